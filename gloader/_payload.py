"""What a loader ships to its workers, checked for picklability before any worker starts.

Under fork (and for thread workers) the objects are inherited as they are. Under spawn and
forkserver, and for loaders joining a running shared pool, each part is pickled with dill
(so classes and lambdas defined in `__main__` or a notebook travel by value), one part at a
time, so that a failure names the part and the attribute path that could not be pickled.
Runs in the caller's process. The whole flow is drawn in `_engine`.
"""
from __future__ import annotations

import importlib
import io
import pickle
import sys
import types
from typing import Any

from ._registry import Payload

__all__ = ["build_payload"]

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
                  pickled: bool) -> Payload:
    """Return a loader's payload; with `pickled`, the three parts are dumped one after another
    by one dill pickler, so objects they share (a bound method's dataset) stay one object.

    Raises:
        TypeError: when a part cannot be pickled, naming the part and the attribute path.
    """
    parts = (dataset, batchify_fn, worker_init_fn)
    if not pickled:
        return Payload(parts, base_seed, False)
    buffer = io.BytesIO()
    pickler = _pickler(buffer)
    for name, part in zip(("dataset", "batchify function", "worker_init_fn"), parts):
        try:
            pickler.dump(part)
        except Exception as exc:
            raise _unpicklable_error(name, part, exc) from exc
    return Payload(buffer.getvalue(), base_seed, True)
