"""Admission: on a pool with more process workers than CPUs, at most one task per CPU runs
at a time while tasks keep the CPU busy; the other workers wait for a permit instead of
time-sharing the CPUs.

Time-shared CPU-bound workers are switched every time slice, and each switch refills the
caches: W8 (JPEG decoding) with 4 workers on 2 cores took 157-167 ms of worker CPU a batch
against 148-156 ms with 2. With permits, a worker switches only between tasks. Measured on
W8 (fresh loaders, 10 rounds of 48 batches after 32 warm-up, alternating 2 workers, 4
without and 4 with permits; medians): 4 workers read 0.958x 2 workers without permits and
0.976x with them, 1.021x without in 8 rounds of 10. 3 workers (the permits shared unevenly:
two wait for one, the third has its own) with permits read 1.008x without, faster in 6
rounds of 8. A prototype of the same scheme on W3 (16 ms batches, 8 rounds of 150): 0.998x
and 1.000x. The rest of the gap is the caches of four processes instead of two, and each
worker's first use of each of twice as many slots.

Permits are POSIX record locks on files of the pool's directory (`_mppool.ProcessLock`): the
kernel releases a dead worker's permit, so a kill never loses one, and a wait for a permit
ends when its holder's task does (the loader's `timeout` bounds that task: the caller kills
its worker). A worker tries every permit once, then waits for its own (worker id modulo the
number of permits).

Only tasks that keep the CPU busy are held back. The worker splits each task's time, from
its thread's own counters, into running (CPU time), waiting for a CPU (the scheduler's run
delay, /proc/thread-self/schedstat) and blocked (the rest: reads, sleeps, locks). A task
blocked for more than _BLOCKED_SHARE of its time lets its worker run the next task without a
permit, so a dataset that waits on storage or the network (the reason to start more workers
than CPUs) keeps every worker running; the next task that does not block asks for permits
again. Where the run delay cannot be read, there are no permits.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ._mppool import ProcessLock

__all__ = ["Admission", "usable_cpus"]

# The share of a task's wall time spent blocked (neither running nor waiting for a CPU) above
# which its worker's next task runs without a permit. Larger: datasets that block a little
# (a few reads among decoding) are still held to one task per CPU, and the CPUs idle while
# they block; smaller: CPU-bound tasks that block briefly (page cache misses, a lock) lose
# their permits and time-share again. W8 tasks of a 4-worker pool on 2 CPUs were blocked for
# 0.14% of their time (median; at most 4.4% in 88 tasks).
_BLOCKED_SHARE = 0.2
_SCHEDSTAT = "/proc/thread-self/schedstat"


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Admission:
    """One worker's side of a pool's permits; `with admission:` around the work of a task.

    Args:
        permits: the pool's permits, one per CPU (empty: every task runs at once).
        worker_id: this worker's id, which picks the permit it waits for.
    """

    def __init__(self, permits: Sequence[ProcessLock], worker_id: int) -> None:
        self._permits = tuple(permits)
        self._home = worker_id % len(self._permits) if self._permits else 0
        self._schedstat = -1  # opened by the thread that runs the tasks, at its first task; kept until exit
        self._blocked = False  # the last task was blocked for more than _BLOCKED_SHARE of its time
        self._held: ProcessLock | None = None
        self._start: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        if not self._permits or (self._schedstat < 0 and not self._open()):
            return
        if not self._blocked:
            self._held = self._take()
        self._start = self._times()

    def __exit__(self, *exc: Any) -> None:
        if not self._permits:
            return
        end = self._times()
        if self._held is not None:
            self._held.release()
            self._held = None
        if end is None or self._start is None:  # the run delay could not be read: no permits from now on
            self._permits = ()
            return
        wall, cpu, delay = (after - before for after, before in zip(end, self._start))
        self._blocked = wall - cpu - delay > _BLOCKED_SHARE * wall

    def _open(self) -> bool:
        try:
            self._schedstat = os.open(_SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no run delay to tell waiting for a CPU from blocking
            self._permits = ()
            return False
        return True

    def _take(self) -> ProcessLock | None:
        count = len(self._permits)
        try:
            for step in range(count):
                permit = self._permits[(self._home + step) % count]
                if permit.acquire(block=False):
                    return permit
            permit = self._permits[self._home]
            permit.acquire()
        except OSError:  # e.g. the kernel saw a deadlock among record locks: run without a permit
            return None
        return permit

    def _times(self) -> tuple[int, int, int] | None:
        """(wall, CPU, run delay) of this thread so far, in ns; None if the run delay cannot be read."""
        try:
            delay = int(os.pread(self._schedstat, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return time.perf_counter_ns(), time.thread_time_ns(), delay
