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
import threading
import time
import types
from typing import Any, Callable, Iterator, Protocol

from ._caller_slots import SlotPool
from ._device import DEVICE_STAGE_HOLDS, PIN_THREAD_HOLDS, register_for_device
from ._options import LoaderConfig
from ._pool import PoolCore, make_core
from ._registry import Payload, Registration
from ._seed import preserved_global_rng, seed_global_rng
from ._tuning import Tuner
from ._worker import WorkerState, execute

__all__ = ["Backend", "InProcess", "OnPool", "start"]

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
_SPARE_SLOTS = 2
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
        self._state = WorkerState.in_process(_seeded_preserving_caller if config.seed is not None else _unseeded)

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> _Deferred:
        loader_id, epoch, batches = args[:3]
        return _Deferred(lambda: [execute(self._state, self._registration, loader_id, epoch, number, seed, work, None)
                                  for number, seed, work in batches])

    # Nothing runs elsewhere: no copy of the dataset, no workers to watch, tune or forget.
    copies_dataset = False
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
                 persistent_workers: bool) -> None:
        self.core = core
        self.owns_workers = owns_core
        self.slots = slots
        self._loader_id = loader_id
        # Worker processes hold a copy of the dataset (threads read the caller's); torch's
        # persistent workers keep theirs whatever happens to the caller's.
        self.copies_dataset = slots is not None and not persistent_workers
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
        core.join(loader_id, make_payload(not config.thread_pool))
    else:
        pickled = not config.thread_pool and start_method != "fork"
        core = make_core(workers or config.num_workers, config.thread_pool, config.start_method,
                         [(loader_id, make_payload(pickled))], config.most_workers)
    # With a CUDA device, slots are page-locked for it: the device stage copies a batch straight
    # from its slot, with no copy into pinned memory first (see _device.register_for_device).
    register = (functools.partial(register_for_device, config.device)
                if config.device is not None and config.device_reads_slots else None)
    # The pin thread and the device stage hold batches between the window and the caller, a
    # number that swings as they fill and drain: spares cover it, or each swing retires slots
    # the next one makes again (W2 batches with the pin thread: 23 new slots in 192 batches).
    spare = _SPARE_SLOTS + (PIN_THREAD_HOLDS if config.pin_thread else 0) + \
        (DEVICE_STAGE_HOLDS if config.device is not None else 0)
    slots = None if config.thread_pool else SlotPool(spare, config.most_prefetch + spare + _HELD_WITH_DESCRIPTOR, register)
    return OnPool(core, config.pool is None, loader_id, slots, config.persistent_workers)


class Backend(Protocol):
    """What the engine asks of a strategy (`InProcess`, `OnPool`, `_ray.OnRay`): it submits
    tasks to it, asks it these and never which one it has."""

    slots: SlotPool | None  # the shared-memory slots batches come back in (None: they come whole)
    copies_dataset: bool  # workers hold a copy of the dataset, taken when they started
    owns_workers: bool  # the workers are the loader's own (not a shared pool's)
    has_workers: bool  # anything runs outside the caller's thread
    # Its `exited` counts worker exits seen so far, read without a call: the engine asks
    # `find_dead_worker` only after it grew.
    exits: Any

    def submit(self, args: tuple[Any, ...], on_ready: Callable[[Any], None]) -> Any: ...

    def find_dead_worker(self) -> str | None: ...

    def worker_pids(self) -> list[int]: ...

    def worker_processes(self) -> list[Any]: ...

    def tune(self, tuner: Tuner, waited_s: float, worker_s: float) -> None: ...

    def timed_out(self, epoch: int, numbers: list[int]) -> None: ...

    def forget(self, result: Any) -> None: ...

    def forget_after_fork(self) -> bool: ...

    def close(self, drain: Callable[[float], None], prompt: bool = False) -> None: ...
