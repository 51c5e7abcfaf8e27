"""Pipeline visibility: stats() and the progress bar."""
from __future__ import annotations

import sys
import time
import warnings

import numpy as np
import pytest

from gloader import DataLoader
from tests import _data
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_stats_count_batches_and_split_time_per_epoch(mode: dict) -> None:
    with DataLoader(np.arange(64, dtype=np.float32), batch_size=8, **mode) as loader:
        assert loader.stats()["total"]["batches"] == 0
        for _ in range(2):
            list(loader)
        stats = loader.stats()
    assert list(stats["epochs"]) == [0, 1]
    for epoch in stats["epochs"].values():
        assert epoch["batches"] == 8 and epoch["wall_s"] > 0 and 0 <= epoch["wait_fraction"] <= 1.0 + 1e-6
        assert epoch["worker_fetch_s"] >= 0 and epoch["worker_batchify_s"] >= 0
    assert stats["total"]["batches"] == 16
    if mode["num_workers"] and not mode.get("thread_pool"):
        assert stats["shared_memory_bytes"] > 0


def test_stats_list_the_latest_epochs_and_count_all_in_the_total() -> None:
    """Code that starts an epoch per step (`next(iter(loader))`) made one entry a step, kept
    forever (~0.7 KB each); older epochs now count only in the total."""
    from gloader._caller.stats import _LISTED_EPOCHS

    with DataLoader(np.arange(64, dtype=np.float32), batch_size=8) as loader:
        list(loader)
        first = loader.stats()["epochs"][0]
        for _ in range(_LISTED_EPOCHS + 36):
            next(iter(loader))
        stats = loader.stats()
    assert list(stats["epochs"]) == list(range(37, _LISTED_EPOCHS + 37))
    assert stats["total"]["batches"] == 8 + _LISTED_EPOCHS + 36
    assert stats["total"]["wall_s"] >= first["wall_s"] + sum(e["wall_s"] for e in stats["epochs"].values())
    assert stats["total"]["worker_fetch_s"] >= first["worker_fetch_s"]


def test_stats_show_an_input_bound_loader() -> None:
    with DataLoader(_data.SlowEverySample(0.02, length=8), batch_size=2, num_workers=1) as slow:
        list(slow)
        stats = slow.stats()["total"]
    assert stats["wait_fraction"] > 0.5  # the caller did nothing but wait
    assert stats["worker_fetch_s"] >= 8 * 0.02 * 0.9


@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_stats_split_each_batch_into_the_hops_of_its_trip(mode: dict) -> None:
    from gloader._caller.stats import HOPS

    with DataLoader(_data.SlowEverySample(0.01, length=16), batch_size=2, **mode) as input_bound:
        list(input_bound)
        slow_data = input_bound.stats()["total"]
    with DataLoader(np.arange(64, dtype=np.float32), batch_size=8, **mode) as caller_bound:
        for _ in caller_bound:
            time.sleep(0.02)  # a training step far slower than loading
        slow_caller = caller_bound.stats()["total"]
    for stats in (slow_data, slow_caller):
        assert all(stats[hop] >= 0 for hop in HOPS)
    assert slow_data["worker_fetch_s"] >= 16 * 0.01 * 0.9
    assert slow_data["worker_fetch_s"] > slow_data["return_s"] + slow_data["handover_s"]
    if mode["num_workers"]:  # finished batches waited for the caller (in-process loads on demand)
        assert slow_caller["window_s"] > slow_caller["worker_fetch_s"] + slow_caller["worker_batchify_s"]


def test_stats_say_how_many_workers_of_what_kind_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    import gloader._caller.options

    monkeypatch.setattr(gloader._caller.options, "usable_cpus", lambda: 3)
    with DataLoader(np.arange(8), batch_size=4, num_workers="auto", memory_budget=2**30) as auto:
        assert auto.stats()["workers"] == {
            "count": 3, "kind": "processes", "chosen_by": "num_workers='auto': one per CPU of cpu_budget=3 to start",
            "most": 48, "cpu_budget": 3.0, "memory_budget": 2**30, "budgets_shared_by": 1, "changes": []}
    with DataLoader(np.arange(8), batch_size=4, num_workers=2, thread_pool=True) as threads, \
            DataLoader(np.arange(8), batch_size=4) as in_process, gloader.WorkerPool(2) as pool, \
            DataLoader(np.arange(8), batch_size=4, pool=pool) as shared:
        assert threads.stats()["workers"] == {"count": 2, "kind": "threads", "chosen_by": "num_workers as given"}
        assert in_process.stats()["workers"]["kind"] == "in-process"
        assert shared.stats()["workers"] == {"count": 2, "kind": "processes",
                                             "chosen_by": "the workers of the WorkerPool given as pool="}


def test_progress_bar_reports_batches_and_rate(capsys: pytest.CaptureFixture[str]) -> None:
    with DataLoader(np.arange(40), batch_size=4, num_workers=2, progress=True) as loader:
        list(loader)
    err = capsys.readouterr().err
    assert "epoch 0" in err and "10/10" in err and "batches/s" in err and "waited" in err and ", 2 workers" in err
    assert "\r" not in err and err.endswith("\n")  # captured stderr is no terminal: whole lines only


def test_stats_count_what_the_caller_got_while_the_pin_thread_runs_ahead() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # without CUDA pinning is a no-op; the thread still runs
        loader = DataLoader(np.arange(64), batch_size=4, num_workers=2, pin_memory=True)
    with loader:
        it = iter(loader)
        next(it), next(it)
        assert wait_until(it._pinner._queue.full, 10.0)  # the thread fetched batches the caller has not
        epoch = loader.stats()["epochs"][0]
    assert epoch["batches"] == 2 and 0 <= epoch["wait_fraction"] <= 1.0 + 1e-6


def test_progress_bar_redraws_in_place_on_a_terminal(capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with DataLoader(np.arange(40), batch_size=4, num_workers=2, progress=True) as loader:
        list(loader)
    err = capsys.readouterr().err
    assert err.startswith("\repoch 0") and err.endswith("\n") and err.count("\n") == 1 and "10/10" in err


def test_shared_memory_bytes_are_what_is_resident_and_the_mapped_capacity_is_beside_them() -> None:
    """Held batches each keep a slot mapped that was sized for a task of several batches: the
    mapping is far larger than what its written pages hold, and the figure users read for
    memory is the latter."""
    data = np.ones((200, 65536), dtype=np.float32)  # 256 KiB a sample, 1 MiB a batch
    with DataLoader(data, batch_size=4, num_workers=2) as loader:
        held = [batch for i, batch in enumerate(loader) if i % 4 == 0]
        stats = loader.stats()
        held_bytes = sum(batch.numel() * batch.element_size() for batch in held)
        assert held_bytes <= stats["shared_memory_bytes"] <= 1.5 * held_bytes + 16 * 2**20
        assert stats["shared_memory_capacity_bytes"] >= stats["shared_memory_bytes"]
        del held
