"""Memory workloads of the benchmark (`python -m gloader.bench --workloads W5,W6`).

W5 copy-on-write: a dataset of many small Python objects (a list of dicts) versus the same
    data in numpy arrays. Forked workers share the caller's pages until they write to them,
    and merely reading a Python object writes its reference count, so every page of objects
    a worker touches is copied. The report gives each worker's USS (memory no other process
    shares) growth over one epoch, for gloader and torch's DataLoader side by side.
W6 shared pool: train and val loaders on one `WorkerPool` versus a pool each (spawn, where
    every worker holds its own copy of the datasets and of the interpreter): total USS of
    the worker processes after one epoch of each.
"""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

import gloader

__all__ = ["DictRecords", "ArrayRecords", "measure_copy_on_write", "measure_shared_pool"]

_MB = 1 << 20


class DictRecords:
    """Sample i comes from a list of `length` dicts of Python numbers (the costly layout)."""

    def __init__(self, length: int) -> None:
        self.records = [{"x": float(i), "y": i % 10} for i in range(length)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, idx: int) -> Any:
        record = self.records[idx]
        return np.array([record["x"], record["y"]], dtype=np.float32)


class ArrayRecords:
    """The same data in two numpy arrays (the recommended layout)."""

    def __init__(self, length: int) -> None:
        self.x = np.arange(length, dtype=np.float64)
        self.y = np.arange(length, dtype=np.int64) % 10

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, idx: int) -> Any:
        return np.array([self.x[idx], self.y[idx]], dtype=np.float32)


def _uss_mb(pids: list[int]) -> list[float]:
    import psutil

    return [psutil.Process(pid).memory_full_info().uss / _MB for pid in pids]


def _growth(loader: Any, pids_of: Any) -> list[float]:
    """USS growth (MB) per worker from the first batch to the end of one epoch."""
    it = iter(loader)
    next(it)
    pids = pids_of()
    before = _uss_mb(pids)
    for _ in it:
        pass
    after = _uss_mb(pids)
    return [a - b for a, b in zip(after, before)]


def measure_copy_on_write(quick: bool) -> dict[str, Any]:
    """W5: per-worker USS growth over one epoch, objects vs numpy, gloader vs torch (fork)."""
    import psutil

    length = 200_000 if quick else 1_000_000
    out: dict[str, Any] = {"length": length}
    for name, make in (("objects", DictRecords), ("numpy", ArrayRecords)):
        dataset: Any = make(length)
        with gloader.DataLoader[Any](dataset, batch_size=1024, shuffle=True, num_workers=2,
                                     start_method="fork") as loader:
            gl = _growth(loader, loader.worker_pids)
        before_children = {p.pid for p in psutil.Process().children()}
        tl: Any = torch.utils.data.DataLoader(dataset, batch_size=1024, shuffle=True, num_workers=2,
                                         persistent_workers=True, multiprocessing_context="fork")
        th = _growth(tl, lambda known=before_children: [p.pid for p in psutil.Process().children()
                                                        if p.pid not in known])
        del tl
        out[name] = {"gloader": gl, "torch": th}
        del dataset
    return out


def _pool_uss(loaders: list[Any], pids_of: Any) -> float:
    for loader in loaders:
        for _ in loader:
            pass
    return sum(_uss_mb(pids_of()))


def measure_shared_pool(quick: bool) -> dict[str, float]:
    """W6: total worker USS (MB), train+val on one shared pool vs one pool each (spawn)."""
    size = 2_000_000 if quick else 8_000_000
    train, val = ArrayRecords(size), ArrayRecords(size // 4)
    with gloader.WorkerPool(2, start_method="spawn") as pool:
        loaders = [gloader.DataLoader[Any](d, batch_size=4096, pool=pool) for d in (train, val)]
        shared = _pool_uss(loaders, pool.worker_pids)
        for loader in loaders:
            loader.close()
    loaders = [gloader.DataLoader(d, batch_size=4096, num_workers=2, start_method="spawn") for d in (train, val)]
    try:
        separate = _pool_uss(loaders, lambda: loaders[0].worker_pids() + loaders[1].worker_pids())
    finally:
        for loader in loaders:
            loader.close()
    return {"dataset_mb": (train.x.nbytes + train.y.nbytes + val.x.nbytes + val.y.nbytes) / _MB,
            "shared_mb": shared, "separate_mb": separate}


def report_memory(results: dict[str, Any]) -> list[str]:
    """Markdown lines for W5 and W6."""
    lines = []
    if "W5" in results:
        w5 = results["W5"]
        lines += ["", f"| W5 copy-on-write, {w5['length']:,} records, fork | gloader USS growth per worker, MB "
                  "| torch USS growth per worker, MB |", "|---|---|---|"]
        for name in ("objects", "numpy"):
            row = w5[name]
            lines.append(f"| {'list of dicts' if name == 'objects' else 'numpy arrays'} | "
                         f"{', '.join(f'{v:.0f}' for v in row['gloader'])} (median "
                         f"{statistics.median(row['gloader']):.0f}) | {', '.join(f'{v:.0f}' for v in row['torch'])} "
                         f"(median {statistics.median(row['torch']):.0f}) |")
    if "W6" in results:
        w6 = results["W6"]
        lines += ["", f"| W6 train+val ({w6['dataset_mb']:.0f} MB of arrays), spawn, 2 workers per pool | "
                  "total worker USS, MB |", "|---|---|",
                  f"| one shared WorkerPool (2 processes) | {w6['shared_mb']:.0f} |",
                  f"| a pool per loader (4 processes) | {w6['separate_mb']:.0f} |"]
    return lines
