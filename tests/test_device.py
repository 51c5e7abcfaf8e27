"""pin_memory and device transfer. The pin thread runs on CPU-only machines too (pinning is
then a no-op), so its ordering, errors, resume and shutdown are tested everywhere; the CUDA
behaviour itself is behind the `cuda` marker."""
from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import pytest
import torch

from gloader import DataLoader
from gloader._caller.device import DEVICE_STAGE_HOLDS, DevicePipeline
from gloader.bench.datasets import ImageDataset
from tests import _data
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pinned_loader(dataset, pin_memory: bool = True, **kwargs) -> DataLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no CUDA here: pinning is a no-op
        return DataLoader(dataset, pin_memory=pin_memory, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_pin_memory_without_cuda_warns_once_and_yields_unpinned_batches() -> None:
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        loader = DataLoader(np.arange(10), batch_size=4, pin_memory=True, num_workers=2)
    with loader:
        assert torch.cat(list(loader)).tolist() == list(range(10))
        assert torch.cat(list(loader)).tolist() == list(range(10))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pin_thread_keeps_order_errors_and_exact_resume(num_workers: int) -> None:
    with _pinned_loader(_data.RaisesAt(13, length=40), batch_size=4, num_workers=num_workers) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(3)]
        with pytest.raises(_data.CustomLookupError):
            next(it)
        state = loader.state_dict()
        rest = list(it)
    assert state["batches_yielded"] == 4  # the pin thread runs ahead; only handed-over batches count
    assert torch.cat(first + rest).flatten().tolist() == [i for i in range(40) if not 12 <= i < 16]
    with _pinned_loader(_data.RaisesAt(13, length=40), batch_size=4, num_workers=num_workers) as resumed:
        resumed.load_state_dict(state)
        assert torch.cat(list(resumed)).flatten().tolist() == list(range(16, 40))


def test_pin_thread_stops_on_break_new_epoch_and_close() -> None:
    loader = _pinned_loader(np.arange(64), batch_size=4, num_workers=2)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    assert torch.cat(list(loader)).tolist() == list(range(64))
    it = iter(loader)
    next(it)
    loader.close()  # with the pin thread running ahead


def test_dropped_iterator_ends_the_pin_thread() -> None:
    with _pinned_loader(np.arange(64), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        del it
        assert torch.cat(list(loader)).tolist() == list(range(64))


def test_the_pin_thread_reuses_slots_in_steady_state() -> None:
    """The batches the pin thread holds ahead are in flight too: the loader keeps spare slots
    for them, instead of making (and page-faulting) a new slot for most batches."""
    with _pinned_loader(ImageDataset(1024), batch_size=16, shuffle=True, num_workers=2) as loader:
        for _ in range(2):  # settle: every slot the loop needs exists
            assert all(images.shape == (16, 224, 224, 3) for images, _ in loader)
        created = loader._engine.workers.slots.segments_created
        for _ in range(3):
            assert all(images.shape == (16, 224, 224, 3) for images, _ in loader)
        assert loader._engine.workers.slots.segments_created - created <= 2  # of 192 batches


def test_device_cpu_is_a_no_op() -> None:
    with DataLoader(np.arange(6), batch_size=3, device="cpu") as loader:
        assert [b.device.type for b in loader] == ["cpu", "cpu"]


@pytest.mark.cuda
@needs_cuda
def test_pin_memory_pins_every_nested_tensor() -> None:
    with DataLoader(_data.Records(), batch_size=4, num_workers=2, pin_memory=True) as loader:
        batch = next(iter(loader))
    assert batch["x"].is_pinned() and batch["pair"][1].is_pinned() and batch["name"][0] == "item0"


@pytest.mark.cuda
@needs_cuda
def test_a_batch_class_with_its_own_pin_memory_is_pinned_on_the_device() -> None:
    with DataLoader(np.arange(8, dtype=np.float32), batch_size=4, batchify_fn=_data.PinnableBatch,
                    num_workers=2, pin_memory=True) as loader:
        batches = list(loader)
    assert all(b.pinned_by_its_method and b.inp.is_pinned() for b in batches)
    assert torch.cat([b.inp for b in batches]).tolist() == list(range(8))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pin_memory", [False, True])
def test_device_batches_arrive_on_cuda_equal_to_host_batches(pin_memory: bool) -> None:
    with DataLoader(_data.Records(), batch_size=4, num_workers=2, seed=1) as host_loader:
        host = list(host_loader)
    with DataLoader(_data.Records(), batch_size=4, num_workers=2, seed=1, pin_memory=pin_memory,
                    device="cuda:0") as loader:
        for _ in range(2):
            got = list(loader)
            assert len(got) == len(host)
            for g, h in zip(got, host):
                assert g["x"].device.type == "cuda" and g["name"] == h["name"]
                assert torch.equal(g["x"].cpu(), h["x"]) and torch.equal(g["pair"][1].cpu(), h["pair"][1])


@pytest.mark.cuda
@needs_cuda
def test_device_batches_are_safe_to_use_on_the_current_stream() -> None:
    with DataLoader(np.arange(4096, dtype=np.float32).reshape(64, 64), batch_size=8, num_workers=2,
                    pin_memory=True, device="cuda:0") as loader:
        total = sum(float((b * 2).sum()) for b in loader)
    assert total == float(np.arange(4096, dtype=np.float64).sum() * 2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("pin_memory", [False, True])
def test_device_batches_come_straight_from_page_locked_slots_and_stay_right_when_copies_lag(pin_memory: bool) -> None:
    """Every batch equals the host loader's while the side stream runs ~10 ms behind. (On an
    H100 this passed also with the stage's hold on host batches removed: the race is too
    narrow to hit here; the hold itself is tested with a stand-in for CUDA below.)"""
    data = np.arange(96 * 2048, dtype=np.float32).reshape(96, 2048)
    with DataLoader(data, batch_size=4, shuffle=True, seed=5, num_workers=2) as host_loader:
        expected = [list(host_loader) for _ in range(3)]
    with DataLoader(data, batch_size=4, shuffle=True, seed=5, num_workers=2, pin_memory=pin_memory,
                    device="cuda:0") as loader:
        side_stream = loader._device._stream
        for epoch in range(3):
            got = []
            for batch in loader:
                got.append(batch)
                with torch.cuda.stream(side_stream):  # delays the next copies: their slots must stay taken
                    torch.cuda._sleep(20_000_000)  # ~10 ms
            assert [b.cpu().tolist() for b in got] == [b.tolist() for b in expected[epoch]], f"epoch {epoch}"
        slots = [slot for slot in loader._engine.workers.slots._slots.values() if not slot.probe]
        assert slots and all(torch.frombuffer(slot.segment, dtype=torch.uint8).is_pinned() for slot in slots)


class _CopyEvent:
    """Stands in for torch.cuda.Event: the test says when a copy has ended."""

    def __init__(self, made: list[Any]) -> None:
        self.done = False
        self.waited = False
        made.append(self)

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = self.waited = True


def _stage_without_cuda(monkeypatch: pytest.MonkeyPatch) -> tuple[DevicePipeline, list[_CopyEvent]]:
    """A device stage whose copies are to the meta device (a new tensor, as a copy to a GPU
    makes), with their events in the returned list."""
    events: list[_CopyEvent] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda: _CopyEvent(events))
    return DevicePipeline(torch.device("meta")), events


def test_device_stage_keeps_each_host_batch_until_its_copy_has_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host batch may view a page-locked slot that the copy reads directly: freeing it lends
    the slot to a worker, so the stage holds it until the copy's event says it has ended."""
    stage, events = _stage_without_cuda(monkeypatch)
    first, second = torch.ones(4), torch.ones(3)
    first_alive, second_alive = weakref.ref(first), weakref.ref(second)
    stage.to_device([first, {"y": torch.zeros(2)}])
    stage.to_device((second,))
    del first, second
    gc.collect()
    assert first_alive() is not None and second_alive() is not None  # neither copy has ended
    events[0].done = True
    stage.to_device(torch.ones(1))  # notices that the first copy ended
    gc.collect()
    assert first_alive() is None and second_alive() is not None
    assert not any(event.waited for event in events)  # two under way at most: no wait
    stage.settle()  # what close() does: waits for the rest
    gc.collect()
    assert second_alive() is None and all(event.done for event in events)


def test_a_caller_ahead_of_the_copies_waits_for_the_oldest_rather_than_hold_more_batches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host batch the stage holds keeps a slot from the workers: the loader's spare slots
    count DEVICE_STAGE_HOLDS, and a stage holding more (copies lagging) would make the slot
    pool create, page-lock and later retire slots."""
    stage, events = _stage_without_cuda(monkeypatch)
    for k in range(6):
        stage.to_device(torch.ones(k + 1))
        assert len(stage._copying) <= DEVICE_STAGE_HOLDS
    assert [event.waited for event in events] == [True] * 4 + [False] * 2  # the oldest, in order


class _RecordingStage:
    """Stands in for the CUDA stage so its ordering runs on any machine: `to_device` and
    `hand_over` log which batch they see, in the order the loader calls them."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def to_device(self, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.log.append(("copy", int(batch[0])))
        return batch.clone(), int(batch[0])

    def hand_over(self, moved: torch.Tensor, first: int) -> torch.Tensor:
        self.log.append(("hand", first))
        return moved

    def settle(self) -> None:
        self.log.append(("settle", -1))


@pytest.mark.parametrize("pin_memory", [False, True])
def test_device_stage_copies_one_batch_ahead_and_counts_only_handed_batches(pin_memory: bool) -> None:
    with _pinned_loader(np.arange(16), batch_size=4, num_workers=2, pin_memory=pin_memory) as loader:
        stage = loader._device = _RecordingStage()  # type: ignore[assignment]
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        assert stage.log == [("copy", 0), ("copy", 4), ("hand", 0)]  # batch 1 started before 0 is handed
        state = loader.state_dict()
        assert state["batches_yielded"] == 1  # batch 1 is on its way, not in the caller's hands
        assert torch.cat(list(it)).tolist() == list(range(4, 16))
        assert stage.log[3:] == [("copy", 8), ("hand", 4), ("copy", 12), ("hand", 8), ("hand", 12)]
        loader.load_state_dict(state)
        stage.log.clear()
        assert torch.cat(list(loader)).tolist() == list(range(4, 16))
        assert [k for k, _ in stage.log].count("hand") == 3


def test_device_stage_raises_a_failed_batch_at_its_own_turn() -> None:
    with DataLoader(_data.RaisesAt(5, length=16), batch_size=4, num_workers=2) as loader:
        stage = loader._device = _RecordingStage()  # type: ignore[assignment]
        it = iter(loader)
        assert next(it).flatten().tolist() == [0, 1, 2, 3]  # batch 1 already failed, one ahead
        with pytest.raises(_data.CustomLookupError):
            next(it)
        assert torch.cat(list(it)).flatten().tolist() == list(range(8, 16))
    assert ("copy", 4) not in stage.log


def test_pin_thread_leaves_the_callers_torch_threads_alone() -> None:
    before = torch.get_num_threads()
    with _pinned_loader(np.arange(32), batch_size=4, num_workers=2) as loader:
        assert len(list(loader)) == 8
        assert torch.get_num_threads() == before


def test_state_and_len_describe_the_callers_epoch_after_the_pin_thread_fetched_its_end() -> None:
    with _pinned_loader(np.arange(12), batch_size=4, num_workers=2) as loader:
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        assert wait_until(lambda: it._host.ended, 10.0)  # the pin thread fetched the whole epoch
        state = loader.state_dict()
        assert (state["epoch"], state["batches_yielded"], len(loader)) == (0, 1, 3)
        assert torch.cat(list(it)).tolist() == list(range(4, 12))
        assert (loader.state_dict()["epoch"], loader.state_dict()["batches_yielded"]) == (1, 0)
    with _pinned_loader(np.arange(12), batch_size=4, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert torch.cat(list(resumed)).tolist() == list(range(4, 12))


class _PinRecorder:
    """Stands in for CUDA's pinning so the pin thread's calls can be checked on any machine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, device_count: int = 2) -> None:
        self.devices: list[tuple[str, int]] = []
        self.pinned = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: False)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args: self._pin(t, *args))

    def _set_device(self, index: int) -> None:
        self.devices.append((threading.current_thread().name, index))

    def _pin(self, tensor: torch.Tensor, *args: object) -> torch.Tensor:
        assert not args, "Tensor.pin_memory(device) is deprecated; the thread's device decides"
        self.pinned += 1
        return tensor.clone()


def test_pin_thread_pins_every_tensor_for_pin_device_id(monkeypatch: pytest.MonkeyPatch) -> None:
    pins = _PinRecorder(monkeypatch)
    with DataLoader(_data.Records(), batch_size=4, num_workers=0, pin_memory=True, pin_device_id=1) as loader:
        batches = list(loader)
    assert pins.devices == [("gloader-pin", 1)]  # set once, in the pin thread, not in the caller
    tensors_per_batch = 6  # x, label, weight, flag and both of pair; the names pass through
    assert pins.pinned == tensors_per_batch * len(batches) and batches[0]["name"][0] == "item0"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_class_with_its_own_pin_memory_is_pinned_through_it(monkeypatch: pytest.MonkeyPatch,
                                                                    num_workers: int) -> None:
    pins = _PinRecorder(monkeypatch)
    with DataLoader(np.arange(8), batch_size=4, batchify_fn=_data.PinnableBatch, num_workers=num_workers,
                    pin_memory=True) as loader:
        batches = list(loader)
    assert [b.pinned_by_its_method for b in batches] == [True, True] and pins.pinned == 2
    assert torch.cat([b.inp for b in batches]).tolist() == list(range(8))
    with DataLoader(np.arange(8), batch_size=4, batchify_fn=_data.PinnableBatch, num_workers=num_workers) as loader:
        assert not any(b.pinned_by_its_method for b in loader)


def test_cuda_indices_beyond_the_machine_are_rejected_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    _PinRecorder(monkeypatch, device_count=2)
    with pytest.raises(ValueError, match=r"pin_device_id=2 names CUDA device 2, but this machine has 2 \(indices 0 to 1\)"):
        DataLoader(np.arange(4), pin_memory=True, pin_device_id=2)
    with pytest.raises(ValueError, match=r"device='cuda:5' names CUDA device 5, but this machine has 2"):
        DataLoader(np.arange(4), device="cuda:5")


def test_a_pin_thread_that_cannot_select_its_device_fails_the_next_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    _PinRecorder(monkeypatch)

    def broken(index: int) -> None:
        raise RuntimeError(f"CUDA error: device {index} is busy or unavailable")

    monkeypatch.setattr(torch.cuda, "set_device", broken)
    with DataLoader(np.arange(8), batch_size=4, pin_memory=True, pin_device_id=1) as loader:
        with pytest.raises(RuntimeError, match="device 1 is busy"):
            next(iter(loader))
