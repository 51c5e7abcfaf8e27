"""Host-to-device stage: pin batches and copy them to a CUDA device on a side stream.

Runs in the caller's process only; workers never touch CUDA (a forked worker cannot use a
CUDA context created before the fork, and spawned ones would each pay for a context).
`DevicePipeline` copies batch k+1 on a dedicated stream while the caller works on batch k
(from its page-locked slot, `register_for_device`, where process workers wrote it);
the caller's current stream waits on that copy before the batch is handed over. The whole
flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

from .._checks import check_non_negative_int
from .._wire.tree import map_structure, map_tensors
from .waits import ctrl_c_as_itself

__all__ = ["DEVICE_STAGE_HOLDS", "PIN_THREAD_HOLDS", "DevicePipeline", "PinThread", "pin_batch", "register_for_device",
           "warn_if_cannot_pin"]

# Pinned batches the pin thread keeps ready ahead of the caller. Larger: smooths bursts of
# slow batches; smaller: less pinned (page-locked) memory held.
_PIN_AHEAD = 2
# Host batches the pin thread holds at most: those ready in its queue and the one it is putting.
PIN_THREAD_HOLDS = _PIN_AHEAD + 1
# Host batches the device stage holds: the one copying ahead, and the one handed over whose
# copy it has not yet seen end.
DEVICE_STAGE_HOLDS = 2
# How often the pin thread and the caller wake up while waiting, to notice stop requests
# and a dropped iterator. Shorter: faster stop; longer: fewer wake-ups.
_PIN_POLL_S = 0.05
# Deadline for the pin thread to stop after being asked.
_PIN_STOP_S = 5.0

logger = logging.getLogger(__name__)


def warn_if_cannot_pin() -> None:
    """Warn (once per loader, from the caller's thread) when pin_memory cannot take effect."""
    if not torch.cuda.is_available():
        warnings.warn("pin_memory=True was requested but CUDA is not available; batches stay in "
                      "ordinary (pageable) memory", RuntimeWarning, stacklevel=3)


def _pin_leaf(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return leaf if leaf.is_pinned() else leaf.pin_memory()
    pin = getattr(leaf, "pin_memory", None)  # a batch class of the user's own pins itself, as in torch
    return pin() if callable(pin) else leaf


def pin_batch(batch: Any) -> Any:
    """Return `batch` with every tensor in page-locked memory (unchanged without CUDA).

    Lists, tuples and mappings are walked; any other object with a `pin_memory()` method (a
    custom batch class, as torch's loader allows) is replaced by what that method returns.
    The memory is pinned for the calling thread's current CUDA device (the pin thread sets
    it to `pin_device_id`); torch deprecated naming the device in `Tensor.pin_memory`.
    """
    if not torch.cuda.is_available():
        return batch
    return map_structure(_pin_leaf, batch)


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def register_for_device(device: torch.device, address: int, size: int) -> Callable[[], None] | None:
    """Page-lock a shared-memory slot's mapping for CUDA (cudaHostRegister), so that batches
    written into it are copied to the device by DMA straight from the slot (~48 GB/s on an
    H100, against ~7 GB/s for first copying them into pinned memory on one thread). Returns
    what unregisters it, or None where registering failed (the copy then stages, as for any
    pageable memory). Only for the device stage: it keeps the slot's batch until the copy has
    ended (DevicePipeline), which torch cannot do for user copies from registered memory."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch lacks stubs here
    with torch.cuda.device(device):  # whichever thread lends the slot: no context made on another device
        error = cudart.cudaHostRegister(address, size, _HOST_REGISTER_PORTABLE)
    if error != cudart.cudaError.success:
        logger.debug("cudaHostRegister of a %d-byte slot failed (%s); its batches are copied from pageable memory",
                     size, error)
        return None

    def unregister() -> None:
        cudart.cudaHostUnregister(address)

    return unregister


class DevicePipeline:
    """Moves host batches to `device`, one batch ahead, on a side stream.

    A host batch is kept until its copy has ended: its slot may be page-locked
    (`register_for_device`) and copied from directly, and freeing the batch lends the slot
    to a worker, which must not overwrite it while the copy still reads it.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch lacks stubs here
        self._copying: collections.deque[tuple[Any, Any]] = collections.deque()  # (event, host batch)

    def to_device(self, batch: Any) -> tuple[Any, Any]:
        """Start copying `batch`; returns (device batch, event that marks the copy's end).

        Waits for the oldest copy when DEVICE_STAGE_HOLDS are under way: a caller running
        ahead of lagging copies would otherwise hold a slot for each batch queued behind them,
        beyond the spare slots the loader keeps for the stage, and the slot pool would make
        (and page-lock, ~4 ms each on an H200 host) new slots for the workers meanwhile, then
        retire them as the copies catch up. The copies limit the rate then, so the wait costs none."""
        self._forget_copied()
        while len(self._copying) >= DEVICE_STAGE_HOLDS:
            event, _ = self._copying.popleft()
            event.synchronize()
        with torch.cuda.stream(self._stream):
            moved = map_tensors(lambda t: t.to(self._device, non_blocking=True), batch)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch lacks stubs here
            event.record(self._stream)
        self._copying.append((event, batch))
        return moved, event

    def _forget_copied(self) -> None:
        while self._copying and self._copying[0][0].query():
            self._copying.popleft()

    def settle(self) -> None:
        """Wait for the copies under way and let their host batches go (on close)."""
        while self._copying:
            event, _ = self._copying.popleft()
            event.synchronize()

    def hand_over(self, moved: Any, event: Any) -> Any:
        """Make the caller's current stream wait for the copy, and return the batch.

        `record_stream` tells the caching allocator that the caller's stream uses the memory,
        so it is not given to another tensor while the caller's kernels still read it.
        """
        self._forget_copied()
        current = torch.cuda.current_stream(self._device)
        current.wait_event(event)

        def mark(t: torch.Tensor) -> torch.Tensor:
            t.record_stream(current)
            return t

        return map_tensors(mark, moved)


class _Failure:
    """An exception raised while fetching a batch, handed to the caller at that batch's turn."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


class PinThread:
    """Fetches and pins host batches in a background thread of the caller's process.

    While it runs, it is the only user of the loader's engine; the loader stops it
    (`stop()`) before starting another epoch, loading a state or closing. It holds the
    iterator weakly and ends when the iterator is dropped.

    Args:
        iterator: the epoch iterator; its `fetch()` returns the next host batch.
        device_id: CUDA device the pinned memory is meant for.
        timeout_s: the loader's timeout; the caller waits at most this long for a batch.
    """

    def __init__(self, iterator: Any, device_id: int, timeout_s: float) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=_PIN_AHEAD)
        self._stopping = threading.Event()
        self._timeout_s = timeout_s
        self._iterator = weakref.ref(iterator)
        self._thread = threading.Thread(target=self._run, args=(device_id,), name="gloader-pin", daemon=True)
        self._thread.start()

    def _run(self, device_id: int) -> None:
        import torch

        torch.set_num_threads(1)  # pinning is a copy; intra-op threads would only contend
        try:
            if torch.cuda.is_available():
                torch.cuda.set_device(device_id)  # this thread's device: where its pinned memory belongs
        except Exception as exc:  # the caller raises it for its next batch rather than seeing an empty epoch
            self._put(_Failure(exc))
            return
        while not self._stopping.is_set():
            iterator = self._iterator()
            if iterator is None:
                return
            try:
                item: Any = pin_batch(iterator.fetch())
            except StopIteration:
                item = _DONE
            except BaseException as exc:  # the caller re-raises it at this batch's turn
                item = _Failure(exc)
            del iterator
            if not self._put(item) or item is _DONE:
                return

    def _put(self, item: Any) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=_PIN_POLL_S)
                return True
            except queue.Full:
                if self._iterator() is None:
                    return False
        return False

    def take(self) -> Any:
        """The next pinned batch; raises what fetching it raised, StopIteration at the end."""
        waited = 0.0
        while True:
            try:
                with ctrl_c_as_itself():
                    item = self._queue.get(timeout=_PIN_POLL_S)
                break
            except queue.Empty:
                waited += _PIN_POLL_S
                if not self._thread.is_alive() and self._queue.empty():
                    if self._stopping.is_set():  # stopped under its iterator: the loader was closed at exit
                        raise RuntimeError("this DataLoader is closed; create a new one") from None
                    raise StopIteration from None
                if waited > self._timeout_s + _PIN_STOP_S:
                    raise TimeoutError(f"the pin thread produced no batch for {waited:.1f} s") from None
        if item is _DONE:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def stop(self) -> None:
        """Ask the thread to end and wait for it (bounded); drop what it had ready."""
        self._stopping.set()
        self._thread.join(_PIN_STOP_S)
        if self._thread.is_alive():
            logger.warning("the gloader pin thread did not stop within %.1f s", _PIN_STOP_S)
        while not self._queue.empty():
            self._queue.get_nowait()


def check_pin_device(pin_memory: bool, pin_device_id: Any) -> int:
    """pin_device_id: a CUDA device index (checked against the devices when pinning can run)."""
    index = check_non_negative_int("pin_device_id", pin_device_id)
    if pin_memory and torch.cuda.is_available():
        _check_cuda_index("pin_device_id", pin_device_id, index)
    return index


def check_device(device: Any) -> torch.device | None:
    """device: a CUDA device or 'cpu' (None: batches stay on the host); the index is checked."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a string such as 'cuda:0', got {device!r}") from exc
    if dev.type == "cpu":
        return None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available on this machine; "
                         "use device=None (or 'cpu') to keep batches on the host")
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device or 'cpu', got {device!r}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    _check_cuda_index("device", device, index)
    return torch.device("cuda", index)


def _check_cuda_index(name: str, value: Any, index: int) -> None:
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{name}={value!r} names CUDA device {index}, but this machine has {count} "
                         f"(indices 0 to {count - 1})")
