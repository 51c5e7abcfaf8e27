"""The DataLoader contract: every mode yields what the in-process loader yields, resumably."""
from __future__ import annotations

import copy
import gc
import pickle
import random
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import gloader
from gloader import ArrayDataset, DataLoader, SimpleDataset
from tests import _data
from tests.conftest import leaks, snapshot

pytestmark = pytest.mark.timeout(60)

START_METHODS = ["fork", "spawn", "forkserver"]


def assert_same_batch(got: Any, want: Any) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
        assert torch.equal(got, want), (got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_batch(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same_batch(got[key], want[key])
    else:
        assert got == want


def assert_loader_contract(dataset: Any, epochs: int = 2, resume_at: int = 2, **kwargs: Any) -> None:
    """`kwargs` (with workers) yields the in-process batches; state_dict resumes exactly."""
    inline_kwargs = {k: v for k, v in kwargs.items() if k not in ("num_workers", "thread_pool", "start_method")}
    with DataLoader(dataset, **inline_kwargs) as inline:
        expected = [[b for b in inline] for _ in range(epochs)]
    with DataLoader(dataset, **kwargs) as loader:
        for epoch in range(epochs):
            got = list(loader)
            assert len(got) == len(expected[epoch])
            for g, w in zip(got, expected[epoch]):
                assert_same_batch(g, w)
        # Resume: stop mid-epoch, continue in a fresh loader.
        it = iter(loader)
        for _ in range(resume_at):
            next(it)
        state = loader.state_dict()
        rest_expected = list(it) + list(loader)
    with DataLoader(dataset, **kwargs) as resumed:
        resumed.load_state_dict(state)
        rest = list(resumed) + list(resumed)
    assert len(rest) == len(rest_expected)
    for g, w in zip(rest, rest_expected):
        assert_same_batch(g, w)


MODES = [pytest.param({"thread_pool": True}, id="threads")] + [
    pytest.param({"start_method": m}, id=f"processes-{m}") for m in START_METHODS]


# The caller plans batches, and so last_batch, the same way whatever starts the workers: every
# mode with every last_batch under threads and fork, and under spawn and forkserver (each start
# ~1.5 s of interpreters importing torch) with 'rollover', the one that carries samples over.
_SLOW_STARTS = ("processes-spawn", "processes-forkserver")


@pytest.mark.parametrize("mode, last_batch", [
    pytest.param(mode.values[0], last_batch, id=f"{last_batch}-{mode.id}")
    for mode in MODES for last_batch in ("keep", "discard", "rollover")
    if mode.id not in _SLOW_STARTS or last_batch == "rollover"])
def test_workers_yield_the_inline_batches_and_resume(mode: dict, last_batch: str) -> None:
    # Thread workers share the global generators, so their draws cannot be reproducible;
    # they get a deterministic dataset (see test_worker_rng_is_reproducible_with_threads...).
    dataset = _data.Records() if mode.get("thread_pool") else _data.RandomAugmented(45)
    assert_loader_contract(dataset, batch_size=8, shuffle=True, seed=7,
                           last_batch=last_batch, num_workers=2, **mode)


def test_same_seed_gives_bit_identical_batches_for_any_num_workers() -> None:
    runs = []
    for workers in (0, 1, 2, 3):
        with DataLoader(_data.RandomAugmented(40), batch_size=6, shuffle=True, seed=3,
                        num_workers=workers) as loader:
            runs.append([list(loader) for _ in range(2)])
    for other in runs[1:]:
        assert_same_batch(other, runs[0])
    # And the two epochs differ (new permutation, new draws).
    assert not torch.equal(runs[0][0][0][1], runs[0][1][0][1])


def test_different_seeds_give_different_draws() -> None:
    with DataLoader(_data.RandomAugmented(12), batch_size=4, seed=1) as a, \
            DataLoader(_data.RandomAugmented(12), batch_size=4, seed=2) as b:
        assert not torch.equal(next(iter(a))[0], next(iter(b))[0])


def test_inline_seeding_leaves_the_callers_generators_untouched() -> None:
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    with DataLoader(_data.RandomAugmented(10), batch_size=4, seed=9, shuffle=True) as loader:
        list(loader)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected


@pytest.mark.parametrize("thread_pool", [False, True])
def test_worker_rng_is_reproducible_with_threads_and_processes(thread_pool: bool) -> None:
    results = []
    for workers in (1, 3):
        with DataLoader(_data.WorkerRngDataset(), batch_size=5, seed=11, num_workers=workers,
                        thread_pool=thread_pool) as loader:
            results.append(torch.cat(list(loader)))
    assert torch.equal(results[0], results[1])
    assert (results[0][:, 1] >= 0).all()  # get_worker_info() was set in every worker
    for batch in results[0].split(5):  # one generator per batch, its stream continuing from sample to sample
        assert len(set(batch[:, 1].tolist())) == 5


def test_get_worker_info_is_none_in_the_main_process() -> None:
    assert gloader.get_worker_info() is None
    with DataLoader(_data.WorkerRngDataset(), batch_size=5) as loader:
        assert (next(iter(loader))[:, 1] == -1).all()


def test_worker_init_fn_runs_once_per_worker_with_its_id() -> None:
    with DataLoader(_data.InitRecorder(), batch_size=2, num_workers=2, worker_init_fn=_data.record_init) as loader:
        rows = torch.cat([b for _ in range(2) for b in loader])
    by_pid = {}
    for worker_id, pid in rows.tolist():
        by_pid.setdefault(pid, set()).add(worker_id)
    assert all(len(ids) == 1 for ids in by_pid.values())
    assert {next(iter(ids)) for ids in by_pid.values()} <= {0, 1}
    assert len(by_pid) == 2 or set().union(*by_pid.values()) <= {0, 1}


def test_pool_is_created_once_and_reused_by_every_epoch() -> None:
    with DataLoader(np.arange(64), batch_size=8, num_workers=2) as loader:
        assert loader.worker_pids() == []
        list(loader)
        pids = loader.worker_pids()
        assert len(pids) == 2
        for _ in range(3):
            list(loader)
            assert loader.worker_pids() == pids


@pytest.mark.parametrize("thread_pool", [False, True])
def test_breaking_out_then_next_epoch_yields_the_whole_epoch(thread_pool: bool) -> None:
    with DataLoader(np.arange(50), batch_size=5, num_workers=2, thread_pool=thread_pool) as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        full = torch.cat(list(loader))
    assert full.tolist() == list(range(50))


@pytest.mark.parametrize("thread_pool", [False, True])
def test_interleaved_loaders_each_yield_only_their_own_data(thread_pool: bool) -> None:
    loaders = [DataLoader(_data.Tagged(tag, 30), batch_size=4, num_workers=2, thread_pool=thread_pool)
               for tag in (1, 2, 3)]
    try:
        for _ in range(2):
            iters = [iter(loader) for loader in loaders]
            seen: dict[int, list[int]] = {1: [], 2: [], 3: []}
            for _ in range(8):
                for tag, it in zip((1, 2, 3), iters):
                    batch = next(it, None)
                    if batch is not None:
                        assert (batch[:, 0] == tag).all()
                        seen[tag] += batch[:, 1].tolist()
            assert all(indices == list(range(30)) for indices in seen.values())
    finally:
        for loader in loaders:
            loader.close()


@pytest.mark.parametrize("num_workers, thread_pool", [(0, False), (2, False), (2, True)])
def test_worker_error_keeps_type_traceback_and_indices_and_loader_stays_usable(num_workers: int,
                                                                               thread_pool: bool) -> None:
    with DataLoader(_data.RaisesAt(13), batch_size=4, num_workers=num_workers, thread_pool=thread_pool) as loader:
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        with pytest.raises(_data.CustomLookupError, match="sample 13 is corrupt") as info:
            next(it)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "batch 3" in notes and "sample index 13" in notes
        if num_workers:
            assert "RaisesAt" in str(info.value.__cause__) or "__getitem__" in str(info.value.__cause__)
        rest = list(it)  # the next batch still works
        assert torch.cat(got + rest).flatten().tolist() == [i for i in range(40) if not 12 <= i < 16]
        assert torch.cat([b for b in loader if True] if False else list(_skip_errors(loader))).numel() == 36


def _skip_errors(loader: DataLoader) -> Any:
    it = iter(loader)
    while True:
        try:
            yield next(it)
        except StopIteration:
            return
        except _data.CustomLookupError:
            continue


def test_exception_that_cannot_be_rebuilt_still_arrives_with_its_message() -> None:
    with DataLoader(_data.RaisesUnrebuildable(), batch_size=4, num_workers=1) as loader:
        with pytest.raises(Exception, match="7: bad record") as info:
            next(iter(loader))
    assert type(info.value).__name__ in ("UnrebuildableError", "RuntimeError")


def test_len_counts_rollover_remainder() -> None:
    with DataLoader(np.arange(10), batch_size=4, last_batch="rollover") as loader:
        lengths = []
        for _ in range(4):
            lengths.append(len(loader))
            assert len(list(loader)) == lengths[-1]
    assert lengths == [2, 3, 2, 3]


def test_accepts_lists_arrays_tensors_and_torch_datasets() -> None:
    class TorchDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, idx: int) -> Any:
            return torch.tensor([idx, idx * 2])

    for data in (list(range(6)), np.arange(6), torch.arange(6), SimpleDataset(list(range(6)))):
        with DataLoader(data, batch_size=4) as loader:
            assert torch.cat(list(loader)).tolist() == list(range(6))
    with DataLoader(TorchDataset(), batch_size=3, num_workers=1) as loader:
        assert torch.cat(list(loader))[:, 1].tolist() == [0, 2, 4, 6, 8, 10]


def test_structured_samples_batch_the_same_in_workers_and_inline() -> None:
    assert_loader_contract(_data.Records(), batch_size=5, num_workers=2, resume_at=1)
    with DataLoader(_data.Records(), batch_size=5, num_workers=2) as loader:
        batch = next(iter(loader))
    assert batch["x"].dtype == torch.float32 and batch["x"].shape == (5, 2, 3)
    assert batch["label"].dtype == torch.int64 and batch["weight"].dtype == torch.float64
    assert batch["flag"].dtype == torch.bool and batch["name"] == [f"item{i}" for i in range(5)]
    assert batch["pair"][0].dtype == torch.int16 and batch["pair"][1].shape == (5, 2)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1, got 0"),
    ({"batch_size": 2.5}, TypeError, "batch_size must be a positive integer, got 2.5"),
    ({"batch_size": None, "last_batch": "discard"}, ValueError, "batch_size=None loads one sample at a time"),
    ({"batch_size": 2, "num_workers": -1}, ValueError, "num_workers must be a non-negative int or .auto., got -1"),
    ({"batch_size": 2, "num_workers": "many"}, TypeError, "num_workers must be a non-negative int or .auto., got .many."),
    ({"batch_size": 2, "prefetch": -2}, ValueError, "prefetch must be >= 0, got -2"),
    ({"batch_size": 2, "last_batch": "drop"}, ValueError, "last_batch must be one of .* got 'drop'"),
    ({"batch_size": 2, "shuffle": True, "sampler": [0, 1]}, ValueError, "shuffle=True excludes sampler"),
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError, "batch_sampler excludes batch_size"),
    ({"batch_sampler": [[0, 1]], "shuffle": True}, ValueError, "batch_sampler excludes shuffle"),
    ({"batch_sampler": [[0, 1]], "sampler": [0]}, ValueError, "batch_sampler excludes sampler"),
    ({"batch_sampler": [[0, 1]], "last_batch": "keep"}, ValueError, "batch_sampler excludes last_batch"),
    ({"batch_size": 2, "timeout": 0}, ValueError, r"timeout must be > 0 seconds and finite, got 0: every wait "
                                                  r"for a batch has a deadline \(torch's timeout=0 waits forever\)"),
    ({"batch_size": 2, "timeout": -1}, ValueError, "timeout must be > 0 seconds and finite, got -1"),
    ({"batch_size": 2, "timeout": float("inf")}, ValueError, "timeout must be > 0 seconds and finite, got inf"),
    ({"batch_size": 2, "timeout": float("nan")}, ValueError, "timeout must be > 0 seconds and finite, got nan"),
    ({"batch_size": 2, "start_method": "thread"}, ValueError, "start_method must be one of .* got 'thread'"),
    ({"batch_size": 2, "seed": "x"}, TypeError, "seed must be an integer or None, got 'x'"),
    ({"batch_size": 2, "worker_init_fn": 3}, TypeError, "worker_init_fn must be callable"),
    ({"batch_size": 2, "batchify_fn": 3}, TypeError, "batchify_fn must be callable"),
    ({"batch_size": 2, "device": "tpu"}, ValueError, "device"),
    # A string flag is truthy whatever it says: shuffle="False" would shuffle.
    ({"batch_size": 2, "shuffle": "False"}, TypeError, r"shuffle must be True or False \(or None\), got 'False' of type str"),
    ({"batch_size": 2, "pin_memory": "no"}, TypeError, "pin_memory must be True or False .* got 'no'"),
    ({"batch_size": 2, "drop_last": "yes"}, TypeError, "drop_last must be True or False .* got 'yes'"),
    ({"batch_size": 2, "thread_pool": 2}, TypeError, "thread_pool must be True or False, got 2 of type int"),
    ({"batch_size": 2, "in_order": "False"}, TypeError, "in_order must be True or False, got 'False'"),
])
def test_bad_arguments_raise_at_construction_naming_the_value(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        DataLoader(list(range(4)), **kwargs)


def test_flags_take_numpy_bools_and_zero_or_one_as_torch_code_and_config_files_pass_them() -> None:
    for shuffle, drop_last in ((np.True_, np.False_), (1, 0), (None, 1)):
        with DataLoader(list(range(5)), batch_size=2, shuffle=shuffle, drop_last=drop_last, seed=0) as loader:
            keys = torch.cat(list(loader)).tolist()
        assert (keys != sorted(keys)) == bool(shuffle) and len(keys) == (4 if drop_last else 5)
        assert loader.drop_last is bool(drop_last)


def test_dataset_without_len_is_rejected_by_map_style_sampler() -> None:
    class NoLen:
        def __getitem__(self, idx: int) -> int:
            return idx

    with pytest.raises(TypeError, match="NoLen has no __len__"):
        DataLoader(NoLen(), batch_size=2)
    with pytest.raises(TypeError, match="dataset must support __getitem__"):
        DataLoader(42, batch_size=2)


def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        DataLoader([1, 2], batch_size=1, device="cuda:0")


@pytest.mark.parametrize("mode", [{"start_method": "fork"}, {"start_method": "spawn"}, {"thread_pool": True}])
def test_close_and_with_release_everything(mode: dict) -> None:
    loader = DataLoader(np.arange(40), batch_size=4, num_workers=2, **mode)
    it = iter(loader)
    kept = next(it)
    loader.close()
    loader.close()  # idempotent
    assert kept.tolist() == [0, 1, 2, 3]  # a batch the caller holds survives close
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_garbage_collected_loader_shuts_down_with_a_resource_warning() -> None:
    loader = DataLoader(np.arange(40), batch_size=4, num_workers=2)
    next(iter(loader))
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        del loader
        gc.collect()


@pytest.mark.parametrize("what", ["loader", "pool"])
def test_a_dropped_loader_or_pool_stops_its_workers_even_where_warnings_are_errors(what: str) -> None:
    """Under `python -W error` (or pytest's filterwarnings = error) the ResourceWarning is an
    exception raised inside the finalizer; the workers must stop all the same."""
    before = snapshot()
    raised: list[type] = []
    hook, sys.unraisablehook = sys.unraisablehook, lambda info: raised.append(info.exc_type)
    try:
        dropped: Any = gloader.WorkerPool(2) if what == "pool" else DataLoader(np.arange(40), batch_size=4,
                                                                               num_workers=2)
        if what == "loader":
            next(iter(dropped))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            del dropped
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert raised == [ResourceWarning]
    assert not leaks(before)


@pytest.mark.parametrize("use", ["next(iter(loader))", "for loop"])
def test_a_loader_used_only_through_its_iterator_stops_its_workers_once_the_iterator_is_dropped(use: str) -> None:
    """`next(iter(DataLoader(...)))` and `for batch in DataLoader(...)` keep no reference to the
    loader, only to its iterator: the loader is collected before the first batch starts the
    workers. Those workers stopped only at exit; now they stop with the iterator."""
    before = snapshot()
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        if use == "for loop":
            seen = [batch.tolist() for batch in DataLoader(np.arange(12), batch_size=4, num_workers=2)]
        else:
            seen = [next(iter(DataLoader(np.arange(12), batch_size=4, num_workers=2))).tolist()]
        gc.collect()
    assert seen == ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] if use == "for loop" else [[0, 1, 2, 3]])
    assert not leaks(before)


def test_a_pin_thread_starts_no_workers_once_the_exit_hook_closed_the_loader() -> None:
    """The exit hook closes each loader's engine, not its iterator: a pin thread still fetching
    started a new pool during interpreter shutdown (a ResourceWarning at every exit)."""
    before = snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # without CUDA pinning is a no-op; the thread still runs
        loader = DataLoader(np.arange(40), batch_size=4, num_workers=2, pin_memory=True)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    loader._engine.close()  # what the exit hook does to every loader still open
    with pytest.raises(RuntimeError, match="this DataLoader is closed"):
        for _ in it:  # the batches the pin thread fetched ahead, then no new workers
            pass
    assert not leaks(before)
    loader.close()


def test_an_iterator_outliving_its_loader_keeps_the_workers_until_it_is_dropped() -> None:
    before = snapshot()
    it = iter(DataLoader(np.arange(12), batch_size=4, num_workers=2))
    gc.collect()  # the loader is gone; its iterator still loads the epoch
    assert [batch.tolist() for batch in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert len(snapshot()["children"] - before["children"]) == 2
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        del it
        gc.collect()
    assert not leaks(before)


def test_a_loader_inside_a_worker_process_says_its_workers_cannot_be_processes() -> None:
    with DataLoader(_data.NestedLoader(num_workers=2), batch_size=2, num_workers=1) as loader:
        with pytest.raises(RuntimeError, match=r"cannot start 2 worker processes from a daemonic process \(pid "
                                               r"\d+\), such as a gloader worker.*num_workers=0 or thread_pool=True"):
            next(iter(loader))
    for inner in ({"num_workers": 2, "thread_pool": True}, {"num_workers": 0}):  # what the message offers works
        with DataLoader(_data.NestedLoader(**inner), batch_size=2, num_workers=1) as loader:
            assert [batch.tolist() for batch in loader] == [[28, 29], [30, 31]]


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy, pickle.dumps], ids=["copy", "deepcopy", "pickle"])
def test_loaders_and_pools_refuse_to_be_copied_or_pickled_and_say_what_to_do(copier: Any) -> None:
    with gloader.WorkerPool(1) as pool, DataLoader(np.arange(8), batch_size=2, num_workers=1) as loader:
        assert next(iter(loader)).tolist() == [0, 1]
        with pytest.raises(TypeError, match="DataLoader cannot be pickled or copied.*make a new DataLoader"):
            copier(loader)
        with pytest.raises(TypeError, match="WorkerPool cannot be pickled or copied.*share the WorkerPool"):
            copier(pool)
        assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the original goes on


def test_a_loader_with_worker_processes_inside_a_thread_worker_loads_its_own_batches() -> None:
    """Its workers are forked from the thread worker's thread and inherit that thread's locals:
    they must still act as process workers of the inner loader."""
    with DataLoader(_data.NestedLoader(num_workers=2), batch_size=2, num_workers=2, thread_pool=True) as loader:
        assert [batch.tolist() for batch in loader] == [[28, 29], [30, 31]]


def test_unstarted_loader_is_collected_silently() -> None:
    loader = DataLoader(np.arange(4), batch_size=2, num_workers=2)
    del loader
    gc.collect()


def test_array_dataset_zips_and_single_array_gives_plain_items() -> None:
    ds = ArrayDataset(np.arange(5), torch.arange(5) * 10)
    assert ds[2][0] == 2 and ds[2][1].item() == 20
    assert ArrayDataset(np.arange(5))[3] == 3
    with pytest.raises(ValueError, match=r"same length, got lengths \[5, 4\]"):
        ArrayDataset(np.arange(5), np.arange(4))


def test_user_sampler_changed_between_epochs_is_honoured() -> None:
    from gloader.sampler import DistributedSampler

    sampler = DistributedSampler(40, num_replicas=2, rank=0, seed=1)
    with DataLoader(np.arange(40), batch_size=4, sampler=sampler, num_workers=2) as loader:
        epochs = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            epochs.append(torch.cat(list(loader)).tolist())
    for epoch, got in enumerate(epochs):
        sampler.set_epoch(epoch)
        assert got == list(sampler)
    assert epochs[0] != epochs[1]


def test_owned_shuffle_dispatches_next_epoch_before_it_is_asked_for() -> None:
    with DataLoader(np.arange(40), batch_size=4, shuffle=True, seed=3, num_workers=2) as loader:
        list(loader)
        assert loader.stats()["in_flight"] > 0  # the next epoch's first batches are already in flight
        second = torch.cat(list(loader)).tolist()
    with DataLoader(np.arange(40), batch_size=4, shuffle=True, seed=3) as inline:
        list(inline)
        assert second == torch.cat(list(inline)).tolist()


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_notebook_style_main_code_reaches_spawned_workers(start_method: str) -> None:
    """Code run with `python -c` has no file, like a notebook cell: its classes and lambdas
    (referring to module globals and to gloader itself) must travel to the workers by value."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import numpy as np, gloader
        OFFSET = 100
        class Cell(gloader.Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                info = gloader.get_worker_info()
                return np.array([i, -1 if info is None else info.id])
        ds = Cell().transform(lambda x: x + OFFSET)
        with gloader.DataLoader(ds, batch_size=4, num_workers=2, start_method={start_method!r}) as dl:
            rows = np.concatenate([b.numpy() for b in dl])
        assert rows[:, 0].tolist() == [100 + i for i in range(8)], rows
        assert (rows[:, 1] >= 100).all(), rows  # loaded in workers (id + OFFSET), not in-process
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_forked_workers_freeze_inherited_objects_out_of_their_collector() -> None:
    import gc

    gc.unfreeze()  # the suite's leak guard froze what this test started with; the workers' freeze is wanted
    with DataLoader(_data.FreezeCount(), batch_size=2, num_workers=1, start_method="fork") as loader:
        counts = torch.cat(list(loader)).flatten().tolist()
    assert all(count > 1000 for count in counts)  # the caller's objects, inherited by fork
    assert gc.get_freeze_count() == 0  # never in the caller's own process


def test_small_batches_travel_several_to_a_task_and_nothing_else_changes() -> None:
    data = np.arange(4000, dtype=np.float32).reshape(1000, 4)
    inline = DataLoader(data, batch_size=4, shuffle=True, seed=5)
    with DataLoader(data, batch_size=4, shuffle=True, seed=5, num_workers=2) as loader:
        for epoch in range(3):
            expected = list(inline)
            got = list(loader)
            assert len(got) == len(expected) == 250
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), epoch
        assert loader._engine.batches_per_task() > 1  # cheap 64-byte batches: grouped
    with DataLoader(data, batch_size=4, num_workers=2, thread_pool=True) as threads:
        list(threads)
        assert threads._engine.batches_per_task() == 1  # threads share the caller's memory: nothing to gain


def test_the_first_task_of_each_epoch_carries_one_batch_and_the_rest_whole_counts() -> None:
    """An epoch's first batch waits for one batch of work, not a whole task of them; the tasks
    after it are whole at once, so that no worker runs out of work at an epoch boundary."""
    with DataLoader(np.zeros((4000, 4), np.float32), batch_size=4, num_workers=2) as loader:
        list(loader)  # epoch 0 measures the batches: cheap and tiny, so later ones are grouped
        engine = loader._engine
        assert engine.batches_per_task() >= 8
        sent: list[tuple[int, int, int]] = []
        backend = engine.workers.backend
        submit = backend.submit

        def spy(args: tuple, on_ready: object) -> object:
            # (epoch, batches in the task, the whole count then: it follows the measured cost)
            sent.append((args[1], len(args[2]), engine.batches_per_task()))
            return submit(args, on_ready)

        backend.submit = spy
        for _ in range(3):
            assert len(list(loader)) == 1000
        del backend.submit, spy
    # Epoch 1 may have been dispatched in part before the spy, and epoch 3's end opened epoch 4.
    assert {epoch for epoch, _, _ in sent} >= {2, 3}
    for epoch in (2, 3):
        tasks = [(count, whole) for e, count, whole in sent if e == epoch]
        assert sum(count for count, _ in tasks) == 1000
        assert tasks[0][0] == 1, tasks
        assert all(count == whole for count, whole in tasks[1:-1]), tasks  # the epoch's last one: what is left
        assert 1 <= tasks[-1][0] <= tasks[-1][1], tasks


def test_large_batches_travel_one_to_a_task() -> None:
    with DataLoader(np.zeros((64, 65536), np.float32), batch_size=8, num_workers=2) as loader:  # 2 MiB batches
        for _ in range(2):
            list(loader)
        assert loader._engine.batches_per_task() == 1


def test_an_error_inside_a_grouped_task_is_raised_at_its_own_batch() -> None:
    with DataLoader(_data.RaisesAt(bad=330, length=400), batch_size=4, num_workers=2) as loader:
        with pytest.raises(_data.CustomLookupError):
            list(loader)  # epoch 0 measures the batches; later epochs group them
        it = iter(loader)
        got = []
        with pytest.raises(_data.CustomLookupError, match="sample 330 is corrupt"):
            for batch in it:
                got.append(batch)
        assert loader._engine.batches_per_task() > 1
        # every batch before the bad one arrived, in order, and the loader goes on after it
        assert [int(b[0, 0]) for b in got] == list(range(0, 328, 4))
        assert [int(b[0, 0]) for b in it] == list(range(332, 400, 4))


def _reversed_batch(samples: list[Any]) -> np.ndarray:
    return np.asarray(samples, dtype=np.float64)[::-1]  # a view with a negative stride


@pytest.mark.parametrize("workers", [{}, {"num_workers": 1, "thread_pool": True}, {"num_workers": 1}],
                         ids=["in-process", "threads", "processes"])
def test_a_batchify_fn_that_returns_a_reversed_view_gives_the_same_batches_everywhere(workers: dict[str, Any]) -> None:
    with DataLoader(list(range(6)), batch_size=3, batchify_fn=_reversed_batch, **workers) as loader:
        assert [batch.tolist() for batch in loader] == [[2.0, 1.0, 0.0], [5.0, 4.0, 3.0]]
