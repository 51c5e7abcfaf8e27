"""pin_memory and device transfer. The pin thread runs on CPU-only machines too (pinning is
then a no-op), so its ordering, errors, resume and shutdown are tested everywhere; the CUDA
behaviour itself is behind the `cuda` marker."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from gloader import DataLoader

from tests import _data

pytestmark = pytest.mark.timeout(60)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pinned_loader(dataset, **kwargs) -> DataLoader:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no CUDA here: pinning is a no-op
        return DataLoader(dataset, pin_memory=True, **kwargs)


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
