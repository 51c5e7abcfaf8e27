"""num_workers='auto' with validation passes between epochs, against fixed worker counts.

A trainer validates between epochs: the training loader sits idle while another loader runs.
Each round builds, for every training loader in turn (gloader with 1, 2 and 4 workers, and
with num_workers='auto'), that loader and a validation loader (gloader, one worker, the same
data), then runs `epochs` epochs of the training loader with a validation pass of `val_batches`
batches after each. Timed: the training epochs after the first (the first lets 'auto' start)
with the pass after each (the training workers fill the next epoch during it, at the
validation's expense). Reported: training samples/s; 'auto' over the best fixed count (the one
with the highest median), round by round, and over each round's fastest count (a maximum of
three noisy figures, so below 1 even for a loader equal to the best); and the count 'auto'
ended with. The workloads are W3 (CPU-bound samples) and W8 (JPEG decode and augmentation),
where a worker too few costs most.
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


def _validate(loader: gloader.DataLoader[Any], batches: int) -> None:
    """Take `batches` batches of `loader` (whole epochs and a part of one), as a validation pass."""
    while batches > 0:
        for _ in loader:
            batches -= 1
            if batches == 0:
                break


def _one_run(name: str, dataset: Any, batch_size: int, epochs: int, val_batches: int
             ) -> tuple[float, int | None, float]:
    """Training samples/s of `name` over epochs 2..`epochs` with the validation passes after
    them included, the worker count it ended with, and the passes' samples/s (the training
    loader's workers fill its next epoch meanwhile: what they take from validation shows there)."""
    timed_s, samples, validated_s = 0.0, 0, 0.0
    val: gloader.DataLoader[Any] = gloader.DataLoader(dataset, batch_size=batch_size, num_workers=1)
    with _training(name, dataset, batch_size) as train, val:
        for epoch in range(epochs):
            started = time.perf_counter()
            count = sum(len(batch[1]) for batch in train)
            trained = time.perf_counter()
            _validate(val, val_batches)
            if epoch > 0:
                timed_s += time.perf_counter() - started
                validated_s += time.perf_counter() - trained
                samples += count
        count_now = train.stats()["workers"]["count"] if name.endswith("auto") else None
    gc.collect()
    return samples / timed_s, count_now, val_batches * batch_size * (epochs - 1) / validated_s


def measure_gaps(workloads: dict[str, tuple[Any, int, int, int]], quick: bool, rounds: int,
                 step: Callable[[str], None]) -> dict[str, Any]:
    """For each workload name -> (dataset, batch size, batches an epoch, batches a validation
    pass): every loader of GAP_LOADERS, round by round, the order turning each round (--quick,
    a check rather than a figure: a tenth of the batches and one timed epoch)."""
    epochs = 2 if quick else 4
    results: dict[str, Any] = {"epochs": epochs}
    for work, (dataset, batch_size, batches, val_batches) in workloads.items():
        batches, val_batches = (max(4, batches // 10), max(2, val_batches // 10)) if quick else (batches, val_batches)
        data = Head(dataset, batches * batch_size)
        rates: dict[str, list[float]] = {name: [] for name in GAP_LOADERS}
        validation: dict[str, list[float]] = {name: [] for name in GAP_LOADERS}
        counts: list[int] = []
        names = list(GAP_LOADERS)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                rate, count, validation_rate = _one_run(name, data, batch_size, epochs, val_batches)
                rates[name].append(rate)
                validation[name].append(validation_rate)
                if count is not None:
                    counts.append(count)
                step(f"{work} with validation passes, round {r + 1} {name}")
        fastest = [max(rates[name][r] for name in GAP_LOADERS[:-1]) for r in range(rounds)]
        best = max(GAP_LOADERS[:-1], key=lambda name: statistics.median(rates[name]))
        results[work] = {"samples_per_s": rates, "best": best,
                         "auto_over_best": [a / b for a, b in zip(rates["gloader auto"], rates[best])],
                         "auto_over_fastest": [a / b for a, b in zip(rates["gloader auto"], fastest)],
                         "auto_workers": counts, "batches": batches, "val_batches": val_batches,
                         "validation_per_s": validation}
    return results


def report_gaps(results: dict[str, Any]) -> list[str]:
    gaps = results.get("gaps")
    if not gaps:
        return []
    works = [name for name in gaps if name.startswith("W")]
    passes = ", ".join(f"{work} {gaps[work]['batches']} batches an epoch and {gaps[work].get('val_batches', '?')} a "
                       "pass" for work in works)
    timed = "epoch 2" if gaps["epochs"] == 2 else f"epochs 2-{gaps['epochs']}"
    lines = ["", "num_workers='auto' with a validation pass after every epoch (another gloader loader, one worker, "
             f"takes its batches while the training loader waits; {passes}); training samples/s over {timed}, "
             "the passes' time included, median (min-max)", "",
             "| workload | " + " | ".join(GAP_LOADERS) + " | auto / the best fixed count, per round | "
             "auto / each round's fastest fixed count | auto ended with |",
             "|---|" + "---|" * (len(GAP_LOADERS) + 3)]
    for work in works:
        got = gaps[work]
        counts = got["auto_workers"]
        ended = f"{statistics.median(counts):g} ({min(counts)}-{max(counts)}) workers" if counts else ""
        best = f"**{summary(got['auto_over_best'])}x** ({got['best'].split()[-1]})"
        lines.append(f"| {work} | " + " | ".join(summary(got["samples_per_s"][name]) for name in GAP_LOADERS)
                     + f" | {best} | {summary(got['auto_over_fastest'])}x | {ended} |")
    for work in works:
        beside = gaps[work]["validation_per_s"]
        lines += ["", f"{work}: the validation loader's samples/s during the passes, beside "
                  + ", ".join(f"{name} {summary(beside[name]).strip()}" for name in GAP_LOADERS)]
    return lines
