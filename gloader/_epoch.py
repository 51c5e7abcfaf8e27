"""Iterating one epoch: handing batches to the caller, through the pin thread and the device
stage when asked, counting what reached the caller; and batching an in-process stream.

Runs in the caller's process. The whole flow is drawn in `_dispatch`.
"""
from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Iterator

from ._dispatch import EpochRun
from ._stats import ProgressBar
from .dataset import IterableDataset

if TYPE_CHECKING:
    from .loader import DataLoader

__all__ = ["BatchIterator", "StreamBatches"]


class StreamBatches:
    """Groups an in-process IterableDataset's samples into lists of `batch_size`."""

    def __init__(self, dataset: IterableDataset, batch_size: int, last_batch: str) -> None:
        self._dataset = dataset
        self.batch_size = batch_size
        self.keep_last = last_batch == "keep"

    def __iter__(self) -> Iterator[list[Any]]:
        stream = iter(self._dataset)
        while True:
            batch = list(itertools.islice(stream, self.batch_size))
            if len(batch) == self.batch_size or (batch and self.keep_last):
                yield batch
            if len(batch) < self.batch_size:
                return


_END = object()


class BatchIterator:
    """Iterates one epoch run; with a device, copies one batch ahead of the caller.

    Counts the batches that reach the caller (`run.yielded`), which is what `state_dict`
    saves: the pin thread and the device stage fetch ahead of the caller.
    """

    def __init__(self, loader: DataLoader, run: EpochRun) -> None:
        self._loader = loader
        self._run = run
        self._ahead: Any = None
        self._ahead_error: BaseException | None = None
        self._bar: ProgressBar | None = None
        if loader._options.progress:
            self._bar = ProgressBar(run.number, run.length - run.skipped if run.length >= 0 else None)

    def __iter__(self) -> BatchIterator:
        return self

    def __len__(self) -> int:
        if self._run.length < 0:
            raise TypeError("this epoch has no length (an IterableDataset, or a batch sampler without __len__)")
        return self._run.length - self._run.skipped

    def fetch(self) -> Any:
        """Next host batch of this run; called by the pin thread when there is one."""
        return self._loader._next_host_batch(self._run)

    def _host(self) -> Any:
        pinner = self._loader._pinner
        if pinner is not None and pinner.serves(self):
            return pinner.take()
        return self.fetch()

    def __next__(self) -> Any:
        asked = time.perf_counter()
        try:
            batch = self._next_batch()
        except StopIteration:
            self._run.finished = True
            if self._bar is not None:
                self._bar.close(self._wait_fraction())
                self._bar = None
            raise
        except BaseException:
            self._run.yielded += 1  # a batch that raised is consumed: resume starts after it
            raise
        self._run.yielded += 1
        self._loader._stats.record_wait(self._run.number, asked, time.perf_counter() - asked)
        if self._bar is not None:
            self._bar.update(self._wait_fraction())
        return batch

    def _wait_fraction(self) -> float:
        return self._loader._stats.wait_fraction(self._run.number)

    def _next_batch(self) -> Any:
        device = self._loader._device
        if device is None:
            return self._host()
        if self._ahead is None:
            self._ahead = device.to_device(self._host())
        if self._ahead is _END:
            raise StopIteration
        if self._ahead_error is not None:
            error, self._ahead_error, self._ahead = self._ahead_error, None, None
            raise error
        current = self._ahead
        try:
            self._ahead = device.to_device(self._host())
        except StopIteration:
            self._ahead = _END
        except Exception as exc:  # raised at its own turn, after the batch before it
            self._ahead_error = exc
        return device.hand_over(*current)
