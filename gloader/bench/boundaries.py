"""How many module boundaries one `next()` crosses: `python -m gloader.bench.boundaries`.

A structural figure, not a speed one: with `sys.setprofile` in the caller, each call that
enters a module of the loader's package (`gloader`; `torch` for torch's DataLoader, whose
batches are rebuilt by torch's tensor and storage modules) other than the one entered last
counts one change.
One worker, batches of 4 small arrays; `next()` timed twice: with the batch already loaded
(the window full before the call) and while it loads (the call waits for it). The median of
15 calls after 8 warm ones, for gloader and for torch's DataLoader in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

__all__ = ["count_changes", "main"]

_WARM = 8
_COUNTED = 15


class _Small:
    """4-element float32 samples; `delay_s` per sample makes a batch still load at `next()`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> np.ndarray:
        if self.delay_s:
            time.sleep(self.delay_s)
        return np.full(4, index, dtype=np.float32)


def count_changes(step: Callable[[], Any], package: str) -> int:
    """Changes between modules of `package` while `step()` runs in this thread."""
    changes = 0
    last: str | None = None
    prefix = package + "."

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal changes, last
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module != package and not module.startswith(prefix):
            return
        if module != last:
            if last is not None:
                changes += 1
            last = module

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return changes


def _median_changes(batches: Iterator[Any], package: str, loaded: bool) -> float:
    for _ in range(_WARM):
        next(batches)
    counts = []
    for _ in range(_COUNTED):
        if loaded:
            time.sleep(0.05)  # the worker fills the window: the next batch is there before the call
        counts.append(count_changes(lambda: next(batches), package))
    return statistics.median(counts)


def measure() -> dict[str, dict[str, float]]:
    import torch.utils.data

    import gloader

    out: dict[str, dict[str, float]] = {}
    for name, loaded, delay in (("already loaded", True, 0.0), ("while it loads", False, 0.005)):
        dataset: Any = _Small(delay)
        with gloader.DataLoader[Any](dataset, batch_size=4, num_workers=1) as gl:
            got = _median_changes(iter(gl), "gloader", loaded)
        th: Any = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1)
        it: Any = iter(th)
        try:
            theirs = _median_changes(it, "torch", loaded)
        finally:
            it._shutdown_workers()
        out[name] = {"gloader": got, "torch": theirs}
    return out


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    results = measure()
    print("| one next(), 1 worker, batch of 4 small arrays | gloader module changes | torch module changes |")
    print("|---|---|---|")
    for name, got in results.items():
        print(f"| batch {name} | {got['gloader']:g} | {got['torch']:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
