"""A task in the engine's window: consecutive batches of one epoch dispatched together, and
their answers as they arrive (see `_caller.engine` for the whole flow)."""
from __future__ import annotations

import collections
import time
from typing import Any, Callable

from .._wire.protocol import BatchTimeoutError, Job, Loaded, decode_answer, decode_answers, decode_keys
from .._wire.segment import Slot
from .slots import SlotPool
from .waits import as_ctrl_c, ctrl_c_as_itself

__all__ = ["Task", "TaskWindow", "describe_keys", "timeout_error"]

# How long one wait lasts, on a task whose place does not ring when another task finishes
# (in-process loading, Ray), before the engine looks at the deadline
# and, with in_order=False, at the other tasks again. Longer: fewer wake-ups; shorter: a
# batch that finished out of order is taken sooner.
_POLL_S = 0.04


def _marker(arrived: list[float]) -> Callable[[Any], None]:
    def mark(value: Any) -> None:
        arrived[0] = time.monotonic()

    return mark


class Task:
    """Consecutive batches of one epoch dispatched as one task: their jobs, the slot lent to
    them, the task's result, and its batches' answers as they arrive: a process worker
    publishes each in the slot as soon as its batch is written (see `_wire.segment`), and sends
    what did not fit there by message."""

    __slots__ = ("jobs", "epoch", "batches", "slot", "result", "submitted", "arrived", "mark_arrived", "answers", "arrivals",
                 "chunks_taken", "done", "taken", "waited", "cancel")

    def __init__(self, jobs: list[Job], slot: Slot | None) -> None:
        self.jobs = jobs
        self.epoch = jobs[0].epoch
        self.batches = tuple((job.batch_index, job.seed, job.work) for job in jobs)  # as the task sends them
        self.slot = slot
        self.result: Any = None
        self.submitted = time.monotonic()
        # When the final result arrived, set by the pool's supervisor thread through `mark_arrived`
        # (the callback given with the task). A list, not an attribute, and a callback that
        # holds only it: the pool keeps the callback, and one bound to the task would tie the
        # task, its result and the pool into a cycle (pipes open until gc).
        self.arrived = [0.0]
        self.mark_arrived = _marker(self.arrived)
        self.answers: dict[int, Any] = {}  # position in the task -> answer, received and not collected
        self.arrivals: dict[int, float] = {}  # position -> when it arrived (0.0: not known, in-process)
        self.chunks_taken = 0  # parts of the result (`result.chunks`) taken in
        self.done = False  # the whole result is in
        self.taken = 0  # batches collected (of a discarded task: collected or given back)
        # (batch position, since when) the caller waits for: its deadline runs from there
        self.waited: tuple[int, float] | None = None
        # Thread workers: set to [True] when nobody will collect the task; its batches not yet
        # begun are skipped (see _worker.run_task). None for process workers.
        self.cancel: list[bool] | None = None

    def undecodable(self, position: int, slots: SlotPool | None, exc: Exception) -> None:
        """The answer of batch `position` could not be decoded (`exc`): its share of the slot
        is given back, and a note on `exc` names the batch."""
        if slots is not None:
            slots.give_back(self.slot, None)
        job = self.jobs[position]
        exc.add_note(f"gloader: batch {job.batch_index} of epoch {job.epoch}{describe_keys(job)} was loaded by a "
                     "worker, but its answer could not be rebuilt in this process")

    def skip(self) -> None:
        """Have the thread worker skip the batches it has not begun (nobody will collect them)."""
        if self.cancel is not None:
            self.cancel[0] = True

    @property
    def next_job(self) -> Job:
        return self.jobs[self.taken]

    @property
    def has_next(self) -> bool:
        """The answer of the next batch to collect is in (see `receive`)."""
        return self.taken in self.answers

    def overdue(self) -> tuple[Job, float]:
        """At the deadline of the caller's wait: the batch that is late, and its time so far: the
        next one to collect, waited for since `waited`. A task whose batches come back together
        (Ray's, see `_places.ray`) may be loading a later one: the batches before it are taken in as
        they are, and the next one is not late (0.0): its wait begins anew, as for a task that
        delivers each batch when written."""
        assert self.waited is not None
        job, elapsed = self.next_job, time.monotonic() - self.waited[1]
        loading = getattr(self.result, "loading", None)
        found = loading() if loading is not None else None
        if found is not None and found[0] > self.taken:
            now = time.monotonic()
            for position in range(self.taken, found[0]):
                self._add(position, found[1][position], now)
            return job, 0.0
        return job, elapsed

    def ready(self, slots: SlotPool | None) -> bool:
        """Whether the answer of the next batch to collect is in, taking in what arrived."""
        if self.taken not in self.answers:
            self.receive(slots)
        return self.taken in self.answers

    def receive(self, slots: SlotPool | None) -> None:
        """Take in the answers that arrived since the last look: published in the slot, sent
        before the end, or in the final result; raises what the task raised (in-process
        loading loads its batches here)."""
        if self.done:
            return
        result = self.result
        ready = result.ready()  # looked at first: once it is, every answer is in the slot or a message
        if slots is not None and self.slot is not None:
            now = time.monotonic()
            for position, answer in slots.answers(self.slot):
                self._add(position, answer, now)
        chunks = getattr(result, "chunks", None)
        while chunks is not None and self.chunks_taken < len(chunks):
            when, data = chunks[self.chunks_taken]
            self.chunks_taken += 1
            for position, answer in decode_answers(data):
                self._add(position, answer, when)
        if ready:
            value = result.get(0)
            self.done = True
            # process workers: (position, answer) of those not published (b"": none); threads, in-process: all
            for position, answer in (decode_answers(value) if value else ()) if isinstance(value, bytes) \
                    else enumerate(value):
                if position >= self.taken:  # (Ray: those before were taken in early, see `overdue`)
                    self._add(position, answer, self.arrived[0])

    def _add(self, position: int, answer: Any, when: float) -> None:
        self.answers[position] = answer
        self.arrivals[position] = when

    def wait(self, slots: SlotPool | None, timeout_s: float, exits: Any = None, seen: int = 0) -> bool:
        """Wait up to `timeout_s` for the next batch's answer; True once it is in (the caller
        has just looked: `receive`). A pool's result rings `wakeup` when any task of the loader
        progresses and, on a process pool, when a worker exits (see `_pool.processes`), so the
        whole wait is one sleep; other results are waited on for at most _POLL_S at a time. Returns
        False without sleeping when `exits.exited` is no longer `seen` (the exits the caller
        has looked at): an exit rung before the event was cleared would not wake it."""
        wakeup = getattr(self.result, "wakeup", None)
        if wakeup is None:
            try:
                self.result.wait(min(timeout_s, _POLL_S))
            except RuntimeError as exc:
                as_ctrl_c(exc)
        else:
            wakeup.clear()  # then one more look: what came meanwhile set it before the clear
            self.receive(slots)
            if self.has_next:
                return True
            if exits is not None and exits.exited != seen:  # counted before it rings: the caller looks
                return False
            try:
                wakeup.wait(timeout_s)
            except RuntimeError as exc:
                as_ctrl_c(exc)
        self.receive(slots)
        if self.done and not self.has_next:
            raise RuntimeError(f"internal error: the task of batches {self.jobs[0].batch_index}-{self.jobs[-1].batch_index} "
                               f"ended without an answer for batch {self.next_job.batch_index}")
        return self.has_next


def timeout_error(job: Job, elapsed: float, timeout_s: float, why: str | None = None) -> BatchTimeoutError:
    """The error of a batch over the loader's timeout; `why`: what it waited for, when the
    workers know (actors not placed), else the likely causes are said."""
    return BatchTimeoutError(f"DataLoader timed out after {timeout_s:g} seconds: batch {job.batch_index} of epoch "
                             f"{job.epoch}{describe_keys(job)} took more than {elapsed:.1f} s, the loader's "
                             f"timeout={timeout_s:g}; " + (why or "raise timeout= if batches are legitimately slow, "
                                                                  "or look for a hang in the dataset"))


class TaskWindow(collections.deque[Task]):
    """The engine's tasks in flight, oldest first, and those discarded (nobody will collect
    them), kept until their batches' slot shares come back (`reap`)."""

    def __init__(self) -> None:
        super().__init__()
        self.discarded: list[Task] = []

    @property
    def in_flight(self) -> int:
        """Batches dispatched and not yet collected."""
        return sum(len(task.jobs) - task.taken for task in self)

    def drop(self, task: Task) -> None:
        """`task` leaves the window (a failure while receiving its answers)."""
        self.remove(task)
        self.discarded.append(task)

    def discard(self, epoch: int | None = None) -> None:
        """The tasks of `epoch` (every task when None) leave the window; thread workers skip
        their batches not yet begun."""
        for task in list(self):
            if epoch is None or task.epoch == epoch:
                task.skip()
                self.drop(task)

    def skip(self, epoch: int) -> None:
        """Thread workers skip the batches of `epoch` they have not begun (only flags are set)."""
        for task in list(self):
            if task.epoch == epoch:
                task.skip()

    def first_ready(self, epoch: int, has_next: Callable[[Task], bool]) -> Task | None:
        """The first task of `epoch` whose next batch's answer is in (in_order=False)."""
        for task in self:
            if task.epoch != epoch:
                return None
            if has_next(task):
                return task
        return None

    def reap(self, slots: SlotPool | None) -> None:
        """Give back the slot shares of the discarded tasks' uncollected batches as their
        answers come; keep the tasks still running (none without slots: nothing to give back)."""
        if slots is None:
            self.discarded = []
            return
        keep = []
        for task in self.discarded:
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
        self.discarded = keep

    def drain(self, backend: Any, timeout_s: float) -> None:
        """Leaving a shared pool: let the discarded tasks finish, up to `timeout_s`, before
        the slots go; the pool forgets those that did not (a dead worker's never will)."""
        deadline = time.monotonic() + timeout_s
        for task in self.discarded:
            with ctrl_c_as_itself():
                task.result.wait(max(0.0, deadline - time.monotonic()))
        for task in self.discarded:
            if not task.result.ready():
                backend.forget(task.result)
        self.reap(backend.slots)


def describe_keys(job: Job) -> str:
    """" (sample indices [...])" for a job of a map-style epoch, else ""."""
    if not isinstance(job.work, (bytes, list)):
        return ""
    keys = decode_keys(job.work)
    return f" (sample indices {keys[:8]}{'...' if len(keys) > 8 else ''})"
