"""A shallow picture of a dataset, to tell whether the caller changed it after worker processes
took their copy.

Worker processes persist across epochs, so they keep the dataset as it was when they started
(forked, or unpickled from its payload). A training script that changes the dataset between
epochs (`dataset.set_epoch(e)`, a new transform, a curriculum's difficulty, `set_format`)
expects the next epoch to see the change, as torch's DataLoader without persistent workers
does. The loader compares this picture at each epoch's start and restarts its workers when
it differs (see `_caller.serving.Serving`).

The picture holds, for the dataset and the objects it reaches through attributes, list and
dict items (a few levels deep, a bounded number of entries): the value of numbers and short
strings, and the identity (and length) of everything else. So it sees an attribute set to a
new value or a new object, and an item appended to a list; it does not see a change made
inside a numpy array, a tensor or an object it does not descend into. It also holds
len(dataset), so a new length is seen however it came. Runs in the caller's process; runs no
user code beyond reading attributes, lengths and `len(dataset)`.
"""
from __future__ import annotations

import collections
import itertools
import types
from typing import Any

import numpy as np
import torch

__all__ = ["Picture", "first_difference", "picture"]

# How far the picture reaches. Deeper and more: changes further inside the dataset are seen;
# shallower and fewer: a cheaper check at each epoch's start (~1 us an entry).
_MAX_DEPTH = 4
_MAX_ENTRIES = 2000
_MAX_ITEMS = 16  # of each list, tuple or dict (their identity and length are always there)
_MAX_ATTRIBUTES = 64  # of each object
_MAX_TEXT = 256  # longer strings are compared by identity
_VALUES = (int, bool, str, bytes, type(None))
_CONTAINERS = (list, tuple, dict, set, frozenset)
# Objects whose insides are not looked at: their identity is their entry.
_OPAQUE = (np.ndarray, np.generic, torch.Tensor, type, types.ModuleType, types.FunctionType,
           types.BuiltinFunctionType, types.MethodType)

_LEAVES = (set, frozenset, *_OPAQUE)
# Loaders a dataset may refer to: their state moves every epoch (the iterator in use), which is
# no change of the dataset. Compared by identity only.
_LOADER_MODULES = frozenset({"gloader._caller.iterator", "gloader._caller.serving", "gloader._caller.engine",
                             "gloader._caller.workers", "gloader._caller.task", "gloader._places", "gloader._places.pool",
                             "gloader._places.inprocess", "gloader._places.ray", "gloader._pool.core",
                             "torch.utils.data.dataloader"})
_LOADER_CLASSES = frozenset({("gloader", "DataLoader"), ("gloader", "WorkerPool")})  # exported as gloader's

Picture = dict[str, Any]  # path ('dataset.transform.size') -> entry


def _entry(value: Any) -> Any:
    kind = type(value)
    if kind in _VALUES and (kind not in (str, bytes) or len(value) <= _MAX_TEXT):
        return value
    if kind in (float, complex):
        return repr(value)  # NaN equals itself this way
    if kind in _CONTAINERS:
        return (id(value), len(value))
    return id(value)


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", item) for i, item in enumerate(value[:_MAX_ITEMS])]
    if isinstance(value, dict):
        return [(f"[{key!r:.40}]", item) for key, item in itertools.islice(value.items(), _MAX_ITEMS)]
    if isinstance(value, _LEAVES) or _is_loader(value):
        return []
    try:
        attributes = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return []
    if not isinstance(attributes, dict):
        return []
    return [(f".{name}", item) for name, item in itertools.islice(attributes.items(), _MAX_ATTRIBUTES)]


def _is_loader(value: Any) -> bool:
    kind = type(value)
    return kind.__module__ in _LOADER_MODULES or (kind.__module__, kind.__qualname__) in _LOADER_CLASSES


def picture(dataset: Any) -> Picture:
    """The dataset's picture (see the module)."""
    entries: Picture = {}
    seen: set[int] = set()
    pending = collections.deque([("dataset", dataset, 0)])
    try:  # a new length is a change however it came (the loader's samplers follow it)
        entries["len(dataset)"] = len(dataset)
    except TypeError:
        pass
    while pending and len(entries) < _MAX_ENTRIES:  # breadth first: the top levels always fit
        path, value, depth = pending.popleft()
        entries[path] = _entry(value)
        if depth >= _MAX_DEPTH or id(value) in seen:
            continue
        seen.add(id(value))
        pending.extend((path + name, child, depth + 1) for name, child in _children(value))
    return entries


def first_difference(before: Picture, now: Picture) -> str | None:
    """The path of the first entry that differs between two pictures (or that only one of
    them has); None when none does."""
    missing = object()
    for path, entry in before.items():
        if now.get(path, missing) != entry:
            return path
    return next((path for path in now if path not in before), None)
