"""num_workers='auto' with validation passes between epochs, against fixed worker counts.

A trainer validates between epochs: the training loader sits idle while another loader runs.
Each round builds, for every training loader in turn (gloader with 1, 2 and 4 workers, and
with num_workers='auto'), that loader and a validation loader (gloader, one worker, the same
data), then runs `epochs` epochs of the training loader with a validation pass of `gap_s`
seconds after each. Timed: the training epochs after the first (the first lets 'auto' start;
the validation passes are not timed). Reported: training samples/s, 'auto' over the best
fixed count of the same rounds, and the count 'auto' ended with. The workloads are W3
(CPU-bound samples) and W8 (JPEG decode and augmentation), where a worker too few costs most.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import gloader

from .figures import summary

__all__ = ["GAP_LOADERS", "measure_gaps", "report_gaps"]

GAP_LOADERS = ("gloader nw=1", "gloader nw=2", "gloader nw=4", "gloader auto")


class Head:
    """The first `length` samples of `dataset`, wrapping around: an epoch of a chosen size."""

    def __init__(self, dataset: Any, length: int) -> None:
        self.dataset = dataset
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index % len(self.dataset)]


def _training(name: str, dataset: Any, batch_size: int) -> gloader.DataLoader[Any]:
    workers: Any = "auto" if name.endswith("auto") else int(name.rsplit("=", 1)[1])
    return gloader.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, seed=0)


def _validate(loader: gloader.DataLoader[Any], seconds: float) -> None:
    """Iterate `loader` for `seconds` (whole epochs and a part of one), as a validation pass."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in loader:
            if time.perf_counter() >= end:
                break


def _one_run(name: str, dataset: Any, batch_size: int, epochs: int, gap_s: float) -> tuple[float, int | None]:
    """Training samples/s of `name` over epochs 2..`epochs`, and the worker count it ended with."""
    timed_s, samples = 0.0, 0
    val: gloader.DataLoader[Any] = gloader.DataLoader(dataset, batch_size=batch_size, num_workers=1)
    with _training(name, dataset, batch_size) as train, val:
        for epoch in range(epochs):
            started = time.perf_counter()
            count = sum(len(batch[1]) for batch in train)
            if epoch > 0:
                timed_s += time.perf_counter() - started
                samples += count
            _validate(val, gap_s)
        count_now = train.stats()["workers"]["count"] if name.endswith("auto") else None
    gc.collect()
    return samples / timed_s, count_now


def measure_gaps(workloads: dict[str, tuple[Any, int, int]], quick: bool, rounds: int,
                 step: Callable[[str], None]) -> dict[str, Any]:
    """For each workload name -> (dataset, batch size, batches an epoch): every loader of
    GAP_LOADERS, round by round, the order turning each round (--quick: a quarter of the batches)."""
    epochs, gap_s = (3, 1.5) if quick else (4, 3.0)
    results: dict[str, Any] = {"epochs": epochs, "gap_s": gap_s}
    for work, (dataset, batch_size, batches) in workloads.items():
        batches = max(4, batches // 4) if quick else batches
        data = Head(dataset, batches * batch_size)
        rates: dict[str, list[float]] = {name: [] for name in GAP_LOADERS}
        counts: list[int] = []
        names = list(GAP_LOADERS)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rate, count = _one_run(name, data, batch_size, epochs, gap_s)
                rates[name].append(rate)
                if count is not None:
                    counts.append(count)
                step(f"{work} with validation passes, round {r + 1} {name}")
        best = [max(rates[name][r] for name in GAP_LOADERS[:-1]) for r in range(rounds)]
        results[work] = {"samples_per_s": rates, "auto_over_best": [a / b for a, b in zip(rates["gloader auto"], best)],
                         "auto_workers": counts, "batches": batches}
    return results


def report_gaps(results: dict[str, Any]) -> list[str]:
    gaps = results.get("gaps")
    if not gaps:
        return []
    works = [name for name in gaps if name.startswith("W")]
    lines = ["", f"num_workers='auto' with a validation pass of {gaps['gap_s']:g} s after every epoch (another "
             f"gloader loader runs while the training loader waits); training samples/s over epochs 2-"
             f"{gaps['epochs']}, median (min-max)", "",
             "| workload | " + " | ".join(GAP_LOADERS) + " | auto / best fixed count, per round | auto ended with |",
             "|---|" + "---|" * (len(GAP_LOADERS) + 2)]
    for work in works:
        got = gaps[work]
        counts = got["auto_workers"]
        ended = f"{statistics.median(counts):g} ({min(counts)}-{max(counts)}) workers" if counts else ""
        lines.append(f"| {work} | " + " | ".join(summary(got["samples_per_s"][name]) for name in GAP_LOADERS)
                     + f" | **{summary(got['auto_over_best'])}x** | {ended} |")
    return lines
