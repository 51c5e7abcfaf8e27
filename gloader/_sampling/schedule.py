"""Epochs as numbered batches: which batches, in which order, with which seeds, resumable.

`Schedule` owns the batch sampler, the epoch counter, the resume skip and the lookahead (an
epoch opened early so its first batches can be dispatched before the caller asks). An
`Epoch` hands out its batches one by one and knows, as soon as its last batch is taken,
that it is exhausted; `state_dict` only reads (between epochs, the sampler's own state).
Runs in the caller's process; the flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np

from .._checks import is_int
from .._wire.protocol import Job, Placed, StreamRequest, encode_keys
from .._wire.seed import derive_batch_seed, derive_epoch_seed, draw_base_seed
from .elastic import GlobalBatchSampler
from .samplers import BatchSampler
from .state import check_fields, check_made_for, made_for

__all__ = ["Epoch", "Schedule"]

def encoded_batches(batch_sampler: Any, epoch_seed: int = 0) -> Iterator[Any]:
    """One epoch of `batch_sampler`, each batch's keys as `encode_keys` encodes them; straight
    from the epoch's index array when the samplers make one (~15 us a batch of 256 less); for a
    sampler of a global order, with each batch's place in it (`Placed`, seeded by `epoch_seed`)."""
    if isinstance(batch_sampler, GlobalBatchSampler):
        return (Placed(encode_keys(keys), first, epoch_seed) for first, keys in batch_sampler._placed_batches())
    arrays = batch_sampler._index_batches() if isinstance(batch_sampler, BatchSampler) else None
    if arrays is None:
        own = isinstance(batch_sampler, BatchSampler) and type(batch_sampler).__iter__ is BatchSampler.__iter__
        return map(encode_keys, batch_sampler._batches() if own else batch_sampler)
    return map(np.ndarray.tobytes, arrays)


def _set_count(sampler: Any) -> int | None:
    """How often the caller set `sampler`'s state, where it counts that (gloader's samplers)."""
    count = getattr(sampler, "_set_count", None)
    return count if isinstance(count, int) else None


class Epoch:
    """One epoch's batches, numbered from 0; the first `skipped` were served before a resume.

    Args:
        length: batches in the whole epoch, or None when unknown (a stream).
        start_state: the batch sampler's state before the epoch (None for streams).
    """

    def __init__(self, number: int, length: int | None, start_state: Any, batches: Iterator[tuple[int, Any]],
                 skipped: int) -> None:
        self.number = number
        self.length = length
        self.start_state = start_state
        self.skipped = skipped
        self.samples: int | None = None  # len(index sampler) when the epoch was drawn
        self.drawn_inner: Any = None  # the index sampler's state just after drawing it
        self.drawn_view: Any = None  # what can be seen of it then (`Schedule._inner_view`)
        self.exhausted = False
        self._batches = batches
        self._failed: Exception | None = None  # raised by the sampler while reading ahead: given at its turn
        self._next = self._advance()

    def _advance(self) -> tuple[int, Any] | None:
        item = next(self._batches, None)
        if item is None:
            self.mark_exhausted()
        return item

    def mark_exhausted(self) -> None:
        """No batch is left to hand out (for a stream: every worker's shard has ended)."""
        self.exhausted = True

    def take(self) -> tuple[int, Any] | None:
        """The next (index, work), or None when the epoch is exhausted."""
        item = self._next
        if item is not None and not self.exhausted:
            try:
                self._next = self._advance()  # one batch ahead, so that the end is known when it comes
            except Exception as exc:
                self._next, self._failed = None, exc
            return item
        if self._failed is not None:
            error, self._failed = self._failed, None
            raise error
        return None

    @property
    def remaining(self) -> int | None:
        """Batches the epoch serves after its skip (its length as a loader reports it)."""
        return None if self.length is None else self.length - self.skipped


class Schedule:
    """Opens epochs from a batch sampler (or a stream request) and derives each batch's seed.

    Args:
        batch_sampler: yields lists of sample keys; None for a stream.
        stream: the request every stream task carries; None for a map-style dataset.
        base_seed: the loader's base seed; None: the first one offered (`adopt_seed`), or
            drawn with `draw_seed` where one is needed before that.
        lookahead: whether the next epoch may be opened before the caller asks for it.
        draw_seed: draws a base seed.
        seeded_sampler: the loader's own RandomSampler, which takes the base seed as its seed.
    """

    def __init__(self, batch_sampler: Any, stream: StreamRequest | None, base_seed: int | None, lookahead: bool,
                 draw_seed: Callable[[], int] = draw_base_seed, seeded_sampler: Any = None) -> None:
        self._sampler = batch_sampler
        self._stream = stream
        self._base_seed = base_seed
        self._given_seed = base_seed  # seed= as given (None: drawn), what a state must have been made for
        self._draw_seed = draw_seed
        self._seeded_sampler = seeded_sampler
        self._lookahead = lookahead
        self._next_number = 0
        self._resume_skip = 0
        self._upcoming: Epoch | None = None
        self._seen_sets: int | None = None  # the index sampler's count of set calls after the last draw or load

    @property
    def base_seed(self) -> int:
        """The loader's base seed (drawn now if none was given or offered yet)."""
        self._ensure_seed()
        assert self._base_seed is not None
        return self._base_seed

    def _ensure_seed(self) -> None:
        """Draw the base seed if none was given or offered yet: the loader's own RandomSampler
        takes it as its seed, which it needs before it draws an epoch."""
        if self._base_seed is None:
            self.adopt_seed(self._draw_seed())

    def adopt_seed(self, seed: int) -> None:
        """Take `seed` as the base seed, unless one is set already; the loader's own
        RandomSampler takes it too."""
        if self._base_seed is None:
            self._base_seed = seed
            if self._seeded_sampler is not None:
                self._seeded_sampler._seed = seed

    def _sampler_state(self) -> Any:
        return self._sampler.state_dict() if hasattr(self._sampler, "state_dict") else None

    def _new_epoch(self) -> Epoch:
        number, self._next_number = self._next_number, self._next_number + 1
        if self._stream is not None:
            request = self._stream
            return Epoch(number, None, None, ((i, request) for i in itertools.count()), 0)
        skip, self._resume_skip = self._resume_skip, 0
        length = len(self._sampler) if hasattr(self._sampler, "__len__") else None
        self._ensure_seed()
        prepare = getattr(getattr(self._sampler, "sampler", None), "_prepare_epoch", None)
        if prepare is not None:  # a seedless RandomSampler draws the epoch's seed before the state is taken
            prepare()
        start_state = self._sampler_state()
        batches = enumerate(encoded_batches(self._sampler, derive_epoch_seed(self.base_seed, number)))
        for _ in range(skip):
            next(batches, None)
        epoch = Epoch(number, length, start_state, batches, skip)
        epoch.samples = self._samples()
        epoch.drawn_inner = self._inner_state()
        epoch.drawn_view = self._inner_view()
        self._mark_seen()
        return epoch

    def _inner(self) -> Any:
        return getattr(self._sampler, "sampler", None)

    def _samples(self) -> int | None:
        inner = self._inner()
        return len(inner) if hasattr(inner, "__len__") else None

    def _inner_state(self) -> Any:
        inner = self._inner()
        return inner.state_dict() if hasattr(inner, "state_dict") else None

    def _inner_view(self) -> Any:
        """The index sampler's state, or for one without `state_dict` its `epoch` where it has one
        (torch's DistributedSampler): what tells that the caller set it since a draw."""
        state = self._inner_state()
        if state is None:
            epoch = getattr(self._inner(), "epoch", None)
            return {"epoch": epoch} if is_int(epoch) else None
        return state

    def _mark_seen(self) -> None:
        """The index sampler's state, as it is now, is the schedule's own doing (a draw, a load)."""
        self._seen_sets = _set_count(self._inner())

    def _caller_set_sampler(self, last: Epoch) -> bool:
        """Whether the caller set the index sampler (`set_epoch`, `load_state_dict`) since the
        schedule last drew from it or loaded it. gloader's samplers count those calls, so a call
        that sets the very state a draw left (`set_epoch(e)` right after epoch e was drawn ahead)
        is still seen; another sampler is judged by its state against the one `last` left."""
        count = _set_count(self._inner())
        if count is not None:
            return count != self._seen_sets
        return last.drawn_view is not None and self._inner_view() != last.drawn_view

    def keeps(self, drawn: list[Epoch]) -> bool:
        """Whether the epochs drawn but not yet served (`drawn`, oldest first: a dropped probe's
        epoch, the epoch opened ahead) are the ones the caller would get by drawing now, so that
        drawing ahead is invisible. They are not when the dataset's length changed since (the
        loader's samplers follow it), or when the caller set the index sampler to another state
        than the one the first of them was drawn from (`loader.sampler.set_epoch(e)` before
        iter(), as torch and Lightning do). A sampler set back to that very state keeps them, and
        is moved on to where drawing them left it."""
        if not drawn:
            return True
        first, last = drawn[0], drawn[-1]
        if any(epoch.samples is not None and epoch.samples != self._samples() for epoch in drawn):
            return False
        if not self._caller_set_sampler(last):
            return True
        now = self._inner_state()
        if first.drawn_inner is None or last.drawn_inner is None or not isinstance(first.start_state, Mapping):
            return False
        if now != first.start_state.get("sampler"):
            return False
        self._inner().load_state_dict(last.drawn_inner)  # what it asks for is what was drawn
        self._mark_seen()
        return True

    @property
    def upcoming(self) -> Epoch | None:
        """The epoch opened ahead, if any."""
        return self._upcoming

    def redraw(self, first: Epoch) -> None:
        """Draw again from `first` on (a dropped probe's epoch, or the epoch opened ahead), whose
        batches in flight were discarded: the next `open` draws epoch `first.number` anew, with a
        state the caller gave the index sampler since it was drawn."""
        now = self._inner_state()
        given = now is not None and self._caller_set_sampler(self._upcoming or first)
        self._upcoming = first
        self.rewind_upcoming()
        if given and hasattr(self._inner(), "load_state_dict"):
            self._inner().load_state_dict(now)
            self._mark_seen()

    def open(self) -> Epoch:
        """The epoch the next iterator serves: the one opened ahead, or a new one."""
        epoch, self._upcoming = self._upcoming or self._new_epoch(), None
        return epoch

    def rewind_upcoming(self) -> None:
        """The epoch opened ahead opens again from its start (its batches in flight were
        discarded, and the next `open` must dispatch them anew, with the same seeds)."""
        upcoming, self._upcoming = self._upcoming, None
        if upcoming is None:
            return
        if upcoming.start_state is not None and hasattr(self._sampler, "load_state_dict"):
            self._sampler.load_state_dict(upcoming.start_state)
            self._mark_seen()
        self._next_number = upcoming.number
        self._resume_skip = upcoming.skipped

    def next_job(self, current: Epoch) -> Job | None:
        """The next batch to dispatch: `current`'s, then (with lookahead) the next epoch's first."""
        epoch: Epoch | None = current
        if current.exhausted:
            if not self._lookahead:
                return None
            if self._upcoming is None:
                self._upcoming = self._new_epoch()
            epoch = self._upcoming
        item = epoch.take() if epoch is not None else None
        if item is None or epoch is None:
            return None
        index, work = item
        return Job(epoch.number, index, derive_batch_seed(self.base_seed, epoch.number, index), work)

    def length(self, served: Epoch | None, finished: bool) -> int | None:
        """Batches in the whole epoch the current (or next) iterator serves, those a resumed
        epoch skips included (torch's StatefulDataLoader counts them; Lightning relies on it)."""
        if served is not None and not finished:
            return served.length
        if self._upcoming is not None:
            return self._upcoming.length
        if self._stream is not None or not hasattr(self._sampler, "__len__"):
            return None
        return len(self._sampler)

    def state_dict(self, served: Epoch | None, yielded: int, finished: bool) -> dict[str, Any]:
        """Where the caller stands, given the epoch its latest iterator serves and the batches of
        it handed over (`yielded`, the resume's skip included); reads only (but for the base
        seed, drawn now if none was yet, which the loader's own RandomSampler then takes too)."""
        self._ensure_seed()
        if served is not None and not finished and not (
                served.exhausted and served.length is not None and yielded >= served.length):
            if yielded == served.skipped:  # none handed over yet: as it will be drawn again if it must
                return self._state(served.number, yielded, self._as_served(served, self._upcoming or served))
            return self._state(served.number, yielded, served.start_state)
        upcoming = self._upcoming
        if upcoming is not None:  # the next epoch, opened ahead; as it will be drawn again if it must
            return self._state(upcoming.number, upcoming.skipped, self._as_served(upcoming, upcoming))
        if served is not None and served.exhausted:  # the caller has the whole epoch
            return self._state(served.number + 1, 0, self._sampler_state())
        return self._state(self._next_number, self._resume_skip, self._sampler_state())

    def _as_served(self, first: Epoch, last: Epoch) -> Any:
        """The batch sampler's state at the start of `first`, drawn but not served, as it will be
        served: with the index sampler's state the caller set since (`last`: the latest drawn)."""
        state = first.start_state
        if isinstance(state, Mapping) and self._caller_set_sampler(last):
            state = {**state, "sampler": self._inner_state()}
        return state

    def _state(self, epoch: int, yielded: int, sampler_state: Any) -> dict[str, Any]:
        return {"epoch": epoch, "batches_yielded": yielded, "sampler": sampler_state, "seed": self.base_seed,
                "made_for": made_for(self._sampler, self._samples(), sampler_state, yielded, encoded_batches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: the next epoch opened is the saved one, minus its served batches.

        Raises:
            TypeError: when `state` is not a mapping.
            ValueError: when `state` lacks a key that `state_dict` writes or holds an impossible value.
        """
        check_fields(state)
        self._upcoming = None
        previous = self._sampler_state()
        if state["sampler"] is not None and hasattr(self._sampler, "load_state_dict"):
            self._sampler.load_state_dict(state["sampler"])
            self._mark_seen()
        try:
            length = len(self._sampler) if hasattr(self._sampler, "__len__") else None
            if length is not None and state["batches_yielded"] > length:
                raise ValueError(f"state['batches_yielded']={state['batches_yielded']} exceeds the {length} batches "
                                 "of the saved epoch; pass a state made by this loader's state_dict()")
            check_made_for(state, self._given_seed, made_for(self._sampler, self._samples(), state["sampler"],
                                                             int(state["batches_yielded"]), encoded_batches))
        except ValueError:  # the loader stays where it was
            if previous is not None and hasattr(self._sampler, "load_state_dict"):
                self._sampler.load_state_dict(previous)
                self._mark_seen()
            raise
        self._next_number = int(state["epoch"])
        self._resume_skip = int(state["batches_yielded"])
        self._base_seed = int(state["seed"])
        if self._seeded_sampler is not None and self._seeded_sampler._seed is None:
            self._seeded_sampler._seed = self._base_seed  # as adopt_seed gives it
