"""Task sizes: how many consecutive batches of an epoch travel in one task, from running
estimates of a batch's worker time and bytes (see docs/design.md, "Several small batches to a
task"). The engine asks before each task and tells it each batch collected."""
from __future__ import annotations

from typing import Any, Callable

from .._pool.channel import ATOMIC_TASK_BYTES
from .._wire.protocol import Job, Loaded, StreamRequest
from .slots import TASK_BYTES

__all__ = ["TASK_KEY_BYTES", "TASK_TARGET_S", "TaskSizer", "key_bytes"]

# Small batches travel several to a task, so that the fixed cost of a task's round trip
# (~0.1-0.2 ms of the caller's CPU on a local pool) is shared: as many consecutive batches of
# one epoch as the workers load in about the strategy's target (TASK_TARGET_S for a local
# process pool; see `_places`, `_places.ray`), at most _MAX_BATCHES_PER_TASK and TASK_BYTES (what
# the slots are sized for), with keys a worker can read whole (_pool.channel.ATOMIC_TASK_BYTES); an
# epoch's first task carries one batch. Longer target: less overhead per batch; shorter: less
# in flight. The measurements behind these numbers: docs/design.md, "Several small batches to
# a task".
TASK_TARGET_S = 0.02
_MAX_BATCHES_PER_TASK = 32
# The sample keys a task message may carry (room left for the rest of the message), and
# what a key that is not part of an int64 array is taken to need.
TASK_KEY_BYTES = ATOMIC_TASK_BYTES - 2048
_GUESSED_KEY_BYTES = 64
# Weight of the newest batch in the running estimate of a batch's cost and size.
_ESTIMATE_WEIGHT = 0.2


def key_bytes(work: Any) -> int:
    """About what a job's work adds to its task message."""
    if isinstance(work, bytes):
        return len(work) + 32
    return _GUESSED_KEY_BYTES * len(work) if isinstance(work, list) else _GUESSED_KEY_BYTES


class TaskSizer:
    """Running estimates of a batch's worker time and bytes, and the task sizes they give:
    `per_task`, how many batches the next task carries for the strategy's target (`aim`), and
    `most_per_task`, the most a task may carry by their size alone (plain attributes, kept by
    `estimate` and `aim`: the engine reads them for every task)."""

    def __init__(self) -> None:
        self.batch_cost_s = 0.0  # 0: unknown
        self.batch_bytes = 0.0
        self.most_per_task = _MAX_BATCHES_PER_TASK
        self.target_s = 0.0  # the running strategy's `task_target_s` (0: one batch a task)
        self.per_task = 1
        self._epoch: int | None = None  # the epoch of the latest task taken

    def take(self, first: Job, next_job: Callable[[], Job | None], limit: int) -> tuple[list[Job], Job | None]:
        """The jobs of the next task: `first` and up to `limit` in all from `next_job` (one for
        an epoch's first task), and the job taken that starts the task after (None if none): a
        task never spans two epochs, and its keys fit its message."""
        if first.epoch != self._epoch:
            self._epoch, limit = first.epoch, 1
        jobs = [first]
        message_bytes = key_bytes(first.work)
        while len(jobs) < limit and not isinstance(first.work, StreamRequest):
            job = next_job()
            if job is None:
                break
            message_bytes += key_bytes(job.work)
            if job.epoch != first.epoch or message_bytes > TASK_KEY_BYTES:
                return jobs, job
            jobs.append(job)
        return jobs, None

    def estimate(self, message: Loaded, size: int) -> None:
        """Update the estimates with a batch collected (`size`: its bytes)."""
        cost = message.fetch_s + message.batchify_s
        self.batch_cost_s += (cost - self.batch_cost_s) * (_ESTIMATE_WEIGHT if self.batch_cost_s else 1.0)
        self.batch_bytes += (size - self.batch_bytes) * (_ESTIMATE_WEIGHT if self.batch_bytes else 1.0)
        if self.batch_bytes > 0.0:
            self.most_per_task = max(1, min(_MAX_BATCHES_PER_TASK, int(TASK_BYTES / self.batch_bytes)))
        self.aim(self.target_s)

    def aim(self, target_s: float) -> None:
        """Size the next tasks for a strategy whose tasks aim at `target_s` seconds of worker
        time (see `_places.Backend.task_target_s`)."""
        self.target_s = target_s
        cost = self.batch_cost_s
        self.per_task = 1 if not target_s or cost <= 0.0 else max(1, min(int(target_s / cost), self.most_per_task))
