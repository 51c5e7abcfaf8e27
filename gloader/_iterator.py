"""What the user iterates: one epoch's batches, through the pin thread and the device stage
when asked, counting what reaches the caller (for `state_dict`, stats and the progress bar).

`_HostBatches` pulls host batches of one epoch from the engine, keeping its window full;
`EpochIterator` owns the pin thread (which pulls in its place) and the device stage (one
batch ahead). It knows the engine and the schedule, never the loader. Runs in the caller's
process; the flow is drawn in `_engine`.
"""
from __future__ import annotations

import time
from typing import Any

from ._device import PinThread
from ._engine import Engine
from ._options import LoaderConfig
from ._protocol import BatchTimeoutError, ShardEnd, WorkerExitedError
from ._schedule import Epoch, Schedule
from ._stats import PipelineStats, ProgressBar

__all__ = ["EpochIterator"]


class _HostBatches:
    """The host batches of one epoch, in order, from the engine."""

    def __init__(self, engine: Engine, schedule: Schedule, epoch: Epoch, stats: PipelineStats) -> None:
        self._engine = engine
        self._schedule = schedule
        self._epoch = epoch
        self._stats = stats
        self._shards_ended: set[int] = set()
        self.ended = False  # no batch will come: the epoch is over, or its workers were stopped

    def _next_job(self) -> Any:
        return self._schedule.next_job(self._epoch)

    def next(self) -> Any:
        """The epoch's next batch; StopIteration at its end."""
        while not self.ended:
            self._engine.fill(self._next_job)
            try:
                got = self._engine.collect(self._epoch.number)
            except (WorkerExitedError, BatchTimeoutError):
                # The engine stopped the workers; batches opened ahead were lost with them.
                self.ended = True
                self._schedule.drop_upcoming()
                raise
            if got is None:  # nothing of this epoch in flight and nothing left to dispatch
                self.ended = True
                break
            if isinstance(got.batch, ShardEnd):
                self._shards_ended.add(got.batch.worker_id)
                if len(self._shards_ended) >= self._engine.shards:
                    self._epoch.mark_exhausted()
                continue
            self._stats.record_work(self._epoch.number, got.fetch_s, got.batchify_s, got.handover_s)
            self._engine.fill(self._next_job)  # the window's freed place goes to work at once
            return got.batch
        raise StopIteration


_END = object()


class EpochIterator:
    """Iterates one epoch; with a device, copies one batch ahead of the caller.

    Counts the batches that reach the caller (`yielded`, a resume's skip included): the pin
    thread and the device stage fetch ahead of the caller.
    """

    def __init__(self, engine: Engine, schedule: Schedule, epoch: Epoch, stats: PipelineStats,
                 config: LoaderConfig, device: Any) -> None:
        self.epoch = epoch
        self.yielded = epoch.skipped
        self.finished = False  # the caller reached the epoch's end
        self._engine = engine
        self._stats = stats
        self._device = device
        self._host = _HostBatches(engine, schedule, epoch, stats)
        self._ahead: Any = None
        self._ahead_error: BaseException | None = None
        self._replaced_by = ""
        self._bar = ProgressBar(epoch.number, epoch.remaining) if config.progress else None
        self._pinner = PinThread(self, config.pin_device_id, config.timeout_s) if config.pin_memory else None

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        if self.epoch.remaining is None:
            raise TypeError("this epoch has no length (an IterableDataset, or a batch sampler without __len__)")
        return self.epoch.remaining

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
        asked = time.perf_counter()
        try:
            batch = self._next_batch()
        except StopIteration:
            self.finished = True
            if self._bar is not None:
                self._bar.close(self._stats.wait_fraction(self.epoch.number))
                self._bar = None
            raise
        except BaseException:
            self.yielded += 1  # a batch that raised is consumed: resume starts after it
            raise
        self.yielded += 1
        self._stats.record_wait(self.epoch.number, asked, time.perf_counter() - asked)
        if self._bar is not None:
            self._bar.update(self._stats.wait_fraction(self.epoch.number))
        return batch

    def _host_batch(self) -> Any:
        return self._pinner.take() if self._pinner is not None else self._host.next()

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

    def stop(self, reason: str) -> None:
        """End this iterator: stop its pin thread, drop its epoch's batches in flight; its next
        use raises, naming `reason` ("a newer iter(loader)", "load_state_dict", "close")."""
        if self._pinner is not None:
            self._pinner.stop()
            self._pinner = None
        if not self.finished:
            self._engine.discard(self.epoch.number)
            self._replaced_by = reason
