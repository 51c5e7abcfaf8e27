"""Batchify functions: turn a list of samples into one batch of torch tensors.

Gluon's batchify API (`Stack`, `Pad`, `Group`/`Tuple`, `Dict`, `List`, GluonNLP's `NamedTuple`,
MXNet 2.0's `AsList` and `Append`, and `default_batchify_fn`, which follows torch's
`default_collate`). Each one also *plans* the batch (shapes and dtypes first, data second),
which lets a worker write the batch straight into shared memory, each byte once. Any other
callable works as a batchify function too; its output is copied once. Nothing here starts a
process or touches CUDA.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence  # typing's aliases check isinstance ~2x slower
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from ._checks import check_flag
from ._math import round_up
from ._wire.plans import (
    UnequalSamplesError,
    build_planned,
    check_dtype,
    materialize_host,
    plan_batch,
    plan_default,
    plan_scalars,
    plan_stack,
    sample_tensor,
)
from ._wire.tree import Leaf, Opaque, as_torch_dtype, map_structure, plan_from_value

__all__ = ["Append", "AsList", "Dict", "Group", "List", "NamedTuple", "Pad", "Stack", "Tuple", "UnequalSamplesError",
           "build_planned", "default_batchify_fn", "plan_batch"]

_T = TypeVar("_T")

def default_batchify_fn(samples: list[Any]) -> Any:
    """Batch samples by torch's `default_collate` rules, numpy-first as Gluon does.

    Arrays and tensors stack into a tensor of their dtype; Python and numpy bools, ints and
    floats become bool, int64 and float64 tensors (mixed freely); strings, bytes, numpy string
    scalars and string arrays stay a list; a namedtuple sample becomes the same namedtuple of
    batched fields, any other sequence sample a list of batched fields, and a dict sample a
    dict of batched fields, recursively. Nested tensors stay a list. MXNet NDArrays (any object
    with an `asnumpy()` method) are batched as the arrays that method returns.

    Args:
        samples: the samples of one batch.

    Returns:
        The batch.

    Raises:
        ValueError: when arrays of different shapes would be stacked.
        TypeError: for a field mixing numbers with other values (None), or numpy arrays of a
            dtype torch cannot hold (objects), as torch's `default_collate` does.
    """
    return build_planned(lambda: plan_default(samples), materialize_host)


default_batchify_fn._gloader_plan = plan_default  # type: ignore[attr-defined]  # read by plan_batch


def _written(**arguments: Any) -> str:
    """Keyword arguments as written in a call, leaving out those given as None (the defaults)."""
    return ", ".join(f"{name}={value!r}" for name, value in arguments.items() if value is not None)


class _Batchify:
    """Shared call path: every built-in batchify function is its plan, materialized."""

    _shown = ""  # the arguments its repr shows, as they would be written

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._shown})"

    def __call__(self, samples: list[Any]) -> Any:
        return build_planned(lambda: self._gloader_plan(samples), materialize_host)

    def _gloader_plan(self, samples: list[Any]) -> Any:
        raise NotImplementedError


class Stack(_Batchify):
    """Stack arrays, tensors or numbers along a new first axis.

    Args:
        dtype: output dtype (numpy or torch); None keeps the samples' dtype.
    """

    def __init__(self, dtype: Any = None) -> None:
        self._dtype = check_dtype(dtype)
        self._shown = _written(dtype=dtype)

    def _gloader_plan(self, samples: list[Any]) -> Any:
        if not samples:
            raise ValueError("Stack needs at least one sample, got an empty batch")
        if isinstance(samples[0], (bool, int, float, complex)):
            return plan_scalars(samples, self._dtype)
        return plan_stack(samples, self._dtype)


_UNSET: Any = object()


def _is_zero(value: Any) -> bool:
    """Whether `value` is a number equal to 0 (Pad's default pad_val)."""
    try:
        return isinstance(value, (numbers.Number, np.generic)) and bool(value == 0)
    except (TypeError, ValueError):
        return False


class Pad(_Batchify):
    """Pad arrays to the longest, then stack them.

    Three spellings. GluonNLP 0.x's, `Pad(axis=0, pad_val=0, ret_length=False, dtype=None,
    round_to=None)`, and GluonNLP 1.0's, `Pad(val=0, axis=k)`, pad along one axis. MXNet 2.0's,
    `Pad(val=..., dtype=None, round_to=None)` (`val` named, no `axis`), pads every axis to the
    largest size among the samples; where the samples agree on every other axis, that is the
    same batch as padding axis 0.

    Args:
        axis: the sample axis to pad (samples agree on every other axis).
        pad_val: value written into the padding.
        ret_length: also return an int64 tensor of the original lengths along `axis`.
        dtype: output dtype; None keeps the samples' dtype.
        round_to: round each padded length up to a multiple of this.
        val: the padding value of MXNet 2.0 and GluonNLP 1.0 (None means 0); with no `axis` and
            no `ret_length`, it selects the every-axis form.

    Raises:
        ValueError: for an axis outside the samples' dimensions, other axes that differ, or both
            `val` and `pad_val`.
    """

    def __init__(self, axis: int = 0, pad_val: Any = 0, ret_length: bool = False,
                 dtype: Any = None, round_to: int | None = None, *, val: Any = _UNSET) -> None:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an integer, got {axis!r}")
        if round_to is not None and (isinstance(round_to, bool) or not isinstance(round_to, int) or round_to < 1):
            raise ValueError(f"round_to must be an integer >= 1 or None, got {round_to!r}")
        if val is not _UNSET and not _is_zero(pad_val):
            raise ValueError(f"val={val!r} and pad_val={pad_val!r} both give the padding value (val is MXNet 2.0's and "
                             "GluonNLP 1.0's name, pad_val GluonNLP 0.x's): pass one")
        self._ret_length = check_flag("ret_length", ret_length)
        self._every_axis = val is not _UNSET and axis == 0 and not self._ret_length
        self._axis = axis
        self._pad_val = pad_val if val is _UNSET else (0 if val is None else val)
        self._dtype = check_dtype(dtype)
        self._round_to = round_to
        shown = _written(axis=axis or None, pad_val=None if _is_zero(pad_val) else pad_val,
                         ret_length=ret_length or None, dtype=dtype, round_to=round_to)
        # val=None is shown too: it selects the every-axis form
        self._shown = shown if val is _UNSET else ", ".join(filter(None, [shown, f"val={val!r}"]))

    def _rounded(self, size: int) -> int:
        return round_up(size, self._round_to) if self._round_to else size

    def _gloader_plan(self, samples: list[Any]) -> Any:
        if not samples:
            raise ValueError("Pad needs at least one sample, got an empty batch")
        tensors = [s if isinstance(s, torch.Tensor) else sample_tensor(s, "Pad") for s in samples]
        if self._every_axis:
            return self._plan_every_axis(tensors)
        ndim = tensors[0].dim()
        axis = self._axis + ndim if self._axis < 0 else self._axis
        if not 0 <= axis < ndim or any(t.dim() != ndim for t in tensors):
            raise ValueError(f"Pad(axis={self._axis}) needs samples with the same number of dimensions, "
                             f"more than the axis; got shapes {[tuple(t.shape) for t in tensors[:3]]}")
        lengths = [int(t.shape[axis]) for t in tensors]
        rest = {tuple(t.shape[:axis]) + tuple(t.shape[axis + 1:]) for t in tensors}
        if len(rest) != 1:
            raise ValueError(f"Pad(axis={self._axis}) needs samples that agree on every other axis, "
                             f"got shapes {[tuple(t.shape) for t in tensors[:3]]}")
        longest = self._rounded(max(lengths))
        shape = list(tensors[0].shape)
        shape[axis] = longest
        pad_val = self._pad_val

        def fill(out: torch.Tensor) -> None:
            for row, t, length in zip(out, tensors, lengths):
                row.narrow(axis, 0, length).copy_(t)
                if length < longest:
                    row.narrow(axis, length, longest - length).fill_(pad_val)

        padded = Leaf((len(tensors), *shape), self._dtype or tensors[0].dtype, fill)
        if self._ret_length:
            return (padded, plan_scalars(lengths, torch.int64))
        return padded

    def _plan_every_axis(self, tensors: list[torch.Tensor]) -> Leaf:
        ndim = tensors[0].dim()
        if any(t.dim() != ndim for t in tensors):
            raise ValueError(f"Pad(val=...) needs samples with the same number of dimensions, got shapes "
                             f"{[tuple(t.shape) for t in tensors[:3]]}")
        shape = [self._rounded(max(int(t.shape[d]) for t in tensors)) for d in range(ndim)]
        pad_val = self._pad_val

        def fill(out: torch.Tensor) -> None:
            out.fill_(pad_val)
            for row, t in zip(out, tensors):
                row[tuple(slice(0, size) for size in t.shape)].copy_(t)

        return Leaf((len(tensors), *shape), self._dtype or tensors[0].dtype, fill)


class Group(_Batchify):
    """Apply one batchify function per field of tuple samples; returns a tuple.

    Args:
        *fns: one batchify function per field (or a single list/tuple of them).

    Raises:
        ValueError: at batch time, when a sample has a different number of fields.
    """

    def __init__(self, *fns: Any) -> None:
        if len(fns) == 1 and isinstance(fns[0], (list, tuple)):
            fns = tuple(fns[0])
        if not fns or not all(callable(fn) for fn in fns):
            raise TypeError(f"Group needs one or more batchify functions, got {fns!r}")
        self._fns = fns
        self._shown = ", ".join(map(repr, fns))

    def _gloader_plan(self, samples: list[Any]) -> Any:
        for sample in samples:
            if not isinstance(sample, (tuple, list)) or len(sample) != len(self._fns):
                raise ValueError(f"Group of {len(self._fns)} functions needs samples with {len(self._fns)} "
                                 f"fields, got {type(sample).__name__} {sample!r:.80}")
        return tuple(plan_batch(fn, [sample[i] for sample in samples]) for i, fn in enumerate(self._fns))


Tuple = Group


class Dict(_Batchify):
    """Apply one batchify function per key of dict samples; returns a dict.

    Args:
        fn_dict: key -> batchify function, GluonNLP's form (keys of any type).
        **fns: key -> batchify function, for string keys. Every sample must have exactly the
            keys of both together.
    """

    def __init__(self, fn_dict: Mapping[Any, Callable[[list[Any]], Any]] | None = None, /,
                 **fns: Callable[[list[Any]], Any]) -> None:
        if fn_dict is not None and not isinstance(fn_dict, Mapping):
            raise TypeError(f"Dict takes a mapping of key -> batchify function, or keyword functions; "
                            f"got {type(fn_dict).__name__} {fn_dict!r:.80}")
        clash = sorted(set(fn_dict or ()) & set(fns), key=repr)
        if clash:
            raise ValueError(f"Dict got keys {clash} both in the mapping and as keywords: pass each once")
        merged = {**(fn_dict or {}), **fns}
        if not merged or not all(callable(fn) for fn in merged.values()):
            raise TypeError(f"Dict needs one or more batchify functions, one per key, got {merged!r:.200}")
        self._fns = merged
        self._shown = repr(merged)

    def _gloader_plan(self, samples: list[Any]) -> Any:
        for sample in samples:
            if not isinstance(sample, Mapping) or set(sample.keys()) != set(self._fns):
                raise ValueError(f"Dict with keys {sorted(self._fns, key=repr)} needs dict samples with exactly "
                                 f"these keys, got {type(sample).__name__} {sample!r:.80}")
        return {key: plan_batch(fn, [sample[key] for sample in samples]) for key, fn in self._fns.items()}


class NamedTuple(_Batchify):
    """Apply one batchify function per field of namedtuple samples; returns that namedtuple
    (GluonNLP's `NamedTuple`).

    Args:
        container: the namedtuple class of the samples.
        fns: one batchify function per field, in field order (a list or tuple), or by field
            name (a mapping with exactly the class's fields).

    Raises:
        ValueError: when `fns` does not match the fields, and at batch time for a sample that is
            not a `container`.
    """

    def __init__(self, container: type, fns: Sequence[Callable[[list[Any]], Any]] | Mapping[str, Any]) -> None:
        fields = getattr(container, "_fields", None)
        if not isinstance(container, type) or not issubclass(container, tuple) or fields is None:
            raise TypeError(f"container must be a namedtuple class, got {container!r:.80}")
        if isinstance(fns, Mapping):
            if set(fns) != set(fields):
                raise ValueError(f"NamedTuple({container.__name__}) needs one batchify function per field "
                                 f"{list(fields)}, got keys {list(fns)}")
            fns = [fns[name] for name in fields]
        elif not isinstance(fns, (list, tuple)) or len(fns) != len(fields):
            raise ValueError(f"NamedTuple({container.__name__}) needs a list of {len(fields)} batchify functions "
                             f"(one per field {list(fields)}) or a dict by field name, got {fns!r:.120}")
        if not all(callable(fn) for fn in fns):
            raise ValueError(f"NamedTuple({container.__name__}) needs callable batchify functions, got {fns!r:.120}")
        self._container = container
        self._fields = Group(*fns)
        self._shown = f"{container.__name__}, {list(fns)!r}"

    def _gloader_plan(self, samples: list[Any]) -> Any:
        for sample in samples:
            if not isinstance(sample, self._container):
                raise ValueError(f"NamedTuple({self._container.__name__}) needs {self._container.__name__} samples, "
                                 f"got {type(sample).__name__} {sample!r:.80}")
        return self._container(*self._fields._gloader_plan(samples))


class List(_Batchify):
    """Keep the samples as a plain list (no stacking)."""

    def _gloader_plan(self, samples: list[Any]) -> Any:
        return Opaque(list(samples))


AsList = List  # MXNet 2.0's name


class Append(_Batchify):
    """Keep the samples apart: a list of tensors, one per sample (MXNet 2.0's `Append`).

    Args:
        expand: give each sample a batch axis of size 1.
        batch_axis: where that axis goes.
    """

    def __init__(self, expand: bool = True, batch_axis: int = 0) -> None:
        if isinstance(batch_axis, bool) or not isinstance(batch_axis, int):
            raise TypeError(f"batch_axis must be an integer, got {batch_axis!r}")
        self._expand = check_flag("expand", expand)
        self._batch_axis = batch_axis
        self._shown = _written(expand=None if self._expand else False, batch_axis=batch_axis or None)

    def _gloader_plan(self, samples: list[Any]) -> Any:
        out = []
        for sample in samples:
            tensor = sample if isinstance(sample, torch.Tensor) else sample_tensor(np.ascontiguousarray(sample),
                                                                                      "Append")
            out.append(plan_from_value(tensor.unsqueeze(self._batch_axis) if self._expand else tensor))
        return out


def _scalar_to_tensor(value: Any) -> Any:
    if isinstance(value, np.generic) and as_torch_dtype(value.dtype) is not None and value.dtype.kind not in "US":
        return torch.as_tensor(value)
    return value


class EachSample(_Batchify):  # used by the loader for batch_size=None; not part of the API
    """torch's unbatched mode (`batch_size=None`): each batch is one sample, given to `fn`,
    or by default converted as torch's `default_convert` does (numpy arrays and numeric
    numpy scalars become tensors; containers keep their shape)."""

    def __init__(self, fn: Callable[[Any], Any] | None = None) -> None:
        self.fn = fn

    def _gloader_plan(self, samples: list[Any]) -> Any:
        if self.fn is not None:
            return plan_from_value(self.fn(samples[0]))
        return plan_from_value(map_structure(_scalar_to_tensor, samples[0]))
