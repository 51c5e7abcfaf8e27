"""Synthetic datasets of the benchmark: made from the index, nothing is downloaded."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["CpuBoundDataset", "ImageDataset", "TinyDataset", "calibrate_cpu_work", "has_huggingface_datasets",
           "huggingface_table"]


class TinyDataset:
    """W1: sample i is (float32[16] filled from i, i)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        return np.arange(16, dtype=np.float32) + idx, idx


class ImageDataset:
    """W2: sample i is (uint8 224x224x3 filled from i, i)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        return np.full((224, 224, 3), idx % 251, dtype=np.uint8), idx


class CpuBoundDataset:
    """W3: sample i costs `size` elements of sin/cos work (about 0.5 ms once calibrated)."""

    def __init__(self, length: int, size: int) -> None:
        self.length = length
        self.size = size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        x = np.linspace(0.0, float(idx % 97), self.size)
        y = np.sin(x) * np.cos(x * 0.5) + np.sqrt(x + 1.0)
        return y[:64].astype(np.float32), idx


def calibrate_cpu_work(target_s: float = 0.5e-3) -> int:
    """Return the work size that makes one CpuBoundDataset sample take about `target_s`."""
    size = 20_000
    for _ in range(4):
        probe = CpuBoundDataset(64, size)
        start = time.perf_counter()
        for i in range(64):
            probe[i]
        per_sample = (time.perf_counter() - start) / 64
        size = max(1000, int(size * target_s / per_sample))
    return size


def has_huggingface_datasets() -> bool:
    """Whether the optional `datasets` package (W9) is installed."""
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def huggingface_table(length: int) -> Any:
    """W9: a HuggingFace `datasets` table of `length` rows (x: float32[64], label) in torch format."""
    import datasets

    rows = np.random.default_rng(0)
    table = datasets.Dataset.from_dict({"x": rows.random((length, 64), dtype=np.float32),
                                        "label": np.arange(length) % 10})
    return table.with_format("torch")
