"""Batch samplers of a global order, the same on every rank: each global batch is a run of
consecutive places in the epoch's order, and rank r takes the r-th of its contiguous slices.

Everything a rank yields follows from (seed, epoch, place): which samples a global batch holds
does not depend on the number of ranks, and the loader seeds each sample from its place (see
`_wire.protocol.Placed`), not from the rank or slot it lands in. So a state taken on R1 ranks loads
on R2 ranks with the same global batch, and the batches after it are the uninterrupted run's,
sample for sample. `DistributedBatchSampler` cuts the order of any sampler into global batches
of a fixed size; `TokenBudgetBatchSampler` (`_sampling.budget`) cuts a length-bucketed order by a token
budget. Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch.utils.data as torch_data

from .._checks import check_positive_int
from .._math import ceil_div
from .samplers import RandomSampler, SequentialSampler, default_distributed

__all__ = ["DistributedBatchSampler", "GlobalBatchSampler", "epoch_order", "rank_and_replicas"]

_LAST_BATCH = ("pad", "discard", "keep")


def rank_and_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """(num_replicas, rank), torch.distributed's where not given, checked."""
    replicas = check_positive_int("num_replicas", default_distributed("num_replicas") if num_replicas is None
                                  else num_replicas)
    rank = default_distributed("rank") if rank is None else int(rank)
    if not 0 <= rank < replicas:
        raise ValueError(f"rank must be in [0, {replicas}), got {rank}")
    return replicas, rank


def epoch_order(sampler: Any) -> np.ndarray:
    """One epoch of an index sampler as an array (an int64 array for gloader's own samplers,
    made at once); advances the sampler to its next epoch, as iterating does."""
    indices = getattr(sampler, "_indices", None)
    if indices is not None and callable(indices):
        return np.asarray(indices())
    keys = list(sampler)
    array = np.asarray(keys)
    return array if array.ndim == 1 and array.dtype.kind in "iu" else np.array(keys + [None], dtype=object)[:-1]


class GlobalBatchSampler(torch_data.BatchSampler):
    """What a rank yields of global batches (subclasses make them, `_global_epoch`): each global batch
    is split into `num_replicas` contiguous slices, as even as can be, and this rank's is its
    batch. Every rank has the same number of batches when every global batch holds at least
    `num_replicas` samples (see the subclasses' `last_batch`).

    A DataLoader given one seeds each sample from its place in the epoch's order; iterated by
    anything else (a torch DataLoader that Accelerate builds) it yields plain lists.
    """

    num_replicas: int
    rank: int

    def _global_epoch(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The next epoch: its global order and its global batches as (start, end) places."""
        raise NotImplementedError

    def _slice(self, start: int, end: int) -> tuple[int, int]:
        """This rank's places of the global batch [start, end)."""
        size, extra = divmod(end - start, self.num_replicas)
        first = start + self.rank * size + min(self.rank, extra)
        return first, first + size + (self.rank < extra)

    def _placed_batches(self) -> Iterator[tuple[int, Any]]:
        """The epoch's batches as (place of its first sample, its keys); the loader draws
        through here (see `_sampling.schedule`). A rank whose slice is empty yields no batch for it."""
        order, bounds = self._global_epoch()
        for start, end in bounds:
            first, last = self._slice(start, end)
            if last > first:
                yield first, order[first:last]

    def __iter__(self) -> Iterator[list[Any]]:
        for _, keys in self._placed_batches():
            yield keys.tolist()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class DistributedBatchSampler(GlobalBatchSampler):
    """This rank's batches of the global batches of `sampler`'s order: global batch k is the
    `batch_size * num_replicas` indices of the order from place `k * global_batch_size`, and rank r
    takes its r-th slice of `batch_size`. Every rank draws the same order (give `sampler` a seed,
    or seed torch the same on every rank), so the slices are disjoint and cover the epoch.

    A state taken on one number of ranks loads on another whose `batch_size * num_replicas` is
    the same (2 ranks of 16 resume as 1 of 32 or 4 of 8): the global batches after it are the
    uninterrupted run's, and each sample's random draws too (see docs/guide/elastic.md).

    Args:
        sampler: the epoch's global order: any index sampler (`RandomSampler(len(ds), seed=0)`,
            `WeightedMixtureSampler`, torch's), or a dataset length (then a `RandomSampler`
            seeded with `seed`, or with shuffle=False a `SequentialSampler`).
        batch_size: samples per rank and batch.
        num_replicas: ranks; default: torch.distributed's world size.
        rank: this rank in [0, num_replicas); default: torch.distributed's rank.
        last_batch: the global batch the epoch ends with, when it is short: 'pad' (default)
            fills it with the order's first indices, so every rank gets a whole batch (and
            Accelerate's `gather_for_metrics` drops exactly those: gloader.integrations.accelerate);
            'discard' drops it; 'keep' splits it as evenly as can be (exact evaluation; a rank
            whose slice is empty then has one batch fewer).
        shuffle: with a length for `sampler`: shuffle each epoch.
        seed: with a length for `sampler`: the RandomSampler's seed.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    def __init__(self, sampler: Any, batch_size: int, num_replicas: int | None = None, rank: int | None = None,
                 last_batch: str = "pad", shuffle: bool = True, seed: int | None = 0) -> None:
        if isinstance(sampler, (int, np.integer)) and not isinstance(sampler, bool):
            sampler = RandomSampler(int(sampler), seed) if shuffle else SequentialSampler(int(sampler))
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be an index sampler or a dataset length, got {sampler!r:.80}")
        if last_batch not in _LAST_BATCH:
            raise ValueError(f"last_batch must be one of {_LAST_BATCH}, got {last_batch!r}")
        self.num_replicas, self.rank = rank_and_replicas(num_replicas, rank)
        self._sampler = sampler
        self._batch_size = check_positive_int("batch_size", batch_size)
        self.last_batch = last_batch

    @property
    def sampler(self) -> Any:  # type: ignore[override]  # a property here, an attribute in torch's
        """The sampler of the global order."""
        return self._sampler

    @property
    def batch_size(self) -> int:  # type: ignore[override]  # a property here, an attribute in torch's
        """Samples per rank and batch."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:  # type: ignore[override]  # a property here, an attribute in torch's
        return self.last_batch == "discard"

    @property
    def global_batch_size(self) -> int:
        """Samples of a global batch, every rank's batch together."""
        return self._batch_size * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Select the order of `epoch` (the inner sampler's); call it with the same value on every rank."""
        set_epoch = getattr(self._sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def _global_batches(self, length: int) -> int:
        return length // self.global_batch_size if self.last_batch == "discard" else ceil_div(length, self.global_batch_size)

    def __len__(self) -> int:
        length, size = len(self._sampler), self.global_batch_size
        batches = self._global_batches(length)
        if self.last_batch == "keep" and length % size:
            first, last = self._slice((batches - 1) * size, length)
            return batches - (last == first)
        return batches

    def _global_epoch(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        order = epoch_order(self._sampler)
        size = self.global_batch_size
        batches = self._global_batches(len(order))
        if self.last_batch == "pad" and len(order) and len(order) < batches * size:
            order = np.resize(order, batches * size)  # repeats the order from its start
        return order, [(k * size, min((k + 1) * size, len(order))) for k in range(batches)]

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self._sampler.state_dict() if hasattr(self._sampler, "state_dict") else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self._sampler, "load_state_dict"):
            self._sampler.load_state_dict(state["sampler"])

    def describe(self) -> dict[str, Any]:
        """What a loader's state records of this sampler (see `_sampling.schedule`): what decides the global batches."""
        return {"batches": type(self).__name__, "global_batch_size": self.global_batch_size,
                "last_batch": self.last_batch, "order": type(self._sampler).__name__}
