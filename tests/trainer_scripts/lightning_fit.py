"""A Lightning fit on a gloader DataLoader, as a user writes it: `seed_everything(workers=True)`
(which sets the loader's worker_init_fn) and a dataset with random augmentations. Prints the
per-step losses as JSON. Run: python tests/trainer_scripts/lightning_fit.py NUM_WORKERS"""
from __future__ import annotations

import json
import sys

import lightning as L
import numpy as np
import torch

import gloader


class Noisy(gloader.Dataset):
    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(64, 4)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.x[i] + np.random.normal(size=4).astype(np.float32)  # an augmentation


class Model(L.LightningModule):
    def __init__(self, workers: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.workers = workers
        self.losses: list[float] = []

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> gloader.DataLoader:
        return gloader.DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=self.workers)


def main() -> None:
    L.seed_everything(0, workers=True, verbose=False)
    model = Model(int(sys.argv[1]))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model)
    loader = trainer.train_dataloader
    print(json.dumps({"losses": model.losses, "worker_init_fn": getattr(loader.worker_init_fn, "func", loader.worker_init_fn).__name__}))


if __name__ == "__main__":
    main()
