"""IterableDataset: each worker iterates its own shard; every element once per epoch."""
from __future__ import annotations

import warnings

import pytest
import torch

from gloader import DataLoader
from tests import _data
from tests.conftest import take_all

pytestmark = pytest.mark.timeout(60)

MODES = [pytest.param({"num_workers": 0}, id="inline"),
         pytest.param({"num_workers": 2, "thread_pool": True}, id="threads"),
         pytest.param({"num_workers": 2, "start_method": "fork"}, id="fork"),
         pytest.param({"num_workers": 3, "start_method": "spawn"}, id="spawn")]


@pytest.mark.parametrize("mode", MODES)
def test_every_element_once_per_epoch_with_uneven_shards(mode: dict) -> None:
    with DataLoader(_data.RangeStream(23), batch_size=4, **mode) as loader:
        for _ in range(2):
            batches = list(loader)
            values = torch.cat(batches).flatten().tolist()
            assert sorted(values) == list(range(23))
            assert all(1 <= len(b) <= 4 for b in batches)


@pytest.mark.parametrize("mode", MODES[1:])
def test_discard_drops_each_shards_short_tail(mode: dict) -> None:
    with DataLoader(_data.RangeStream(23), batch_size=4, last_batch="discard", **mode) as loader:
        batches = list(loader)
    assert all(len(b) == 4 for b in batches)
    workers = mode["num_workers"]
    assert len(batches) == sum(len(range(w, 23, workers)) // 4 for w in range(workers))


@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}])
def test_error_in_a_stream_surfaces_like_map_style_and_the_rest_continues(mode: dict) -> None:
    with DataLoader(_data.RangeStream(40, bad=9), batch_size=2, **mode) as loader:
        got, errors = take_all(iter(loader), _data.CustomLookupError)  # in-process, the one stream ends with its error
        assert len(errors) == 1 and "record 9 is corrupt" in str(errors[0])
        values = set(torch.cat(got).flatten().tolist())
        assert 9 not in values
        if mode["num_workers"]:
            assert {i for i in range(40) if i % 2 == 0} <= values  # the other shard is complete
        # The next epoch starts fresh shards.
        with pytest.raises(_data.CustomLookupError):
            list(loader)


def test_stream_has_no_length_and_no_state() -> None:
    with DataLoader(_data.RangeStream(5), batch_size=2) as loader:
        with pytest.raises(TypeError, match="has no length"):
            len(loader)
        with pytest.raises(TypeError, match="has no\\s+positions"):
            loader.state_dict()
    with pytest.raises(ValueError, match="IterableDataset has no indices"):
        DataLoader(_data.RangeStream(5), batch_size=2, shuffle=True)


def test_failing_worker_init_fn_is_reported_with_its_type_for_streams() -> None:
    with DataLoader(_data.RangeStream(10), batch_size=2, num_workers=2, worker_init_fn=_data.failing_init) as loader:
        with pytest.raises(PermissionError, match="cannot open the database") as info:
            next(iter(loader))
    assert "worker_init_fn raised" in "\n".join(info.value.__notes__)


def test_a_stream_that_outruns_its_reported_length_warns_once_an_epoch_after_len_was_taken() -> None:
    """torch's rule: code that took len(loader) trusts it; with workers, the usual cause of
    more batches is an IterableDataset that every worker reads whole."""
    with DataLoader(_data.UnshardedSizedStream(6), batch_size=2, num_workers=2) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len([batch for batch in loader]) == 6  # each worker's 3; no len() taken (list() takes it)
        assert len(loader) == 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert len([batch for batch in loader]) == 6
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith("len(loader) was taken from len(dataset)=6, but 8 samples have been fetched. For "
                                  "multiprocessing data-loading, this usually means that each of the num_workers=2 "
                                  "workers iterates the whole dataset")
    assert messages[0].endswith("Seen at batch 4 of epoch 1.")
    # Streams that keep to their length never warn, though shards' short last batches can make
    # more batches than len(loader) (4 here: each worker's 3 samples in batches of 2).
    for mode in ({"num_workers": 0}, {"num_workers": 2}):
        dataset = _data.UnshardedSizedStream(6) if mode["num_workers"] == 0 else _data.SizedTorchStream(6)
        with DataLoader(dataset, batch_size=2, **mode) as loader, warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(loader) == 3
            for _ in range(2):
                assert sorted(torch.cat([batch for batch in loader]).tolist()) == list(range(6))
