"""Records held once: SharedList and SharedDict, gloader's own datasets holding their lists of
Python objects that way in the workers, the payload pickled once (the standard pickler, large
buffers out of band), and the warning for a dataset's lists that every worker would copy."""
from __future__ import annotations

import pickle
import re
import warnings

import numpy as np
import pytest
import torch

import gloader
from gloader import DataLoader, SharedDict, SharedList, SimpleDataset
from gloader._caller.payload import build_payload
from gloader._wire.segment import SharedBuffers
from tests import _data

pytestmark = pytest.mark.timeout(120)


def test_a_shared_list_gives_back_the_records_it_was_given() -> None:
    records = [{"id": i, "tags": ["a", "b"][: i % 3], "score": i / 3} for i in range(1000)] + [None, "x", (1, 2.5)]
    held = SharedList(records)
    assert len(held) == len(records) and list(held) == records and held[-1] == (1, 2.5)
    assert held[10:13] == records[10:13] and held[np.int64(7)] == records[7]
    with pytest.raises(IndexError, match="index 1003 out of range for 1003 records"):
        held[1003]
    again = pickle.loads(pickle.dumps(held, protocol=5))
    assert list(again) == records
    with pytest.raises(TypeError, match="item 2 is function"):
        SharedList([1, 2, lambda: 3])


def test_a_shared_dict_finds_str_bytes_and_int_keys_and_says_what_it_takes() -> None:
    mapping = {**{f"key{i}": {"v": i} for i in range(500)}, b"raw": 1, 7: [7], -3: "minus"}
    held = SharedDict(mapping)
    assert len(held) == len(mapping) and held["key42"] == {"v": 42} and held[b"raw"] == 1 and held[-3] == "minus"
    assert "key499" in held and "key500" not in held and 3.5 not in held
    assert dict(held.items()) == mapping
    with pytest.raises(KeyError):
        held["nope"]
    with pytest.raises(TypeError, match="keys are str, bytes or int, got float"):
        SharedDict({1.5: 1})
    assert dict(pickle.loads(pickle.dumps(held, protocol=5)).items()) == mapping


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_gloaders_own_datasets_hold_their_records_once_in_the_workers_and_load_the_same_batches(
        start_method: str) -> None:
    records = [{"id": i, "name": f"n{i}"} for i in range(12_000)]
    data = SimpleDataset(records)
    expected = [batch["id"].tolist() for batch in DataLoader(data, batch_size=500, shuffle=True, seed=3)]
    with DataLoader(data, batch_size=500, shuffle=True, seed=3, num_workers=2, start_method=start_method) as loader:
        assert [batch["id"].tolist() for batch in loader] == expected
    with DataLoader(data.transform(_data.worker_store), batch_size=6000, num_workers=1,
                    start_method=start_method) as loader:
        assert {kind for batch in loader for kind in batch} == {"SharedList"}  # what the worker reads
    assert data._data is records  # the caller's dataset is left as it is
    numbers = gloader.ArrayDataset(list(range(12_000)), [float(i) for i in range(12_000)])
    with DataLoader(numbers, batch_size=4000, num_workers=1, start_method=start_method) as loader:
        first, second = next(iter(loader))
        assert first.tolist() == list(range(4000)) and second.dtype == torch.float64


def test_a_list_of_numbers_held_once_gives_workers_the_callers_items() -> None:
    numbers = [1, 2.5] + list(range(3, 12_000))  # an int first, a float after: one array would make both floats
    dataset = SimpleDataset(numbers).transform(repr)
    expected = [repr(x) for x in numbers[:8]]
    for workers in (0, 2):
        with DataLoader(dataset, batch_size=8, num_workers=workers, batchify_fn=list) as loader:
            assert next(iter(loader)) == expected


def test_a_change_to_a_simple_datasets_list_between_epochs_is_still_seen() -> None:
    records = [{"id": i} for i in range(12_000)]
    with DataLoader(SimpleDataset(records), batch_size=4000, num_workers=2) as loader:
        assert sum(len(b["id"]) for b in loader) == 12_000
        records.append({"id": -1})
        ids = torch.cat([b["id"] for b in loader]).tolist()
    assert len(ids) == 12_001 and ids[-1] == -1


def test_a_large_list_a_dataset_holds_is_named_once_with_its_memory_and_the_fix() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DataLoader(_data.ManyRecords(), batch_size=5000, num_workers=1) as loader:
            assert len(list(loader)) == 4
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 2
    assert re.match(r"ManyRecords\.records is a list of 20,000 Python objects \(about \d+ MB\).*"
                    r"records = gloader\.SharedList\(\.\.\.\)", said[0])
    assert said[1].startswith("ManyRecords.lookup is a dict of 20,000") and "gloader.SharedDict" in said[1]
    assert all(w.filename == __file__ for w in caught)  # said where the loop asked for the batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once a process; and never for records held once, threads or in-process
        for kwargs, data in (({"num_workers": 1}, _data.ManyRecords()), ({"num_workers": 1}, _data.ManyRecords(shared=True)),
                             ({"num_workers": 2, "thread_pool": True}, _data.ManyRecords(20_001)),
                             ({}, _data.ManyRecords(20_002))):
            with DataLoader(data, batch_size=5000, **kwargs) as loader:
                assert torch.cat(list(loader))[:, 1].tolist()[:3] == [0, 2, 4]


def test_a_dict_given_as_the_dataset_is_named_with_the_fix_for_a_dataset() -> None:
    records = {i: {"x": float(i)} for i in range(20_000)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with DataLoader(records, batch_size=4, num_workers=1, batchify_fn=len) as loader:
            assert next(iter(loader)) == 4
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and said[0].startswith("dict is a dict of 20,000 Python objects")
    assert "pass gloader.SharedDict(...) of it as the dataset" in said[0]


def test_a_spawned_workers_payload_is_pickled_once_with_its_large_buffers_out_of_band() -> None:
    dataset = gloader.ArrayDataset(np.ones((1 << 20,), dtype=np.float64), np.arange(1 << 20))
    payload = build_payload(dataset, None, None, 0, pickled=True)
    assert len(payload.parts) < 64 << 10  # 16 MB of arrays, not in the pickle
    assert isinstance(payload.buffers, SharedBuffers) and payload.buffers.nbytes == 16 << 20
    for_ray = build_payload(dataset, None, None, 0, pickled=True, shared=False)
    assert [b.nbytes for b in for_ray.buffers] == [8 << 20, 8 << 20]  # for Ray's object store, as arrays
    local = lambda x: x + 1  # noqa: E731 - a lambda: by value, with dill
    with DataLoader(dataset.transform_first(local), batch_size=4, num_workers=1, start_method="spawn") as loader:
        assert next(iter(loader))[0].tolist() == [2.0] * 4
