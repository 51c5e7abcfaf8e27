"""What a loader ships to its workers, checked for picklability before any worker starts.

The dataset first becomes what the workers load from: gloader's own datasets hold their lists
of Python objects once (`dataset.shared_copy`), and a dataset that holds a large list or dict of
Python objects anyway is named in a warning, once. Under fork (and for thread workers) the
objects are inherited as they are. Under spawn and forkserver, and for loaders joining a running
shared pool, the parts are pickled once, with the standard (C) pickler: only what it cannot send
by reference (a lambda, a function or class defined in `__main__`, a notebook, or a function)
goes by value with dill, and large buffers (numpy arrays, the records of a SharedList) go out of
band, into one shared segment every worker maps (`_wire.segment.SharedBuffers`), or, for Ray, to its
object store once. A failure names the part and the attribute path that could not be pickled.
Runs in the caller's process. The whole flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import types
import warnings
from typing import Any

from .._datasets.records import python_objects
from .._wire.segment import SharedBuffers
from .._worker.registry import Payload, from_dill
from ..dataset import shared_copy

__all__ = ["build_payload", "warn_if_copied"]

# How deep the search for the unpicklable attribute goes. Deeper: a more precise path for
# deeply nested datasets; shallower: a faster error message.
_MAX_SEARCH_DEPTH = 6


_PICKLER: Any = None


def _pickler_class() -> Any:
    """dill's pickler, saving every importable module by reference.

    With `recurse=True` (which lets a notebook function carry the globals it uses), dill saves
    a module that is not installed under sys.prefix (an editable install, the user's own
    project modules) together with its whole namespace, which fails on the first lock or
    thread-local in it. Workers see the caller's sys.path, so such modules import there.
    """
    global _PICKLER
    if _PICKLER is None:
        import dill

        class _PayloadPickler(dill.Pickler):  # type: ignore[misc]
            dispatch = type(dill.Pickler.dispatch)(dill.Pickler.dispatch)

        default_save_module = dill.Pickler.dispatch[types.ModuleType]

        def save_module(pickler: Any, module: types.ModuleType) -> None:
            if module.__name__ != "__main__" and sys.modules.get(module.__name__) is module:
                pickler.save_reduce(importlib.import_module, (module.__name__,), obj=module)
            else:
                default_save_module(pickler, module)

        _PayloadPickler.dispatch[types.ModuleType] = save_module
        _PICKLER = _PayloadPickler
    return _PICKLER


def _pickler(buffer: io.BytesIO) -> Any:
    return _pickler_class()(buffer, protocol=pickle.HIGHEST_PROTOCOL, recurse=True)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _pickler(buffer).dump(obj)
    return buffer.getvalue()


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return [(f".{key}", value) for key, value in state.items()]
    return []


def find_unpicklable(obj: Any, path: str, depth: int = 0) -> str:
    """Return the deepest attribute path below `path` whose value cannot be pickled."""
    if depth < _MAX_SEARCH_DEPTH:
        for suffix, child in _children(obj):
            try:
                _dumps(child)
            except Exception:
                return find_unpicklable(child, path + suffix, depth + 1)
    return f"{path} ({type(obj).__name__})"


def _unpicklable_error(name: str, obj: Any, exc: Exception) -> TypeError:
    culprit = find_unpicklable(obj, name)
    return TypeError(f"the {name} cannot be pickled for the workers ({type(exc).__name__}: {exc}); the "
                     f"first part that fails is {culprit}. Open files, locks, sockets, generators and "
                     "database handles cannot be sent to another process: open them lazily inside "
                     "__getitem__ (or in worker_init_fn), or use start_method='fork' or thread_pool=True")


def build_payload(dataset: Any, batchify_fn: Any, worker_init_fn: Any, base_seed: int,
                  pickled: bool, shared: bool = True, processes: bool = True) -> Payload:
    """Return a loader's payload: the dataset as the workers load from it (see the module), with
    `pickled`, the three parts dumped one after another by one pickler, so objects they share (a
    bound method's dataset) stay one object; `shared`: the large buffers in a shared segment
    (else kept as arrays, for Ray's object store). `processes`: the workers are processes (a
    warning names the dataset's lists of Python objects that each would copy).

    Raises:
        TypeError: when a part cannot be pickled, naming the part and the attribute path.
    """
    held = shared_copy(dataset) if processes else dataset  # threads and the caller read the dataset itself
    if processes:
        warn_if_copied(held)
    parts = (held, _rebound(batchify_fn, dataset, held), _rebound(worker_init_fn, dataset, held))
    if not pickled:
        return Payload(parts, base_seed, False)
    buffer, large = io.BytesIO(), list[pickle.PickleBuffer]()
    pickler = _PartsPickler(buffer, large)
    for name, part in zip(("dataset", "batchify function", "worker_init_fn"), parts):
        try:
            pickler.dump(part)
        except Exception as exc:
            raise _unpicklable_error(name, part, exc) from exc
    buffers: Any = None
    if large:
        raws = [view.raw() for view in large]
        buffers = SharedBuffers(raws) if shared else [_array_of(raw) for raw in raws]
    return Payload(buffer.getvalue(), base_seed, True, buffers=buffers)


# A buffer this large or larger goes out of band (see the module); smaller ones stay in the pickle.
_OUT_OF_BAND_BYTES = 64 << 10


class _PartsPickler(pickle.Pickler):
    """The standard pickler, with dill for what it cannot send by reference (see `_by_value`),
    and the large buffers of protocol 5 collected out of band in `large`."""

    def __init__(self, file: io.BytesIO, large: list[pickle.PickleBuffer]) -> None:
        def out_of_band(view: pickle.PickleBuffer) -> bool:
            if view.raw().nbytes < _OUT_OF_BAND_BYTES:
                return True  # in band
            large.append(view)
            return False

        super().__init__(file, protocol=5, buffer_callback=out_of_band)

    def reducer_override(self, obj: Any) -> Any:
        # The C pickler asks here for objects of other types than the builtin ones (dict, list,
        # str, int...), so a list of a million dicts costs no Python call per record.
        if isinstance(obj, (types.FunctionType, type)) and _by_value(obj):
            return from_dill, (_dumps(obj),)
        return NotImplemented


def _by_value(obj: Any) -> bool:
    """Whether a function or class cannot be pickled by reference: a worker could not import it
    by its module and name (a lambda, one defined in a function, in `__main__` or a notebook)."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<" in name:
        return True
    found: Any = sys.modules.get(module)
    for part in name.split("."):
        found = getattr(found, part, None)
    return found is not obj


def _array_of(raw: memoryview) -> Any:
    import numpy as np

    return np.frombuffer(raw, dtype=np.uint8)  # a view: Ray puts it in its object store once


def _rebound(fn: Any, dataset: Any, held: Any) -> Any:
    """`fn`, a method bound to the caller's dataset, bound to the copy the workers load from."""
    if held is not dataset and isinstance(fn, types.MethodType) and fn.__self__ is dataset:
        return types.MethodType(fn.__func__, held)
    return fn


_WARNED: set[str] = set()


def warn_if_copied(dataset: Any) -> None:
    """Warn, once a process for each, about a list or dict of many Python objects the dataset
    holds (as a top-level attribute, or one level down): every worker process copies it as it
    reads it (reading an object writes its reference count), and it is named with the memory
    that costs each worker and the one-line fix."""
    for path, value in _attributes(dataset):
        if path in _WARNED or not (python_objects(value) or _objects_dict(value)):
            continue
        _WARNED.add(path)
        kind, fix = ("dict", "gloader.SharedDict") if isinstance(value, dict) else ("list", "gloader.SharedList")
        attribute = path.partition(".")[2].split("[")[0]
        hold = (f"{attribute} = {fix}(...) in the dataset's __init__" if attribute
                else f"pass {fix}(...) of it as the dataset")  # the dataset is the container itself
        warnings.warn(f"{path} is a {kind} of {len(value):,} Python objects (about {_estimate_mb(value):,.0f} MB): "
                      "each worker process copies it as it reads it, since reading an object writes its reference "
                      f"count, about that much memory per worker (and, under spawn, the time to unpickle it). "
                      f"Hold it once: {hold} (or numpy arrays for numbers)", RuntimeWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The stack level of the first frame outside gloader: where the user's code asked for the
    batch that started the workers."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("gloader."):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]  # None ends the walk
    return level


def _attributes(dataset: Any) -> list[tuple[str, Any]]:
    """The dataset's attributes (and theirs, one level down, and a dict's values), with their paths."""
    name = type(dataset).__name__
    found = [(name, dataset)] if isinstance(dataset, (list, dict)) else []
    for attribute, value in list(getattr(dataset, "__dict__", {}).items()):
        found.append((f"{name}.{attribute}", value))
        if isinstance(value, dict) and not _objects_dict(value):
            found += [(f"{name}.{attribute}[{key!r}]", item) for key, item in list(value.items())[:32]]
    return found


def _objects_dict(value: Any) -> bool:
    return isinstance(value, dict) and len(value) >= 10_000


def _estimate_mb(value: Any) -> float:
    """What the container and its objects take, from a sample of them."""
    items = list(value.values()) if isinstance(value, dict) else value
    sample = items[:: max(1, len(items) // 200)][:200]
    each = sum(_deep_size(item) for item in sample) / max(1, len(sample))
    return (sys.getsizeof(value) + each * len(items)) / 2**20


def _deep_size(item: Any) -> int:
    size = sys.getsizeof(item)
    if isinstance(item, dict):
        size += sum(sys.getsizeof(key) + sys.getsizeof(value) for key, value in item.items())
    elif isinstance(item, (list, tuple)):
        size += sum(sys.getsizeof(value) for value in item)
    return size



