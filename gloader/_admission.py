"""Admission: on a pool with more process workers than CPUs, while its tasks keep the CPU
busy, one worker per CPU takes them and the other workers wait, instead of time-sharing the
CPUs.

Time-shared CPU-bound workers are switched every time slice, and each switch refills the
caches: W8 (JPEG decoding) with 4 workers on 2 cores took 157-167 ms of worker CPU a batch
against 148-156 ms with 2. A worker takes a permit before it reads its next task from the
pool's queue and keeps it across tasks, so tasks go only to permit holders (and to workers
that run without one, below): CPU-bound work runs as with one worker per CPU, with no switch
between workers at all. Measured with fresh loaders, one iterator across warm-up and timed
batches, median of the per-round ratios of 4 workers to 2 on 2 cores: W3 (16 ms batches, 10
rounds of 100 after 20, the benchmark's own turns, twice) 1.004x and 0.996x, against 0.990x
when a permit was taken per task (and released after it, so the CPU went to a waiting worker
after every task) and 0.988x without permits (8 rounds of 150 after 20); W8 (6 rounds of 48
after 32) 1.003x, against 0.993x per task and 0.997x without, and 0.994x in 8 rounds of the
benchmark's turns. A permit per task read 1.020x on W8 in 10 other rounds: all within the
noise of this machine, except that the worker CPU a W8 batch took fell from 158.8 ms (per
task) to 153.5.

No task waits for a permit: a worker waits for a permit only before it reads a task, holding
none; a holder either runs a task or waits on the queue, so every task queued is taken by a
holder or by a worker without permits. Tasks can wait for one another, though: samples that
meet at a barrier, or a dataset whose `__getitem__` waits for what other workers produce. Had
every holder such a task, the tasks they wait for would stay queued until the loader's
timeout. So a waiting worker tries every permit every _WAIT_POLL_S, and watches the holders
(the kernel names them): when one has spent the last interval inside a task and off the CPU
(neither running nor waiting for a CPU, from its /proc schedstat), its CPU idles, and the
waiting worker takes its next task without a permit. A holder waiting on the queue between
tasks is not a reason (the status table says which holders are inside a task). Measured: 6
workers on 2 CPUs whose samples meet at a barrier of 6 (torch's test_worker_seed does that)
timed out before, and load in ~0.1 s now.
Permits are POSIX record locks on files of the pool's directory (`_mppool.ProcessLock`): the
kernel releases a dead worker's permit, so a kill never loses one.

Stream tasks (an iterable dataset) run without permits: each worker answers from its own
shard, so a worker kept waiting would keep its shard from the epoch. A worker gives its
permit back when it takes a stream task, and takes none until it takes a task by key.

Only tasks that keep the CPU busy are held back. The worker splits each task's time, from
its thread's own counters, into running (CPU time), waiting for a CPU (the scheduler's run
delay, /proc/thread-self/schedstat) and blocked (the rest: reads, sleeps, locks), and keeps
a moving average of the blocked share. A task that never gave up its CPU of its own accord
(no voluntary context switch, getrusage(RUSAGE_THREAD)) did not block, whatever its times
say: on a virtual machine the hypervisor takes the CPU from a running guest now and then
(steal time), and that time is neither the thread's CPU time nor its run delay, so a
CPU-bound task on a busy host read as blocked by the share stolen, lost its permit and
time-shared the CPUs again. A permit holder that blocks leaves its CPU idle,
which costs about the share it blocks: a synthetic dataset (1 ms of CPU and a sleep per
sample, 4 workers on 2 CPUs) read 0.87x, 0.83x and 0.80x with permits than without when it
slept ~11%, ~16% and ~20% of the time (from 2 workers' loss), 0.99x when it never slept;
with the average below, 1.00-1.01x, and with the permit kept across tasks 1.005x, 0.999x and
1.012x with no sleep, 0.2 ms and 0.5 ms a sample (batches of 16, 4 rounds of 100 after 20).
So a worker holds a permit only while its average stays under _BLOCKED_SHARE, and gives it
back as soon as it goes over; a dataset that waits on storage or the network (the reason to
start more workers than CPUs) keeps every worker running. Where the run delay cannot be
read, there are no permits.
"""
from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable, Sequence

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
