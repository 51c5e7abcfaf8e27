"""Worker-side registry of loaders, keyed by loader id, and `get_worker_info`.

Every worker (process or thread) holds the dataset, batchify function, `worker_init_fn` and
seed of each loader it serves under that loader's id, so that several loaders (or one thread
pool serving several loaders) never see each other's data. Filled by the pool initializer
(`_worker.run.initialize_process_worker`, `_worker.run.initialize_thread_worker`) or, for a loader that joins a running pool, from its payload
file on the worker's first task for it. Never imports caller-side code.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import threading
import traceback
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from .._wire.seed import seed_global_rng

__all__ = ["Payload", "Registration", "WorkerInfo", "get_worker_info", "lookup", "register_loader", "renewed",
           "registered_from_file", "registered_ids", "set_current_info", "set_torch_worker_info",
           "unregister_loader"]


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
    """What a loader ships to its workers.

    `parts` is (dataset, batchify_fn, worker_init_fn), or, when `pickled`, the bytes of the three
    dumped one after another by one pickler (see `_caller.payload`): one object graph, so a
    `worker_init_fn` that is a method of the dataset configures the very dataset that loads.
    """

    parts: Any
    base_seed: int
    pickled: bool
    fetch_threads: int | str | None = None  # the loader's fetch_threads (see _fetch.Fetcher)
    # The pickle's large buffers, sent out of band: a `_wire.segment.SharedBuffers` the workers map,
    # or (Ray's object store keeps them) the arrays themselves; None: all in `parts`.
    buffers: Any = None


@dataclasses.dataclass
class Registration:
    """One loader as a worker holds it; `error` is set when registering failed."""

    dataset: Any = None
    batchify_fn: Callable[[list[Any]], Any] | None = None
    base_seed: int = 0
    error: BaseException | None = None
    error_traceback: str = ""
    error_context: str = ""
    from_file: bool = False
    torch_info: Any = None  # what torch.utils.data.get_worker_info() returns in a process worker
    fetch_threads: int | str | None = None
    fetcher: Any = None  # made at the first batch (see _fetch.Fetcher)
    again: Callable[[], None] | None = None  # registers anew (worker_init_fn raised; see `renewed`)
    failed_epoch: int | None = None  # the epoch whose tasks report the failure


_LOCK = threading.Lock()
_LOADERS: dict[int, Registration] = {}
_LOCAL = threading.local()


def set_current_info(parts: tuple[int, int, int, Any] | None) -> None:
    """Publish `(worker id, num_workers, seed, dataset)` of the batch being loaded on this
    thread (None to clear). Its `WorkerInfo` is built on the first `get_worker_info()` of the
    batch: a batch whose dataset never asks skips making the generator (~8 us, a third of
    the per-batch seeding cost)."""
    _LOCAL.parts = parts
    _LOCAL.info = None


def get_worker_info() -> WorkerInfo | None:
    """Return the calling worker's `WorkerInfo`, or None in the main process.

    Returns:
        The info of the batch being loaded (or of the worker, inside `worker_init_fn`); the
        same object for every call during one batch, so `rng` continues its stream.
    """
    info: WorkerInfo | None = getattr(_LOCAL, "info", None)
    if info is None:
        parts = getattr(_LOCAL, "parts", None)
        if parts is None:
            return None
        worker_id, num_workers, seed, dataset = parts
        info = _LOCAL.info = WorkerInfo(worker_id, num_workers, seed, dataset, np.random.default_rng(seed))
    return info


_STAGE_FAILURES = {
    "dataset": "the dataset could not be unpickled in the worker",
    "batchify_fn": "the batchify function could not be unpickled in the worker",
    "worker_init_fn": "worker_init_fn could not be unpickled in the worker",
    "worker_init_fn call": "worker_init_fn raised",
}


def _load_parts(payload: Payload) -> Iterator[tuple[str, Any]]:
    """(stage, part) for the dataset, the batchify function and worker_init_fn, in turn."""
    names = ("dataset", "batchify_fn", "worker_init_fn")
    if not payload.pickled:
        yield from zip(names, payload.parts)
        return
    buffers = payload.buffers.views() if hasattr(payload.buffers, "views") else payload.buffers
    unpickler = pickle.Unpickler(io.BytesIO(payload.parts), buffers=buffers)  # one memo: shared objects stay shared
    for name in names:
        yield name, unpickler.load()


def from_dill(data: bytes) -> Any:
    """An object the payload's pickler could not send by reference (a lambda, a class defined in
    `__main__` or a notebook), sent by value with dill (see `_caller.payload`)."""
    import dill

    return dill.loads(data)


def _torch_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> Any:
    """torch's own WorkerInfo, so that datasets written for torch find their shard."""
    try:
        from torch.utils.data._utils.worker import WorkerInfo as TorchWorkerInfo

        return TorchWorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)
    except Exception:  # a torch without this private class: torch's get_worker_info() stays None
        return None


def register_loader(loader_id: int, payload: Payload, worker_id: int, num_workers: int, seeds_globals: bool,
                    from_file: bool = False) -> None:
    """Register a loader in this worker and run its `worker_init_fn(worker_id)`. Never raises.

    The worker's seed is the loader's base seed plus the worker id (torch's rule); with
    `seeds_globals` (process workers) `random`, numpy and torch are seeded from it before
    `worker_init_fn` runs. A failure (unpickling, `worker_init_fn`) is kept in the
    registration and reported by the loader's first task, so that a pool initializer never
    fails and respawns in a loop.
    """
    registration = Registration(base_seed=payload.base_seed, from_file=from_file, fetch_threads=payload.fetch_threads)
    seed = (payload.base_seed + worker_id) & ((1 << 63) - 1)
    stage = "dataset"
    try:
        parts = {}
        for stage, part in _load_parts(payload):
            parts[stage] = part
        registration.dataset, registration.batchify_fn = parts["dataset"], parts["batchify_fn"]
        if seeds_globals:
            registration.torch_info = _torch_worker_info(worker_id, num_workers, seed, registration.dataset)
        if parts["worker_init_fn"] is not None:
            stage = "worker_init_fn call"
            _run_worker_init_fn(parts["worker_init_fn"], registration, worker_id, num_workers, seed, seeds_globals)
    except BaseException as exc:  # reported by the first task; see docstring
        registration.error = exc
        registration.error_traceback = traceback.format_exc()
        registration.error_context = _STAGE_FAILURES[stage]
        if stage == "worker_init_fn call":  # may pass another time (a file not there yet, a flaky mount)
            registration.again = functools.partial(register_loader, loader_id, payload, worker_id, num_workers,
                                                   seeds_globals, from_file)
    with _LOCK:
        _LOADERS[loader_id] = registration


def renewed(registration: Registration, loader_id: int, epoch: int) -> Registration:
    """The registration to load a task of `epoch` with. One whose worker_init_fn raised reports
    that for the tasks of the epoch that first saw it, and is made again (worker_init_fn runs
    again) at the first task of a later epoch, as torch's next epoch starts its workers anew:
    a worker_init_fn that failed once does not fail every later epoch of the worker."""
    if registration.again is None:
        return registration
    if registration.failed_epoch is None:
        registration.failed_epoch = epoch
    if epoch == registration.failed_epoch:
        return registration
    registration.again()
    return lookup(loader_id) or registration


def _run_worker_init_fn(fn: Any, registration: Registration, worker_id: int, num_workers: int, seed: int,
                        seeds_globals: bool) -> None:
    if seeds_globals:
        seed_global_rng(seed)
        set_torch_worker_info(registration.torch_info)
    set_current_info((worker_id, num_workers, seed, registration.dataset))
    try:
        fn(worker_id)
    finally:
        set_current_info(None)


_TORCH_WORKER: Any = None  # torch.utils.data._utils.worker, resolved once (set per batch)


def set_torch_worker_info(info: Any) -> None:
    """Make `torch.utils.data.get_worker_info()` return `info` in this process worker."""
    global _TORCH_WORKER
    if _TORCH_WORKER is None:
        try:
            from torch.utils.data._utils import worker as torch_worker
        except ImportError:  # a torch without this private module: its get_worker_info() stays None
            return
        _TORCH_WORKER = torch_worker
    _TORCH_WORKER._worker_info = info


def unregister_loader(loader_id: int) -> None:
    """Drop a loader's registration (and with it this worker's reference to its dataset, and
    its fetch threads)."""
    with _LOCK:
        registration = _LOADERS.pop(loader_id, None)
    if registration is not None and registration.fetcher is not None:
        registration.fetcher.close()


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
