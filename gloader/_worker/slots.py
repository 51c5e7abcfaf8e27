"""The worker's side of the shared-memory slots (the layout: `_wire.segment`).

`SlotMaps` maps a lent slot through the caller's descriptor (/proc/PID/fd/FD, a process of the
same user) the first time it sees it, and keeps it mapped across batches without a
descriptor: its pages stay in the worker's page table, so the next batch is written without
page faults. `pack_batch` writes a planned batch into the slot, after the batches of its task
before it, and returns a small handle, `(token, offset, bytes used, encoded plan, None)`.
Before the caller knows the batch size, it lends probe slots: large, not reserved ahead, only
the pages written take memory, retired once used. A batch that does not fit (larger than any
before) travels in the handle instead, as a bytearray; the caller then lends bigger slots.
`SlotSpace.publish` writes each batch's answer into the slot as soon as the batch is written.
Runs in worker processes.
"""
from __future__ import annotations

import collections
import ctypes
import os
import zlib
from typing import Any, Callable

import torch

from .._math import round_up
from .._wire.protocol import SharedMemoryUnreachableError
from .._wire.segment import (
    ALIGN_BYTES,
    ANSWERS,
    HEADER_BYTES,
    PROBE_BYTES,
    RETIRED,
    SEGMENT_NAME,
    TOKEN,
    TRAILER,
    WANTED,
    WRITTEN,
    Handle,
    Header,
    Segment,
    Slot,
    c_library,
    map_fd,
    tensor_at,
)
from .._wire.tree import Leaf, Opaque

__all__ = ["SlotMaps", "SlotSpace", "close_inherited_segments", "encode", "pack_batch"]


# A worker maps all of a new slot's pages at once rather than faulting them in one by one
# (Linux 5.14+; elsewhere the call fails and nothing changes): the first writer with
# POPULATE_WRITE, the others with POPULATE_READ (docs/design.md, "Batches through reused
# shared memory"). Not for probes: only the pages written take memory.
_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23


def close_inherited_segments() -> int:
    """Close the descriptors of the caller's segments that a forked worker inherited (they
    would keep retired segments' memory alive for the worker's life); return how many."""
    closed = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{entry}").startswith(f"/memfd:{SEGMENT_NAME} "):
                os.close(int(entry))
                closed += 1
        except OSError:
            pass
    return closed


class SlotMaps:
    """Worker-side mappings of lent slots, kept across batches (least recently used out).

    Args:
        max_maps: how many slots stay mapped. Larger: fewer re-maps when many slots
            circulate; smaller: fewer mappings to check when pruning.
    """

    def __init__(self, max_maps: int) -> None:
        self._max_maps = max_maps
        self._maps: collections.OrderedDict[int, tuple[Segment, Any]] = collections.OrderedDict()

    def get(self, slot: Slot) -> Segment:
        pid, fd, token, capacity, _ = slot
        found = self._maps.get(token)
        if found is not None:
            self._maps.move_to_end(token)
            return found[0]
        path = f"/proc/{pid}/fd/{fd}"
        try:
            local = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except PermissionError as exc:
            raise SharedMemoryUnreachableError(
                f"gloader's worker processes cannot open {path}, the shared memory their caller (pid {pid}) lends "
                "them: the caller is not dumpable (prctl(PR_SET_DUMPABLE, 0), or a setuid or setgid program), the "
                "workers run as another user, or a security module forbids it; keep the caller dumpable and the "
                "workers its own user, or use thread_pool=True or num_workers=0") from exc
        try:
            # The caller may have retired the slot before this worker opened it (a task discarded
            # after a death) and reused its descriptor number for another, smaller file: mapping
            # past that file's end and reading the header would end this worker with SIGBUS.
            if os.fstat(local).st_size < HEADER_BYTES + capacity:
                raise RuntimeError(f"{path} is not the slot gloader's caller (pid {pid}) lent (smaller than it)")
            segment = map_fd(local, HEADER_BYTES + capacity)
        finally:
            os.close(local)
        header = Header.from_buffer(segment)
        if header[TOKEN] != token:
            raise RuntimeError(f"{path} is not the slot gloader's caller (pid {pid}) lent (token mismatch)")
        if capacity == PROBE_BYTES - HEADER_BYTES:  # a probe is lent once: not kept mapped (a slot of
            return segment  # exactly that size is only mapped again each time)
        advice = _MADV_POPULATE_READ if header[WRITTEN] else _MADV_POPULATE_WRITE
        header[WRITTEN] = 1
        c_library().madvise(ctypes.addressof(segment), HEADER_BYTES + capacity, advice)
        self._maps[token] = (segment, header)
        while len(self._maps) > self._max_maps:
            self._maps.popitem(last=False)
        return segment

    def prune(self) -> int:
        """Unmap slots the caller retired (only our mapping still holds their memory);
        return how many."""
        gone = [token for token, (_, header) in self._maps.items() if header[RETIRED]]
        for token in gone:
            del self._maps[token]  # unmapped once no view of it is left (see map_fd)
        return len(gone)

    def close(self) -> None:
        self._maps.clear()

    def __len__(self) -> int:
        return len(self._maps)


def encode(plan: Any, offset_of: Callable[[Leaf], int]) -> Any:
    """Describe a plan as plain tuples: ('t', offset, shape, dtype), ('o', value), containers
    ('L' list, 'T' tuple, 'N' namedtuple with its class, 'D' dict). `offset_of(leaf)` gives
    each leaf's byte offset; leaves are visited in `iter_leaves` order."""
    if isinstance(plan, Leaf):
        return ("t", offset_of(plan), plan.shape, str(plan.dtype)[6:])
    if isinstance(plan, Opaque):
        return ("o", plan.value)
    if isinstance(plan, list):
        return ("L", [encode(item, offset_of) for item in plan])
    if isinstance(plan, tuple):
        if hasattr(plan, "_fields"):  # a namedtuple: its class travels by reference
            return ("N", type(plan), [encode(item, offset_of) for item in plan])
        return ("T", [encode(item, offset_of) for item in plan])
    return ("D", [(key, encode(item, offset_of)) for key, item in plan.items()])


class _Placement:
    """Leaves placed one after the other, each at a multiple of ALIGN_BYTES, in the order
    `_encode` visits them: describing a plan and laying it out is one pass."""

    __slots__ = ("placed", "total")

    def __init__(self) -> None:
        self.placed: list[tuple[Leaf, int]] = []
        self.total = 0

    def place(self, leaf: Leaf) -> int:
        offset = self.total
        self.placed.append((leaf, offset))
        self.total = offset + round_up(leaf.nbytes, ALIGN_BYTES)
        return offset


class SlotSpace:
    """A lent slot as one task fills it (worker side): batches from the start up, each one after
    the one before, and their answers from the end down (`publish`)."""

    __slots__ = ("slot", "offset", "limit", "view", "header", "published")

    def __init__(self, slot: Slot | None) -> None:
        self.slot = slot
        self.offset = 0  # where the next batch starts, after the header
        self.limit = slot[3] if slot is not None else 0  # where the answers published so far start
        self.view: memoryview | None = None  # the slot's bytes, once mapped (`open`)
        self.header: Any = None
        self.published = 0
    @property
    def room(self) -> int:
        """Bytes left for batches."""
        return self.limit - self.offset

    def open(self, maps: SlotMaps) -> None:
        """Map the slot (if one was lent), so that answers can be published in it."""
        if self.slot is not None and self.view is None:
            segment = maps.get(self.slot)
            self.view = memoryview(segment).cast("B")
            self.header = Header.from_buffer(segment)

    def wanted(self) -> int:
        """How many of the task's batches the caller waits to have (0: it does not wait)."""
        return int(self.header[WANTED]) if self.header is not None else 0

    def publish(self, position: int, answer: bytes) -> bool:
        """Write the answer of the task's batch at `position` into the slot, where the caller
        reads it at once (see the module's docstring); False when it does not fit."""
        view = self.view
        size = len(answer)
        need = round_up(size, 8) + TRAILER.size
        if view is None or need > self.room:
            return False
        end = HEADER_BYTES + self.limit
        start = end - need
        view[start:start + size] = answer
        lend = self.slot[4] & 0xFFFFFFFF  # type: ignore[index]
        check = zlib.crc32(TRAILER.pack(size, position, lend, 0), zlib.crc32(answer))
        TRAILER.pack_into(view, end - TRAILER.size, size, position, lend, check)
        self.limit -= need
        self.published += 1
        self.header[ANSWERS] = self.published  # last: the record is whole before it counts
        return True


def pack_batch(plan: Any, space: SlotSpace | None, maps: SlotMaps) -> Handle:
    """Write a planned batch into the lent slot, after the task's batches before it, and
    return its handle.

    Returns `(token, offset, bytes used, encoded plan, None)`; when the batch needs no memory
    or does not fit what is left of the slot, token is 0 and the last field holds the
    batch's bytes (a bytearray, None when empty).
    """
    placement = _Placement()
    encoded = encode(plan, placement.place)
    total = placement.total
    if total == 0:  # nothing to write (no tensors, or only empty ones): no memory needed
        for leaf, _ in placement.placed:
            leaf.fill(torch.empty(leaf.shape, dtype=leaf.dtype))
        return (0, 0, 0, encoded, None)
    inline: bytearray | None = None
    slot = space.slot if space is not None else None
    offset = space.offset if space is not None else 0
    if space is not None and slot is not None and total <= space.room:
        memory: Any = maps.get(slot)
        start_at = HEADER_BYTES + offset
        space.offset += total  # a multiple of ALIGN_BYTES: the next batch starts aligned
    else:  # larger than any batch before (or no slot lent): the batch travels in the handle
        memory = inline = bytearray(total)
        start_at = offset = 0
    for leaf, at in placement.placed:
        out = tensor_at(memory, start_at + at, leaf.shape, leaf.dtype)
        leaf.fill(out)
        del out
    token = slot[2] if inline is None and slot is not None else 0
    return (token, offset, total, encoded, inline)
