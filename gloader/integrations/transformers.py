"""gloader under the transformers Trainer: an epoch resumed mid-way loads in gloader, exactly.

The Trainer resumes an epoch by skipping its first batches with Accelerate's
`skip_first_batches`, which builds a torch DataLoader from the loader's attributes: the rest of
that epoch loaded in torch's loader, not gloader's, and its batches were not the uninterrupted
run's (0 of 12 per-step losses equal). `LoaderStateCallback` has gloader resume instead: it
writes the loader's `state_dict()` into each checkpoint, and loads it back when training
resumes from one; `TrainingArguments(ignore_data_skip=True)` keeps the Trainer from skipping
batches itself::

    class MyTrainer(Trainer):
        def get_train_dataloader(self):
            return gloader.DataLoader(self.train_dataset, batch_size=self.args.train_batch_size,
                                      shuffle=True, collate_fn=self.data_collator, num_workers=2)

    args = TrainingArguments(output_dir="out", ignore_data_skip=True, ...)
    trainer = MyTrainer(model, args, train_dataset=..., callbacks=[LoaderStateCallback()])
    trainer.train(resume_from_checkpoint=True)

Checkpoints are looked for where the Trainer writes them (`args.output_dir/checkpoint-<step>`).
With gradient accumulation, an epoch whose batch count is not a multiple of
`gradient_accumulation_steps` ends its resumed run without the optimizer step of its last,
shorter accumulation (the Trainer counts a resumed epoch's batches from 0 when it skips none),
so resume such an epoch only at its start, or keep its batch count a multiple.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..loader import DataLoader

__all__ = ["STATE_FILE", "LoaderStateCallback"]

logger = logging.getLogger(__name__)

STATE_FILE = "gloader_loader_state.json"


class LoaderStateCallback(TrainerCallback):
    """Save the training loader's position into each checkpoint and resume from it.

    Raises (when training begins):
        TypeError: the Trainer's training loader is not a gloader DataLoader (override
            `get_train_dataloader` to return one; the Trainer's own is torch's).
        ValueError: `ignore_data_skip` is not set: the Trainer would skip the resumed epoch's
            batches in a torch DataLoader of its own.
    """

    def __init__(self) -> None:
        self._loader: DataLoader[Any] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        if not isinstance(train_dataloader, DataLoader):
            raise TypeError(f"LoaderStateCallback resumes a gloader DataLoader, but the Trainer trains on "
                            f"{type(train_dataloader).__name__}; override get_train_dataloader() to return a "
                            "gloader.DataLoader")
        if not args.ignore_data_skip:
            raise ValueError("LoaderStateCallback resumes the loader itself; set TrainingArguments("
                             "ignore_data_skip=True), or the Trainer skips a resumed epoch's first batches by "
                             "loading them in a torch DataLoader of its own")
        self._loader = train_dataloader
        if state.global_step == 0:
            return
        path = os.path.join(_checkpoint(args, state), STATE_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                saved = json.load(handle)
        except FileNotFoundError:
            logger.warning("training resumes at step %d, but %s is missing (a checkpoint saved without "
                           "LoaderStateCallback): the loader starts its epoch from the beginning", state.global_step,
                           path)
            return
        train_dataloader.load_state_dict(saved)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._loader is None or not state.is_world_process_zero:
            return
        path = os.path.join(_checkpoint(args, state), STATE_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(self._loader.state_dict(), handle)
        os.replace(path + ".tmp", path)


def _checkpoint(args: Any, state: Any) -> str:
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
