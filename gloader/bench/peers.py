"""The benchmark's other peers, beside torch's DataLoader: the loop a user writes without
workers, and tensorpack's `MultiProcessRunnerZMQ` (optional: skipped when not installed).

Each is an iterable whose `iter()` gives batches of torch tensors, like a DataLoader, and has
`close()`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
from typing import Any, Iterator

import numpy as np
import torch

from gloader.batchify import default_batchify_fn

__all__ = ["InProcessLoop", "TensorpackLoop", "has_tensorpack"]


class InProcessLoop:
    """What a user writes without workers: shuffled keys, `dataset[k]`, the default batchify."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self._rng = np.random.default_rng(0)

    def __iter__(self) -> Iterator[Any]:
        order = self._rng.permutation(len(self.dataset)).tolist()
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            yield default_batchify_fn([self.dataset[k] for k in order[start:start + self.batch_size]])

    def close(self) -> None:
        pass


def has_tensorpack() -> bool:
    """Whether the optional `tensorpack` package is installed."""
    return importlib.util.find_spec("tensorpack") is not None


class TensorpackLoop:
    """tensorpack's parallel loader as its documentation sets it up: each of `num_workers`
    processes runs the whole dataflow (its own shuffled pass over the dataset, batched by
    `BatchData`) and pushes batches to one ZMQ socket the caller reads.
    Batches come as numpy arrays and are handed over as tensors (`torch.from_numpy`, no copy).
    The workers never stop, so `iter()` goes on where the last iterator stopped.
    """

    def __init__(self, dataset: Any, batch_size: int, num_workers: int) -> None:
        with _quiet_tensorpack():
            from tensorpack.dataflow import BatchData, DataFlow, MultiProcessRunnerZMQ

            class _Samples(DataFlow):  # type: ignore[misc]
                def __len__(self) -> int:
                    return len(dataset)

                def __iter__(self) -> Iterator[list[Any]]:
                    for k in np.random.default_rng().permutation(len(dataset)).tolist():
                        yield list(dataset[k])

            # Queues as deep as gloader's default window (its default, 50 per socket, lets its
            # workers refill ~150 batches while the other loaders are timed, on their cores;
            # measured steady-state throughput on W1 is the same within noise).
            self._flow = MultiProcessRunnerZMQ(BatchData(_Samples(), batch_size), num_workers, hwm=2 * num_workers)
            self._flow.reset_state()
        self._stream = iter(self._flow)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._stream:  # an epoch of the runner: len(dataset) // batch_size batches
            yield [torch.from_numpy(np.asarray(field)) for field in batch]
        self._stream = iter(self._flow)  # its workers go on; the next iter() reads on

    def close(self) -> None:
        flow, self._flow = self._flow, None
        if flow is not None:
            with _quiet_tensorpack():
                self._stream.close()
                flow.__del__()  # tensorpack's own clean-up: closes the socket, terminates the workers
                flow._reset_done = False  # done: its exit hook has nothing left to do


@contextlib.contextmanager
def _quiet_tensorpack() -> Iterator[None]:
    """tensorpack prints a warning for each missing optional package and on clean-up."""
    logging.getLogger("tensorpack").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
