"""Admission: a pool with more process workers than CPUs gives CPU-bound tasks to one worker
per CPU; tasks that block (storage, network) and stream tasks run side by side; a killed
worker's permit is freed."""
from __future__ import annotations

import itertools
import os
import time
from typing import Any

import multiprocess
import numpy as np
import pytest

import gloader
from gloader import DataLoader, WorkerExitedError, WorkerPool
from gloader._pool import admission as _admission
from gloader._pool import core as _pool
from gloader._pool.directory import ProcessLock
from tests import _data

pytestmark = pytest.mark.timeout(60)


def _overlaps(rows: np.ndarray) -> int:
    """How many pairs of samples loaded by different workers ran at the same time."""
    return sum(a[0] != b[0] and a[1] < b[2] and b[1] < a[2] for a, b in itertools.combinations(rows.tolist(), 2))


def _load(dataset: _data.Occupies, min_workers: int = 2, **options: Any) -> np.ndarray:
    """Epochs of `dataset` until `min_workers` or more took part (a worker that starts first,
    spawned ones most of all, may load a whole epoch before the others are up)."""
    with DataLoader(dataset, batch_size=1, timeout=30, **options) as loader:
        rows = np.empty((0, 3), dtype=np.int64)
        for _ in range(_MAX_EPOCHS):
            rows = np.concatenate([rows, *(batch.numpy() for batch in loader)])
            if len(_workers(rows)) >= min_workers:
                break
        return rows


def _workers(rows: np.ndarray) -> set[int]:
    """The workers (pids) that loaded the samples of `rows`."""
    return set(rows[:, 0].tolist())


_MAX_EPOCHS = 20


@pytest.fixture
def one_cpu(monkeypatch) -> None:
    """Pools count one usable CPU, so that any pool of two workers or more is oversubscribed."""
    monkeypatch.setattr(_pool, "usable_cpus", lambda: 1)


def _spin_rows(start_method: str | None) -> np.ndarray:
    with DataLoader(_data.Occupies("spin"), batch_size=1, num_workers=3, start_method=start_method,
                    timeout=30) as loader:
        rows = np.concatenate([batch.numpy() for _ in range(3) for batch in loader])
        assert len(loader.worker_pids()) == 3
    return rows


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_cpu_bound_tasks_beyond_the_cpus_go_to_one_worker_per_cpu(monkeypatch, start_method) -> None:
    """The others wait for a permit instead of time-sharing the CPU. Spawned workers open the
    permits by their paths. Which worker holds the permit may change: a holder whose tasks
    blocked more than _BLOCKED_SHARE on average hands it on, and on a machine busy with other
    programs a spinning task that waits for its CPU looks blocked, so a few overlaps happen
    there. The rule is measured against the same load with a CPU for every worker (no
    permits), in the same test: one task at a time makes a small fraction of its overlaps."""
    monkeypatch.setattr(_pool, "usable_cpus", lambda: 3)
    free = _overlaps(_spin_rows(start_method))
    monkeypatch.setattr(_pool, "usable_cpus", lambda: 1)
    admitted = _overlaps(_spin_rows(start_method))
    assert free > 20  # 72 samples on 3 workers: without permits they overlap all along
    assert admitted <= free // 8, (admitted, free)


def test_tasks_that_block_run_side_by_side_beyond_the_permits(one_cpu) -> None:
    """A worker whose task slept runs its next task without a permit: I/O-bound datasets
    (the reason to start more workers than CPUs) keep every worker busy."""
    rows = _load(_data.Occupies("sleep", seconds=0.02), num_workers=3)
    assert _overlaps(rows) > 0


def test_tasks_that_block_a_sixth_of_their_time_also_run_side_by_side(one_cpu) -> None:
    """A permit holder that blocks leaves its CPU idle, which costs more than permits save as
    soon as it blocks more than a few percent of the time."""
    rows = _load(_data.Occupies("mixed"), num_workers=3)
    assert _overlaps(rows) > 0


def test_samples_that_wait_for_one_another_load_together_beyond_the_permits(one_cpu) -> None:
    """The permit holder's sample waits at a barrier for the other two, which only workers
    without a permit can load: the waiting workers see the holder stuck off the CPU inside its
    task and run theirs (before, the loader timed out)."""
    with DataLoader(_data.MeetAtBarrier(3), batch_size=1, num_workers=3, timeout=30) as loader:
        pids = [int(batch) for batch in loader]
    assert len(set(pids)) == 3


def test_without_the_run_delay_a_pool_takes_no_permits(one_cpu, monkeypatch) -> None:
    """Where /proc/thread-self/schedstat cannot be read, waiting for a CPU cannot be told from
    blocking; such a pool runs every task at once, as one that fits its CPUs does."""
    monkeypatch.setattr(_admission, "_SCHEDSTAT", "/nonexistent/schedstat")
    rows = _load(_data.Occupies("spin", seconds=0.03), num_workers=3)
    assert _overlaps(rows) > 0


def test_a_worker_killed_holding_a_permit_frees_it(one_cpu) -> None:
    with WorkerPool(2) as pool:
        with DataLoader(_data.DiesAt(0, "kill", length=4), batch_size=1, pool=pool, timeout=30) as dying:
            with pytest.raises(WorkerExitedError):
                list(dying)
        rows = _load(_data.Occupies("spin"), min_workers=1, pool=pool)
    assert len(rows) == 24 and _overlaps(rows) == 0


def _free_elsewhere(permit: ProcessLock) -> bool:
    """Whether another process could take `permit` now (record locks are per process)."""
    child = multiprocess.get_context("fork").Process(target=lambda: os._exit(0 if permit.acquire(block=False) else 1))
    child.start()
    child.join(10)
    return child.exitcode == 0


def test_a_worker_that_can_no_longer_read_the_run_delay_frees_its_permit_and_takes_no_more(tmp_path) -> None:
    permit = ProcessLock(str(tmp_path / "permit.lock"))
    admission = _admission.Admission([permit], worker_id=0)
    try:
        admission.before_task()
        with admission.task(stream=False):
            _data.spin(0.01)  # a task that keeps the CPU busy (the check below blocks: not in a task)
        assert not _free_elsewhere(permit)  # kept for the next task
        with admission.task(stream=False):
            os.close(admission._schedstat)  # the next read fails
        assert _free_elsewhere(permit)
        admission.before_task()
        with admission.task(stream=False):
            assert _free_elsewhere(permit)
        again = _admission.Admission([permit], worker_id=0)
        again.before_task()
        assert not _free_elsewhere(permit)
        os.close(again._schedstat)  # the read at the task's start fails
        with again.task(stream=False):
            assert _free_elsewhere(permit)
    finally:
        permit.close()


class _StolenWall:
    """`time` for the admission module, whose wall clock jumps `stolen_ns` at each reading
    while the thread runs: a hypervisor taking the CPU from a running guest (steal time) shows
    up in neither the thread's CPU time nor its run delay."""

    def __init__(self, stolen_ns: int) -> None:
        self.stolen_ns = stolen_ns
        self.readings = 0

    def perf_counter_ns(self) -> int:
        self.readings += 1
        return time.perf_counter_ns() + self.readings * self.stolen_ns

    def thread_time_ns(self) -> int:
        return time.thread_time_ns()


def test_a_cpu_bound_worker_keeps_its_permit_on_a_host_that_steals_time(tmp_path, monkeypatch) -> None:
    """Only a task that gave up its CPU (a voluntary context switch) can have blocked; one
    that lost half its wall time to steal without one is still CPU-bound. A task that slept
    through the same clocks gives the permit back."""
    monkeypatch.setattr(_admission, "time", _StolenWall(stolen_ns=10_000_000))
    permit = ProcessLock(str(tmp_path / "permit.lock"))
    admission = _admission.Admission([permit], worker_id=0)
    try:
        for _ in range(4):
            admission.before_task()
            with admission.task(stream=False):
                _data.spin(0.01)
            assert not _free_elsewhere(permit)
        with admission.task(stream=False):
            time.sleep(0.01)
        assert _free_elsewhere(permit)
    finally:
        os.close(admission._schedstat)
        permit.close()


@pytest.mark.parametrize("start_method", [None, "spawn"])
def test_a_worker_spinning_on_a_task_never_gives_up_its_cpu(start_method) -> None:
    """Nothing else in a worker takes the GIL from its task (the watch on the caller sleeps in
    poll() without it), so a CPU-bound task reads as such to admission. The watch used to wake
    every 0.2 s: 1-5 switches in 4 tasks of 0.5 s."""
    with DataLoader(_data.CountsVoluntarySwitches(0.5, length=4), batch_size=1, num_workers=2,
                    start_method=start_method, timeout=30) as loader:
        assert [int(batch) for batch in loader] == [0, 0, 0, 0]


class _SpinningShards(gloader.IterableDataset):
    """Each worker yields `per_worker` samples of its own (its id), spinning on the CPU for each."""

    def __init__(self, per_worker: int, seconds: float = 0.005) -> None:
        self.per_worker = per_worker
        self.seconds = seconds

    def __iter__(self) -> Any:
        info = gloader.get_worker_info()
        for _ in range(self.per_worker):
            _data.spin(self.seconds)
            yield np.array([info.id], dtype=np.int64)


def test_stream_tasks_run_without_permits_so_that_every_shard_is_served(one_cpu, monkeypatch) -> None:
    """Each worker streams its own shard: one kept waiting for a permit would keep its shard
    from the epoch, and the epoch would end in a timeout. Here no amount of blocking (a shard
    that has ended answers in microseconds, and such short tasks read as blocked) makes a
    holder give its permit back: only the stream rule lets the waiting workers in."""
    monkeypatch.setattr(_admission, "_BLOCKED_SHARE", 1.0)
    with DataLoader(_SpinningShards(4), batch_size=1, num_workers=3, timeout=10) as loader:
        for _ in range(2):
            assert sorted(int(batch) for batch in loader) == [0] * 4 + [1] * 4 + [2] * 4


def test_a_shared_pool_serves_a_loader_by_key_and_a_stream_side_by_side(one_cpu) -> None:
    """Workers go from holding a permit (tasks by key) to running without one (stream tasks)
    and back, batch by batch, as a train loader and a streamed validation set take turns."""
    with WorkerPool(3) as pool:
        with DataLoader(_data.Occupies("spin", seconds=0.003, length=12), batch_size=2, pool=pool,
                        timeout=10) as by_key, \
                DataLoader(_SpinningShards(3, 0.003), batch_size=1, pool=pool, timeout=10) as stream:
            for _ in range(2):
                keyed, streamed = iter(by_key), iter(stream)
                rows = [next(keyed) for _ in range(2)]
                shards = [int(batch) for batch in streamed]  # the whole stream epoch amid the keyed one
                rows += list(keyed)
                assert sorted(shards) == [0] * 3 + [1] * 3 + [2] * 3
                assert len(rows) == 6 and all(batch.shape == (2, 3) for batch in rows)
