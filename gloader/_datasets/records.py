"""Records held once: `SharedList` and `SharedDict`, Python objects kept as one buffer of their
pickles with an array of offsets, so that worker processes read them without touching a
Python object's reference count.

A list of a million dicts is a million objects, and reading one writes its reference count:
every page of the list a forked worker reads is copied into it (copy-on-write), and a spawned
worker unpickles a copy of its own. Held as two numpy arrays (the pickles end to end, and where
each begins), reading a record writes nothing but a new, short-lived object: forked workers
keep sharing the pages, and spawned ones map the arrays from the shared memory the loader puts
them in once (see `_caller.payload`). `SimpleDataset` and `ArrayDataset` hold lists of Python objects
this way by themselves; a dataset of your own takes one line: `self.records = SharedList(records)`.
Nothing here starts a process or touches CUDA.
"""
from __future__ import annotations

import bisect
import hashlib
import operator
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["SharedDict", "SharedList", "held_once", "python_objects"]

# Lists shorter than this stay lists in gloader's own datasets (their copies cost little), and
# the warning for lists and dicts outside the shared form leaves them alone.
_FEW = 10_000


def _pickled(items: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The items' pickles end to end, and the offsets where each begins (one more at the end)."""
    pickles = [pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL) for item in items]
    offsets = np.zeros(len(pickles) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in pickles], out=offsets[1:])
    return np.frombuffer(b"".join(pickles), dtype=np.uint8), offsets


class SharedList(Sequence[Any]):
    """A read-only list of picklable objects, held as one buffer of their pickles: worker
    processes read it without copying it (see the module's docstring). `records[i]` unpickles
    record i (about a microsecond for a small dict); items equal to those given, not the same
    objects. Pickled (a spawned worker's copy of the dataset), it travels as its two arrays,
    which the loader puts in shared memory once for all the workers.

    Args:
        items: the records, each picklable with the standard pickler.

    Raises:
        TypeError: an item cannot be pickled (naming its index).
    """

    def __init__(self, items: Iterable[Any]) -> None:
        items = items if isinstance(items, Sequence) else list(items)
        try:
            data, offsets = _pickled(items)
        except Exception as exc:
            index = next((i for i, item in enumerate(items) if not _picklable(item)), None)
            raise TypeError(f"SharedList holds records the standard pickler can pickle; item {index} is "
                            f"{type(items[index]).__name__ if index is not None else '?'} ({exc})") from exc
        self._set(data, offsets)

    def _set(self, data: np.ndarray, offsets: np.ndarray) -> None:
        self._data, self._offsets = data, offsets
        self._bytes = memoryview(data.data)  # slices of a memoryview: ~3x faster than of the array
        self._starts = memoryview(offsets.data)

    @classmethod
    def _from_arrays(cls, data: np.ndarray, offsets: np.ndarray) -> SharedList:
        held = cls.__new__(cls)
        held._set(data, offsets)
        return held

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedList._from_arrays, (self._data, self._offsets))

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"SharedList index {index} out of range for {len(self)} records")
        return pickle.loads(self._bytes[self._starts[i]:self._starts[i + 1]])

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"SharedList({len(self):,} records, {self._data.nbytes / 2**20:.1f} MiB)"

    @property
    def nbytes(self) -> int:
        """Bytes the records take, pickled, with their offsets."""
        return int(self._data.nbytes + self._offsets.nbytes)


def _picklable(item: Any) -> bool:
    try:
        pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return False
    return True


def _key_hash(key: Any) -> int:
    """A hash of a key that is the same in every process (str's hash() is not)."""
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool) and -(1 << 63) <= key < 1 << 63:
        return int(key)
    if isinstance(key, str):
        key = key.encode("utf-8", "surrogatepass")
    if not isinstance(key, bytes):
        raise TypeError(f"SharedDict keys are str, bytes or int, got {type(key).__name__} {key!r:.40}")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


class SharedDict(Mapping[Any, Any]):
    """A read-only dict with str, bytes or int keys, held as `SharedList`s of its keys and
    values with a sorted array of key hashes: worker processes read it without copying it.
    `records[key]` finds the key (a binary search) and unpickles its value: about 2 microseconds.

    Args:
        mapping: the dict (or pairs) to hold.

    Raises:
        TypeError: a key that is not a str, bytes or int, or a value that cannot be pickled.
    """

    def __init__(self, mapping: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> None:
        pairs = list(mapping.items() if isinstance(mapping, Mapping) else mapping)
        hashes = np.fromiter((_key_hash(key) for key, _ in pairs), dtype=np.int64, count=len(pairs))
        order = np.argsort(hashes, kind="stable")
        self._set(hashes[order], SharedList([pairs[i][0] for i in order]), SharedList([pairs[i][1] for i in order]))

    def _set(self, hashes: np.ndarray, keys: SharedList, values: SharedList) -> None:
        self._hashes, self._keys, self._values = hashes, keys, values
        self._sorted = memoryview(hashes.data)  # bisect on it: ~3x faster than np.searchsorted for one key

    @classmethod
    def _from_parts(cls, hashes: np.ndarray, keys: SharedList, values: SharedList) -> SharedDict:
        held = cls.__new__(cls)
        held._set(hashes, keys, values)
        return held

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedDict._from_parts, (self._hashes, self._keys, self._values))

    def _place(self, key: Any) -> int | None:
        try:
            wanted = _key_hash(key)
        except TypeError:
            return None
        place = bisect.bisect_left(self._sorted, wanted)
        while place < len(self._sorted) and self._sorted[place] == wanted:
            if self._keys[place] == key:
                return place
            place += 1
        return None

    def __getitem__(self, key: Any) -> Any:
        place = self._place(key)
        if place is None:
            raise KeyError(key)
        return self._values[place]

    def __contains__(self, key: object) -> bool:
        return self._place(key) is not None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"SharedDict({len(self):,} keys, {(self._keys.nbytes + self._values.nbytes) / 2**20:.1f} MiB)"


def python_objects(value: Any) -> bool:
    """Whether `value` is a list (or tuple) of at least _FEW Python objects other than arrays
    and tensors: what every worker copies as it reads it."""
    if not isinstance(value, (list, tuple)) or len(value) < _FEW:
        return False
    first = value[0]
    return not (isinstance(first, np.ndarray) or type(first).__module__.startswith("torch"))


def held_once(value: Any) -> Any:
    """`value` held once when it is a list of Python objects worth it (`python_objects`): as a
    SharedList when every item pickles (numbers too: the same items come back, an int as an int,
    where an array would turn them into numpy scalars of one dtype); else `value` itself."""
    if not python_objects(value):
        return value
    try:
        return SharedList(value)
    except TypeError:
        return value  # not picklable: left as it is (and said so: see `_caller.payload`)
