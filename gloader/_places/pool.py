"""Tasks on a pool of workers, the loader's own or a shared `WorkerPool`'s: its shared-memory
slots for process workers, watching and tuning the workers, and leaving the pool. One strategy
of `gloader._places`.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable

from .._caller.device import DEVICE_STAGE_HOLDS, PIN_THREAD_HOLDS, register_for_device
from .._caller.options import LoaderConfig
from .._caller.sizing import TASK_TARGET_S
from .._caller.slots import SlotPool
from .._caller.tuning import Tuner
from .._pool.core import PoolCore, make_core
from .._worker.registry import Payload

__all__ = ["OnPool", "start_on_pool"]

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
        self._wakeup = threading.Event()
        # `submit(args, on_ready)`: the core's, called straight (one call less per task).
        self.submit: Callable[[tuple[Any, ...], Callable[[Any], None]], Any] = functools.partial(
            core.submit, wakeup=self._wakeup)

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

    def timed_out(self, epoch: int, batch_indices: list[int]) -> None:
        """A batch of these took longer than the timeout: a shared pool outlives this loader, so
        the worker loading it is ended (a hung worker would hold its place forever)."""
        if not self.owns_workers:
            self.core.kill_worker_loading(self._loader_id, epoch, batch_indices)

    def why_late(self) -> str | None:
        return self.core.why_late()  # worker processes that never started; else the dataset's

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


def start_on_pool(config: LoaderConfig, loader_id: int, make_payload: Callable[..., Payload],
                  workers: int | None = None) -> OnPool:
    """The loader's own pool of `workers` processes or threads (default num_workers), or its
    place on the shared pool given as pool=, with the slots its process workers write into."""
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
