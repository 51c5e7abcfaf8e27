"""Which epoch a loader serves and where it stands: what iter(loader) opens (the next epoch,
or again a probe's: an iterator dropped before its first batch), the seeds drawn as torch
draws them, the dataset's changes followed between epochs, len(), and the position that
`state_dict()` saves and `load_state_dict()` restores. Runs in the caller's process; the
`DataLoader` facade delegates here, the flow is drawn in `_caller.engine`.
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

from .._sampling.schedule import Epoch, Schedule
from .._wire.seed import draw_base_seed
from .device import DevicePipeline
from .engine import Engine
from .iterator import EpochIterator, Position
from .options import LoaderConfig
from .stats import PipelineStats

__all__ = ["LatestIterator", "Serving"]

logger = logging.getLogger(__name__)


class LatestIterator:
    """A loader's newest iterator, held weakly: the loader's current one, and what its finalizer waits for."""

    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref: weakref.ref[EpochIterator] | None = None


class Serving:
    """A loader's epochs as the caller sees them. The current iterator is held weakly, in
    `latest` (an iterator the caller drops mid-epoch is noticed, see `_abandon`); where it
    stands, `position`, outlives it (state_dict)."""

    def __init__(self, config: LoaderConfig, schedule: Schedule, engine: Engine) -> None:
        self._options = config
        self._schedule = schedule
        self._engine = engine
        self.latest = LatestIterator()
        self.position: Position | None = None
        self._iterated = False  # iter() was called: torch's persistent workers draw no new base seed after
        self.reported_samples: int | None = None  # a stream's len(dataset), once len(loader) was taken

    @property
    def config(self) -> LoaderConfig:
        """The settings the epochs are served with."""
        return self._options

    def reconfigure(self, config: LoaderConfig) -> None:
        """Serve from now on with `config` (attributes set since the last iter()): the current
        iterator ends, workers started with the settings before stop, and the epoch opened ahead
        from them opens again."""
        self.end("an attribute of the DataLoader was set")
        self._engine.reconfigure(config)
        self._schedule.rewind_upcoming()
        self._options = config

    def iterate(self, stats: PipelineStats, device: DevicePipeline | None) -> EpochIterator:
        """The iterator of the epoch that iter(loader) serves now: the next one, or after a
        probe (an iterator dropped before its first batch) the probe's."""
        self._draw_as_torch_does()
        previous, position = self.current, self.position
        if previous is not None and previous.untouched:
            previous.stop("a newer iter(loader)", keep_epoch=True)
            epoch = self._probed_epoch(previous.epoch)
        elif previous is None and position is not None and not position.asked and not position.finished:
            epoch = self._probed_epoch(position.epoch)  # a probe dropped before use: the same
        else:
            self.end("a newer iter(loader)")
            self._follow_dataset_changes()
            self._redraw_stale_lookahead()
            epoch = self._schedule.open()
        iterator = EpochIterator(self._engine, self._schedule, epoch, stats, self._options, device)
        self.latest.ref = weakref.ref(iterator)
        self.position = iterator.position
        weakref.finalize(iterator, _abandon, self._engine, iterator.position)
        iterator.reported_samples = self.reported_samples
        return iterator

    @property
    def current(self) -> EpochIterator | None:
        """The current iterator while the caller holds it."""
        return self.latest.ref() if self.latest.ref is not None else None

    def _follow_dataset_changes(self) -> None:
        """Let the epoch about to start see changes the caller made to the dataset since the
        worker processes took their copy (`dataset.set_epoch(e)`, a new transform): the
        loader's own workers are restarted, as torch's non-persistent workers are every epoch;
        a shared WorkerPool's cannot be, which a warning says. See `_caller.snapshot` for what is seen."""
        changed = self._engine.workers.dataset_change()
        if changed is None:
            return
        if self._engine.workers.owned:
            logger.info("%s changed since the worker processes took their copy of the dataset: restarting them "
                        "for the epoch about to start", changed)
            self._engine.stop_workers()  # batches opened ahead, from the old copy, go with them
            self._schedule.rewind_upcoming()
            return
        self._engine.workers.accept_dataset()
        warnings.warn(f"{changed} changed since this DataLoader joined its WorkerPool, whose worker processes keep "
                      "the dataset as it was then; make a new DataLoader on the pool to load the changed dataset",
                      RuntimeWarning, stacklevel=4)

    def _draw_as_torch_does(self) -> None:
        """torch's DataLoader draws from torch's generators at every iter(), and nothing when it
        is built: its base seed (from `generator`, else the default generator; persistent
        workers reuse their iterator and draw it once) and, shuffling with its own RandomSampler
        without a generator, that sampler's seed. The same draws at the same moments leave
        torch's default generator where torch leaves it, so a model built after the loader, or
        dropout after iter(), draws the same numbers. The first base seed drawn is the loader's;
        the later draws only keep step with torch. With seed= (gloader's own, which torch code
        never passes) nothing is drawn: the caller's generators are left untouched."""
        config = self._options
        if config.seed is not None:
            return
        if not (self._iterated and config.persistent_workers):
            self._schedule.adopt_seed(draw_base_seed(config.generator))
        if config.own_shuffle and config.generator is None:
            draw_base_seed()
        self._iterated = True

    def _probed_epoch(self, epoch: Epoch) -> Epoch:
        """The epoch to serve after a probe (an iterator made and dropped before its first batch,
        as Lightning's): a probe does not use up an epoch, so its epoch (and its batches in
        flight) serve on, unless the caller set the sampler since it was drawn
        (`set_epoch(e)`): then it is drawn again, as if no probe had been made."""
        upcoming = self._schedule.upcoming
        drawn = [epoch] if upcoming is None else [epoch, upcoming]
        if self._schedule.keeps(drawn):
            return epoch
        for stale in drawn:
            self._engine.discard(stale.number)
        self._schedule.redraw(epoch)
        return self._schedule.open()

    def _redraw_stale_lookahead(self) -> None:
        """The epoch opened ahead was drawn for a dataset length that has changed since (a
        growing replay buffer), or before the caller's `loader.sampler.set_epoch(e)`: drop its
        batches in flight and draw it again when opened."""
        upcoming = self._schedule.upcoming
        if upcoming is not None and not self._schedule.keeps([upcoming]):
            self._engine.discard(upcoming.number)
            self._schedule.redraw(upcoming)

    def end(self, reason: str) -> None:
        """End the current iterator (`reason` says why, in the error it then raises)."""
        iterator, position = self.current, self.position
        if iterator is not None:
            iterator.stop(reason)
        elif position is not None and not position.finished and position.asked:
            self._engine.discard(position.epoch.number)  # dropped mid-epoch: its batches in flight go

    def served(self) -> tuple[Any, int, bool]:
        """(the epoch served, batches of it yielded, whether it is finished)."""
        position = self.position
        return (None, 0, False) if position is None else (position.epoch, position.yielded, position.finished)

    def length(self) -> int:
        """len(loader): batches in the epoch served now (or next); a stream's estimate from len(dataset)."""
        if self._options.stream is not None:
            if self._options.stream_batches is None:
                raise TypeError("a DataLoader over an IterableDataset has no length: the stream decides when "
                                "it ends (give the dataset __len__ for torch's estimate)")
            self.reported_samples = len(self._options.dataset)  # epochs that outrun it warn from now on
            if self.current is not None and not self.current.finished:
                self.current.reported_samples = self.reported_samples
            return self._options.stream_batches
        if self.position is None or self.position.finished:
            self._redraw_stale_lookahead()  # between epochs: the next one's length as the dataset is now
        length = self._schedule.length(self.served()[0], self.served()[2])
        if length is None:
            raise TypeError("this DataLoader's batch_sampler has no __len__")
        return length

    def state_dict(self) -> dict[str, Any]:
        """See `DataLoader.state_dict`."""
        if self._options.stream is not None:
            raise TypeError("state_dict needs a map-style dataset; an IterableDataset stream has no "
                            "positions to resume from")
        served = self.served()
        if served[0] is not None and not served[2] and self._engine.reordered_epoch == served[0].number:
            raise ValueError(f"state_dict() in the middle of epoch {served[0].number}, which in_order=False served "
                             "out of order: a position cannot say which of its batches you have; take it "
                             "between epochs, or use in_order=True")
        return self._schedule.state_dict(*served)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See `DataLoader.load_state_dict`."""
        self.end("load_state_dict")
        self.latest.ref, self.position = None, None
        self._engine.discard()
        self._schedule.load_state_dict(state)


def _abandon(engine: Engine, position: Position) -> None:
    """The caller dropped an iterator mid-epoch (`position`: where it stood; the finalizer of
    the iterator calls this): thread workers skip the epoch's batches they have not begun,
    which would otherwise go on drawing from the process's generators. Only flags are set,
    whatever thread the collector runs in; the next iter() discards."""
    if position.asked and not position.finished:
        engine.tasks.skip(position.epoch.number)
