"""W12: loading on a Ray cluster (here a local instance), against Ray Data, torch and local gloader on the same CPUs.

A local Ray instance is started with this machine's usable CPUs (and a 1 GiB object store).
On W3 (CPU-bound) and W8 (JPEG decode and augmentation) each round times, in turns:
gloader on Ray (`RayPool(2)`: two actors of one CPU), Ray Data the way its training docs
show it (`ray.data.range(n).map_batches(...)`, then `iter_torch_batches`; no global shuffle,
which only favours it), torch's DataLoader and gloader with two local workers. Reported per
loader: samples/s and the caller's CPU time per batch (its thread's, during the timed batches).

Then the receive bound: one caller taking W2 images in batches of 16 (2.4 MB) from
`RayPool(2)`, in GB/s and the caller's CPU time per batch, beside local gloader: the rate at
which one trainer can take batches from remote CPUs, whatever their number. The scale-out
model (`scale_out`) follows from these figures. Skipped when Ray is not installed.

`python -m gloader.bench.receive` measures the receive bound alone, for several counts of actors.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

import gloader

from .datasets import ImageDataset
from .figures import summary, three_digits

__all__ = ["W3_SAMPLES", "WORKERS", "has_ray", "measure_ray", "measure_receive", "ray_summary", "report_ray", "scale_out",
           "start_ray"]

WORKERS = 2
_OBJECT_STORE_BYTES = 1 << 30
# W2 batches through Ray's object store: 16 images of 224x224x3 (2.4 MB), and an epoch's batches.
_RECEIVE_BATCH = 16
_RECEIVE_BATCHES = 300
# W3's epoch here (samples): ~3 s at the two CPUs' rate.
W3_SAMPLES = 6400
_LOADERS = ("gloader on Ray", "Ray Data", "torch", "gloader local")


def has_ray() -> bool:
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError:
        return False
    return True


class RayDataLoop:
    """Ray Data as its docs show for training: `map_batches` loads each batch's samples (the
    same `dataset[i]` as every loader), `iter_torch_batches` hands torch tensors to the caller.
    One pass over the dataset per `iter()`."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        import ray.data

        def load(ids: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            samples = [dataset[int(index)] for index in ids["id"]]
            first = samples[0]
            if isinstance(first, tuple):
                return {f"f{k}": np.stack([np.asarray(sample[k]) for sample in samples]) for k in range(len(first))}
            return {"f0": np.stack([np.asarray(sample) for sample in samples])}

        self._batch_size = batch_size
        self._data = ray.data.range(len(dataset)).map_batches(load, batch_size=batch_size)

    def __iter__(self) -> Any:
        return iter(self._data.iter_torch_batches(batch_size=self._batch_size))


def _makers(dataset: Any, batch_size: int, workers: int = WORKERS) -> dict[str, Callable[[], Any]]:
    return {
        "gloader on Ray": lambda: gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0,
                                                     pool=gloader.RayPool(workers)),
        "Ray Data": lambda: RayDataLoop(dataset, batch_size),
        "torch": lambda: torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                                     num_workers=WORKERS, persistent_workers=True),
        "gloader local": lambda: gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0,
                                                    num_workers=workers),
    }


def _timed(loader: Any) -> tuple[int, float, float]:
    """(batches, seconds, caller CPU seconds) of one whole epoch, after an untimed one. Whole
    epochs, from iter() to the end: Ray Data runs ahead without bound while the caller is
    slower (its first 20 batches, untimed, left the next 10 read at 20x the CPUs' rate), and
    starts its pipeline anew at each iter(), which training pays every epoch."""
    for _ in loader:
        pass
    batches = 0
    start, cpu = time.perf_counter(), time.thread_time()
    for batch in loader:
        del batch
        batches += 1
    return batches, time.perf_counter() - start, time.thread_time() - cpu


def _close(loader: Any) -> None:
    close = getattr(loader, "close", None)
    if close is not None:
        close()


def _measure(makers: dict[str, Callable[[], Any]], batch_size: int, rounds: int, step: Callable[[str], None],
             label: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: {"samples_per_s": [], "caller_ms": []} for name in makers}
    names = list(makers)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            loader = makers[name]()
            try:
                batches, seconds, cpu = _timed(loader)
            finally:
                _close(loader)
                del loader
            out[name]["samples_per_s"].append(batches * batch_size / seconds)
            out[name]["caller_ms"].append(cpu / batches * 1e3)
            step(f"W12 {label} round {r + 1} {name}")
    return out


def measure_receive(rounds: int, quick: bool, step: Callable[[str], None], workers: int = WORKERS) -> dict[str, Any]:
    """W2 batches of 2.4 MB from RayPool(workers) and from local gloader with as many workers:
    GB/s and caller ms per batch."""
    dataset = ImageDataset(_RECEIVE_BATCH * (_RECEIVE_BATCHES // 10 if quick else _RECEIVE_BATCHES))
    nbytes = _RECEIVE_BATCH * 224 * 224 * 3
    makers = {name: maker for name, maker in _makers(dataset, _RECEIVE_BATCH, workers).items()
              if name in ("gloader on Ray", "gloader local")}
    got = _measure(makers, _RECEIVE_BATCH, rounds, step, "W2 receive")
    return {name: {"gb_per_s": [rate / _RECEIVE_BATCH * nbytes / 1e9 for rate in res["samples_per_s"]],
                   "caller_ms": res["caller_ms"]} for name, res in got.items()} | {"batch_mb": nbytes / 1e6}


def measure_ray(datasets: dict[str, tuple[Any, int]], quick: bool, rounds: int,
                step: Callable[[str], None]) -> dict[str, Any]:
    """W12: `datasets` maps a workload (W3, W8) to (dataset, batch size); each loader is timed
    over a whole epoch of it, after an untimed one."""
    if not has_ray():
        return {"skipped": "Ray is not installed (pip install 'gloader[ray]')"}
    import ray

    cpus, started_here = start_ray()
    try:
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = False
        out: dict[str, Any] = {"cpus": cpus}
        for name, (dataset, batch_size) in datasets.items():
            out[name] = _measure(_makers(dataset, batch_size), batch_size, rounds, step, name)
        out["receive"] = measure_receive(rounds, quick, step)
        return out
    finally:
        if started_here:
            ray.shutdown()


def start_ray() -> tuple[int, bool]:
    """(this machine's usable CPUs, whether Ray was started here): a local instance with
    those CPUs and a 1 GiB object store, unless Ray is initialized already."""
    import ray

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=cpus, object_store_memory=_OBJECT_STORE_BYTES, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    return cpus, started_here


def scale_out(results: dict[str, Any], workload: str, nodes: int) -> float | None:
    """Samples/s that `nodes` nodes like this one would deliver to one caller on `workload`:
    nodes x this node's gloader-on-Ray rate, up to the receive bound (the W2 GB/s one caller
    took, over the workload's batch bytes; None when W12 did not run)."""
    res = results.get("W12")
    if not res or "skipped" in res or workload not in res:
        return None
    per_node = statistics.median(res[workload]["gloader on Ray"]["samples_per_s"])
    bound_gb = statistics.median(res["receive"]["gloader on Ray"]["gb_per_s"])
    sample_bytes = {"W3": 64 * 4 + 8, "W8": 3 * 224 * 224 * 4 + 8}[workload]
    return float(min(nodes * per_node, bound_gb * 1e9 / sample_bytes))


def report_ray(results: dict[str, Any]) -> list[str]:
    res = results.get("W12")
    if res is None:
        return []
    if "skipped" in res:
        return ["", f"W12 skipped: {res['skipped']}"]
    lines = ["", f"W12 on a local Ray instance with {res['cpus']} CPUs, {WORKERS} workers each: samples/s "
             "(over gloader on Ray in parentheses) and the caller's CPU ms per batch", "",
             "| workload | " + " | ".join(_LOADERS) + " |", "|---|" + "---|" * len(_LOADERS)]
    for name in ("W3", "W8"):
        if name not in res:
            continue
        ray_rates = res[name]["gloader on Ray"]["samples_per_s"]
        cells = []
        for loader in _LOADERS:
            rates = res[name][loader]["samples_per_s"]
            ratio = statistics.median(r / g for r, g in zip(ray_rates, rates))
            cells.append(f"{summary(rates)} (**{ratio:.2f}x**), {three_digits(statistics.median(res[name][loader]['caller_ms']))} ms")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    receive = res["receive"]
    lines += ["", f"| W12 receive: W2 batches of {receive['batch_mb']:.1f} MB, one caller | GB/s | caller CPU ms "
              "per batch |", "|---|---|---|"]
    for loader in ("gloader on Ray", "gloader local"):
        lines.append(f"| {loader} | {summary(receive[loader]['gb_per_s'])} | {summary(receive[loader]['caller_ms'])} |")
    model = [f"{name}: " + ", ".join(f"{nodes} nodes {three_digits(rate)}" for nodes in (1, 4, 16, 64)
                                      if (rate := scale_out(results, name, nodes)) is not None)
             for name in ("W3", "W8") if name in res]
    if model:
        lines += ["", "Scale-out model, samples/s one caller would take (nodes x this node's gloader-on-Ray rate, "
                  "up to the receive bound; see docs/guide/ray.md): " + "; ".join(model)]
    return lines


def ray_summary(results: dict[str, Any]) -> str | None:
    """W12 in one README summary row, or None when it did not run."""
    res = results.get("W12")
    if not res or "skipped" in res:
        return None
    cells = [f"{name} {statistics.median(r / d for r, d in zip(res[name]['gloader on Ray']['samples_per_s'], res[name]['Ray Data']['samples_per_s'])):.2f}x"
             for name in ("W3", "W8") if name in res]
    receive = statistics.median(res["receive"]["gloader on Ray"]["gb_per_s"])
    return f"W12 gloader on Ray / Ray Data, same CPUs | {', '.join(cells)}; one caller receives {receive:.2f} GB/s"
