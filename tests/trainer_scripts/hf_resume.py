"""A transformers Trainer on a gloader DataLoader (random augmentations, dropout), 24 steps with a
checkpoint every 12, with `LoaderStateCallback`; or, given a checkpoint, resumed from it. Prints
{step: loss} as JSON. Run: python tests/trainer_scripts/hf_resume.py OUTPUT_DIR [CHECKPOINT]"""
from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import gloader
from gloader.integrations.transformers import LoaderStateCallback


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.dropout = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)}


class Augmented(gloader.Dataset):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(96, 8)).astype(np.float32)
        self.y = self.x.sum(1, keepdims=True).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"x": self.x[i] + 0.1 * np.random.normal(size=8).astype(np.float32), "y": self.y[i]}


class GloaderTrainer(Trainer):
    def get_train_dataloader(self) -> gloader.DataLoader:
        return gloader.DataLoader(self.train_dataset, batch_size=8, shuffle=True, num_workers=2)


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main() -> None:
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=sys.argv[1], max_steps=24, logging_steps=1, save_steps=12,
                             per_device_train_batch_size=8, report_to=[], use_cpu=True, ignore_data_skip=True,
                             learning_rate=0.01, seed=0, disable_tqdm=True)
    losses = Losses()
    trainer = GloaderTrainer(model=Model(), args=args, train_dataset=Augmented(),
                             callbacks=[losses, LoaderStateCallback()])
    trainer.train(resume_from_checkpoint=sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps(losses.losses))


if __name__ == "__main__":
    main()
