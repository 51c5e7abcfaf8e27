"""How samples become a batch's plan (shapes and dtypes first, data second), the machinery
behind `gloader.batchify`'s functions: stacking arrays, tensors and numbers with torch's
`default_collate` rules, dtype promotion, and the error for samples that cannot be stacked.
A plan lets a worker write the batch straight into shared memory (`_worker.fetch`, `_worker.rows`). Nothing
here starts a process or touches CUDA.
"""
from __future__ import annotations

import functools
import numbers
import operator
import threading
from collections.abc import Mapping, Sequence  # typing's aliases check isinstance ~2x slower
from typing import Any, Callable, Literal, TypeVar

import numpy as np
import torch

from .tree import Leaf, Opaque, as_torch_dtype, materialize, numeric_tensor, plan_from_value

__all__ = ["UnequalSamplesError", "build_planned", "check_dtype", "materialize_host", "plan_batch", "plan_default",
           "plan_scalars", "plan_stack", "sample_tensor"]

_T = TypeVar("_T")

# np.stack takes `casting` from numpy 1.24; before it (MXNet 1.9 pins numpy below 1.24, so a
# Gluon user moving over may have one), the same fill is a concatenation of 1-row views.
_STACK_CASTS = np.lib.NumpyVersion(np.__version__) >= "1.24.0"


def _stack_into(arrays: Sequence[Any], target: np.ndarray, cast: Any) -> None:
    if _STACK_CASTS:
        np.stack(arrays, axis=0, out=target, casting=cast)
    else:
        np.concatenate([a[np.newaxis] for a in arrays], axis=0, out=target, casting=cast)


def materialize_host(plan: Any) -> Any:
    """The batch of `plan` in ordinary host memory (a worker writes it into its slot instead)."""
    return materialize(plan, lambda shape, dtype: torch.empty(shape, dtype=dtype))


def plan_batch(batchify_fn: Callable[[list[Any]], Any], samples: list[Any]) -> Any:
    """Return the plan of `batchify_fn(samples)`: planned directly by built-in functions,
    otherwise computed and then planned from its output."""
    planner = getattr(batchify_fn, "_gloader_plan", None)
    if planner is not None:
        return planner(samples)
    return plan_from_value(batchify_fn(samples))


class _MixedDtypes(Exception):
    """Raised by the fill of a numpy field planned with its first array's dtype, when the
    field's arrays turn out to have several: the batch is planned again (see build_planned)."""


class _Promoting(threading.local):
    """Set while a batch is planned again: numpy fields then take the dtype that torch's type
    promotion gives their arrays. Per thread: thread workers plan batches side by side."""

    active = False


_PROMOTING = _Promoting()


def build_planned(plan: Callable[[], Any], build: Callable[[Any], _T]) -> _T:
    """`build(plan())`; where a numpy field mixes dtypes, planned and built again with each such
    field's dtype promoted over its arrays, as torch's default_collate does.

    A field of numpy arrays is planned with its first array's dtype and filled with no casting
    allowed, so a batch of one dtype pays nothing for the check: the fill finds the rare mixed
    one. `build` must undo what its first try did (it runs again from the start).
    """
    try:
        return build(plan())
    except _MixedDtypes:
        pass
    _PROMOTING.active = True
    try:
        return build(plan())
    finally:
        _PROMOTING.active = False


def _promoted(dtypes: Any) -> torch.dtype:
    """torch's promotion of numpy or torch dtypes (int64 with float32 gives float32, as
    torch.stack does); a TypeError naming a dtype torch cannot hold."""
    found = []
    for dtype in dtypes:
        torch_dtype = as_torch_dtype(dtype)
        if torch_dtype is None:
            shown = sorted(map(str, dtypes))
            raise TypeError(f"cannot stack samples of numpy dtypes {shown} into one tensor: torch has no dtype for "
                            f"{dtype}; {_dtype_hint(np.dtype(dtype))}convert them in the dataset, or give this field "
                            "a batchify function such as gloader.batchify.List()")
        found.append(torch_dtype)
    return functools.reduce(torch.promote_types, found)


def check_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    try:
        found = as_torch_dtype(dtype)
    except TypeError:
        found = None
    if found is None:
        raise TypeError(f"dtype must be a numeric numpy or torch dtype, got {dtype!r}")
    return found


_PLAIN_KINDS = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _numeric_kind(items: Sequence[Any]) -> torch.dtype:
    """bool, int64, float64 or complex128, numpy-first: Python and numpy scalars mix freely."""
    kinds = set(map(type, items))
    if len(kinds) == 1 and next(iter(kinds)) in _PLAIN_KINDS:  # the usual batch: one Python type
        return _PLAIN_KINDS[next(iter(kinds))]
    if all(issubclass(kind, (bool, np.bool_)) for kind in kinds):
        return torch.bool
    if all(issubclass(kind, (int, np.integer, np.bool_)) for kind in kinds):
        return torch.int64
    if all(issubclass(kind, (int, float, np.integer, np.floating, np.bool_)) for kind in kinds):
        return torch.float64
    if all(issubclass(kind, (numbers.Number, np.number, np.bool_)) for kind in kinds):
        return torch.complex128
    shown = [item for item in items if not isinstance(item, (numbers.Number, np.number, np.bool_))][:3]
    raise TypeError(f"cannot batch numbers together with {shown!r} (batch {list(items)[:8]!r}); return the "
                    "same kind of value for this field in every sample, or give a batchify_fn that handles it")


def plan_scalars(items: Sequence[Any], dtype: torch.dtype | None) -> Leaf:
    out_dtype = dtype or _numeric_kind(items)
    values = items if isinstance(items, (list, tuple)) else list(items)

    def fill(out: torch.Tensor) -> None:
        try:
            out.numpy()[:] = values  # ~5x faster than torch.tensor(values) for 256 ints
        except TypeError:  # a dtype numpy lacks (bfloat16)
            out.copy_(torch.tensor(values, dtype=out_dtype))
        except OverflowError:
            shown = [v for v in values if isinstance(v, int) and not -2**63 <= v < 2**63][:3] or list(values)[:8]
            raise OverflowError(f"cannot batch {shown!r} as {out_dtype}: out of its range; convert them in the "
                                "dataset (to float, or to strings with a batchify_fn that keeps them)") from None

    return Leaf((len(values),), out_dtype, fill)


class UnequalSamplesError(ValueError, RuntimeError):
    """Samples of one batch that cannot be stacked (shapes or lengths differ). A ValueError,
    and a RuntimeError as torch's default_collate raises for the same samples, so code written
    against either catches it."""

    __module__ = "gloader.batchify"  # where users import it from


def _shape_error(shapes: list[tuple[int, ...]]) -> UnequalSamplesError:
    distinct = sorted(set(shapes))[:3]
    return UnequalSamplesError(f"cannot stack samples of different shapes {distinct}; pad them with "
                               "gloader.batchify.Pad or give the DataLoader a batchify_fn that handles them")


_NDARRAY_ONLY = {np.ndarray}
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _plan_tensor_stack(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None) -> Leaf | Opaque:
    """`plan_stack` for samples with a tensor among them (all made tensors)."""
    shapes = set(map(_SHAPE, tensors))
    if len(shapes) != 1:
        raise _shape_error([tuple(s) for s in shapes])
    if any(map(_REQUIRES_GRAD, tensors)):  # stacked as torch does, the graph kept (in-process only)
        return Opaque(torch.stack([t if dtype is None else t.to(dtype) for t in tensors]))
    dtypes = set(map(_DTYPE, tensors))
    out_dtype = dtype or (tensors[0].dtype if len(dtypes) == 1 else _promoted(dtypes))  # torch.stack's rule
    same_dtype = dtypes == {out_dtype}

    def fill_tensors(out: torch.Tensor) -> None:
        if not same_dtype:
            for row, t in zip(out, tensors):
                row.copy_(t)
            return
        torch.stack(list(tensors), out=out)

    return Leaf((len(tensors),) + tuple(tensors[0].shape), out_dtype, fill_tensors)


def plan_stack(items: Sequence[Any], dtype: torch.dtype | None) -> Leaf | Opaque:
    """Stack arrays/tensors/numpy scalars along a new first axis.

    Checks run at C speed (`set(map(...))`): this is per batch and per field in the worker.
    """
    kinds = set(map(type, items))
    if kinds != _NDARRAY_ONLY and any(issubclass(kind, torch.Tensor) for kind in kinds):
        return _plan_tensor_stack(items if kinds == {torch.Tensor} else [torch.as_tensor(item) for item in items],
                                  dtype)
    arrays: Sequence[Any] = items if kinds == {np.ndarray} else [np.asarray(item) for item in items]
    first_shape = arrays[0].shape
    # Concatenating n arrays of shape (d0, ...) into the memory of the stack seen as
    # (n * d0, ...) writes the same bytes with ~3x less overhead than np.stack(out=). numpy
    # checks every array's other dimensions against that target; equal lengths (~3x cheaper
    # to check than the shapes themselves) complete the check.
    try:
        concatenates = bool(first_shape) and first_shape[0] > 0 and set(map(len, arrays)) == {first_shape[0]}
    except TypeError:  # a 0-d array after the first: len() has nothing to measure; the shapes say what differs
        concatenates = False
    if not concatenates:
        shapes = set(map(_SHAPE, arrays))
        if len(shapes) != 1:
            raise _shape_error(list(shapes))
    # Without a dtype given, the first array's is assumed and the fill allows no casting
    # ('equiv': byte order only): it finds a field of several dtypes (raising _MixedDtypes),
    # which is then planned again with the dtypes promoted (see build_planned). numpy's 'no'
    # refuses the same dtypes but costs ~2 us more per 256 arrays.
    cast: Literal["unsafe", "equiv"] = "equiv"
    if dtype is not None:
        found: torch.dtype | None = dtype
        cast = "unsafe"
    elif _PROMOTING.active:
        found = _promoted(set(map(_DTYPE, arrays)))
        cast = "unsafe"
    else:
        found = as_torch_dtype(arrays[0].dtype)
    if found is None:
        raise TypeError(f"cannot stack samples of numpy dtype {arrays[0].dtype} into a tensor; "
                        f"{_dtype_hint(arrays[0].dtype)}use gloader.batchify.List() for non-numeric fields")

    def fill_arrays(out: torch.Tensor) -> None:
        target = out.numpy()
        try:
            if not concatenates:
                _stack_into(arrays, target, cast)
                return
            np.concatenate(arrays, axis=0, out=target.reshape((-1,) + first_shape[1:]), casting=cast)
        except ValueError:
            shapes = set(map(_SHAPE, arrays))
            if len(shapes) != 1:
                raise _shape_error(list(shapes)) from None
            raise
        except TypeError:
            if cast == "equiv" and len(set(map(_DTYPE, arrays))) > 1:
                raise _MixedDtypes from None
            raise

    return Leaf((len(arrays),) + arrays[0].shape, found, fill_arrays)


def _dtype_hint(dtype: np.dtype[Any]) -> str:
    """What to do about a numeric dtype that torch refuses only for its byte order."""
    if dtype.isnative or dtype.kind not in "biufc":
        return ""
    return "its byte order is not this machine's: array.astype(array.dtype.newbyteorder('=')) fixes that; "


def sample_tensor(sample: Any, name: str) -> torch.Tensor:
    """`sample` as a tensor sharing its memory; a TypeError naming it when it is not numeric."""
    array = np.asarray(sample)
    if array.dtype.hasobject or as_torch_dtype(array.dtype) is None:
        raise TypeError(f"{name} needs numeric arrays, tensors or numbers, got {sample!r:.80} (numpy dtype "
                        f"{array.dtype}); give this field a batchify function such as gloader.batchify.List()")
    return numeric_tensor(array)


def _plan_array_field(samples: Sequence[Any]) -> Any:
    first = samples[0]
    if isinstance(first, np.ndarray) and first.dtype.kind in "US":
        return Opaque(list(samples))  # string arrays: torch has no string tensors
    if isinstance(first, np.ndarray) and (first.dtype.hasobject or as_torch_dtype(first.dtype) is None):
        raise TypeError(f"the default batchify cannot batch numpy arrays of dtype {first.dtype} (as torch's "
                        f"default_collate cannot); {_dtype_hint(first.dtype)}convert them in the dataset, or give a "
                        "batchify_fn such as gloader.batchify.List()")
    if isinstance(first, torch.Tensor) and first.is_nested:
        return Opaque(list(samples))  # nested tensors do not stack; they travel as they are
    if isinstance(first, torch.Tensor) and first.layout != torch.strided:
        raise TypeError(f"the default batchify cannot batch tensors of layout {first.layout} (as torch's "
                        "default_collate cannot): return tensor.to_dense() from the dataset, or give a batchify_fn "
                        "such as gloader.batchify.List(), which keeps them as a list")
    return plan_stack(samples, None)


def plan_default(samples: Sequence[Any]) -> Any:
    if not samples:
        return Opaque([])
    first = samples[0]
    if isinstance(first, (str, bytes)):  # numpy string scalars too: np.str_ is a str
        return Opaque(list(samples))
    if isinstance(first, (torch.Tensor, np.ndarray)):
        return _plan_array_field(samples)
    if isinstance(first, np.generic):
        if any(not isinstance(item, np.generic) for item in samples):
            return plan_scalars(samples, None)  # numpy and Python scalars mixed
        return _plan_array_field(samples)
    if isinstance(first, (bool, int, float, complex)):
        return plan_scalars(samples, None)
    if isinstance(first, Mapping):
        keys = list(first.keys())
        key_set = set(keys)
        for sample in samples:  # in any order, as torch's default_collate takes them (by the first's)
            if not isinstance(sample, Mapping) or (sample.keys() != key_set):
                raise ValueError(f"dict samples of one batch must have the same keys, got {keys} and "
                                 f"{list(sample.keys()) if isinstance(sample, Mapping) else type(sample).__name__}")
        return {key: plan_default([sample[key] for sample in samples]) for key in keys}
    if isinstance(first, Sequence):
        try:
            columns = list(zip(*samples, strict=True))  # checks the lengths as it goes, at C speed
        except ValueError:
            lengths = set(map(len, samples))
            if len(lengths) == 1:
                raise  # not the lengths: a sample's own iteration failed
            raise UnequalSamplesError(f"sequence samples of one batch must have the same length, got lengths "
                                      f"{sorted(lengths)}") from None
        fields = [plan_default(column) for column in columns]
        return type(first)(*fields) if hasattr(first, "_fields") else fields  # a namedtuple stays one
    if hasattr(first, "asnumpy"):  # MXNet NDArrays, as Gluon's datasets return: batched as their numpy arrays
        return plan_default([item.asnumpy() if hasattr(item, "asnumpy") else item for item in samples])
    return Opaque(list(samples))
