"""What the user iterates: one epoch's batches, through the pin thread and the device stage
when asked, counting what reaches the caller (for `state_dict`, stats and the progress bar).

`_HostBatches` pulls host batches of one epoch from the engine, keeping its window full;
`EpochIterator` owns the pin thread (which pulls in its place) and the device stage (one
batch ahead). It knows the engine and the schedule, never the loader. Runs in the caller's
process; the flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import collections
import time
import warnings
from typing import Any

from .._sampling.schedule import Epoch, Schedule
from .._wire.protocol import EPOCH_ENDING_ERRORS, BatchTimeoutError, ShardEnd, WorkerExitedError
from .device import PinThread
from .engine import Collected, Engine
from .options import LoaderConfig
from .stats import PipelineStats, ProgressBar

__all__ = ["EpochIterator", "Position"]


class _HostBatches:
    """The host batches of one map-style epoch, in order, from the engine."""

    def __init__(self, engine: Engine, schedule: Schedule, epoch: Epoch, stats: PipelineStats) -> None:
        self._engine = engine
        self._schedule = schedule
        self._epoch = epoch
        self._stats = stats
        self.collected = 0  # batches taken from the engine (by the caller or the pin thread)
        self.ended = False  # no batch will come: the epoch is over, or its workers were stopped
        self._sampler_error: Exception | None = None  # raised by the sampler; given after the batches before it

    def _next_job(self) -> Any:
        if self._sampler_error is not None:
            return None
        try:
            return self._schedule.next_job(self._epoch)
        except Exception as exc:  # the batches dispatched before it are still good: the error takes its turn
            self._sampler_error = exc
            return None

    def _collect(self) -> Collected | None:
        """The engine's next result of this epoch, None when it has none left."""
        self._engine.fill(self._next_job)
        try:
            got = self._engine.collect(self._epoch.number)
        except EPOCH_ENDING_ERRORS:
            # The engine stopped the workers; the batches of the epoch opened ahead were lost with
            # them, so that epoch opens again from its start, with its own order and seeds.
            self.ended = True
            self._schedule.rewind_upcoming()
            raise
        if got is None:  # nothing of this epoch in flight and nothing left to dispatch
            self.ended = True
            if self._sampler_error is not None:
                error, self._sampler_error = self._sampler_error, None
                raise error
        elif not isinstance(got.batch, ShardEnd):
            self.collected += 1
            self._stats.record_work(self._epoch.number, got.timings)
            self._engine.fill(self._next_job)  # the window's freed place goes to work at once
        return got

    def next(self) -> Any:
        """The epoch's next batch; StopIteration at its end."""
        got = None if self.ended else self._collect()
        if got is None:
            raise StopIteration
        return got.batch


class _StreamBatches(_HostBatches):
    """A stream epoch's batches in a fixed order whatever the timing: each worker answers from
    its own shard, and the shards take turns (shard 0's first batch, shard 1's first, ...,
    skipping ended shards), as torch's DataLoader orders them. With `in_order=False`, a shard
    whose turn it is and that has nothing ready lets another shard's ready batch go first."""

    def __init__(self, engine: Engine, schedule: Schedule, epoch: Epoch, stats: PipelineStats,
                 timeout_s: float, in_order: bool) -> None:
        super().__init__(engine, schedule, epoch, stats)
        self._timeout_s = timeout_s
        self._in_order = in_order
        self._progress_at = time.monotonic()  # a batch arrived or a shard ended
        self._waiting: dict[int, collections.deque[tuple[Any, int]]] = {shard: collections.deque()
                                                             for shard in range(engine.shards)}
        self._live = list(range(engine.shards))  # shards still taking turns, in turn order
        self._ended: set[int] = set()  # shards whose worker reported the end
        self._begun: set[int] = set()  # shards that have sent a batch
        self._turn = 0  # index into _live
        self.samples_out = 0  # samples in the batches handed out so far

    def next(self) -> Any:
        while self._live:
            self._turn %= len(self._live)
            shard = self._live[self._turn]
            if self._waiting[shard]:
                self._turn += 1
                return self._hand_out(shard)
            ready = None if self._in_order else next((other for other in self._live if self._waiting[other]), None)
            if ready is not None:  # the turn stays with the shard that has nothing yet
                return self._hand_out(ready)
            if shard in self._ended:
                self._live.pop(self._turn)  # the next shard takes this turn
                if not self._live:
                    self._epoch.mark_exhausted()
                continue
            got = None if self.ended else self._collect()
            if got is None:  # nothing more will come: hand out what is waiting, in turn
                self._ended.update(self._live)
                continue
            done = max(got.worker_id, 0)  # in-process loading is shard 0
            if got.shard_began and (done in self._begun or done in self._ended):
                self._shard_restarted(done)
            if not isinstance(got.batch, ShardEnd):
                self._begun.add(done)
                self._waiting[done].append((got.batch, got.samples))
                self._progress_at = time.monotonic()
            elif done not in self._ended:
                self._ended.add(done)
                self._progress_at = time.monotonic()
            elif time.monotonic() - self._progress_at > self._timeout_s:
                self._no_progress(shard)
        self._engine.discard(self._epoch.number)  # tasks still out can only answer "shard ended"
        raise StopIteration

    def _hand_out(self, shard: int) -> Any:
        batch, samples = self._waiting[shard].popleft()
        self.samples_out += samples
        return batch

    def _shard_restarted(self, shard: int) -> None:
        """A worker began a shard that had sent batches this epoch: the worker that served it
        died (its death may have been reported to another loader of a shared pool) and its
        replacement reads the shard from the start. Its samples would come twice: the epoch ends."""
        self.ended = True
        self._engine.discard(self._epoch.number)
        raise WorkerExitedError(f"the gloader worker serving shard {shard} of stream epoch {self._epoch.number} died, "
                                "and its replacement began the shard again; the epoch ends here, so that no sample "
                                "comes twice, and the next epoch starts anew")

    def _no_progress(self, shard: int) -> None:
        self.ended = True
        self._engine.discard(self._epoch.number)
        raise BatchTimeoutError(f"DataLoader timed out after {self._timeout_s:g} seconds: stream epoch "
                                f"{self._epoch.number} made no progress for more than {self._timeout_s:g} s (the "
                                "loader's timeout): only ended shards answered, while "
                                f"shard {shard} neither sent a batch nor ended. Raise timeout= if a shard is "
                                "legitimately that slow, or look for a hang in the dataset's __iter__")


_END = object()


class Position:
    """Where an epoch iterator stands, kept apart from it so that the loader can answer for it
    (state_dict) without keeping it alive: an iterator the caller dropped mid-epoch is noticed."""

    __slots__ = ("epoch", "yielded", "finished", "asked")

    def __init__(self, epoch: Epoch) -> None:
        self.epoch = epoch
        self.yielded = epoch.skipped  # batches that reached the caller, a resume's skip included
        self.finished = False  # the caller reached the epoch's end
        self.asked = False  # next() was called (a batch or an error was handed over)


class EpochIterator:
    """Iterates one epoch; with a device, copies one batch ahead of the caller.

    Counts the batches that reach the caller (`yielded`, a resume's skip included): the pin
    thread and the device stage fetch ahead of the caller.
    """

    def __init__(self, engine: Engine, schedule: Schedule, epoch: Epoch, stats: PipelineStats,
                 config: LoaderConfig, device: Any) -> None:
        self.epoch = epoch
        self.position = Position(epoch)
        self._engine = engine
        self._stats = stats
        self._device = device
        self._host = (_StreamBatches(engine, schedule, epoch, stats, config.timeout_s, config.in_order)
                      if config.stream is not None
                      else _HostBatches(engine, schedule, epoch, stats))
        self._ahead: Any = None
        self._ahead_error: BaseException | None = None
        self._replaced_by = ""
        self._bar = ProgressBar(epoch.number, epoch.remaining, engine.workers.describe) if config.progress else None
        self._config = config
        self._pins = config.pin_thread  # batches go through a pin thread
        self._pinner: PinThread | None = None  # started by the first next(): a probe iter() fetches nothing
        # A stream's len(dataset) once the caller has taken len(loader) (None before): more
        # samples than that are worth a warning (see _warn_past_reported_length).
        self.reported_samples: int | None = None

    def __iter__(self) -> EpochIterator:
        return self

    @property
    def _workers(self) -> list[Any]:
        """The loader's worker processes, by worker id (none for threads or in-process), started
        here if the first batch has not started them: torch's iterator has this private list from
        its start, and tools and tests read it for pids and to join the workers once the loader
        is gone."""
        return self._engine.workers.processes()

    @property
    def yielded(self) -> int:
        return self.position.yielded

    @yielded.setter
    def yielded(self, value: int) -> None:
        self.position.yielded = value

    @property
    def finished(self) -> bool:
        return self.position.finished

    @finished.setter
    def finished(self, value: bool) -> None:
        self.position.finished = value

    def __len__(self) -> int:
        if self.epoch.length is None:
            raise TypeError("this epoch has no length (an IterableDataset, or a batch sampler without __len__)")
        return self.epoch.length

    def fetch(self) -> Any:
        """Next host batch of the epoch; called by the pin thread when there is one."""
        return self._host.next()

    def __next__(self) -> Any:
        if self._replaced_by:
            raise RuntimeError(f"this iterator over a gloader DataLoader was ended by {self._replaced_by}; a "
                               "loader serves one iterator at a time (zip(loader, loader) or two threads "
                               "iterating one loader need two loaders)")
        if self.finished:
            raise StopIteration
        self.position.asked = True
        asked = time.perf_counter()
        try:
            batch = self._next_batch()
        except StopIteration:
            self.finished = True
            if self._bar is not None:
                self._bar.close(self._stats.wait_fraction(self.epoch.number))
                self._bar = None
            raise
        except BaseException as exc:
            self.yielded += 1  # a batch that raised is consumed: resume starts after it
            if isinstance(exc, EPOCH_ENDING_ERRORS) and self._host.ended:
                self.finished = True  # its workers were stopped: the next iter() (and state) is the next epoch
            raise
        self.yielded += 1
        if self.reported_samples is not None and isinstance(self._host, _StreamBatches) \
                and self._host.samples_out > self.reported_samples:
            self._warn_past_reported_length(self._host.samples_out)
        self._stats.record_wait(self.epoch.number, asked, time.perf_counter() - asked)
        if self._bar is not None:
            self._bar.update(self._stats.wait_fraction(self.epoch.number))
        return batch

    def _warn_past_reported_length(self, samples: int) -> None:
        """Warn, once an epoch, that a stream gives more samples than len(dataset) said, as
        torch's DataLoader does once len(loader) was taken: code that trusts the length (a
        progress bar, an LR schedule) goes wrong, and with workers the usual cause is an
        IterableDataset that every worker reads whole."""
        reported, self.reported_samples = self.reported_samples, None
        workers = self._config.num_workers
        cause = (f" For multiprocessing data-loading, this usually means that each of the num_workers={workers} "
                 "workers iterates the whole dataset: its __iter__ must take its own share (see "
                 "gloader.get_worker_info()), or every sample comes num_workers times." if workers > 1 else "")
        # "but N samples have been fetched. For multiprocessing data-loading" are torch's words, which
        # warning filters written for torch match.
        warnings.warn(f"len(loader) was taken from len(dataset)={reported}, but {samples} samples have been fetched."
                      f"{cause} Seen at batch {self.yielded} of epoch {self.epoch.number}.", UserWarning, stacklevel=3)

    def _host_batch(self) -> Any:
        if not self._pins:
            return self._host.next()
        if self._pinner is None:
            self._pinner = PinThread(self, self._config.pin_device_id, self._config.timeout_s)
            self._engine.workers.attach(self._pinner)
        return self._pinner.take()

    def _next_batch(self) -> Any:
        device = self._device
        if device is None:
            return self._host_batch()
        if self._ahead is None:
            self._ahead = device.to_device(self._host_batch())
        if self._ahead is _END:
            raise StopIteration
        if self._ahead_error is not None:
            error, self._ahead_error, self._ahead = self._ahead_error, None, None
            raise error
        current = self._ahead
        try:
            self._ahead = device.to_device(self._host_batch())
        except StopIteration:
            self._ahead = _END
        except Exception as exc:  # raised at its own turn, after the batch before it
            self._ahead_error = exc
        return device.hand_over(*current)

    @property
    def untouched(self) -> bool:
        """Nothing of the epoch was taken yet (an iterator made and dropped, as Lightning's probe)."""
        return (not self.position.asked and not self.finished and self._pinner is None and self._host.collected == 0
                and not self._host.ended)

    def stop(self, reason: str, keep_epoch: bool = False) -> None:
        """End this iterator: stop its pin thread and (unless `keep_epoch`, for a successor
        serving the same epoch) drop its epoch's batches in flight; its next use raises,
        naming `reason` ("a newer iter(loader)", "load_state_dict", "close")."""
        if self._pinner is not None:
            self._pinner.stop()
            self._pinner = None
        if not self.finished:
            if not keep_epoch:
                self._engine.discard(self.epoch.number)
            self._replaced_by = reason
