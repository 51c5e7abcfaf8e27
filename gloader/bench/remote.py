"""W11: samples read from remote storage over HTTP.

A real HTTP server, started by the benchmark in its own process on 127.0.0.1, answers each
request after a fixed delay, as an object store or a network file system does, with one of a
set of small JPEGs; the dataset fetches each sample's image and decodes it. Loading then
mostly waits, and the question is how many concurrent fetches a loader keeps going, and what
memory that costs: torch and gloader with 2, 8 and 32 workers, gloader with 2 workers and
`fetch_threads='auto'`, and gloader with `num_workers='auto'`, alone and with
`fetch_threads='auto'`. Reported: samples/s, the workers' USS (memory no other process
shares) summed, and the workers and fetch threads auto settled on. A loader that tunes its
worker count is timed once the count has held for _SETTLE_S (untimed epochs, for at most
_SETTLE_MAX_S), as in training, which runs many epochs.
"""
from __future__ import annotations

import functools
import gc
import io
import os
import statistics
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

import gloader

from .figures import summary
from .memory import _uss_mb

__all__ = ["RemoteJpegs", "measure_remote", "remote_loader_names", "remote_summary", "report_remote"]

# What the server does per request (seconds) and what it serves. Larger delay: loading
# waits more and concurrency matters more.
_DELAY_S = 0.005
_IMAGES = 64
_IMAGE_SIZE = (128, 128)
_BATCH = 32
_SAMPLES = 1024
_QUICK_SAMPLES = 256
_WORKER_COUNTS = (2, 8, 32)
_AUTO = "gloader nw=2 fetch_threads=auto"
_AUTO_WORKERS = "gloader nw=auto"
_AUTO_BOTH = "gloader nw=auto fetch_threads=auto"
# A loader with num_workers='auto' is timed once its count has not changed for _SETTLE_S (a few
# of its decision windows of ~1 s; an epoch here is shorter), or after _SETTLE_MAX_S of epochs.
_SETTLE_S = 4.0
_SETTLE_MAX_S = 40.0
# Epochs timed, one after the other: an epoch here is 32 batches, and a loader whose window
# spans more than that (2 tasks a worker) starts each epoch with the next one well under way, so
# one epoch timed alone read up to 13,000 samples/s where the machine serves ~3,700 at most.
_TIMED_EPOCHS = 3


def _jpegs(count: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        pixels = rng.integers(0, 256, (*_IMAGE_SIZE, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def _serve(images: list[bytes], delay_s: float, port: Any) -> None:
    """The server process: answer each GET /<n> (keep-alive) with image n % len(images) after
    `delay_s`. asyncio, so that thousands of waiting requests cost the server next to no CPU."""
    import asyncio

    responses = [b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(body) + body
                 for body in images]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                await asyncio.sleep(delay_s)
                writer.write(responses[int(path.strip(b"/")) % len(responses)])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        port.send(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


_CONNECTIONS = threading.local()


class RemoteJpegs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each sample: the JPEG at `http://127.0.0.1:<port>/<index>` fetched over HTTP and decoded,
    as a uint8 CHW tensor, and its index. Each thread keeps its own connection, as the
    clients of object stores do; thread-safe."""

    def __init__(self, port: int, length: int) -> None:
        self.port = port
        self.length = length

    def __len__(self) -> int:
        return self.length

    def _get(self, index: int) -> bytes:
        import http.client

        connection = getattr(_CONNECTIONS, "connection", None)
        for attempt in range(2):
            if connection is None:
                connection = _CONNECTIONS.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
            try:
                connection.request("GET", f"/{index}")
                return connection.getresponse().read()
            except (OSError, http.client.HTTPException):
                connection.close()
                connection = _CONNECTIONS.connection = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        pixels = np.asarray(Image.open(io.BytesIO(self._get(index))).convert("RGB"))
        return torch.from_numpy(pixels.copy()).permute(2, 0, 1), index


def _torch(dataset: RemoteJpegs, workers: int) -> Any:
    return torch.utils.data.DataLoader(dataset, batch_size=_BATCH, shuffle=True, num_workers=workers,
                                       persistent_workers=True)


def _gloader(dataset: RemoteJpegs, workers: int | str, fetch_threads: Any = None) -> Any:
    return gloader.DataLoader(dataset, batch_size=_BATCH, shuffle=True, num_workers=workers, seed=0,
                              fetch_threads=fetch_threads)


def _loaders(dataset: RemoteJpegs) -> dict[str, Callable[[], Any]]:
    makers: dict[str, Callable[[], Any]] = {}
    for workers in _WORKER_COUNTS:
        makers[f"torch nw={workers}"] = functools.partial(_torch, dataset, workers)
        makers[f"gloader nw={workers}"] = functools.partial(_gloader, dataset, workers)
    makers[_AUTO] = functools.partial(_gloader, dataset, 2, "auto")
    makers[_AUTO_WORKERS] = functools.partial(_gloader, dataset, "auto")
    makers[_AUTO_BOTH] = functools.partial(_gloader, dataset, "auto", "auto")
    return makers


def _worker_pids(loader: Any) -> list[int]:
    if isinstance(loader, gloader.DataLoader):
        return loader.worker_pids()
    iterator = getattr(loader, "_iterator", None)  # torch's persistent workers
    return [worker.pid for worker in getattr(iterator, "_workers", [])]


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _one_round(name: str, make: Callable[[], Any], samples: int) -> tuple[float, float, int, int, float]:
    """(samples/s over _TIMED_EPOCHS epochs, the workers' USS in MB, fetch threads per worker or
    0, the worker count, the CPUs busy meanwhile). The epochs timed follow a first: training
    runs many, and each loader has started its workers (and gloader's fetch_threads='auto' has
    found its count) in the first; num_workers='auto' has until its count holds (_SETTLE_S)."""
    built = time.monotonic()
    loader = make()
    try:
        tuned = getattr(loader, "cpu_budget", None) is not None
        while True:
            for _ in loader:
                pass
            changes = loader.stats()["workers"]["changes"] if tuned else []
            held = time.monotonic() - built - (changes[-1]["at_s"] if changes else 0.0)
            if not tuned or held >= _SETTLE_S or time.monotonic() - built > _SETTLE_MAX_S:
                break
        started, busy_before = time.perf_counter(), _busy_cpu_s()
        count = sum(len(batch[1]) for _ in range(_TIMED_EPOCHS) for batch in loader)
        wall = time.perf_counter() - started
        rate, busy = count / wall, (_busy_cpu_s() - busy_before) / wall
        assert count == samples * _TIMED_EPOCHS, (name, count)
        pids = _worker_pids(loader)
        uss = sum(_uss_mb(pids))
        threads = max(loader.stats().get("fetch_threads", {0: 0}).values()) if name in (_AUTO, _AUTO_BOTH) else 0
        return rate, uss, threads, len(pids), busy
    finally:
        if isinstance(loader, gloader.DataLoader):
            loader.close()
        del loader
        gc.collect()  # torch's workers end with its loader, which a reference cycle may keep


def _busy_cpu_s() -> float:
    """CPU seconds the CPUs this process may use have been busy (not idle, not waiting for
    I/O) since boot, whoever ran on them: the loader, its workers, the server, anything else."""
    import psutil

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    times = psutil.cpu_times(percpu=True)
    return float(sum(t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
               for i, t in enumerate(times) if cpus is None or i in cpus))


def measure_remote(quick: bool, rounds: int, step: Callable[[str], None]) -> dict[str, Any]:
    """W11: per loader, samples/s, worker USS (MB) and fetch threads, one entry per round."""
    import multiprocessing

    try:
        images = _jpegs(_IMAGES)
    except ImportError:
        return {"skipped": "Pillow is not installed (pip install pillow)"}
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    server = context.Process(target=_serve, args=(images, _DELAY_S, send), daemon=True)
    server.start()
    try:
        if not receive.poll(60):
            return {"skipped": "the local HTTP server did not start within 60 s"}
        port = receive.recv()
        samples = _QUICK_SAMPLES if quick else _SAMPLES
        dataset = RemoteJpegs(port, samples)
        makers = _loaders(dataset)
        out: dict[str, Any] = {name: {"samples_per_s": [], "uss_mb": [], "threads": [], "workers": [],
                                      "cpus_busy": []} for name in makers}
        for r in range(rounds):
            for name in (list(makers) if r % 2 == 0 else list(reversed(makers))):
                rate, uss, threads, workers, busy = _one_round(name, makers[name], samples)
                out[name]["cpus_busy"].append(busy)
                out[name]["samples_per_s"].append(rate)
                out[name]["uss_mb"].append(uss)
                out[name]["threads"].append(threads)
                out[name]["workers"].append(workers)
                step(f"W11 round {r + 1} {name}")
        return {"delay_ms": _DELAY_S * 1e3, "samples": samples, "loaders": out, "cpus": _usable_cpus()}
    finally:
        server.terminate()
        server.join(5)
        receive.close()
        send.close()


def remote_loader_names() -> list[str]:
    """The loaders W11 measures each round."""
    return [f"{kind} nw={workers}" for workers in _WORKER_COUNTS for kind in ("torch", "gloader")] + [
        _AUTO, _AUTO_WORKERS, _AUTO_BOTH]


def _against_best_torch(loaders: dict[str, Any], auto_name: str = _AUTO) -> tuple[str, float, float]:
    """(the fastest torch configuration, a gloader auto loader's speed and memory as multiples of it)."""
    torch_names = [name for name in loaders if name.startswith("torch")]
    best = max(torch_names, key=lambda name: statistics.median(loaders[name]["samples_per_s"]))
    auto = loaders[auto_name]
    speed = statistics.median(auto["samples_per_s"]) / statistics.median(loaders[best]["samples_per_s"])
    memory = statistics.median(auto["uss_mb"]) / statistics.median(loaders[best]["uss_mb"])
    return best, speed, memory


def remote_summary(results: dict[str, Any]) -> str | None:
    """W11 in one table cell pair for the README summary, or None when it did not run."""
    res = results.get("W11")
    if not res or "loaders" not in res:
        return None
    name = _AUTO_BOTH if _AUTO_BOTH in res["loaders"] else _AUTO  # results written before it ran have only _AUTO
    best, speed, memory = _against_best_torch(res["loaders"], name)
    return f"{name} / the best torch ({best}) | {speed:.2f}x the speed, {memory:.2f}x the workers' memory"


def report_remote(results: dict[str, Any]) -> list[str]:
    """The W11 table, and how gloader auto compares with the best torch configuration."""
    res = results.get("W11")
    if res is None:
        return []
    if "skipped" in res:
        return ["", f"W11 skipped: {res['skipped']}"]
    loaders = res["loaders"]
    lines = ["", f"| W11 HTTP store ({res['delay_ms']:g} ms a request), JPEGs 128x128, batch {_BATCH} | samples/s | "
                 "workers' USS MB | workers | fetch threads | CPUs busy |", "|---|---|---|---|---|---|"]
    for name, got in loaders.items():
        threads = f"{statistics.median(got['threads']):g} per worker" if name in (_AUTO, _AUTO_BOTH) else ""
        workers = (f"{statistics.median(got['workers']):g} ({min(got['workers'])}-{max(got['workers'])})"
                   if got.get("workers") else "")
        busy = f"{statistics.median(got['cpus_busy']):.2f}" if got.get("cpus_busy") else ""
        lines.append(f"| {name} | {summary(got['samples_per_s'])} | {summary(got['uss_mb'])} | {workers} | "
                     f"{threads} | {busy} |")
    for name in (_AUTO, _AUTO_WORKERS, _AUTO_BOTH):
        if name in loaders:
            best, speed, memory = _against_best_torch(loaders, name)
            lines.append(f"W11: {name} reads {speed:.2f}x the best torch configuration ({best}) with "
                         f"{memory:.2f}x its workers' memory.")
    lines.insert(len(lines) - sum(name in loaders for name in (_AUTO, _AUTO_WORKERS, _AUTO_BOTH)), "")
    # The least CPU a sample took (every process on the usable CPUs, over a timed epoch) bounds
    # what any loader can reach here: the CPUs over it. 0: epochs too short to count (10 ms ticks).
    costs = [statistics.median(busy / rate for busy, rate in zip(got["cpus_busy"], got["samples_per_s"]))
             for got in loaders.values() if got.get("cpus_busy")]
    cost_ms = min(costs) * 1e3 if len(costs) == len(loaders) else 0.0
    if cost_ms > 0:
        ceiling = res["cpus"] / (cost_ms / 1e3)
        best_torch = statistics.median(loaders[best]["samples_per_s"])
        lines.append(f"W11 CPU bound here: the least CPU a sample took was {cost_ms:.2f} ms (HTTP client, decode, "
                     f"server, batching), so {res['cpus']} CPUs serve at most {ceiling:.0f} samples/s, "
                     f"{ceiling / best_torch:.2f}x the best torch.")
    return lines



if __name__ == "__main__":  # pragma: no cover - a quick look: python -m gloader.bench.remote
    def _say(label: str) -> None:
        sys.stderr.write(label + "\n")

    result = {"W11": measure_remote(quick="--quick" in sys.argv, rounds=1, step=_say)}
    print("\n".join(report_remote(result)))
