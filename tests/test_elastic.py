"""Elastic and self-checking state, weighted mixtures, token budgets: samplers of a global order
whose batches do not depend on the number of ranks or workers, and states that say what they
were made for. In-process checks first; then real runs: torchrun with gloo on 2 ranks, resumed
on 1 and on 4, and a Lightning DDP fit resumed on 1 rank."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import pytest
import torch

import gloader
from gloader import DataLoader
from gloader.sampler import (
    DistributedBatchSampler,
    RandomSampler,
    SequentialSampler,
    TokenBudgetBatchSampler,
    WeightedMixtureSampler,
)
from tests.conftest import run_group

pytestmark = pytest.mark.timeout(180)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Drawn(gloader.Dataset):
    """Sample i: (i, a draw of each process-wide generator): an augmentation's randomness."""

    def __init__(self, length: int = 50) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.rand(), torch.rand(()).item()], dtype=np.float64)


def _global_batches(replicas: int, workers: int, state: dict[str, Any] | None = None, stop: int | None = None,
                    **kwargs: Any) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
    """Two epochs of global batches on `replicas` loaders of a DistributedBatchSampler (each
    rank's batch in rank order), resumed from `state`; with `stop`, the ranks' states after
    that many and nothing more."""
    loaders = [DataLoader(Drawn(103), batch_sampler=DistributedBatchSampler(RandomSampler(103, seed=1),
                                                                            12 // replicas, replicas, rank, **kwargs),
                          num_workers=workers, seed=5) for rank in range(replicas)]
    try:
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        out: list[np.ndarray] = []
        for _ in range(2):
            iterators = [iter(loader) for loader in loaders]
            for parts in zip(*iterators):
                out.append(torch.cat(parts).numpy())
                if len(out) == stop:
                    return out, [loader.state_dict() for loader in loaders]
            assert all(next(it, None) is None for it in iterators)  # every rank ends with the others
        return out, []
    finally:
        for loader in loaders:
            loader.close()


def test_each_global_batch_is_the_ranks_slices_of_one_run_of_the_order() -> None:
    order = list(RandomSampler(30, seed=4))
    for last_batch, expected in (("pad", [*order, *order[:6]]), ("discard", order[:24]), ("keep", order)):
        ranks = [list(DistributedBatchSampler(RandomSampler(30, seed=4), 4, 3, rank, last_batch=last_batch))
                 for rank in range(3)]
        assert [len(r) for r in ranks] == [len(DistributedBatchSampler(30, 4, 3, rank, last_batch=last_batch, seed=4))
                                           for rank in range(3)]
        flat = [key for step in zip(*ranks) for batch in step for key in batch] if last_batch != "keep" else \
            [key for k in range(len(ranks[0])) for rank in ranks if k < len(rank) for key in rank[k]]
        assert flat == expected, last_batch
    keep = [list(DistributedBatchSampler(SequentialSampler(26), 4, 3, rank, last_batch="keep")) for rank in range(3)]
    assert [batches[-1] for batches in keep] == [[24], [25], [20, 21, 22, 23]]  # the last global batch: 24, 25 split
    for kwargs, error in (({"batch_size": 0}, "batch_size"), ({"rank": 3}, r"rank must be in \[0, 3\)"),
                          ({"last_batch": "rollover"}, "last_batch must be one of")):
        with pytest.raises(ValueError, match=error):
            DistributedBatchSampler(10, **{"batch_size": 2, "num_replicas": 3, "rank": 0, **kwargs})


@pytest.mark.parametrize("replicas, workers", [(1, 3), (4, 1), (3, 0)])
def test_a_state_of_2_ranks_resumes_on_another_number_with_the_uninterrupted_runs_batches(replicas: int,
                                                                                         workers: int) -> None:
    """Samples and their random draws, bit for bit: a sample is seeded from its place in the
    epoch's order, not from the rank, worker or batch it lands in."""
    full, _ = _global_batches(2, 2)
    _, states = _global_batches(2, 2, stop=5)
    assert states[0] == states[1]  # the state of all ranks is one small object
    resumed, _ = _global_batches(replicas, workers, state=states[0])
    assert len(resumed) == len(full) - 5 and all(np.array_equal(a, b) for a, b in zip(resumed, full[5:]))


def test_a_state_says_what_it_was_made_for_and_refuses_a_loader_it_does_not_fit() -> None:
    with DataLoader(np.arange(100), batch_size=8, shuffle=True, seed=1) as made:
        it = iter(made)
        next(it)
        state = made.state_dict()
    assert state["made_for"]["batch_size"] == 8 and state["made_for"]["samples"] == 100
    for data, kwargs, says in ((np.arange(100), {"seed": 2}, r"seed 1 \(this loader's seed=2\)"),
                               (np.arange(120), {}, r"samples 100 \(this loader's: 120\)"),
                               (np.arange(100), {"batch_size": 16}, r"batch_size 8 \(this loader's: 16\)"),
                               (np.arange(100), {"shuffle": False}, "order 'RandomSampler'")):
        with DataLoader(data, **{"batch_size": 8, "shuffle": True, "seed": 1, **kwargs}) as other:
            with pytest.raises(ValueError, match=f"made for another loader: .*{says}"):
                other.load_state_dict(state)
    with DataLoader(np.arange(100), batch_size=8, shuffle=True) as seedless:  # seed=None: the state's is taken
        seedless.load_state_dict(state)
        with DataLoader(np.arange(100), batch_size=8, shuffle=True, seed=1) as again:
            assert [b.tolist() for b in seedless] == [b.tolist() for b in again][1:]
    _, states = _global_batches(2, 0, stop=3)
    with pytest.raises(ValueError, match=r"global_batch_size 12 \(this loader's: 16\)"):
        DataLoader(Drawn(103), batch_sampler=DistributedBatchSampler(RandomSampler(103, seed=1), 8, 2, 0)) \
            .load_state_dict(states[0])  # another global batch: refused, not regrouped


def test_a_mixture_draws_each_dataset_in_proportion_exactly_per_run_and_seeded_per_epoch() -> None:
    mixture = WeightedMixtureSampler([30, 50, 10], [0.5, 0.3, 0.2], num_samples=120, seed=2, exact_every=12)
    epochs = [list(mixture) for _ in range(2)]
    assert epochs[0] != epochs[1] and len(epochs[0]) == len(mixture) == 120
    sources = np.searchsorted([30, 80], epochs[0], side="right")
    assert all(np.bincount(sources[k:k + 12], minlength=3).tolist() == [6, 4, 2] for k in range(0, 120, 12))
    small = np.asarray(epochs[0])[sources == 2] - 80  # dataset 2 (10 samples) drawn 24 times: each twice
    assert np.bincount(small, minlength=10).tolist() == [2] * 10
    again = WeightedMixtureSampler([30, 50, 10], [5, 3, 2], num_samples=120, seed=2, exact_every=12)
    assert list(again) == epochs[0]  # weights are normalized
    free = np.searchsorted([30, 80], list(WeightedMixtureSampler([30, 50, 10], [0.5, 0.3, 0.2], 3000, seed=3)),
                           side="right")
    assert np.allclose(np.bincount(free) / 3000, [0.5, 0.3, 0.2], atol=0.04)
    for kwargs, error in (({"weights": [1, -1, 0]}, "weights must be 3 finite numbers"),
                          ({"datasets": []}, "one or more non-empty datasets")):
        with pytest.raises(ValueError, match=error):
            WeightedMixtureSampler(**{"datasets": [30, 50, 10], "weights": [1, 1, 1], **kwargs})


def test_token_budget_batches_stay_within_the_budget_and_every_rank_gets_as_many() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=500)
    ranks = [TokenBudgetBatchSampler(lengths, max_tokens=300, num_replicas=3, rank=rank, seed=1) for rank in range(3)]
    epochs = [[list(r) for r in ranks] for _ in range(2)]
    for batches in epochs:
        assert len({len(b) for b in batches}) == 1 and all(len(b) == len(ranks[0]) for b in batches)
        for rank_batches in batches:
            for batch in rank_batches:
                assert batch and len(batch) * max(lengths[batch]) <= 300 + max(lengths[batch])
        seen = {key for rank_batches in batches for batch in rank_batches for key in batch}
        assert seen == set(range(500))  # padding repeats some, none is missed
    assert epochs[0] != epochs[1]
    with pytest.raises(ValueError, match="max_tokens=50 is below the longest sample"):
        TokenBudgetBatchSampler(lengths, max_tokens=50, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="exactly one of max_tokens and batch_size"):
        TokenBudgetBatchSampler(lengths, num_replicas=1, rank=0)
    bucketed = list(TokenBudgetBatchSampler(lengths, batch_size=8, num_replicas=1, rank=0, window=64))
    assert all(len(batch) == 8 for batch in bucketed)


def test_a_token_budget_samplers_length_follows_a_loaded_seed() -> None:
    lengths = np.random.default_rng(0).integers(1, 60, size=500)
    budget = TokenBudgetBatchSampler(lengths, max_tokens=300, num_replicas=1, rank=0, seed=0, window=16)
    counts = {len(budget)}
    for seed in range(1, 20):  # epoch 0 of other seeds: their cuts make other batch counts
        budget.load_state_dict({"seed": seed, "epoch": 0})
        state = budget.state_dict()
        counts.add(len(budget))
        assert len(budget) == len(list(budget))  # what len() said is what the epoch yields
        budget.load_state_dict(state)
    assert len(counts) > 1


def test_thread_workers_give_placed_samples_their_place_in_get_worker_info() -> None:
    """Threads share the process-wide generators: with a placed sampler, a sample's seed and rng
    in `get_worker_info()` are its own, the same for any thread count."""

    class InfoDraws(gloader.Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> np.ndarray:
            return np.array([i, gloader.get_worker_info().rng.random()])

    runs = []
    for workers in (1, 3):
        sampler = DistributedBatchSampler(RandomSampler(40, seed=2), 4, 1, 0)
        with DataLoader(InfoDraws(), batch_sampler=sampler, num_workers=workers, thread_pool=True, seed=1) as loader:
            runs.append(torch.cat(list(loader)).numpy())
    assert np.array_equal(runs[0], runs[1])


def _torchrun(replicas: int, *args: str) -> None:
    done = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(replicas),
                      "tests/trainer_scripts/elastic_ddp.py", *args], 150, cwd=_ROOT,
                     env={**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_training_on_2_ranks_resumes_on_1_and_on_4_with_every_global_batch_of_the_uninterrupted_run(tmp_path) -> None:
    """torchrun, gloo, a DDP model: 2 ranks x 2 workers train and save the loaders' state after
    5 steps; 1 rank x 3 workers and 4 ranks x 1 worker resume from it, for a plain sampler, a
    weighted mixture of 3 datasets and token-budget batches."""
    _torchrun(2, "2", str(tmp_path / "full.json"), "5")
    full = json.loads((tmp_path / "full.json").read_text())
    (tmp_path / "states.json").write_text(json.dumps(full["states"]))
    for replicas, workers in ((1, 3), (4, 1)):
        _torchrun(replicas, str(workers), str(tmp_path / "resumed.json"), "-", str(tmp_path / "states.json"))
        resumed = json.loads((tmp_path / "resumed.json").read_text())["batches"]
        for kind, batches in full["batches"].items():
            assert len(batches) > 10 and resumed[kind] == batches[5:], (kind, replicas)


def test_a_lightning_ddp_fit_stopped_mid_epoch_on_2_ranks_resumes_on_1_with_the_remaining_samples(tmp_path) -> None:
    pytest.importorskip("lightning")
    script = "tests/trainer_scripts/lightning_elastic.py"
    env = {**os.environ, "PYTHONPATH": _ROOT, "OMP_NUM_THREADS": "1"}
    for args in (["2", str(tmp_path / "full"), str(tmp_path / "ckpt"), "5"],
                 ["1", str(tmp_path / "resumed"), "--resume", str(tmp_path / "ckpt" / "step=5.ckpt")]):
        done = run_group([sys.executable, script, *args], 150, cwd=_ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"full.rank{rank}.json").read_text()) for rank in (0, 1)]
    full = {step: first + second for (step, first), (_, second) in zip(*ranks)}
    resumed = dict(json.loads((tmp_path / "resumed.rank0.json").read_text()))
    assert sorted(resumed) == [step for step in sorted(full) if step >= 5]
    assert all(resumed[step] == full[step] for step in resumed)  # samples and their random draws
