"""Engine: keeps a window of tasks in flight on the loader's workers and collects their batches in order.

The whole flow, with who runs each step::

    caller's thread (or its pin thread)          worker (process, thread, or in-process)
    -----------------------------------          ---------------------------------------
    Schedule.next_job(epoch) -> Job(epoch, i, seed, keys)                     (_sampling.schedule)
    Engine.fill: a task of 1-32 consecutive jobs (more when batches are small and quick);
        SlotPool.acquire(n) -> a free slot (memfd); submit run_task(loader id, epoch,
        ((i, seed, keys), ...), slot)     ->  WorkerState: registry[loader id]       (_worker.run)
                                               per batch: load_batch: dataset[k] for k
                                               in keys -> batchify plan -> write into
                                               the slot after the one before (shm)  (_worker.fetch)
                                               (large samples, default batchify: each
                                               written into the slot as it comes) (_worker.rows)
                                               per batch: its answer, Loaded(handle) |
                                               ShardEnd | WorkerFailure, published in
                                               the slot as soon as it is written
                                          <-  the task's end (answers that did not fit)
    ... up to `prefetch` tasks in flight, across the end of an epoch into the next ...
    Engine.collect: wait for the oldest batch's answer, read from the slot or the task's
        messages (asleep until a task's message or a worker's exit rings the loader's
        event, or the batch's own timeout; a task that runs long tells a waiting caller by
        message; with in_order=False a batch that came first goes first), then hand it out:
        SlotPool.rebuild(slot, handle) -> tensors viewing the slot (zero copy)  (_caller.slots)
        WorkerFailure.reraise() -> the worker's exception, as its own type   (_wire.protocol)
    EpochIterator: [pin, in its pin thread] -> [to(device) on a side stream] (_caller.device); with a
        device and process workers, slots are page-locked and there is no pin thread
        -> the user, counting what it hands over (state_dict, stats)        (_caller.iterator)
    the slot is free again when the last tensor of its last batch is freed

Thread workers and in-process loading share the caller's memory: no slots, the batch itself
comes back, one batch to a task. In-process loading runs the same task function when the batch is collected.
`_places` runs the tasks (one strategy each: in-process, a pool with its slots, Ray),
`_caller.workers` keeps the workers over the loader's life (started, supervised, stopped, tuned),
`_caller.task` receives a task's answers and keeps the window of tasks, `_pool` owns worker
processes, `_worker` is what runs in them, `_sampling.schedule` numbers the epochs' batches,
`_caller.options` checks the arguments, and `loader` is the public facade that builds the config,
the schedule and this engine.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, NamedTuple

from .._wire.protocol import (
    BatchTimeoutError,
    Job,
    Loaded,
    SharedMemoryUnreachableError,
    WorkerExitedError,
    WorkerFailure,
    decode_answer,
)
from .._wire.tree import tensor_bytes
from .._worker.registry import Payload
from .options import LoaderConfig
from .sizing import TaskSizer
from .task import Task, TaskWindow, timeout_error
from .workers import Workers

__all__ = ["Collected", "Engine"]

_UNREACHABLE = f"{SharedMemoryUnreachableError.__module__}.{SharedMemoryUnreachableError.__qualname__}"


class Collected(NamedTuple):
    """A collected batch (or a stream's `ShardEnd`) with where its time went, in seconds:
    `timings` maps each hop (`_caller.stats.HOPS`) to its duration; empty for a `ShardEnd`."""

    batch: Any
    timings: dict[str, float]
    worker_id: int
    samples: int  # 0 for a ShardEnd
    shard_began: bool = False  # a stream's batch that began its worker's shard for the epoch


class Engine:
    """Dispatches a loader's jobs into a window of `prefetch` and collects them in order (with
    `in_order=False`, as they finish).

    Starts its workers (or joins the shared pool) at the first `fill`; after a dead worker or
    a timeout it stops them, and the next `fill` starts new ones. Holds no reference to the
    loader, so the loader's finalizer can close it.

    Args:
        config: the loader's checked arguments.
        loader_id: the loader's id in the workers' registry.
        make_payload: `make_payload(config, pickled)` -> what the workers register.
    """

    def __init__(self, config: LoaderConfig, loader_id: int,
                 make_payload: Callable[[LoaderConfig, bool], Payload]) -> None:
        self._config = config
        self._loader_id = loader_id
        self._make_payload = make_payload
        self.workers = Workers(config, loader_id, make_payload)
        self.tuner = self.workers.tuner  # num_workers='auto' on the loader's own pool, else None
        self.tasks = TaskWindow()  # in flight, in dispatch order (and those discarded)
        self._held: Job | None = None  # taken from the schedule, of another epoch than the task being filled
        self._sizer = TaskSizer()  # how many batches go to a task
        self.reordered_epoch: int | None = None  # the latest epoch a batch was collected ahead of an older one
        self._collected_epoch: int | None = None  # the epoch of the latest batch collected
        self.fetch_threads: dict[int, int] = {}  # worker id -> threads its latest batch was fetched with
        self.shards = config.num_workers or 1  # how many shards a stream epoch has: one per worker (one in-process)

    @property
    def window(self) -> int:
        """Most tasks in flight (following a tuned worker count; for a tuned count, wider while
        all of them belong to an epoch the caller has not started: see `_caller.tuning._BETWEEN_EPOCHS`)."""
        if self.tuner is None:
            return self._config.prefetch
        if self.tasks and self._collected_epoch is not None and self.tasks[0].epoch != self._collected_epoch:
            return self.tuner.window_between_epochs(slots.task_bytes() if (slots := self.workers.slots) is not None else 0)
        return self.tuner.window

    def batches_per_task(self) -> int:
        """How many batches the next task carries (see `_caller.sizing`)."""
        return self._sizer.per_task

    def fill(self, next_job: Callable[[], Job | None]) -> None:
        """Dispatch jobs from `next_job` until the window is full or it has none."""
        window = self.window
        if len(self.tasks) >= window:
            return  # called after every batch collected: usually the window is still full
        backend = self.workers.backend or self.workers.running()
        slots = backend.slots
        if backend.task_target_s != self._sizer.target_s:  # a strategy started: its task size
            self._sizer.aim(backend.task_target_s)
        per_task = self._sizer.per_task
        while len(self.tasks) < window:
            first, self._held = self._held or next_job(), None
            if first is None:
                return
            jobs, self._held = self._sizer.take(first, next_job, per_task)
            task = Task(jobs, None if slots is None else
                        slots.acquire(len(jobs), self._sizer.most_per_task if per_task > 1 else 1))
            args: tuple[Any, ...] = (self._loader_id, first.epoch, task.batches, task.slot)
            if self._config.thread_pool:  # threads share this process: a task nobody collects is skipped
                task.cancel = [False]
                args += (task.cancel,)
            task.result = backend.submit(args, task.mark_arrived)
            self.tasks.append(task)

    def collect(self, epoch: int) -> Collected | None:
        """Wait for the oldest batch in flight if it belongs to `epoch` (None otherwise); with
        `in_order=False`, take a batch of `epoch` that finished while the oldest has not.

        Re-raises a worker's exception as its own type; raises `WorkerExitedError` or
        `BatchTimeoutError` (after stopping the workers) rather than wait unbounded.
        """
        if not self.tasks or self.tasks[0].epoch != epoch:
            return None
        asked = time.monotonic()
        if self.tasks.discarded:
            self.tasks.reap(self.workers.slots)
        task = self._next_task(epoch)
        if task.taken == 0:  # once a task, waited for or not: a worker that died while idle is reported too
            with self._failing(task):
                self._check_workers(task)
        if task is not self.tasks[0]:
            self.reordered_epoch = epoch
        position = task.taken
        task.taken += 1
        self._collected_epoch = epoch
        if task.taken == len(task.jobs):
            self.tasks.remove(task)
        ready = time.monotonic()
        slot, slots = task.slot, self.workers.slots
        item, arrival = task.answers.pop(position), task.arrivals.pop(position)  # the batch is the caller's now
        try:
            message = decode_answer(item)
        except Exception as exc:  # this batch's answer only: the task's others come at their turn
            task.undecodable(position, slots, exc)
            raise
        if not isinstance(message, Loaded):
            if slots is not None:
                slots.give_back(slot, None)
            if isinstance(message, WorkerFailure):
                if message.type_name == _UNREACHABLE:  # every batch would fail alike: stop at the first
                    self.stop_workers(prompt=True)
                message.reraise(epoch)
            return Collected(message, {}, message.worker_id, 0)
        batch = message.batch
        if message.fetch_threads:
            self.fetch_threads[message.worker_id] = message.fetch_threads
        backend = self.workers.backend
        if self.tuner is not None and backend is not None:
            backend.tune(self.tuner, ready - asked, message.fetch_s + message.batchify_s)
        if slots is not None:
            _, _, size, _, _ = batch  # a Handle
            self._sizer.estimate(message, size)
            batch = slots.rebuild(slot, batch)
        elif backend is not None and backend.task_target_s:  # whole batches a task may group (Ray)
            self._sizer.estimate(message, tensor_bytes(batch))
        arrived = arrival or message.finished  # in-process loading: no trip back
        timings = {"dispatch_s": max(0.0, message.started - task.submitted), "worker_fetch_s": message.fetch_s,
                   "worker_batchify_s": message.batchify_s, "return_s": max(0.0, arrived - message.finished),
                   "window_s": max(0.0, ready - arrived), "handover_s": time.monotonic() - ready}
        return Collected(batch, timings, message.worker_id, message.samples, message.shard_began)

    def _next_task(self, epoch: int) -> Task:
        """The task whose next batch goes out next, once that batch's answer is in: the oldest,
        or with in_order=False one of `epoch` whose batch came first."""
        task = self.tasks[0]
        if not self._has_next(task):
            if self._config.in_order or len(self.tasks) == 1:
                self._await(task)
            else:  # a batch of the epoch that came first goes first, while the oldest is still out
                task = self._finished_task(epoch) or task
                if not self._has_next(task) and not self._await(task, lambda: self._finished_task(epoch) is not None):
                    task = self._finished_task(epoch) or task  # one came while waiting
                    if not self._has_next(task):
                        self._await(task)
        return task

    def _finished_task(self, epoch: int) -> Task | None:
        return self.tasks.first_ready(epoch, self._has_next)

    def _has_next(self, task: Task) -> bool:
        """Whether the answer of `task`'s next batch is in, without waiting."""
        with self._failing(task):
            return task.ready(self.workers.slots)

    def _await(self, task: Task, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait for the answer of `task`'s next batch; on a failure the task leaves the window.
        False when `give_up()` turned true first (checked between waits)."""
        with self._failing(task):
            self._check_workers(task)
            return self._wait(task, give_up)

    @contextlib.contextmanager
    def _failing(self, task: Task) -> Iterator[None]:
        """A failure while receiving `task`'s answers takes the task out of the window; a dead
        worker or a timeout stops the workers too."""
        try:
            yield
        except (WorkerExitedError, BatchTimeoutError) as exc:
            self.tasks.drop(task)
            if isinstance(exc, BatchTimeoutError) and self.workers.backend is not None:
                self.workers.backend.timed_out(task.epoch, [job.batch_index for job in task.jobs])
            self.stop_workers(prompt=True)
            raise
        except BaseException:  # Ctrl-C, or a result that could not be received: the task is not ours any more
            self.tasks.drop(task)
            raise

    def _wait(self, task: Task, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait until the answer of `task`'s next batch is in (True) or `give_up()` is true
        (False). The timeout is the batch's: it runs from when the caller began waiting for it."""
        position = task.taken
        slots = self.workers.slots
        if task.waited is None or task.waited[0] != position:
            task.waited = (position, time.monotonic())
            if slots is not None:
                slots.want(task.slot, position + 1)  # its worker sends it as soon as it is written
        deadline = task.waited[1] + self._config.timeout_s
        backend = self.workers.backend
        exits = backend.exits if backend is not None else None
        while not task.wait(slots, max(0.0, deadline - time.monotonic()), exits, self.workers.exits_seen):
            self._check_workers(task)
            if give_up is not None and give_up():
                return False
            if time.monotonic() > deadline:
                job, elapsed = task.overdue()
                if elapsed < self._config.timeout_s:  # not late after all (a task whose batches come together)
                    deadline = time.monotonic() + self._config.timeout_s - elapsed
                    continue
                raise timeout_error(job, elapsed, self._config.timeout_s, backend.why_late() if backend else None)
        return True

    def _check_workers(self, task: Task) -> None:
        backend = self.workers.backend  # looked for only once a worker exited (see Workers.check)
        if backend is not None and backend.exits.exited != self.workers.exits_seen:
            self.workers.check(f"batch {task.next_job.batch_index} of epoch {task.epoch}")

    def discard(self, epoch: int | None = None) -> None:
        """Drop the batches in flight of `epoch` (of every epoch when None).

        They leave the window at once, so other batches are dispatched without waiting for them.
        """
        self.tasks.discard(epoch)
        if self._held is not None and (epoch is None or self._held.epoch == epoch):
            self._held = None
        self.tasks.reap(self.workers.slots)

    def stop_workers(self, prompt: bool = False) -> None:
        """Stop the workers (or leave the shared pool) and release shared memory; the next
        `fill` starts anew. Batches already collected stay valid. `prompt`: terminate at once
        (see `PoolCore.close`)."""
        if self.workers.backend is not None:
            self.tasks.discard()  # freed by the drain, or with every slot at close
            self._held = None  # its epoch ends with these workers
        self.workers.stop(self.tasks.drain, prompt)
        self.tasks.discarded = []

    def reconfigure(self, config: LoaderConfig) -> None:
        """Load with `config` from the next `fill`: the workers started with the settings before
        stop (their batches in flight go with them), and new ones start as `config` says."""
        self.workers.close(self.stop_workers)
        self._config = config
        self.workers = Workers(config, self._loader_id, self._make_payload)
        self.tuner = self.workers.tuner
        self.shards = config.num_workers or 1

    def close(self) -> None:
        """Stop the pin thread, then the workers, for good (see `Workers.close`)."""
        self.workers.close(self.stop_workers)

    def forget_after_fork(self) -> None:
        """In a forked child: the workers, the tasks in flight and the shared memory are the
        parent's. Drop them without closing anything (see `PoolCore.forget_after_fork`); using
        the loader here raises. In-process loading has nothing of the parent's and goes on."""
        if self.workers.forget_after_fork():
            self._held, self.tasks.discarded = None, []
            self.tasks.clear()
