"""Admission: on a pool with more process workers than CPUs, while its tasks keep the CPU
busy, one worker per CPU takes them and the other workers wait, instead of time-sharing the
CPUs (which refills the caches at every switch).

The rules: a worker takes a permit (a POSIX record lock on a file of the pool's directory,
`_pool.directory.ProcessLock`, which the kernel frees when its holder dies) before it reads its next
task, and keeps it across tasks. No task waits for a permit, since only a worker holding none
waits for one. A waiting worker tries every permit every _WAIT_POLL_S and takes its next task
without one when a holder spent the last interval inside a task and off the CPU (tasks that
wait for one another: samples meeting at a barrier). Stream tasks run without permits. A worker
whose tasks spend more than _BLOCKED_SHARE of their time blocked (a moving average; a task
with no voluntary context switch never counts as blocked, so stolen time on a virtual machine
does not) holds no permit, so datasets that wait on storage keep every worker running. Where
the run delay cannot be read, there are no permits. The measurements behind each rule are in
docs/design.md, "More workers than CPUs".
"""
from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable, Sequence

from .directory import ProcessLock

__all__ = ["Admission", "usable_cpus"]

# The share of its time a worker's tasks spend blocked (neither running nor waiting for a
# CPU), averaged over tasks, above which the worker runs its tasks without a permit. What
# permits save is ~2-3% (W8) and what a blocking holder costs is about its blocked share, so
# the line is near the saving. Larger: datasets that block a little (reads among decoding)
# keep their permits and idle the CPUs while they block; smaller: CPU-bound tasks that block
# now and then (W8 tasks of a 4-worker pool on 2 CPUs: median 0.12-0.14%, but 10% of them over
# 3-5%) lose their permits more often.
_BLOCKED_SHARE = 0.03
# Weight of the newest task in the average. Larger: a worker follows a change of workload
# (a cold first epoch, a warm second) in fewer tasks; smaller: one odd task moves it less.
_SMOOTHING = 0.25
_SCHEDSTAT = "/proc/thread-self/schedstat"
# How often a worker waiting for a permit tries them all and looks at their holders. Shorter:
# a freed permit (or a holder stuck in a task) is taken up sooner; longer: fewer wake-ups of
# waiting workers (each ~20-30 us of CPU, taken from the holders).
_WAIT_POLL_S = 0.05
# The share of a poll interval that a holder inside a task spent neither running nor waiting
# for a CPU, from which it counts as stuck (its CPU idles; its task may wait for another).
# Lower: a holder that blocks briefly lets a waiting worker in sooner (time-sharing the CPUs
# once it runs again); higher: only holders that hardly run.
_STUCK_SHARE = 0.9
# Linux's (where the run delay can be read): the calling thread's counters only.
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Admission:
    """One worker's side of a pool's permits.

    The pool's task queue calls `before_task()` before the worker waits for its next task;
    `with admission.task(stream):` goes around the work of each task it takes.

    Args:
        permits: the pool's permits, one per CPU (empty: every task runs at once).
        worker_id: this worker's id, which picks the permit it tries first.
        in_task: `in_task(pid)` says whether worker `pid` is inside a task (not waiting for
            one); None: always taken to be.
    """

    def __init__(self, permits: Sequence[ProcessLock], worker_id: int,
                 in_task: Callable[[int], bool] | None = None) -> None:
        self._permits = tuple(permits)
        self._home = worker_id % len(self._permits) if self._permits else 0
        self._in_task = in_task or (lambda pid: True)
        self._schedstat = -1  # opened by the thread that runs the tasks, at its first task; kept until exit
        self._blocked_share = 0.0  # moving average over this worker's tasks
        self._held: ProcessLock | None = None
        self._start: tuple[int, int, int, int] | None = None
        self._streaming = False  # the last task was a stream's: no permit until a task by key

    def before_task(self) -> None:
        """Take a permit unless this worker holds one, serves a stream or blocks too often;
        waits until one is free (the worker holds no task while it waits)."""
        if self._held is not None or self._streaming or not self._permits or self._blocked_share > _BLOCKED_SHARE:
            return
        if self._schedstat < 0 and not self._open():
            return
        self._held = self._take()

    def task(self, stream: bool) -> Admission:
        """Admission for a task just taken; `stream`: it asks for a stream's next batch, which
        only this worker's shard can answer, so it runs without a permit."""
        self._streaming = stream
        if stream:
            self._release()
        return self

    def __enter__(self) -> None:
        if self._permits and (self._schedstat >= 0 or self._open()):
            self._start = self._times()
            if self._start is None:
                self._stop()

    def __exit__(self, *exc: Any) -> None:
        if not self._permits or self._start is None:
            return
        end, start, self._start = self._times(), self._start, None
        if end is None:
            self._stop()
            return
        wall, cpu, delay, waits = (after - before for after, before in zip(end, start))
        share = (wall - cpu - delay) / wall if wall > 0 and waits > 0 else 0.0
        self._blocked_share += _SMOOTHING * (share - self._blocked_share)
        if self._blocked_share > _BLOCKED_SHARE:
            self._release()

    def _stop(self) -> None:
        """The run delay could not be read: no permits from now on."""
        self._permits = ()
        self._release()

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def _open(self) -> bool:
        try:
            self._schedstat = os.open(_SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no run delay to tell waiting for a CPU from blocking
            self._stop()
            return False
        return True

    def _take(self) -> ProcessLock | None:
        """A permit once one is free; None (run the next task without one) as soon as a holder
        is stuck in a task, or where the permits cannot be used."""
        count = len(self._permits)
        seen: dict[int, tuple[int, int]] = {}
        try:
            while True:
                for step in range(count):
                    permit = self._permits[(self._home + step) % count]
                    if permit.acquire(block=False):
                        return permit
                if self._a_holder_is_stuck(seen):
                    return None
                time.sleep(_WAIT_POLL_S)
        except OSError:  # the permits' files are gone (the pool is closing): run without one
            return None

    def _a_holder_is_stuck(self, seen: dict[int, tuple[int, int]]) -> bool:
        """Whether a holder spent the interval since the last look (`seen`: pid -> (when, its
        running and waiting ns then), updated here) inside a task and off the CPU."""
        now = time.perf_counter_ns()
        looked: dict[int, tuple[int, int]] = {}
        stuck = False
        for permit in self._permits:
            pid = permit.holder()
            if pid is None:
                continue
            try:
                with open(f"/proc/{pid}/schedstat", "rb") as stats:  # the holder's main thread, which runs tasks
                    fields = stats.read().split()
                progress = int(fields[0]) + int(fields[1])
            except (OSError, ValueError, IndexError):  # it has just exited: its permit is free
                continue
            looked[pid] = (now, progress)
            before = seen.get(pid)
            if before is not None and now > before[0] and self._in_task(pid):
                off_cpu = (now - before[0]) - (progress - before[1])
                stuck = stuck or off_cpu > _STUCK_SHARE * (now - before[0])
        seen.clear()
        seen.update(looked)
        return stuck

    def _times(self) -> tuple[int, int, int, int] | None:
        """(wall, CPU, run delay in ns, voluntary context switches) of this thread so far;
        None if the run delay cannot be read."""
        try:
            delay = int(os.pread(self._schedstat, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None
        waits = resource.getrusage(_RUSAGE_THREAD).ru_nvcsw
        return time.perf_counter_ns(), time.thread_time_ns(), delay, waits
