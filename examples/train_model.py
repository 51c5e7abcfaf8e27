"""Train a small torch model with train and val loaders sharing one WorkerPool.

Shows: ArrayDataset + transform_first augmentation, shuffle with a seed, last_batch='rollover'
for training and 'keep' for validation, a shared pool, loader.stats() to see whether
training waits for input.

Run: python examples/train_model.py
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from gloader import ArrayDataset, DataLoader, WorkerPool


def make_data(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two Gaussian blobs in 16 dimensions: label = which blob."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    features = rng.normal(size=(count, 16)).astype(np.float32) + labels[:, None].astype(np.float32) * 1.5
    return features, labels


def jitter(x: np.ndarray) -> np.ndarray:
    """Augmentation drawn from numpy's global generator: reproducible thanks to seed=."""
    return x + np.random.normal(scale=0.05, size=x.shape).astype(np.float32)


def main(epochs: int = 3, num_workers: int = 2) -> float:
    """Train; returns the final validation accuracy."""
    torch.manual_seed(0)
    train = ArrayDataset(*make_data(4000, seed=1)).transform_first(jitter)
    val = ArrayDataset(*make_data(1000, seed=2))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accuracy = 0.0
    with WorkerPool(num_workers) as pool, \
            DataLoader(train, batch_size=64, shuffle=True, last_batch="rollover", seed=0, pool=pool) as train_loader, \
            DataLoader(val, batch_size=256, pool=pool) as val_loader:
        for epoch in range(epochs):
            model.train()
            for x, y in train_loader:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            model.eval()
            correct = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += int((model(x).argmax(dim=1) == y).sum())
            accuracy = correct / len(val)
            sys.stdout.write(f"epoch {epoch}: loss {loss.item():.3f}, val accuracy {accuracy:.3f}\n")
        waited = train_loader.stats()["total"]["wait_fraction"]
        sys.stdout.write(f"training waited for input {waited:.0%} of the time\n")
    return accuracy


if __name__ == "__main__":
    main()
