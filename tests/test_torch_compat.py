"""Code written for torch's DataLoader (and Gluon's) runs on gloader: torch's keyword names,
attributes, unbatched mode, randomness, streams, resume lengths and warnings."""
from __future__ import annotations

import inspect
import multiprocessing
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import gloader
from gloader import DataLoader, WorkerPool
from gloader.sampler import DistributedSampler
from tests import _data


def test_torch_attributes_are_readable_and_those_that_decide_the_batches_read_only() -> None:
    data = np.arange(10)
    with DataLoader(data, batch_size=4, shuffle=True, drop_last=True, num_workers=2, prefetch_factor=3,
                    timeout=30) as loader:
        assert loader.dataset is data and loader.batch_size == 4 and loader.drop_last is True
        assert loader.num_workers == 2 and loader.prefetch_factor == 3 and loader.timeout == 30.0
        assert loader.pin_memory is False and loader.worker_init_fn is None and loader.generator is None
        assert loader.collate_fn is gloader.batchify.default_batchify_fn and loader.persistent_workers is False
        assert loader.batch_sampler.batch_size == 4 and loader.batch_sampler.sampler is loader.sampler
        assert len(loader) == 2
        for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset"):  # torch's test_invalid_assign_after_init
            for error in (AttributeError, ValueError):  # torch raises ValueError; Python's convention is AttributeError
                with pytest.raises(error, match=f"DataLoader.{name} cannot be set after the DataLoader is built"):
                    setattr(loader, name, {})
        for name in ("persistent_workers", "seed", "device", "thread_pool"):  # torch refuses the first; gloader's own
            with pytest.raises(AttributeError, match=f"DataLoader.{name} cannot be set"):
                setattr(loader, name, None)
        assert len(loader) == 2 and loader.batch_size == 4  # nothing changed


def test_attributes_torch_lets_code_set_load_from_the_next_iter() -> None:
    """Lightning's `seed_everything(workers=True)` sets `loader.worker_init_fn` on the loader it
    is given (its CLI does by default), and torch lets code set every attribute but the six that
    decide the batches. Each takes effect from the next iter(); the epoch in progress goes on
    with the settings it began with; a bad value fails at the assignment, naming it."""
    with DataLoader(_data.InitRecorder(), batch_size=8, num_workers=2, seed=3) as loader:
        it = iter(loader)
        first = next(it)
        assert (first[:, 0] == -1).all()  # no worker_init_fn yet
        before = set(loader.worker_pids())
        loader.worker_init_fn = _data.record_init
        assert loader.worker_init_fn is _data.record_init and vars(loader)["worker_init_fn"] is _data.record_init
        assert (next(it)[:, 0] == -1).all()  # the epoch in progress keeps its workers
        batches = list(loader)  # a new iter(): new workers, each ran worker_init_fn
        assert len(batches) == 4 and all(set(b[:, 0].tolist()) <= {0, 1} for b in batches)
        assert not before & set(loader.worker_pids())
        loader.collate_fn = _data.sum_batchify
        loader.timeout = 30
        loader.prefetch_factor = 1
        assert loader.timeout == 30.0 and loader.prefetch_factor == 1
        assert [b.shape for b in loader] == [(1, 2)] * 4
        loader.num_workers = 0
        assert [b.shape for b in loader] == [(1, 2)] * 4 and loader.worker_pids() == []
        for name, value, match in (("num_workers", -1, "num_workers must be"), ("timeout", 0, "timeout"),
                                   ("worker_init_fn", 3, "worker_init_fn must be callable"),
                                   ("prefetch_factor", 2, "prefetch_factor=2 needs worker processes")):
            with pytest.raises((TypeError, ValueError), match=match):
                setattr(loader, name, value)
        assert loader.num_workers == 0 and loader.collate_fn is _data.sum_batchify  # a refused value changes nothing


def test_a_seed_everything_fit_loads_the_same_batches_for_any_worker_count() -> None:
    """What Lightning's `seed_everything(s, workers=True)` leaves in place, in Lightning's order:
    the seed of torch's generator, then `loader.worker_init_fn = pl_worker_init_function`. Its
    per-worker seeding runs in each worker once; gloader seeds each batch from (seed, epoch, batch
    index) before loading it, so the draws in `__getitem__` are the same for any num_workers and
    follow the seed given to seed_everything (see the migration guide)."""
    def fit(workers: int, seed: int) -> list[list[float]]:
        torch.manual_seed(seed)
        with DataLoader(_data.RandomAugmented(), batch_size=4, shuffle=True, num_workers=workers) as loader:
            loader.worker_init_fn = _data.record_init
            return [x.flatten().tolist() for _ in range(2) for x, _ in loader]

    assert fit(2, 5) == fit(1, 5) != fit(2, 6)  # in-process loading without seed= draws from the caller's generators, as torch's


def test_set_epoch_on_loader_sampler_reaches_the_sampler_that_orders() -> None:
    with DataLoader(np.arange(12), batch_size=12, shuffle=True, seed=5) as loader:
        loader.sampler.set_epoch(3)
        third = next(iter(loader)).tolist()
    with DataLoader(np.arange(12), batch_size=12, shuffle=True, seed=5) as other:
        orders = [next(iter(other)).tolist() for _ in range(4)]
    assert third == orders[3] != orders[0]


def test_torch_keyword_names_work_and_a_clash_with_the_gluon_name_names_both() -> None:
    def first_only(samples: list[Any]) -> Any:
        return samples[0]

    context = multiprocessing.get_context("spawn")
    with DataLoader(list(range(5)), batch_size=2, collate_fn=first_only, drop_last=True, num_workers=1,
                    multiprocessing_context=context, persistent_workers=True,
                    in_order=False) as loader:
        assert list(loader) == [0, 2]
        assert loader.multiprocessing_context is context  # the object given, as torch keeps it
    with DataLoader(list(range(5)), batch_size=2, num_workers=1, multiprocessing_context="spawn") as loader:
        assert loader.multiprocessing_context.get_start_method() == "spawn"  # a context, as torch's
    for kwargs, match in (({"collate_fn": first_only, "batchify_fn": first_only}, "batchify_fn=.* and collate_fn="),
                          ({"drop_last": True, "last_batch": "keep"}, "last_batch='keep' and drop_last=True"),
                          ({"num_workers": 1, "prefetch": 2, "prefetch_factor": 2}, "prefetch=2 and prefetch_factor=2"),
                          ({"num_workers": 1, "start_method": "fork", "multiprocessing_context": "spawn"},
                           "start_method='fork' and multiprocessing_context='spawn'"),
                          ({"seed": 1, "generator": torch.Generator()}, "seed=1 and generator= both"),
                          ({"start_method": "spawn"}, "needs worker processes, but num_workers=0"),
                          ({"prefetch_factor": 2}, "prefetch_factor=2 needs worker processes"),
                          ({"persistent_workers": True}, "persistent_workers=True needs worker processes"),
                          ({"num_workers": 1, "multiprocessing_context": "threads"},
                           "multiprocessing_context must be one of .* got 'threads'")):
        with pytest.raises(ValueError, match=match):
            DataLoader(list(range(5)), **kwargs)


def test_batch_size_defaults_to_one_and_none_means_torchs_unbatched_mode() -> None:
    assert [b.tolist() for b in DataLoader(np.arange(3))] == [[0], [1], [2]]
    samples = [{"x": np.full(2, i, np.float32), "y": np.int64(i), "name": f"s{i}"} for i in range(3)]
    with DataLoader(samples, batch_size=None, num_workers=1) as loader:
        unbatched = list(loader)
    assert unbatched[2]["x"].tolist() == [2.0, 2.0] and unbatched[2]["y"].ndim == 0 and unbatched[2]["name"] == "s2"
    assert isinstance(unbatched[0]["x"], torch.Tensor) and isinstance(unbatched[0]["y"], torch.Tensor)
    loader = DataLoader(list(range(3)), batch_size=None, collate_fn=lambda sample: sample * 10)
    assert list(loader) == [0, 10, 20] and loader.batch_size is None and loader.batch_sampler is None


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_manual_seed_reproduces_shuffle_and_worker_draws_without_seed(workers: int) -> None:
    # In-process, as in torch, only torch's own draws follow torch.manual_seed; workers are
    # seeded per batch from a base seed drawn from torch, so all three generators follow it.
    columns = [2] if workers == 0 else [0, 1, 2]

    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with DataLoader(_data.RandomAugmented(20), batch_size=5, shuffle=True, num_workers=workers) as loader:
            return torch.cat([batch[0][:, columns] for batch in loader])

    first = run(0)
    assert torch.equal(first, run(0)) and not torch.equal(first, run(1))


def test_generator_seeds_the_loader_like_seed_does() -> None:
    orders = []
    for _ in range(2):
        with DataLoader(np.arange(16), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7),
                        num_workers=1) as loader:
            orders.append(next(iter(loader)).tolist())
    assert orders[0] == orders[1] != list(range(16))


@pytest.mark.parametrize("where", ["fork", "spawn", "forkserver", "shared pool"])
def test_worker_init_fn_configures_the_loading_dataset_with_seeded_generators(where: str) -> None:
    dataset = _data.InitDraws()
    if where == "shared pool":
        with WorkerPool(2, start_method="spawn") as pool, \
                DataLoader(dataset, batch_size=1, worker_init_fn=dataset.init, pool=pool) as loader:
            rows = torch.cat(list(loader))
    else:
        with DataLoader(dataset, batch_size=1, num_workers=2, start_method=where,
                        worker_init_fn=dataset.init) as loader:
            rows = torch.cat(list(loader))
    assert (rows[:, 3] == 1).all()  # init ran on this dataset, with torch.initial_seed() == the worker's seed
    draws = {tuple(row[:3].tolist()) for row in rows}
    assert len(draws) == len(set(rows[:, 4].tolist()))  # each worker (1 or 2 served) drew its own numbers


def test_torch_iterable_dataset_is_a_stream_in_a_fixed_worker_order_with_torchs_length() -> None:
    orders = []
    for _ in range(3):
        with DataLoader(_data.TorchShardedStream(14), batch_size=3, num_workers=2) as loader:
            orders.append([b.tolist() for b in loader])
    assert orders[0] == orders[1] == orders[2]
    assert orders[0][:3] == [[0, 2, 4], [1, 3, 5], [6, 8, 10]]  # shard 0, shard 1, shard 0, ...
    assert sorted(sum(orders[0], [])) == list(range(14))
    with DataLoader(_data.SizedTorchStream(14), batch_size=3) as sized, \
            DataLoader(_data.SizedTorchStream(14), batch_size=3, drop_last=True) as dropped:
        assert (len(sized), len(dropped)) == (5, 4)
    with pytest.raises(TypeError, match="has no length"):
        len(DataLoader(_data.TorchShardedStream(4), batch_size=2))
    with pytest.raises(ValueError, match="batch_sampler are not allowed"):
        DataLoader(_data.TorchShardedStream(4), batch_sampler=[[0, 1]])


def _datapipe(n: int, shuffled: bool) -> Any:
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(n))
    return (pipe.shuffle(buffer_size=n) if shuffled else pipe).sharding_filter()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datapipe_is_sharded_between_workers_and_shuffled_by_the_loader(workers: int) -> None:
    with DataLoader(_datapipe(40, shuffled=False), batch_size=4, num_workers=workers) as loader:
        assert sorted(torch.cat(list(loader)).tolist()) == list(range(40))  # each worker keeps its share only
    with DataLoader(_datapipe(40, shuffled=True), batch_size=None, num_workers=workers, shuffle=True) as loader:
        epochs = [list(loader), list(loader)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(40))  # one order split between the shards
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # a new order each epoch
    orders = []
    for _ in range(2):
        torch.manual_seed(7)
        with DataLoader(_datapipe(40, shuffled=True), batch_size=None, num_workers=workers, shuffle=True) as loader:
            orders.append([list(loader), list(loader)])
    assert orders[0] == orders[1]  # torch.manual_seed reproduces every epoch's order
    with pytest.raises(ValueError, match="shuffle=True is, for a torch IterDataPipe"):
        DataLoader(_data.TorchShardedStream(4), shuffle=True)
    with pytest.raises(ValueError, match="IterDataPipe allows one iterator at a time.*num_workers=2"):
        DataLoader(_datapipe(8, shuffled=False), num_workers=2, thread_pool=True)
    with DataLoader(_datapipe(8, shuffled=False), batch_size=4, num_workers=1, thread_pool=True) as one_thread:
        assert torch.cat(list(one_thread)).tolist() == list(range(8))


def test_the_iterators_workers_list_is_torchs_and_its_processes_end_with_code_0() -> None:
    import gc

    loader = DataLoader(_data.WhoLoads(), batch_size=2, num_workers=2)
    it = iter(loader)
    assert len(it._workers) == 2  # there from the start, as torch's are
    ids_and_pids = [row[:2] for row in torch.cat(list(it)).tolist()]  # (worker id, pid) of each sample
    workers = it._workers
    assert sorted(w.pid for w in workers) == sorted(loader.worker_pids())
    assert all(workers[worker_id].pid == pid for worker_id, pid in ids_and_pids)  # listed by worker id
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    with pytest.warns(ResourceWarning, match="garbage-collected without close"):
        del it, loader  # the workers go with the loader, as torch's go with the iterator
        gc.collect()
    for w in workers:
        w.join(10.0)
    assert [(w.is_alive(), w.exitcode) for w in workers] == [(False, 0), (False, 0)]  # after the pool closed them
    with DataLoader(np.arange(4), batch_size=2, num_workers=2, thread_pool=True) as threads:
        assert iter(threads)._workers == []
    with DataLoader(np.arange(4), batch_size=2, num_workers=2) as closing:
        it = iter(closing)
    assert it._workers == []  # closed: none, and none started


def test_torch_chain_and_sum_of_datasets_work() -> None:
    chained = torch.utils.data.ChainDataset([_data.TorchShardedStream(3), _data.TorchShardedStream(2)])
    assert torch.cat(list(DataLoader(chained, batch_size=2))).tolist() == [0, 1, 2, 0, 1]
    summed = torch.utils.data.TensorDataset(torch.arange(3)) + torch.utils.data.TensorDataset(torch.arange(3, 5))
    with DataLoader(summed, batch_size=5, num_workers=1) as loader:
        assert next(iter(loader))[0].tolist() == [0, 1, 2, 3, 4]


def test_len_after_resume_is_the_whole_epoch_and_iteration_yields_the_rest() -> None:
    with DataLoader(np.arange(20), batch_size=2, shuffle=True, seed=1, num_workers=2) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(4)]
        state = loader.state_dict()
    with DataLoader(np.arange(20), batch_size=2, shuffle=True, seed=1, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert len(resumed) == 10
        rest = list(resumed)
        assert len(rest) == 6 and len(resumed) == 10
    assert sorted(torch.cat(head + rest).tolist()) == list(range(20))


def test_an_iterator_dropped_before_its_first_batch_does_not_use_up_an_epoch() -> None:
    with DataLoader(np.arange(12), batch_size=4, shuffle=True, seed=2, num_workers=2) as probed:
        iter(probed)  # Lightning probes every loader like this
        epochs = [torch.cat(list(probed)).tolist() for _ in range(2)]
    with DataLoader(np.arange(12), batch_size=4, shuffle=True, seed=2) as plain:
        assert epochs == [torch.cat(list(plain)).tolist() for _ in range(2)]


def test_a_superseded_iterator_raises_instead_of_ending_silently() -> None:
    with DataLoader(np.arange(8), batch_size=2) as loader:
        first = iter(loader)
        next(first)
        second = iter(loader)
        with pytest.raises(RuntimeError, match="ended by a newer iter"):
            next(first)
        assert len(list(second)) == 4


def test_a_rank_that_loads_with_a_sampler_not_distributed_warns_once_where_it_iterates(monkeypatch: pytest.MonkeyPatch) -> None:
    from gloader._caller import options as _options

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(_options, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Built, but not loading: Lightning and Accelerate build the loader, then shard it elsewhere.
        unsharded = DataLoader(np.arange(8), batch_size=2)
        with DataLoader(np.arange(8), batch_size=2, sampler=DistributedSampler(8, num_replicas=2, rank=0)) as sharded:
            assert len(list(sharded)) == 2
    with pytest.warns(UserWarning, match="every rank loads the whole dataset.*DistributedSampler") as said:
        assert len(list(unsharded)) == 4  # this rank loads it all: said where it iterates
    assert said[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(unsharded)) == 4  # once per process
    unsharded.close()


def test_num_workers_far_above_the_cpus_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.warns(UserWarning, match=r"^This DataLoader will create 5 workers \(num_workers=5\), far above the 2 CPUs"):
        DataLoader(np.arange(8), batch_size=2, num_workers=5)


def test_timeouts_and_dead_workers_are_runtime_errors_too() -> None:
    assert issubclass(gloader.BatchTimeoutError, TimeoutError) and issubclass(gloader.BatchTimeoutError, RuntimeError)
    assert issubclass(gloader.WorkerExitedError, RuntimeError)
    loader = DataLoader(_data.Sleepy(slow=1, seconds=3.0), batch_size=2, num_workers=1, timeout=0.3)
    with loader, pytest.raises(RuntimeError, match=r"^DataLoader timed out after 0.3 seconds: .*took more than"):
        list(loader)


def test_generic_aliases_like_torch() -> None:
    loader: DataLoader[torch.Tensor] = DataLoader[torch.Tensor](np.arange(4), batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert gloader.Dataset[int] is not None and gloader.IterableDataset[int] is not None


def test_distributed_keep_shards_every_sample_exactly_once_without_padding() -> None:
    for length, replicas in ((10, 3), (2, 4), (9, 3)):
        shards = [list(DistributedSampler(length, num_replicas=replicas, rank=r, last_batch="keep"))
                  for r in range(replicas)]
        assert sorted(sum(shards, [])) == list(range(length))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        assert [len(DistributedSampler(length, num_replicas=replicas, rank=r, last_batch="keep"))
                for r in range(replicas)] == list(map(len, shards))


@pytest.mark.parametrize("workers", [0, 2])
def test_getitems_fetches_a_batch_in_one_call(workers: int) -> None:
    with DataLoader(_data.BatchedFetch(), batch_size=4, num_workers=workers) as loader:
        batches = list(loader)
    assert [b[:, 1].tolist() for b in batches] == [[4] * 4] * 3
    assert torch.cat([b[:, 0] for b in batches]).tolist() == list(range(12))


def test_random_module_unaffected_by_in_process_seeded_loading() -> None:
    random.seed(3)
    expected = random.random()
    random.seed(3)
    list(DataLoader(_data.RandomAugmented(4), batch_size=2, seed=1))
    assert random.random() == expected


class _Growing:
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> int:
        return idx


def test_a_growing_dataset_is_followed_by_the_loaders_own_sampler_as_by_torchs() -> None:
    """Both read the length every epoch, as torch's samplers do."""
    dataset = _Growing(4)
    own = DataLoader(dataset, batch_size=2, shuffle=True, seed=0)
    torchs = DataLoader(dataset, batch_size=2, sampler=torch.utils.data.RandomSampler(dataset))
    assert sorted(torch.cat(list(own)).tolist()) == sorted(torch.cat(list(torchs)).tolist()) == [0, 1, 2, 3]
    dataset.length = 6
    assert len(own) == 3 and sorted(torch.cat(list(own)).tolist()) == [0, 1, 2, 3, 4, 5]
    assert len(torchs) == 3 and sorted(torch.cat(list(torchs)).tolist()) == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", [{"num_workers": 2}, {"num_workers": 2, "thread_pool": True}],
                         ids=["processes", "threads"])
def test_in_order_false_lets_ready_batches_go_ahead_of_a_slow_one(mode: dict) -> None:
    """torch's meaning: batch 0's first sample is released only once the caller holds three
    other batches, which in sampler order it could never get (the loader would time out)."""
    dataset = _data.HeldBack(12, held=0)
    with DataLoader(dataset, batch_size=2, timeout=30, in_order=False, **mode) as loader:
        it = iter(loader)
        got = [next(it).tolist() for _ in range(3)]
        with pytest.raises(ValueError, match="epoch 0, which in_order=False served out of order"):
            loader.state_dict()
        dataset.release.set()
        got += [batch.tolist() for batch in it]
        assert loader.state_dict()["epoch"] == 1  # between epochs a position is exact again
        again = [batch.tolist() for batch in loader]  # released now: nothing waits, same batches
    assert [0, 1] not in got[:3]
    assert sorted(got) == sorted(again) == [[i, i + 1] for i in range(0, 12, 2)]


def test_in_order_false_lets_a_streams_ready_shard_go_ahead_of_a_slow_one() -> None:
    """torch's meaning for streams: shard 1 starts only once the caller holds two batches of
    shard 0; with the shards taking turns the caller would wait for shard 1 first."""
    dataset = _data.HeldBackStream(12, held=1)
    with DataLoader(dataset, batch_size=2, num_workers=2, timeout=30, in_order=False) as loader:
        it = iter(loader)
        got = [next(it).tolist() for _ in range(2)]
        dataset.release.set()
        got += [batch.tolist() for batch in it]
    assert got[:2] == [[0, 2], [4, 6]]
    assert sorted(sum(got, [])) == list(range(12)) and len(got) == 6


def _rebuild_with_sampler(loader: Any, sampler: Any) -> Any:
    """What Lightning does to put a DistributedSampler into a torch DataLoader it did not build
    (its unwrapped path): read the loader's instance attributes and __init__ signature, keep
    what differs from the defaults, swap the sampler in, and call the class again."""
    assert isinstance(loader, torch.utils.data.DataLoader)
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    params = dict(inspect.signature(loader.__init__).parameters)
    kwargs = {k: v for k, v in attrs.items() if k in params and (params[k].default is not v or k == "dataset")}
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not torch.utils.data.BatchSampler:
        batch_sampler = type(batch_sampler)(sampler, batch_size=batch_sampler.batch_size,
                                            drop_last=batch_sampler.drop_last)
        kwargs.update(sampler=None, shuffle=False, batch_sampler=batch_sampler, batch_size=1, drop_last=False)
    else:
        kwargs.update(sampler=sampler, shuffle=False, batch_sampler=None)
    return type(loader)(**kwargs)


def _is_shuffled(loader: Any) -> bool:
    """How Lightning decides whether the injected DistributedSampler shuffles."""
    batch_sampler = loader.batch_sampler
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return isinstance(sampler, torch.utils.data.RandomSampler)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_tool_rebuilds_the_loader_from_its_attributes_with_a_distributed_sampler_per_rank(shuffle: bool) -> None:
    data = np.arange(22)
    with DataLoader(data, batch_size=4, shuffle=shuffle, num_workers=2, seed=3, drop_last=True) as loader:
        assert isinstance(loader, torch.utils.data.DataLoader) and _is_shuffled(loader) is shuffle
        assert isinstance(loader.sampler, torch.utils.data.RandomSampler if shuffle
                          else torch.utils.data.SequentialSampler)
        whole = torch.cat(list(loader)).tolist()
    shards = []
    for rank in range(2):
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=shuffle, seed=0)
        with _rebuild_with_sampler(loader, sampler) as rebuilt:
            assert type(rebuilt) is DataLoader and rebuilt.num_workers == 2 and rebuilt.seed == 3
            assert rebuilt.batch_sampler.sampler is sampler and rebuilt.batch_sampler.drop_last is True
            batches = [b.tolist() for b in rebuilt]
        assert [len(b) for b in batches] == [4, 4]  # 11 indices a rank, the short batch dropped
        assert [i for b in batches for i in b] == list(sampler)[:8]
        shards.append({i for b in batches for i in b})
    assert not shards[0] & shards[1] and len(whole) == 20


def test_samplers_are_torch_samplers_of_their_kind_and_batch_sampler_takes_drop_last() -> None:
    from gloader import sampler as gs

    assert isinstance(gs.SequentialSampler(3), torch.utils.data.SequentialSampler)
    assert isinstance(gs.RandomSampler(3, seed=1), torch.utils.data.RandomSampler)
    assert isinstance(gs.DistributedSampler(6, num_replicas=2, rank=0), torch.utils.data.DistributedSampler)
    assert isinstance(gs.FilterSampler(bool, [0, 1]), torch.utils.data.Sampler)
    random_sampler = gs.RandomSampler(5, seed=1)
    assert random_sampler.num_samples == 5 and random_sampler.replacement is False  # torch's attributes
    batches = gs.BatchSampler(gs.SequentialSampler(5), 2, drop_last=True)
    assert isinstance(batches, torch.utils.data.BatchSampler) and list(batches) == [[0, 1], [2, 3]]
    assert list(gs.BatchSampler(range(5), 2, drop_last=False)) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="last_batch='rollover' and drop_last=True are the same setting"):
        gs.BatchSampler(range(5), 2, "rollover", drop_last=True)
    with pytest.raises(TypeError, match="drop_last must be True or False"):
        gs.BatchSampler(range(5), 2, drop_last="yes")


def test_gloader_datasets_are_torch_datasets_so_they_add_and_chain() -> None:
    joined = gloader.SimpleDataset([0, 1, 2]) + gloader.SimpleDataset([3, 4])
    assert isinstance(joined, torch.utils.data.ConcatDataset)
    with DataLoader(joined, batch_size=2, num_workers=2) as loader:
        assert torch.cat(list(loader)).tolist() == [0, 1, 2, 3, 4]
    chained = _data.RangeStream(3) + _data.RangeStream(2)
    assert isinstance(chained, torch.utils.data.ChainDataset)
    with DataLoader(chained, batch_size=2) as loader:
        assert torch.cat(list(loader)).flatten().tolist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("samples", [[np.ones(2), np.ones(3)], [torch.ones(2), torch.ones(3)], [[1, 2], [1, 2, 3]]])
def test_samples_that_cannot_be_stacked_raise_what_torch_code_catches(num_workers: int, samples: list[Any]) -> None:
    with pytest.raises(RuntimeError):  # what torch's default_collate raises for them
        list(torch.utils.data.DataLoader(samples, batch_size=2))
    with DataLoader(samples, batch_size=2, num_workers=num_workers) as loader:
        for caught in (RuntimeError, ValueError):  # ValueError: what gloader raised before, kept
            with pytest.raises(caught, match="same length|different shapes") as info:
                list(loader)
            assert isinstance(info.value, gloader.batchify.UnequalSamplesError)


class _ReplayBuffer(torch.utils.data.Dataset):
    """A dataset that grows (or shrinks) between epochs, as a replay buffer or a filter does."""

    def __init__(self, size: int) -> None:
        self.items = list(range(size))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> int:
        return self.items[index]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_dataset_whose_length_changes_between_epochs_is_followed_as_torch_follows_it(num_workers: int,
                                                                                        shuffle: bool) -> None:
    def epochs(loader_class: Any) -> list[tuple[int, list[int]]]:
        buffer = _ReplayBuffer(6)
        loader = loader_class(buffer, batch_size=4, shuffle=shuffle, num_workers=num_workers)
        seen = []
        for size in (9, 12, 5, 8):
            seen.append((len(loader), sorted(torch.cat(list(loader)).tolist())))
            buffer.items[:] = range(size)  # in place, as a buffer grows
        if hasattr(loader, "close"):
            loader.close()
        return seen

    expected = epochs(torch.utils.data.DataLoader)
    assert [length for length, _ in expected] == [2, 3, 3, 2]  # torch's own, as the check of the stand-in
    assert epochs(DataLoader) == expected


def _draws_around_a_run(loader_class: Any, epochs: int, **kwargs: Any) -> tuple[torch.Tensor, list[float], list]:
    """A script's randomness around its loader: weights made after building it, one draw after
    each epoch, and the batches."""
    torch.manual_seed(0)
    loader = loader_class(np.arange(10), batch_size=4, **kwargs)
    weights = torch.nn.Linear(3, 3).weight.detach().clone()
    draws, batches = [], []
    for _ in range(epochs):
        batches.append([b.tolist() for b in loader])
        draws.append(torch.rand(1).item())
    if hasattr(loader, "close"):
        loader.close()
    return weights, draws, batches


@pytest.mark.parametrize("kwargs", [{"shuffle": True}, {"shuffle": False}, {"shuffle": True, "num_workers": 2},
                                    {"shuffle": True, "num_workers": 2, "persistent_workers": True},
                                    {"shuffle": True, "generator": "seeded"}],
                         ids=["shuffle", "sequential", "workers", "persistent", "generator"])
def test_the_loader_draws_from_torchs_generators_when_torchs_loader_does(kwargs: dict) -> None:
    """Nothing at construction, the same draws at iter(): a model built after the loader gets
    torch's weights, and every later draw of the script is torch's too."""
    def run(loader_class: Any) -> Any:
        options = dict(kwargs)
        if options.get("generator") == "seeded":
            options["generator"] = torch.Generator().manual_seed(3)
        return _draws_around_a_run(loader_class, 3, **options)

    torch_weights, torch_draws, _ = run(torch.utils.data.DataLoader)
    weights, draws, batches = run(DataLoader)
    assert torch.equal(weights, torch_weights) and draws == torch_draws
    assert run(DataLoader)[2] == batches  # and the same torch.manual_seed gives the same batches


def test_a_seedless_random_sampler_follows_torch_manual_seed_at_each_iteration() -> None:
    from gloader.sampler import RandomSampler

    def orders(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        sampler = RandomSampler(12)
        return [list(sampler) for _ in range(3)]

    first = orders(1)
    assert orders(1) == first and orders(2) != first and len({tuple(o) for o in first}) == 3
    sampler = RandomSampler(12)
    torch.manual_seed(5)
    one = list(sampler)
    torch.manual_seed(5)  # as torch's RandomSampler: the epoch's seed is drawn as it starts
    assert list(sampler) == one


def test_a_seedless_random_sampler_resumes_its_epoch_exactly() -> None:
    from gloader.sampler import RandomSampler

    with DataLoader(np.arange(20), batch_size=4, sampler=RandomSampler(20), num_workers=2) as loader:
        it = iter(loader)
        first = [next(it).tolist() for _ in range(2)]
        state = loader.state_dict()
        rest = [b.tolist() for b in it]
    torch.manual_seed(123)  # the global generator moved on: the saved state still names the epoch
    with DataLoader(np.arange(20), batch_size=4, sampler=RandomSampler(20), num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == rest
    assert sorted(sum(first + rest, [])) == list(range(20))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_before_iter_is_honoured_for_that_epoch_even_when_drawn_ahead(num_workers: int) -> None:
    """Lightning calls loader.sampler.set_epoch(e) before each epoch; so do torch's examples."""
    from gloader.sampler import RandomSampler

    def order(epoch: int) -> list[int]:
        sampler = RandomSampler(20, seed=3)
        sampler.set_epoch(epoch)
        return list(sampler)

    with DataLoader(np.arange(20), batch_size=4, shuffle=True, seed=3, num_workers=num_workers) as loader:
        for epoch in (0, 1, 2, 5, 5, 3):
            loader.sampler.set_epoch(epoch)
            assert loader.state_dict()["sampler"]["sampler"]["epoch"] == epoch  # and the state says so
            assert torch.cat(list(loader)).tolist() == order(epoch), f"set_epoch({epoch})"
        assert torch.cat(list(loader)).tolist() == order(4)  # without a call, the next epoch
