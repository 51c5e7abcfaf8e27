"""Host-to-device stage: pin batches and copy them to a CUDA device on a side stream.

Runs in the caller's process only; workers never touch CUDA (a forked worker cannot use a
CUDA context created before the fork, and spawned ones would each pay for a context).
`DevicePipeline` copies batch k+1 on a dedicated stream while the caller works on batch k;
the caller's current stream waits on that copy before the batch is handed over. The whole
flow is drawn in `_dispatch`.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

from ._tree import map_tensors

__all__ = ["DevicePipeline", "pin_batch"]

logger = logging.getLogger(__name__)
_WARNED_NO_CUDA = False


def pin_batch(batch: Any, device_id: int) -> Any:
    """Return `batch` with every tensor in page-locked memory (unchanged without CUDA)."""
    global _WARNED_NO_CUDA
    if not torch.cuda.is_available():
        if not _WARNED_NO_CUDA:
            _WARNED_NO_CUDA = True
            warnings.warn("pin_memory=True was requested but CUDA is not available; batches stay in "
                          "ordinary (pageable) memory", RuntimeWarning, stacklevel=3)
        return batch
    device = torch.device("cuda", device_id)
    return map_tensors(lambda t: t if t.is_pinned() else t.pin_memory(device), batch)


class DevicePipeline:
    """Moves host batches to `device`, one batch ahead, on a side stream.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)

    def to_device(self, batch: Any) -> tuple[Any, Any]:
        """Start copying `batch`; returns (device batch, event that marks the copy's end)."""
        with torch.cuda.stream(self._stream):
            moved = map_tensors(lambda t: t.to(self._device, non_blocking=True), batch)
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event

    def hand_over(self, moved: Any, event: Any) -> Any:
        """Make the caller's current stream wait for the copy, and return the batch.

        `record_stream` tells the caching allocator that the caller's stream uses the memory,
        so it is not given to another tensor while the caller's kernels still read it.
        """
        current = torch.cuda.current_stream(self._device)
        current.wait_event(event)

        def mark(t: torch.Tensor) -> torch.Tensor:
            t.record_stream(current)
            return t

        return map_tensors(mark, moved)
