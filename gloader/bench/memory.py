"""W6 of the benchmark (`python -m gloader.bench --workloads W6`; W5, a dataset held once, is
`gloader.bench.held`).

W6 shared pool: train and val loaders on one `WorkerPool` versus a pool each (spawn, where
    every worker holds its own copy of the datasets and of the interpreter): total USS of
    the worker processes after one epoch of each.
"""
from __future__ import annotations

from typing import Any

import numpy as np

import gloader

__all__ = ["ArrayRecords", "measure_shared_pool", "report_memory"]

_MB = 1 << 20


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
    """Markdown lines for W6."""
    if "W6" not in results:
        return []
    w6 = results["W6"]
    return ["", f"| W6 train+val ({w6['dataset_mb']:.0f} MB of arrays), spawn, 2 workers per pool | "
            "total worker USS, MB |", "|---|---|",
            f"| one shared WorkerPool (2 processes) | {w6['shared_mb']:.0f} |",
            f"| a pool per loader (4 processes) | {w6['separate_mb']:.0f} |"]
