"""num_workers='auto': the worker count, adjusted online from what the loader measures.

Runs in the caller's thread, at the batches it collects; the engine asks `Tuner.decide` after
each and resizes the pool (`PoolCore.resize`) to the count it answers. A decision looks at
the last window of about _DECIDE_S:

- the caller's wait: the share of the window it spent waiting for batches (0: the loader
  keeps ahead, and more workers cannot help);
- the workers' busy count: the worker time of the batches collected over the window's wall
  time (Little's law: how many workers were loading, on average);
- the workers' CPU use, from /proc: CPUs' worth of time the pool's processes ran, which tells
  workers that compute (CPU use near their busy count) from workers that wait on storage or
  the network (busy, hardly running);
- the CPUs left idle on this machine (of those this process may use), and the workers' memory
  (USS: what each holds alone), against the budgets.

The pool grows while the caller waits, the workers are all busy, and the CPUs have room for
what one more worker uses (within cpu_budget, idle on the machine, and within the memory
budget); it shrinks when the workers use more than the budgets, or when the caller has not
waited and half the workers idle. A grow that did not raise the rate by _GROWTH_GAIN is taken
back, and the count it reached is not tried again for _RETRY_S. Decisions are never made while
a resize is under way. Nothing here changes what a batch holds: its seed and its place come
from the schedule, whichever worker loads it.
"""
from __future__ import annotations

import collections
import math
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

from .._pool.admission import usable_cpus

__all__ = ["Measures", "SharedBudgets", "Tuner", "default_memory_budget", "most_workers"]

# How long a window a decision looks at. Longer: steadier measures, slower to settle (a
# doubling per window: 2 to 16 workers took ~3 windows on W11); shorter: noisier decisions.
_DECIDE_S = 1.0
# The fewest batches a window must hold (slow batches: the window lasts until then).
_DECIDE_BATCHES = 4
# The caller's wait share above which the loader holds training back (grow), and below which
# it keeps ahead (shrink allowed). Between them nothing changes (hysteresis).
_WAITING = 0.05
_AHEAD = 0.01
# Workers count as all busy above this share of them busy on average, as idle below _IDLE.
_SATURATED = 0.7
_IDLE = 0.5
# The share of cpu_budget the workers may fill when growing (the caller needs some CPU too),
# and how far over the budget they may run before the pool shrinks.
_CPU_FILL = 0.9
_CPU_OVER = 1.15
# CPUs free (idle on the machine and left in the budget) that let a waiting caller's pool grow
# by one worker even where a whole worker's CPU use does not fit (1 -> 2 workers on 2 CPUs,
# beside the caller). Lower: grows into CPUs the caller needs; higher: a CPU left idle.
_FREE_CPU = 0.5
# Time the caller spends away from the loader between two batches (a validation pass, a
# checkpoint, the end of an epoch) longer than both of these is not measured: the window opens
# again. Its usual time away (a training step) is followed with weight _AWAY_WEIGHT a batch.
# Larger: pauses up to that long count as idle workers; smaller: slow steps restart windows.
_AWAY_S = 1.0
_AWAY_RATIO = 10.0
_AWAY_WEIGHT = 0.1
# The window between epochs (the next epoch's first tasks, dispatched before the caller asks),
# in times the count's: a caller is often away there (a validation pass, a checkpoint), the
# workers fill it meanwhile, and the epoch starts from that many batches ready. W8 (20-batch
# epochs, a 14-batch validation pass on another loader's one worker after each) on 2 CPUs,
# 'auto' at 2 workers, end to end: 4 made 1.11x (0.94-1.27) the samples/s of 2, 12 rounds in
# turns, and W3 1.05x (0.91-1.26) in 5 (the passes slower, the epochs faster: the validation
# loader's one worker leaves a CPU that the wider window fills); 8 made 1.04x what 4 did over
# 5 rounds, within the noise, holding twice the batches. (2 workers with a window of 4 had made
# 0.76x the samples/s of 4 workers with 8.) Larger: more batches ready after a pause, more
# shared memory held then (at most the window at the most workers, which the slots are sized
# for).
_BETWEEN_EPOCHS = 4.0
# The share of the memory budget that the tasks of the window between epochs beyond the count's
# window may hold (their batches wait in shared memory until the caller comes back): 4 times
# the window of 500 MB batches at 2 workers would be 8 GB. W8's 38.5 MB batches at 2 workers:
# 12 tasks beyond the window need 0.46 GB, within an eighth of this host's default budget
# (half of 23 GB available). Loaders sharing the default budget split it (see
# window_between_epochs). Smaller: fewer batches ready after a pause where batches are large.
_AHEAD_MEMORY = 0.125
# A grow must raise the batches per second by this share of its relative size (2 -> 4
# workers: by 0.3 x 100%) or it is taken back. Higher: fewer useless workers kept; lower:
# fewer grows taken back on a noisy host.
_GROWTH_GAIN = 0.3
# How long a count taken back stays out of reach.
_RETRY_S = 30.0
# The most workers num_workers='auto' may grow to, per CPU of the budget and in all (a machine
# with more CPUs may still double its start): the pool's ids, status rows and permits are sized
# for it at the start. W11 (5 ms a sample) wanted ~32 processes on 2 CPUs without fetch threads.
_MOST_PER_CPU = 16
_MOST_WORKERS = 128
# The default memory budget: this share of the memory available when the loader is built.
_MEMORY_SHARE = 0.5
# Workers whose USS a window reads (the others keep their last reading): smaps_rollup costs
# ~2 ms a worker here, and every worker each window stalled the caller 48 ms at 24 workers.
_USS_READS = 2
# How many changes stats() lists.
_LISTED_CHANGES = 32

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def most_workers(cpu_budget: float) -> int:
    """The most workers num_workers='auto' may grow to with this budget."""
    start = math.ceil(cpu_budget)
    return max(2 * start, min(_MOST_WORKERS, _MOST_PER_CPU * start))


def default_memory_budget() -> int | None:
    """_MEMORY_SHARE of the memory available now (None where /proc/meminfo cannot be read)."""
    try:
        with open("/proc/meminfo", "rb") as info:
            for line in info:
                if line.startswith(b"MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * _MEMORY_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) process `pid` has used; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime and stime: fields 14 and 15 of stat
    except (OSError, ValueError, IndexError):
        return None


def process_uss(pid: int) -> int | None:
    """Memory process `pid` holds alone (USS, bytes); None when it cannot be read."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            for line in rollup:
                if line.startswith(b"Private_"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return total


def idle_cpu_s(cpus: Iterable[int]) -> float | None:
    """Idle time (idle + iowait) of these CPUs since boot, from /proc/stat; None without it."""
    wanted = {f"cpu{cpu}".encode() for cpu in cpus}
    total = 0
    try:
        with open("/proc/stat", "rb") as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in wanted:
                    total += int(fields[4]) + int(fields[5])
    except (OSError, ValueError, IndexError):
        return None
    return total / _TICKS


class Measures:
    """What one window measured (rates are per second of the window's wall time)."""

    def __init__(self, wall_s: float, batches: int, waited_s: float, worker_s: float, cpu: float | None,
                 idle_cpus: float | None, uss_bytes: int | None) -> None:
        self.wall_s = wall_s
        self.rate = batches / wall_s  # batches per second
        self.wait = waited_s / wall_s  # the caller's share of time waiting
        self.busy = worker_s / wall_s  # workers loading, on average
        self.cpu = cpu  # CPUs' worth of time the workers ran
        self.idle_cpus = idle_cpus  # CPUs idle on the machine
        self.uss_bytes = uss_bytes  # the workers' memory, all together

    def describe(self, count: int) -> str:
        parts = [f"the caller waited {self.wait:.0%} of the time", f"{self.busy:.1f} of {count} workers busy"]
        if self.cpu is not None:
            parts.append(f"using {self.cpu:.1f} CPUs")
        if self.idle_cpus is not None:
            parts.append(f"{self.idle_cpus:.1f} CPUs idle")
        if self.uss_bytes is not None:
            parts.append(f"{self.uss_bytes / 2**20:.0f} MiB of worker memory")
        return ", ".join(parts)


class SharedBudgets:
    """The default budgets, one CPU budget and one memory budget for all the tuned loaders of
    this process that did not set their own (train and validation loaders side by side must
    not each take the whole machine): each grows only into what the others' latest windows
    leave. The memory budget is the default's value when the first of them joined."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._members: weakref.WeakSet[Tuner] = weakref.WeakSet()
        self._memory_budget: int | None = None

    def join(self, tuner: Tuner, memory_budget: int | None) -> int | None:
        """Add `tuner`; returns the shared memory budget (`memory_budget` if it is the first)."""
        with self._lock:
            if not self._members:
                self._memory_budget = memory_budget
            self._members.add(tuner)
            return self._memory_budget

    def leave(self, tuner: Tuner) -> None:
        """`tuner`'s loader is closed: it shares nothing any more."""
        with self._lock:
            self._members.discard(tuner)

    def others(self, tuner: Tuner) -> tuple[float, int, int]:
        """(CPUs, worker memory bytes) the other members' workers used in their latest windows,
        and how many loaders share the budgets, `tuner` included."""
        with self._lock:
            members = list(self._members)
        others = [member for member in members if member is not tuner]
        return sum(m.used_cpu for m in others), sum(m.used_uss for m in others), len(members)


_SHARED = SharedBudgets()


class Tuner:
    """Picks the worker count of one loader's own process pool.

    Args:
        start: the count to start with.
        most: the most workers (the pool's capacity).
        cpu_budget: CPUs the workers may keep busy.
        memory_budget: bytes of worker memory (USS, all workers together); None: no limit.
        per_worker_window: tasks in flight per worker (the window follows the count).
        clock: seconds, monotonic (tests pass their own).
        shared: whether the CPU budget and the memory budget are the defaults, shared with the
            process's other tuned loaders that did not set their own (see SharedBudgets).
        budgets: where the shared ones are kept (tests pass their own).
    """

    def __init__(self, start: int, most: int, cpu_budget: float, memory_budget: int | None,
                 per_worker_window: float, clock: Callable[[], float] = time.monotonic,
                 shared: tuple[bool, bool] = (False, False), budgets: SharedBudgets | None = None) -> None:
        self.count = start
        self.most = most
        self.cpu_budget = cpu_budget
        self.memory_budget = memory_budget
        self.shared = shared
        self.used_cpu = 0.0  # CPUs its workers used in the latest window (for the shared budgets)
        self.used_uss = 0  # bytes its workers held then
        self._budgets = (budgets or _SHARED) if any(shared) else None
        if self._budgets is not None:
            joined = self._budgets.join(self, memory_budget)
            if shared[1]:
                self.memory_budget = joined
        self._per_worker_window = per_worker_window
        self._clock = clock
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(usable_cpus()))
        self.changes: collections.deque[dict[str, Any]] = collections.deque(maxlen=_LISTED_CHANGES)
        self._started = clock()
        self._blocked: dict[int, float] = {}  # count -> until when it is not tried again
        self._grown_from: tuple[int, float] | None = None  # the count and rate before the latest grow
        self._uss: dict[int, int] = {}  # pid -> its latest USS reading (a few are read each window)
        self._last_at = clock()  # when the latest batch was collected
        self._usual_away_s: float | None = None  # the caller's usual time away between batches
        self.settling = True  # until the pool's workers all run (see begin)
        self._open_window(None)

    @property
    def window(self) -> int:
        """Tasks in flight for the current count."""
        return max(1, math.ceil(self._per_worker_window * self.count))

    def window_between_epochs(self, task_bytes: int = 0) -> int:
        """Tasks in flight while the caller has not started the epoch they belong to:
        _BETWEEN_EPOCHS times `window`, at most the window at the most workers, and those beyond
        `window` holding at most _AHEAD_MEMORY of the memory budget (`task_bytes`: what one
        task's batches take; 0: not known yet); a shared budget's share is split among the
        loaders sharing it, whose batches ahead are held at once (a validation loader's while
        the training loader's epoch runs)."""
        wider = min(math.ceil(self._per_worker_window * _BETWEEN_EPOCHS * self.count),
                    math.ceil(self._per_worker_window * self.most))
        if self.memory_budget is not None and task_bytes > 0:
            sharing = self._budgets.others(self)[2] if self.shared[1] and self._budgets is not None else 1
            wider = min(wider, self.window + math.floor(self.memory_budget * _AHEAD_MEMORY / sharing / task_bytes))
        return max(self.window, wider)

    def _open_window(self, pids: list[int] | None) -> None:
        self._since = self._clock()
        self._batches = 0
        self._waited_s = 0.0
        self._worker_s = 0.0
        self._cpu_at = {pid: cpu for pid in pids or () if (cpu := process_cpu_s(pid)) is not None}
        self._idle_at = idle_cpu_s(self._cpus)

    def resized(self) -> None:
        """The pool was started, resized or replaced: no window until `begin`."""
        self.settling = True

    def begin(self, pids: list[int]) -> None:
        """Every worker of the pool runs (`pids`): open a window."""
        self.settling = False
        self._open_window(pids)

    def observe(self, waited_s: float, worker_s: float) -> None:
        """A batch collected: the caller waited `waited_s` for it, a worker spent `worker_s` on it.
        After a time away from the loader far longer than its usual one (a validation pass
        between epochs), the window opens again: the workers idled because nobody asked."""
        now = self._clock()
        away = max(0.0, now - self._last_at - waited_s)
        self._last_at = now
        usual = self._usual_away_s
        # A pause is not folded into the usual time away: a 30 s checkpoint folded in at
        # _AWAY_WEIGHT left the usual at 0.41 s after a 20-batch epoch of 50 ms steps, so that
        # the next 3 s validation pass (under 10 x 0.41 s) was measured as idle workers.
        if usual is None or away <= max(_AWAY_S, _AWAY_RATIO * usual):
            self._usual_away_s = away if usual is None else usual + _AWAY_WEIGHT * (away - usual)
        if away > max(_AWAY_S, _AWAY_RATIO * (usual or 0.0)):
            self.settling = True  # the engine opens a new window (`begin`) at once: no resize is under way
            return
        self._batches += 1
        self._waited_s += waited_s
        self._worker_s += worker_s

    def due(self) -> bool:
        """Whether a window is complete."""
        return not self.settling and self._batches >= _DECIDE_BATCHES and self._clock() - self._since >= _DECIDE_S

    def measure(self, pids: list[int]) -> Measures:
        """The window's measures (`pids`: the workers now); a new window opens."""
        wall = self._clock() - self._since
        cpu_at, idle_before = self._cpu_at, self._idle_at
        batches, waited, worker = self._batches, self._waited_s, self._worker_s
        self._open_window(pids)
        used = sum(self._cpu_at[pid] - cpu_at[pid] for pid in self._cpu_at if pid in cpu_at)
        idle = None if idle_before is None or self._idle_at is None else (self._idle_at - idle_before) / wall
        measures = Measures(wall, batches, waited, worker, used / wall if cpu_at else None, idle,
                            self._workers_uss(pids))
        self.used_cpu = measures.cpu or 0.0
        self.used_uss = measures.uss_bytes or 0
        return measures

    def workers_stopped(self) -> None:
        """The pool's workers are gone: they use nothing of the shared budgets any more."""
        self.used_cpu, self.used_uss = 0.0, 0

    def close(self) -> None:
        """The loader is closed: it leaves the shared budgets."""
        self.workers_stopped()
        if self._budgets is not None:
            self._budgets.leave(self)

    def budgets_left(self) -> tuple[float, int | None, int]:
        """(CPU budget, memory budget) this loader may fill now: its own, or of shared ones what
        the other loaders' workers leave; and how many loaders share them (1: none)."""
        if self._budgets is None:
            return self.cpu_budget, self.memory_budget, 1
        cpu, uss, sharing = self._budgets.others(self)
        cpu_budget = max(0.0, self.cpu_budget - cpu) if self.shared[0] else self.cpu_budget
        memory_budget = self.memory_budget
        if memory_budget is not None and self.shared[1]:
            memory_budget = max(0, memory_budget - uss)
        return cpu_budget, memory_budget, sharing

    def _workers_uss(self, pids: list[int]) -> int | None:
        """The workers' USS together: _USS_READS of them read now (those never read first),
        the others at their latest reading, and any unread at the average of those read."""
        self._uss = {pid: uss for pid, uss in self._uss.items() if pid in pids}
        unread = [pid for pid in pids if pid not in self._uss]
        for pid in (unread + [pid for pid in self._uss if pid not in unread])[:_USS_READS]:
            uss = process_uss(pid)
            if uss is None:
                return None  # not readable here (or the worker just left): no memory measure this window
            self._uss.pop(pid, None)
            self._uss[pid] = uss  # last in the order: read again after the others
        if not self._uss:
            return None
        return round(sum(self._uss.values()) / len(self._uss) * len(pids))

    def decide(self, measures: Measures) -> int | None:
        """The count to change to after this window, or None to keep it; records why."""
        count, now = self.count, self._clock()
        to, why = self._choose(measures, count, now)
        if to is None or to == count:
            return None
        self.settling = True
        self.changes.append({"at_s": round(now - self._started, 3), "from": count, "to": to,
                             "why": f"{why}: {measures.describe(count)}"})
        self.count = to
        return to

    def refused(self, count: int) -> None:
        """The pool could not resize after all (it was closing): back to `count`."""
        self.count = count
        self.changes.pop()
        self.settling = False

    def _choose(self, m: Measures, count: int, now: float) -> tuple[int | None, str]:
        cpu_budget, memory_budget, sharing = self.budgets_left()
        shared = f" (shared by {sharing} loaders)" if sharing > 1 else ""
        if memory_budget is not None and m.uss_bytes is not None and m.uss_bytes > memory_budget and count > 1:
            return max(1, math.floor(count * memory_budget / m.uss_bytes)), f"shrank, over the memory budget{shared}"
        if m.cpu is not None and m.cpu > cpu_budget * _CPU_OVER and count > 1:
            return max(1, math.floor(count * cpu_budget / m.cpu)), f"shrank, over the CPU budget{shared}"
        grown, self._grown_from = self._grown_from, None
        if grown is not None and m.rate < grown[1] * (1 + _GROWTH_GAIN * (count - grown[0]) / grown[0]):
            self._blocked[count] = now + _RETRY_S
            return grown[0], "took back the last grow, which did not raise the rate"
        if m.wait > _WAITING and m.busy > _SATURATED * count and count < self.most:
            room = self._room(m, count, now, cpu_budget, memory_budget)
            if room > 0:
                self._grown_from = (count, m.rate)
                return count + room, "grew, the loader kept the caller waiting"
            return None, ""
        if m.wait < _AHEAD and m.busy < _IDLE * count and count > 1:
            return max(1, count - max(1, count // 4), math.ceil(m.busy / _SATURATED)), \
                "shrank, the workers kept ahead of the caller and idled"
        return None, ""

    def _room(self, m: Measures, count: int, now: float, cpu_budget: float, memory_budget: int | None) -> int:
        """How many workers to add (0: none fit): at most doubling, within the CPU budget, the
        idle CPUs and the memory budget, and below a count taken back lately."""
        add = min(count, self.most - count)
        if m.cpu is not None:
            per_worker_cpu = m.cpu / count
            if per_worker_cpu > 0:
                free = cpu_budget - m.cpu if m.idle_cpus is None else min(cpu_budget - m.cpu, m.idle_cpus)
                fits = math.floor((cpu_budget * _CPU_FILL - m.cpu) / per_worker_cpu)
                if m.idle_cpus is not None:
                    fits = min(fits, math.floor(m.idle_cpus / per_worker_cpu))
                add = min(add, max(fits, 1 if free >= _FREE_CPU else 0))
        if m.uss_bytes and memory_budget is not None:
            add = min(add, math.floor((memory_budget - m.uss_bytes) / (m.uss_bytes / count)))
        for blocked, until in self._blocked.items():
            if until > now and count < blocked:
                add = min(add, blocked - count - 1)
        return max(0, add)
