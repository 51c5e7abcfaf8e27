"""gloader's samplers (public as `gloader.sampler`): which sample indices make up an epoch, and
how they are grouped into batches.

Gluon's samplers with Gluon's semantics, plus resumable state (`state_dict`) and a
`DistributedSampler` for torch.distributed. Each is also an instance of torch's sampler of the
same kind (`isinstance(s, torch.utils.data.RandomSampler)`), so tools that look for those
(Lightning's shuffle detection and sampler injection) see them for what they are; torch's
constructors are not used. Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Iterator

import numpy as np
import torch.utils.data as torch_data

from .._checks import check_flag, check_last_batch, check_positive_int
from .._math import ceil_div
from .._wire.seed import draw_base_seed

__all__ = ["BatchSampler", "DistributedSampler", "EpochSeeded", "FilterSampler", "IntervalSampler", "RandomSampler", "Sampler",
           "SequentialSampler", "dataset_length", "default_distributed"]


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        hint = "; gloader's samplers take the dataset's length (Gluon's API): pass len(dataset)" if hasattr(
            length, "__len__") else ""
        raise TypeError(f"length must be a non-negative integer, got {length!r:.80}{hint}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return int(length)


def dataset_length(dataset: Any) -> int:
    """Return len(dataset), or a TypeError that says a map-style sampler needs it."""
    try:
        return len(dataset)
    except TypeError:
        length = getattr(type(dataset), "__len__", None)
        if length is None:
            raise TypeError(f"dataset {type(dataset).__name__} has no __len__, which a map-style sampler needs; "
                            "give it __len__, or use gloader.IterableDataset for a stream") from None
        returned = length(dataset)  # what len() refused (an error of its own propagates)
        raise TypeError(f"dataset {type(dataset).__name__}.__len__() returned {returned!r:.80}, which is not a "
                        "non-negative integer; a map-style sampler needs the number of samples") from None


class Sampler(torch_data.Sampler[Any]):
    """Base class of samplers: iterate over sample indices (or batches of them).

    Subclasses implement `__iter__` and `__len__`; `state_dict`/`load_state_dict` may be
    overridden by samplers that carry state across epochs (used by DataLoader resume).
    """

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Return the state that decides the next epoch's order (empty when there is none)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state returned by `state_dict`."""


class _Length:
    """The length of a sampler a DataLoader built: fixed, or followed from the dataset at each
    use once the loader calls `_follow` (torch's samplers read len(data_source) each epoch, so a
    dataset that grows or shrinks between epochs is followed)."""

    _fixed_length: int
    _dataset: Any = None

    @property
    def _length(self) -> int:
        return self._fixed_length if self._dataset is None else dataset_length(self._dataset)

    @_length.setter
    def _length(self, value: int) -> None:
        self._fixed_length = value

    def _follow(self, dataset: Any) -> None:
        self._dataset = dataset
        self.data_source = dataset  # torch's attribute


class SequentialSampler(_Length, Sampler, torch_data.SequentialSampler):
    """Yields `start, start+1, ..., start+length-1`.

    Args:
        length: number of indices.
        start: first index.
    """

    def __init__(self, length: int, start: int = 0) -> None:
        self._length = _check_length(length)
        self._start = int(start)
        self.data_source = range(self._start, self._start + self._length)  # torch's attribute

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._start, self._start + self._length))

    def _fits_int64(self) -> bool:
        return _INT64_MIN <= self._start and self._start + self._length - 1 <= _INT64_MAX

    def _indices(self) -> np.ndarray:
        """One epoch's indices as an int64 array (see `_fits_int64`)."""
        return np.arange(self._start, self._start + self._length, dtype=np.int64)

    def __len__(self) -> int:
        return self._length


class EpochSeeded:
    """A seeded epoch order's state: the seed (None: each epoch's drawn from torch's default
    generator when it starts, as torch's samplers draw), the epoch, and a seedless epoch's drawn
    seed (kept in the state, so that a resumed epoch repeats it)."""

    _seed: int | None

    def _start_epochs(self, seed: int | None) -> None:
        self._seed = seed
        self._epoch = 0
        self._epoch_seed: int | None = None  # drawn for the epoch about to run (seedless)
        self._set_count = 0  # calls of set_epoch/load_state_dict: how a loader tells them from its own draws

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration draw the order of `epoch`."""
        self._epoch = int(epoch)
        self._set_count += 1

    def _prepare_epoch(self) -> None:
        """Draw the coming epoch's seed now (seedless), so that a state taken before the
        epoch's indices already holds it."""
        if self._seed is None and self._epoch_seed is None:
            self._epoch_seed = draw_base_seed()  # from torch's default generator, as torch's sampler draws

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "epoch": self._epoch, "epoch_seed": self._epoch_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seed = None if state["seed"] is None else int(state["seed"])
        self._epoch = int(state["epoch"])
        self._epoch_seed = state.get("epoch_seed")
        self._set_count += 1


class RandomSampler(EpochSeeded, _Length, Sampler, torch_data.RandomSampler):
    """Yields a fresh permutation of `range(length)` every epoch.

    With a seed, epoch `e` uses a generator seeded from `(seed, e)`, so the sequence of
    permutations is the same in any process. Without one, as torch's RandomSampler without a
    generator, each epoch draws its seed from torch's default generator when it starts, so
    `torch.manual_seed(s)` before it reproduces the order; `state_dict` keeps the drawn seed,
    so a resumed epoch repeats it.

    Args:
        length: number of indices.
        seed: non-negative integer, or None (see above).
    """

    def __init__(self, length: int, seed: int | None = None) -> None:
        self._length = _check_length(length)
        self._start_epochs(None if seed is None else int(seed))
        # torch's attributes: a permutation of every index, without replacement.
        self.data_source, self.replacement, self._num_samples, self.generator = range(self._length), False, None, None

    def __iter__(self) -> Iterator[int]:
        yield from self._indices().tolist()  # drawn at the first next(), as torch's sampler draws

    def _indices(self) -> np.ndarray:
        """One epoch's indices as an int64 array; advances to the next epoch as iterating does."""
        if self._seed is None:  # the order is the drawn seed's alone, as torch's
            self._prepare_epoch()
            rng = np.random.default_rng(self._epoch_seed)
            self._epoch_seed = None
        else:
            rng = np.random.default_rng([self._seed, self._epoch])
        self._epoch += 1
        return rng.permutation(self._length).astype(np.int64, copy=False)

    def __len__(self) -> int:
        return self._length



class IntervalSampler(Sampler):
    """Yields `0, k, 2k, ...`, then (with rollover) `1, 1+k, ...` and so on.

    Args:
        length: number of indices.
        interval: the stride k, >= 1.
        rollover: continue with the next offset after each pass; False stops after offset 0.
    """

    def __init__(self, length: int, interval: int, rollover: bool = True) -> None:
        self._length = _check_length(length)
        self._interval = check_positive_int("interval", interval)
        self._rollover = check_flag("rollover", rollover)

    def __iter__(self) -> Iterator[int]:
        for offset in range(self._interval if self._rollover else 1):
            yield from range(offset, self._length, self._interval)

    def __len__(self) -> int:
        if self._rollover:
            return self._length
        return ceil_div(self._length, self._interval)


class FilterSampler(Sampler):
    """Yields the indices `i` of `dataset` for which `fn(dataset[i])` is true.

    Args:
        fn: predicate on a sample.
        dataset: any object with `__getitem__` and `__len__`; evaluated once, here.
    """

    def __init__(self, fn: Callable[[Any], bool], dataset: Any) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self._indices = [i for i in range(dataset_length(dataset)) if fn(dataset[i])]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices)

    def __len__(self) -> int:
        return len(self._indices)


class BatchSampler(Sampler, torch_data.BatchSampler):
    """Groups the indices of `sampler` into lists of `batch_size`.

    Args:
        sampler: yields sample indices.
        batch_size: indices per batch, >= 1.
        last_batch: what happens to a final batch shorter than `batch_size`: 'keep' yields it,
            'discard' drops it, 'rollover' carries its indices into the front of the next epoch
            (and `len()` counts them). None means 'keep'.
        drop_last: torch's name: True is 'discard', False 'keep' (not with last_batch).
    """

    def __init__(self, sampler: Any, batch_size: int, last_batch: str | None = "keep", *,
                 drop_last: bool | None = None) -> None:
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be an iterable of sample keys (a Sampler, a list of indices), got "
                            f"{sampler!r:.80}")
        if drop_last is not None:
            drop = check_flag("drop_last", drop_last)
            if last_batch not in (None, "keep"):
                raise ValueError(f"last_batch={last_batch!r} and drop_last={drop_last!r} are the same setting "
                                 "(Gluon's and torch's name for it); pass only one")
            last_batch = "discard" if drop else "keep"
        self._sampler = sampler
        self._batch_size = check_positive_int("batch_size", batch_size)
        self._last_batch = check_last_batch(last_batch)
        self._prev: list[Any] = []
        self._loader_owned = False  # built by a DataLoader, which draws through _batches/_index_batches

    @property
    def sampler(self) -> Any:  # a property here, an attribute in torch's
        """The sampler whose indices this one groups; settable, as torch's attribute is
        (Accelerate's `use_seedable_sampler` puts its own in): the next epoch draws from it."""
        return self._sampler

    @sampler.setter
    def sampler(self, sampler: Any) -> None:
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be an iterable of sample keys (a Sampler, a list of indices), got "
                            f"{sampler!r:.80}")
        self._sampler = sampler

    @property
    def batch_size(self) -> int:  # type: ignore[override]  # read-only here; an attribute in torch's
        return self._batch_size

    @property
    def last_batch(self) -> str:
        return self._last_batch

    @property
    def drop_last(self) -> bool:  # type: ignore[override]  # read-only here; an attribute in torch's
        """torch's name: whether a short last batch is dropped ('discard')."""
        return self._last_batch == "discard"

    def __iter__(self) -> Iterator[list[Any]]:
        if self._loader_owned:
            _warn_iterated_without_the_loader()
        return self._batches()

    def _batches(self) -> Iterator[list[Any]]:
        """The epoch's batches, as iterating yields them (the loader draws through here)."""
        batch, self._prev = self._prev, []
        indices = iter(self._sampler)
        if batch:
            batch.extend(itertools.islice(indices, self._batch_size - len(batch)))
            if len(batch) == self._batch_size:
                yield batch
                batch = []
        if not batch:
            while True:  # islice takes whole batches at C speed
                batch = list(itertools.islice(indices, self._batch_size))
                if len(batch) < self._batch_size:
                    break
                yield batch
        if batch:
            if self._last_batch == "keep":
                yield batch
            elif self._last_batch == "rollover":
                self._prev = batch

    def _index_batches(self) -> Iterator[np.ndarray] | None:
        """The epoch's batches as int64 arrays, exactly as iterating yields them (and with the
        same effect on the samplers' state), without a Python int per index; None unless both
        this sampler and its inner one are this module's own, which make an epoch as one array."""
        sampler = self._sampler
        if type(self).__iter__ is not BatchSampler.__iter__ or type(sampler).__iter__ not in _ARRAY_EPOCHS:
            return None
        if isinstance(sampler, SequentialSampler) and not sampler._fits_int64():
            return None
        prev = np.asarray(self._prev)
        if prev.size and (prev.ndim != 1 or prev.dtype.kind not in "iu" or prev.dtype == np.uint64):
            return None  # a carried-over batch of other keys (from load_state_dict): iterate
        return self._array_batches(sampler, prev.astype(np.int64))

    def _array_batches(self, sampler: Any, prev: np.ndarray) -> Iterator[np.ndarray]:
        self._prev = []
        order = sampler._indices()
        if prev.size:
            order = np.concatenate([prev, order])
        size = self._batch_size
        full = len(order) - len(order) % size
        for start in range(0, full, size):
            yield order[start:start + size]
        if full < len(order):
            if self._last_batch == "keep":
                yield order[full:]
            elif self._last_batch == "rollover":
                self._prev = order[full:].tolist()

    def __len__(self) -> int:
        total = len(self._sampler)
        if self._last_batch == "keep":
            return ceil_div(total, self._batch_size)
        if self._last_batch == "discard":
            return total // self._batch_size
        return (len(self._prev) + total) // self._batch_size

    def state_dict(self) -> dict[str, Any]:
        inner = self._sampler.state_dict() if hasattr(self._sampler, "state_dict") else {}
        return {"prev": list(self._prev), "sampler": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev = list(state["prev"])
        if hasattr(self._sampler, "load_state_dict"):
            self._sampler.load_state_dict(state["sampler"])

    def describe(self) -> dict[str, Any]:
        """What a loader's state records of this sampler: what decides the batches."""
        order = self._sampler
        described = order.describe() if hasattr(order, "describe") else {"order": type(order).__name__}
        return {"batches": type(self).__name__, "batch_size": self._batch_size, "last_batch": self._last_batch,
                **described}


_said_iterated_without_the_loader = False


def _warn_iterated_without_the_loader() -> None:
    """Said once a process: a DataLoader's own batch sampler is iterated by something else, most
    likely a torch DataLoader built from the loader's attributes (Accelerate's prepare())."""
    global _said_iterated_without_the_loader
    if _said_iterated_without_the_loader:
        return
    _said_iterated_without_the_loader = True
    warnings.warn("a gloader DataLoader's batch sampler is being iterated without the loader, as a torch DataLoader "
                  "built from its attributes does (accelerate's prepare()): batches then load in that loader, not "
                  "in gloader's workers, and gloader's seeds, resume and per-batch errors do not apply. To keep "
                  "loading with gloader under Accelerate, leave the loader out of prepare() and shard it with "
                  "gloader.sampler.DistributedSampler on accelerator.device (see 'Accelerate' in gloader's "
                  "migration guide)", RuntimeWarning, stacklevel=3)


_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)

_DISTRIBUTED_MODES = ("pad", "discard", "keep")


def default_distributed(name: str) -> int:
    """torch.distributed's world size (`name`='num_replicas') or rank, or a ValueError saying
    it is not initialized."""
    import torch.distributed as dist  # imported lazily: plain loaders never need it

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name} was not given and torch.distributed is not initialized; pass "
                         "num_replicas= and rank=, or call torch.distributed.init_process_group first")
    return dist.get_world_size() if name == "num_replicas" else dist.get_rank()


class DistributedSampler(Sampler, torch_data.DistributedSampler[Any]):
    """Yields this rank's share of `range(length)`, the same count on every rank.

    All ranks draw the same permutation for a given `(seed, epoch)` and take every
    `num_replicas`-th index of it starting at `rank`, so shards are disjoint and, together,
    cover the dataset.

    Args:
        length: dataset length.
        num_replicas: number of ranks; default: torch.distributed's world size.
        rank: this rank in [0, num_replicas); default: torch.distributed's rank.
        shuffle: permute the indices every epoch (call `set_epoch` before each epoch).
        seed: shared by all ranks.
        last_batch: 'pad' repeats indices from the front so every rank gets
            ceil(length / num_replicas) indices; 'discard' drops the tail so every rank gets
            floor(length / num_replicas); 'keep' neither pads nor drops: every index goes to
            exactly one rank, and the first `length % num_replicas` ranks get one more (for
            exact evaluation; ranks then run different numbers of batches).

    Raises:
        ValueError: for a rank outside [0, num_replicas) or an unknown last_batch, or when a
            default is needed and torch.distributed is not initialized.
    """

    def __init__(self, length: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, last_batch: str = "pad") -> None:
        self._length = _check_length(length)
        replicas = default_distributed("num_replicas") if num_replicas is None else num_replicas
        self._num_replicas = check_positive_int("num_replicas", replicas)
        self._rank = default_distributed("rank") if rank is None else int(rank)
        if not 0 <= self._rank < self._num_replicas:
            raise ValueError(f"rank must be in [0, {self._num_replicas}), got {self._rank}")
        if last_batch not in _DISTRIBUTED_MODES:
            raise ValueError(f"last_batch must be one of {_DISTRIBUTED_MODES}, got {last_batch!r}")
        self._last_batch = last_batch
        self._shuffle = check_flag("shuffle", shuffle)
        self._seed = int(seed)
        self._epoch = 0
        self._set_count = 0  # calls of set_epoch/load_state_dict: how a loader tells them from its own draws

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of `epoch`; call it with the same value on every rank."""
        self._epoch = int(epoch)
        self._set_count += 1

    def __len__(self) -> int:
        if self._last_batch == "pad":
            return ceil_div(self._length, self._num_replicas)
        if self._last_batch == "keep":
            return len(range(self._rank, self._length, self._num_replicas))
        return self._length // self._num_replicas

    def __iter__(self) -> Iterator[int]:
        yield from self._indices().tolist()

    def _indices(self) -> np.ndarray:
        """This rank's indices of the epoch as an int64 array."""
        if self._shuffle:
            order = np.random.default_rng([self._seed, self._epoch]).permutation(self._length)
        else:
            order = np.arange(self._length)
        order = order.astype(np.int64, copy=False)
        if self._last_batch == "keep":
            return order[self._rank::self._num_replicas]
        total = len(self) * self._num_replicas
        if total > self._length:
            order = np.resize(order, total)  # np.resize repeats from the front
        order = order[:total]
        return order[self._rank::self._num_replicas]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self._seed, "epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._set_count += 1


# Samplers whose epoch `BatchSampler._index_batches` takes as one array (their `_indices()`).
_ARRAY_EPOCHS = (SequentialSampler.__iter__, RandomSampler.__iter__, DistributedSampler.__iter__)

