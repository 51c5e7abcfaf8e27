"""Synthetic datasets of the benchmark: made from the index, nothing is downloaded."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["BatchedTable", "CpuBoundDataset", "ImageDataset", "JpegFolder", "TinyDataset", "calibrate_cpu_work",
           "has_huggingface_datasets", "has_pillow", "huggingface_table", "write_jpeg_folder"]


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


def has_pillow() -> bool:
    """Whether Pillow (W8's JPEG decoding) is installed."""
    import importlib.util

    return importlib.util.find_spec("PIL") is not None


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


class BatchedTable:
    """W10: `length` rows of (float32[64], int label) in numpy arrays, with torch's batched
    `__getitems__` written as a user writes it: one fancy index per batch, then the list of
    samples that the protocol asks for (row views of that copy, and the labels)."""

    def __init__(self, length: int) -> None:
        self.x = np.random.default_rng(0).random((length, 64), dtype=np.float32)
        self.labels = np.arange(length) % 10

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> Any:
        return self.x[idx], int(self.labels[idx])

    def __getitems__(self, keys: list[int]) -> list[Any]:
        return list(zip(self.x[keys], self.labels[keys].tolist()))


def write_jpeg_folder(root: str, count: int, classes: int = 10, size: tuple[int, int] = (500, 375)) -> None:
    """W8: write `count` JPEGs (`size`, quality 90) into `root/class_k/`, as an ImageFolder
    of photos is laid out. Each image is a smooth colour field with noise, so that it
    compresses as a photo does, not as a flat colour."""
    import os

    from PIL import Image

    rng = np.random.default_rng(0)
    width, height = size
    # One large field and one noise buffer; each image is a window of both at a random offset.
    ys, xs = np.mgrid[0:2 * height, 0:2 * width].astype(np.float32)
    field = np.stack([np.sin(xs / (40 + 9 * c) + ys / (55 + 7 * c) + c) for c in range(3)], axis=-1)
    base = (127 + 100 * field).astype(np.int16)
    noise = rng.normal(0, 12, base.shape).astype(np.int16)
    for k in range(classes):
        os.makedirs(os.path.join(root, f"class_{k}"), exist_ok=True)
    for i in range(count):
        y, x, ny, nx = rng.integers(0, height), rng.integers(0, width), rng.integers(0, height), rng.integers(0, width)
        pixels = (base[y:y + height, x:x + width] + noise[ny:ny + height, nx:nx + width]).clip(0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(os.path.join(root, f"class_{i % classes}", f"{i:05d}.jpg"), quality=90)


_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255


class JpegFolder:
    """W8: an ImageFolder of JPEGs with the classic ImageNet training transform, in PIL and
    numpy: decode, random resized crop (scale 0.08-1, ratio 3/4-4/3) to `out` x `out`,
    horizontal flip half the time, normalize; sample i is (float32[3, out, out], class)."""

    def __init__(self, root: str, out: int = 224) -> None:
        import os

        self.out = out
        names = sorted(os.listdir(root))
        self.files = [(os.path.join(root, name, f), k) for k, name in enumerate(names)
                      for f in sorted(os.listdir(os.path.join(root, name)))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx: int) -> Any:
        import math
        import random

        from PIL import Image

        path, label = self.files[idx]
        with Image.open(path) as file:
            image = file.convert("RGB")
        width, height = image.size
        box = (0, 0, width, height)
        for _ in range(10):
            area = width * height * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                x, y = random.randint(0, width - w), random.randint(0, height - h)
                box = (x, y, x + w, y + h)
                break
        pixels = np.asarray(image.resize((self.out, self.out), Image.Resampling.BILINEAR, box=box), dtype=np.float32)
        if random.random() < 0.5:
            pixels = pixels[:, ::-1]
        return np.ascontiguousarray(((pixels - _MEAN) / _STD).transpose(2, 0, 1)), label
