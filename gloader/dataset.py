"""Datasets with Gluon's API: transform, transform_first, filter, shard, take, sample.

Any object with `__getitem__` and `__len__` (a list, a numpy array, a torch tensor, a
`torch.utils.data.Dataset`) can be given to a DataLoader directly; these classes add Gluon's
lazy transforms. They are torch's `Dataset` and `IterableDataset` too, so `a + b` and torch's
`ConcatDataset`/`ChainDataset` work with them. Every wrapper is a module-level class so that
workers can unpickle it. Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch.utils.data as torch_data

from ._datasets.records import SharedDict, SharedList, held_once
from ._sampling.samplers import dataset_length

__all__ = ["ArrayDataset", "Dataset", "IterableDataset", "SharedDict", "SharedList", "SimpleDataset",
           "shared_copy"]

_T_co = TypeVar("_T_co", covariant=True)


class Dataset(torch_data.Dataset[_T_co]):
    """Base class of map-style datasets: subclasses implement `__getitem__` and `__len__`.

    Generic in its sample type, as torch's is: `class Images(gloader.Dataset[Tensor])`.
    """

    def __getitem__(self, idx: int) -> _T_co:
        raise NotImplementedError(f"{type(self).__name__} must implement __getitem__ (a subclass of gloader.Dataset)")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement __len__ (a subclass of gloader.Dataset)")

    def transform(self, fn: Callable[..., Any], lazy: bool = True) -> Dataset[Any]:
        """Return a dataset whose samples are `fn(sample)` (`fn(*sample)` for tuple samples).

        Args:
            fn: the transform; it runs in the workers when `lazy` is True.
            lazy: apply `fn` on access; False applies it to every sample now.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        transformed = _LazyTransformDataset(self, fn)
        if lazy:
            return transformed
        return SimpleDataset([transformed[i] for i in range(len(transformed))])

    def transform_first(self, fn: Callable[[Any], Any], lazy: bool = True) -> Dataset[Any]:
        """Like `transform`, but `fn` sees only the first element of each tuple sample.

        Typical use: augment the image and leave the label alone.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        return self.transform(_TransformFirst(fn), lazy)

    def filter(self, fn: Callable[[Any], bool]) -> Dataset[Any]:
        """Return the samples for which `fn(sample)` is true (evaluated now, once)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        return _SampledDataset(self, [i for i in range(len(self)) if fn(self[i])])

    def shard(self, num_shards: int, index: int) -> Dataset[Any]:
        """Return contiguous shard `index` of `num_shards`; lengths differ by at most one."""
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_shards:
            raise ValueError(f"index must be an integer in [0, {num_shards}), got {index!r}")
        size, rest = divmod(len(self), num_shards)
        start = size * index + min(index, rest)
        return _SampledDataset(self, range(start, start + size + (index < rest)))

    def take(self, count: int | None) -> Dataset[Any]:
        """Return the first `count` samples (all of them for None or a count past the end)."""
        if count is None:
            count = len(self)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0 or None, got {count!r}")
        return _SampledDataset(self, range(min(count, len(self))))

    def sample(self, sampler: Iterable[int]) -> Dataset[Any]:
        """Return the samples at the indices that `sampler` yields, in that order."""
        if not hasattr(sampler, "__iter__"):
            raise TypeError(f"sampler must be an iterable of indices (a Sampler, a list), got {sampler!r:.80}")
        return _SampledDataset(self, list(sampler))


class SimpleDataset(Dataset[Any]):
    """Wraps any indexable sequence (list, numpy array, tensor) as a Dataset.

    Args:
        data: object with `__getitem__` and `__len__`.
    """

    def __init__(self, data: Sequence[Any]) -> None:
        dataset_length(data)
        self._data = data

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, idx: int) -> Any:
        return self._data[idx]


class ArrayDataset(Dataset[Any]):
    """Zips equally long arrays: sample `i` is `(a[i], b[i], ...)`, or `a[i]` for one array.

    Args:
        *arrays: objects with `__getitem__` and `__len__`, all of the same length.

    Raises:
        ValueError: when no array is given or the lengths differ.
    """

    def __init__(self, *arrays: Sequence[Any]) -> None:
        if not arrays:
            raise ValueError("ArrayDataset needs at least one array")
        lengths = [dataset_length(a) for a in arrays]
        if len(set(lengths)) != 1:
            raise ValueError(f"all arrays of an ArrayDataset must have the same length, got lengths {lengths}")
        self._length = lengths[0]
        self._data = arrays

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, idx: int) -> Any:
        if len(self._data) == 1:
            return self._data[0][idx]
        return tuple(a[idx] for a in self._data)


class IterableDataset(torch_data.IterableDataset[_T_co]):
    """Base class of stream datasets: subclasses implement `__iter__` only (generic in the
    sample type). A `torch.utils.data.IterableDataset` is a stream too.

    With workers, every worker iterates the same object; each must yield only its own shard,
    found through `gloader.get_worker_info()` (`id`, `num_workers`; None in the main process).
    """

    def __iter__(self) -> Iterator[_T_co]:
        raise NotImplementedError(f"{type(self).__name__} must implement __iter__ (a subclass of "
                                  "gloader.IterableDataset)")


class _TransformFirst:
    """Applies `fn` to the first element of a tuple sample (the whole sample otherwise)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self._fn = fn

    def __call__(self, first: Any, *rest: Any) -> Any:
        if rest:
            return (self._fn(first),) + rest
        return self._fn(first)


class _LazyTransformDataset(Dataset[Any]):
    def __init__(self, data: Any, fn: Callable[..., Any]) -> None:
        self._data = data
        self._fn = fn

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, idx: int) -> Any:
        item = self._data[idx]
        if isinstance(item, tuple):
            return self._fn(*item)
        return self._fn(item)


class _SampledDataset(Dataset[Any]):
    def __init__(self, data: Any, indices: Sequence[int]) -> None:
        self._data = data
        self._indices = indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, idx: int) -> Any:
        return self._data[self._indices[idx]]


def shared_copy(dataset: Any) -> Any:
    """What worker processes load from in place of `dataset`: the same samples, with the lists
    of Python objects inside gloader's own datasets (SimpleDataset, ArrayDataset, the datasets
    their transform, filter, shard, take and sample make, and torch's ConcatDataset of them), or
    a plain list given as the dataset, held once (`_datasets.records.held_once`). `dataset` itself when
    nothing changes; a shallow copy otherwise, so that the caller's dataset stays as it is (a
    change made to it between epochs is still seen, see `_caller.snapshot`). A dataset of another class
    is left alone: its own lists are its business (a warning says when they are large)."""
    if isinstance(dataset, list):
        return held_once(dataset)
    if type(dataset) in _OWN:
        fields = {name: _shared_field(value) for name, value in vars(dataset).items()}
        changed = {name: value for name, value in fields.items() if value is not vars(dataset)[name]}
    elif type(dataset) is torch_data.ConcatDataset:
        parts = [shared_copy(part) for part in dataset.datasets]
        changed = {"datasets": parts} if any(a is not b for a, b in zip(parts, dataset.datasets)) else {}
    else:
        return dataset
    if not changed:
        return dataset
    held = copy.copy(dataset)
    held.__dict__.update(changed)
    return held


def _shared_field(value: Any) -> Any:
    if isinstance(value, tuple) and all(hasattr(item, "__getitem__") for item in value):  # ArrayDataset's arrays
        held = tuple(shared_copy(item) for item in value)
        return value if all(a is b for a, b in zip(held, value)) else held
    return shared_copy(value) if isinstance(value, (list, Dataset)) else value


_OWN = (SimpleDataset, ArrayDataset, _LazyTransformDataset, _SampledDataset)
