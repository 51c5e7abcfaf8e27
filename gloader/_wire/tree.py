"""Nested batch structures: plans of leaves before a batch exists, and maps over tensors after.

A *plan* is what a built-in batchify function returns before any memory is written: nested
lists, tuples and dicts whose leaves are `Leaf` (shape, dtype and a function that fills a
tensor of that shape) or `Opaque` (a value that travels as it is, e.g. a list of strings).
Planning first lets a worker size its shared-memory slot and then write each byte once
(see `_wire.segment`). Runs in workers and in the caller's process.
"""
from __future__ import annotations

from collections.abc import Mapping  # typing's alias checks isinstance ~2x slower
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = ["Leaf", "Opaque", "arrays_to_tensors", "as_torch_dtype", "iter_leaves", "map_structure", "map_tensors",
           "materialize", "numeric_tensor", "plan_from_value", "tensor_bytes"]

_NUMPY_TO_TORCH: dict[np.dtype[Any], torch.dtype] = {}


def as_torch_dtype(dtype: Any) -> torch.dtype | None:
    """Return the torch dtype for a torch or numpy dtype (or its name); None if torch has none."""
    if isinstance(dtype, torch.dtype):
        return dtype
    np_dtype = np.dtype(dtype)
    found = _NUMPY_TO_TORCH.get(np_dtype)
    if found is None:
        try:
            found = torch.from_numpy(np.empty(0, dtype=np_dtype)).dtype
        except (TypeError, ValueError):  # no such tensor type, or not in this machine's byte order
            return None
        _NUMPY_TO_TORCH[np_dtype] = found
    return found


class Leaf:
    """One tensor of a planned batch: `fill(out)` writes it into `out` (shape, dtype given)."""

    __slots__ = ("shape", "dtype", "fill")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill: Callable[[torch.Tensor], None]) -> None:
        self.shape = tuple(map(int, shape))
        self.dtype = dtype
        self.fill = fill

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


class Opaque:
    """A planned value that is not a tensor: it travels by pickle, unchanged."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def iter_leaves(plan: Any) -> Iterator[Leaf]:
    """Yield the plan's leaves in a fixed depth-first order (dict keys in insertion order)."""
    if isinstance(plan, Leaf):
        yield plan
    elif isinstance(plan, (list, tuple)):
        for item in plan:
            yield from iter_leaves(item)
    elif isinstance(plan, dict):
        for item in plan.values():
            yield from iter_leaves(item)


def materialize(plan: Any, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> Any:
    """Build the batch a plan describes, allocating each leaf with `alloc(shape, dtype)`."""
    if isinstance(plan, Leaf):
        out = alloc(plan.shape, plan.dtype)
        plan.fill(out)
        return out
    if isinstance(plan, Opaque):
        return plan.value
    if isinstance(plan, list):
        return [materialize(item, alloc) for item in plan]
    if isinstance(plan, tuple):
        items = [materialize(item, alloc) for item in plan]
        return type(plan)(*items) if hasattr(plan, "_fields") else tuple(items)
    if isinstance(plan, dict):
        return {key: materialize(item, alloc) for key, item in plan.items()}
    raise AssertionError(f"internal error: unexpected plan node {type(plan).__name__}")


def _copy_leaf(value: torch.Tensor) -> Leaf:
    def fill(out: torch.Tensor) -> None:
        out.copy_(value)

    return Leaf(tuple(value.shape), value.dtype, fill)


def plan_from_value(value: Any) -> Any:
    """Plan a batch that already exists (the output of a user's batchify function).

    Tensors and numeric numpy arrays become leaves that are copied once into their
    destination; containers recurse; anything else is opaque.
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested or value.layout != torch.strided:
            return Opaque(value)  # no flat buffer to write: travels by pickle
        return _copy_leaf(value.detach().cpu() if value.device.type != "cpu" else value.detach())
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject or as_torch_dtype(value.dtype) is None:
            return Opaque(value)
        return _copy_leaf(torch.from_numpy(np.ascontiguousarray(value)) if value.ndim else torch.tensor(value))
    if isinstance(value, tuple):
        items = [plan_from_value(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [plan_from_value(item) for item in value]
    if isinstance(value, dict):
        return {key: plan_from_value(item) for key, item in value.items()}
    return Opaque(value)


def map_structure(fn: Callable[[Any], Any], batch: Any) -> Any:
    """Apply `fn` to every leaf nested in lists, tuples (named ones kept) and mappings."""
    if isinstance(batch, list):
        return [map_structure(fn, item) for item in batch]
    if isinstance(batch, tuple):
        mapped = [map_structure(fn, item) for item in batch]
        return type(batch)(*mapped) if hasattr(batch, "_fields") else tuple(mapped)
    if isinstance(batch, Mapping):
        return {key: map_structure(fn, item) for key, item in batch.items()}
    return fn(batch)


def tensor_bytes(batch: Any) -> int:
    """The bytes of the tensors nested in a batch."""
    total = 0

    def add(leaf: Any) -> Any:
        nonlocal total
        if isinstance(leaf, torch.Tensor):
            total += leaf.nbytes
        return leaf

    map_structure(add, batch)
    return total


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], batch: Any) -> Any:
    """Apply `fn` to every tensor nested in lists, tuples (named ones too) and mappings."""
    return map_structure(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, batch)


def numeric_tensor(array: np.ndarray) -> torch.Tensor:
    """A numeric array (one `as_torch_dtype` maps) as a tensor, sharing its memory where torch
    can: a read-only array is copied, and so is a reversed view (x[::-1]), whose negative
    strides torch refuses (found by that refusal: nothing is checked per array otherwise)."""
    try:
        return torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
    except ValueError:
        return torch.from_numpy(np.ascontiguousarray(array))


def _array_to_tensor(leaf: Any) -> Any:
    if not isinstance(leaf, np.ndarray) or leaf.dtype.hasobject or as_torch_dtype(leaf.dtype) is None:
        return leaf
    return numeric_tensor(leaf)


def arrays_to_tensors(batch: Any) -> Any:
    """Turn numeric numpy arrays nested in a batch into tensors that share their memory."""
    return map_structure(_array_to_tensor, batch)
