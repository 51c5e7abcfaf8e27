"""Device-transfer workload of the benchmark (`python -m gloader.bench --workloads W7`).

W7 host-to-device: W2's image batches delivered on a CUDA device, gloader with
`pin_memory=True, device=...` (pinning in a background thread, copy on a side stream one batch
ahead) versus torch's DataLoader with `pin_memory=True` and `.to(device, non_blocking=True)` in
the loop, side by side, as GB/s reaching the device; and, as the ceiling of the copy itself, a
plain loop that copies one already-pinned batch over and over with no loader at all. Skipped
where CUDA is absent.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import gloader

from .datasets import ImageDataset

__all__ = ["measure_device_transfer"]


def _gb_per_s(loader: Any, batches: int, move: bool, device: torch.device) -> float:
    it = iter(loader)
    next(it)
    torch.cuda.synchronize(device)
    moved = 0
    start = time.perf_counter()
    for _ in range(batches):
        try:
            images, labels = next(it)
        except StopIteration:
            it = iter(loader)
            images, labels = next(it)
        if move:
            images = images.to(device, non_blocking=True)
        moved += images.numel() * images.element_size()
        images.float().mean()  # a kernel that reads the batch on the caller's stream
    torch.cuda.synchronize(device)
    return moved / (time.perf_counter() - start) / 1e9


def _copy_loop_gb_per_s(batches: int, device: torch.device) -> float:
    """A pinned W2 batch copied `batches` times with no loader: the link's own speed here."""
    images = torch.zeros((64, 224, 224, 3), dtype=torch.uint8).pin_memory()
    images.to(device, non_blocking=True).float().mean()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(batches):
        images.to(device, non_blocking=True).float().mean()
    torch.cuda.synchronize(device)
    return batches * images.numel() / (time.perf_counter() - start) / 1e9


def measure_device_transfer(quick: bool, rounds: int) -> dict[str, Any]:
    """W7 per round: GB/s of image batches reaching the GPU, gloader vs torch."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    device = torch.device("cuda", 0)
    dataset: Any = ImageDataset(4_000)
    batches = 30 if quick else 120
    gl = gloader.DataLoader[Any](dataset, batch_size=64, shuffle=True, num_workers=2, pin_memory=True, device=device)
    th: Any = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2, pin_memory=True,
                                          persistent_workers=True)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "gloader": [], "torch": [],
                           "copy_loop": []}
    try:
        for r in range(rounds):
            order = [("gloader", gl, False), ("torch", th, True)]
            for name, loader, move in (order if r % 2 == 0 else order[::-1]):
                out[name].append(_gb_per_s(loader, batches, move, device))
            out["copy_loop"].append(_copy_loop_gb_per_s(batches, device))
    finally:
        gl.close()
    return out


def report_device(results: dict[str, Any]) -> list[str]:
    """Markdown lines for W7."""
    if "W7" not in results:
        return []
    w7 = results["W7"]
    if "skipped" in w7:
        return ["", f"W7 host-to-device: skipped ({w7['skipped']})"]
    g, t = w7["gloader"], w7["torch"]
    ratio = [a / b for a, b in zip(g, t)]
    lines = ["", f"| W7 W2 batches to {w7['device']} | gloader GB/s | torch GB/s | gloader/torch |", "|---|---|---|---|",
             f"| pin_memory + device | {_summary(g)} | {_summary(t)} | {statistics.median(ratio):.2f}x |"]
    if w7.get("copy_loop"):
        lines.append(f"| plain loop copying one pinned batch, no loader (the copy's ceiling) | "
                     f"{_summary(w7['copy_loop'])} | | |")
    return lines


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
