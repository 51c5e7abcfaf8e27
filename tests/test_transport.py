"""Shared-memory transport: every dtype and structure, lifetimes, reuse and release."""
from __future__ import annotations

import errno
import gc
import os
from typing import Any

import numpy as np
import pytest
import torch

from gloader import DataLoader, batchify
from gloader._transport import SegmentCache, SlotPool, pack_batch
from gloader.batchify import plan_batch
from tests import _data
from tests.conftest import shm_entries
from tests.test_loader import assert_same_batch

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def _round_trip(batchify_fn: Any, samples: list[Any], pool: SlotPool, cache: SegmentCache) -> Any:
    """Pack in this process as a worker would, rebuild as the caller does."""
    slot, capacity = pool.acquire()
    handle = pack_batch(plan_batch(batchify_fn, samples), slot, capacity, pool.prefix, cache)
    pool.settle(slot, handle)
    return pool.rebuild(handle)


@pytest.fixture
def slots():
    prefix = f"gltest{os.getpid()}_"
    pool, cache = SlotPool(prefix, max_spare=4), SegmentCache(8)
    yield pool, cache
    cache.close()
    pool.close()


CASES = {
    "dtypes": ([torch.arange(6).to(d).reshape(2, 3) for d in DTYPES], batchify.default_batchify_fn),
    "zero_d": ([np.float32(1.5), np.float32(2.5)], batchify.default_batchify_fn),
    "empty": ([np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)], batchify.default_batchify_fn),
    "non_contiguous": ([np.arange(12).reshape(3, 4)[:, ::2], np.arange(12).reshape(4, 3).T[:, :2]],
                       batchify.default_batchify_fn),
    "objects": ([("text", b"raw", None, {"k": [1, 2]}), ("more", b"x", None, {"k": [3, 4]})],
                batchify.default_batchify_fn),
    "pad": ([np.arange(3), np.arange(5)], batchify.Pad(ret_length=True)),
    "group": ([(1, np.ones(2)), (2, np.zeros(2))], batchify.Group(batchify.Stack(), batchify.Stack(dtype="float16"))),
    "dict": ([{"a": 1.0, "b": "s"}, {"a": 2.0, "b": "t"}], batchify.Dict(a=batchify.Stack(), b=batchify.List())),
    "user_fn": ([np.ones(3), np.ones(3)], _data.sum_batchify),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pack_and_rebuild_match_in_process_batchify(name: str, slots) -> None:
    samples, fn = CASES[name]
    if name == "dtypes":
        for tensor in samples:
            got = _round_trip(fn, [tensor, tensor + 1], *slots)
            assert_same_batch(got, fn([tensor, tensor + 1]))
        return
    expected = fn(samples)
    if isinstance(expected, np.ndarray):
        expected = torch.from_numpy(expected)
    assert_same_batch(_round_trip(fn, samples, *slots), expected)


def test_rebuilt_tensors_view_shared_memory_without_copying(slots) -> None:
    pool, cache = slots
    batch = _round_trip(batchify.default_batchify_fn, [np.ones(1000, np.float32)] * 4, pool, cache)
    base = batch.numpy().base
    while base is not None and not isinstance(base, np.ndarray):
        base = getattr(base, "base", None)
    assert pool.in_use_bytes() >= batch.numel() * 4
    # Writing through the tensor changes the mapped segment the pool owns.
    batch[0, 0] = 7.0
    name = next(iter(pool._maps))
    assert np.frombuffer(pool._maps[name], np.float32, count=1)[0] == 7.0


def test_slot_is_reused_only_after_the_last_view_dies(slots) -> None:
    pool, cache = slots
    first = _round_trip(batchify.default_batchify_fn, [np.full(256, 1.0)] * 4, pool, cache)
    second = _round_trip(batchify.default_batchify_fn, [np.full(256, 2.0)] * 4, pool, cache)
    assert pool.segments_created == 2  # first is alive: its slot was not handed out again
    row = first[1]  # a view keeps the whole slot alive
    del first
    gc.collect()
    third = _round_trip(batchify.default_batchify_fn, [np.full(256, 3.0)] * 4, pool, cache)
    assert pool.segments_created == 3 and (row == 1.0).all() and (second == 2.0).all()
    del row
    gc.collect()
    for value in range(4, 20):
        batch = _round_trip(batchify.default_batchify_fn, [np.full(256, float(value))] * 4, pool, cache)
        assert (batch == value).all()
        del batch
    assert pool.segments_created == 3  # steady state: no new segment
    assert (third == 3.0).all()


def test_growing_batches_replace_small_slots_and_surplus_is_unlinked(slots) -> None:
    pool, cache = slots
    held = [_round_trip(batchify.default_batchify_fn, [np.zeros(n)] * 2, pool, cache) for n in (10, 10, 10)]
    big = _round_trip(batchify.default_batchify_fn, [np.zeros(100_000)] * 2, pool, cache)
    assert big.shape == (2, 100_000)
    del held, big
    gc.collect()
    assert len(pool._free) <= 4


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_reuse_slots_in_steady_state_and_held_batches_survive(start_method: str) -> None:
    with DataLoader(np.arange(4096, dtype=np.float32).reshape(512, 8), batch_size=16, num_workers=2,
                    start_method=start_method) as loader:
        held = [next(iter(loader))]  # kept across epochs and after close
        snapshot = held[0].clone()
        list(loader)  # holds every batch of an epoch: many slots
        for _ in loader:  # the next epoch's first batches were dispatched while those were held
            pass
        slots = loader._engine.slots
        created = slots.segments_created
        for _ in range(3):
            for batch in loader:
                assert batch.shape == (16, 8)
        assert slots.segments_created == created  # no new segment per batch in steady state
        # window + the batch held above + the loop's batch + the one being handed over + 2 spares
        assert len(slots._maps) <= loader._options.prefetch + 5
        prefix = slots.prefix
    assert torch.equal(held[0], snapshot)
    assert shm_entries(prefix) == []


def test_nothing_is_left_in_shm_after_an_error_in_a_worker() -> None:
    with DataLoader(_data.RaisesAt(5), batch_size=4, num_workers=2) as loader:
        with pytest.raises(_data.CustomLookupError):
            list(loader)
        prefix = loader._engine.slots.prefix
    assert shm_entries(prefix) == []


def test_unpicklable_leaf_in_a_batch_travels_by_dill() -> None:
    class Local:  # defined in a function: the stdlib pickler cannot find it
        def __init__(self, v: int) -> None:
            self.v = v

    with DataLoader([0, 1, 2, 3], batch_size=2, num_workers=1, batchify_fn=lambda xs: [Local(x) for x in xs]) as dl:
        assert [[o.v for o in b] for b in dl] == [[0, 1], [2, 3]]


def test_small_dev_shm_warns_at_the_first_batch_naming_sizes_and_fix(monkeypatch) -> None:
    from gloader import _transport

    real = os.statvfs

    class Tiny:
        f_bavail, f_blocks, f_frsize = 16, 32, 4096  # 64 KiB free of 128 KiB

    monkeypatch.setattr(_transport.os, "statvfs", lambda path: Tiny() if path == "/dev/shm" else real(path))
    with DataLoader(np.zeros((64, 1024), np.float32), batch_size=16, num_workers=1) as loader:
        # RuntimeWarning: shown under Python's default filters, which hide ResourceWarnings
        with pytest.warns(RuntimeWarning, match=r"/dev/shm has 0 MiB free \(of 0 MiB\).*needs about .* MiB.*--shm-size"):
            next(iter(loader))


def test_worker_discards_only_its_own_segment_not_those_whose_names_extend_it() -> None:
    from gloader._fetch import SharedMemoryWriter

    base = f"gltest{os.getpid()}_w1_1"
    created = []
    try:
        for name in (base, base + "0", base + "1"):  # ..._1, ..._10, ..._11
            fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.close(fd)
            created.append(name)
        SharedMemoryWriter().discard((base, 4096, True, None))  # a handle of a segment the worker created
        assert sorted(shm_entries(f"gltest{os.getpid()}_w1_")) == [base + "0", base + "1"]
    finally:
        for name in created:
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def test_full_dev_shm_is_an_error_naming_its_size_and_the_fix(monkeypatch) -> None:
    from gloader import _transport

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_transport.os, "posix_fallocate", no_space)
    cache = SegmentCache(4)
    with pytest.raises(OSError, match=r"/dev/shm is full: a batch needs .* MiB free of .* MiB.*--shm-size"):
        cache.create(f"gltest{os.getpid()}_", 4096)
    assert shm_entries(f"gltest{os.getpid()}_") == []


def test_planted_files_of_another_user_never_make_cleanup_raise(monkeypatch) -> None:
    from gloader import _transport

    prefix = f"gltest{os.getpid()}_planted_"
    path = f"/dev/shm/{prefix}w1_1"
    with open(path, "wb"):
        pass
    try:
        other_user = os.getuid() + 1
        monkeypatch.setattr(_transport.os, "getuid", lambda: other_user)  # as if the file were another user's
        assert _transport.unlink_prefix(prefix) == 0 and os.path.exists(path)
    finally:
        os.unlink(path)


def test_worker_segment_names_have_a_random_part() -> None:
    cache = SegmentCache(4)
    prefix = f"gltest{os.getpid()}_names_"
    names = []
    try:
        for _ in range(2):
            names.append(cache.create(prefix, 4096)[0])
        suffixes = [name.rsplit("_", 1)[1] for name in names]
        assert all(len(s) == 8 for s in suffixes) and suffixes[0] != suffixes[1]
    finally:
        cache.close()
        for name in names:
            os.unlink(f"/dev/shm/{name}")


def test_a_batch_freed_while_the_slot_pool_holds_its_lock_does_not_deadlock() -> None:
    with DataLoader(np.zeros((8, 4), np.float32), batch_size=4, num_workers=1) as loader:
        batch = next(iter(loader))
        slots = loader._engine.slots
        with slots._lock:  # as if the collector ran inside acquire(): release() comes from this thread
            del batch
            gc.collect()
        assert slots.acquire()[0] is not None  # the slot came back
