"""The caller's side of the shared-memory slots (the layout: `_wire.segment`).

`SlotPool` creates every segment and owns it. It lends a free one, sized for the batches seen
so far, with each dispatched batch; rebuilds the worker's handle into tensors that view the
segment (no copy); and takes the slot back only when the last of those tensors is freed (see
`_caller.dropped`: the batch's base array is watched), so a batch the user keeps is never
overwritten. Because the caller owns the memory, a worker that dies loses nothing the caller
has been sent. It reads the answers workers publish in a slot (`SlotPool.answers`) whenever
the engine looks. Runs in the caller's process.
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import math
import mmap
import os
import threading
import weakref
import zlib
from typing import Any

import numpy as np
import torch

from .._math import round_up
from .._wire.segment import (
    ALIGN_BYTES,
    ANSWER_BYTES,
    ANSWERS,
    HEADER_BYTES,
    PROBE_BYTES,
    RETIRED,
    TOKEN,
    TRAILER,
    WANTED,
    Handle,
    Header,
    Register,
    Segment,
    Slot,
    c_library,
    create_segment,
    numpy_twin,
    out_of_memory,
    resident_bytes,
    tensor_at,
)
from . import dropped as _dropped
from .dropped import Drops, on_drop

__all__ = ["TASK_BYTES", "SlotPool"]


# A new slot gets this much room beyond the largest batch seen (in eighths), so that slowly
# growing padded batches fit it instead of needing a new slot each time.
_HEADROOM_EIGHTHS = 1
_PAGE_BYTES = mmap.PAGESIZE
# Probe slots a loader lends in all: the first window's, and a few more if that window
# ends before the first batch comes back.
_MAX_PROBES = 16
_MADV_REMOVE = 9  # frees a range of a shared memory file's pages, for every process that maps it
# The batch bytes a task carries at most (the engine sizes tasks to it): what a slot for
# several small batches needs, however many a task carried before.
TASK_BYTES = 1 << 20
# Batch sizes a slot's size follows: the largest of the latest this many. Larger: slots that
# fit an occasional big batch stay longer; smaller: memory returns sooner after one.
_RECENT_SIZES = 64
# A free slot more than this many times the size a new one would get now is retired as it
# comes back, not lent again: one large batch does not size the slots that follow it.
_OVERSIZED = 4


def _capacity_for(room: int) -> int:
    """The capacity a new slot gets for `room` bytes of batches: with headroom, its segment
    rounded up to whole pages (so a slot for tiny batches is a page, never "oversized")."""
    return (HEADER_BYTES + room + room * _HEADROOM_EIGHTHS // 8 + _PAGE_BYTES - 1) // _PAGE_BYTES * _PAGE_BYTES \
        - HEADER_BYTES


# dtype name -> (torch's dtype, numpy's twin of it or None: see `_wire.segment.tensor_at`)
_DTYPES: dict[str, tuple[torch.dtype, np.dtype[Any] | None]] = {}


def _dtype(name: str) -> tuple[torch.dtype, np.dtype[Any] | None]:
    found = _DTYPES.get(name)
    if found is None:
        dtype = getattr(torch, name)
        found = _DTYPES[name] = (dtype, numpy_twin(dtype))
    return found


def _decode(spec: Any, base: np.ndarray) -> Any:
    kind = spec[0]
    if kind == "t":
        _, start, shape, dtype_name = spec
        dtype, twin = _DTYPES.get(dtype_name) or _dtype(dtype_name)
        if math.prod(shape) == 0:  # holds no bytes: need not keep the slot taken
            return torch.empty(shape, dtype=dtype)
        if twin is not None:  # tensor_at's way, without a call per tensor into another module
            return torch.from_numpy(np.ndarray(shape, twin, base, start))
        return tensor_at(base, start, shape, dtype)
    if kind == "o":
        return spec[1]
    if kind == "L":
        return [_decode(item, base) for item in spec[1]]
    if kind == "T":
        return tuple(_decode(item, base) for item in spec[1])
    if kind == "N":
        return spec[1](*[_decode(item, base) for item in spec[2]])
    return {key: _decode(item, base) for key, item in spec[1]}


class _Lendable:
    __slots__ = ("segment", "header", "token", "capacity", "fd", "pending", "probe", "holes", "lent", "collected",
                 "extent", "released", "tail_given", "lendings", "answers_read", "answers_end")

    def __init__(self, fd: int, segment: Segment) -> None:
        self.segment = segment
        self.header = Header.from_buffer(segment)
        self.token = int.from_bytes(os.urandom(8), "little") | 1  # never 0: 0 means "no slot"
        self.header[TOKEN] = self.token
        self.capacity = len(segment) - HEADER_BYTES
        self.fd = fd
        self.pending = 0  # batches lent with it that are not back yet (see SlotPool.release)
        self.probe = False  # lent before any batch size was known (see SlotPool.acquire)
        self.holes = False  # pages of it were given back (see SlotPool.release): reserve before lending
        self.lent = 0  # batches of the task it was last lent with
        self.collected = 0  # of those, rebuilt or given back by the caller
        self.extent = 0  # the end of the bytes those batches use
        self.released: list[tuple[int, int]] = []  # byte ranges of its freed batches (while others are held)
        self.tail_given = False  # the bytes past `extent` were given back
        self.lendings = 0  # times lent (the header's LEND)
        self.answers_read = 0  # answer records of this lending read by the caller (see SlotPool.answers)
        self.answers_end = len(segment)  # where the next record to read ends

    def read_answers(self) -> list[tuple[int, bytes]]:
        """The answers published since the last read (see `SlotPool.answers`)."""
        found: list[tuple[int, bytes]] = []
        view = memoryview(self.segment).cast("B")
        lend = self.lendings & 0xFFFFFFFF
        while self.answers_read < self.header[ANSWERS]:
            end = self.answers_end
            size, position, record_lend, check = TRAILER.unpack_from(view, end - TRAILER.size)
            start = end - TRAILER.size - (size + 7) // 8 * 8  # records are 8-byte aligned
            if record_lend != lend or start < HEADER_BYTES:
                break  # not all of it is visible yet: the next look takes it
            answer = bytes(view[start:start + size])
            if zlib.crc32(TRAILER.pack(size, position, record_lend, 0), zlib.crc32(answer)) != check:
                break
            found.append((position, answer))
            self.answers_read += 1
            self.answers_end = start
        return found

    def punch(self, start: int, end: int) -> None:
        """Give back the memory of bytes [start, end) of the segment (whole pages inside it),
        for every process that maps it; what is written there later takes new pages."""
        first, last = round_up(start, _PAGE_BYTES), end // _PAGE_BYTES * _PAGE_BYTES
        if last > first:
            c_library().madvise(ctypes.addressof(self.segment) + first, last - first, _MADV_REMOVE)
            self.holes = True

    def close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def retire(self) -> None:
        self.header[RETIRED] = 1
        self.close_fd()


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges joined where they touch or overlap, in order."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _punch_waiting(to_punch: collections.deque[int], slots: dict[int, _Lendable]) -> None:
    """Give back the pages of the freed batches of the slots in `to_punch` (their tokens; those
    retired or free since are skipped), and the unused rest of slots whose task is all collected."""
    while to_punch:
        lent = slots.get(to_punch.popleft())
        if lent is None or lent.pending <= 0:
            continue  # retired or free since: nothing of it is held
        if lent.released:  # freed batches side by side make one range: their shared pages go too
            for start, end in _merged(lent.released):
                lent.punch(start, end)
        if lent.collected == lent.lent and not lent.tail_given:
            lent.punch(lent.extent, len(lent.segment))
            lent.tail_given = True


class _Sizes:
    """The latest batch sizes, in arrival order and sorted, and what a slot must hold from them:
    `typical`, a size that most recent batches do not exceed (7 in 8 of them), and `largest`,
    the largest recent one, both aligned as batches are placed; `most_batches`, the most
    batches lent with one slot so far. Read and changed under the SlotPool's lock."""

    def __init__(self) -> None:
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT_SIZES)
        self._sorted: list[int] = []
        self.typical = 0
        self.largest = 0
        self.most_batches = 1

    @property
    def known(self) -> bool:
        """Whether a batch's size has been seen."""
        return bool(self._sorted)

    def note(self, total: int) -> None:
        """A batch of `total` bytes came back."""
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(total)
        bisect.insort(self._sorted, total)
        self.typical = -(-self._sorted[len(self._sorted) * 7 // 8] // ALIGN_BYTES) * ALIGN_BYTES
        self.largest = -(-self._sorted[-1] // ALIGN_BYTES) * ALIGN_BYTES

    def needed(self, batches: int, most: int) -> int:
        """What a task of `batches` needs (`most`: how many later tasks may carry): each batch
        as large as most recent ones; a task of one batch, room for the largest recent one
        too. An odd larger batch among many small ones travels in its handle rather than size
        every slot of the window."""
        self.most_batches = max(self.most_batches, batches, most)
        needed = batches * (self.typical + ANSWER_BYTES)
        return max(needed, self.largest) if batches == 1 else needed

    def room(self) -> int:
        """What a slot needs now: room for the most batches a task carries, which the engine
        keeps within TASK_BYTES unless one batch alone is larger, so an earlier task's count of
        small batches does not multiply a large one (a task of one large batch asks for its size
        in `acquire`)."""
        return max(self.typical, min(self.most_batches * self.typical, TASK_BYTES)) + \
            self.most_batches * ANSWER_BYTES


class SlotPool:
    """Caller-side owner of a loader's shared-memory segments ("slots").

    Thread-safe: slots are released from whichever thread drops the last view.

    Args:
        max_spare: free slots kept for reuse; a slot released beyond that is retired, unless
            the pool maps no more than `working_set` slots in all. Larger: fewer new slots
            when the user holds batches in bursts; smaller: less idle shared memory.
        max_descriptors: slots that keep the descriptor workers map them by. A slot whose
            batch the user holds beyond that many gives its descriptor up and is retired
            when released, so holding 10,000 batches needs no more descriptors than this.
        register: given each new slot's mapping (not a probe's: only its written pages are
            memory), e.g. to page-lock it for a CUDA device so batches are copied to the device
            straight from the slot. Undone just before the mapping goes.
        working_set: slots (in flight, held and free) a loop uses, which are kept however many
            are free: after a loop stops mid-epoch, its window's slots come back all at once
            and its next iter() needs as many.
    """

    def __init__(self, max_spare: int, max_descriptors: int, register: Register | None = None,
                 working_set: int = 0) -> None:
        self._register = register
        self._max_spare = max_spare
        self._working_set = working_set
        self._max_descriptors = max_descriptors
        # Re-entrant: a release() reached from code run under it (a drop queue run there) cannot deadlock.
        self._lock = threading.RLock()
        self._slots: dict[int, _Lendable] = {}  # token -> slot, lent, held or free
        self._free: list[_Lendable] = []
        self._descriptors = 0
        self._sizes = _Sizes()  # what lent slots must hold
        # Pages of page-locked slots (register) are never given back: a device copy reads them.
        self._punchable = register is None
        # Slots holding freed batches' pages while others of their task are still held; given
        # back once the caller holds more slots than a loop does (see release).
        self._to_punch: collections.deque[int] = collections.deque()  # their tokens: retired ones are skipped
        self._probes = 0  # probe slots lent (see _lend_probe)
        self._drops = Drops()  # the batches rebuilt, given back once dropped (see `dropped`)
        self._closed = False
        self._pid = os.getpid()
        self.segments_created = 0

    def acquire(self, batches: int = 1, most: int = 1) -> Slot | None:
        """Lend a slot for `batches` batches about to be dispatched as one task (a probe slot
        until a batch's size is known; None once the probes are spent or the pool is closed).
        The slot is free again once each of them has come back: given back, or rebuilt and
        freed. `most`: how many batches later tasks may carry; new slots have room for that
        many (the most asked so far), so tasks of a varying size reuse the same slots."""
        drops = self._drops
        lent, room = self._lend_free(batches, most, last_try=not drops.dropped)
        if room and drops.dropped:  # batches the caller dropped since: their slots may be free now
            drops.run()
            if _dropped.MAPPINGS.dropped:  # slots retired so: their mappings go now too
                _dropped.MAPPINGS.run()
            lent, room = self._lend_free(batches, most, last_try=True)
        if not room:
            return lent
        made = _Lendable(*create_segment(HEADER_BYTES + _capacity_for(room), register=self._register,
                                         on_drop=on_drop))
        with self._lock:
            return self._adopt(made, batches)

    def _lend_free(self, batches: int, most: int, last_try: bool) -> tuple[Slot | None, int]:
        """(a free slot lent, or a probe, or None when closed; 0), or (None, the room a new slot
        needs) when none fits; on the `last_try`, free slots too small are retired."""
        with self._lock:
            if self._closed:
                return None, 0
            if not self._sizes.known:
                return self._lend_probe(batches), 0
            needed = self._sizes.needed(batches, most)
            room = max(needed, self._sizes.room())
            for unfit in [free for free in self._free if free.capacity > _OVERSIZED * _capacity_for(room)]:
                self._free.remove(unfit)  # sized for batches long gone
                self._retire(unfit)
            for found in reversed(self._free):  # the most recently freed first: its pages are likeliest cached
                if needed <= found.capacity:
                    self._free.remove(found)
                    return self._lend(found, batches), 0
            for small in list(self._free) if last_try else ():  # all smaller than what is coming: replaced
                self._free.remove(small)
                self._retire(small)
            return None, room

    def _lend_probe(self, batches: int) -> Slot | None:
        """A slot for the first window, before any batch's size is known (call holding the
        lock). Its size is a guess, PROBE_BYTES of which only the pages written are used,
        and it is not reserved ahead; without it those batches would cross the result pipe
        inside their handles (~50 ms for a 9.6 MB batch). Retired once its batches are back."""
        if self._probes >= _MAX_PROBES:
            return None
        made = _Lendable(*create_segment(PROBE_BYTES, reserve=False, on_drop=on_drop))
        made.probe = True
        self._probes += 1
        return self._adopt(made, batches)

    def _adopt(self, made: _Lendable, batches: int) -> Slot:
        """Own a new slot and lend it (call holding the lock)."""
        self._slots[made.token] = made
        self._descriptors += 1
        self.segments_created += 1
        return self._lend(made, batches)

    def _lend(self, lent: _Lendable, batches: int) -> Slot:
        if lent.holes and not lent.probe:  # reserved again, so a writer meets no unbacked page
            try:
                os.posix_fallocate(lent.fd, 0, len(lent.segment))
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise out_of_memory(len(lent.segment), exc) from exc
                raise
            lent.holes = False
        lent.pending = lent.lent = batches
        lent.collected, lent.extent, lent.released, lent.tail_given = 0, HEADER_BYTES, [], False
        lent.lendings += 1
        lent.answers_read, lent.answers_end = 0, len(lent.segment)
        lent.header[WANTED], lent.header[ANSWERS] = 0, 0
        return (self._pid, lent.fd, lent.token, lent.capacity, lent.lendings)

    def _lent_now(self, slot: Slot | None) -> _Lendable | None:
        """The slot as lent with `slot` (None: retired, or lent again since; call holding the lock)."""
        lent = self._slots.get(slot[2]) if slot is not None else None
        return lent if lent is not None and lent.lendings == slot[4] else None  # type: ignore[index]

    def want(self, slot: Slot | None, count: int) -> None:
        """Tell the worker loading the task lent `slot` that the caller waits to have `count`
        of its batches: it says so as soon as that many are in (see `answers`)."""
        with self._lock:
            lent = self._lent_now(slot)
            if lent is not None:
                lent.header[WANTED] = count

    def answers(self, slot: Slot | None) -> list[tuple[int, bytes]]:
        """The answers the worker has published in `slot` since the last call, as (position in
        the task, encoded answer); none once the slot is retired or lent again."""
        with self._lock:
            lent = self._lent_now(slot)
            return [] if lent is None else lent.read_answers()

    def rebuild(self, slot: Slot | None, handle: Handle) -> Any:
        """Turn a handle into the batch. Tensors view the slot when the batch was written
        into it, and the slot stays taken until the last of them is freed."""
        token, offset, total, spec, inline = handle
        with self._lock:
            self._sizes.note(total)
        if not token:
            self.give_back(slot, None)
            return _decode(spec, np.frombuffer(inline, dtype=np.uint8) if inline is not None
                           else np.empty(0, dtype=np.uint8))
        start = HEADER_BYTES + offset
        with self._lock:
            lent = self._slots[token]
            if self._descriptors > self._max_descriptors and lent.fd >= 0:  # see the class: retired when released
                lent.close_fd()
                self._descriptors -= 1
            self._collected(lent, start + total)
        base = np.frombuffer(lent.segment, dtype=np.uint8, count=total, offset=start)
        batch = _decode(spec, base)
        ref = weakref.ref(base, self._drops.dropped.append)  # Drops.watch, written out: the hot path
        self._drops.watched[id(ref)] = (ref, self.release, (token, start, start + total))
        if _dropped._runner is None:
            _dropped.keep_running()
        return batch

    def give_back(self, slot: Slot | None, handle: Handle | None) -> None:
        """Take back a batch's share of its slot when the batch will never be rebuilt (failed
        or discarded)."""
        token, offset, total = handle[:3] if handle is not None else (0, 0, 0)
        if handle is not None:
            with self._lock:
                self._sizes.note(total)
        if slot is not None:
            start = end = 0
            if handle is not None and token == slot[2]:  # its bytes are in the slot
                start = HEADER_BYTES + offset
                end = start + total
            with self._lock:
                lent = self._slots.get(slot[2])
                if lent is not None:
                    self._collected(lent, end)
            self.release(slot[2], start, end)

    def release(self, token: int, start: int = 0, end: int = 0) -> None:
        """One batch lent with the slot is back (its bytes were [start, end) of the slot);
        after the last, return the slot to the free list, or retire it (closed, in surplus,
        or without its descriptor). A batch back while others of its slot are still held gives
        its pages back once the caller holds more slots than a training loop does (a loop
        holds one or two batches: then nothing is given back only to be reserved again), so
        a held batch keeps about its own bytes, not its task's."""
        with self._lock:
            lent = self._slots.get(token)
            if lent is None:
                return
            lent.pending -= 1
            if lent.pending > 0:
                if end > start and self._punchable:
                    lent.released.append((start, end))
                    self._to_punch.append(token)
                    if len(self._slots) > self._max_descriptors:  # the caller holds more than a loop does
                        _punch_waiting(self._to_punch, self._slots)
                return
            lent.released = []
            surplus = len(self._free) >= self._max_spare and len(self._slots) > self._working_set
            if self._closed or lent.fd < 0 or lent.probe or surplus \
                    or lent.capacity > _OVERSIZED * _capacity_for(self._sizes.room()):  # sized for batches long gone
                self._retire(lent)
            else:
                self._free.append(lent)

    def _collected(self, lent: _Lendable, end: int) -> None:
        """One batch of the slot's task reached the caller (call holding the lock)."""
        lent.collected += 1
        lent.extent = max(lent.extent, end)
        if lent.collected == lent.lent and lent.holes:  # its extent is final: the rest can go too
            self._to_punch.append(lent.token)

    def in_use_bytes(self) -> int:
        """Bytes of shared memory this loader's slots hold in memory (free slots included: the
        pages written and not given back)."""
        self._drops.run()
        with self._lock:
            return sum((resident_bytes(slot.segment, slot.fd) for slot in self._slots.values()))

    def task_bytes(self) -> int:
        """What a task's batches take, from the recent ones (about nothing before any came back)."""
        with self._lock:
            return self._sizes.room()

    def capacity_bytes(self) -> int:
        """Bytes of shared memory this loader's slots have mapped, written or not."""
        with self._lock:
            return sum(len(slot.segment) for slot in self._slots.values())

    def close(self) -> None:
        """Retire every slot; batches the user still holds stay valid until freed."""
        with self._lock:
            self._closed = True
            for slot in list(self._slots.values()):
                self._retire(slot)
            self._free = []
            self._to_punch.clear()

    def _retire(self, slot: _Lendable) -> None:
        if slot.pending <= 0 and self._punchable:  # no batch of it is held: its memory goes now,
            slot.punch(_PAGE_BYTES, len(slot.segment))  # however long workers keep it mapped (the header stays)
        if slot.fd >= 0:
            self._descriptors -= 1
        slot.retire()
        del self._slots[slot.token]  # unmapped once no view of it is left (see map_fd)
