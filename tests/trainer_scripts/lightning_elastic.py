"""A Lightning DDP fit on gloader with a DistributedBatchSampler: each rank records the samples
of every step it trains (and their random draws). Run on RANKS processes (CPU, gloo) with a
checkpoint every STOP steps, or on RANKS resuming from a checkpoint. Writes OUT.rank<r>.json.

Run: python tests/trainer_scripts/lightning_elastic.py RANKS OUT [CHECKPOINT_DIR STOP | --resume CKPT]"""
from __future__ import annotations

import json
import sys
from typing import Any

import lightning as L
import numpy as np
import torch

import gloader
from gloader.sampler import DistributedBatchSampler, RandomSampler

GLOBAL_BATCH = 8


class Drawn(gloader.Dataset):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.rand()], dtype=np.float32)  # an augmentation's draw


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[list[float]]]] = []

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        self.seen.append((self.global_step, batch.tolist()))
        return self.layer(batch[:, 1:]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> gloader.DataLoader:
        replicas, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedBatchSampler(RandomSampler(100, seed=1), GLOBAL_BATCH // replicas, replicas, rank)
        return gloader.DataLoader(Drawn(), batch_sampler=sampler, num_workers=2, seed=5)


def main() -> None:
    ranks, out = int(sys.argv[1]), sys.argv[2]
    resume = sys.argv[4] if sys.argv[3] == "--resume" else None
    callbacks: list[Any] = []
    if resume is None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=sys.argv[3], every_n_train_steps=int(sys.argv[4]),
                                                             save_top_k=-1, filename="{step}"))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=ranks, strategy="ddp" if ranks > 1 else "auto",
                        use_distributed_sampler=False, enable_progress_bar=False, logger=False,
                        enable_model_summary=False, callbacks=callbacks, enable_checkpointing=resume is None)
    model = Model()
    trainer.fit(model, ckpt_path=resume)
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as handle:
        json.dump(model.seen, handle)


if __name__ == "__main__":
    main()
