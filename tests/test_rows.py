"""Row-wise batching: large samples written into the slot as they are fetched make the batch
the default batchify makes, and anything else falls back to it with every sample intact."""
from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest
import torch

from gloader import DataLoader
from gloader._caller.slots import SlotPool
from gloader._worker.fetch import Cursor, _fetch_rest
from gloader._worker.rows import _MIN_ROW_BYTES, load_rows
from gloader._worker.slots import SlotMaps, SlotSpace
from gloader.batchify import default_batchify_fn

pytestmark = pytest.mark.timeout(60)

Pair = collections.namedtuple("Pair", "image label")
_SIDE = 48  # a 48x48x3 float32 image is 27 KB: above _MIN_ROW_BYTES
assert _SIDE * _SIDE * 3 * 4 >= _MIN_ROW_BYTES


def _image(i: int, dtype: Any = np.float32, side: int = _SIDE) -> np.ndarray:
    return (np.arange(side * side * 3, dtype=np.float64).reshape(side, side, 3) % 251 + i).astype(dtype)


SAMPLES = {
    "array": lambda i: _image(i),
    "tuple": lambda i: (_image(i), i),
    "namedtuple": lambda i: Pair(_image(i), i % 3 == 0),
    "list": lambda i: [_image(i, np.uint8), float(i) / 2, _image(i), i],
    "non_contiguous": lambda i: (_image(i).transpose(2, 0, 1), i),
}


def _load(make: Any, keys: list[int], slot: Any, maps: SlotMaps) -> tuple[Any, list[Any]]:
    """As a worker loads a batch: row by row, or the samples taken so far and then the rest."""
    handle, taken = load_rows(make, keys, SlotSpace(slot), maps, lambda key: None)
    return handle, (taken if handle is not None else _fetch_rest(make, keys, taken, Cursor()))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture
def slot_pool():
    pool, maps = SlotPool(max_spare=2, max_descriptors=4), SlotMaps(4)
    pool._sizes.note(8 * (_SIDE * _SIDE * 3 * 4 * 3 + 1024))  # room for a batch of 8 of the largest samples
    yield pool, maps
    maps.close()
    pool.close()


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_rows_written_as_fetched_make_the_default_batch(kind: str, slot_pool) -> None:
    pool, maps = slot_pool
    make = SAMPLES[kind]
    slot = pool.acquire()
    handle, rest = load_rows(make, list(range(8)), SlotSpace(slot), maps, lambda key: None)
    assert rest == [] and handle is not None  # written row by row
    assert _same(pool.rebuild(slot, handle), default_batchify_fn([make(i) for i in range(8)]))


@pytest.mark.parametrize("odd", [
    lambda i: (_image(i, side=_SIDE + 1), i),  # another shape
    lambda i: (_image(i, np.float64), i),  # another dtype: the default batchify casts it
    lambda i: (torch.from_numpy(_image(i)), i),  # another kind of array
    lambda i: [_image(i), i],  # another kind of sequence
    lambda i: (_image(i), i, 0),  # another length
], ids=["shape", "dtype", "tensor", "list", "length"])
def test_a_sample_that_differs_hands_every_sample_back_unchanged(odd, slot_pool) -> None:
    pool, maps = slot_pool

    def make(i: int) -> Any:
        return odd(i) if i == 5 else (_image(i), i)

    slot = pool.acquire()
    handle, samples = _load(make, list(range(8)), slot, maps)
    assert handle is None and samples is not None
    assert len(samples) == 8
    for i, sample in enumerate(samples):
        expected = make(i)
        assert type(sample) is type(expected)
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) and np.asarray(x).dtype == np.asarray(y).dtype
                   for x, y in zip(sample, expected))
    pool.give_back(slot, None)


@pytest.mark.parametrize("make", [lambda i: (np.zeros(16, np.float32), i), lambda i: ("text", _image(i)),
                                  lambda i: {"image": _image(i)}, lambda i: (_image(i).astype(object), i),
                                  lambda i: (_image(i).astype(">f4"), i)],
                         ids=["small", "string", "dict", "objects", "big-endian"])
def test_samples_it_does_not_take_are_fetched_for_the_usual_batching(make, slot_pool) -> None:
    pool, maps = slot_pool
    slot = pool.acquire()
    handle, samples = _load(make, list(range(4)), slot, maps)
    assert handle is None and samples is not None and len(samples) == 4
    pool.give_back(slot, None)


def test_a_failing_sample_is_named_and_raises_as_it_is(slot_pool) -> None:
    pool, maps = slot_pool
    named = []

    def make(i: int) -> Any:
        if i == 3:
            raise KeyError("sample 3 is corrupt")
        return (_image(i), i)

    slot = pool.acquire()
    with pytest.raises(KeyError, match="sample 3 is corrupt"):
        load_rows(make, [0, 1, 2, 3, 4], SlotSpace(slot), maps, named.append)
    assert named == [3]
    pool.give_back(slot, None)


class _Images:
    def __init__(self, odd_at: int | None = None, bad_label_at: int | None = None) -> None:
        self.odd_at, self.bad_label_at = odd_at, bad_label_at

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        image = _image(i, side=_SIDE + 2 if i == self.odd_at else _SIDE)
        return image, (None if i == self.bad_label_at else i)


def test_a_loader_of_large_samples_gives_the_default_batches() -> None:
    dataset = _Images()
    with DataLoader(dataset, batch_size=8, num_workers=2) as loader:
        for _ in range(2):
            got = list(loader)
            assert len(got) == 5
            for b, batch in enumerate(got):
                assert _same(batch, default_batchify_fn([dataset[i] for i in range(8 * b, 8 * b + 8)]))


@pytest.mark.parametrize("dataset, error, match", [
    (_Images(odd_at=13), ValueError, "different shapes.*Pad"),
    (_Images(bad_label_at=13), TypeError, r"cannot batch numbers together with \[None\]"),
], ids=["shape", "label"])
def test_a_loader_reports_a_bad_sample_as_the_default_batchify_does(dataset, error, match: str) -> None:
    with DataLoader(dataset, batch_size=8, num_workers=1) as loader:
        it = iter(loader)
        next(it)
        with pytest.raises(error, match=match):
            next(it)
        assert [len(batch[1]) for batch in it] == [8, 8, 8]  # the loader goes on


class _Growing:
    """Samples of batch b (of `per`): float32 values of their index, 1% more of them each batch
    from 16 KiB (row-wise batching's size), as variable-size images or audio grow."""

    def __init__(self, per: int) -> None:
        self.per = per

    def __len__(self) -> int:
        return 120 * self.per

    def __getitem__(self, idx: int) -> np.ndarray:
        return np.full(int(16384 * 1.01 ** (idx // self.per)) // 4, idx, np.float32)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_batch_larger_than_every_slot_before_it_travels_instead_of_failing(batch_size: int) -> None:
    """Each batch ~1% larger than the one before: past the slots' headroom it must travel in
    its handle (it raised "buffer is too small" after ~38 steps)."""
    dataset = _Growing(batch_size)
    with DataLoader(dataset, batch_size=batch_size, num_workers=2) as loader:
        batches = list(loader)
    assert len(batches) == 120
    for index, batch in enumerate(batches):
        keys = range(index * batch_size, (index + 1) * batch_size)
        assert torch.equal(batch, torch.from_numpy(np.stack([dataset[k] for k in keys])))
