"""Faults found in the field: idle worker deaths, shared pools that must recover, exits in
datasets, keys, superseded iterators, thread workers and impossible resume states."""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Iterator

import numpy as np
import psutil
import pytest
import torch

import gloader
from gloader import DataLoader, WorkerPool
from tests import _data
from tests.conftest import dev_shm_names, segment_sizes, take_all, wait_until

pytestmark = pytest.mark.timeout(60)


def _kill_and_wait_for_replacement(pids: list[int], victim: int) -> None:
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in pids() and len(pids()) == 2, 10.0)  # the pool replaced it


def test_a_worker_dying_while_idle_is_reported_once_then_loading_goes_on() -> None:
    with DataLoader(_data.WhoLoads(), batch_size=4, num_workers=2) as loader:
        list(loader)
        status = loader._engine.workers.backend.core.status
        # Each worker marks itself idle once its last result is sent: a death now lost nothing.
        assert wait_until(lambda: all(status.doing(pid) is None for pid in loader.worker_pids()), 5.0)
        victim = loader.worker_pids()[0]
        _kill_and_wait_for_replacement(loader.worker_pids, victim)
        with pytest.raises(gloader.WorkerExitedError, match=rf"^DataLoader worker \(pid {victim}\) is killed by signal: Killed \(SIGKILL\)"):
            list(loader)
        rows = torch.cat(list(loader))  # the next epoch runs on new workers
    assert sorted(rows[:, 2].tolist()) == list(range(16))


def test_a_shared_pool_recovers_from_a_dead_worker_and_gives_the_replacement_its_id() -> None:
    with WorkerPool(2) as pool:
        with DataLoader(_data.WhoLoads(), batch_size=1, pool=pool) as first:
            list(first)
            victim = pool.worker_pids()[0]
            _kill_and_wait_for_replacement(pool.worker_pids, victim)
            with pytest.raises(gloader.WorkerExitedError, match=f"pid {victim}"):
                list(first)
            assert len(torch.cat(list(first))) == 16  # reported once: the next epoch works
        with DataLoader(_data.WhoLoads(), batch_size=1, pool=pool) as second:  # the pool is not poisoned
            rows = torch.cat(list(second))
    by_id: dict[int, set[int]] = {}
    for worker_id, pid, _ in rows.tolist():
        by_id.setdefault(worker_id, set()).add(pid)
    assert set(by_id) <= {0, 1} and all(len(pids) == 1 for pids in by_id.values())
    assert len(set().union(*by_id.values())) == len(by_id)  # one pid per id: ids stay unique


def test_a_replacement_that_dies_before_the_loader_next_looks_is_reported_too() -> None:
    with WorkerPool(2) as pool, DataLoader(_data.WhoLoads(), batch_size=1, pool=pool) as loader:
        list(loader)
        first = pool.worker_pids()[0]
        _kill_and_wait_for_replacement(pool.worker_pids, first)
        second = pool.worker_pids()[-1]  # its replacement: the pool appends them
        _kill_and_wait_for_replacement(pool.worker_pids, second)  # the pool forgot it; nobody looked
        for victim in (first, second):
            with pytest.raises(gloader.WorkerExitedError, match=rf"pid {victim}\)"):
                list(loader)
        assert len(torch.cat(list(loader))) == 16


def test_a_worker_killed_while_starting_is_described_by_its_signal(monkeypatch) -> None:
    with WorkerPool(1) as pool, DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
        list(loader)
        monkeypatch.setattr(pool.core.status, "has_started", lambda pid: False)  # as if it died before claiming an id
        victim = pool.worker_pids()[0]
        _kill_and_wait_for_replacement_of_one(pool.worker_pids, victim)
        with pytest.raises(gloader.WorkerExitedError, match=rf"pid {victim}\) is killed by signal: Killed \(SIGKILL\).*, while starting") \
                as info:
            list(loader)
        assert "__main__" not in str(info.value)  # not the advice for a script that fails on import


def test_on_a_shared_pool_a_death_is_reported_to_the_loader_whose_batch_it_held() -> None:
    with WorkerPool(2) as pool:
        with DataLoader(_data.Sleepy(slow=2, seconds=30.0), batch_size=2, pool=pool, timeout=30) as stuck, \
                DataLoader(np.arange(8), batch_size=2, pool=pool, timeout=30) as other:
            it = iter(stuck)
            next(it)  # batch 0; a worker goes on to batch 1 and stays in sample 2
            owner = stuck._engine._loader_id

            def holder() -> int | None:
                return next((pid for pid in pool.worker_pids() if pool.core.status.doing(pid) == (owner, 0, 1)), None)

            assert wait_until(lambda: holder() is not None, 10.0)
            victim = holder()
            _kill_and_wait_for_replacement(pool.worker_pids, victim)
            # The other loader waits first: the death is not its to report, and it lost nothing.
            assert torch.cat(list(other)).tolist() == list(range(8))
            started = time.monotonic()
            with pytest.raises(gloader.WorkerExitedError, match=rf"pid {victim}\) is killed by signal: Killed \(SIGKILL\).*loading batch 1 of "
                                                                r"epoch 0 for loader"):
                next(it)
            assert time.monotonic() - started < 20.0  # promptly, not after its 120 s timeout


def test_a_hung_worker_on_a_shared_pool_is_replaced_after_the_timeout() -> None:
    with WorkerPool(2) as pool:
        with DataLoader(_data.Sleepy(slow=1, seconds=60.0, length=4), batch_size=1, pool=pool, timeout=0.5) as slow:
            with pytest.raises(gloader.BatchTimeoutError):
                list(slow)
        with DataLoader(np.arange(8), batch_size=2, pool=pool, timeout=10) as other:
            assert torch.cat(list(other)).tolist() == list(range(8))  # both workers serve again


def test_a_hang_inside_a_task_of_several_batches_times_out_naming_that_batch_and_the_worker_is_replaced(tmp_path) -> None:
    flag = tmp_path / "hang"
    with WorkerPool(2) as pool:
        # Sample 1001 (batch 500) lies beyond what the loader dispatches of epoch 1 while epoch 0
        # ends (its window of tasks of up to 32 batches), so it is loaded after the flag is set.
        dataset = _data.SleepsWhenFlagged(str(flag), slow=1001, seconds=60.0, length=2000)
        with DataLoader(dataset, batch_size=2, pool=pool, timeout=1.0) as loader:
            list(loader)  # fast: the loader measures its batches, and later tasks carry several
            assert loader._engine.batches_per_task() > 1
            before = set(pool.worker_pids())
            flag.touch()
            served = []
            with pytest.raises(gloader.BatchTimeoutError, match=r"batch 500 of epoch 1 \(sample indices \[1000, 1001\]\)"):
                for batch in loader:
                    served.append(batch)
            # every batch before the hung one came, those written before it in its task included
            assert torch.cat(served).flatten().tolist() == list(range(1000))
        assert wait_until(lambda: len(set(pool.worker_pids()) - before) == 1, 5.0)  # the stuck worker was replaced
        with DataLoader(np.arange(8), batch_size=2, pool=pool, timeout=10) as other:
            assert torch.cat(list(other)).tolist() == list(range(8))


def test_a_batch_the_caller_waits_for_comes_when_written_not_after_a_slow_one_behind_it(tmp_path) -> None:
    """One worker, tasks of many batches: the caller waits for the first batch of a task,
    written 0.02 s after the task starts, and the task's second batch takes 4 s. The caller
    sleeps until a message comes, so the worker tells it as soon as the first is written."""
    flag = tmp_path / "stall"
    dataset = _data.StallsWhenFlagged(str(flag), short_s=0.02, long_s=4.0, length=2000)
    with DataLoader(dataset, batch_size=2, num_workers=1, timeout=30) as loader:
        list(loader)  # fast: later tasks carry many batches
        it = iter(loader)
        for _ in range(100):
            next(it)
        first = loader._engine.tasks[-1].jobs[-1].batch_index + 1  # the first batch of a task not dispatched yet
        assert loader._engine.batches_per_task() > 4 and first < 900
        flag.write_text(f"{2 * first} {2 * first + 2}")
        for _ in range(first - 100):
            next(it)
        started = time.monotonic()
        assert next(it).flatten().tolist() == [2 * first, 2 * first + 1]
        waited = time.monotonic() - started
        assert next(it).flatten().tolist() == [2 * first + 2, 2 * first + 3]
        stalled = time.monotonic() - started
    assert stalled > 3.0  # the second batch was loading all along: the wait above was not for it
    assert waited < 2.0, f"batch {first} came {waited:.1f} s after the caller asked, with the next ({stalled:.1f} s)"


def test_the_timeout_is_per_batch_when_the_cost_of_samples_jumps(tmp_path) -> None:
    """Tasks sized on fast samples carry many batches; when each sample then takes 0.2 s, no
    batch comes near timeout=1.5, so none may time out (a whole task would take seconds)."""
    flag = tmp_path / "slow"
    dataset = _data.SlowsDownWhenFlagged(str(flag), start=1000, seconds=0.2, length=2000)
    with DataLoader(dataset, batch_size=1, num_workers=2, timeout=1.5) as loader:
        list(loader)  # fast: later tasks carry many batches
        assert loader._engine.batches_per_task() >= 16
        flag.touch()
        it = iter(loader)
        got = [next(it) for _ in range(1012)]  # past sample 1000 (not dispatched before the flag), then slow
    assert torch.cat(got).flatten().tolist() == list(range(1012))


def test_a_dead_worker_is_reported_promptly() -> None:
    with DataLoader(_data.Sleepy(slow=2, seconds=30.0), batch_size=2, num_workers=1) as loader:
        it = iter(loader)
        next(it)  # batch 0; the worker goes on to batch 1, stuck in sample 2
        victim = loader.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(gloader.WorkerExitedError, match=f"pid {victim}"):
            next(it)
        assert time.monotonic() - started < 10.0  # not after the 30 s sample, nor the 120 s timeout


@pytest.mark.parametrize("mode", [{"num_workers": 1}, {"num_workers": 1, "thread_pool": True}])
def test_sys_exit_in_a_worker_is_an_error_not_the_end_of_the_script(mode: dict) -> None:
    with DataLoader(_data.ExitsAt(2), batch_size=2, **mode) as loader:
        with pytest.raises(RuntimeError, match=r"SystemExit\(7\) was raised in gloader worker 0.*must raise an "
                                               r"exception, not exit"):
            list(loader)


class _BreaksInFirstEpoch:
    """Sampler whose first epoch raises at index 9 (in the third batch of 4)."""

    def __init__(self) -> None:
        self.epochs = 0

    def __iter__(self) -> Iterator[int]:
        self.epochs += 1
        for index in range(16):
            if self.epochs == 1 and index == 9:
                raise KeyError("the sampler broke")
            yield index

    def __len__(self) -> int:
        return 16


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [{}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_a_sampler_that_raises_gives_the_batches_before_it_then_its_error_then_whole_epochs(mode: dict) -> None:
    with DataLoader(list(range(16)), batch_size=4, sampler=_BreaksInFirstEpoch(), **mode) as loader:
        served = []
        with pytest.raises(KeyError, match="the sampler broke"):
            for batch in loader:
                served.append(batch.tolist())
        assert served == [[0, 1, 2, 3], [4, 5, 6, 7]]  # as torch gives them without workers
        whole = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
        assert [batch.tolist() for batch in loader] == whole  # a new epoch, not the broken one's leftovers
        assert [batch.tolist() for batch in loader] == whole


@pytest.mark.parametrize("mode", [{}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_sampler_keys_reach_getitem_unchanged_in_every_mode(mode: dict) -> None:
    keys = [1.7, (0, 224), "a"]
    with DataLoader(_data.KeyEcho(), batch_size=3, sampler=keys, **mode) as loader:
        assert next(iter(loader)) == [repr(k) for k in keys]
    # Integer keys of any kind arrive as Python ints (docs/migration.md, differences from torch).
    with DataLoader(_data.KeyEcho(), batch_sampler=[[np.int32(2), torch.tensor(1), 0], np.array([1, 2])],
                    **mode) as loader:
        assert list(loader) == [["2", "1", "0"], ["1", "2"]]


def test_zip_of_one_loader_with_itself_raises_instead_of_yielding_nothing() -> None:
    loader = DataLoader(np.arange(8), batch_size=2)
    with pytest.raises(RuntimeError, match="serves one iterator at a time"):
        list(zip(loader, loader))


def test_thread_workers_see_a_dataset_changed_between_epochs() -> None:
    dataset = _data.Tag()
    with DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2, thread_pool=True) as loader:
        list(loader)
        dataset.tag = 1
        assert (torch.cat(list(loader))[:, 0] == 1).all()


@pytest.mark.parametrize("field, value, says", [
    ("batches_yielded", -3, r"state\['batches_yielded'\] must be an integer >= 0, got -3"),
    ("batches_yielded", 99, r"state\['batches_yielded'\]=99 exceeds the 4 batches"),
    ("seed", -1, r"state\['seed'\] must be an integer >= 0, got -1"),
    ("epoch", "x", r"state\['epoch'\] must be an integer >= 0, got 'x'"),
])
def test_load_state_dict_rejects_impossible_states_naming_the_field(field: str, value, says: str) -> None:
    loader = DataLoader(np.arange(8), batch_size=2)
    state = loader.state_dict()
    state[field] = value
    with pytest.raises(ValueError, match=says):
        loader.load_state_dict(state)


def test_memory_of_dropped_batches_returns_within_the_window_and_a_few_spares() -> None:
    batch_bytes = 16 * 65536  # 1 MiB
    with DataLoader(np.zeros((640, 65536), np.uint8), batch_size=16, num_workers=2) as loader:
        held = list(loader)  # 40 batches held at once: 40 segments

        def in_use() -> int:  # shared memory mapped anywhere: the caller or a worker
            return sum(segment_sizes([os.getpid(), *loader.worker_pids()]).values())

        assert in_use() >= 30 * batch_bytes
        del held
        for _ in range(2):  # workers give up the surplus the caller handed back once it lasts 16 batches
            for _ in loader:
                pass
        # window (4) + 2 spare segments per worker + the batch being handed over, with headroom;
        # the last batches' slots are given back by `_caller.dropped`'s thread within 0.1 s of their drop
        bound = (loader.prefetch_factor * loader.num_workers + 5) * batch_bytes * 1.2
        assert wait_until(lambda: in_use() <= bound, 10), f"{in_use()} bytes still mapped, more than {bound:g}"


def test_a_stream_epoch_whose_shard_never_answers_times_out_instead_of_spinning() -> None:
    from gloader._caller.engine import Collected
    from gloader._caller.iterator import _StreamBatches
    from gloader._caller.stats import PipelineStats
    from gloader._sampling.schedule import Schedule
    from gloader._wire.protocol import ShardEnd, StreamRequest

    class OnlyShardZeroAnswers:  # shard 1's worker is gone: every answer is shard 0's "ended"
        shards = 2
        discarded: list[int] = []

        def fill(self, next_job) -> None:
            next_job()

        def collect(self, epoch: int) -> Collected:
            return Collected(ShardEnd(0), {}, 0, 0)

        def discard(self, epoch: int) -> None:
            self.discarded.append(epoch)

    schedule = Schedule(None, StreamRequest(2, True), 0, lookahead=False)
    engine = OnlyShardZeroAnswers()
    batches = _StreamBatches(engine, schedule, schedule.open(), PipelineStats(), timeout_s=0.2,  # type: ignore[arg-type]
                             in_order=True)
    started = time.monotonic()
    with pytest.raises(gloader.BatchTimeoutError, match=r"^DataLoader timed out after 0.2 seconds: stream epoch 0 .*"
                                                        "shard 1 neither sent a batch nor ended"):
        batches.next()
    assert 0.2 <= time.monotonic() - started < 5.0 and engine.discarded == [0]


@pytest.mark.parametrize("run", range(3))  # the exit hooks' order varied from run to run
def test_interpreter_exit_with_a_shared_pool_open_is_prompt_and_quiet(tmp_path, run: int) -> None:
    from tests.test_faults import _run_script, _wait_line

    names_before = dev_shm_names()
    with _run_script(tmp_path, """
        from gloader import WorkerPool
        pool = WorkerPool(2)
        loader = DataLoader(np.arange(64, dtype=np.float32), batch_size=8, pool=pool)
        it = iter(loader)
        next(it)  # batches in flight on the shared pool as the script ends
        print("loading", flush=True)
        """) as proc:
        _wait_line(proc)
        started = time.monotonic()
        assert proc.wait(20) == 0
        elapsed = time.monotonic() - started
        stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert elapsed < 15.0  # no join waits out its deadline (a busy machine takes seconds)
    assert wait_until(lambda: not dev_shm_names() - names_before, 5.0), dev_shm_names() - names_before


def test_closing_a_loader_after_its_shared_pool_is_quiet() -> None:
    pool = WorkerPool(2)
    loader = DataLoader(np.arange(64, dtype=np.float32), batch_size=8, pool=pool)
    it = iter(loader)
    next(it)
    pool.close()
    loader.close()  # the leak guard checks fds, processes and shared memory after the test


def test_holding_many_batches_needs_no_file_descriptor_each() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with DataLoader(np.arange(1200, dtype=np.float32).reshape(1200, 1), batch_size=1, num_workers=1) as loader:
        it = iter(loader)
        held = [next(it)]  # the pool has started: its pipes and locks are counted in `before`
        before = open_fds()
        held += list(it)  # 1,200 batches, each in its own segment while held
        assert len(held) == 1200 and open_fds() - before < 20
        assert torch.cat(held).flatten().tolist() == list(range(1200))


@pytest.mark.parametrize("which", ["result queue", "worker id"])
def test_a_shared_pool_goes_on_after_a_process_died_holding_one_of_its_locks(which: str) -> None:
    # A worker sends each result holding the result queue's write lock, and claims its id
    # under the id lock as it starts (replacements are often killed then). (An idle worker
    # waits for tasks holding the task queue's read lock: the tests that kill idle workers
    # cover that lock.)
    import multiprocess

    with WorkerPool(1) as pool:
        with DataLoader(np.arange(4), batch_size=2, pool=pool, timeout=10) as loader:
            list(loader)
            held = pool.core.pool.results._wlock if which == "result queue" else pool.core.spec.id_lock
            taken = multiprocess.get_context("fork").Event()
            holder = multiprocess.get_context("fork").Process(target=_data.hold_lock_forever, args=(held, taken))
            holder.start()
            assert taken.wait(10.0)  # held as by a worker killed there
            assert not held.acquire(block=False)
            holder.kill()
            holder.join(10.0)
            victim = pool.worker_pids()[0]
            _kill_and_wait_for_replacement_of_one(pool.worker_pids, victim)
            with pytest.raises(gloader.WorkerExitedError, match=f"pid {victim}"):
                list(loader)
            assert torch.cat(list(loader)).tolist() == [0, 1, 2, 3]  # the kernel freed the lock: loading goes on


def test_what_workers_share_holds_no_lock_a_killed_worker_could_keep() -> None:
    with WorkerPool(1) as pool:
        spec = pool.core.spec
        shared = [spec.generation, spec.status, spec.incarnations]
        assert not any(hasattr(value, "get_lock") for value in shared)  # plain shared memory
        assert spec.counter is None  # thread ids only; process ids are claimed under the id lock


def _kill_and_wait_for_replacement_of_one(pids, victim: int) -> None:
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: victim not in pids() and len(pids()) == 1, 10.0)


def test_a_second_ctrl_c_while_close_waits_for_the_workers_still_stops_them(monkeypatch) -> None:
    from gloader._pool import core as _pool

    loader = DataLoader(_data.Sleepy(slow=5, seconds=30.0), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)  # batches in flight; sample 5 keeps one worker busy for 30 s
    pids = loader.worker_pids()
    real_join_all = _pool._join_all
    calls = []

    def interrupted_once(processes, timeout_s):
        calls.append(timeout_s)
        if len(calls) == 1:  # Ctrl-C lands while close() waits for the workers to finish
            raise KeyboardInterrupt
        return real_join_all(processes, timeout_s)

    monkeypatch.setattr(_pool, "_join_all", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    # the leak guard then checks that no process, thread, fd or segment is left


def test_a_batch_whose_answer_cannot_be_rebuilt_in_the_caller_fails_alone() -> None:
    """Small batches travel several to a task; the one the caller cannot unpickle raises, named,
    at its turn, and the other batches of its task still come (they were lost silently)."""
    with DataLoader(_data.OneWorkerOnly(21), batch_size=4, num_workers=2, batchify_fn=list) as loader:
        got, failures = take_all(iter(loader), _data.CustomLookupError)
        assert len(failures) == 1 and "batch 5 of epoch 0 (sample indices [20, 21, 22, 23])" in "".join(
            failures[0].__notes__)
        assert [x for batch in got for x in batch] == [i for i in range(64) if not 20 <= i < 24]
        assert loader.state_dict()["epoch"] == 1


@pytest.mark.parametrize("lost", ["tasks", "results"])
def test_a_worker_that_loses_its_end_of_a_queue_says_so_instead_of_blaming_the_dataset(monkeypatch, lost) -> None:
    from gloader._pool import channel

    name = "_take_message" if lost == "tasks" else "_write_whole"
    original, caller = getattr(channel, name), os.getpid()

    def closed(*args: Any) -> Any:
        if os.getpid() == caller:  # the caller writes to the result pipe too, to stop the pool's threads
            return original(*args)
        raise EOFError("the task socket was closed") if lost == "tasks" else BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(channel, name, closed)  # inherited by the forked workers
    with DataLoader(np.arange(8), batch_size=2, num_workers=1, start_method="fork", timeout=10) as loader:
        with pytest.raises(gloader.WorkerExitedError) as info:
            list(loader)
    code = channel.EXIT_TASKS_CLOSED if lost == "tasks" else channel.EXIT_RESULTS_CLOSED
    assert f"exited with code {code}: its {'task queue' if lost == 'tasks' else 'result pipe'} was closed" \
        in str(info.value)
    assert "dataset" not in str(info.value).split(".")[0]


def test_workers_that_cannot_open_the_callers_shared_memory_fail_the_loader_once_naming_the_cause(monkeypatch) -> None:
    original, caller = os.open, os.getpid()

    def refused(path: Any, *args: Any, **kwargs: Any) -> int:  # as for a caller that is not dumpable
        if os.getpid() != caller and str(path).startswith(f"/proc/{caller}/fd/"):
            raise PermissionError(1, "Operation not permitted", path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)  # inherited by the forked workers
    with DataLoader(np.arange(64), batch_size=2, num_workers=2, start_method="fork") as loader:
        got, errors = take_all(iter(loader), RuntimeError)
        assert got == [] and len(errors) == 1  # once, not once per batch
        assert "not dumpable" in str(errors[0]) and "thread_pool=True" in str(errors[0])
        assert not loader.worker_pids()  # stopped: the next epoch starts on new workers


def test_a_stream_on_a_shared_pool_never_reads_a_shard_twice_after_another_loader_was_told_of_the_death() -> None:
    with WorkerPool(2) as pool, DataLoader(_data.RangeStream(400), batch_size=4, pool=pool) as stream, \
            DataLoader(np.arange(8), batch_size=2, pool=pool) as other:
        it = iter(stream)
        served = [next(it) for _ in range(10)]  # both shards have begun
        status = pool.core.status
        assert wait_until(lambda: all(status.doing(pid) is None for pid in pool.worker_pids()), 5.0)  # idle
        victim = pool.worker_pids()[0]
        _kill_and_wait_for_replacement(pool.worker_pids, victim)
        with pytest.raises(gloader.WorkerExitedError, match=f"pid {victim}"):
            list(other)  # the death lost none of `other`'s work; it is told first, once
        with pytest.raises(gloader.WorkerExitedError, match=r"shard \d of stream epoch 0 died.*no sample comes twice"):
            for batch in it:
                served.append(batch)
        values = torch.cat(served).flatten().tolist()
        assert len(values) == len(set(values))  # none twice
        assert sorted(torch.cat(list(stream)).flatten().tolist()) == list(range(400))  # the next epoch is whole


def test_an_iterator_dropped_mid_epoch_on_thread_workers_stops_its_batches_not_begun() -> None:
    import gc

    dataset = _data.GatedLoads(64, gated=2)
    with DataLoader(dataset, batch_size=1, num_workers=2, thread_pool=True, prefetch=6) as loader:
        it = iter(loader)
        assert [int(next(it)) for _ in range(2)] == [0, 1]  # batches 2-7 in flight: 2 begun (at the gate), 4 queued
        tasks = list(loader._engine.tasks)
        assert len(tasks) == 6
        assert wait_until(lambda: sorted(dataset.waiting) == [2, 3], 10.0)  # both threads took their next batch
        del it  # an early break: the caller drops the iterator
        gc.collect()
        dataset.gate.set()
        assert wait_until(lambda: all(task.result.ready() for task in tasks), 10.0)
        assert sorted(dataset.loaded) == [0, 1, 2, 3]  # the queued ones were skipped, not loaded
        state = loader.state_dict()
        assert (state["epoch"], state["batches_yielded"]) == (0, 2)  # still answered for
        assert [int(b) for b in loader] == list(range(64))  # the next epoch is whole


def test_workers_of_a_killed_caller_exit_with_a_code_that_says_so() -> None:
    import ctypes
    import subprocess
    import sys

    from gloader._pool.channel import EXIT_RESULTS_CLOSED, EXIT_TASKS_CLOSED
    from gloader._worker.setup import EXIT_CALLER_GONE

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: the orphaned workers become our children
        pytest.skip("this system cannot make the test a subreaper")
    try:
        script = ("import sys, numpy as np, gloader\n"
                  "loader = gloader.DataLoader(np.arange(8), batch_size=2, num_workers=2)\n"
                  "next(iter(loader))\n"
                  "print(*loader.worker_pids(), flush=True)\n"
                  "sys.stdin.read()\n")
        with subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) as caller:
            workers = [int(pid) for pid in caller.stdout.readline().split()]
            assert len(workers) == 2
            caller.kill()
        codes: dict[int, int] = {}

        def reaped() -> bool:
            for pid in workers:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            return len(codes) == len(workers)

        assert wait_until(reaped, 10.0)
        # the parent watch (119), the task socket's end gone with the caller (117), or, for a worker
        # that was writing a prefetched batch's answer as the caller died, the result pipe's (118):
        # each says the caller went, never 0
        assert set(codes.values()) <= {EXIT_CALLER_GONE, EXIT_TASKS_CLOSED, EXIT_RESULTS_CLOSED}, codes
    finally:
        libc.prctl(36, 0, 0, 0, 0)


@pytest.mark.parametrize("mode", [{}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_an_exception_whose_str_raises_fails_its_batch_alone_named(mode: dict) -> None:
    with DataLoader(_data.RaisesAt(bad=13, length=64, error=_data.UnprintableError), batch_size=2, **mode) as loader:
        got, errors = take_all(iter(loader), _data.UnprintableError)
    assert len(errors) == 1
    assert "batch 6 of epoch 0, at sample index 13" in errors[0].__notes__[-1]
    assert sorted(torch.cat(got).flatten().tolist()) == [i for i in range(64) if i not in (12, 13)]


@pytest.mark.parametrize("mode", [{"num_workers": 2}, {"num_workers": 2, "persistent_workers": True},
                                  {"num_workers": 2, "thread_pool": True}, {"shared": True}],
                         ids=["own", "persistent", "threads", "shared-pool"])
def test_a_worker_init_fn_that_raised_once_runs_again_at_the_next_epoch(mode: dict, tmp_path) -> None:
    """torch starts its workers anew each epoch, persistent ones after a failure too: a worker
    whose worker_init_fn raised fails its batches of that epoch, and loads the next epochs.
    (Thread workers share one registration per loader, the last one made: the failing one may
    serve the first epoch or not.)"""
    import functools

    init = functools.partial(_data.fails_the_first_time, str(tmp_path / "tried"))
    pool = WorkerPool(2) if mode.pop("shared", False) else None
    try:
        options = {"pool": pool} if pool is not None else mode
        with DataLoader(np.arange(32), batch_size=2, worker_init_fn=init, **options) as loader:
            got, errors = take_all(iter(loader), PermissionError)
            assert errors or options.get("thread_pool")
            assert all("cannot open the database yet" in str(e) for e in errors)
            assert len(got) + len(errors) == 16
            for _ in range(2):
                assert torch.cat(list(loader)).tolist() == list(range(32))
    finally:
        if pool is not None:
            pool.close()
