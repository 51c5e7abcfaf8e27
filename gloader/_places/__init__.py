"""Where a loader's tasks run, one strategy each: in the caller's thread (`inprocess`), on a
pool of workers, the loader's own or a shared `WorkerPool`'s (`pool`, the pool itself in
`gloader._pool`), or on a Ray cluster (`ray`). `start` picks one from the loader's config; the
engine submits tasks to it through `Backend`, asks it what differs between them (whether
workers hold a copy of the dataset, watching and tuning them, a timeout, forgetting unfinished
tasks, a fork, closing) and never which one it has. The whole flow is drawn in
`gloader._caller.engine`.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from .._caller.options import LoaderConfig
from .._caller.slots import SlotPool
from .._caller.tuning import Tuner
from .._worker.registry import Payload

__all__ = ["Backend", "start"]


class Backend(Protocol):
    """What the engine asks of a strategy (`InProcess`, `OnPool`, `_places.ray.OnRay`): it submits
    tasks to it, asks it these and never which one it has."""

    slots: SlotPool | None  # the shared-memory slots batches come back in (None: they come whole)
    copies_dataset: bool  # workers hold a copy of the dataset, taken when they started
    owns_workers: bool  # the workers are the loader's own (not a shared pool's)
    has_workers: bool  # anything runs outside the caller's thread
    task_target_s: float  # the worker time a task's batches add up to (see `_caller.sizing`; 0: one batch a task)
    # Its `exited` counts worker exits seen so far, read without a call: the engine asks
    # `find_dead_worker` only after it grew.
    exits: Any

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> Any: ...

    def find_dead_worker(self) -> str | None: ...

    def worker_pids(self) -> list[int]: ...

    def worker_processes(self) -> list[Any]: ...

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None: ...

    def timed_out(self, epoch: int, batch_indices: list[int]) -> None: ...

    def why_late(self) -> str | None: ...

    def forget(self, result: Any) -> None: ...

    def forget_after_fork(self) -> bool: ...

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None: ...


def start(config: LoaderConfig, loader_id: int, make_payload: Callable[..., Payload],
          workers: int | None = None) -> Backend:
    """Where the loader's tasks run: `workers` processes or threads to start with (default
    num_workers; a tuned count, see `_caller.tuning`), or in-process."""
    from .inprocess import InProcess
    from .pool import start_on_pool

    if config.num_workers == 0:
        return InProcess(config, make_payload(False))
    place = getattr(config.pool, "start_backend", None)
    if place is not None:  # a pool that runs tasks elsewhere (a RayPool: see _ray)
        backend: Backend = place(config, loader_id, make_payload)
        return backend
    return start_on_pool(config, loader_id, make_payload, workers)
