"""Token-budget batches: a length-bucketed global order cut into global batches by a budget of
padded tokens (GluonNLP's FixedBucketSampler and fairseq's token batches, as samplers of a
global order: see `_sampling.elastic`). Seeded per (seed, epoch), resumable, elastic, and every rank
gets the same number of batches per epoch. Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .._checks import check_flag, check_positive_int
from .elastic import GlobalBatchSampler, rank_and_replicas

__all__ = ["TokenBudgetBatchSampler"]

_LAST_BATCH = ("pad", "discard")


class TokenBudgetBatchSampler(GlobalBatchSampler):
    """Batches of samples of similar length, each within a budget of padded tokens.

    Each epoch (seeded by `seed` and the epoch) shuffles the indices, sorts them by length
    within windows of `window` samples, cuts the result into global batches, and shuffles the
    global batches' order (the epoch's last one, which the samples left make, stays last). A global batch holds as
    many samples as `max_tokens * num_replicas` padded tokens allow (its count times its longest
    length); rank r takes its r-th contiguous slice, so each rank's batch holds about `max_tokens`
    padded tokens (at most one sample's length more), and at least one sample. With `batch_size` instead of `max_tokens`, a global batch
    is `batch_size * num_replicas` samples (bucketed by length, no budget).

    The global batches depend on `max_tokens * num_replicas` (or `batch_size * num_replicas`),
    never on the number of ranks alone: a state taken on 2 ranks of 4,096 tokens loads on 1 rank
    of 8,192 or 4 of 2,048 and the batches after it are the uninterrupted run's.

    Args:
        lengths: each sample's length (tokens), a sequence of ints.
        max_tokens: padded tokens per rank and batch (one of max_tokens and batch_size).
        batch_size: samples per rank and batch instead.
        num_replicas: ranks, as DistributedSampler's (default: torch.distributed's world size).
        rank: this rank, as DistributedSampler's (default: torch.distributed's rank).
        shuffle: shuffle (False: the windows are the order of the indices, sorted within).
        seed: non-negative integer, the same on every rank.
        window: samples sorted by length together; larger: less padding, less randomness.
        last_batch: the epoch's last global batch, which the samples left make: 'pad' (default)
            fills it from the epoch's first samples up to the budget (or the global batch size),
            so that every rank gets a batch; 'discard' drops it.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int | None = None, batch_size: int | None = None,
                 num_replicas: int | None = None, rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 window: int = 4096, last_batch: str = "pad") -> None:
        self._lengths = np.asarray(lengths, dtype=np.int64)
        if self._lengths.ndim != 1 or (self._lengths < 0).any():
            raise ValueError("lengths must be a sequence of non-negative ints, one per sample")
        if (max_tokens is None) == (batch_size is None):
            raise ValueError(f"pass exactly one of max_tokens and batch_size, got max_tokens={max_tokens!r} and "
                             f"batch_size={batch_size!r}")
        if last_batch not in _LAST_BATCH:
            raise ValueError(f"last_batch must be one of {_LAST_BATCH}, got {last_batch!r}")
        self.num_replicas, self.rank = rank_and_replicas(num_replicas, rank)
        self.max_tokens = None if max_tokens is None else check_positive_int("max_tokens", max_tokens)
        longest = int(self._lengths.max(initial=0))
        if self.max_tokens is not None and self.max_tokens < longest:
            raise ValueError(f"max_tokens={max_tokens} is below the longest sample ({longest} tokens): a rank's batch "
                             "could hold no sample; raise max_tokens, or leave the longest samples out")
        self._batch_size = None if batch_size is None else check_positive_int("batch_size", batch_size)
        self.shuffle = check_flag("shuffle", shuffle)
        self.seed = int(seed)
        self.window = check_positive_int("window", window)
        self.last_batch = last_batch
        self._epoch = 0
        self._set_count = 0  # calls of set_epoch/load_state_dict: how a loader tells them from its own draws
        self._counted: tuple[int, int, int] | None = None  # (seed, epoch, batches) of the latest count (see __len__)

    @property
    def batch_size(self) -> int | None:  # type: ignore[override]  # a property here, an attribute in torch's
        """Samples per rank and batch (None: by token budget)."""
        return self._batch_size

    @property
    def drop_last(self) -> bool:  # type: ignore[override]  # a property here, an attribute in torch's
        return self.last_batch == "discard"

    @property
    def sampler(self) -> None:  # type: ignore[override]  # a property here, an attribute in torch's
        """None: this sampler makes its own order."""
        return None

    def set_epoch(self, epoch: int) -> None:
        """Select the batches of `epoch`; call it with the same value on every rank."""
        self._epoch = int(epoch)
        self._set_count += 1

    def __len__(self) -> int:
        """Batches of this rank in the coming epoch (its budget cuts depend on the epoch's draw)."""
        if self._counted is None or self._counted[:2] != (self.seed, self._epoch):
            self._counted = (self.seed, self._epoch, len(self._epoch_of(self._epoch)[1]))  # a function of the two
        return self._counted[2]

    def _global_epoch(self) -> tuple[np.ndarray, list[tuple[int, int]]]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self._epoch_of(epoch)

    def _epoch_of(self, epoch: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """The order and global batches of `epoch`."""
        rng = np.random.default_rng([self.seed, epoch])
        indices = rng.permutation(len(self._lengths)) if self.shuffle else np.arange(len(self._lengths))
        windows = [indices[start:start + self.window] for start in range(0, len(indices), self.window)]
        bucketed = np.concatenate([w[np.argsort(self._lengths[w], kind="stable")] for w in windows]) \
            if windows else indices
        cuts = self._cuts(self._lengths[bucketed])
        # Every cut the budget made holds at least one sample per rank (max_tokens is at least the
        # longest sample); the one the epoch ends with may not: it stays last, and is filled up to
        # the budget (or the global batch size) from the epoch's first samples, or dropped.
        tail = cuts.pop() if cuts else None
        batches = [bucketed[a:b] for a, b in cuts]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if tail is not None and self.last_batch == "pad":
            batches.append(self._filled(bucketed[tail[0]:tail[1]], bucketed))
        order = np.concatenate(batches) if batches else bucketed[:0]
        bounds, start = [], 0
        for batch in batches:
            bounds.append((start, start + len(batch)))
            start += len(batch)
        return order, bounds

    def _filled(self, tail: np.ndarray, order: np.ndarray) -> np.ndarray:
        """The epoch's last global batch, filled from the order's start as far as a whole one
        goes: the budget (or global batch size) alone decides how far, not the ranks."""
        if self._batch_size is not None:
            return np.concatenate([tail, np.resize(order, self._batch_size * self.num_replicas - len(tail))])
        budget = self.max_tokens * self.num_replicas  # type: ignore[operator]
        widest, count = int(self._lengths[tail].max()), len(tail)
        for length in self._lengths[np.resize(order, len(order) * 2)].tolist():  # at most twice round
            if (count + 1) * max(widest, length) > budget:
                break
            widest, count = max(widest, length), count + 1
        return np.concatenate([tail, np.resize(order, count - len(tail))])

    def _cuts(self, lengths: np.ndarray) -> list[tuple[int, int]]:
        """Where the bucketed order's global batches begin and end: by the global budget alone
        (or the global batch size), never by the number of ranks, so that they are the same on
        any number of ranks with the same budget."""
        if self._batch_size is not None:
            size = self._batch_size * self.num_replicas
            return [(start, min(start + size, len(lengths))) for start in range(0, len(lengths), size)]
        budget = self.max_tokens * self.num_replicas  # type: ignore[operator]
        cuts, start, longest = [], 0, 0
        for place, length in enumerate(lengths.tolist()):
            widest = max(longest, length)
            if place > start and (place - start + 1) * widest > budget:
                cuts.append((start, place))
                start, widest = place, length
            longest = widest
        if start < len(lengths):
            cuts.append((start, len(lengths)))
        return cuts

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._set_count += 1

    def describe(self) -> dict[str, Any]:
        """What a loader's state records of this sampler: what decides the global batches."""
        budget = None if self.max_tokens is None else self.max_tokens * self.num_replicas
        size = None if self._batch_size is None else self._batch_size * self.num_replicas
        return {"batches": type(self).__name__, "global_tokens": budget, "global_batch_size": size,
                "samples": len(self._lengths), "shuffle": self.shuffle, "window": self.window,
                "last_batch": self.last_batch}
