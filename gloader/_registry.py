"""Worker-side registry of loaders, keyed by loader id, and `get_worker_info`.

Every worker (process or thread) holds the dataset, batchify function, `worker_init_fn` and
seed of each loader it serves under that loader's id, so that several loaders (or one thread
pool serving several loaders) never see each other's data. Filled by the pool initializer
(`_worker.initialize_worker`) or, for a loader that joins a running pool, from its payload
file on the worker's first task for it. Never imports caller-side code.
"""
from __future__ import annotations

import dataclasses
import threading
import traceback
from typing import Any, Callable, NamedTuple

import numpy as np

__all__ = ["Payload", "Registration", "WorkerInfo", "get_worker_info", "lookup", "register_loader",
           "registered_from_file", "registered_ids", "set_current_info", "unregister_loader"]


class WorkerInfo(NamedTuple):
    """What a dataset can learn about the worker loading it.

    Attributes:
        id: worker index in [0, num_workers).
        num_workers: workers in the pool.
        seed: the seed of the batch being loaded (derived from the loader's seed, the epoch
            and the batch index), or the worker's seed inside `worker_init_fn`.
        dataset: this worker's copy of the dataset.
        rng: a numpy Generator seeded with `seed`; the reproducible source of randomness
            with `thread_pool=True`, where the global generators are shared.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any
    rng: np.random.Generator


@dataclasses.dataclass
class Payload:
    """What a loader ships to its workers. Parts are objects, or dill bytes under spawn."""

    dataset: Any
    batchify_fn: Any
    worker_init_fn: Any
    base_seed: int
    prefix: str
    pickled: bool


@dataclasses.dataclass
class Registration:
    """One loader as a worker holds it; `error` is set when registering failed."""

    dataset: Any = None
    batchify_fn: Callable[[list[Any]], Any] | None = None
    base_seed: int = 0
    prefix: str = ""
    error: BaseException | None = None
    error_traceback: str = ""
    error_context: str = ""
    from_file: bool = False


_LOCK = threading.Lock()
_LOADERS: dict[int, Registration] = {}
_LOCAL = threading.local()


def set_current_info(info: WorkerInfo | None) -> None:
    """Publish the WorkerInfo of the batch being loaded on this thread (None to clear)."""
    _LOCAL.info = info


def get_worker_info() -> WorkerInfo | None:
    """Return the calling worker's `WorkerInfo`, or None in the main process.

    Returns:
        The info of the batch being loaded (or of the worker, inside `worker_init_fn`).
    """
    return getattr(_LOCAL, "info", None)


def _load_part(part: Any, pickled: bool) -> Any:
    if not pickled or part is None:
        return part
    import dill

    return dill.loads(part)


def register_loader(loader_id: int, payload: Payload, worker_id: int, num_workers: int,
                    from_file: bool = False) -> None:
    """Register a loader in this worker and run its `worker_init_fn(worker_id)`. Never raises.

    A failure (unpickling, `worker_init_fn`) is kept in the registration and reported by the
    loader's first task, so that a pool initializer never fails and respawns in a loop.
    """
    registration = Registration(base_seed=payload.base_seed, prefix=payload.prefix, from_file=from_file)
    stage = "dataset"
    try:
        registration.dataset = _load_part(payload.dataset, payload.pickled)
        stage = "batchify_fn"
        registration.batchify_fn = _load_part(payload.batchify_fn, payload.pickled)
        stage = "worker_init_fn"
        worker_init_fn = _load_part(payload.worker_init_fn, payload.pickled)
        if worker_init_fn is not None:
            stage = "worker_init_fn call"
            seed = (payload.base_seed + worker_id) & ((1 << 63) - 1)
            set_current_info(WorkerInfo(worker_id, num_workers, seed, registration.dataset,
                                        np.random.default_rng(seed)))
            try:
                worker_init_fn(worker_id)
            finally:
                set_current_info(None)
    except BaseException as exc:  # reported by the first task; see docstring
        registration.error = exc
        registration.error_traceback = traceback.format_exc()
        registration.error_context = {
            "dataset": "the dataset could not be unpickled in the worker",
            "batchify_fn": "the batchify function could not be unpickled in the worker",
            "worker_init_fn": "worker_init_fn could not be unpickled in the worker",
            "worker_init_fn call": "worker_init_fn raised",
        }[stage]
    with _LOCK:
        _LOADERS[loader_id] = registration


def unregister_loader(loader_id: int) -> None:
    """Drop a loader's registration (and with it this worker's reference to its dataset)."""
    with _LOCK:
        _LOADERS.pop(loader_id, None)


def lookup(loader_id: int) -> Registration | None:
    """Return the registration of `loader_id`, or None when this worker has none."""
    return _LOADERS.get(loader_id)


def registered_ids() -> list[int]:
    """Ids of every loader registered in this worker."""
    with _LOCK:
        return sorted(_LOADERS)


def registered_from_file() -> list[int]:
    """Ids of the loaders this worker registered from payload files (shared pools)."""
    with _LOCK:
        return [key for key, reg in _LOADERS.items() if reg.from_file]
