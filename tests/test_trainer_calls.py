"""The loader called in the orders real trainers call it: Lightning's probe iter() and
set_epoch() before each epoch, Accelerate's rebuild of a torch DataLoader from the loader's
attributes, distributed runs that inject their own sampler. Stand-ins make the trainers' calls
exactly; the trainers themselves were run by hand (see the migration guide)."""
from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as torch_data

from gloader import DataLoader
from gloader.sampler import DistributedSampler

pytestmark = pytest.mark.timeout(120)

_SAMPLES = 24
_BATCH = 4


def _samplers_of(loader: Any) -> list[Any]:
    """What Lightning's `_set_sampler_epoch` sets: loader.sampler and batch_sampler.sampler, once each."""
    found: dict[int, Any] = {}
    for candidate in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if candidate is not None:
            found[id(candidate)] = candidate
    return list(found.values())


def _set_epoch(loader: Any, epoch: int) -> None:
    for sampler in _samplers_of(loader):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def _model_order(kind: str, seed: int, epoch: int) -> list[int]:
    """The epoch's order as the sampler itself gives it, drawn fresh (no loader involved)."""
    if kind == "random":
        return np.random.default_rng([seed, epoch]).permutation(_SAMPLES).tolist()
    if kind == "distributed":
        sampler = DistributedSampler(_SAMPLES, num_replicas=2, rank=1, seed=seed)
    else:
        sampler = torch_data.DistributedSampler(range(_SAMPLES), num_replicas=2, rank=1, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def _build(kind: str, seed: int, workers: int) -> DataLoader:
    data = np.arange(_SAMPLES)
    if kind == "random":
        return DataLoader(data, batch_size=_BATCH, shuffle=True, seed=seed, num_workers=workers)
    if kind == "distributed":
        sampler: Any = DistributedSampler(_SAMPLES, num_replicas=2, rank=1, seed=seed)
    else:
        sampler = torch_data.DistributedSampler(range(_SAMPLES), num_replicas=2, rank=1, seed=seed)
    return DataLoader(data, batch_size=_BATCH, sampler=sampler, num_workers=workers, seed=seed)


def _calls(rng: random.Random) -> list[tuple[str, int]]:
    """A random trainer's sequence: probes, set_epoch() calls, full and half-read epochs."""
    ops = [("probe", 0)] if rng.random() < 0.7 else []
    for _ in range(rng.randint(4, 9)):
        op = rng.choice(["probe", "set", "set", "epoch", "epoch", "half"])
        ops.append((op, rng.randint(0, 4)))
    return ops + [("epoch", 0)]


def _replay(loader: DataLoader, kind: str, seed: int, ops: list[tuple[str, int]]) -> None:
    """Make the calls, checking every epoch's order against the sampler's own for the epoch it
    was set to (torch's samplers stay at the epoch set; gloader's RandomSampler counts on)."""
    epoch = 0
    for op, value in ops:
        if op == "probe":
            iter(loader)
        elif op == "set":
            _set_epoch(loader, value)
            epoch = value
        else:
            expected = _model_order(kind, seed, epoch)
            it = iter(loader)
            state = loader.state_dict()
            assert state["sampler"]["sampler"].get("epoch", epoch) == epoch, (ops, state)
            if op == "half":
                got = next(it).tolist()
                assert got == expected[:_BATCH], (ops, op)
                del it
            else:
                got = [int(i) for batch in it for i in batch]
                assert got == expected, (ops, op)
            if kind == "random":
                epoch += 1


@pytest.mark.parametrize("kind", ["random", "distributed", "torch-distributed"])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_any_order_of_probes_set_epoch_and_epochs_serves_the_samplers_order(kind: str, workers: int) -> None:
    rng = random.Random(f"{kind}-{workers}")
    for trial in range(4):
        ops = _calls(rng)
        with _build(kind, seed=trial, workers=workers) as loader:
            _replay(loader, kind, trial, ops)


@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_fit_trains_three_different_orders_and_checkpoints_name_the_epoch(workers: int) -> None:
    """Lightning's calls in a fit of 3 epochs: one probe iter() before fit, then set_epoch(e)
    and a full epoch, with a checkpoint (loader.state_dict()) taken mid-epoch."""
    with DataLoader(np.arange(_SAMPLES), batch_size=_BATCH, shuffle=True, seed=7, num_workers=workers) as loader:
        iter(loader)  # _check_dataloader_iterable
        orders, checkpoints = [], []
        for epoch in range(3):
            _set_epoch(loader, epoch)
            order = []
            for step, batch in enumerate(loader):
                order += batch.tolist()
                if step == 2:
                    checkpoints.append(loader.state_dict())
            orders.append(order)
    assert len({tuple(order) for order in orders}) == 3
    assert [c["sampler"]["sampler"]["epoch"] for c in checkpoints] == [0, 1, 2]
    assert [c["epoch"] for c in checkpoints] == [0, 1, 2]


def test_same_calls_give_bit_identical_batches_for_any_worker_count() -> None:
    """Random draws in the dataset follow the batch's seed: the probe does not shift them."""
    from tests._data import RandomAugmented  # noqa: PLC0415

    runs = []
    for workers in (0, 1, 2):
        with DataLoader(RandomAugmented(_SAMPLES), batch_size=_BATCH, shuffle=True, seed=3, num_workers=workers) as loader:
            iter(loader)
            epochs = []
            for epoch in range(2):
                _set_epoch(loader, epoch)
                epochs.append(torch.cat([features for features, _ in loader]))
            runs.append(epochs)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    assert not torch.equal(runs[0][0], runs[0][1])


def test_a_seedless_random_sampler_draws_its_seed_at_the_first_next() -> None:
    """torch's test_sampler_reproducibility: two iterators made first, then torch.manual_seed(0)
    before the first next() of each, give the same order."""
    from gloader.sampler import RandomSampler

    sampler = RandomSampler(20)
    first, second = iter(sampler), iter(sampler)
    torch.manual_seed(0)
    a = list(first)
    torch.manual_seed(0)
    b = list(second)
    assert a == b
    torch.manual_seed(1)
    assert list(sampler) != a


def test_warnings_stay_quiet() -> None:
    """No warning on the ordinary Lightning path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with DataLoader(np.arange(8), batch_size=4, shuffle=True, seed=1, num_workers=1) as loader:
            iter(loader)
            _set_epoch(loader, 0)
            assert len(list(loader)) == 2


# --- Accelerate: prepare() builds a torch DataLoader from the loader's attributes -------------

# The torch DataLoader arguments accelerate's prepare_data_loader reads with getattr (1.15).
_ACCELERATE_READS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                     "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers")


def _prepared_as_accelerate_does(loader: DataLoader) -> torch_data.DataLoader:
    kwargs = {name: getattr(loader, name) for name in _ACCELERATE_READS}
    if kwargs["num_workers"] == 0:
        kwargs["prefetch_factor"] = None  # torch refuses one without workers; accelerate's default is None
        kwargs["multiprocessing_context"] = None
    return torch_data.DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **kwargs)


def test_a_torch_loader_built_from_the_attributes_loads_with_num_workers_0_and_says_gloader_is_left(
        monkeypatch) -> None:
    from gloader._sampling import samplers as gloader_sampler

    monkeypatch.setattr(gloader_sampler, "_said_iterated_without_the_loader", False)
    with DataLoader(np.arange(16), batch_size=4, shuffle=True) as loader:
        assert loader.timeout == 0.0 and vars(loader)["timeout"] == 120.0  # torch's 0: nothing waits in-process
        rebuilt = _prepared_as_accelerate_does(loader)
        with pytest.warns(RuntimeWarning, match=r"iterated without the loader.*leave the loader out of prepare\(\)"):
            got = sorted(int(i) for batch in rebuilt for i in batch)
        assert got == list(range(16))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(list(rebuilt)) == 4  # said once



def test_a_seedless_shuffle_follows_torchs_generator_wherever_its_sampler_is_iterated(monkeypatch) -> None:
    from gloader._sampling import samplers as gloader_sampler

    monkeypatch.setattr(gloader_sampler, "_said_iterated_without_the_loader", True)  # said elsewhere

    def orders(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        with DataLoader(np.arange(16), batch_size=4, shuffle=True, num_workers=1) as loader:
            rebuilt = _prepared_as_accelerate_does(loader)
            return [[int(i) for batch in rebuilt for i in batch] for _ in range(2)]

    first, again, other = orders(1), orders(1), orders(2)
    assert first == again  # torch.manual_seed reproduces the run
    assert first[0] != first[1]  # every epoch its own order
    assert first != other  # another seed, other orders
