"""Row-wise batching: a process worker writes each large sample into its batch's place in the
lent slot as soon as it is fetched, instead of keeping the whole batch of samples and
stacking them at the end.

For samples of tens of KB and more (images), stacking at the end touches every byte twice
in memory that does not stay cached: the batch's samples (9.6 MB for 64 images of 150 KB)
and then the slot. Written row by row, a sample's memory is freed before the next one is
made (malloc hands the same block back, still cached), and only the slot is written. W2
(64 uint8 224x224x3 images), two workers alike, measured outside gloader: 1.3-1.6 ms per
batch stacked, 0.9 ms row by row. For small samples the per-row call costs more than it
saves (~0.4 us a row against ~0.1 us in one concatenate), so rows start at _MIN_ROW_BYTES.

Applies to the default batchify only, and only to samples that are an array or a flat
tuple/list/namedtuple of arrays and Python numbers; the batch it writes is the one
`default_batchify_fn` makes. The layout comes from the first sample; a later sample that
differs (another shape, dtype or kind) ends the row-wise write, and the batch is made the
usual way from all its samples (those already written are read back from the slot).
Runs in process workers only; the flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._math import round_up
from .._wire.plans import plan_scalars
from .._wire.segment import ALIGN_BYTES, HEADER_BYTES, Handle, tensor_at
from .._wire.tree import Leaf, as_torch_dtype
from .slots import SlotMaps, SlotSpace, encode

__all__ = ["load_rows"]

# Array bytes per sample from which batches are written row by row (see the module).
# Larger: fewer datasets take the row-wise path; smaller: more per-row call overhead.
_MIN_ROW_BYTES = 16 * 1024
_SCALARS = (int, float, bool)


def _no_fill(out: Any) -> None:
    """The leaf of a row-wise batch is written already."""


class _Layout:
    """Where each field of a batch's samples goes: array fields into views of the slot,
    Python numbers into lists that become tensors at the end."""

    def __init__(self, first: Any, count: int) -> None:
        self.kind = type(first)
        fields = [first] if self.kind is np.ndarray else list(first)
        self.width = len(fields)
        self.count = count
        self.arrays: dict[int, np.ndarray] = {}  # field -> (count, *shape) view of the slot, once bound
        self.numbers: dict[int, list[Any]] = {}
        self.offsets: dict[int, int] = {}  # field -> byte offset in the batch
        self._fields: dict[int, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        total = 0
        for index, field in enumerate(fields):
            if type(field) is np.ndarray:
                self.offsets[index] = total
                self._fields[index] = (field.shape, field.dtype)
                total += round_up(count * field.nbytes, ALIGN_BYTES)
            else:
                self.numbers[index] = []
        self.array_bytes = total

    def bind(self, memory: Any, start: int) -> None:
        """Make the array fields' views of the slot, from byte `start` (checked to fit first:
        a view past the mapping's end is an error)."""
        for index, (shape, dtype) in self._fields.items():
            self.arrays[index] = np.ndarray((self.count,) + shape, dtype, memory, start + self.offsets[index])

    def write(self, row: int, sample: Any) -> bool:
        """Write one sample; False (nothing written) when it does not fit the layout."""
        if type(sample) is not self.kind:
            return False
        fields = [sample] if self.kind is np.ndarray else sample
        if len(fields) != self.width:
            return False
        for index, view in self.arrays.items():
            field = fields[index]
            if type(field) is not np.ndarray or field.shape != view.shape[1:] or field.dtype != view.dtype:
                return False
        for index, view in self.arrays.items():
            view[row] = fields[index]
        for index, values in self.numbers.items():
            values.append(fields[index])
        return True

    def read_back(self, rows: int) -> list[Any]:
        """The first `rows` samples as written (copies: the slot will hold the batch)."""
        samples = []
        for row in range(rows):
            fields = [np.array(self.arrays[i][row]) if i in self.arrays else self.numbers[i][row]
                      for i in range(self.width)]
            if self.kind is np.ndarray:
                samples.append(fields[0])
            elif hasattr(self.kind, "_fields"):
                samples.append(self.kind(*fields))
            else:
                samples.append(self.kind(fields))
        return samples


def _fits(first: Any) -> bool:
    """Whether `first` is a sample row-wise batching takes: numeric arrays of enough bytes,
    alone or in a flat tuple/list/namedtuple with Python numbers."""
    if type(first) is np.ndarray:
        fields: Any = [first]
    elif type(first) in (tuple, list) or (isinstance(first, tuple) and hasattr(first, "_fields")):
        fields = first  # a namedtuple is rebuilt from its fields, any other sequence is not
    else:
        return False
    if not fields:
        return False
    array_bytes = 0
    for field in fields:
        if type(field) is np.ndarray:
            dtype = field.dtype
            if dtype.hasobject or dtype.kind in "USV" or not dtype.isnative or as_torch_dtype(dtype) is None:
                return False
            array_bytes += field.nbytes
        elif type(field) not in _SCALARS:
            return False
    return array_bytes >= _MIN_ROW_BYTES


def load_rows(load: Callable[[Any], Any], keys: list[Any], space: SlotSpace | None, maps: SlotMaps,
              on_key: Callable[[Any], None]) -> tuple[Any, list[Any]]:
    """Fetch the samples of `keys` with `load`, writing them row by row into the task's slot.

    Returns `(handle, [])` when the whole batch was written so (the handle `pack_batch`
    would give), otherwise `(None, samples)`: the first samples of the batch, each fetched
    once, for the caller to fetch the rest and batch them the usual way. `on_key(key)` names
    the key being fetched when `load` raises.
    """
    try:
        first = load(keys[0])
    except BaseException:
        on_key(keys[0])
        raise
    slot = space.slot if space is not None else None
    if space is None or slot is None or not _fits(first):
        return None, [first]
    count = len(keys)
    layout = _Layout(first, count)
    # Numbers take at most 16 bytes each (complex128); they go after the arrays. A batch that
    # does not fit (larger than any before) is batched the usual way and travels in its handle.
    if layout.array_bytes + len(layout.numbers) * round_up(16 * count, ALIGN_BYTES) > space.room:
        return None, [first]
    layout.bind(maps.get(slot), HEADER_BYTES + space.offset)
    layout.write(0, first)
    del first
    for row in range(1, count):
        try:
            sample = load(keys[row])
        except BaseException:
            on_key(keys[row])
            raise
        if not layout.write(row, sample):
            return None, layout.read_back(row) + [sample]
        del sample
    return _seal(layout, count, space, maps, slot), []


def _seal(layout: _Layout, count: int, space: SlotSpace, maps: SlotMaps, slot: Any) -> Handle:
    """Write the number fields after the arrays and return the batch's handle."""
    offsets: dict[int, int] = {}
    leaves: list[Leaf] = []
    total = layout.array_bytes
    memory = maps.get(slot)
    start = HEADER_BYTES + space.offset
    for index in range(layout.width):
        if index in layout.arrays:
            view = layout.arrays[index]
            leaf = Leaf(view.shape, as_torch_dtype(view.dtype), _no_fill)  # type: ignore[arg-type]
            offsets[id(leaf)] = layout.offsets[index]
        else:
            leaf = plan_scalars(layout.numbers[index], None)  # raises as the default batchify does
            offsets[id(leaf)] = total
            leaf.fill(tensor_at(memory, start + total, leaf.shape, leaf.dtype))
            total += round_up(leaf.nbytes, ALIGN_BYTES)
        leaves.append(leaf)
    if layout.kind is np.ndarray:
        plan: Any = leaves[0]
    elif hasattr(layout.kind, "_fields"):
        plan = layout.kind(*leaves)
    else:
        plan = leaves  # the default batchify makes a list of any other sequence sample
    offset = space.offset
    space.offset += total
    return (slot[2], offset, total, encode(plan, lambda leaf: offsets[id(leaf)]), None)
