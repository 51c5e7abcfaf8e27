"""Engine: keeps a window of tasks in flight on the loader's workers and collects their batches in order.

The whole flow, with who runs each step::

    caller's thread (or its pin thread)          worker (process, thread, or in-process)
    -----------------------------------          ---------------------------------------
    Schedule.next_job(epoch) -> Job(epoch, i, seed, keys)                     (_schedule)
    Engine.fill: a task of 1-32 consecutive jobs (more when batches are small and quick);
        SlotPool.acquire(n) -> a free slot (memfd); submit run_task(loader id, epoch,
        ((i, seed, keys), ...), slot)     ->  WorkerState: registry[loader id]       (_worker)
                                               per batch: load_batch: dataset[k] for k
                                               in keys -> batchify plan -> write into
                                               the slot after the one before (shm)  (_fetch)
                                               (large samples, default batchify: each
                                               written into the slot as it comes) (_rows)
                                               per batch: its answer, Loaded(handle) |
                                               ShardEnd | WorkerFailure, published in
                                               the slot as soon as it is written
                                          <-  the task's end (answers that did not fit)
    ... up to `prefetch` tasks in flight, across the end of an epoch into the next ...
    Engine.collect: wait for the oldest batch's answer, read from the slot or the task's
        messages (asleep until a task's message or a worker's exit rings the loader's
        event, or the batch's own timeout; a task that runs long tells a waiting caller by
        message; with in_order=False a batch that came first goes first), then hand it out:
        SlotPool.rebuild(slot, handle) -> tensors viewing the slot (zero copy)  (_caller_slots)
        WorkerFailure.reraise() -> the worker's exception, as its own type   (_protocol)
    EpochIterator: [pin, in its pin thread] -> [to(device) on a side stream] (_device); with a
        device and process workers, slots are page-locked and there is no pin thread
        -> the user, counting what it hands over (state_dict, stats)        (_iterator)
    the slot is free again when the last tensor of its last batch is freed

Thread workers and in-process loading share the caller's memory: no slots, the batch itself
comes back, one batch to a task. In-process loading runs the same task function when the batch is collected.
`_backends` runs the tasks (in-process, or on a pool, with the slots), `_task` receives a
task's answers, `_pool` owns worker processes and their supervision, `_options` the checked
arguments, `loader` the public facade that builds the config, the schedule and this engine.
"""
from __future__ import annotations

import collections
import contextlib
import os
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, NamedTuple

from ._backends import Backend, start
from ._caller_slots import SlotPool
from ._options import LoaderConfig
from ._protocol import (
    BatchTimeoutError,
    Job,
    Loaded,
    SharedMemoryUnreachableError,
    StreamRequest,
    WorkerExitedError,
    WorkerFailure,
    decode_answer,
    decode_keys,
)
from ._registry import Payload
from ._sizing import TASK_KEY_BYTES, TaskSizer, key_bytes
from ._snapshot import Picture, first_difference, picture
from ._task import Task
from ._tuning import Tuner
from ._waits import ctrl_c_as_itself

__all__ = ["Collected", "Engine"]

_UNREACHABLE = f"{SharedMemoryUnreachableError.__module__}.{SharedMemoryUnreachableError.__qualname__}"


class Collected(NamedTuple):
    """A collected batch (or a stream's `ShardEnd`) with where its time went, in seconds:
    `timings` maps each hop (`_stats.HOPS`) to its duration; empty for a `ShardEnd`."""

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
        make_payload: `make_payload(pickled)` -> what the workers register.
    """

    def __init__(self, config: LoaderConfig, loader_id: int, make_payload: Callable[[bool], Payload]) -> None:
        self._config = config
        self._loader_id = loader_id
        self._make_payload = make_payload
        self._backend: Backend | None = None
        self._exits_seen = -1  # the backend's `exits.exited` when deaths were last looked for
        self._tasks: collections.deque[Task] = collections.deque()  # in flight, in dispatch order
        self._discarded: list[Task] = []  # no longer wanted; their slots come back as they finish
        self._held: Job | None = None  # taken from the schedule, of another epoch than the task being filled
        self._sizer = TaskSizer()  # how many batches go to a task
        self._dispatching_epoch: int | None = None  # the epoch of the latest task dispatched
        self._forked_from: int | None = None  # the pid whose workers this process inherited by fork
        self._dataset_picture: Picture | None = None  # the dataset when worker processes took their copy
        self.reordered_epoch: int | None = None  # the latest epoch a batch was collected ahead of an older one
        self._collected_epoch: int | None = None  # the epoch of the latest batch collected
        self._closed = False  # close() ran: no workers start again
        self._helpers: weakref.WeakSet[Any] = weakref.WeakSet()  # threads fetching through this engine
        self.fetch_threads: dict[int, int] = {}  # worker id -> threads its latest batch was fetched with
        # num_workers='auto' on the loader's own process pool: the count follows what it measures.
        self.tuner = (Tuner(config.num_workers, config.most_workers, config.cpu_budget or 1.0, config.memory_budget,
                            config.prefetch / config.num_workers, shared=config.budgets_shared)
                      if config.tunes_workers else None)

    @property
    def worker_count(self) -> int:
        """Workers the loader keeps now (its tuned count with num_workers='auto')."""
        return self.tuner.count if self.tuner is not None else self._config.num_workers

    def describe_workers(self) -> str:
        """The workers for the progress bar: "4 workers", with the latest change of a tuned count
        ("4 workers, grew from 2"); "" without workers."""
        count = self.worker_count
        if not count:
            return ""
        text = f"{count} workers"
        if self.tuner is not None and self.tuner.changes:
            change = self.tuner.changes[-1]
            text += f", {change['why'].split(',')[0]} from {change['from']}"
        return text

    @property
    def window(self) -> int:
        """Most tasks in flight (following a tuned worker count; for a tuned count, wider while
        all of them belong to an epoch the caller has not started: see `_tuning._BETWEEN_EPOCHS`)."""
        if self.tuner is None:
            return self._config.prefetch
        if self._tasks and self._collected_epoch is not None and self._tasks[0].epoch != self._collected_epoch:
            return self.tuner.window_between_epochs
        return self.tuner.window

    @property
    def in_flight(self) -> int:
        """Batches dispatched and not yet collected."""
        return sum(len(task.jobs) - task.taken for task in self._tasks)

    @property
    def shards(self) -> int:
        """How many shards a stream epoch has: one per worker (one in-process)."""
        return self._config.num_workers or 1

    def _running(self) -> Backend:
        if self._forked_from is not None:
            raise RuntimeError(f"this DataLoader's workers belong to process {self._forked_from}, from which this "
                               "process was forked; make a new DataLoader here")
        if self._backend is None:
            if self._closed:
                raise RuntimeError("this DataLoader is closed; create a new one")
            self._backend = start(self._config, self._loader_id, self._make_payload, self.worker_count)
            self._exits_seen = -1  # a shared pool's deaths before this loader joined: looked for once
            if self.tuner is not None:
                self.tuner.resized()
            if self._backend.copies_dataset:
                self._dataset_picture = picture(self._config.dataset)
        return self._backend

    def dataset_change(self) -> str | None:
        """Where the dataset differs from the copy this loader's worker processes hold (a path
        such as 'dataset.scale', see `_snapshot`); None when it does not, or when no process
        holds a copy (in-process loading and thread workers read the dataset itself)."""
        if self._dataset_picture is None:
            return None
        return first_difference(self._dataset_picture, picture(self._config.dataset))

    @property
    def owns_workers(self) -> bool:
        """Whether the workers are this loader's own (not a shared WorkerPool's)."""
        return self._backend is None or self._backend.owns_workers

    def accept_dataset(self) -> None:
        """Compare later changes with the dataset as it is now (a shared pool's workers keep
        their copy: the change has been reported)."""
        if self._dataset_picture is not None:
            self._dataset_picture = picture(self._config.dataset)

    def batches_per_task(self) -> int:
        """How many batches the next task carries: one for in-process loading and thread
        workers (they share the caller's memory: nothing to gain), else see `_sizing`."""
        if self._backend is None or self._backend.slots is None:
            return 1
        return self._sizer.per_task

    def fill(self, next_job: Callable[[], Job | None]) -> None:
        """Dispatch jobs from `next_job` until the window is full or it has none."""
        window = self.window
        if len(self._tasks) >= window:
            return  # called after every batch collected: usually the window is still full
        backend = self._running()
        slots = backend.slots
        per_task = self.batches_per_task()
        while len(self._tasks) < window:
            first, self._held = self._held or next_job(), None
            if first is None:
                return
            jobs = [first]
            limit = per_task
            if first.epoch != self._dispatching_epoch:  # the epoch's first task: one batch (see _sizing)
                self._dispatching_epoch, limit = first.epoch, 1
            message_bytes = key_bytes(first.work)
            while len(jobs) < limit and not isinstance(first.work, StreamRequest):
                job = next_job()
                if job is None:
                    break
                message_bytes += key_bytes(job.work)
                if job.epoch != first.epoch or message_bytes > TASK_KEY_BYTES:  # a task never spans two epochs
                    self._held = job
                    break
                jobs.append(job)
            slot = None
            if slots is not None:
                slot = slots.acquire(len(jobs), self._sizer.most_per_task if per_task > 1 else 1)
            task = Task(jobs, slot)
            args: tuple[Any, ...] = (self._loader_id, first.epoch, task.batches, task.slot)
            if self._config.thread_pool:  # threads share this process: a task nobody collects is skipped
                task.cancel = [False]
                args += (task.cancel,)
            task.result = backend.submit(args, task.mark_arrived)
            self._tasks.append(task)

    def collect(self, epoch: int) -> Collected | None:
        """Wait for the oldest batch in flight if it belongs to `epoch` (None otherwise); with
        `in_order=False`, take a batch of `epoch` that finished while the oldest has not.

        Re-raises a worker's exception as its own type; raises `WorkerExitedError` or
        `BatchTimeoutError` (after stopping the workers) rather than wait unbounded.
        """
        if not self._tasks or self._tasks[0].epoch != epoch:
            return None
        asked = time.monotonic()
        self._reap_discarded()
        task = self._next_task(epoch)
        if task.taken == 0:  # once a task, waited for or not: a worker that died while idle is reported too
            with self._failing(task):
                self._check_workers(task)
        if task is not self._tasks[0]:
            self.reordered_epoch = epoch
        position = task.taken
        task.taken += 1
        self._collected_epoch = epoch
        if task.taken == len(task.jobs):
            self._tasks.remove(task)
        ready = time.monotonic()
        item = task.answers.pop(position)  # the batch is the caller's now
        arrival = task.arrivals.pop(position)
        slot = task.slot
        slots = self._backend.slots if self._backend is not None else None
        try:
            message = decode_answer(item)
        except Exception as exc:  # this batch's answer only: the task's others come at their turn
            if slots is not None:
                slots.give_back(slot, None)
            job = task.jobs[position]
            exc.add_note(f"gloader: batch {job.number} of epoch {epoch}{_describe_keys(job)} was loaded by a "
                         "worker, but its answer could not be rebuilt in this process")
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
        if self.tuner is not None and self._backend is not None:
            self._backend.tune(self.tuner, ready - asked, message.fetch_s + message.batchify_s)
        if slots is not None:
            _, _, size, _, _ = batch  # a Handle
            self._sizer.estimate(message, size)
            batch = slots.rebuild(slot, batch)
        arrived = arrival or message.finished  # in-process loading: no trip back
        timings = {"dispatch_s": max(0.0, message.started - task.submitted), "worker_fetch_s": message.fetch_s,
                   "worker_batchify_s": message.batchify_s, "return_s": max(0.0, arrived - message.finished),
                   "window_s": max(0.0, ready - arrived), "handover_s": time.monotonic() - ready}
        return Collected(batch, timings, message.worker_id, message.samples, message.shard_began)

    def _next_task(self, epoch: int) -> Task:
        """The task whose next batch goes out next, once that batch's answer is in: the oldest,
        or with in_order=False one of `epoch` whose batch came first."""
        task = self._tasks[0]
        if not self._has_next(task):
            if self._config.in_order or len(self._tasks) == 1:
                self._await(task)
            else:  # a batch of the epoch that came first goes first, while the oldest is still out
                task = self._finished_task(epoch) or task
                if not self._has_next(task) and not self._await(task, lambda: self._finished_task(epoch) is not None):
                    task = self._finished_task(epoch) or task  # one came while waiting
                    if not self._has_next(task):
                        self._await(task)
        return task

    def _finished_task(self, epoch: int) -> Task | None:
        """The first task of `epoch` in the window with an answer in (in_order=False)."""
        for task in self._tasks:
            if task.epoch != epoch:
                return None
            if self._has_next(task):
                return task
        return None

    def _has_next(self, task: Task) -> bool:
        """Whether the answer of `task`'s next batch is in, without waiting."""
        with self._failing(task):
            return task.ready(self.slots)

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
            self._tasks.remove(task)
            self._discarded.append(task)
            if isinstance(exc, BatchTimeoutError) and self._backend is not None:
                self._backend.timed_out(task.epoch, [job.number for job in task.jobs])
            self.stop_workers(prompt=True)
            raise
        except BaseException:  # Ctrl-C, or a result that could not be received: the task is not ours any more
            self._tasks.remove(task)
            self._discarded.append(task)
            raise

    def _wait(self, task: Task, give_up: Callable[[], bool] | None = None) -> bool:
        """Wait until the answer of `task`'s next batch is in (True) or `give_up()` is true
        (False). The timeout is the batch's: it runs from when the caller began waiting for it."""
        position = task.taken
        slots = self.slots
        if task.waited is None or task.waited[0] != position:
            task.waited = (position, time.monotonic())
            if slots is not None:
                slots.want(task.slot, position + 1)  # its worker sends it as soon as it is written
        deadline = task.waited[1] + self._config.timeout_s
        exits = self._backend.exits if self._backend is not None else None
        while not task.wait(slots, max(0.0, deadline - time.monotonic()), exits, self._exits_seen):
            self._check_workers(task)
            if give_up is not None and give_up():
                return False
            if time.monotonic() > deadline:
                elapsed = time.monotonic() - task.waited[1]
                job = task.next_job
                timeout = self._config.timeout_s
                raise BatchTimeoutError(f"DataLoader timed out after {timeout:g} seconds: batch {job.number} of epoch "
                                        f"{job.epoch}{_describe_keys(job)} took more than {elapsed:.1f} s, the "
                                        f"loader's timeout={timeout:g}; raise timeout= if batches are legitimately "
                                        "slow, or look for a hang in the dataset")
        return True

    def _check_workers(self, task: Task) -> None:
        """Raise WorkerExitedError when a worker process has died since the last check (looked
        for only when a worker exited since then)."""
        backend = self._backend
        if backend is None or backend.exits.exited == self._exits_seen:
            return
        self._exits_seen = backend.exits.exited
        dead = backend.find_dead_worker()
        if dead is not None:
            raise WorkerExitedError(f"{dead}. The loader was waiting for batch {task.next_job.number} of epoch "
                                    f"{task.epoch}; its workers are stopped and the next epoch starts anew.")

    def discard(self, epoch: int | None = None) -> None:
        """Drop the batches in flight of `epoch` (of every epoch when None).

        They leave the window at once, so other batches are dispatched without waiting for them.
        """
        keep: collections.deque[Task] = collections.deque()
        for task in self._tasks:
            if epoch is None or task.epoch == epoch:
                _skip(task)
                self._discarded.append(task)
            else:
                keep.append(task)
        self._tasks = keep
        if self._held is not None and (epoch is None or self._held.epoch == epoch):
            self._held = None
        self._reap_discarded()

    def abandon(self, position: Any) -> None:
        """The caller dropped an iterator mid-epoch (`position`: where it stood; the loader's
        finalizer of the iterator calls this): thread workers skip the epoch's batches they
        have not begun, which would otherwise go on drawing from the process's generators.
        Only flags are set, whatever thread the collector runs in; the next iter() discards."""
        if position.asked and not position.finished:
            for task in list(self._tasks):
                if task.epoch == position.epoch.number:
                    _skip(task)

    def _reap_discarded(self, backend: Backend | None = None) -> None:
        """Free the slots of discarded tasks' uncollected batches once the task has finished;
        keep waiting for the others."""
        backend = backend or self._backend
        slots = backend.slots if backend is not None else None
        if slots is None:
            self._discarded = []
            return
        keep = []
        for task in self._discarded:
            try:
                task.receive(slots)
            except Exception:  # what did not arrive never will
                task.done = True
            for position in list(task.answers):
                try:
                    message = decode_answer(task.answers.pop(position))
                except Exception:
                    message = None
                slots.give_back(task.slot, message.batch if isinstance(message, Loaded) else None)
                task.taken += 1
            if task.done:  # answers that never came (the slot was retired first): their share
                for _ in range(task.taken, len(task.jobs)):
                    slots.give_back(task.slot, None)
            else:
                keep.append(task)
        self._discarded = keep

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes now running for this loader."""
        return self._backend.worker_pids() if self._backend is not None else []

    def worker_processes(self) -> list[Any]:
        """The worker processes of this loader, by worker id; they start here if they had not
        (none once the loader is closed)."""
        return [] if self._closed else self._running().worker_processes()

    def shared_memory_bytes(self) -> tuple[int, int]:
        """(resident, mapped) bytes of the loader's shared-memory slots."""
        slots = self._backend.slots if self._backend is not None else None
        return (slots.in_use_bytes(), slots.capacity_bytes()) if slots is not None else (0, 0)

    @property
    def slots(self) -> SlotPool | None:
        """The loader's shared-memory slots (None before the first batch and for threads)."""
        return self._backend.slots if self._backend is not None else None

    def stop_workers(self, prompt: bool = False) -> None:
        """Stop the workers (or leave the shared pool) and release shared memory; the next
        `fill` starts anew. Batches already collected stay valid. `prompt`: terminate at once
        (see `PoolCore.close`)."""
        backend, self._backend = self._backend, None
        self._dataset_picture = None
        if backend is None:
            return
        if self.tuner is not None:
            self.tuner.resized()
            self.tuner.workers_stopped()
        for task in self._tasks:
            _skip(task)
        self._discarded.extend(self._tasks)  # freed below: by the drain, or with every slot at close
        self._tasks.clear()
        self._held = None  # its epoch ends with these workers

        def drain(timeout_s: float) -> None:  # leaving a shared pool: let our tasks finish first
            deadline = time.monotonic() + timeout_s
            for task in self._discarded:
                with ctrl_c_as_itself():
                    task.result.wait(max(0.0, deadline - time.monotonic()))
            for task in self._discarded:  # what did not finish by now never will (a dead worker's)
                if not task.result.ready():
                    backend.forget(task.result)
            self._reap_discarded(backend)

        backend.close(drain, prompt)
        self._discarded = []

    def attach(self, helper: Any) -> None:
        """Have `close()` first call `helper.stop()` (a pin thread, which fetches through this
        engine from its own thread; held weakly)."""
        self._helpers.add(helper)

    def close(self) -> None:
        """Stop the attached helpers, then the workers, for good: a later `fill` raises
        instead of starting new ones. The exit hook closes engines, not iterators: a pin
        thread still fetching raced the stop and started a new pool during shutdown."""
        self._closed = True
        for helper in list(self._helpers):
            helper.stop()
        self.stop_workers()
        if self.tuner is not None:
            self.tuner.close()

    def forget_after_fork(self) -> None:
        """In a forked child: the workers, the tasks in flight and the shared memory are the
        parent's. Drop them without closing anything (see `PoolCore.forget_after_fork`); using
        the loader here raises. In-process loading has nothing of the parent's and goes on."""
        backend = self._backend
        if backend is None or not backend.forget_after_fork():
            return
        self._backend, self._held, self._discarded = None, None, []
        self._tasks.clear()
        self._forked_from = os.getppid()

    def close_from_gc(self) -> None:
        """The loader's finalizer: close, and say so when workers were still running. Where
        warnings are errors (`python -W error`, pytest's `filterwarnings = error`) the warning
        is raised, so it is given only after the workers have stopped."""
        running = self._backend is not None and self._backend.has_workers
        self.stop_workers()
        if running:
            warnings.warn("a gloader DataLoader with running workers was garbage-collected without close(); "
                          "use `with DataLoader(...) as loader:` or call loader.close()", ResourceWarning,
                          stacklevel=2)


def _skip(task: Task) -> None:
    """Have the thread worker skip the batches of `task` it has not begun (nobody will collect them)."""
    if task.cancel is not None:
        task.cancel[0] = True


def _describe_keys(job: Job) -> str:
    if not isinstance(job.work, (bytes, list)):
        return ""
    keys = decode_keys(job.work)
    return f" (sample indices {keys[:8]}{'...' if len(keys) > 8 else ''})"
