"""The benchmark's workloads and the loaders it measures on them (see `gloader.bench.cli` for
the method): each workload's dataset, batch size and batches, each peer's loader made the
same way for every workload, and W8's JPEGs, written once into a cache and reused by later runs.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import sys
from typing import Any, Callable

import numpy as np
import torch

import gloader

from .datasets import (
    BatchedTable,
    CpuBoundDataset,
    ImageDataset,
    JpegFolder,
    TinyDataset,
    has_huggingface_datasets,
    has_pillow,
    huggingface_table,
    write_jpeg_folder,
)
from .peers import BatchingFloor, ComputeCeiling, InProcessLoop, TensorpackLoop

__all__ = ["PEERS", "SCALING", "SCALING_WORKERS", "STOPS", "STOP_AFTER", "WORKERS", "Workload", "close_loader",
           "gloader_loader", "jpeg_cache", "machine", "make_loader", "make_workloads", "torch_loader"]

# Workers of every loader but those whose count is what is measured (scaling, nw=1, 'auto').
WORKERS = 2

# W8's ImageFolder: JPEGs written for a full run, and at least this many for --quick (~2 ms each).
_JPEGS = 2000
_QUICK_JPEGS = 256

# Peers measured beside gloader (nw=2) and torch (nw=2, persistent workers), per workload.
PEERS = {"W1": ("in-process", "gloader nw=1", "tensorpack", "floor", "ceiling", "gloader auto"),
         "W2": ("in-process", "gloader nw=1", "tensorpack"),
         "W3": ("in-process", "gloader nw=1", "ceiling", "gloader auto"), "W8": ("ceiling", "gloader auto")}
SCALING = ("W3", "W8")
SCALING_WORKERS = (1, 2, 4)
# W4's stopped epochs: each stopped after this many of its 12 batches (the rest in flight are
# dropped), this many times a round.
STOP_AFTER = 6
STOPS = 8


@dataclasses.dataclass
class Workload:
    name: str
    title: str
    make: Callable[[], Any]
    batch_size: int
    sample_bytes: int
    batches: int  # per round and loader
    warm: int  # batches each new loader serves untimed before its timed ones


def gloader_loader(dataset: Any, batch_size: int, workers: int = WORKERS) -> Any:
    return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, seed=0)


def torch_loader(dataset: Any, batch_size: int, workers: int = WORKERS) -> Any:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       persistent_workers=True)


def make_loader(name: str, dataset: Any, batch_size: int) -> Any:
    if name == "gloader":
        return gloader_loader(dataset, batch_size)
    if name == "torch":
        return torch_loader(dataset, batch_size)
    if name == "gloader nw=1":
        return gloader_loader(dataset, batch_size, 1)
    if name == "gloader auto":
        return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers="auto", seed=0)
    if name == "in-process":
        return InProcessLoop(dataset, batch_size)
    if name == "ceiling":
        return ComputeCeiling(dataset, batch_size, WORKERS)
    if name == "floor":
        return BatchingFloor(dataset, batch_size, WORKERS)
    return TensorpackLoop(dataset, batch_size, WORKERS)


def close_loader(loader: Any) -> None:
    close = getattr(loader, "close", None)  # torch's DataLoader has none: its workers end with it
    if close is not None:
        close()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """What the figures were measured on: the CPU, how many CPUs this process may use, the
    system and the versions that matter (runs on different machines differ by far more than
    rounds of one run)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{_cpu_model()}, {cpus} CPUs usable; {platform.system()} {platform.release()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
            f"gloader {gloader.__version__}")


def make_workloads(size: int, scale: float, only: set[str] | None, results: dict[str, Any]) -> list[Workload]:
    """The workloads to run (all, or those in `only`), W8's batches and the others' scaled by
    `scale`; one skipped for a missing package is said so in `results`."""
    def jpegs() -> Any:
        count = max(_QUICK_JPEGS, int(_JPEGS * scale))  # --quick: a few batches, no need for 2,000 files
        return JpegFolder(jpeg_cache(count))

    workloads = [
        Workload("W1", "tiny float32[16]+int, batch 256", lambda: TinyDataset(200_000), 256, 16 * 4 + 8,
                 int(1000 * scale) or 100, 160),
        Workload("W2", "images uint8 224x224x3+int, batch 64", lambda: ImageDataset(20_000), 64,
                 224 * 224 * 3 + 8, int(400 * scale) or 40, 150 if scale == 1.0 else 15),
        Workload("W3", "CPU-bound ~0.5 ms/sample, batch 32", lambda: CpuBoundDataset(20_000, size), 32, 64 * 4 + 8,
                 int(100 * scale) or 10, 20),
        # --quick: as many untimed batches as the scaling table's most workers load at once, and
        # more: with 2, four workers had loaded the timed batches while the warm ones were taken
        # (torch nw=4 once read 5,450 samples/s, 15x nw=2).
        Workload("W8", "ImageFolder JPEGs, decode + crop/flip/normalize, batch 64", jpegs, 64,
                 3 * 224 * 224 * 4 + 8, int(24 * scale) or 3, 32 if scale == 1.0 else 2 * max(SCALING_WORKERS)),
        Workload("W9", "HuggingFace datasets table (torch format), batch 256", lambda: huggingface_table(50_000),
                 256, 64 * 4 + 8, int(150 * scale) or 15, 4),
        Workload("W10", "numpy table with a plain __getitems__, batch 256", lambda: BatchedTable(50_000), 256,
                 64 * 4 + 8, int(150 * scale) or 15, 4),
    ]
    if only is not None:
        workloads = [w for w in workloads if w.name in only]
    for name, present, message in (
            ("W8", has_pillow, "Pillow is not installed (pip install pillow)"),
            ("W9", has_huggingface_datasets, "the datasets package is not installed (pip install datasets)")):
        if any(w.name == name for w in workloads) and not present():
            workloads = [w for w in workloads if w.name != name]
            results[name] = {"skipped": message}
    return workloads



def jpeg_cache(count: int) -> str:
    """A folder of W8's `count` JPEGs, written the first time (they are the same every time) into
    the user's cache (`$XDG_CACHE_HOME/gloader/bench`, else `~/.cache/gloader/bench`) and reused:
    a run stopped while it measures leaves nothing in the temp directory. A folder is written
    beside its final name and renamed when whole; what a run stopped while writing left is
    removed by the next."""
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gloader", "bench")
    final = os.path.join(cache, f"jpegs-{count}")
    if os.path.isdir(final):
        return final
    os.makedirs(cache, exist_ok=True)
    for name in os.listdir(cache):
        if name.startswith(f"jpegs-{count}.") and name.endswith(".partial"):
            shutil.rmtree(os.path.join(cache, name), ignore_errors=True)
    partial = os.path.join(cache, f"jpegs-{count}.{os.getpid()}.partial")
    sys.stderr.write(f"W8: writing {count:,} JPEGs into {final} (once; later runs reuse them) ...\n")
    write_jpeg_folder(partial, count)
    try:
        os.rename(partial, final)
    except OSError:  # another run finished the same folder first
        shutil.rmtree(partial, ignore_errors=True)
    return final
