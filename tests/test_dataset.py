"""Datasets: Gluon's transform API."""
from __future__ import annotations

import numpy as np
import pytest

from gloader import ArrayDataset, DataLoader, Dataset, IterableDataset, SimpleDataset


def test_transform_applies_to_whole_sample_and_unpacks_tuples() -> None:
    ds = ArrayDataset(np.arange(4), np.arange(4) * 10)
    assert ds.transform(lambda x, y: x + y)[2] == 22
    assert SimpleDataset([1, 2]).transform(lambda x: -x)[1] == -2


def test_transform_first_touches_only_the_first_field() -> None:
    ds = ArrayDataset(np.arange(4), np.arange(4) * 10).transform_first(lambda x: x * 100)
    assert ds[3] == (300, 30)
    assert SimpleDataset([5]).transform_first(lambda x: x + 1)[0] == 6


def test_eager_transform_runs_now() -> None:
    calls = []
    ds = SimpleDataset([1, 2, 3]).transform(lambda x: calls.append(x) or x * 2, lazy=False)
    assert calls == [1, 2, 3] and ds[2] == 6


def test_filter_shard_take_sample() -> None:
    ds = SimpleDataset(list(range(10)))
    assert list(ds.filter(lambda x: x % 2 == 0)) == [0, 2, 4, 6, 8]
    shards = [list(ds.shard(3, i)) for i in range(3)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert list(ds.take(3)) == [0, 1, 2] and len(ds.take(None)) == 10 and len(ds.take(99)) == 10
    assert list(ds.sample([9, 0, 5])) == [9, 0, 5]


@pytest.mark.parametrize("call, match", [
    (lambda ds: ds.shard(0, 0), "num_shards must be an integer >= 1, got 0"),
    (lambda ds: ds.shard(2, 2), r"index must be an integer in \[0, 2\), got 2"),
    (lambda ds: ds.take(-1), "count must be an integer >= 0 or None, got -1"),
    (lambda ds: ds.transform(3), "fn must be callable, got 3"),
    (lambda ds: ds.sample(3), "sampler must be an iterable of indices.*got 3"),
])
def test_bad_dataset_arguments_name_the_value(call, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        call(SimpleDataset([1, 2, 3]))


def test_base_dataset_is_abstract() -> None:
    with pytest.raises(NotImplementedError):
        len(Dataset())


def test_a_subclass_missing_a_method_is_named_with_the_method() -> None:
    class Images(Dataset):
        pass

    class Lines(IterableDataset):
        pass

    with pytest.raises(NotImplementedError, match="Images must implement __len__"):
        len(Images())
    with pytest.raises(NotImplementedError, match="Images must implement __getitem__"):
        Images()[0]
    with pytest.raises(NotImplementedError, match="Lines must implement __iter__"):
        iter(Lines())


def test_a_length_that_is_not_an_integer_is_named_not_called_missing() -> None:
    class HalfLength:
        def __len__(self) -> float:
            return 2.5

        def __getitem__(self, idx: int) -> int:
            return idx

    with pytest.raises(TypeError, match=r"HalfLength.__len__\(\) returned 2.5, which is not a non-negative integer"):
        DataLoader(HalfLength())
