"""Admission: on a pool with more process workers than CPUs, at most one task per CPU runs
at a time while tasks keep the CPU busy; the other workers wait for a permit instead of
time-sharing the CPUs.

Time-shared CPU-bound workers are switched every time slice, and each switch refills the
caches: W8 (JPEG decoding) with 4 workers on 2 cores took 157-167 ms of worker CPU a batch
against 148-156 ms with 2. With permits, a worker switches only between tasks. Measured on
W8 (fresh loaders, 8 rounds of 48 batches after 32 warm-up, alternating 2 workers, 4 without
and 4 with permits): 4 workers with permits read 1.028x without (median of the rounds'
ratios; faster in 7 rounds of 8), and 821 samples/s against 791 without and 808 for 2
workers (medians). With a first version that let only tasks blocked over 20% of their time
go without permits: 1.021x (8 rounds of 10), 0.976x 2 workers. 3 workers (the permits shared
unevenly: two wait for one, the third has its own) read 1.008x without, faster in 6 rounds
of 8. A prototype of the same scheme on W3 (16 ms batches, 8 rounds of 150): 0.998x and
1.000x of 2 workers without and with permits.

Permits are POSIX record locks on files of the pool's directory (`_mppool.ProcessLock`): the
kernel releases a dead worker's permit, so a kill never loses one, and a wait for a permit
ends when its holder's task does (the loader's `timeout` bounds that task: the caller kills
its worker). A worker tries every permit once, then waits for its own (worker id modulo the
number of permits).

Only tasks that keep the CPU busy are held back. The worker splits each task's time, from
its thread's own counters, into running (CPU time), waiting for a CPU (the scheduler's run
delay, /proc/thread-self/schedstat) and blocked (the rest: reads, sleeps, locks), and keeps a
moving average of the blocked share. A permit holder that blocks leaves its CPU idle, which
costs about the share it blocks: a synthetic dataset (1 ms of CPU and a sleep per sample, 4
workers on 2 CPUs) read 0.87x, 0.83x and 0.80x with permits than without when it slept
~11%, ~16% and ~20% of the time (from 2 workers' loss), 0.99x when it never slept; with the
average below, 1.00-1.01x. So a worker asks for permits only while its average stays under
_BLOCKED_SHARE; a dataset that waits on storage or the network (the reason to start more
workers than CPUs) keeps every worker running. Where the run delay cannot be read, there are
no permits.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

from ._mppool import ProcessLock

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
        self._blocked_share = 0.0  # moving average over this worker's tasks
        self._held: ProcessLock | None = None
        self._start: tuple[int, int, int] | None = None

    def __enter__(self) -> None:
        if not self._permits or (self._schedstat < 0 and not self._open()):
            return
        if self._blocked_share <= _BLOCKED_SHARE:
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
        share = (wall - cpu - delay) / wall if wall > 0 else 0.0
        self._blocked_share += _SMOOTHING * (share - self._blocked_share)

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
