"""Pipeline statistics and the progress bar: is training waiting for input, and where does
loading time go? Runs in the caller's process. The whole flow is drawn in `_caller.engine`."""
from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from typing import Any, Callable

__all__ = ["EpochStats", "PipelineStats", "ProgressBar", "write_status"]

# Shortest interval between two redraws of the progress bar on a terminal. Shorter: smoother;
# longer: less terminal output (and less time spent writing it).
_REDRAW_S = 0.1
# The same when stderr is a file or a pipe (CI logs, nohup), where each redraw is a new line.
_LOG_EVERY_S = 10.0


def write_status(text: str, last: bool) -> None:
    """Show a status line on stderr: redrawn in place on a terminal, one line each elsewhere
    (carriage returns would pile up in a log file)."""
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text + ("\n" if last else ""))
    else:
        sys.stderr.write(text.rstrip() + "\n")
    sys.stderr.flush()


# How many epochs `stats()` lists one by one; older ones count only in the total. Each costs
# ~0.7 KB, so code that starts an epoch per step (`next(iter(loader))` in a training loop)
# grew by that much a step; more: a longer listing, and more memory.
_LISTED_EPOCHS = 64


# A batch's hops, in order, as the engine times them: dispatch_s (queued until a worker began
# it: the pool's task thread, the pipe, waiting for a free worker), worker_fetch_s and
# worker_batchify_s (in the worker), return_s (the result's trip back: encoding, the pipe, the
# pool's supervisor thread), window_s (finished, waiting in the window for the caller to ask),
# handover_s (rebuilding it into tensors in the caller).
HOPS = ("dispatch_s", "worker_fetch_s", "worker_batchify_s", "return_s", "window_s", "handover_s")


@dataclasses.dataclass
class EpochStats:
    """Accumulated timings of one epoch (seconds)."""

    batches: int = 0
    waited_s: float = 0.0
    hops: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(HOPS, 0.0))
    started: float = 0.0
    last: float = 0.0

    def as_dict(self) -> dict[str, float]:
        wall = max(self.last - self.started, 1e-9) if self.batches else 0.0
        return {"batches": self.batches, "wall_s": wall, "waited_s": self.waited_s,
                "wait_fraction": self.waited_s / wall if wall else 0.0, **self.hops,
                "batches_per_s": self.batches / wall if wall else 0.0}


class PipelineStats:
    """Per-epoch and overall timings of a loader. The work is recorded where a batch is
    fetched (the pin thread, when there is one), the wait where the caller waits; hence the lock."""

    def __init__(self) -> None:
        self.epochs: dict[int, EpochStats] = {}  # the latest _LISTED_EPOCHS
        self._earlier = EpochStats()  # the epochs listed no more, summed (its wall in _earlier_wall_s)
        self._earlier_wall_s = 0.0
        self._lock = threading.Lock()

    def _epoch(self, epoch: int) -> EpochStats:
        stats = self.epochs.get(epoch)
        if stats is None:  # the epoch's clock starts when the caller first asks (record_wait)
            stats = self.epochs[epoch] = EpochStats(started=math.inf)
            if len(self.epochs) > _LISTED_EPOCHS:
                self._retire(min(self.epochs))
        return stats

    def _retire(self, epoch: int) -> None:
        """Fold an epoch into the total of the epochs no longer listed."""
        stats = self.epochs.pop(epoch)
        _add(self._earlier, stats)
        self._earlier_wall_s += stats.as_dict()["wall_s"]

    def record_work(self, epoch: int, timings: dict[str, float]) -> None:
        """Add the hop timings of one batch of `epoch`."""
        with self._lock:
            hops = self._epoch(epoch).hops
            for hop, seconds in timings.items():
                hops[hop] += seconds

    def record_wait(self, epoch: int, asked: float, waited_s: float) -> None:
        """Count a batch handed to the caller, who asked for it at `asked` and waited `waited_s`."""
        with self._lock:
            stats = self._epoch(epoch)
            stats.started = min(stats.started, asked)
            stats.batches += 1
            stats.waited_s += waited_s
            stats.last = asked + waited_s

    def wait_fraction(self, epoch: int) -> float:
        with self._lock:
            stats = self.epochs.get(epoch)
            return stats.as_dict()["wait_fraction"] if stats is not None else 0.0

    def snapshot(self, in_flight: int, shared_memory_bytes: int) -> dict[str, Any]:
        with self._lock:
            return self._snapshot(in_flight, shared_memory_bytes)

    def _snapshot(self, in_flight: int, shared_memory_bytes: int) -> dict[str, Any]:
        total = dataclasses.replace(self._earlier, hops=dict(self._earlier.hops))
        for stats in self.epochs.values():
            _add(total, stats)
        overall = total.as_dict()
        wall = self._earlier_wall_s + sum(s.as_dict()["wall_s"] for s in self.epochs.values())
        overall.update(wall_s=wall, wait_fraction=total.waited_s / wall if wall else 0.0,
                       batches_per_s=total.batches / wall if wall else 0.0)
        return {"epochs": {epoch: s.as_dict() for epoch, s in sorted(self.epochs.items())}, "total": overall,
                "in_flight": in_flight, "shared_memory_bytes": shared_memory_bytes}


def _add(total: EpochStats, stats: EpochStats) -> None:
    """Add an epoch's batches, wait and hop timings to `total` (its clock is not added)."""
    total.batches += stats.batches
    total.waited_s += stats.waited_s
    for hop, seconds in stats.hops.items():
        total.hops[hop] += seconds


class ProgressBar:
    """A one-line progress bar on stderr: batches done, batches/s and the share of time the
    caller waited for input. Shown only because the user asked for it (`progress=True`)."""

    def __init__(self, epoch: int, total: int | None, workers: Callable[[], str] | None = None) -> None:
        self._epoch = epoch
        self._total = total
        self._workers = workers  # says the workers, at each redraw ("" for none)
        self._done = 0
        self._started = time.perf_counter()
        self._drawn = 0.0
        self._every_s = _REDRAW_S if sys.stderr.isatty() else _LOG_EVERY_S

    def update(self, waited_fraction: float) -> None:
        self._done += 1
        now = time.perf_counter()
        if now - self._drawn >= self._every_s:
            self._drawn = now
            self._draw(now, waited_fraction, last=False)

    def close(self, waited_fraction: float) -> None:
        self._draw(time.perf_counter(), waited_fraction, last=True)

    def _draw(self, now: float, waited_fraction: float, last: bool) -> None:
        rate = self._done / max(now - self._started, 1e-9)
        if self._total:
            width = 24
            filled = min(width, width * self._done // self._total)
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {self._done}/{self._total}"
        else:
            bar = f"{self._done} batches"
        workers = self._workers() if self._workers is not None else ""
        workers = f", {workers}" if workers else ""
        write_status(f"epoch {self._epoch} {bar} {rate:.1f} batches/s, waited {waited_fraction:.0%}{workers}", last)
