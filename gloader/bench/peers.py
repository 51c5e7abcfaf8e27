"""The benchmark's other peers, beside torch's DataLoader: the loop a user writes without
workers, tensorpack's `MultiProcessRunnerZMQ` (optional: skipped when not installed), the
compute ceiling (worker processes that load the samples and drop them) and the batching floor
(the leanest loader that hands over batches at all).

Each is an iterable whose `iter()` gives batches (of torch tensors, like a DataLoader, except
the ceiling's, which are placeholders) and has `close()`.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import queue
import time
from typing import Any, Iterator

import numpy as np
import torch

from gloader.batchify import default_batchify_fn

__all__ = ["BatchingFloor", "ComputeCeiling", "InProcessLoop", "TensorpackLoop", "has_tensorpack"]


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


# How long the ceiling's caller waits for one batch before it gives up (a worker died).
_CEILING_WAIT_S = 120.0
# How often a ceiling process says how many batches it has loaded (slower batches: each).
# A note per batch, as it was, cost a W1 batch a wake-up of the process's queue feeder
# thread and of the caller: on 2 cores that work went to the same CPUs as the loading and
# the ceiling read lower and wider than what the loading costs. Longer: less of that; shorter:
# the timed batches start and end closer to when they were loaded (a turn lasts seconds).
_CEILING_NOTE_S = 0.01


def _stop(processes: list[Any], within_s: float = 10.0) -> None:
    """Terminate `processes` and reap them: those still there after `within_s` in all are killed."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + within_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(5)


# glibc malloc settings of gloader's workers. The benchmark uses gloader's public API only,
# so it repeats them; tests/test_bench.py checks that they match the workers' own.
_MALLOC_MMAP_THRESHOLD_BYTES = 32 << 20
_MALLOC_TRIM_THRESHOLD_BYTES = 256 << 20


def _keep_freed_memory() -> None:
    """glibc malloc as gloader's workers set it: freed memory is kept for the next sample."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, _MALLOC_MMAP_THRESHOLD_BYTES)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, _MALLOC_TRIM_THRESHOLD_BYTES)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


def _drop_samples(dataset: Any, batch_size: int, seed: int, done: Any, note_s: float) -> None:
    if len(dataset) < batch_size:
        return  # not one whole batch to load: the caller's wait names the exit code
    _keep_freed_memory()
    rng = np.random.default_rng(seed)
    loaded, noted = 0, time.monotonic()
    while True:
        order = rng.permutation(len(dataset)).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            for k in order[start:start + batch_size]:
                dataset[k]
            loaded += 1
            now = time.monotonic()
            if now - noted >= note_s:
                done.put(loaded)
                loaded, noted = 0, now


class ComputeCeiling:
    """The most that any loader with `num_workers` processes can deliver on this machine:
    each process loads the samples of its batches (`dataset[k]`, shuffled keys) and drops
    them, with no batching, no copy and no transfer; it only says how many batches it has
    loaded, every _CEILING_NOTE_S. The processes keep freed memory as gloader's workers do,
    so what they measure is the dataset's own cost. `iter()` gives one None per batch loaded."""

    def __init__(self, dataset: Any, batch_size: int, num_workers: int) -> None:
        context = multiprocessing.get_context()
        self._done = context.Queue()
        self._workers = [context.Process(target=_drop_samples, daemon=True,
                                         args=(dataset, batch_size, seed, self._done, _CEILING_NOTE_S))
                         for seed in range(num_workers)]
        for worker in self._workers:
            worker.start()

    def __iter__(self) -> Iterator[None]:
        while True:
            try:
                loaded = self._done.get(timeout=_CEILING_WAIT_S)
            except queue.Empty:
                raise RuntimeError(f"the ceiling's workers loaded no batch in {_CEILING_WAIT_S:.0f} s (exit codes "
                                   f"{[w.exitcode for w in self._workers]})") from None
            for _ in range(loaded):
                yield None

    def close(self) -> None:
        _stop(self._workers)
        self._done.close()
        self._done.cancel_join_thread()  # the caller put nothing: no feeder to wait for
        self._workers = []


def has_tensorpack() -> bool:
    """Whether the optional `tensorpack` package is installed."""
    return importlib.util.find_spec("tensorpack") is not None


# Batches each of the floor's processes may have written ahead of the caller.
_FLOOR_SLOTS = 4


def _write_batches(dataset: Any, batch_size: int, seed: int, fields: list[tuple[Any, np.dtype[Any], tuple[int, ...]]],
                   link: Any, first_slot: int) -> None:
    _keep_freed_memory()
    views = [np.frombuffer(memory, dtype).reshape((-1, batch_size) + shape) for memory, dtype, shape in fields]
    free = list(range(first_slot, first_slot + _FLOOR_SLOTS))
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(dataset)).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            while not free:
                free.append(link.recv())  # a slot the caller is done with
            slot = free.pop()
            samples = [dataset[k] for k in order[start:start + batch_size]]
            for field, view in enumerate(views):
                column = [sample[field] for sample in samples]
                if view.ndim > 2:  # arrays: one concatenation into the slot, as gloader's workers write them
                    np.concatenate(column, out=view[slot].reshape((-1,) + view.shape[3:]))
                else:
                    view[slot] = column
            link.send(slot)


class BatchingFloor:
    """The leanest loader with `num_workers` processes that hands over batches at all: each
    process runs its own shuffled pass (as tensorpack's do), writes each batch's fields into a
    slot of shared memory (arrays with one concatenation, as gloader's workers write them) and
    sends the slot's number; the caller wraps the slot as tensors without a copy and gives it
    back when the next batch is taken. No order across processes, no seeds, no supervision, no
    checks: what is left is the cost of loading and batching, and the least of handing over.
    For samples that are tuples of numeric arrays and numbers (W1's).
    """

    def __init__(self, dataset: Any, batch_size: int, num_workers: int) -> None:
        # Forked, so that the slots are anonymous shared memory: no name, no descriptor.
        context = multiprocessing.get_context("fork")
        fields = []
        for value in dataset[0]:
            array = np.asarray(value)
            fields.append((mmap.mmap(-1, num_workers * _FLOOR_SLOTS * batch_size * array.nbytes), array.dtype,
                           array.shape))
        self._tensors = [torch.from_numpy(np.frombuffer(memory, dtype).reshape((-1, batch_size) + shape))
                         for memory, dtype, shape in fields]
        self._links: list[Any] = []
        self._workers = []
        for seed in range(num_workers):
            mine, theirs = context.Pipe()
            self._workers.append(context.Process(target=_write_batches, daemon=True, args=(
                dataset, batch_size, seed, fields, theirs, seed * _FLOOR_SLOTS)))
            self._links.append(mine)
        for worker in self._workers:
            worker.start()
        self._held: tuple[Any, int] | None = None

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        while True:
            ready = multiprocessing.connection.wait(self._links, _CEILING_WAIT_S)
            if not ready:
                raise RuntimeError(f"the floor's workers wrote no batch in {_CEILING_WAIT_S:.0f} s (exit codes "
                                   f"{[w.exitcode for w in self._workers]})")
            for link in ready:
                assert isinstance(link, multiprocessing.connection.Connection)
                try:
                    slot: int = link.recv()
                    if self._held is not None:  # the batch before is done with once the next is taken
                        self._held[0].send(self._held[1])
                except (EOFError, OSError):  # a process is gone (OSError: mid-message, or a broken pipe)
                    raise RuntimeError(f"one of the floor's workers ended (exit codes "
                                       f"{[w.exitcode for w in self._workers]})") from None
                self._held = (link, slot)
                yield [tensors[slot] for tensors in self._tensors]

    def close(self) -> None:
        _stop(self._workers)
        for link in self._links:
            link.close()
        self._workers, self._links = [], []


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
            # Its clean-up swallows any error and waits 5 s a worker: whatever it left is reaped here.
            if not flow.context.closed:
                flow.context.destroy(0)
            _stop(flow._procs)


@contextlib.contextmanager
def _quiet_tensorpack() -> Iterator[None]:
    """tensorpack prints a warning for each missing optional package and on clean-up."""
    logging.getLogger("tensorpack").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield
