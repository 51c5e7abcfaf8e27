"""RayPool: a loader's workers as Ray actors on a local Ray instance (one per module), with
every guarantee of the local loader: batches bit-identical to num_workers=0, resume,
samplers, per-batch errors and timeouts, a lost actor's tasks run again, close ends its actors."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import gloader
from gloader import BatchTimeoutError, DataLoader, RayPool
from gloader.sampler import DistributedSampler
from tests import _data
from tests.conftest import RAY_WORKERS_NOT_NICED, dev_shm_names, wait_until

ray = pytest.importorskip("ray")

# Generous: on a loaded 2-CPU machine (two CPU hogs and another gloader program) Ray's own
# processes and each new actor's start are starved; the module took 14.5 min there, 75 s alone.
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("ray")]  # one Ray instance at a time (pytest.ini)


@pytest.fixture(scope="module", autouse=True)
def ray_instance() -> Iterator[None]:
    """A small local Ray instance for the module: 4 logical CPUs (actors reserve half a CPU
    each below, so that 3 fit), a 100 MB object store, and workers at this process's priority:
    Ray renices its workers by 15, and on a machine busy with other programs an actor then
    took over 90 s to start (see docs/guide/ray.md)."""
    ray.init(num_cpus=4, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
             configure_logging=False, _system_config=RAY_WORKERS_NOT_NICED)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Ray's own processes and threads outlive a loader by design: here a test must leave no
    /dev/shm name, and `actors_of` checks that close() ended the loader's actors."""
    before = dev_shm_names()
    yield
    assert wait_until(lambda: not dev_shm_names() - before, 5.0), dev_shm_names() - before


def _pool(workers: int) -> RayPool:
    return RayPool(workers, num_cpus=0.5)


def actors_of(loader: DataLoader) -> list[Any]:
    """The Ray actors of a loader now running (its strategy's)."""
    backend = loader._engine.workers.backend
    return list(backend._actors) if backend is not None else []


def _ended(actor: Any, timeout_s: float = 30.0) -> bool:
    """Whether the actor ends within `timeout_s` (Ray kills asynchronously: a call sent just
    after `ray.kill` may still be answered)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ready.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return True
    return False


class Draws:
    """Samples that draw from the global generators a worker seeds per batch."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"x": np.full((2, 3), index, dtype=np.float32), "np": np.random.randint(1 << 30),
                "torch": torch.randint(1 << 30, ()), "seen": index}


def _equal(first: list[Any], second: list[Any]) -> bool:
    return len(first) == len(second) and all(
        all(torch.equal(a[key], b[key]) for key in a) for a, b in zip(first, second))


def _reference(dataset: Any, epochs: int = 2, **kwargs: Any) -> list[list[Any]]:
    with DataLoader(dataset, num_workers=0, **kwargs) as loader:
        return [list(loader) for _ in range(epochs)]


@pytest.mark.parametrize("workers", [1, 3])
def test_batches_are_bit_identical_to_in_process_loading(workers: int) -> None:
    kwargs = dict(batch_size=4, shuffle=True, seed=7, last_batch="keep")
    expected = _reference(Draws(), **kwargs)
    with DataLoader(Draws(), pool=_pool(workers), **kwargs) as loader:
        got = [list(loader) for _ in range(2)]
        actors = actors_of(loader)
        assert len(actors) == workers
        assert loader.stats()["workers"]["count"] == workers
        assert loader.stats()["workers"]["kind"] == "Ray actors"
    assert all(_equal(a, b) for a, b in zip(got, expected))
    assert not _equal(got[0], got[1])  # two epochs, two orders
    assert all(_ended(actor) for actor in actors)


def test_a_cluster_too_small_for_the_actors_is_named_and_the_loader_runs_on_those_placed() -> None:
    kwargs = dict(batch_size=4, shuffle=True, seed=2)
    expected = _reference(Draws(), epochs=1, **kwargs)[0]
    with DataLoader(Draws(), pool=RayPool(3, num_cpus=2), **kwargs) as loader:  # 6 CPUs of the instance's 4
        with pytest.warns(RuntimeWarning, match="reserves 6 CPUs .* the Ray cluster has 4"):
            got = list(loader)
    assert _equal(got, expected)


def test_batches_are_tensors_viewing_the_object_store_and_the_caller_may_write_them() -> None:
    with DataLoader(Draws(), batch_size=5, pool=_pool(2)) as loader:
        batch = next(iter(loader))
        assert isinstance(batch["x"], torch.Tensor) and batch["x"].shape == (5, 2, 3)
        batch["x"] += 1  # the batch is the caller's alone
        assert batch["x"][0, 0, 0].item() == 1.0


def test_resume_mid_epoch_gives_the_rest_of_the_epoch() -> None:
    kwargs = dict(batch_size=4, shuffle=True, seed=3)
    expected = _reference(Draws(), epochs=1, **kwargs)[0]
    with DataLoader(Draws(), pool=_pool(2), **kwargs) as loader:
        iterator = iter(loader)
        first = [next(iterator) for _ in range(5)]
        state = loader.state_dict()
    with DataLoader(Draws(), pool=_pool(3), **kwargs) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    with DataLoader(Draws(), num_workers=1, **kwargs) as loader:  # from Ray to local workers
        loader.load_state_dict(state)
        rest_locally = list(loader)
    assert _equal(first + rest, expected) and _equal(first + rest_locally, expected)


def test_distributed_ranks_split_the_epoch_as_in_process_loading_does() -> None:
    got, expected = [], []
    for rank in range(2):
        def sampler(rank: int = rank) -> DistributedSampler:
            made = DistributedSampler(len(Draws()), num_replicas=2, rank=rank, shuffle=True, seed=5)
            made.set_epoch(1)
            return made
        with DataLoader(Draws(), batch_size=4, sampler=sampler(), pool=_pool(2), seed=1) as loader:
            got.append(list(loader))
        with DataLoader(Draws(), batch_size=4, sampler=sampler(), num_workers=0, seed=1) as loader:
            expected.append(list(loader))
    assert all(_equal(a, b) for a, b in zip(got, expected))
    seen = [int(index) for rank in got for batch in rank for index in batch["seen"]]
    assert sorted(seen) == list(range(50))


class FailsAt:
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> np.ndarray:
        if index == self.bad:
            raise KeyError(f"sample {index} is missing")
        return np.full(3, index)


def test_a_failing_sample_fails_its_own_batch_with_the_datasets_exception() -> None:
    with DataLoader(FailsAt(9), batch_size=4, pool=_pool(2)) as loader:
        iterator = iter(loader)
        got = [next(iterator), next(iterator)]
        with pytest.raises(KeyError, match="sample 9 is missing") as info:
            next(iterator)
        assert "batch 2" in "\n".join(getattr(info.value, "__notes__", []))
        got += list(iterator)  # the batches after it come
    assert [int(batch[0, 0]) for batch in got] == [0, 4, 12, 16]


class Hangs:
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> np.ndarray:
        if index == 5:
            time.sleep(60)
        return np.full(3, index)


def test_a_batch_over_its_timeout_raises_and_its_actors_end() -> None:
    # 8 s: room for the actors' start on a loaded machine (the first batch waits for it; 2.6 s
    # on a quiet 2-CPU host)
    with DataLoader(Hangs(), batch_size=2, pool=_pool(2), timeout=8) as loader:
        iterator = iter(loader)
        actors = actors_of(loader) if next(iterator) is not None else []
        next(iterator)
        started = time.monotonic()
        with pytest.raises(BatchTimeoutError, match="batch 2 of epoch 0"):
            next(iterator)
        assert time.monotonic() - started < 45
        assert all(_ended(actor) for actor in actors)


def test_cheap_batches_travel_several_to_an_actor_call_and_stay_bit_identical() -> None:
    kwargs = dict(batch_size=2, shuffle=True, seed=5)
    dataset = np.arange(400, dtype=np.float32)
    expected = _reference(dataset, epochs=3, **kwargs)
    with DataLoader(dataset, pool=_pool(2), **kwargs) as loader:
        got = [list(loader)]
        assert loader._engine.batches_per_task() > 1  # batches of microseconds: an actor call costs more
        sent = []
        submit = loader._engine.workers.backend.submit
        loader._engine.workers.backend.submit = lambda args, on_ready: sent.append(len(args[2])) or submit(args, on_ready)
        got += [list(loader) for _ in range(2)]
    assert max(sent) > 1 and sum(sent) == 400
    assert all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, expected))


def test_large_batches_go_one_to_a_call_however_cheap() -> None:
    """A task carries at most 1 MiB of batches: 600 KB batches that load in microseconds go one
    to a call (by time alone, a call would carry 32: each held batch would keep them all)."""
    dataset = np.zeros((24, 150_000), dtype=np.float32)
    with DataLoader(dataset, batch_size=1, pool=_pool(2)) as loader:
        list(loader)
        sent = []
        submit = loader._engine.workers.backend.submit
        loader._engine.workers.backend.submit = lambda args, on_ready: sent.append(len(args[2])) or submit(args, on_ready)
        assert len(list(loader)) == 24
    assert sent and set(sent) == {1}


def test_a_hang_inside_a_task_of_several_batches_times_out_naming_that_batch(tmp_path: Any) -> None:
    flag = tmp_path / "hang"
    # Sample 301 (batch 150 of epoch 1) lies beyond what the loader dispatches of epoch 1 while
    # epoch 0 ends, so it is loaded after the flag is set, in a task of several batches.
    dataset = _data.SleepsWhenFlagged(str(flag), slow=301, seconds=60.0, length=400)
    with DataLoader(dataset, batch_size=2, pool=_pool(2), timeout=6) as loader:
        list(loader)
        assert loader._engine.batches_per_task() > 1
        flag.touch()
        served = []
        started = time.monotonic()
        with pytest.raises(BatchTimeoutError, match=r"batch 150 of epoch 1 \(sample indices \[300, 301\]\)"):
            for batch in loader:
                served.append(batch)
        assert time.monotonic() - started < 45
    # every batch before the hung one came, those loaded before it in its call included
    assert torch.cat(served).flatten().tolist() == list(range(300))


def test_the_timeout_stays_per_batch_when_a_task_carries_several(tmp_path: Any) -> None:
    """Tasks sized on fast samples carry many batches; each sample then takes 0.5 s, so a whole
    task of 16 or more takes 8 s or more, but no batch comes near timeout=6: none may time out.
    (The margin is for a busy machine, where a fast batch took 2.5 s on a Ray actor, and once,
    beside two CPU hogs, over 4 s.)"""
    flag = tmp_path / "slow"
    dataset = _data.SlowsDownWhenFlagged(str(flag), start=300, seconds=0.5, length=400)
    with DataLoader(dataset, batch_size=1, pool=_pool(2), timeout=6.0) as loader:
        list(loader)
        assert loader._engine.batches_per_task() >= 16
        flag.touch()
        iterator = iter(loader)
        got = [next(iterator) for _ in range(320)]  # past sample 300 (not dispatched before the flag), then slow
    assert torch.cat(got).flatten().tolist() == list(range(320))


class OpensSqlite:
    """A dataset that opens an sqlite connection when unpickled in its worker (sqlite refuses a
    connection used in another thread than the one that made it)."""

    def __len__(self) -> int:
        return 12

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        import sqlite3

        self.db = sqlite3.connect(":memory:")

    def __getitem__(self, index: int) -> np.ndarray:
        return np.array(self.db.execute("select ?", (index,)).fetchone())


def test_a_dataset_with_thread_bound_handles_makes_and_uses_them_in_one_thread() -> None:
    with DataLoader(OpensSqlite(), batch_size=3, pool=_pool(2), timeout=60) as loader:
        assert torch.cat(list(loader)).flatten().tolist() == list(range(12))


class Slow:
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(0.02)
        return np.full(2, index) + np.random.randint(100)


def test_an_actor_killed_mid_epoch_changes_no_batch() -> None:
    kwargs = dict(batch_size=2, shuffle=True, seed=11)
    expected = _reference(Slow(), epochs=1, **kwargs)[0]
    with DataLoader(Slow(), pool=_pool(3), **kwargs) as loader:
        iterator = iter(loader)
        got = [next(iterator) for _ in range(3)]
        before = actors_of(loader)
        victim = before[0]  # with tasks in flight: each of them runs again, and it is replaced once
        ray.kill(victim, no_restart=True)
        got += list(iterator)
        after = actors_of(loader)
        assert victim not in after and after[1:] == before[1:] and len(after) == 3
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


class Stream(gloader.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        info = gloader.get_worker_info()
        begin, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(begin, 30, step))


def test_a_stream_is_read_once_across_the_actors() -> None:
    with DataLoader(Stream(), batch_size=4, pool=_pool(3), last_batch="keep") as loader:
        seen = sorted(int(value) for batch in loader for value in batch)
    assert seen == list(range(30))


def test_a_notebook_style_lambda_and_local_class_reach_the_actors() -> None:
    class Local:
        def __len__(self) -> int:
            return 6

        def __getitem__(self, index: int) -> int:
            return index * 10

    with DataLoader(Local(), batch_size=3, pool=_pool(2), batchify_fn=lambda samples: torch.tensor(samples) + 1) as loader:
        assert [batch.tolist() for batch in loader] == [[1, 11, 21], [31, 41, 51]]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_workers=0), ValueError, "num_workers must be"),
    (dict(num_workers=2, num_cpus=0), ValueError, "num_cpus must be a number > 0"),
    (dict(num_workers=2, resources=["cpu_node"]), TypeError, "resources must be a dict"),
    (dict(num_workers=2, address=6379), TypeError, "address must be a str"),
])
def test_bad_arguments_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        RayPool(**kwargs)


def test_a_conflicting_worker_count_is_named() -> None:
    with pytest.raises(ValueError, match="num_workers=3 conflicts with pool="):
        DataLoader(Draws(), batch_size=2, num_workers=3, pool=_pool(2))


def test_the_local_loader_never_imports_ray() -> None:
    code = ("import sys, gloader, numpy as np\n"
            "with gloader.DataLoader(np.arange(8), batch_size=4, num_workers=1) as loader:\n"
            "    list(loader)\n"
            "print('ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_ctrl_c_while_the_caller_waits_is_a_keyboard_interrupt_and_close_ends_the_actors() -> None:
    import _thread
    import threading

    with DataLoader(Hangs(), batch_size=2, pool=_pool(2), timeout=90) as loader:
        iterator = iter(loader)
        next(iterator)
        next(iterator)
        actors = actors_of(loader)
        interrupt = threading.Timer(0.5, _thread.interrupt_main)  # Ctrl-C while batch 2 (sample 5: 60 s) loads
        interrupt.start()
        started = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                next(iterator)
        finally:
            interrupt.join()
        assert time.monotonic() - started < 10
    assert all(_ended(actor) for actor in actors)


def test_the_receive_benchmark_prints_a_row_per_worker_count_and_names_bad_counts(capsys: Any) -> None:
    from gloader.bench import receive

    receive.main(["--workers", "1,2", "--rounds", "1", "--quick"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2"]
    for row in rows:
        ray_gb, ray_ms, local_gb, local_ms = (float(cell.split()[0]) for cell in row.strip(" |").split(" | ")[1:])
        assert min(ray_gb, ray_ms, local_gb, local_ms) > 0
    assert ray.is_initialized()  # the module's instance, not one of its own, and left running
    for bad in ("0", "two", "2,,4"):
        with pytest.raises(SystemExit):
            receive.main(["--workers", bad])
        assert f"--workers takes worker counts >= 1 separated by commas, got {bad!r}" in capsys.readouterr().err


def test_a_loader_whose_actors_cannot_be_placed_says_so_at_once_and_waits_no_longer_than_its_timeout() -> None:
    """The first loader's actors hold the instance's 4 CPUs; a second loader on the same pool
    waited 5.6x its timeout in silence, then blamed the dataset."""
    pool = RayPool(2, num_cpus=2)
    with DataLoader(Draws(), batch_size=4, pool=pool) as first:
        next(iter(first))  # its actors are placed and hold every CPU
        with DataLoader(Draws(), batch_size=4, pool=pool, timeout=4) as second:
            started = time.monotonic()
            with pytest.warns(RuntimeWarning, match=r"2 of its 2 Ray actors wait for resources: each needs \{'CPU': 2\.0\}"):
                with pytest.raises(BatchTimeoutError, match="2 of its 2 Ray actors still wait for resources"):
                    next(iter(second))
            assert time.monotonic() - started < 3 * 4  # was 5.6x the timeout


def test_ray_shut_down_under_an_open_loader_is_named_and_a_new_iter_starts_again_when_ray_is_back() -> None:
    with DataLoader(Draws(), batch_size=4, pool=_pool(2)) as loader:
        iterator = iter(loader)
        next(iterator)
        ray.shutdown()
        try:
            with pytest.raises(gloader.WorkerExitedError, match=r"Ray was shut down \(ray.shutdown\(\)\)"):
                next(iterator)
        finally:  # the module's instance, as the fixture made it
            ray.init(num_cpus=4, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _system_config=RAY_WORKERS_NOT_NICED)
        assert len(list(loader)) == 13  # a new iter(): new actors on the Ray that is back


def test_an_address_where_nothing_listens_fails_within_the_timeout_naming_it() -> None:
    """A mistyped port or a head that is down: ray.init blocked for over 7 minutes."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (f"import time, gloader, numpy as np\n"
            f"loader = gloader.DataLoader(np.arange(8), pool=gloader.RayPool(1, address='127.0.0.1:{port}'), timeout=5)\n"
            "started = time.monotonic()\n"
            "try:\n"
            "    next(iter(loader))\n"
            "except ConnectionError as exc:\n"
            "    print(round(time.monotonic() - started), exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    seconds, message = out.stdout.strip().split(" ", 1)
    assert int(seconds) <= 10 and f"127.0.0.1:{port}" in message and "nothing answers" in message
