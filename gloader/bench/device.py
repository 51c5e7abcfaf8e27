"""Device-transfer workload of the benchmark (`python -m gloader.bench --workloads W7`).

W7 host-to-device: W2's image batches delivered on a CUDA device, gloader with
`pin_memory=True, device=...` (pinning in a background thread, copy on a side stream one batch
ahead) versus torch's DataLoader with `pin_memory=True` and `.to(device, non_blocking=True)` in
the loop, side by side, as GB/s reaching the device; as the ceiling of the copy itself, a plain
loop that copies one already-pinned batch over and over with no loader at all; and as the
ceiling of making the batches, the same gloader loader with neither pinning nor a device. With
2 workers and, where the machine has the cores, more. Skipped where CUDA is absent.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

import gloader

from .datasets import ImageDataset
from .figures import summary

__all__ = ["measure_device_transfer"]


def _gb_per_s(loader: Any, batches: int, move: bool, device: torch.device, on_device: bool = True) -> float:
    """GB/s of images the loop receives; `on_device`: each batch is read by a kernel there
    (False: the host batches are only counted, what the loader makes without a GPU)."""
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
        if on_device:
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


def _worker_counts() -> list[int]:
    """2 workers, as every workload; and more where the machine has the cores, so that making
    the batches is not what limits the rate and the transfer path itself is measured."""
    return sorted({2, max(2, min(8, (os.cpu_count() or 2) // 2))})


def measure_device_transfer(quick: bool, rounds: int) -> dict[str, Any]:
    """W7 per round: GB/s of image batches reaching the GPU, gloader vs torch, per worker count."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    device = torch.device("cuda", 0)
    dataset: Any = ImageDataset(4_000)
    batches = 30 if quick else 400  # 3.8 GB a turn: ~0.1 s at the copy's speed
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "copy_loop": [], "workers": {}}
    for workers in _worker_counts():
        gl = gloader.DataLoader[Any](dataset, batch_size=64, shuffle=True, num_workers=workers, pin_memory=True,
                                     device=device)
        th: Any = torch.utils.data.DataLoader(dataset, batch_size=64, shuffle=True, num_workers=workers,
                                              pin_memory=True, persistent_workers=True)
        # The same loader without pinning or a device: how fast the workers make the batches,
        # which bounds any delivery to the GPU.
        host = gloader.DataLoader[Any](dataset, batch_size=64, shuffle=True, num_workers=workers)
        rates: dict[str, list[float]] = {"gloader": [], "torch": [], "gloader_host": []}
        try:
            for r in range(rounds):
                order = [("gloader", gl, False), ("torch", th, True)]
                for name, loader, move in (order if r % 2 == 0 else order[::-1]):
                    rates[name].append(_gb_per_s(loader, batches, move, device))
                rates["gloader_host"].append(_gb_per_s(host, batches, False, device, on_device=False))
                out["copy_loop"].append(_copy_loop_gb_per_s(batches, device))
        finally:
            gl.close()
            host.close()
            del th
        out["workers"][str(workers)] = rates
    return out


def report_device(results: dict[str, Any]) -> list[str]:
    """Markdown lines for W7."""
    if "W7" not in results:
        return []
    w7 = results["W7"]
    if "skipped" in w7:
        return ["", f"W7 host-to-device: skipped ({w7['skipped']})"]
    copy = statistics.median(w7["copy_loop"])
    lines = ["", f"| W7 W2 batches to {w7['device']} | gloader GB/s | torch GB/s | gloader/torch | gloader/plain loop "
                 "| gloader host-only GB/s | gloader/host-only |", "|---|---|---|---|---|---|---|"]
    for workers, rates in w7["workers"].items():
        g, t, h = rates["gloader"], rates["torch"], rates["gloader_host"]
        ratio = statistics.median([a / b for a, b in zip(g, t)])
        lines.append(f"| pin_memory + device, {workers} workers | {summary(g)} | {summary(t)} | {ratio:.2f}x | "
                     f"{statistics.median(g) / copy:.2f}x | {summary(h)} | "
                     f"{statistics.median([a / b for a, b in zip(g, h)]):.2f}x |")
    lines.append(f"| plain loop copying one pinned batch, no loader (the copy's ceiling) | "
                 f"{summary(w7['copy_loop'])} | | | | | |")
    return lines


