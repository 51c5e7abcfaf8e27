"""W5, a dataset held once (`python -m gloader.bench --workloads W5`): what a dataset of
Python objects costs each worker, gloader and torch's DataLoader side by side.

Three stores of the same records (a float, an int and a short string each): a `list of dicts`,
a `dict of lists` (one list per field) and `numpy` arrays. torch's loader gets them as they
are; gloader's gets the list of dicts as a `gloader.SimpleDataset` (held once by itself; under
spawn, beside the array, in a dataset of its own as a `gloader.SharedList`) and the dict of
lists with each list a `gloader.SharedList` (the one-line fix its warning names).
- fork: each worker's USS growth (memory no other process shares) over two epochs, from the
  first batch: reading a Python object writes its reference count, so a page of objects a
  worker reads is copied into it.
- spawn: the first batch's time from iter() and the workers' USS after it, with a 64 MB numpy
  array beside the records, for 2 and 4 workers; and the same for a dataset of 1,000 ints, what
  starting the processes alone costs (interpreter, torch).
- forkserver: the same for the list of dicts and the ints, 2 workers (gloader's fork server has
  imported gloader and torch, so its workers share those pages; torch's, as shipped, has not).
Every figure comes from a fresh process (`--one`), so that no run inherits another's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

import gloader

__all__ = ["held_runs", "measure_held", "report_held"]

_MB = 1 << 20
STORES = ("list of dicts", "dict of lists", "numpy")
_FORKSERVER_STORES = ("list of dicts", "ints")


def _records(length: int) -> list[dict[str, Any]]:
    return [{"x": float(i), "y": i % 10, "name": f"record {i}"} for i in range(length)]


def _as_array(record: dict[str, Any]) -> np.ndarray:
    return np.array([record["x"], record["y"], len(record["name"])], dtype=np.float32)


class Store(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Records in one of the three stores (`shared`: the dict of lists' lists as SharedLists),
    with `array_mb` of numpy beside them; sample i: its record's fields as float32[3]."""

    def __init__(self, store: str, length: int, shared: bool, array_mb: int) -> None:
        self.store = store
        self.length = length
        records = _records(length) if store != "numpy" else []
        if store == "list of dicts":
            self.records: Any = gloader.SharedList(records) if shared else records
        elif store == "dict of lists":
            columns = {key: [r[key] for r in records] for key in ("x", "y", "name")}
            self.columns: Any = {key: gloader.SharedList(v) if shared else v for key, v in columns.items()}
        else:
            self.x = np.arange(length, dtype=np.float64)
            self.y = self.x.astype(np.int64) % 10
            self.name_lengths = np.array([len(f"record {i}") for i in range(length)], dtype=np.int64)
        self.array = np.ones(array_mb * _MB // 4, dtype=np.float32)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        extra = self.array[i % len(self.array)] if len(self.array) else 0.0
        if self.store == "list of dicts":
            return _as_array(self.records[i]) + extra
        if self.store == "dict of lists":
            c = self.columns
            return np.array([c["x"][i], c["y"][i], len(c["name"][i])], dtype=np.float32) + extra
        return np.array([self.x[i], self.y[i], self.name_lengths[i]], dtype=np.float32) + extra


def _dataset(store: str, loader: str, length: int, array_mb: int) -> Any:
    if store == "ints":
        return list(range(1000))
    if store == "list of dicts" and loader == "gloader" and not array_mb:  # gloader's own: held once by itself
        return gloader.SimpleDataset(_records(length)).transform(_as_array)
    return Store(store, length, loader == "gloader", array_mb)


def _uss(pids: list[int]) -> list[float]:
    import psutil

    return [psutil.Process(pid).memory_full_info().uss / _MB for pid in pids]


def _one(mode: str, store: str, loader: str, workers: int, length: int) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    array_mb = 64 if mode != "fork" and store != "ints" else 0
    dataset = _dataset(store, loader, length, array_mb)
    started = time.perf_counter()
    if loader == "gloader":
        made: Any = gloader.DataLoader(dataset, batch_size=256, num_workers=workers, start_method=mode)
        iterator = iter(made)
        next(iterator)
        pids = made.worker_pids()
    else:
        made = torch.utils.data.DataLoader(dataset, batch_size=256, num_workers=workers, persistent_workers=True,
                                           multiprocessing_context=mode)
        iterator = iter(made)
        next(iterator)
        pids = [worker.pid for worker in iterator._workers]
    first_s = time.perf_counter() - started
    before = _uss(pids)
    if mode == "fork":
        for _ in iterator:
            pass
        for _ in made:
            pass
    after = _uss(pids)
    if loader == "gloader":
        made.close()
    return {"first_s": first_s, "uss_mb": after, "growth_mb": [a - b for a, b in zip(after, before)]}


def _run_one(mode: str, store: str, loader: str, workers: int, length: int) -> dict[str, Any]:
    spec = json.dumps([mode, store, loader, workers, length])
    done = subprocess.run([sys.executable, "-m", "gloader.bench.held", "--one", spec], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        raise RuntimeError(f"W5 {spec} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def held_runs(quick: bool) -> int:
    """How many measurements (fresh processes) `measure_held` makes."""
    return len(STORES) * 2 + (1 if quick else 2) * (len(STORES) + 1) * 2 + len(_FORKSERVER_STORES) * 2


def measure_held(quick: bool, step: Any = None) -> dict[str, Any]:
    """W5's figures: fork growth per store and loader (2 workers); spawn start-up per store,
    loader and worker count, with the processes' own start ('ints') beside; forkserver's for the
    list of dicts and the ints (2 workers)."""
    length = 50_000 if quick else 500_000
    out: dict[str, Any] = {"length": length, "fork": {}, "spawn": {}, "forkserver": {}}
    for store in STORES:
        for loader in ("gloader", "torch"):
            out["fork"][f"{store}|{loader}"] = _run_one("fork", store, loader, 2, length)
            if step:
                step(f"W5 fork {store} {loader}")
    for workers in ((2,) if quick else (2, 4)):
        for store in (*STORES, "ints"):
            for loader in ("gloader", "torch"):
                out["spawn"][f"{store}|{loader}|{workers}"] = _run_one("spawn", store, loader, workers, length)
                if step:
                    step(f"W5 spawn {store} {loader} {workers} workers")
    for store in _FORKSERVER_STORES:
        for loader in ("gloader", "torch"):
            out["forkserver"][f"{store}|{loader}|2"] = _run_one("forkserver", store, loader, 2, length)
            if step:
                step(f"W5 forkserver {store} {loader}")
    return out


def report_held(results: dict[str, Any]) -> list[str]:
    """Markdown lines for W5."""
    if "W5" not in results or "fork" not in results["W5"]:
        return []
    w5 = results["W5"]
    lines = ["", f"| W5 {w5['length']:,} records, fork, 2 workers, 2 epochs | gloader USS growth per worker, MB | "
             "torch USS growth per worker, MB | gloader / torch |", "|---|---|---|---|"]
    for store in STORES:
        gl, th = (w5["fork"][f"{store}|{loader}"]["growth_mb"] for loader in ("gloader", "torch"))
        ratio = sum(gl) / sum(th) if sum(th) > 0 else float("nan")
        lines.append(f"| {store} | {', '.join(f'{v:.0f}' for v in gl)} | {', '.join(f'{v:.0f}' for v in th)} | "
                     f"{ratio:.2f}x |")
    for mode in ("spawn", "forkserver"):
        if w5.get(mode):
            lines += _start_up_table(mode, w5["length"], w5[mode])
    return lines


def _start_up_table(mode: str, length: int, runs: dict[str, Any]) -> list[str]:
    lines = ["", f"| W5 {mode}, {length:,} records + a 64 MB array | workers | gloader first batch, s | "
             "torch first batch, s | gloader / torch | gloader workers' USS, MB | torch workers' USS, MB |",
             "|---|---|---|---|---|---|---|"]
    for key in runs:
        store, loader, workers = key.split("|")
        if loader != "gloader":
            continue
        gl, th = runs[key], runs[f"{store}|torch|{workers}"]
        label = "1,000 ints (starting the processes alone)" if store == "ints" else store
        lines.append(f"| {label} | {workers} | {gl['first_s']:.2f} | {th['first_s']:.2f} | "
                     f"{gl['first_s'] / th['first_s']:.2f}x | {sum(gl['uss_mb']):.0f} | {sum(th['uss_mb']):.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", required=True, help="[mode, store, loader, workers, length] as JSON")
    mode, store, loader, workers, length = json.loads(parser.parse_args().one)
    sys.stdout.write(json.dumps(_one(mode, store, loader, workers, length)) + "\n")


if __name__ == "__main__":
    main()
