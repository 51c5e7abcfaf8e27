"""W13, what the samplers of a global order cost (`python -m gloader.bench --workloads W13`).

Per batch: drawing the epoch's batches as the loader draws them (no loading), for a plain
`BatchSampler(RandomSampler)`, a `DistributedBatchSampler` over the same order, one over a
`WeightedMixtureSampler` of 3 datasets, and a `TokenBudgetBatchSampler`, as ratios against the
plain one. Per sample: loading W1's tiny samples with 2 workers through the plain sampler and
through a `DistributedBatchSampler`, whose samples are each seeded from their place (the
process-wide generators reseeded before each: a few microseconds a sample), as samples/s and
their ratio. One rank of two throughout; medians over the rounds.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

import gloader
from gloader.sampler import (
    BatchSampler,
    DistributedBatchSampler,
    RandomSampler,
    TokenBudgetBatchSampler,
    WeightedMixtureSampler,
)

from .datasets import TinyDataset
from .figures import summary

__all__ = ["measure_samplers", "report_samplers"]

_SAMPLES = 200_000
_BATCH = 256


def _makers() -> dict[str, Callable[[], Any]]:
    lengths = ((np.arange(_SAMPLES) * 7919) % 120 + 8).tolist()
    return {
        "RandomSampler (plain)": lambda: BatchSampler(RandomSampler(_SAMPLES, seed=0), _BATCH),
        "DistributedBatchSampler": lambda: DistributedBatchSampler(RandomSampler(_SAMPLES, seed=0), _BATCH, 2, 0),
        "WeightedMixtureSampler, 3 datasets": lambda: DistributedBatchSampler(
            WeightedMixtureSampler([_SAMPLES // 2, _SAMPLES // 4, _SAMPLES // 4], [0.5, 0.3, 0.2], seed=0), _BATCH, 2, 0),
        "TokenBudgetBatchSampler": lambda: TokenBudgetBatchSampler(lengths, max_tokens=_BATCH * 64, num_replicas=2,
                                                                   rank=0, seed=0),
    }


def _epoch_batches(sampler: Any) -> int:
    """Draw one epoch's batches as the loader draws them (see `gloader._schedule`); their count."""
    draw = getattr(sampler, "_placed_batches", None) or sampler._index_batches
    return sum(1 for _ in draw())


def measure_samplers(quick: bool, rounds: int) -> dict[str, Any]:
    """Microseconds a batch of each sampler, per round; W1's samples/s through two of them."""
    per_batch: dict[str, list[float]] = {name: [] for name in _makers()}
    for _ in range(rounds):
        for name, make in _makers().items():
            sampler = make()
            started = time.perf_counter()
            count = _epoch_batches(sampler)
            per_batch[name].append((time.perf_counter() - started) / count * 1e6)
    dataset = TinyDataset(_SAMPLES // (10 if quick else 1))
    loaded: dict[str, list[float]] = {"plain": [], "placed": []}
    for round_ in range(rounds):
        for name in (["plain", "placed"] if round_ % 2 == 0 else ["placed", "plain"]):
            order = RandomSampler(len(dataset), seed=0)
            drawn: Any = BatchSampler(order, _BATCH) if name == "plain" else DistributedBatchSampler(order, _BATCH, 2, 0)
            with gloader.DataLoader[Any](dataset, batch_sampler=drawn, num_workers=2, seed=0) as loader:
                next(iter(loader))  # the workers start: not timed
                started = time.perf_counter()
                samples = sum(len(batch[0]) for batch in loader)
                loaded[name].append(samples / (time.perf_counter() - started))
    return {"per_batch_us": per_batch, "loaded": loaded, "batch": _BATCH}


def report_samplers(results: dict[str, Any]) -> list[str]:
    """Markdown lines for W13."""
    if "W13" not in results:
        return []
    w13 = results["W13"]
    plain = w13["per_batch_us"]["RandomSampler (plain)"]
    lines = ["", f"| W13 drawing batches of {w13['batch']} (one rank of two), no loading | us a batch | "
             "/ plain RandomSampler |", "|---|---|---|"]
    for name, times in w13["per_batch_us"].items():
        lines.append(f"| {name} | {summary(times)} | {summary([t / p for t, p in zip(times, plain)])}x |")
    loaded = w13["loaded"]
    ratio = [placed / plain for placed, plain in zip(loaded["placed"], loaded["plain"])]
    lines += ["", "| W13 loading W1's tiny samples, 2 workers | samples/s |", "|---|---|",
              f"| BatchSampler(RandomSampler) | {summary(loaded['plain'])} |",
              f"| DistributedBatchSampler, each sample seeded from its place | {summary(loaded['placed'])} "
              f"({summary(ratio).strip()}x) |"]
    return lines
