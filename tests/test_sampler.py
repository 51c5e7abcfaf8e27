"""Samplers: Gluon's semantics, checked as properties over many sizes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gloader.sampler import (
    BatchSampler,
    DistributedSampler,
    FilterSampler,
    IntervalSampler,
    RandomSampler,
    SequentialSampler,
)

sizes = st.integers(min_value=0, max_value=200)
batch_sizes = st.integers(min_value=1, max_value=50)


@given(sizes, st.integers(min_value=0, max_value=2**31))
def test_seeded_shuffle_is_a_permutation_that_changes_per_epoch_and_repeats_per_seed(length: int, seed: int) -> None:
    a, b = RandomSampler(length, seed), RandomSampler(length, seed)
    first, second = list(a), list(a)
    assert sorted(first) == list(range(length)) and sorted(second) == list(range(length))
    assert [list(b), list(b)] == [first, second]
    if length > 5:
        assert first != second


@given(sizes, batch_sizes)
def test_keep_yields_every_index_once_and_len_matches(length: int, batch_size: int) -> None:
    sampler = BatchSampler(SequentialSampler(length), batch_size, "keep")
    batches = list(sampler)
    assert [i for batch in batches for i in batch] == list(range(length))
    assert len(batches) == len(sampler)
    assert all(len(batch) == batch_size for batch in batches[:-1])


@given(sizes, batch_sizes)
def test_discard_drops_only_the_short_last_batch(length: int, batch_size: int) -> None:
    sampler = BatchSampler(SequentialSampler(length), batch_size, "discard")
    batches = list(sampler)
    assert len(batches) == len(sampler) == length // batch_size
    assert all(len(batch) == batch_size for batch in batches)


@given(st.integers(min_value=1, max_value=100), batch_sizes, st.integers(min_value=1, max_value=6))
def test_rollover_carries_remainder_into_next_epoch(length: int, batch_size: int, epochs: int) -> None:
    sampler = BatchSampler(SequentialSampler(length), batch_size, "rollover")
    stream = []
    for _ in range(epochs):
        expected_len = len(sampler)
        batches = list(sampler)
        assert len(batches) == expected_len
        assert all(len(batch) == batch_size for batch in batches)
        stream += [i for batch in batches for i in batch]
    # Across epochs, the indices form the concatenation of whole epochs, minus the tail still carried.
    whole = list(range(length)) * epochs
    assert stream == whole[:len(stream)]
    assert len(whole) - len(stream) < batch_size


def test_rollover_state_round_trips() -> None:
    sampler = BatchSampler(RandomSampler(10, seed=1), 4, "rollover")
    list(sampler)
    state = sampler.state_dict()
    expected = list(sampler)
    other = BatchSampler(RandomSampler(10, seed=99), 4, "rollover")
    other.load_state_dict(state)
    assert list(other) == expected


@given(sizes, st.integers(min_value=1, max_value=7), st.booleans())
def test_interval_sampler(length: int, interval: int, rollover: bool) -> None:
    sampler = IntervalSampler(length, interval, rollover)
    got = list(sampler)
    assert len(got) == len(sampler)
    if rollover:
        assert sorted(got) == list(range(length))
    else:
        assert got == list(range(0, length, interval))


def test_filter_sampler_keeps_matching_indices() -> None:
    assert list(FilterSampler(lambda x: x % 3 == 0, list(range(10)))) == [0, 3, 6, 9]


@settings(max_examples=50)
@given(st.integers(min_value=0, max_value=100), st.integers(min_value=1, max_value=5),
       st.sampled_from(["pad", "discard"]), st.integers(min_value=0, max_value=3))
def test_distributed_shards_are_disjoint_equal_and_cover(length: int, replicas: int, mode: str, epoch: int) -> None:
    shards = []
    for rank in range(replicas):
        sampler = DistributedSampler(length, replicas, rank, seed=5, last_batch=mode)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    assert len({len(shard) for shard in shards}) == 1
    flat = [i for shard in shards for i in shard]
    if mode == "pad":
        assert set(flat) == set(range(length)) and len(flat) - length < replicas
    else:
        assert len(set(flat)) == len(flat) and length - len(flat) < replicas


def test_distributed_shuffle_changes_with_epoch_and_matches_across_ranks() -> None:
    a, b = DistributedSampler(50, 2, 0), DistributedSampler(50, 2, 0)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b)
    b.set_epoch(2)
    assert list(a) != list(b)


@pytest.mark.parametrize("make, match", [
    (lambda: BatchSampler(SequentialSampler(3), 0), "batch_size must be >= 1, got 0"),
    (lambda: BatchSampler(SequentialSampler(3), 2, "drop"), "last_batch must be one of"),
    (lambda: IntervalSampler(3, 0), "interval must be >= 1, got 0"),
    (lambda: SequentialSampler(-1), "length must be >= 0, got -1"),
    (lambda: DistributedSampler(10, 2, 2), r"rank must be in \[0, 2\), got 2"),
    (lambda: DistributedSampler(10, 2, 0, last_batch="rollover"), "last_batch must be one of"),
    (lambda: DistributedSampler(10), "torch.distributed is not initialized"),
    (lambda: DistributedSampler(list(range(10)), 2, 0), r"length must be a non-negative integer.*pass len\(dataset\)"),
    (lambda: BatchSampler(3, 2), "sampler must be an iterable of sample keys.*got 3"),
])
def test_bad_sampler_arguments_name_the_value(make, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def _make_inner(kind: str, length: int):
    if kind == "random":
        return RandomSampler(length, seed=7)
    if kind == "sequential":
        return SequentialSampler(length, start=3)
    return DistributedSampler(length, num_replicas=3, rank=1, seed=7, last_batch="pad")


@given(sizes, batch_sizes, st.sampled_from(["keep", "discard", "rollover"]),
       st.sampled_from(["random", "sequential", "distributed"]))
@settings(max_examples=150)
def test_the_loaders_array_path_sends_the_same_batches_and_keeps_the_same_state(
        length: int, batch_size: int, last_batch: str, kind: str) -> None:
    """The schedule takes an epoch of this module's samplers as one index array; over three
    epochs (rollover carries keys across) it must encode exactly the keys iteration yields."""
    from gloader._sampling.schedule import encoded_batches
    from gloader._wire.protocol import encode_keys

    fast = BatchSampler(_make_inner(kind, length), batch_size, last_batch)
    slow = BatchSampler(_make_inner(kind, length), batch_size, last_batch)
    for _ in range(3):
        assert fast._index_batches() is not None
        assert list(encoded_batches(fast)) == [encode_keys(keys) for keys in slow]
        assert fast.state_dict() == slow.state_dict()


def test_samplers_of_other_kinds_keep_their_own_iteration() -> None:
    """A subclass that overrides `__iter__`, a carried-over batch of non-integer keys and
    indices beyond int64 are iterated, not taken as an array."""
    from gloader._sampling.schedule import encoded_batches
    from gloader._wire.protocol import decode_keys

    class Evens(RandomSampler):
        def __iter__(self):
            return iter(range(0, 2 * len(self), 2))

    assert BatchSampler(Evens(6), 4)._index_batches() is None
    assert [list(keys) for keys in BatchSampler(Evens(6), 4)] == [[0, 2, 4, 6], [8, 10]]
    carried = BatchSampler(SequentialSampler(5), 4, "rollover")
    carried.load_state_dict({"prev": ["a", "b"], "sampler": {}})
    assert carried._index_batches() is None
    assert list(encoded_batches(carried)) == [["a", "b", 0, 1]]
    assert carried.state_dict()["prev"] == [2, 3, 4]
    huge = BatchSampler(SequentialSampler(3, start=2**63 - 2), 2)
    assert huge._index_batches() is None
    assert [decode_keys(keys) for keys in encoded_batches(huge)] == [[2**63 - 2, 2**63 - 1], [2**63]]
