"""Datasets, batchify functions and failure injectors that workers import (module level, so
that spawn and forkserver workers can find them)."""
from __future__ import annotations

import atexit
import collections
import dataclasses
import faulthandler
import os
import random
import resource
import signal
import threading
import time
from typing import Any

import multiprocess
import numpy as np
import torch

import gloader


class RandomAugmented(gloader.Dataset):
    """Sample i: (features drawn from the global generators of random, numpy and torch, i),
    after waiting `seconds` (a read)."""

    def __init__(self, length: int = 50, seconds: float = 0.0) -> None:
        self.length = length
        self.seconds = seconds

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if self.seconds:
            time.sleep(self.seconds)
        noise = np.array([random.random(), np.random.rand(), torch.rand(()).item()], dtype=np.float64)
        return noise + idx, idx


class WorkerRngDataset(gloader.Dataset):
    """Draws from get_worker_info().rng: reproducible with thread workers too."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, idx: int) -> Any:
        info = gloader.get_worker_info()
        draw = info.rng.random() if info is not None else -1.0
        return np.array([idx, draw])


class Tagged(gloader.Dataset):
    """Sample i is (tag, i): tells loaders apart."""

    def __init__(self, tag: int, length: int = 30) -> None:
        self.tag = tag
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        return np.array([self.tag, idx], dtype=np.int64)


class RaisesAt(gloader.Dataset):
    """Raises `error` (a LookupError subclass by default) when sample `bad` is loaded."""

    def __init__(self, bad: int, length: int = 40, error: type[Exception] | None = None) -> None:
        self.bad = bad
        self.length = length
        self.error = error

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad:
            raise (self.error or CustomLookupError)(f"sample {idx} is corrupt")
        return np.array([idx], dtype=np.int64)


class CustomLookupError(LookupError):
    """A user exception type that must reach the caller unchanged."""


class UnrebuildableError(Exception):
    """Pickles, but cannot be rebuilt from its args (needs two)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


class UnprintableError(Exception):
    """Its __str__ raises, as a careless exception class's may."""

    def __str__(self) -> str:
        raise RuntimeError("no text for this error")


class RaisesUnrebuildable(gloader.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        raise UnrebuildableError(7, "bad record")


class DiesAt(gloader.Dataset):
    """The worker loading sample `bad` ends itself: 'exit' (os._exit(3)), 'kill' (SIGKILL), 'segv'
    (SIGSEGV) or 'bus' (SIGBUS, what touching shared memory beyond a full /dev/shm does)."""

    def __init__(self, bad: int, how: str, length: int = 64) -> None:
        self.bad = bad
        self.how = how
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad and gloader.get_worker_info() is not None:
            if self.how == "exit":
                os._exit(3)
            signals = {"kill": signal.SIGKILL, "segv": signal.SIGSEGV, "bus": signal.SIGBUS}
            # pytest's faulthandler, inherited by forked workers, would print a "Fatal Python error"
            # traceback for a crash this test asks for; the signal ends the worker the same way without it.
            faulthandler.disable()
            os.kill(os.getpid(), signals[self.how])
        return np.array([idx], dtype=np.int64)


class Sleepy(gloader.Dataset):
    """Sample `slow` takes `seconds` to load (a stuck read)."""

    def __init__(self, slow: int, seconds: float, length: int = 16) -> None:
        self.slow = slow
        self.seconds = seconds
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.slow:
            time.sleep(self.seconds)
        return np.array([idx], dtype=np.int64)


class SleepsWhenFlagged(Sleepy):
    """Like Sleepy, but only while the file `flag` exists: fast in one epoch, stuck in the next."""

    def __init__(self, flag: str, slow: int, seconds: float, length: int = 16) -> None:
        super().__init__(slow, seconds, length)
        self.flag = flag

    def __getitem__(self, idx: int) -> Any:
        if idx == self.slow and not os.path.exists(self.flag):
            return np.array([idx], dtype=np.int64)
        return super().__getitem__(idx)


class ClosesAPipe(gloader.Dataset):
    """Sample i is [i]. Sample `at` waits (up to 30 s) for the file `path` to name a pipe's
    inode, then closes the loading worker's descriptors on that pipe and loads on, as a dataset
    that closes descriptors it does not know (`os.closerange`) closes its worker's end of the
    sentinel its caller watches. Sample `stuck` takes 60 s (a stuck read)."""

    def __init__(self, path: str, at: int, stuck: int, length: int) -> None:
        self.path, self.at, self.stuck, self.length = path, at, stuck, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.stuck:
            time.sleep(60)
        if idx == self.at:
            deadline = time.monotonic() + 30
            while not os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.01)
            with open(self.path) as f:
                pipe = f"pipe:[{f.read().strip()}]"
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}") == pipe:
                        os.close(int(fd))
                except OSError:  # the listing's own descriptor, closed since
                    pass
        return np.array([idx], dtype=np.int64)


class StallsWhenFlagged(gloader.Dataset):
    """Instant samples, but while the file `flag` holds two sample indices ("short long"), the
    first takes `short_s` and the second `long_s` (the file is read at each sample)."""

    def __init__(self, flag: str, short_s: float, long_s: float, length: int) -> None:
        self.flag, self.short_s, self.long_s, self.length = flag, short_s, long_s, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        try:
            with open(self.flag) as file:
                short, long = map(int, file.read().split())
        except (OSError, ValueError):
            short = long = -1
        if idx in (short, long):
            time.sleep(self.short_s if idx == short else self.long_s)
        return np.array([idx], dtype=np.int64)


class SlowsDownWhenFlagged(gloader.Dataset):
    """From sample `start` on, each sample takes `seconds` while the file `flag` exists: a
    per-sample cost that jumps in the middle of an epoch."""

    def __init__(self, flag: str, start: int, seconds: float, length: int) -> None:
        self.flag = flag
        self.start = start
        self.seconds = seconds
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx >= self.start and os.path.exists(self.flag):
            time.sleep(self.seconds)
        return np.array([idx], dtype=np.int64)


class Unpicklable(gloader.Dataset):
    """Holds a generator three levels down: cannot be sent to spawn workers, even by dill."""

    def __init__(self) -> None:
        self.config = {"reader": {"stream": (line for line in ["a", "b"])}}

    def __len__(self) -> int:
        return 4

    def __getitem__(self, idx: int) -> Any:
        return idx


class BreaksOnUnpickle(gloader.Dataset):
    """Pickles fine, but raises when a worker unpickles it."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, idx: int) -> Any:
        return idx

    def __reduce__(self) -> Any:
        return (_refuse, ("the index file is missing on this host",))


def _refuse(message: str) -> Any:
    raise FileNotFoundError(message)


def failing_init(worker_id: int) -> None:
    raise PermissionError(f"worker {worker_id} cannot open the database")


def fails_the_first_time(marker: str, worker_id: int) -> None:
    """A worker_init_fn that raises in the first worker to run it (it makes `marker`), only once."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    raise PermissionError(f"worker {worker_id} cannot open the database yet")


def record_init(worker_id: int) -> None:
    os.environ["GLOADER_TEST_WORKER_ID"] = str(worker_id)


class InitRecorder(gloader.Dataset):
    """Returns what worker_init_fn recorded in the worker, and the worker's pid."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, idx: int) -> Any:
        return np.array([int(os.environ.get("GLOADER_TEST_WORKER_ID", "-1")), os.getpid()], dtype=np.int64)


def failing_batchify(samples: list[Any]) -> Any:
    raise ValueError(f"cannot batch {len(samples)} samples")


def sum_batchify(samples: list[Any]) -> Any:
    """A user batchify function returning numpy (copied once into shared memory)."""
    return np.stack([np.asarray(s) for s in samples]).sum(axis=0, keepdims=True)


class Records(gloader.Dataset):
    """Mixed structure: dict of arrays, ints, floats, bools, strings, nested tuples."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, idx: int) -> Any:
        return {"x": np.arange(6, dtype=np.float32).reshape(2, 3) + idx, "label": idx, "weight": idx / 2,
                "flag": idx % 2 == 0, "name": f"item{idx}", "pair": (np.int16(idx), torch.tensor([idx, -idx]))}


class SlowToFree(gloader.Dataset):
    """A worker process that loaded from it takes `seconds` more at the interpreter's exit, as one
    freeing a dataset of a million records does (an exit hook that sleeps: freeing is not
    reliably measurable, an exit hook runs exactly where the interpreter's teardown begins)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        if gloader.get_worker_info() is not None and not _SLOW_EXIT:
            _SLOW_EXIT.append(True)
            atexit.register(time.sleep, self.seconds)
        return np.array([idx])


_SLOW_EXIT: list[bool] = []


class IgnoresTerm(gloader.Dataset):
    """The worker loading sample 0 ignores SIGTERM and hangs: only SIGKILL stops it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        if idx == 0 and gloader.get_worker_info() is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(60)
        return np.array([idx])


def generator_batchify(samples: list[Any]) -> Any:
    """Returns a batch holding generators: cannot be pickled back to the caller, even by dill."""
    return [(x for x in range(2)) for _ in samples]


class RegistryProbe(gloader.Dataset):
    """Sample i is (tag, i, pid, ids of the loaders registered in the loading worker...)."""

    def __init__(self, tag: int, length: int = 24) -> None:
        self.tag = tag
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        from gloader._worker import registry as _registry

        ids = _registry.registered_ids()[:6]
        return np.array([self.tag, idx, os.getpid(), len(ids)] + ids + [-1] * (6 - len(ids)), dtype=np.int64)


class RangeStream(gloader.IterableDataset):
    """Yields range(length), each worker its own interleaved shard; optionally raises at `bad`."""

    def __init__(self, length: int, bad: int | None = None) -> None:
        self.length = length
        self.bad = bad

    def __iter__(self) -> Any:
        info = gloader.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.length, step):
            if i == self.bad:
                raise CustomLookupError(f"record {i} is corrupt")
            yield np.array([i], dtype=np.int64)


class SlowEverySample(gloader.Dataset):
    """Every sample takes `seconds` (an input-bound pipeline)."""

    def __init__(self, seconds: float, length: int) -> None:
        self.seconds = seconds
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        time.sleep(self.seconds)
        return np.array([idx])


class FreezeCount(gloader.Dataset):
    """Sample i reports how many objects the loading process's collector has frozen."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, idx: int) -> Any:
        import gc

        return np.array([gc.get_freeze_count()], dtype=np.int64)


Point = collections.namedtuple("Point", ["image", "label"])


class NamedSamples(gloader.Dataset):
    """Sample i is Point(image=float32[2] filled with i, label=i)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        return Point(np.full(2, idx, dtype=np.float32), idx)


class NestedNamedSamples(gloader.Dataset):
    """As NamedSamples, with the namedtuple made in the class body, as torch's tests write it:
    its __qualname__ is "Sample", which names nothing in this module."""

    Sample = collections.namedtuple("Sample", ["image", "label"])

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        return self.Sample(np.full(2, idx, dtype=np.float32), idx)


class TextRows(gloader.Dataset):
    """Rows as a HuggingFace table in numpy format gives them: numpy string and int scalars."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, idx: int) -> Any:
        return {"text": np.str_(f"row number {idx}"), "label": np.int64(idx % 2)}


def nested_batchify(samples: list[Any]) -> Any:
    """Batches ragged samples into one nested tensor."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch calls nested tensors a prototype
        return torch.nested.nested_tensor([torch.as_tensor(s, dtype=torch.float32) for s in samples])


class InitDraws(gloader.Dataset):
    """Its `init` (a worker_init_fn) draws from random, numpy and torch and records whether
    torch.initial_seed() equals the worker's seed; every sample reports that, from the very
    dataset object __getitem__ runs on."""

    def __init__(self) -> None:
        self.draws = [-1.0, -1.0, -1.0, -1.0, -1.0]

    def init(self, worker_id: int) -> None:
        info = gloader.get_worker_info()
        seeded = float(info is not None and torch.initial_seed() == info.seed)
        self.draws = [random.random(), float(np.random.rand()), torch.rand(()).item(), seeded, float(worker_id)]

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        return np.array(self.draws + [idx], dtype=np.float64)


class TorchShardedStream(torch.utils.data.IterableDataset):
    """A stream written for torch: shards by torch.utils.data.get_worker_info()."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.length, step))


class SizedTorchStream(TorchShardedStream):
    def __len__(self) -> int:
        return self.length


class UnshardedSizedStream(torch.utils.data.IterableDataset):
    """A stream with __len__ whose __iter__ ignores the worker: each worker yields all of it."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Any:
        return iter(range(self.length))


class BatchedFetch(gloader.Dataset):
    """Sample k is (k, how many keys the call that fetched it asked for)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, idx: int) -> Any:
        return np.array([idx, 1])

    def __getitems__(self, keys: list[int]) -> list[Any]:
        return [np.array([k, len(keys)]) for k in keys]


class KeyEcho(gloader.Dataset):
    """Sample for key k is repr(k): shows exactly what __getitem__ received."""

    def __len__(self) -> int:
        return 3

    def __getitem__(self, key: Any) -> Any:
        return repr(key)


class WhoLoads(gloader.Dataset):
    """Sample i is (worker id, pid, i)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, idx: int) -> Any:
        info = gloader.get_worker_info()
        return np.array([-1 if info is None else info.id, os.getpid(), idx], dtype=np.int64)


class Tag(gloader.Dataset):
    """Sample i is (self.tag, i); the caller changes `tag` between epochs."""

    def __init__(self) -> None:
        self.tag = 0

    def __len__(self) -> int:
        return 32

    def __getitem__(self, idx: int) -> Any:
        return np.array([self.tag, idx], dtype=np.int64)


class ExitsAt(gloader.Dataset):
    """Calls sys.exit(7) when sample `bad` is loaded."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad:
            import sys

            sys.exit(7)
        return np.array([idx])


class ExitsWhenTold(gloader.Dataset):
    """Sample `bad` writes its worker's pid to `stamp`, waits (10 s at most) for the file `go`,
    then ends the worker with `os._exit(code)`; the others are [i]."""

    def __init__(self, bad: int, code: int, go: str, stamp: str, length: int = 16) -> None:
        self.bad, self.code, self.go, self.stamp, self.length = bad, code, go, stamp, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad:
            with open(self.stamp + ".tmp", "w") as out:
                out.write(str(os.getpid()))
            os.rename(self.stamp + ".tmp", self.stamp)
            deadline = time.monotonic() + 10
            while not os.path.exists(self.go) and time.monotonic() < deadline:
                time.sleep(0.005)
            os._exit(self.code)
        return np.array([idx])


def spin(seconds: float) -> None:
    """Keep this thread's CPU busy for `seconds` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def hold_lock_forever(lock: Any, taken: Any) -> None:
    """A process that takes `lock`, says so, and waits to be killed."""
    lock.acquire()
    taken.set()
    threading.Event().wait()


class Occupies(gloader.Dataset):
    """Sample i keeps its worker for `seconds`, spinning on the CPU ('spin'), asleep as a read
    from storage would be ('sleep'), or spinning and then asleep for a fifth as long ('mixed':
    decoding after a read); it is (worker pid, start, end) in monotonic ns."""

    def __init__(self, how: str, seconds: float = 0.01, length: int = 24) -> None:
        self.how = how
        self.seconds = seconds
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        start = time.monotonic_ns()
        if self.how != "sleep":
            spin(self.seconds)
        if self.how != "spin":
            time.sleep(self.seconds if self.how == "sleep" else self.seconds / 5)
        return np.array([os.getpid(), start, time.monotonic_ns()], dtype=np.int64)


class CountsVoluntarySwitches(gloader.Dataset):
    """Sample i spins for `seconds` of CPU time and is how many times its thread gave up the
    CPU of its own accord meanwhile (blocked on anything, the GIL included)."""

    def __init__(self, seconds: float, length: int) -> None:
        self.seconds = seconds
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        spin(self.seconds)
        return np.int64(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before)


class NestedLoader(gloader.Dataset):
    """Sample i is i plus the sum of np.arange(8), loaded by an inner DataLoader with
    `inner` options (a dataset that reads through another loader)."""

    def __init__(self, **inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return 4

    def __getitem__(self, idx: int) -> Any:
        with gloader.DataLoader(np.arange(8), batch_size=4, **self.inner) as loader:
            return idx + sum(int(batch.sum()) for batch in loader)


@dataclasses.dataclass(frozen=True)
class Spot:
    """A sample field that no batchify rule stacks (the default keeps such fields as a list)."""

    x: int
    y: int


class Scaled(gloader.Dataset):
    """Sample i is i * self.scale: a dataset a training script changes between epochs."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.scale = 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> int:
        return idx * self.scale


class HeldBack(gloader.Dataset):
    """Sample `held` waits until the caller sets `release` (a straggler whose end the test
    decides); every sample is its own index. Fork workers and threads (the event is inherited)."""

    def __init__(self, length: int, held: int) -> None:
        self.length = length
        self.held = held
        self.release = multiprocess.get_context("fork").Event()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> int:
        if idx == self.held and not self.release.wait(30):
            raise TimeoutError(f"sample {idx} was never released")
        return idx


class HeldBackStream(torch.utils.data.IterableDataset):
    """Shard i yields i, i + num_workers, ...; shard `held` starts only once the caller sets
    `release`. Fork workers only (the event is inherited)."""

    def __init__(self, length: int, held: int) -> None:
        self.length = length
        self.held = held
        self.release = multiprocess.get_context("fork").Event()

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        if start == self.held and not self.release.wait(30):
            raise TimeoutError(f"shard {start} was never released")
        return iter(range(start, self.length, step))


class MeetAtBarrier(gloader.Dataset):
    """Every sample waits until all `parties` samples are being loaded at once (as torch's
    test_worker_seed makes its workers do); returns the loading pid. Fork workers only (the
    barrier is inherited)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.barrier = multiprocess.get_context("fork").Barrier(parties, timeout=20)  # the heap the suite warms

    def __len__(self) -> int:
        return self.parties

    def __getitem__(self, idx: int) -> int:
        self.barrier.wait()
        return os.getpid()


class FakeNDArray:
    """Stands in for an MXNet NDArray, which Gluon's datasets return: its data is reachable
    through `asnumpy()` only (no array protocol)."""

    def __init__(self, array: Any) -> None:
        self._array = np.asarray(array)

    def asnumpy(self) -> np.ndarray:
        return self._array.copy()


class GluonImages(gloader.Dataset):
    """(image, label) as Gluon's vision datasets give them: the image an NDArray."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> Any:
        return FakeNDArray(np.full((2, 3), idx, np.uint8)), idx


class PinnableBatch:
    """A batch class of the user's own, built by its batchify function, as in torch's docs: its
    `pin_memory()` pins its tensor and records that the loader called it."""

    def __init__(self, samples: list[Any]) -> None:
        self.inp = torch.stack([torch.as_tensor(s) for s in samples])
        self.pinned_by_its_method = False

    def pin_memory(self) -> PinnableBatch:
        self.inp = self.inp.pin_memory()
        self.pinned_by_its_method = True
        return self


class DiesOnceAt(gloader.Dataset):
    """The first worker to load sample `bad` ends itself (os._exit(3)), leaving `marker` behind;
    later loads of it (the next epoch, a new worker) return it."""

    def __init__(self, bad: int, marker: str, length: int = 64) -> None:
        self.bad, self.marker, self.length = bad, marker, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad and gloader.get_worker_info() is not None and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(3)
        return np.array([idx], dtype=np.int64)


class StampsAndDies(gloader.Dataset):
    """The worker loading sample `bad` writes the time to `path`, then SIGKILLs itself."""

    def __init__(self, bad: int, path: str, length: int = 64) -> None:
        self.bad, self.path, self.length = bad, path, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx == self.bad and gloader.get_worker_info() is not None:
            with open(self.path, "w") as stamp:
                stamp.write(repr(time.time()))
            faulthandler.disable()
            os.kill(os.getpid(), signal.SIGKILL)
        return np.array([idx], dtype=np.int64)


def _rebuilt_in_a_worker_only(value: int) -> WorkerOnly:
    if gloader.get_worker_info() is None:
        raise CustomLookupError(f"WorkerOnly({value}) cannot be rebuilt outside a worker")
    return WorkerOnly(value)


class WorkerOnly:
    """Pickles in a worker, but unpickling it in the caller raises: an answer that cannot be
    rebuilt where it arrives (a class the caller cannot import behaves the same)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return (_rebuilt_in_a_worker_only, (self.value,))


class OneWorkerOnly(gloader.Dataset):
    """Sample i is i, except sample `bad`, a WorkerOnly."""

    def __init__(self, bad: int, length: int = 64) -> None:
        self.bad, self.length = bad, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        return WorkerOnly(idx) if idx == self.bad else idx


class OneLarge(gloader.Dataset):
    """float32 samples of `small_bytes`, except sample `at`, of `large_bytes`."""

    def __init__(self, at: int, large_bytes: int, small_bytes: int, length: int) -> None:
        self.at, self.large, self.small, self.length = at, large_bytes, small_bytes, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        return np.zeros((self.large if idx == self.at else self.small) // 4, np.float32)


def first_sample(samples: list[Any]) -> Any:
    """A batchify function: the batch is its first sample."""
    return samples[0]


class Draws(gloader.Dataset):
    """Each sample: its index and a draw from `get_worker_info().rng` (reproducible draws)."""

    def __init__(self, length: int = 64) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        info = gloader.get_worker_info()
        return np.array([idx, info.rng.integers(1 << 30) if info is not None else -1], dtype=np.int64)


class MeetsInPairs(gloader.Dataset):
    """Each `__getitem__` waits at a barrier for another one running beside it (5 s at most):
    it completes only when samples are fetched two at a time."""

    def __init__(self, length: int = 16) -> None:
        self.length = length
        self._barrier = threading.Barrier(2, timeout=5.0)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        self._barrier.wait()
        return np.array([idx], dtype=np.int64)

    def __getstate__(self) -> dict[str, Any]:
        return {"length": self.length}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["length"])  # type: ignore[misc]


class Waits(gloader.Dataset):
    """Each sample waits `seconds` (a read from remote storage), then computes next to nothing."""

    def __init__(self, seconds: float, length: int = 512) -> None:
        self.seconds, self.length = seconds, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        time.sleep(self.seconds)
        return np.array([idx], dtype=np.int64)


class Computes(gloader.Dataset):
    """Each sample is pure-Python work, holding the GIL throughout."""

    def __init__(self, length: int = 512) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        total = 0
        for value in range(20_000):
            total += value ^ idx
        return np.array([idx, total], dtype=np.int64)


class GatedLoads(gloader.Dataset):
    """Records every index it loads; indices from `gated` on wait for `gate` (an Event; 10 s
    at most) first. For thread workers, which share these objects with the test."""

    def __init__(self, length: int, gated: int) -> None:
        self.length, self.gated = length, gated
        self.gate = threading.Event()
        self.loaded: list[int] = []
        self.waiting: list[int] = []  # indices that reached the gate

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, idx: int) -> Any:
        if idx >= self.gated:
            self.waiting.append(idx)
            self.gate.wait(10.0)
        self.loaded.append(idx)
        return np.array([idx], dtype=np.int64)


def worker_store(sample: Any) -> Any:
    """A transform that answers with the class of the records the loading worker reads: the
    SimpleDataset under the transform, in the worker's copy of the dataset."""
    info = gloader.get_worker_info()
    return type(info.dataset._data._data).__name__ if info is not None else "caller"


class ManyRecords(gloader.Dataset):
    """A dataset of the user's own, holding a large list (and a dict) of Python objects."""

    def __init__(self, length: int = 20_000, shared: bool = False) -> None:
        records = [{"id": i, "name": f"n{i}"} for i in range(length)]
        self.records: Any = gloader.SharedList(records) if shared else records
        self.lookup: Any = {i: i * 2 for i in range(length)}
        if shared:
            self.lookup = gloader.SharedDict(self.lookup)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Any:
        return np.array([self.records[i]["id"], self.lookup[i]])
