"""Measuring, round by round: every loader of a workload takes its turn each round, built anew,
after the workers of the loaders before it are idle; a few untimed batches, then the timed
ones (see `gloader.bench.cli` for the method). Also W4's first batches and stopped epochs, and
the progress lines, with the time left.
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from typing import Any, Callable

from .datasets import ImageDataset
from .peers import has_tensorpack
from .workloads import (
    PEERS,
    SCALING_WORKERS,
    STOP_AFTER,
    STOPS,
    Workload,
    close_loader,
    gloader_loader,
    make_loader,
    torch_loader,
)

__all__ = ["Progress", "children_cpu_ticks", "measure_latency", "measure_scaling", "measure_workload", "settle",
           "time_rounds"]

# Before a loader's turn, the benchmark waits until the worker processes of the loaders before
# it have finished what they had prefetched (a window of 8 JPEG batches is ~1.6 s of CPU),
# so that no loader is timed while another's leftover work shares the cores: their CPU time
# must advance by at most _IDLE_TICKS clock ticks (1/100 s each) in _SETTLE_POLL_S, within
# _SETTLE_DEADLINE_S (then the round goes on).
_SETTLE_POLL_S = 0.1
_IDLE_TICKS = 2
_SETTLE_DEADLINE_S = 30.0


def _throughput(loader: Any, batches: int, warm: int = 1) -> float:
    """Seconds for `batches` batches, counted after `warm` untimed ones (workers busy)."""
    taken = -warm
    it = iter(loader)
    start = 0.0
    while taken < batches:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        del batch
        taken += 1
        if taken == 0:
            start = time.perf_counter()
    return time.perf_counter() - start


def children_cpu_ticks() -> int | None:
    """CPU time (clock ticks) used so far by this process's child processes (None without /proc)."""
    me = str(os.getpid()).encode()
    total = 0
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone, or not ours to read
        if fields[1] == me:  # ppid; utime and stime are fields 14 and 15 of stat
            total += int(fields[11]) + int(fields[12])
    return total


def settle() -> None:
    """Wait until the child processes (every loader's workers) are idle."""
    start = time.perf_counter()
    before = children_cpu_ticks()
    while before is not None and time.perf_counter() - start < _SETTLE_DEADLINE_S:
        time.sleep(_SETTLE_POLL_S)
        after = children_cpu_ticks()
        if after is None or after - before <= _IDLE_TICKS:
            break
        before = after


def _first_batch_latency(loader: Any, epochs: int) -> list[float]:
    out = []
    for _ in range(epochs):
        start = time.perf_counter()
        it = iter(loader)
        next(it)
        out.append(time.perf_counter() - start)
        for _ in it:
            pass
    return out


class Progress:
    """The progress lines on stderr: steps done of all, what ran, and the time left at the pace
    so far."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._started = time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        left = (time.monotonic() - self._started) / self.done * (self.total - self.done)
        sys.stderr.write(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}, "
                         f"{_duration(left)} left\n")
        sys.stderr.flush()


def _duration(seconds: float) -> str:
    """'about 40 s', 'about 12 min' (rounded: an estimate)."""
    return f"about {round(seconds)} s" if seconds < 90 else f"about {round(seconds / 60)} min"


def time_rounds(makers: dict[str, Callable[[], Any]], work: Workload, rounds: int, progress: Progress,
                 label: str, counts: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """Seconds per round of each loader, the order turning each round. Every round builds each
    loader anew (its warm-up batches are untimed) and closes it after its turn: the same
    loader built twice can read a few percent apart all run long (two gloader nw=2 loaders
    on W8 in one run: 819 and 791 samples/s in each of five rounds; one W2 loader of twelve
    read 72k against 93-102k), so a median over rounds is also a median over instances."""
    names = list(makers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            settle()
            loader = makers[name]()
            try:
                times[name].append(_throughput(loader, work.batches, work.warm))
                if counts is not None and getattr(loader, "cpu_budget", None) is not None:  # num_workers='auto'
                    counts.setdefault(name, []).append(loader.stats()["workers"]["count"])
            finally:
                close_loader(loader)
                del loader  # torch's workers end with its loader: before the next turn's wait
            progress.step(f"{label} round {r + 1} {name}")
    return times


def measure_workload(work: Workload, dataset: Any, rounds: int, progress: Progress, peers: bool = True
                     ) -> dict[str, Any]:
    """gloader, torch and (with `peers`) the workload's other peers, round by round."""
    names = ["gloader", "torch", *(PEERS.get(work.name, ()) if peers else ())]
    skipped = {}
    if "tensorpack" in names and not has_tensorpack():
        names.remove("tensorpack")
        skipped["tensorpack"] = "not installed (pip install tensorpack)"
    counts: dict[str, list[int]] = {}
    times = time_rounds({name: functools.partial(make_loader, name, dataset, work.batch_size) for name in names},
                         work, rounds, progress, work.name, counts)
    samples = work.batches * work.batch_size
    gl = times["gloader"]
    return {
        "title": work.title,
        "samples_per_s": {k: [samples / t for t in v] for k, v in times.items()},
        "mb_per_s": {k: [samples * work.sample_bytes / t / 1e6 for t in v] for k, v in times.items()},
        "ratio": [t_torch / t_gl for t_gl, t_torch in zip(gl, times["torch"])],
        "ratios": {k: [t / g for g, t in zip(gl, v)] for k, v in times.items() if k != "gloader"},
        "skipped_peers": skipped,
        "auto_workers": counts.get("gloader auto", []),  # the count num_workers='auto' had at the end, per round
    }


def measure_scaling(work: Workload, dataset: Any, rounds: int, progress: Progress) -> dict[str, Any]:
    """Samples/s of gloader and torch with 1, 2 and 4 workers (persistent), all six loaders
    taking turns in every round, so that the machine's drift does not fall on one column."""
    makers: dict[str, Callable[[], Any]] = {
        f"{name} nw={workers}": functools.partial(gloader_loader if name == "gloader" else torch_loader, dataset,
                                                  work.batch_size, workers)
        for workers in SCALING_WORKERS for name in ("gloader", "torch")}
    times = time_rounds(makers, work, rounds, progress, f"{work.name} scaling")
    return {str(workers): {name: [work.batches * work.batch_size / t for t in times[f"{name} nw={workers}"]]
                           for name in ("gloader", "torch")} for workers in SCALING_WORKERS}


def _stopped_epoch_s(loader: Any, stops: int, take: int) -> float:
    """Median seconds of an epoch stopped after `take` batches, from iter() (as a loop with
    `limit_train_batches` or a validation loop cut short): the batches in flight are dropped
    at each stop, and the next iter() starts anew."""
    out = []
    for _ in range(stops):
        start = time.perf_counter()
        for taken, _batch in enumerate(loader, 1):
            if taken == take:
                break
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def measure_latency(rounds: int, epochs: int, progress: Progress) -> dict[str, Any]:
    """W4: fresh loaders per round, so epoch 1 includes starting the workers; then, with the
    same loaders, epochs stopped halfway."""
    small = ImageDataset(64 * 12)
    lat: dict[str, list[list[float]]] = {"gloader": [], "torch": []}
    stopped: dict[str, list[float]] = {"gloader": [], "torch": []}
    for r in range(rounds):
        for name in (["gloader", "torch"] if r % 2 == 0 else ["torch", "gloader"]):
            loader = gloader_loader(small, 64) if name == "gloader" else torch_loader(small, 64)
            lat[name].append(_first_batch_latency(loader, epochs))
            stopped[name].append(_stopped_epoch_s(loader, STOPS, STOP_AFTER) * 1e3)
            if name == "gloader":
                loader.close()
            del loader
            progress.step(f"W4 round {r + 1} {name}")
    return {
        "epoch1_ms": {k: [v[0] * 1e3 for v in vals] for k, vals in lat.items()},
        "later_ms": {k: [statistics.median(v[1:]) * 1e3 for v in vals] for k, vals in lat.items()},
        "stopped_ms": stopped,
    }

