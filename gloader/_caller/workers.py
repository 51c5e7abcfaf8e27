"""A loader's workers over its life, whichever strategy of `gloader._places` runs them:
started at the first task, stopped after a dead worker or a timeout and started again, tuned,
watched for changes to the dataset they copied, closed for good. Runs in the caller's process;
the flow is drawn in `engine`.
"""
from __future__ import annotations

import functools
import os
import weakref
from typing import Any, Callable

from .._places import Backend, start
from .._wire.protocol import WorkerExitedError
from .._worker.registry import Payload
from .options import LoaderConfig
from .slots import SlotPool
from .snapshot import Picture, first_difference, picture
from .tuning import Tuner

__all__ = ["Workers"]


class Workers:
    """A loader's workers over its life, whichever `Backend` they run as: started at the first
    task (`running`), stopped after a dead worker or a timeout and started again by the next
    task, closed for good by `close`. Keeps what outlives one start: the tuner of a tuned count,
    the dataset as the worker processes copied it, a fork, and the threads that fetch through
    the engine (stopped first at close). Takes the arguments of the `Engine` that holds it.
    """

    def __init__(self, config: LoaderConfig, loader_id: int,
                 make_payload: Callable[[LoaderConfig, bool], Payload]) -> None:
        self._config = config
        self._loader_id = loader_id
        self._make_payload = make_payload
        self.backend: Backend | None = None
        self.slots: SlotPool | None = None  # the backend's shared-memory slots (None: none, or no backend)
        self.exits_seen = -1  # the backend's `exits.exited` when deaths were last looked for
        self._forked_from: int | None = None  # the pid whose workers this process inherited by fork
        self._dataset_picture: Picture | None = None  # the dataset when worker processes took their copy
        self._closed = False  # close() ran: no workers start again
        self._helpers: weakref.WeakSet[Any] = weakref.WeakSet()  # threads fetching through the engine
        # num_workers='auto' on the loader's own process pool: the count follows what it measures.
        self.tuner = (Tuner(config.num_workers, config.most_workers, config.cpu_budget or 1.0, config.memory_budget,
                            config.prefetch / config.num_workers, shared=config.budgets_shared)
                      if config.tunes_workers else None)

    @property
    def count(self) -> int:
        """Workers the loader keeps now (its tuned count with num_workers='auto')."""
        return self.tuner.count if self.tuner is not None else self._config.num_workers

    def describe(self) -> str:
        """The workers for the progress bar: "4 workers", with the latest change of a tuned count
        ("4 workers, grew from 2"); "" without workers."""
        if not self.count:
            return ""
        text = f"{self.count} workers"
        if self.tuner is not None and self.tuner.changes:
            change = self.tuner.changes[-1]
            text += f", {change['why'].split(',')[0]} from {change['from']}"
        return text

    def running(self) -> Backend:
        """The backend tasks run on, started now if it was not running."""
        if self._forked_from is not None:
            raise RuntimeError(f"this DataLoader's workers belong to process {self._forked_from}, from which this "
                               "process was forked; make a new DataLoader here")
        if self.backend is None:
            if self._closed:
                raise RuntimeError("this DataLoader is closed; create a new one")
            self.backend = start(self._config, self._loader_id, functools.partial(self._make_payload, self._config),
                                 self.count)
            self.slots = self.backend.slots
            self.exits_seen = -1  # a shared pool's deaths before this loader joined: looked for once
            if self.tuner is not None:
                self.tuner.resized()
            if self.backend.copies_dataset:
                self._dataset_picture = picture(self._config.dataset)
        return self.backend

    def check(self, waiting_for: str) -> None:
        """Raise WorkerExitedError when a worker process has died since the last check (looked
        for only when a worker exited since then); `waiting_for` names the batch."""
        backend = self.backend
        if backend is None or backend.exits.exited == self.exits_seen:
            return
        self.exits_seen = backend.exits.exited
        dead = backend.find_dead_worker()
        if dead is not None:
            raise WorkerExitedError(f"{dead}. The loader was waiting for {waiting_for}; its workers are stopped and "
                                    "the next epoch starts anew.")

    def dataset_change(self) -> str | None:
        """Where the dataset differs from the copy this loader's worker processes hold (a path
        such as 'dataset.scale', see `_caller.snapshot`); None when it does not, or when no process
        holds a copy (in-process loading and thread workers read the dataset itself)."""
        if self._dataset_picture is None:
            return None
        return first_difference(self._dataset_picture, picture(self._config.dataset))

    def accept_dataset(self) -> None:
        """Compare later changes with the dataset as it is now (a shared pool's workers keep
        their copy: the change has been reported)."""
        if self._dataset_picture is not None:
            self._dataset_picture = picture(self._config.dataset)

    @property
    def owned(self) -> bool:
        """Whether the workers are this loader's own (not a shared WorkerPool's)."""
        return self.backend is None or self.backend.owns_workers

    def pids(self) -> list[int]:
        """Pids of the worker processes now running for this loader."""
        return self.backend.worker_pids() if self.backend is not None else []

    def processes(self) -> list[Any]:
        """The worker processes of this loader, by worker id; they start here if they had not
        (none once the loader is closed)."""
        return [] if self._closed else self.running().worker_processes()

    def shared_memory_bytes(self) -> tuple[int, int]:
        """(resident, mapped) bytes of the loader's shared-memory slots."""
        slots = self.slots
        return (slots.in_use_bytes(), slots.capacity_bytes()) if slots is not None else (0, 0)

    def attach(self, helper: Any) -> None:
        """Have `close()` first call `helper.stop()` (a pin thread, which fetches through the
        engine from its own thread; held weakly)."""
        self._helpers.add(helper)

    def stop(self, drain: Callable[[Backend, float], None], prompt: bool = False) -> None:
        """Stop the workers (or leave the shared pool) and release the slots; `drain(backend,
        timeout_s)` lets a shared pool's tasks finish first. The next `running` starts anew."""
        backend, self.backend, self.slots = self.backend, None, None
        self._dataset_picture = None
        if backend is None:
            return
        if self.tuner is not None:
            self.tuner.resized()
            self.tuner.workers_stopped()
        backend.close(functools.partial(drain, backend), prompt)

    def close(self, stop: Callable[[], None]) -> None:
        """For good: the attached helpers stop, then `stop()` stops the workers; a later
        `running` raises instead of starting new ones. The exit hook closes engines, not
        iterators: a pin thread still fetching raced the stop and started a new pool."""
        self._closed = True
        for helper in list(self._helpers):
            helper.stop()
        stop()
        if self.tuner is not None:
            self.tuner.close()

    def forget_after_fork(self) -> bool:
        """In a forked child: whether the workers and shared memory were the parent's (then
        forgotten without closing anything; using the loader here raises)."""
        backend = self.backend
        if backend is None or not backend.forget_after_fork():
            return False
        self.backend, self.slots, self._forked_from = None, None, os.getppid()
        return True
