"""Shared-memory segments ("slots"), as both sides see them: the caller lends them, workers
write batches into them (`_caller.slots`, `_worker.slots`).

Segments are anonymous memory files (`memfd_create`), never names in /dev/shm. The kernel
frees one when the last process that maps it or holds its descriptor is gone, so no segment
outlives the processes that could use it, however they end: a SIGKILL to the whole process
group (`timeout`, Slurm, systemd, `kill -- -PGID`) leaves nothing behind. There is nothing to
unlink, no name another user could guess or plant, and the size of /dev/shm (64 MiB in
docker by default) does not bound the batches.

Each segment starts with a 64-byte header the caller writes: a random TOKEN, which the
worker checks after mapping; RETIRED, set when the caller gives the segment up (surplus,
too small, or the loader closed), after which workers unmap it; WRITTEN, set by the
first worker that maps it (see `_worker.slots`); WANTED, how many of the task's batches
the caller waits to have (0: it is not waiting); and ANSWERS, how many answers the worker
has published in the slot.

A batch is the caller's as soon as it is written, not when its task ends: the worker writes
each batch's answer (its handle and timings, encoded) into the slot too, from the slot's end
down while batches fill it from the start up (`SlotSpace.publish`), and the caller reads the
answers published so far whenever it looks (`SlotPool.answers`), even while the worker is
deep in a slow batch after them. Each record ends with a TRAILER: its length, its batch's
position in the task, which lending of the slot it belongs to (lent slots carry it) and a
CRC-32 of all that, so that a record the caller sees before all of it is visible (a weakly
ordered CPU) or one left from an earlier lending is never taken for an answer. An answer that
does not fit goes with the task's result message. The whole flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import struct
import weakref
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["ALIGN_BYTES", "ANSWERS", "ANSWER_BYTES", "HEADER_BYTES", "Handle", "Header", "PROBE_BYTES", "RETIRED",
           "Register", "SEGMENT_NAME", "Segment", "SharedBuffers", "Slot", "TOKEN", "TRAILER", "WANTED", "WRITTEN",
           "c_library",
           "create_segment", "map_fd", "numpy_twin", "out_of_memory", "resident_bytes", "tensor_at"]


# Leaves start on 64-byte boundaries: any dtype view is aligned, and no two leaves share a
# cache line that two writers could contend on. The header takes the first 64 bytes.
ALIGN_BYTES = 64
HEADER_BYTES = 64
TOKEN, RETIRED, WRITTEN, WANTED, ANSWERS = 0, 1, 2, 3, 4
# An answer record's trailer (see the module's docstring): length, position, lending, CRC-32.
TRAILER = struct.Struct("<IIII")
# Room a slot has per batch for its answer beyond the batch's bytes (a handle and timings
# take ~300 bytes; a larger answer, one carrying strings or an error, goes by message).
ANSWER_BYTES = 512
Header = ctypes.c_uint64 * (HEADER_BYTES // 8)
# Size of a probe slot, lent with the first window's tasks before any batch size is known
# (see SlotPool._lend_probe); only the pages a worker writes take memory. Larger: bigger
# first batches avoid the pipe; smaller: less address space per probe. A batch larger
# than this still travels in its handle.
PROBE_BYTES = 256 << 20
_MADV_DONTFORK = 10  # linux/mman.h
SEGMENT_NAME = "gloader"
# A mapped segment: a ctypes byte array over the mapping (see map_fd).
Segment = Any
# A written batch as it travels back (see pack_batch): (token of the slot it is in, or 0 when
# it travels inline; its offset in the slot; its bytes; its encoded plan; its bytes when
# inline, else None). A plain tuple, not a NamedTuple: pickling one took 1.5 us more a batch,
# and unpickling 1.4 us more. Read it by unpacking, never by index.
Handle = tuple[int, int, int, Any, "bytearray | None"]
# What the caller lends with a task: (caller pid, fd, token, capacity, lending). A slot is
# lent again and again; its lending tells one task's use of it from the next one's.
Slot = tuple[int, int, int, int, int]
_LIBC: Any = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def c_library() -> Any:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _LIBC = libc
    return _LIBC


# Registers a mapping with a device (address, bytes) so that copies from it need no staging;
# returns what undoes that (called before the mapping goes), or None where it did not register.
Register = Callable[[int, int], Callable[[], None] | None]


def _unmap(address: int, size: int, unregister: Callable[[], None] | None) -> None:
    if unregister is not None:
        unregister()
    c_library().munmap(address, size)


# Has `fn(*args)` run once an object is garbage: `weakref.finalize` where it is, or the
# caller's `_caller.dropped.on_drop`, which a Ctrl-C cannot be lost in.
OnDrop = Callable[..., None]


def _finalize(obj: Any, fn: Callable[..., None], *args: Any) -> None:
    weakref.finalize(obj, fn, *args).atexit = False  # views may outlive exit hooks


def map_fd(fd: int, size: int, register: Register | None = None, on_drop: OnDrop = _finalize) -> Segment:
    """Map `size` bytes of `fd` shared, keeping no file descriptor.

    Python's mmap.mmap duplicates the descriptor and keeps it while mapped: one fd per batch
    the caller holds, so ~1,000 held batches hit the usual `ulimit -n 1024`. Mapped here with
    libc's mmap, the segment is a ctypes byte array over the mapping, unmapped when it and
    every numpy/torch view of it are freed (views keep it alive through their base), so
    dropping our own reference is all that releasing a mapping takes.
    """
    libc = c_library()
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mapping {size} bytes of shared memory failed: {os.strerror(code)}")
    # A process forked later (a replacement worker under fork, a subprocess of the dataset)
    # must not inherit the mapping: it would keep the memory of batches long dropped.
    libc.madvise(address, size, _MADV_DONTFORK)
    segment = (ctypes.c_ubyte * size).from_address(address)
    unregister = register(address, size) if register is not None else None
    on_drop(segment, _unmap, address, size, unregister)
    return segment
_TWINS: dict[torch.dtype, np.dtype[Any] | None] = {}


def numpy_twin(dtype: torch.dtype) -> np.dtype[Any] | None:
    """numpy's dtype for a torch dtype; None where numpy has none (bfloat16)."""
    try:
        return _TWINS[dtype]
    except KeyError:
        pass
    try:
        twin: np.dtype[Any] | None = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        twin = None
    _TWINS[dtype] = twin
    return twin


def tensor_at(buffer: Any, start: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` viewing `buffer` (bytes-like or a uint8 array) from byte
    `start`: one numpy view made in one call, then one tensor, ~3x faster than torch slicing
    and views; a dtype numpy lacks (bfloat16) is viewed as bytes and reinterpreted by torch."""
    twin = numpy_twin(dtype)
    if twin is not None:
        return torch.from_numpy(np.ndarray(shape, twin, buffer, start))
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.frombuffer(buffer, np.uint8, nbytes, start)).view(dtype).view(shape)


def out_of_memory(needed: int, exc: OSError) -> OSError:
    """The error for `needed` bytes of shared memory that could not be reserved."""
    return OSError(exc.errno, f"could not reserve {needed / 2**20:.1f} MiB of shared memory for a batch "
                              f"({os.strerror(exc.errno or 0)}): the memory limit of the machine or container is "
                              "reached; lower prefetch or batch_size, or raise the limit")


def create_segment(size: int, reserve: bool = True, register: Register | None = None,
                   on_drop: OnDrop = _finalize) -> tuple[int, Segment]:
    """A new anonymous segment of `size` bytes: (its descriptor, its mapping). Unless
    `reserve` is False (a probe slot), its pages are reserved at once; `register` is given
    the mapping (see Register); `on_drop` unmaps it once it is garbage (see OnDrop)."""
    fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC)
    try:
        # Reserve the pages now: running out of memory then fails here with an error instead
        # of killing a writer with SIGBUS on its first touch of an unbacked page.
        try:
            if reserve:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise out_of_memory(size, exc) from exc
            raise
        return fd, map_fd(fd, size, register, on_drop)
    except BaseException:
        os.close(fd)
        raise


def resident_bytes(segment: Segment, fd: int) -> int:
    """Bytes of a segment that are resident: its descriptor's blocks, or where it gave the
    descriptor up (`fd` < 0), the pages of its mapping in memory (mincore); its size where
    neither can be read."""
    try:
        if fd >= 0:
            return os.fstat(fd).st_blocks * 512
    except OSError:
        return len(segment)
    pages = -(-len(segment) // mmap.PAGESIZE)
    present = np.zeros(pages, dtype=np.uint8)
    if c_library().mincore(ctypes.addressof(segment), len(segment), present.ctypes.data) != 0:
        return len(segment)
    return int(np.count_nonzero(present & 1)) * mmap.PAGESIZE


class SharedBuffers:
    """Large buffers of a pickled payload (numpy arrays, the records of a `SharedList`), written
    once into one anonymous segment that every worker process maps instead of unpickling a copy
    (pickle's protocol 5, out of band). The caller's object owns the segment's descriptor; a
    worker's (unpickled: the caller's pid, that descriptor, a token, the buffers' places) opens
    it through /proc/PID/fd, as a lent slot is (a process of the same user), and maps it
    privately: the pages are shared until a worker writes one (then that page is its own)."""

    def __init__(self, buffers: list[Any]) -> None:
        views = [memoryview(buffer).cast("B") for buffer in buffers]
        self.token = int.from_bytes(os.urandom(8), "little") | 1
        self.spans: list[tuple[int, int]] = []
        place = ALIGN_BYTES
        for view in views:
            self.spans.append((place, len(view)))
            place += (len(view) + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        self.fd = os.memfd_create("gloader-payload", os.MFD_CLOEXEC)
        self.pid = os.getpid()
        try:
            os.ftruncate(self.fd, place)
            os.pwrite(self.fd, self.token.to_bytes(8, "little"), 0)
            for (start, _), view in zip(self.spans, views):
                written = 0
                while written < len(view):
                    written += os.pwrite(self.fd, view[written:], start + written)
        except BaseException:
            os.close(self.fd)
            raise
        weakref.finalize(self, os.close, self.fd)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.spans)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_MappedBuffers, (self.pid, self.fd, self.token, self.spans))

    def views(self) -> list[memoryview]:
        """In the caller itself (a payload loaded where it was made): the segment, mapped too."""
        return _MappedBuffers(self.pid, self.fd, self.token, self.spans).views()


class _MappedBuffers:
    """A worker's side of `SharedBuffers`: the caller's segment, mapped copy-on-write."""

    def __init__(self, pid: int, fd: int, token: int, spans: list[tuple[int, int]]) -> None:
        self._where = (pid, fd, token)
        self.spans = spans

    def views(self) -> list[memoryview]:
        pid, fd, token = self._where
        size = (self.spans[-1][0] + self.spans[-1][1]) if self.spans else ALIGN_BYTES
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            mapped = mmap.mmap(local, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(local)
        if int.from_bytes(mapped[:8], "little") != token:
            mapped.close()
            raise RuntimeError(f"the payload's shared buffers (descriptor {fd} of process {pid}) are not the ones "
                               "the loader wrote: its process has reused the descriptor (the loader was closed)")
        whole = memoryview(mapped)
        return [whole[start:start + length] for start, length in self.spans]
