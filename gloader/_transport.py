"""Shared-memory transport: workers write batches into reused segments, the caller maps them.

Packing half (runs in workers): `SegmentCache` keeps segments mapped across batches and
`pack_batch` writes a planned batch into one of them and returns a small handle (bytes).
Unpacking half (runs in the caller): `SlotPool` owns the segments, hands a free one to each
dispatched batch, and rebuilds handles into tensors that view the memory without copying.

Ownership: a segment belongs to the caller's `SlotPool` from the moment its name arrives in a
handle. The pool gives it to one batch at a time; it returns to the free list only when the
last tensor viewing that batch's memory is freed (a `weakref.finalize` on the batch's base
array), so a batch the user keeps is never overwritten. A worker that creates a segment (the
slot it was given was too small, or none was free) owns it until the handle is returned; it
unlinks it itself if it fails before then. Segment names start with the loader's prefix, so
`unlink_prefix` removes everything of one loader after close or after the caller dies.
The whole flow is drawn in `_engine`.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import glob
import logging
import mmap
import os
import threading
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from ._math import round_up
from ._tree import Leaf, Opaque, iter_leaves

__all__ = ["SegmentCache", "SlotPool", "pack_batch", "unlink_prefix", "unlink_segment"]

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"
# Leaves start on 64-byte boundaries: any dtype view is aligned, and no two leaves share a
# cache line that two writers could contend on.
_ALIGN_BYTES = 64
# A new segment gets this much room beyond the batch that created it (in eighths), so that
# slowly growing padded batches reuse it instead of creating a new segment each time.
_HEADROOM_EIGHTHS = 1
_PAGE_BYTES = mmap.PAGESIZE
# A mapped segment: a ctypes byte array over the mapping (see _map_fd).
Segment = Any


def _path(name: str) -> str:
    return os.path.join(_SHM_DIR, name)


def _map_segment(name: str, capacity: int, create: bool) -> Segment:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(_path(name), flags, 0o600)
    try:
        if create:
            # Reserve the pages now: a full /dev/shm then fails here with ENOSPC instead of
            # killing the writer with SIGBUS on its first touch of an unbacked page.
            try:
                os.posix_fallocate(fd, 0, capacity)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise _out_of_space(capacity) from exc
                raise
        return _map_fd(fd, capacity)
    except BaseException:
        if create:
            os.unlink(_path(name))
        raise
    finally:
        os.close(fd)


def _shm_free_and_total() -> tuple[int, int]:
    stats = os.statvfs(_SHM_DIR)
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def _out_of_space(needed: int) -> OSError:
    free, total = _shm_free_and_total()
    return OSError(errno.ENOSPC, f"{_SHM_DIR} is full: a batch needs {needed / 2**20:.1f} MiB of shared memory and "
                                 f"{_SHM_DIR} has {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB. Enlarge it "
                                 "(docker: --shm-size=2g), or lower prefetch or batch_size")


def unlink_segment(name: str) -> None:
    """Remove exactly the segment `name` (gone already is fine)."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
    except PermissionError:  # another user's file under our name: not ours to remove
        logger.warning("left %s in place: it belongs to another user", _path(name))


def unlink_prefix(prefix: str) -> int:
    """Remove every segment whose name starts with `prefix`; return how many were removed."""
    removed = 0
    uid = os.getuid()
    for path in glob.glob(os.path.join(_SHM_DIR, glob.escape(prefix) + "*")):
        try:
            if os.lstat(path).st_uid != uid:
                logger.warning("left %s in place: it matches a gloader name but belongs to another user", path)
                continue
            os.unlink(path)
            removed += 1
        except (FileNotFoundError, PermissionError):
            pass
    return removed


_LIBC: Any = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC = libc
    return _LIBC


def _map_fd(fd: int, size: int) -> Segment:
    """Map `size` bytes of `fd` shared, keeping no file descriptor.

    Python's mmap.mmap duplicates the descriptor and keeps it while mapped: one fd per batch
    the caller holds, so ~1,000 held batches hit the usual `ulimit -n 1024`. Mapped here with
    libc's mmap, the segment is a ctypes byte array over the mapping, unmapped when it and
    every numpy/torch view of it are freed (views keep it alive through their base), so
    dropping our own reference is all that releasing a mapping takes.
    """
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mapping {size} bytes of shared memory failed: {os.strerror(code)}")
    segment = (ctypes.c_ubyte * size).from_address(address)
    weakref.finalize(segment, libc.munmap, address, size).atexit = False  # views may outlive exit hooks
    return segment


class SegmentCache:
    """Worker-side mappings of segments, kept open across batches (least recently used out).

    Keeping a segment mapped is what makes reuse cheap: its pages stay in this process's page
    table, so writing the next batch into it takes no page faults.

    Args:
        max_maps: how many segments stay mapped. Larger: fewer re-maps when many slots
            circulate; smaller: retired segments are unmapped (and freed) sooner.
    """

    def __init__(self, max_maps: int) -> None:
        self._max_maps = max_maps
        self._maps: collections.OrderedDict[str, Segment] = collections.OrderedDict()
        self._created = 0

    def get(self, name: str, capacity: int) -> Segment:
        segment = self._maps.get(name)
        if segment is None or len(segment) < capacity:
            segment = _map_segment(name, capacity, create=False)
            self._remember(name, segment)
        else:
            self._maps.move_to_end(name)
        return segment

    def create(self, prefix: str, capacity: int) -> tuple[str, Segment]:
        self._created += 1
        # A random part: another local user who sees the prefix in /dev/shm cannot plant the
        # next name ahead of us (creation is O_EXCL and would fail).
        name = f"{prefix}w{os.getpid()}_{self._created}_{os.urandom(4).hex()}"
        segment = _map_segment(name, capacity, create=True)
        self._remember(name, segment)
        return name, segment

    def prune(self) -> int:
        """Unmap segments whose names are gone: the caller retired them (a surplus slot after
        the user dropped a burst of held batches), and only this mapping still holds their
        memory. Returns how many were unmapped."""
        gone = [name for name in self._maps if not os.path.exists(_path(name))]
        for name in gone:
            self.forget(name)
        return len(gone)

    def forget(self, name: str) -> None:
        self._maps.pop(name, None)  # unmapped once no view of it is left (see _map_fd)

    def close(self) -> None:
        for name in list(self._maps):
            self.forget(name)

    def _remember(self, name: str, segment: Segment) -> None:
        self._maps.pop(name, None)
        self._maps[name] = segment
        while len(self._maps) > self._max_maps:
            self._maps.popitem(last=False)


def _encode(plan: Any, offsets: dict[int, int]) -> Any:
    """Describe a plan as plain tuples: ('t', offset, shape, dtype), ('o', value), containers
    ('L' list, 'T' tuple, 'N' namedtuple with its class, 'D' dict)."""
    if isinstance(plan, Leaf):
        return ("t", offsets[id(plan)], plan.shape, str(plan.dtype)[6:])
    if isinstance(plan, Opaque):
        return ("o", plan.value)
    if isinstance(plan, list):
        return ("L", [_encode(item, offsets) for item in plan])
    if isinstance(plan, tuple):
        if hasattr(plan, "_fields"):  # a namedtuple: its class travels by reference
            return ("N", type(plan), [_encode(item, offsets) for item in plan])
        return ("T", [_encode(item, offsets) for item in plan])
    return ("D", [(key, _encode(item, offsets)) for key, item in plan.items()])


def pack_batch(plan: Any, slot: str | None, slot_capacity: int, prefix: str, cache: SegmentCache) -> tuple[Any, ...]:
    """Write a planned batch into shared memory and return its handle.

    Uses the given slot when the batch fits, otherwise creates a segment (with headroom) that
    the caller adopts. Returns `(segment name or None, capacity, created, encoded plan)`.
    """
    offsets: dict[int, int] = {}
    total = 0
    leaves = list(iter_leaves(plan))
    for leaf in leaves:
        offsets[id(leaf)] = total
        total += round_up(leaf.nbytes, _ALIGN_BYTES)
    if total == 0:  # nothing to write (no tensors, or only empty ones): no segment needed
        for leaf in leaves:
            leaf.fill(torch.empty(leaf.shape, dtype=leaf.dtype))
        return (None, 0, False, _encode(plan, offsets))
    created = slot is None or total > slot_capacity
    if created:
        capacity = round_up(total + total * _HEADROOM_EIGHTHS // 8, _PAGE_BYTES)
        name, segment = cache.create(prefix, capacity)
    else:
        name, capacity = slot, slot_capacity  # type: ignore[assignment]  # slot is set here
        segment = cache.get(name, capacity)
    try:
        flat = torch.from_numpy(np.frombuffer(segment, dtype=np.uint8, count=total))
        for leaf in leaves:
            start = offsets[id(leaf)]
            leaf.fill(flat[start:start + leaf.nbytes].view(leaf.dtype).view(leaf.shape))
        del flat
    except BaseException:
        if created:
            cache.forget(name)
            unlink_segment(name)  # never handed over: this worker still owns it
        raise
    return (name, capacity, created, _encode(plan, offsets))


_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    found = _DTYPES.get(name)
    if found is None:
        found = _DTYPES[name] = getattr(torch, name)
    return found


def _decode(spec: Any, base: np.ndarray) -> Any:
    kind = spec[0]
    if kind == "t":
        _, start, shape, dtype_name = spec
        dtype = _dtype(dtype_name)
        count = 1
        for size in shape:
            count *= size
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        view = torch.from_numpy(base[start:start + count * dtype.itemsize])
        return view.view(dtype).view(shape)
    if kind == "o":
        return spec[1]
    if kind == "L":
        return [_decode(item, base) for item in spec[1]]
    if kind == "T":
        return tuple(_decode(item, base) for item in spec[1])
    if kind == "N":
        return spec[1](*[_decode(item, base) for item in spec[2]])
    return {key: _decode(item, base) for key, item in spec[1]}


class SlotPool:
    """Caller-side owner of a loader's shared-memory segments ("slots").

    Thread-safe: slots are released from whichever thread drops the last view.

    Args:
        prefix: name prefix of this loader's segments.
        max_spare: free slots kept mapped for reuse; a slot released beyond that is unlinked.
            Larger: fewer new segments when the user holds batches in bursts; smaller:
            less idle shared memory.
    """

    def __init__(self, prefix: str, max_spare: int) -> None:
        self.prefix = prefix
        self._max_spare = max_spare
        # Re-entrant: a batch freed by the garbage collector while this thread holds the lock
        # (any allocation inside it can trigger a collection) calls release() right here.
        self._lock = threading.RLock()
        self._maps: dict[str, Segment] = {}
        self._free: list[str] = []
        self._closed = False
        self.segments_created = 0
        self._warned_size = False

    def acquire(self) -> tuple[str | None, int]:
        """Take a free slot for a batch about to be dispatched, or (None, 0) when none is free."""
        with self._lock:
            if self._free and not self._closed:
                name = self._free.pop()
                return name, len(self._maps[name])
        return None, 0

    def settle(self, given: str | None, handle: tuple[Any, ...] | None) -> None:
        """Account for a finished task that was given slot `given`.

        `handle` is the task's `(name, capacity, created, spec)`, or None when it failed.
        """
        used = handle[0] if handle is not None else None
        if given is not None and used != given:
            if handle is not None and handle[2]:
                self._retire(given)  # too small for this batch: a bigger one replaces it
            else:
                self.release(given)
        if handle is not None and handle[2]:
            self._adopt(handle[0], handle[1])

    def rebuild(self, handle: tuple[Any, ...]) -> Any:
        """Turn a handle into the batch: tensors that view the slot, which stays taken until
        the last of them is freed."""
        name, capacity, _, spec = handle
        if name is None:
            return _decode(spec, np.empty(0, dtype=np.uint8))
        with self._lock:
            segment = self._maps[name]
        base = np.frombuffer(segment, dtype=np.uint8, count=capacity)
        batch = _decode(spec, base)
        release = weakref.finalize(base, self.release, name)
        release.atexit = False
        return batch

    def release(self, name: str) -> None:
        """Return a slot to the free list (or unlink it when closed or in surplus)."""
        with self._lock:
            if self._closed or len(self._free) >= self._max_spare:
                self._maps.pop(name, None)  # unmapped once no view of it is left (see _map_fd)
            else:
                self._free.append(name)
                return
        unlink_segment(name)

    def in_use_bytes(self) -> int:
        """Bytes of shared memory this loader holds mapped (free slots included)."""
        with self._lock:
            return sum(len(m) for m in self._maps.values())

    def close(self) -> None:
        """Unlink every segment; batches the user still holds stay valid until freed."""
        with self._lock:
            self._closed = True
            maps, self._maps = self._maps, {}
            self._free = []
        for name in maps:
            unlink_segment(name)
        removed = unlink_prefix(self.prefix)  # created by workers but never handed over
        if removed:
            logger.debug("removed %d segments of %s that were still in flight at close", removed, self.prefix)

    def _adopt(self, name: str, capacity: int) -> None:
        try:
            segment = _map_segment(name, capacity, create=False)
        except FileNotFoundError:  # its worker removed it when exiting (the caller is closing)
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._maps[name] = segment
                self.segments_created += 1
        if closed:
            unlink_segment(name)

    def _retire(self, name: str) -> None:
        with self._lock:
            self._maps.pop(name, None)
        unlink_segment(name)

    def warn_if_shm_small(self, batch_bytes: int, window: int) -> None:
        """Warn once when /dev/shm cannot hold `window` batches of `batch_bytes`."""
        if self._warned_size:
            return
        self._warned_size = True
        free_bytes, total_bytes = _shm_free_and_total()
        needed = batch_bytes * window
        if needed > free_bytes:
            # A RuntimeWarning, not a ResourceWarning: Python hides those by default.
            warnings.warn(f"/dev/shm has {free_bytes / 2**20:.0f} MiB free (of {total_bytes / 2**20:.0f} MiB) but "
                          f"gloader's prefetch window needs about {needed / 2**20:.0f} MiB ({window} batches of "
                          f"{batch_bytes / 2**20:.1f} MiB); workers will fail with 'No space left on device'. "
                          "Enlarge /dev/shm (docker: --shm-size=2g), or lower prefetch or batch_size.",
                          RuntimeWarning, stacklevel=4)
