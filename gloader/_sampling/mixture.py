"""Weighted mixtures of datasets: an index sampler whose epoch draws from several datasets with
given weights, deterministic per (seed, epoch), over the indices of their concatenation
(`ConcatDataset(datasets)`, or `a + b + c` of gloader datasets). Resumable and elastic as any
sampler of a global order is (give it to `DistributedBatchSampler` for distributed training).
Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch.utils.data as torch_data

from .._checks import check_positive_int
from .._math import ceil_div
from .samplers import EpochSeeded

__all__ = ["WeightedMixtureSampler", "apportion"]


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, as near `weights * total` as can be (largest remainders)."""
    exact = weights * total
    counts: np.ndarray = np.floor(exact).astype(np.int64)
    short = total - int(counts.sum())
    if short:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


class WeightedMixtureSampler(EpochSeeded, torch_data.Sampler[int]):
    """An epoch of `num_samples` indices drawn from several datasets with `weights`, as indices of
    their concatenation (dataset i's index j is `sum(lengths[:i]) + j`, as in
    `torch.utils.data.ConcatDataset`).

    Which dataset each place draws from is random per (seed, epoch) with the given weights, or,
    with `exact_every=n`, exactly in proportion within every run of n places (shuffled inside
    it): give the global batch size for exact proportions in every global batch. Within a
    dataset, indices come from a permutation of it per (seed, epoch), and a new one each time it
    is used up (so a small dataset with a large weight repeats, each of its samples equally often).

    Args:
        datasets: the datasets (sized objects) or their lengths, in the order of the concatenation.
        weights: non-negative, at least one positive; normalized to sum to 1.
        num_samples: indices per epoch; default: the datasets' total length.
        seed: non-negative integer, the same on every rank; None draws each epoch's seed from
            torch's default generator (as `RandomSampler` without one).
        exact_every: exact proportions within each run of this many places; None: drawn freely.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float], num_samples: int | None = None,
                 seed: int | None = 0, exact_every: int | None = None) -> None:
        lengths = [int(d) if isinstance(d, (int, np.integer)) else len(d) for d in datasets]
        if not lengths or any(length <= 0 for length in lengths):
            raise ValueError(f"datasets must be one or more non-empty datasets (or lengths > 0), got lengths {lengths}")
        weight = np.asarray(weights, dtype=np.float64)
        if weight.shape != (len(lengths),) or not np.all(np.isfinite(weight)) or (weight < 0).any() or weight.sum() <= 0:
            raise ValueError(f"weights must be {len(lengths)} finite numbers >= 0, not all 0 (one per dataset), got "
                             f"{list(weights)!r}")
        self.lengths = lengths
        self.weights = weight / weight.sum()
        self.num_samples = sum(lengths) if num_samples is None else check_positive_int("num_samples", num_samples)
        self.exact_every = None if exact_every is None else check_positive_int("exact_every", exact_every)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        if seed is not None and int(seed) < 0:
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        self._start_epochs(None if seed is None else int(seed))

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        yield from self._indices().tolist()

    def _indices(self) -> np.ndarray:
        """One epoch's indices; advances to the next epoch, as iterating does."""
        self._prepare_epoch()
        key: list[int] = [self._epoch_seed or 0] if self._seed is None else [self._seed, self._epoch]
        self._epoch_seed = None
        self._epoch += 1
        rng = np.random.default_rng(key)
        sources = self._sources(rng)
        order = np.empty(self.num_samples, dtype=np.int64)
        for i, length in enumerate(self.lengths):
            places = np.flatnonzero(sources == i)
            if len(places):
                own = np.random.default_rng([*key, i])  # each dataset's permutations of its own stream
                rounds = ceil_div(len(places), length)
                order[places] = np.concatenate([own.permutation(length) for _ in range(rounds)])[:len(places)] \
                    + self._offsets[i]
        return order

    def _sources(self, rng: np.random.Generator) -> np.ndarray:
        """Which dataset each place of the epoch draws from."""
        if self.exact_every is None:
            return rng.choice(len(self.lengths), size=self.num_samples, p=self.weights)
        runs = []
        for start in range(0, self.num_samples, self.exact_every):
            size = min(self.exact_every, self.num_samples - start)
            runs.append(rng.permutation(np.repeat(np.arange(len(self.lengths)), apportion(self.weights, size))))
        return np.concatenate(runs)

    def describe(self) -> dict[str, Any]:
        """What a loader's state records of this sampler: what decides its order."""
        return {"order": type(self).__name__, "lengths": list(self.lengths),
                "weights": [round(float(w), 12) for w in self.weights], "num_samples": self.num_samples,
                "exact_every": self.exact_every}
