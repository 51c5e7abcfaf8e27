"""Shared-memory transport: every dtype and structure, lifetimes, reuse and release."""
from __future__ import annotations

import errno
import gc
import mmap
import os
from typing import Any

import numpy as np
import pytest
import torch

from gloader import DataLoader, batchify
from gloader._caller.dropped import run_dropped
from gloader._caller.slots import SlotPool
from gloader._worker.slots import SlotMaps, SlotSpace, pack_batch
from gloader.batchify import plan_batch
from tests import _data
from tests.conftest import dev_shm_names, segment_sizes, wait_until
from tests.test_loader import assert_same_batch

pytestmark = pytest.mark.timeout(60)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]


def _round_trip(batchify_fn: Any, samples: list[Any], pool: SlotPool, maps: SlotMaps) -> Any:
    """Pack in this process as a worker would, rebuild as the caller does."""
    slot = pool.acquire()
    return pool.rebuild(slot, pack_batch(plan_batch(batchify_fn, samples), SlotSpace(slot), maps))


@pytest.fixture
def slots():
    pool, maps = SlotPool(max_spare=4, max_descriptors=8), SlotMaps(8)
    yield pool, maps
    maps.close()
    pool.close()


CASES = {
    "dtypes": ([torch.arange(6).to(d).reshape(2, 3) for d in DTYPES], batchify.default_batchify_fn),
    "zero_d": ([np.float32(1.5), np.float32(2.5)], batchify.default_batchify_fn),
    "empty": ([np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32)], batchify.default_batchify_fn),
    "empty_beside_data": ([(torch.zeros((0, 2), dtype=torch.bfloat16), np.zeros(0, np.float32), np.ones(3)),
                           (torch.zeros((0, 2), dtype=torch.bfloat16), np.zeros(0, np.float32), np.ones(3))],
                          batchify.default_batchify_fn),
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
            for _ in range(2):  # in a probe slot (size not known yet), then in a slot
                got = _round_trip(fn, [tensor, tensor + 1], *slots)
                assert_same_batch(got, fn([tensor, tensor + 1]))
        return
    expected = fn(samples)
    if isinstance(expected, np.ndarray):
        expected = torch.from_numpy(expected)
    for _ in range(2):
        assert_same_batch(_round_trip(fn, samples, *slots), expected)


def test_rebuilt_tensors_view_shared_memory_without_copying(slots) -> None:
    pool, maps = slots
    _round_trip(batchify.default_batchify_fn, [np.ones(1000, np.float32)] * 4, pool, maps)  # the size is known
    batch = _round_trip(batchify.default_batchify_fn, [np.ones(1000, np.float32)] * 4, pool, maps)
    base = batch.numpy().base
    while base is not None and not isinstance(base, np.ndarray):
        base = getattr(base, "base", None)
    assert pool.in_use_bytes() >= batch.numel() * 4
    # Writing through the tensor changes the mapped segment the pool owns.
    batch[0, 0] = 7.0
    taken = [slot for slot in pool._slots.values() if slot not in pool._free]
    assert np.frombuffer(taken[0].segment, np.float32, count=1, offset=64)[0] == 7.0  # after the 64-byte header


def test_slot_is_reused_only_after_the_last_view_dies(slots) -> None:
    pool, cache = slots
    _round_trip(batchify.default_batchify_fn, [np.full(256, 0.0)] * 4, pool, cache)  # the size is known
    probes = pool.segments_created  # the first batch went into a probe slot, retired since
    first = _round_trip(batchify.default_batchify_fn, [np.full(256, 1.0)] * 4, pool, cache)
    second = _round_trip(batchify.default_batchify_fn, [np.full(256, 2.0)] * 4, pool, cache)
    assert pool.segments_created == probes + 2  # first is alive: its slot was not handed out again
    row = first[1]  # a view keeps the whole slot alive
    del first
    gc.collect()
    third = _round_trip(batchify.default_batchify_fn, [np.full(256, 3.0)] * 4, pool, cache)
    assert pool.segments_created == probes + 3 and (row == 1.0).all() and (second == 2.0).all()
    del row
    gc.collect()
    for value in range(4, 20):
        batch = _round_trip(batchify.default_batchify_fn, [np.full(256, float(value))] * 4, pool, cache)
        assert (batch == value).all()
        del batch
    assert pool.segments_created == probes + 3  # steady state: no new segment
    assert (third == 3.0).all()


def test_slots_for_batches_far_smaller_than_a_page_are_reused(slots) -> None:
    # A slot is at least a page: batches of 64 bytes must not make it "oversized" and retired
    # as it comes back, which created and unmapped a segment for every batch.
    pool, maps = slots
    _round_trip(batchify.default_batchify_fn, [np.zeros(4, np.float32)] * 4, pool, maps)  # the probe
    gc.collect()
    for value in range(3):
        _round_trip(batchify.default_batchify_fn, [np.full(4, value, np.float32)] * 4, pool, maps)
    created = pool.segments_created
    for value in range(20):
        batch = _round_trip(batchify.default_batchify_fn, [np.full(4, value, np.float32)] * 4, pool, maps)
        assert (batch == value).all()
        del batch
    assert pool.segments_created == created


def test_growing_batches_replace_small_slots_and_surplus_is_retired(slots) -> None:
    pool, maps = slots
    held = [_round_trip(batchify.default_batchify_fn, [np.zeros(n)] * 2, pool, maps) for n in (10, 10, 10)]
    slot = pool.acquire()
    handle = pack_batch(plan_batch(batchify.default_batchify_fn, [np.zeros(100_000)] * 2), SlotSpace(slot), maps)
    assert handle[0] == 0 and isinstance(handle[4], bytearray)  # too big for the slot: it travels in the handle
    big = pool.rebuild(slot, handle)
    assert big.shape == (2, 100_000)
    del held, big
    gc.collect()
    assert len(pool._free) <= 4
    slot = pool.acquire()  # the caller now lends slots that fit, and retires the small ones
    assert slot[3] >= 2 * 100_000 * 8 and all(s.capacity >= 2 * 100_000 * 8 for s in pool._slots.values())
    pool.give_back(slot, None)


def test_a_registered_slot_is_registered_once_and_unregistered_while_still_mapped() -> None:
    import ctypes

    log: list[tuple[str, int, int]] = []

    def register(address: int, size: int) -> Any:
        log.append(("register", address, size))

        def unregister() -> None:  # reads the slot's header: a crash here if it were unmapped already
            log.append(("unregister", address, ctypes.c_uint64.from_address(address).value))

        return unregister

    pool, maps = SlotPool(max_spare=2, max_descriptors=8, register=register), SlotMaps(8)
    _round_trip(batchify.default_batchify_fn, [np.ones(256)] * 4, pool, maps)  # a probe slot: never registered
    gc.collect()
    assert log == []
    batches = [_round_trip(batchify.default_batchify_fn, [np.full(256, float(i))] * 4, pool, maps) for i in range(3)]
    tokens = {slot.token: len(slot.segment) for slot in pool._slots.values()}
    assert sorted(size for kind, _, size in log) == sorted(tokens.values()) and len(log) == 3
    del batches
    gc.collect()
    for i in range(6):  # reused slots are not registered again
        assert (_round_trip(batchify.default_batchify_fn, [np.full(256, float(i))] * 4, pool, maps) == i).all()
    assert [kind for kind, _, _ in log].count("register") == 3  # (a slot beyond max_spare was retired)
    maps.close()
    pool.close()
    gc.collect()
    run_dropped()  # unmapped outside the collector's callbacks (see _dropped), here at once
    unregistered = [(address, token) for kind, address, token in log if kind == "unregister"]
    assert sorted(address for address, _ in unregistered) == sorted(address for kind, address, _ in log
                                                                     if kind == "register")
    assert {token for _, token in unregistered} == set(tokens)


@pytest.mark.timeout(120)
def test_a_loop_that_stops_mid_epoch_reuses_its_slots_at_the_next_iter() -> None:
    """A break (limit_train_batches, a validation loop cut short) drops the window's batches
    in flight; the next iter() discards them and dispatches a window at once. The slots of the
    loop's working set come back to the pool and serve that window, instead of all but two
    being retired and made anew at each stop (26 to 30 new slots in the 12 stops here)."""
    data = np.zeros((256, 256, 1024), dtype=np.uint8)  # 1 MB batches of 4: one batch a task
    with DataLoader(data, batch_size=4, shuffle=True, num_workers=2, seed=0) as loader:
        def take_three_and_stop() -> None:
            it = iter(loader)  # discards the stopped epoch's batches in flight
            for task in loader._engine.tasks.discarded:  # as a validation pass would, let them end
                task.result.wait(30)
            for _ in range(3):
                next(it)

        for _ in range(3):  # settle
            take_three_and_stop()
        slots = loader._engine.workers.slots
        created = slots.segments_created
        for _ in range(12):
            take_three_and_stop()
        assert slots.segments_created - created <= loader._options.prefetch


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_reuse_slots_in_steady_state_and_held_batches_survive(start_method: str) -> None:
    with DataLoader(np.arange(4096, dtype=np.float32).reshape(512, 8), batch_size=16, num_workers=2,
                    start_method=start_method) as loader:
        held = [next(iter(loader))]  # kept across epochs and after close
        snapshot = held[0].clone()
        list(loader)  # holds every batch of an epoch: many slots
        for _ in range(2):  # settle: the next epoch's first batches were dispatched while those were held
            for batch in loader:  # the loop below holds its batch the same way
                assert batch.shape == (16, 8)
        slots = loader._engine.workers.slots
        created = slots.segments_created
        for _ in range(3):
            for batch in loader:
                assert batch.shape == (16, 8)
        # No new segment per batch in steady state (96 batches here). One more slot than before
        # may be made once, where a machine busy with other programs delays a release so that
        # the window needs a slot more for a moment.
        assert slots.segments_created - created <= 1
        # window + the batch held above + the loop's batch + the one being handed over + 2 spares
        assert len(slots._slots) <= loader._options.prefetch + 5
    assert torch.equal(held[0], snapshot)


def test_nothing_stays_mapped_after_an_error_in_a_worker() -> None:
    with DataLoader(_data.RaisesAt(5), batch_size=4, num_workers=2) as loader:
        with pytest.raises(_data.CustomLookupError):
            list(loader)
    gc.collect()
    assert wait_until(lambda: segment_sizes([os.getpid()]) == {}, 1.0)  # unmapped by _dropped's runner


def test_unpicklable_leaf_in_a_batch_travels_by_dill() -> None:
    class Local:  # defined in a function: the stdlib pickler cannot find it
        def __init__(self, v: int) -> None:
            self.v = v

    with DataLoader([0, 1, 2, 3], batch_size=2, num_workers=1, batchify_fn=lambda xs: [Local(x) for x in xs]) as dl:
        assert [[o.v for o in b] for b in dl] == [[0, 1], [2, 3]]


def test_segments_are_anonymous_never_names_in_dev_shm() -> None:
    names_before = dev_shm_names()
    with DataLoader(np.zeros((64, 1024), np.float32), batch_size=16, num_workers=2) as loader:
        list(loader)  # the first batches travel in their handles, until the caller knows their size
        held = list(loader)  # written into slots by the workers
        in_workers = segment_sizes(loader.worker_pids())
        assert in_workers and set(in_workers) <= set(segment_sizes([os.getpid()]))  # the caller's slots
        assert wait_until(lambda: not dev_shm_names() - names_before, 5.0), dev_shm_names() - names_before  # so /dev/shm's size does not limit batches
        assert all(size >= 16 * 1024 * 4 for size in in_workers.values())
        del held


def test_forked_workers_do_not_keep_another_loaders_slots() -> None:
    def slot_files(pids: list[int]) -> set[int]:
        """The inodes of the slot files the processes hold a descriptor of (a worker holds one of
        its own loader's for a moment while it maps a slot, as val's may for the epoch opened ahead)."""
        found = set()
        for pid in pids:
            for entry in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if "memfd:gloader" in os.readlink(f"/proc/{pid}/fd/{entry}"):
                        found.add(os.stat(f"/proc/{pid}/fd/{entry}").st_ino)
                except OSError:
                    pass
        return found

    with DataLoader(np.zeros((64, 1024), np.float32), batch_size=16, num_workers=1, start_method="fork") as train:
        held = list(train)  # train's slots exist (with their descriptors) when val forks its workers
        train_slots, train_files = set(segment_sizes([os.getpid()])), slot_files([os.getpid()])
        assert train_files
        with DataLoader(np.zeros((32, 8), np.float32), batch_size=8, num_workers=1, start_method="fork") as val:
            list(val)
            assert not train_files & slot_files(val.worker_pids())
            assert not train_slots & set(segment_sizes(val.worker_pids()))  # nor their mappings
        del held


def test_running_out_of_memory_is_an_error_naming_the_size_and_the_fix(monkeypatch) -> None:
    from gloader._caller import slots as _caller_slots

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    pool = SlotPool(max_spare=2, max_descriptors=4)
    pool.give_back(None, (0, 0, 4096, None, None))  # a batch of 4 KiB was seen
    monkeypatch.setattr(_caller_slots.os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match=r"could not reserve .* MiB of shared memory for a batch .*lower prefetch or "
                                      r"batch_size"):
        pool.acquire()
    assert pool.segments_created == 0  # and the leak guard checks that its descriptor was closed


def test_files_planted_in_dev_shm_are_never_touched() -> None:
    path = f"/dev/shm/gl{os.getpid()}_planted_w1_1"  # named as an older gloader named its segments
    with open(path, "wb") as planted:
        planted.write(b"x")
    try:
        with DataLoader(np.zeros((16, 4), np.float32), batch_size=4, num_workers=1) as loader:
            list(loader)
        with open(path, "rb") as planted:
            assert planted.read() == b"x"
    finally:
        os.unlink(path)


def test_a_slot_whose_token_does_not_match_is_refused(slots) -> None:
    pool, maps = slots
    pool.give_back(None, (0, 0, 4096, None, None))  # a batch of 4 KiB was seen
    pid, fd, token, capacity, lending = pool.acquire()
    assert token != 0 and pid == os.getpid()
    with pytest.raises(RuntimeError, match=r"is not the slot gloader's caller \(pid \d+\) lent"):
        maps.get((pid, fd, token ^ 2, capacity, lending))
    assert len(maps) == 0 and maps.get((pid, fd, token, capacity, lending)) is not None
    pool.give_back((pid, fd, token, capacity, lending), None)


def test_a_batch_freed_while_the_slot_pool_holds_its_lock_does_not_deadlock() -> None:
    # 1 MiB batches travel one to a task, one to a slot
    with DataLoader(np.zeros((64, 65536), np.float32), batch_size=4, num_workers=1, prefetch=1) as loader:
        it = iter(loader)
        next(it)  # travels in its handle: the caller learns the size
        batch = next(it)  # written into a slot
        slots = loader._engine.workers.slots
        free = len(slots._free)
        with slots._lock:  # as if the release ran inside acquire(): release() comes from this thread
            del batch
            gc.collect()
            run_dropped()
        assert len(slots._free) == free + 1  # the slot came back


def test_a_tasks_batches_share_one_slot_which_is_free_after_the_last_is_freed(slots) -> None:
    pool, maps = slots
    fn = batchify.default_batchify_fn
    _round_trip(fn, [np.zeros(100, np.float32)] * 4, pool, maps)  # the size is known
    slot = pool.acquire(3)
    space = SlotSpace(slot)
    handles = [pack_batch(plan_batch(fn, [np.full(100, float(i), np.float32)] * 4), space, maps) for i in range(3)]
    assert [h[0] for h in handles] == [slot[2]] * 3  # all three written into the one slot
    assert handles[0][1] == 0 and handles[1][1] >= handles[0][2] and handles[2][1] >= handles[1][1] + handles[1][2]
    too_many = pack_batch(plan_batch(fn, [np.zeros(100_000, np.float32)] * 4), space, maps)
    assert too_many[0] == 0 and isinstance(too_many[4], bytearray)  # what does not fit travels in the handle
    batches = [pool.rebuild(slot, handle) for handle in handles]
    assert all((batch == i).all() and batch.shape == (4, 100) for i, batch in enumerate(batches))
    free = len(pool._free)
    del batches[0], batches[0]
    gc.collect()
    run_dropped()
    assert len(pool._free) == free  # one batch still views the slot: it cannot be lent again
    del batches
    gc.collect()
    run_dropped()
    assert len(pool._free) == free + 1


def test_the_first_batches_go_into_probe_slots_that_use_only_the_pages_written(slots) -> None:
    pool, maps = slots
    slot = pool.acquire()  # no batch size known yet: a probe slot, not the handle
    assert slot is not None
    handle = pack_batch(plan_batch(batchify.default_batchify_fn, [np.ones(1000, np.float32)] * 4),
                        SlotSpace(slot), maps)
    assert handle[0] == slot[2] and handle[4] is None and len(maps) == 0  # written there; not kept mapped
    batch = pool.rebuild(slot, handle)
    assert (batch == 1.0).all() and pool.in_use_bytes() < 1 << 20  # 16 KB written of a large probe
    del batch
    gc.collect()
    run_dropped()
    assert pool._slots == {} and pool._free == []  # retired once its batch is back
    fresh = SlotPool(max_spare=2, max_descriptors=4)
    try:
        lent = [fresh.acquire() for _ in range(64)]  # no batch back yet: a few probes, then none
        assert 1 < sum(slot is not None for slot in lent) < 64 and lent[-1] is None
    finally:
        fresh.close()


def test_a_worker_writes_a_slot_it_maps_for_the_first_time_without_a_fault_per_page(slots) -> None:
    # Every worker meets every slot in circulation once; one fault per 4 KiB page made the
    # first write three times slower than the next (see _MADV_POPULATE_READ).
    resource = pytest.importorskip("resource")
    pool, first_writer = slots
    pool.give_back(None, (0, 0, 8 << 20, None, None))  # batches of 8 MiB were seen
    slot = pool.acquire()
    assert slot is not None
    np.frombuffer(first_writer.get(slot), dtype=np.uint8)[64:] = 1  # past the header
    other_worker = SlotMaps(8)  # a mapping of its own, as in another worker
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.frombuffer(other_worker.get(slot), dtype=np.uint8)[64:] = 7
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults < pages // 8, f"{faults} page faults writing {pages} pages"
    other_worker.close()
    pool.give_back(slot, None)


def _allocated(pid: int, only: set[str] | None = None, skip: set[str] | None = None) -> dict[str, int]:
    """gloader's segments mapped by `pid`: inode -> bytes of memory the segment holds now."""
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "/memfd:gloader" not in line:
                continue
            fields = line.split()
            inode = fields[4]
            if inode in found or (only is not None and inode not in only) or (skip and inode in skip):
                continue
            try:
                found[inode] = os.stat(f"/proc/{pid}/map_files/{fields[0]}").st_blocks * 512
            except FileNotFoundError:  # unmapped meanwhile
                pass
    return found


@pytest.mark.parametrize("keep_every", [32, 7, 2])
def test_held_batches_keep_about_their_own_memory_whatever_the_pattern(keep_every: int) -> None:
    """Small batches share a slot, several to a task: one held batch kept its whole slot
    (keeping one in 32 of 32 KiB batches pinned 36x their bytes)."""
    batches = 9600 // (32 // keep_every) if keep_every < 32 else 9600  # ~300 kept either way
    with DataLoader(np.zeros((batches * 8, 1024), np.float32), batch_size=8, num_workers=2) as loader:
        kept = [batch for index, batch in enumerate(loader) if index % keep_every == 0]
        gc.collect()
        held = sum(batch.numel() * 4 for batch in kept)
        pinned = sum(_allocated(os.getpid()).values())  # the loader's window and spares included
        assert pinned <= 2 * held, (pinned, held)


def test_one_large_batch_does_not_size_the_slots_that_follow_it() -> None:
    """After one 16 MiB batch among 4 KiB ones, slots grew to hold 32 of it and stayed: 3,456
    MiB reserved until close()."""
    with DataLoader(_data.OneLarge(at=3, large_bytes=16 << 20, small_bytes=4096, length=200), batch_size=1,
                    num_workers=2, batchify_fn=_data.first_sample) as loader:
        for index, _ in enumerate(loader):
            if index == 150:
                assert loader._engine.workers.slots.in_use_bytes() < 4 << 20  # a few small slots


def test_an_idle_loader_gives_back_the_memory_of_dropped_batches_within_a_second() -> None:
    with DataLoader(np.zeros((64 * 8, 1024 * 64), np.float32), batch_size=8, num_workers=2) as loader:  # 2 MiB
        batches = list(loader)
        del batches
        gc.collect()
        callers = set(_allocated(os.getpid()))  # the window's slots and the spares: still the loader's

        def workers_keep_beyond_headers() -> int:  # a retired slot keeps its header's page
            kept = [bytes_ for pid in loader.worker_pids() for bytes_ in _allocated(pid, skip=callers).values()]
            return sum(kept) - len(kept) * mmap.PAGESIZE

        # 2.3 MiB a slot, 58 retired: 140 MiB stayed until the next epoch's tasks reached the workers
        assert wait_until(lambda: workers_keep_beyond_headers() <= 0, 1.0), workers_keep_beyond_headers()


def test_answers_published_in_a_slot_reach_the_caller_in_any_order_and_only_for_their_lending(slots) -> None:
    pool, maps = slots
    pool.give_back(None, (0, 0, 4096, None, None))  # a batch of 4 KiB was seen
    slot = pool.acquire(3)
    space = SlotSpace(slot)
    space.open(maps)
    assert pool.answers(slot) == []
    assert space.publish(0, b"first") and space.publish(2, b"third")
    assert pool.answers(slot) == [(0, b"first"), (2, b"third")]
    assert pool.answers(slot) == []  # each is read once
    assert space.publish(1, b"x" * 1000)
    assert pool.answers(slot) == [(1, b"x" * 1000)]
    assert not space.publish(3, b"y" * (slot[3] + 1))  # larger than what is left: the task's message takes it
    for _ in range(3):
        pool.give_back(slot, None)
    again = pool.acquire(1)
    assert again[2] == slot[2] and again[4] != slot[4]  # the same slot, lent again
    assert pool.answers(again) == []  # the earlier lending's records are not this one's
    space = SlotSpace(again)
    space.open(maps)
    assert space.publish(0, b"new")
    assert pool.answers(slot) == []  # a task of the earlier lending does not take the new one's answers
    assert pool.answers(again) == [(0, b"new")]
    pool.give_back(again, None)


def test_a_record_not_yet_whole_is_not_taken_for_an_answer(slots) -> None:
    from gloader._wire import segment as _segment

    pool, maps = slots
    pool.give_back(None, (0, 0, 4096, None, None))
    slot = pool.acquire(2)
    space = SlotSpace(slot)
    space.open(maps)
    assert space.publish(0, b"answer")
    record_end = _segment.HEADER_BYTES + slot[3]
    space.view[record_end - _segment.TRAILER.size - 8] ^= 0xFF  # as if its bytes were not all visible yet
    assert pool.answers(slot) == []
    space.view[record_end - _segment.TRAILER.size - 8] ^= 0xFF
    assert pool.answers(slot) == [(0, b"answer")]  # taken at the next look
    pool.give_back(slot, None)
    pool.give_back(slot, None)
