"""Where a loader's tasks run: in the caller's thread (`InProcess`), or on a pool of
workers, the loader's own or a shared `WorkerPool`'s (`OnPool`), with the shared-memory slots
process workers write into. `start` picks one from the loader's config. Each owns what differs
between them (whether workers hold a copy of the dataset, watching and tuning the workers, a
timeout, forgetting unfinished tasks, a fork, closing); the engine submits tasks to it, asks
it those things and never which one it has. The whole flow is drawn in `_engine`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterator, Protocol

from ._caller_slots import SlotPool
from ._device import DEVICE_STAGE_HOLDS, PIN_THREAD_HOLDS, register_for_device
from ._options import LoaderConfig
from ._pool import PoolCore, make_core
from ._protocol import WorkerExitedError
from ._registry import Payload, Registration
from ._seed import preserved_global_rng, seed_global_rng
from ._sizing import TASK_TARGET_S
from ._snapshot import Picture, first_difference, picture
from ._tuning import Tuner
from ._worker import WorkerState, execute

__all__ = ["Backend", "InProcess", "OnPool", "Workers", "start"]

logger = logging.getLogger(__name__)

# How often, at most, a tuned loader looks whether a resize of its pool is done (a look scans
# the status table). Shorter: the next window opens sooner after a resize; longer: less cost.
_READY_POLL_S = 0.05
# Deadline for a loader leaving a shared pool to see its batches in flight finish, so that
# nothing it owns is written after it has released its shared memory.
_LEAVE_SHARED_POOL_S = 5.0
# The same after a dead worker or a timeout: none. The dead worker's task never finishes, so
# any wait was added whole to the error's latency (0.2 s made a shared pool's death-to-error
# ~250 ms against an own pool's ~60), and what the others write later goes into slots already
# retired, which nobody reads; their tasks are forgotten by the pool.
_LEAVE_AFTER_FAILURE_S = 0.0
# Free shared-memory slots a loader keeps mapped beyond those in flight and those the caller
# holds. Two cover the batch being handed over and the one the caller just dropped. Larger:
# fewer new slots after the caller holds a burst of batches; smaller: less idle memory.
# (A loop's working set is kept however many are free: see `start`.)
_SPARE_SLOTS = 2
# Slots a training loop keeps taken besides the window and the spares: the batch it works on,
# the one being handed over and one released late.
_LOOP_HOLDS = 3
# Batches the caller holds whose slots keep their descriptor (so they can be lent again when
# freed), beyond those in flight and the spares: a training loop holds one or two. Larger:
# fewer new slots for a loop that keeps a few batches; smaller: fewer open descriptors.
_HELD_WITH_DESCRIPTOR = 4


class _Deferred:
    """In-process loading's stand-in for an AsyncResult: the task runs when it is collected."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run

    def ready(self) -> bool:
        return True

    def wait(self, timeout_s: float) -> None:
        pass

    def get(self, timeout_s: float) -> Any:
        return self._run()


@contextlib.contextmanager
def _seeded_preserving_caller(seed: int) -> Iterator[None]:
    """In-process loading with a seed: the batch's draws are seeded, the caller's restored."""
    with preserved_global_rng():
        seed_global_rng(seed)
        yield


@contextlib.contextmanager
def _unseeded(seed: int) -> Iterator[None]:
    yield


class InProcess:
    """Runs tasks in the caller's thread with the loader's own registration."""

    slots: SlotPool | None = None

    def __init__(self, config: LoaderConfig, payload: Payload) -> None:
        self._registration = Registration(dataset=payload.parts[0], batchify_fn=payload.parts[1],
                                          base_seed=payload.base_seed)
        seeded = config.seed is not None
        self._state = WorkerState.in_process(_seeded_preserving_caller if seeded else _unseeded, seeded)

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> _Deferred:
        loader_id, epoch, batches = args[:3]
        return _Deferred(lambda: [execute(self._state, self._registration, loader_id, epoch, number, seed, work, None)
                                  for number, seed, work in batches])

    # Nothing runs elsewhere: no copy of the dataset, no workers to watch, tune or forget, and
    # no round trip a task of several batches would share.
    copies_dataset = False
    task_target_s = 0.0
    exits = types.SimpleNamespace(exited=0)  # nothing runs elsewhere to exit
    owns_workers = True
    has_workers = False

    def find_dead_worker(self) -> str | None:
        return None

    def worker_pids(self) -> list[int]:
        return []

    def worker_processes(self) -> list[Any]:
        return []

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None:
        pass

    def timed_out(self, epoch: int, numbers: list[int]) -> None:
        pass

    def why_late(self) -> str | None:
        return None

    def forget(self, result: Any) -> None:
        pass

    def forget_after_fork(self) -> bool:
        return False

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None:
        pass


class OnPool:
    """Runs tasks on a pool of workers: the loader's own, or a shared `WorkerPool`'s."""

    has_workers = True

    def __init__(self, core: PoolCore, owns_core: bool, loader_id: int, slots: SlotPool | None,
                 persistent_workers: bool, payload: Payload) -> None:
        self.core = core
        self._payload = payload  # workers map its shared buffers (through its descriptor) while they run
        self.owns_workers = owns_core
        self.slots = slots
        self._loader_id = loader_id
        # Worker processes hold a copy of the dataset (threads read the caller's); torch's
        # persistent workers keep theirs whatever happens to the caller's.
        self.copies_dataset = slots is not None and not persistent_workers
        # Process workers group small batches to share a task's round trip; threads share the
        # caller's memory, with nothing to gain.
        self.task_target_s = TASK_TARGET_S if slots is not None else 0.0
        self._ready_looked = 0.0  # when the tuner last looked whether a resize is done
        self.exits = core.exits
        # Set by the pool as any task of this loader progresses and when a worker exits: the
        # engine sleeps on it until then or the batch's deadline (see Task.wait).
        self._progress = threading.Event()
        # `submit(args, on_ready)`: the core's, called straight (one call less per task).
        self.submit: Callable[[tuple[Any, ...], Callable[[Any], None]], Any] = functools.partial(
            core.submit, progress=self._progress)

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None:
        """Count a batch collected in the tuner's window; resize the pool when it decides to."""
        tuner.observe(waited_s, worker_s)
        core = self.core
        if tuner.settling:
            now = time.monotonic()
            if now - self._ready_looked >= _READY_POLL_S:
                self._ready_looked = now
                if core.workers_ready():
                    tuner.begin(core.worker_pids())
            return
        if not tuner.due():
            return
        before = tuner.count
        count = tuner.decide(tuner.measure(core.worker_pids()))
        if count is not None:
            if core.resize(count):
                logger.info("gloader loader %d: %d -> %d workers (%s)", self._loader_id, before, count,
                            tuner.changes[-1]["why"])
            else:
                tuner.refused(before)

    def timed_out(self, epoch: int, numbers: list[int]) -> None:
        """A batch of these took longer than the timeout: a shared pool outlives this loader, so
        the worker loading it is ended (a hung worker would hold its place forever)."""
        if not self.owns_workers:
            self.core.kill_worker_loading(self._loader_id, epoch, numbers)

    def why_late(self) -> str | None:
        return None  # the pool's workers run as soon as started: a late batch is the dataset's

    def forget(self, result: Any) -> None:
        """A task that never finished (a dead worker's): the pool stops waiting for it."""
        self.core.forget(result)

    def forget_after_fork(self) -> bool:
        """In a forked child: the workers are the parent's (see `PoolCore.forget_after_fork`)."""
        if self.owns_workers:
            self.core.forget_after_fork()
        return True

    def find_dead_worker(self) -> str | None:
        return self.core.find_dead_worker(self._loader_id)

    def worker_pids(self) -> list[int]:
        return self.core.worker_pids()

    def worker_processes(self) -> list[Any]:
        return self.core.worker_processes()

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None:
        try:
            if self.owns_workers:
                self.core.close(prompt)
            elif not self.core.closed:  # a closed pool's workers are gone: nothing left to wait for
                drain(_LEAVE_AFTER_FAILURE_S if prompt else _LEAVE_SHARED_POOL_S)
            self.core.leave(self._loader_id)
        finally:  # a second Ctrl-C while stopping still releases the shared memory
            if self.slots is not None:
                self.slots.close()


def start(config: LoaderConfig, loader_id: int, make_payload: Callable[[bool], Payload],
          workers: int | None = None) -> Backend:
    """Where the loader's tasks run: `workers` processes or threads to start with (default
    num_workers; a tuned count, see `_tuning`), or in-process."""
    if config.num_workers == 0:
        return InProcess(config, make_payload(False))
    place = getattr(config.pool, "start_backend", None)
    if place is not None:  # a pool that runs tasks elsewhere (a RayPool: see _ray)
        backend: Backend = place(config, loader_id, make_payload)
        return backend
    import multiprocess

    start_method = multiprocess.get_context(config.start_method).get_start_method()
    if config.pool is not None:
        core = config.pool.core
        payload = make_payload(not config.thread_pool)
        core.join(loader_id, payload)
    else:
        payload = make_payload(not config.thread_pool and start_method != "fork")
        core = make_core(workers or config.num_workers, config.thread_pool, config.start_method,
                         [(loader_id, payload)], config.most_workers)
    # With a CUDA device, slots are page-locked for it: the device stage copies a batch straight
    # from its slot, with no copy into pinned memory first (see _device.register_for_device).
    register = (functools.partial(register_for_device, config.device)
                if config.device is not None and config.device_reads_slots else None)
    # The pin thread and the device stage hold batches between the window and the caller, a
    # number that swings as they fill and drain: spares cover it, or each swing retires slots
    # the next one makes again (W2 batches with the pin thread: 23 new slots in 192 batches).
    spare = _SPARE_SLOTS + (PIN_THREAD_HOLDS if config.pin_thread else 0) + \
        (DEVICE_STAGE_HOLDS if config.device is not None else 0)
    # A loop that stops mid-epoch (a break, limit_train_batches, a validation loop cut short)
    # drops the window's batches in flight, and its next iter() dispatches a window at once:
    # the slots of a loop's working set are kept for it, or each such stop retired all but the
    # spares and made them anew (a W2 window at 4 workers: 6-8 new slots per stop, each
    # reserved, and with a device page-locked, ~4 ms more each on an H200 host).
    working_set = config.prefetch + spare + _LOOP_HOLDS
    slots = None if config.thread_pool else \
        SlotPool(spare, config.most_prefetch + spare + _HELD_WITH_DESCRIPTOR, register, working_set)
    return OnPool(core, config.pool is None, loader_id, slots, config.persistent_workers, payload)


class Backend(Protocol):
    """What the engine asks of a strategy (`InProcess`, `OnPool`, `_ray.OnRay`): it submits
    tasks to it, asks it these and never which one it has."""

    slots: SlotPool | None  # the shared-memory slots batches come back in (None: they come whole)
    copies_dataset: bool  # workers hold a copy of the dataset, taken when they started
    owns_workers: bool  # the workers are the loader's own (not a shared pool's)
    has_workers: bool  # anything runs outside the caller's thread
    task_target_s: float  # the worker time a task's batches add up to (see `_sizing`; 0: one batch a task)
    # Its `exited` counts worker exits seen so far, read without a call: the engine asks
    # `find_dead_worker` only after it grew.
    exits: Any

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> Any: ...

    def find_dead_worker(self) -> str | None: ...

    def worker_pids(self) -> list[int]: ...

    def worker_processes(self) -> list[Any]: ...

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None: ...

    def timed_out(self, epoch: int, numbers: list[int]) -> None: ...

    def why_late(self) -> str | None: ...

    def forget(self, result: Any) -> None: ...

    def forget_after_fork(self) -> bool: ...

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None: ...


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
        such as 'dataset.scale', see `_snapshot`); None when it does not, or when no process
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
