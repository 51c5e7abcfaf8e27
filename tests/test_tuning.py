"""num_workers='auto': the worker count grows and shrinks as the loader runs, within its
budgets, without a batch lost, duplicated or changed; what the tuner decides from its measures."""
from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import torch

import gloader
from gloader import DataLoader
from gloader._caller import tuning as _tuning
from gloader._pool.core import ProcessCore, make_core
from gloader._wire.protocol import WorkerExitedError
from tests import _data
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

MiB = 2**20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tuner(start: int = 2, most: int = 16, cpu_budget: float = 2.0, memory_budget: int | None = None,
          clock: Clock | None = None) -> _tuning.Tuner:
    return _tuning.Tuner(start, most, cpu_budget, memory_budget, 2.0, clock or Clock())


def measures(count: int = 2, wait: float = 0.9, busy: float | None = None, cpu: float | None = 0.1,
             idle: float | None = 1.8, uss: int | None = None, rate: float = 100.0) -> _tuning.Measures:
    busy = count if busy is None else busy
    return _tuning.Measures(1.0, int(rate), wait, busy, cpu, idle, uss if uss is not None else 20 * MiB * count)


# --- what the tuner decides (no workers) ---------------------------------------------------

def test_it_grows_while_the_caller_waits_on_busy_workers_that_leave_the_cpus_idle() -> None:
    t = tuner()
    assert t.decide(measures(count=2)) == 4  # at most doubling
    assert t.count == 4 and t.window == 8  # the window follows: two tasks a worker
    change = t.changes[-1]
    assert (change["from"], change["to"]) == (2, 4)
    assert change["why"].startswith("grew, the loader kept the caller waiting: the caller waited 90% of the time, "
                                    "2.0 of 2 workers busy, using 0.1 CPUs, 1.8 CPUs idle, 40 MiB")


@pytest.mark.parametrize("case", [
    {"cpu": 1.9},  # the workers compute: the CPUs of the budget are full
    {"idle": 0.0},  # other processes keep the machine's CPUs busy
    {"wait": 0.02},  # the caller hardly waits: more workers would not make it faster
    {"busy": 1.0},  # half the workers idle: something else holds the batches back
])
def test_it_does_not_grow_when_more_workers_could_not_help(case: dict[str, Any]) -> None:
    t = tuner()
    assert t.decide(measures(count=2, **case)) is None
    assert t.count == 2 and not t.changes


def test_growth_stops_at_the_cpu_budget_and_the_memory_budget_and_the_most_workers() -> None:
    # 0.25 CPUs a worker: 90% of the budget less the 1.0 used fits 3 more; the 1.8 idle CPUs 7
    assert tuner(start=4).decide(measures(count=4, cpu=1.0)) == 7
    assert tuner(start=4).decide(measures(count=4, cpu=1.0, idle=0.5)) == 6
    # 20 MiB a worker
    assert tuner(start=4, memory_budget=90 * MiB).decide(measures(count=4, cpu=0.1, uss=80 * MiB)) is None
    assert tuner(start=4, memory_budget=130 * MiB).decide(measures(count=4, cpu=0.1, uss=80 * MiB)) == 6
    assert tuner(start=12, most=16).decide(measures(count=12, cpu=0.1)) == 16


def test_a_waiting_caller_grows_one_worker_into_a_free_cpu_even_where_a_whole_worker_does_not_fit() -> None:
    # One CPU-bound worker on 2 CPUs, the caller using a few tenths of the other: 90% of the
    # budget less 1.0 fits no whole worker, but a CPU is free, and the caller waits.
    assert tuner(start=1).decide(measures(count=1, cpu=1.0, idle=0.7)) == 2
    assert tuner(start=1).decide(measures(count=1, cpu=1.0, idle=0.3)) is None  # other programs took it
    assert tuner(start=2).decide(measures(count=2, cpu=1.9, idle=0.6)) is None  # the budget is full


def _feed(t: _tuning.Tuner, clock: Clock, batches: int, step_s: float, wait_s: float) -> None:
    """`batches` batches, the caller away `step_s` (its training step) and waiting `wait_s` for each."""
    for _ in range(batches):
        clock.now += step_s + wait_s
        t.observe(wait_s, 2 * (step_s + wait_s))


def test_time_away_from_the_loader_is_not_measured_as_idle_workers() -> None:
    """A validation pass of 30 s between two epochs: the workers idle because nobody asks, and
    the window that spans it opens again instead of shrinking the pool."""
    clock = Clock()
    t = tuner(clock=clock)
    t.begin([])
    _feed(t, clock, 40, step_s=0.02, wait_s=0.01)
    clock.now += 30.0  # validation
    _feed(t, clock, 1, step_s=0.0, wait_s=0.01)
    assert t.settling  # the window opens again
    t.begin([])
    _feed(t, clock, 40, step_s=0.02, wait_s=0.01)
    assert t.due()
    m = t.measure([])
    assert m.wait > 0.3 and m.busy > 1.9  # what the training steps measure, without the pass
    assert t.decide(m) == 4


def test_between_epochs_the_window_is_wider_up_to_the_window_at_the_most_workers() -> None:
    t = tuner(start=2, most=3)
    assert (t.window, t.window_between_epochs()) == (4, 6)  # 4 times 4, held to the window at the 3 workers most
    t.count = 1
    assert (t.window, t.window_between_epochs()) == (2, 6)
    t.most = 8
    assert (t.window, t.window_between_epochs()) == (2, 8)  # 4 times 2


def test_between_epochs_the_batches_beyond_the_window_hold_at_most_an_eighth_of_the_memory_budget() -> None:
    t = tuner(start=2, most=16, memory_budget=800 * MiB)
    assert t.window_between_epochs() == t.window_between_epochs(MiB) == 16  # 4 times 4: 12 tasks of 1 MiB fit
    assert t.window_between_epochs(100 * MiB) == 4 + 1  # one task of 100 MiB beyond the window: 100 of 800 MiB
    assert t.window_between_epochs(500 * MiB) == 4  # none: never narrower than the window
    assert tuner(start=2, most=16).window_between_epochs(500 * MiB) == 16  # no memory budget known: no cap


def test_loaders_sharing_the_default_memory_budget_split_its_eighth_for_the_batches_ahead() -> None:
    budgets = _tuning.SharedBudgets()

    def shared_tuner() -> _tuning.Tuner:
        return _tuning.Tuner(2, 16, 2.0, 800 * MiB, 2.0, Clock(), shared=(True, True), budgets=budgets)

    train = shared_tuner()
    assert train.window_between_epochs(25 * MiB) == 4 + 4  # alone: 100 MiB of 800 beyond the window
    validation = shared_tuner()
    assert train.window_between_epochs(25 * MiB) == validation.window_between_epochs(25 * MiB) == 4 + 2
    own = _tuning.Tuner(2, 16, 2.0, 800 * MiB, 2.0, Clock(), budgets=budgets)  # its own budget: not shared
    assert own.window_between_epochs(25 * MiB) == 4 + 4
    budgets.leave(validation)
    assert train.window_between_epochs(25 * MiB) == 4 + 4


def test_a_loader_of_large_batches_makes_fewer_ahead_between_epochs(monkeypatch) -> None:
    monkeypatch.setattr(_tuning, "_DECIDE_S", 1e9)  # the count stays as it starts
    width = 75_000  # 300 KB samples: a task is one batch of 1.2 MB
    data = np.arange(128 * width, dtype=np.float32).reshape(128, width)
    with DataLoader(data, batch_size=4, shuffle=True, num_workers="auto", cpu_budget=2, memory_budget=24 * MiB,
                    seed=0) as loader:
        engine, tuner = loader._engine, loader._engine.tuner
        assert len([batch for batch in loader]) == 32
        task_bytes = engine.workers.slots.task_bytes()
        assert 1_200_000 <= task_bytes < 2 * MiB
        beyond = int(24 * MiB * _tuning._AHEAD_MEMORY // task_bytes)  # 3 MiB: 2 tasks
        assert 1 <= beyond < 3 * tuner.window
        assert len(engine.tasks) == tuner.window + beyond  # the next epoch's first batches
        assert [len(batch) for batch in loader] == [4] * 32


def test_every_validation_pass_is_time_away_however_short_the_epochs_between() -> None:
    """20-batch epochs of 50 ms steps, a 30 s checkpoint, then a 3 s pass after each epoch:
    every pause opens the window again (a pause folded into the usual time away hid the passes
    after it, which were measured as idle workers)."""
    clock = Clock()
    t = tuner(clock=clock)
    t.begin([])
    _feed(t, clock, 20, step_s=0.05, wait_s=0.0)
    for pause in (30.0, 3.0, 3.0):
        clock.now += pause
        _feed(t, clock, 1, step_s=0.0, wait_s=0.0)
        assert t.settling
        t.begin([])
        _feed(t, clock, 20, step_s=0.05, wait_s=0.0)
        assert not t.settling


@pytest.mark.parametrize("cpu_budget", [1, 2])
def test_the_next_epoch_opens_with_a_wider_window_while_the_caller_is_away(cpu_budget, monkeypatch) -> None:
    """A caller is often away between epochs (a validation pass): the workers fill a wider
    window of the next epoch meanwhile, and it narrows again once the caller takes its batches."""
    monkeypatch.setattr(_tuning, "_DECIDE_S", 1e9)  # the count stays as it starts
    width = 75_000  # 300 KB samples: a batch of 4 is over a task's bytes, so a task is one batch
    data = np.arange(128 * width, dtype=np.float32).reshape(128, width)
    with DataLoader(data, batch_size=4, shuffle=True, num_workers="auto", cpu_budget=cpu_budget, seed=0) as loader:
        engine, tuner = loader._engine, loader._engine.tuner
        assert sorted(int(row) for batch in loader for row in batch[:, 0] // width) == list(range(128))
        assert tuner.count == cpu_budget and tuner.window_between_epochs(0) == 4 * tuner.window == 8 * cpu_budget
        assert len(engine.tasks) == tuner.window_between_epochs(0)  # the next epoch's first batches
        it = iter(loader)
        next(it)
        assert engine.window == tuner.window  # the caller is in the epoch: nothing more is dispatched
        assert len(engine.tasks) == tuner.window_between_epochs(0) - 1
        assert len([batch for batch in it]) == 31


def test_a_steady_slow_training_step_is_not_taken_for_time_away() -> None:
    clock = Clock()
    t = tuner(clock=clock)
    t.begin([])
    _feed(t, clock, 1, step_s=1.5, wait_s=0.0)  # the first: nothing to compare with yet
    t.begin([])
    _feed(t, clock, 6, step_s=1.5, wait_s=0.0)
    assert not t.settling and t.due()
    m = t.measure([])
    assert m.wait < 0.01 and t.decide(_tuning.Measures(m.wall_s, 6, 0.0, 0.1, 0.1, 1.8, 40 * MiB)) == 1  # shrinks


def test_it_shrinks_when_over_a_budget_or_when_the_workers_idle_ahead_of_the_caller() -> None:
    t = tuner(start=8, memory_budget=100 * MiB)
    assert t.decide(measures(count=8, uss=200 * MiB)) == 4
    assert t.changes[-1]["why"].startswith("shrank, over the memory budget")
    t = tuner(start=4, cpu_budget=1.0)
    assert t.decide(measures(count=4, cpu=2.0)) == 2
    assert t.changes[-1]["why"].startswith("shrank, over the CPU budget")
    t = tuner(start=8)
    assert t.decide(measures(count=8, wait=0.0, busy=1.0)) == 6  # a quarter at a time
    assert t.changes[-1]["why"].startswith("shrank, the workers kept ahead of the caller and idled")
    assert tuner(start=1).decide(measures(count=1, wait=0.0, busy=0.1)) is None  # never below one


def test_a_grow_that_did_not_raise_the_rate_is_taken_back_and_not_tried_again_soon() -> None:
    clock = Clock()
    t = tuner(clock=clock)
    assert t.decide(measures(count=2, rate=100.0)) == 4
    clock.now += 1.0
    assert t.decide(measures(count=4, rate=105.0)) == 2  # +5% for twice the workers
    assert t.changes[-1]["why"].startswith("took back the last grow, which did not raise the rate")
    clock.now += 1.0
    assert t.decide(measures(count=2, rate=100.0)) == 3  # below the count taken back
    clock.now += 1.0
    assert t.decide(measures(count=3, rate=140.0)) is None  # 3 helped; 4 is blocked for a while
    clock.now += _tuning._RETRY_S
    assert t.decide(measures(count=3, rate=140.0)) == 6


def test_a_resize_the_pool_refused_is_undone() -> None:
    t = tuner()
    t.decide(measures(count=2))
    t.refused(2)
    assert t.count == 2 and not t.changes and not t.settling


def test_the_most_workers_scales_with_the_cpu_budget() -> None:
    assert _tuning.most_workers(2) == 32
    assert _tuning.most_workers(0.5) == 16
    assert _tuning.most_workers(100) == 200  # a large machine may still double its start


def test_the_measures_of_this_process_are_read_from_proc() -> None:
    assert _tuning.process_cpu_s(os.getpid()) > 0
    assert _tuning.process_uss(os.getpid()) > MiB
    assert _tuning.idle_cpu_s(os.sched_getaffinity(0)) >= 0
    assert _tuning.process_cpu_s(2**22 + 1) is None  # above the largest pid Linux hands out


def test_worker_memory_is_read_from_a_few_workers_a_window_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []

    def uss(pid: int) -> int:
        reads.append(pid)
        return pid * MiB

    monkeypatch.setattr(_tuning, "process_uss", uss)
    t = tuner()
    assert t._workers_uss([1, 2, 3, 4, 5]) == 15 * MiB // 2  # 1 and 2 read: 1.5 MiB each, for 5 workers
    assert t._workers_uss([1, 2, 3, 4, 5]) == round(2.5 * MiB * 5)  # 1 to 4 known
    assert reads == [1, 2, 3, 4]  # the unread first
    assert t._workers_uss([1, 2, 3, 4, 5]) == 15 * MiB
    t._workers_uss([1, 2, 3, 4, 5])
    assert reads == [1, 2, 3, 4, 5, 1, 2, 3]  # then the oldest reading, in turn
    assert t._workers_uss([2, 3]) == 5 * MiB  # a worker that left no longer counts
    assert _tuning._USS_READS == 2


# --- the pool resizes ----------------------------------------------------------------------

def _ids(core: ProcessCore) -> list[int]:
    return sorted(core.status.worker_id(pid) for pid in core.worker_pids())


def test_a_process_pool_grows_and_shrinks_with_unique_ids_and_no_death_reported() -> None:
    core = make_core(2, False, "fork", [], capacity=5)
    try:
        assert isinstance(core, ProcessCore) and core.capacity == 5
        assert wait_until(core.workers_ready, 20.0)
        assert core.resize(5)
        assert not core.resize(3)  # the last resize is still under way
        assert wait_until(core.workers_ready, 20.0)
        assert _ids(core) == [0, 1, 2, 3, 4]
        first = set(core.worker_pids())
        assert core.resize(1)
        assert wait_until(core.workers_ready, 20.0)
        assert len(core.worker_pids()) == 1 and set(core.worker_pids()) <= first
        assert core.find_dead_worker() is None  # the four that left were asked to
        assert core.resize(3)
        assert wait_until(core.workers_ready, 20.0)
        assert len(set(_ids(core))) == 3 and max(_ids(core)) < 5  # new workers take free ids
        with pytest.raises(ValueError, match="a pool of capacity 5 cannot keep 6 workers"):
            core.resize(6)
    finally:
        core.close()


class Scripted:
    """Replaces the tuner's choice: the counts to go to, one per window, then none."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = list(counts)

    def __call__(self, measures: Any, count: int, now: float) -> tuple[int | None, str]:
        if not self.counts:
            return None, ""
        return self.counts.pop(0), "scripted"


@pytest.fixture
def quick_windows(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(_tuning, "_DECIDE_S", 0.0)
    monkeypatch.setattr(_tuning, "_DECIDE_BATCHES", 2)
    return monkeypatch


@pytest.mark.parametrize("in_order", [True, False])
def test_growing_and_shrinking_under_load_loses_nothing_and_changes_no_batch(quick_windows, in_order) -> None:
    script = Scripted([4, 1, 3, 2, 5, 2])
    quick_windows.setattr(_tuning.Tuner, "_choose", script)
    dataset = _data.RandomAugmented(length=120, seconds=0.002)  # draws from the process-wide generators
    with DataLoader(dataset, batch_size=3, shuffle=True, seed=11) as reference, \
            DataLoader(dataset, batch_size=3, shuffle=True, seed=11, num_workers="auto", cpu_budget=2,
                       in_order=in_order) as loader:
        seen_counts = set()
        for _ in range(20):  # epochs, until the script has run
            got = []
            for batch in loader:
                got.append(batch)
                seen_counts.add(len(loader.worker_pids()))
            expected = list(reference)
            if not in_order:  # a ready batch may go first: the same batches, by their sample indices
                got = sorted(got, key=lambda b: b[1][0].item())
                expected = sorted(expected, key=lambda b: b[1][0].item())
            assert len(got) == len(expected) == 40
            for (features, index), (want_features, want_index) in zip(got, expected):
                assert torch.equal(index, want_index) and torch.equal(features, want_features)
            if not script.counts:
                break
        changes = loader.stats()["workers"]["changes"]
    assert [(c["from"], c["to"]) for c in changes] == [(2, 4), (4, 1), (1, 3), (3, 2), (2, 5), (5, 2)]
    assert {1, 5} <= seen_counts


def test_state_saved_while_the_pool_resizes_resumes_the_same_batches(quick_windows) -> None:
    quick_windows.setattr(_tuning.Tuner, "_choose", Scripted([4, 1, 3]))
    dataset = _data.RandomAugmented(length=90, seconds=0.002)
    with DataLoader(dataset, batch_size=3, shuffle=True, seed=5, num_workers="auto", cpu_budget=2) as loader:
        it = iter(loader)
        for _ in range(12):
            next(it)
        state = loader.state_dict()
        rest = list(it)
        assert loader.stats()["workers"]["changes"]  # it resized on the way
    with DataLoader(dataset, batch_size=3, shuffle=True, seed=5) as resumed:
        resumed.load_state_dict(state)
        again = list(resumed)
    assert len(rest) == len(again) == 18
    for (features, index), (want_features, want_index) in zip(rest, again):
        assert torch.equal(index, want_index) and torch.equal(features, want_features)


def _kill_one_worker_as_the_pool_resizes(monkeypatch: pytest.MonkeyPatch, pick: str) -> list[int]:
    """SIGKILL one worker as the tuner asks for its first resize, just before the pool takes it.
    Killed just after a shrink was asked, the worker could already have taken the retire task
    and exited by itself (on a machine busy with other programs the caller was descheduled
    between the two), and then nothing died."""
    killed: list[int] = []
    resize = ProcessCore.resize

    def kill_then_resize(core: ProcessCore, count: int) -> bool:
        if not killed:
            pids = core.worker_pids()
            victim = max(pids) if pick == "newest" else min(pids)
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)
        return resize(core, count)

    monkeypatch.setattr(ProcessCore, "resize", kill_then_resize)
    return killed


@pytest.mark.parametrize("counts", [[4], [1]], ids=["growing", "shrinking"])
def test_a_worker_killed_while_the_pool_resizes_is_reported_and_the_next_epoch_is_whole(quick_windows,
                                                                                       counts) -> None:
    quick_windows.setattr(_tuning.Tuner, "_choose", Scripted(counts))
    killed = _kill_one_worker_as_the_pool_resizes(quick_windows, "oldest")
    dataset = _data.SlowEverySample(0.002, length=120)
    with DataLoader(dataset, batch_size=2, seed=3) as reference:
        expected = [b.tolist() for b in reference]
    with DataLoader(dataset, batch_size=2, seed=3, num_workers="auto", cpu_budget=2) as loader:
        with pytest.raises(WorkerExitedError) as info:
            for _ in loader:
                pass
        assert killed and f"DataLoader worker (pid {killed[0]}) is killed by signal: Killed" in str(info.value)
        assert [b.tolist() for b in loader] == expected  # a new pool, at the count the tuner had reached


def test_a_dataset_exiting_with_the_retire_code_while_the_pool_shrinks_is_a_death_naming_its_batch(
        quick_windows, tmp_path) -> None:
    """A worker asked to retire exits with EXIT_RETIRED; a dataset that exits with the same code
    while a retire is pending must not be taken for it: the error names that worker and batch."""
    import threading

    from gloader._pool.channel import EXIT_RETIRED

    quick_windows.setattr(_tuning.Tuner, "_choose", Scripted([]))  # the test resizes, not the tuner
    go, stamp = tmp_path / "go", tmp_path / "pid"
    dataset = _data.ExitsWhenTold(bad=0, code=EXIT_RETIRED, go=str(go), stamp=str(stamp))
    with DataLoader(dataset, batch_size=2, num_workers="auto", cpu_budget=2) as loader:
        def shrink_then_exit() -> None:  # while the caller waits for batch 0
            if wait_until(stamp.exists, 30.0):
                assert loader._engine.workers.backend.core.resize(1)
            go.touch()

        helper = threading.Thread(target=shrink_then_exit)
        helper.start()
        try:
            with pytest.raises(WorkerExitedError) as info:
                next(iter(loader))
        finally:
            helper.join(30)
    exited = int(stamp.read_text())
    assert f"DataLoader worker (pid {exited}) exited unexpectedly with code {EXIT_RETIRED}" in str(info.value)
    assert "It was loading batch 0 of epoch 0" in str(info.value)


# --- the tuner on real workloads (decisions from what is measured) --------------------------

def test_samples_that_wait_grow_the_pool_and_the_count_and_why_are_shown(quick_windows, capsys) -> None:
    # 10 ms waits: the caller, at well under a millisecond a batch, waits for them even when
    # other programs keep it off the CPU much of the time.
    quick_windows.setattr(_tuning, "_DECIDE_S", 0.2)
    with DataLoader(_data.Waits(0.01, length=800), batch_size=4, num_workers="auto", cpu_budget=2,
                    progress=True) as loader:
        assert torch.cat(list(loader)).flatten().tolist() == list(range(800))
        workers = loader.stats()["workers"]
    assert workers["count"] > 2 and workers["most"] == 32 and workers["cpu_budget"] == 2.0
    assert workers["changes"][0]["why"].startswith("grew, the loader kept the caller waiting")
    last = workers["changes"][-1]
    assert workers["chosen_by"] == f"num_workers='auto', {last['why']}"
    verb = last["why"].split(",")[0]
    assert f", {workers['count']} workers, {verb} from {last['from']}" in capsys.readouterr().err


def test_a_memory_budget_below_what_the_workers_hold_keeps_one_worker(quick_windows) -> None:
    quick_windows.setattr(_tuning, "_DECIDE_S", 0.2)
    with DataLoader(_data.Waits(0.004, length=400), batch_size=4, num_workers="auto", cpu_budget=2,
                    memory_budget=1) as loader:
        assert len(list(loader)) == 100
        workers = loader.stats()["workers"]
        assert workers["count"] == 1 and len(loader.worker_pids()) == 1
    assert [c["to"] for c in workers["changes"]] == [1]
    assert workers["changes"][0]["why"].startswith("shrank, over the memory budget")


def test_samples_that_compute_do_not_grow_past_the_cpu_budget(quick_windows) -> None:
    quick_windows.setattr(_tuning, "_DECIDE_S", 0.2)
    with DataLoader(_data.Computes(length=600), batch_size=4, num_workers="auto", cpu_budget=1) as loader:
        assert loader.num_workers == 1
        assert len(list(loader)) == 150
        assert loader.stats()["workers"]["count"] == 1


def test_the_count_stays_as_picked_for_streams_threads_and_a_shared_pool() -> None:
    with DataLoader(_data.RangeStream(8), batch_size=2, num_workers="auto", cpu_budget=2) as stream, \
            DataLoader(np.arange(8), batch_size=2, num_workers="auto", cpu_budget=2, thread_pool=True) as threads:
        for loader in (stream, threads):
            assert loader._engine.tuner is None
            workers = loader.stats()["workers"]
            assert workers["count"] == 2 and workers["most"] == 2 and workers["changes"] == []


# --- arguments -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_workers": 2, "cpu_budget": 1}, ValueError,
     r"cpu_budget=1 bounds the workers that num_workers='auto' tunes, but num_workers=2"),
    ({"memory_budget": 2**30}, ValueError, r"memory_budget=1073741824 bounds .* but num_workers=0"),
    ({"num_workers": "auto", "cpu_budget": 0}, ValueError, r"cpu_budget must be a positive number of CPUs or None, got 0"),
    ({"num_workers": "auto", "cpu_budget": float("nan")}, ValueError, r"got nan"),
    ({"num_workers": "auto", "cpu_budget": "two"}, TypeError, r"cpu_budget must be .* got 'two'"),
    ({"num_workers": "auto", "cpu_budget": True}, TypeError, r"got True"),
    ({"num_workers": "auto", "memory_budget": 0}, ValueError, r"memory_budget must be a positive int .* got 0"),
    ({"num_workers": "auto", "memory_budget": 1.5e9}, TypeError, r"memory_budget must be a positive int .* got 1500000000.0"),
])
def test_bad_budgets_are_named(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        DataLoader(np.arange(8), batch_size=2, **kwargs)


def test_a_loader_built_again_from_its_vars_tunes_its_workers_too() -> None:
    with DataLoader(np.arange(8), batch_size=2, num_workers="auto", cpu_budget=1.5, memory_budget=2**30) as loader:
        assert loader.num_workers == 2 and vars(loader)["num_workers"] == "auto"
        assert (loader.cpu_budget, loader.memory_budget) == (1.5, 2**30)
        names = ("dataset", "batch_size", "num_workers", "cpu_budget", "memory_budget")
        with DataLoader(**{name: vars(loader)[name] for name in names}) as again:
            assert again._engine.tuner is not None and again.cpu_budget == 1.5
    with DataLoader(np.arange(8), batch_size=2, num_workers=2) as fixed:
        assert vars(fixed)["num_workers"] == 2 and fixed.cpu_budget is None and fixed.memory_budget is None


def test_a_shared_pool_takes_its_own_count_with_auto() -> None:
    with gloader.WorkerPool(2) as pool, DataLoader(np.arange(8), batch_size=2, num_workers="auto", pool=pool) as loader:
        assert loader._engine.tuner is None and loader.stats()["workers"]["count"] == 2


# --- the default budgets are the process's, shared by its tuned loaders ----------------------

def test_loaders_on_the_default_budgets_share_them_and_an_explicit_budget_stays_its_own() -> None:
    budgets = _tuning.SharedBudgets()

    def member(shared: tuple[bool, bool], memory: int | None = 100 * MiB) -> _tuning.Tuner:
        return _tuning.Tuner(2, 16, 2.0, memory, 2.0, Clock(), shared=shared, budgets=budgets)

    train, val = member((True, True)), member((True, True), memory=300 * MiB)
    own = member((False, False), memory=200 * MiB)
    assert val.memory_budget == 100 * MiB  # the first member's default: one budget, not one each
    train.used_cpu, train.used_uss = 1.5, 60 * MiB
    assert val.budgets_left() == (0.5, 40 * MiB, 2)
    assert own.budgets_left() == (2.0, 200 * MiB, 1)
    # 1.5 CPUs taken by the training loader: the validation loader, computing, does not grow
    assert val.decide(measures(count=2, cpu=0.4, idle=1.0)) is None
    assert own.decide(measures(count=2, cpu=0.4, idle=1.0)) == 4
    # ... and shrinks when the two together run over the budget
    assert val.decide(measures(count=2, cpu=1.0, idle=0.0)) == 1
    assert val.changes[-1]["why"].startswith("shrank, over the CPU budget (shared by 2 loaders)")
    train.workers_stopped()  # its workers gone: the room is the validation loader's again
    assert val.budgets_left() == (2.0, 100 * MiB, 2)


def test_four_auto_loaders_built_together_share_one_memory_budget() -> None:
    loaders = [DataLoader(np.arange(64), batch_size=4, num_workers="auto", cpu_budget=1) for _ in range(4)]
    try:
        budgets = {loader.stats()["workers"]["memory_budget"] for loader in loaders}
        for loader in loaders:
            assert len(list(loader)) == 16
        shared_by = [loader.stats()["workers"]["budgets_shared_by"] for loader in loaders]
    finally:
        for loader in loaders:
            loader.close()
    assert len(budgets) == 1  # one budget for the four, not half the memory each
    assert min(shared_by) >= 4
