"""Shared WorkerPool: several loaders on one pool, joining and leaving while it runs."""
from __future__ import annotations

import gc
import json
import os
import pathlib
import pickle
import platform
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import gloader
from gloader import DataLoader, WorkerPool
from gloader._pool import directory as _pooldir
from gloader._worker import setup as _process_setup
from tests import _data
from tests.conftest import payload_dirs

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", [{}, {"thread_pool": True}, {"start_method": "spawn"}])
def test_loaders_share_a_pool_interleaved_each_seeing_only_its_data(kind: dict) -> None:
    with WorkerPool(2, **kind) as pool:
        loaders = [DataLoader(_data.Tagged(tag, 20), batch_size=3, pool=pool, shuffle=True, seed=tag)
                   for tag in (1, 2, 3)]
        try:
            for _ in range(2):
                iters = [iter(loader) for loader in loaders]
                seen: dict[int, list[int]] = {1: [], 2: [], 3: []}
                for _ in range(8):
                    for tag, it in zip((1, 2, 3), iters):
                        batch = next(it, None)
                        if batch is not None:
                            assert (batch[:, 0] == tag).all()
                            seen[tag] += batch[:, 1].tolist()
                assert all(sorted(v) == list(range(20)) for v in seen.values())
        finally:
            for loader in loaders:
                loader.close()


def test_shared_pool_batches_match_an_owned_pool() -> None:
    with DataLoader(_data.RandomAugmented(30), batch_size=4, num_workers=2, seed=5, shuffle=True) as own:
        expected = list(own)
    with WorkerPool(2) as pool, DataLoader(_data.RandomAugmented(30), batch_size=4, pool=pool, seed=5,
                                           shuffle=True) as shared:
        got = list(shared)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


def test_loader_joins_running_pool_and_leaving_drops_its_dataset_from_workers() -> None:
    with WorkerPool(2) as pool:
        first = DataLoader(_data.RegistryProbe(1), batch_size=2, pool=pool)
        list(first)
        pids = set(pool.worker_pids())
        second = DataLoader(_data.RegistryProbe(2), batch_size=2, pool=pool)
        rows = torch.cat(list(second))
        assert set(pool.worker_pids()) == pids  # joined without restarting workers
        assert set(rows[:, 2].tolist()) <= pids
        first_id = first._id
        first.close()
        # Every worker drops the departed loader at its next task.
        for _ in range(3):
            rows = torch.cat(list(second))
        late = rows[-8:]
        assert all(first_id not in row[4:].tolist() for row in late)
        assert (rows[:, 0] == 2).all()
        second.close()


def test_thread_pool_loader_close_unregisters_its_dataset() -> None:
    from gloader._worker import registry as _registry

    with DataLoader(np.arange(8), batch_size=2, num_workers=2, thread_pool=True) as loader:
        list(loader)
        assert loader._id in _registry.registered_ids()
    assert loader._id not in _registry.registered_ids()


@pytest.mark.parametrize("kwargs, match", [
    ({"num_workers": 3}, "num_workers=3 conflicts with pool="),
    ({"thread_pool": True}, "thread_pool=True conflicts with pool="),
    ({"start_method": "spawn"}, "start_method='spawn' conflicts with pool="),
])
def test_conflicting_settings_with_pool_are_value_errors(kwargs: dict, match: str) -> None:
    with WorkerPool(2) as pool:
        with pytest.raises(ValueError, match=match):
            DataLoader([1, 2], batch_size=1, pool=pool, **kwargs)


def test_worker_pool_argument_errors() -> None:
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        WorkerPool(0)
    with pytest.raises(ValueError, match="start_method must be one of"):
        WorkerPool(1, start_method="threads")
    with pytest.raises(TypeError, match="pool must be a gloader.WorkerPool"):
        DataLoader([1], batch_size=1, pool="pool")


def test_pool_dropped_without_close_is_cleaned_up_with_a_warning() -> None:
    pool = WorkerPool(2)
    with pytest.warns(ResourceWarning, match="WorkerPool was garbage-collected while running"):
        del pool
        gc.collect()


def test_loader_on_closed_pool_fails_clearly() -> None:
    pool = WorkerPool(1)
    loader = DataLoader([1, 2], batch_size=1, pool=pool)
    pool.close()
    with pytest.raises(RuntimeError, match="WorkerPool is closed"):
        next(iter(loader))
    loader.close()
    with pytest.raises(ValueError, match="pool= is a closed WorkerPool; create a new one"):
        DataLoader([1, 2], batch_size=1, pool=pool)


def test_three_notebook_loaders_deleted_in_any_order_never_affect_each_other() -> None:
    with WorkerPool(2) as pool:
        made = {name: DataLoader(_data.Tagged(tag, 12), batch_size=4, pool=pool)
                for tag, name in enumerate(("train", "val", "test"), start=1)}
        for order in (("val", "train", "test"),):
            for name in order:
                for other, loader in made.items():
                    if loader is not None:
                        tag = ("train", "val", "test").index(other) + 1
                        assert all((b[:, 0] == tag).all() for b in loader)
                made[name].close()
                made[name] = None
    for mode in ({"num_workers": 2}, {"num_workers": 2, "thread_pool": True}):
        loaders = [DataLoader(_data.Tagged(t, 12), batch_size=4, **mode) for t in (1, 2, 3)]
        for drop in (2, 0, 1):
            loaders[drop].close()
            for t, loader in enumerate(loaders, start=1):
                if not loader._closed:
                    assert all((b[:, 0] == t).all() for b in loader)
        assert gloader.get_worker_info() is None


def test_a_task_reader_killed_mid_message_leaves_the_whole_task_for_the_next_reader(tmp_path) -> None:
    import os
    import pickle
    import struct

    import multiprocess

    from gloader._pool.channel import TrackedQueue
    from tests.conftest import wait_until

    ctx = multiprocess.get_context("fork")
    tasks = TrackedQueue(ctx=ctx, lock_dir=str(tmp_path), name="tasks", atomic_reads=True)
    task = ("task", list(range(5000)))  # ~15 KB: several reads' worth when taken in pieces
    data = pickle.dumps(task)
    framed = struct.pack("!i", len(data)) + data
    os.write(tasks._writer.fileno(), framed[:len(framed) // 2])  # a task half written
    reader = ctx.Process(target=tasks.get)
    reader.start()

    def reader_holds_the_lock() -> bool:
        if tasks._rlock.acquire(block=False):
            tasks._rlock.release()
            return False
        return True

    try:
        assert wait_until(reader_holds_the_lock, 10.0)  # it waits inside get(), for the rest of the task
        reader.kill()
        reader.join(10.0)
        os.write(tasks._writer.fileno(), framed[len(framed) // 2:])
        assert tasks.get() == task  # nothing of it was taken by the dead reader, and its lock is free
    finally:
        reader.kill()
        reader.join(10.0)
        reader.close()
        _close_task_queue(tasks)


def _close_task_queue(tasks) -> None:
    for end in (tasks._reader, tasks._writer, tasks._socket):
        if end is not None:
            end.close()
    tasks._rlock.close()


def _claim_then_die(tasks, record: str) -> None:
    from gloader._pool import channel

    def claim(task) -> None:
        with open(record, "w") as handle:
            handle.write(repr(task))
        os._exit(0)  # killed between claiming the task and taking it

    channel.on_task_taken(claim)
    tasks.get()


def test_a_worker_claims_a_task_before_taking_it_so_a_death_between_loses_nothing(tmp_path) -> None:
    """A worker says which task it holds before the task leaves the socket: a death in
    between can name a task it did not take, but never take one unnamed."""
    import multiprocess

    from gloader._pool.channel import TrackedQueue

    ctx = multiprocess.get_context("fork")
    tasks = TrackedQueue(ctx=ctx, lock_dir=str(tmp_path), name="tasks", atomic_reads=True)
    task = ("task", 7, [1, 2, 3])
    tasks._writer.send_bytes(pickle.dumps(task))
    reader = ctx.Process(target=_claim_then_die, args=(tasks, str(tmp_path / "claimed")))
    reader.start()
    try:
        reader.join(10.0)
        assert reader.exitcode == 0
        assert (tmp_path / "claimed").read_text() == repr(task)  # it saw the whole task first
        assert tasks.get() == task  # and the task is still there for the next worker
    finally:
        reader.kill()
        reader.join(10.0)
        reader.close()
        _close_task_queue(tasks)


@pytest.mark.parametrize("atomic_bytes", [None, 1 << 20], ids=["default", "waits-for-whole-messages-up-to-1MiB"])
def test_a_task_larger_than_the_socket_holds_reaches_its_reader_whole(tmp_path, monkeypatch, atomic_bytes) -> None:
    """A reader that waits for a whole task before taking it would wait forever for one the
    socket cannot hold (the writer waits for room): such a task is read in pieces."""
    import threading

    import multiprocess

    from gloader._pool import channel

    if atomic_bytes is not None:
        monkeypatch.setattr(channel, "ATOMIC_TASK_BYTES", atomic_bytes)
    ctx = multiprocess.get_context("fork")
    tasks = channel.TrackedQueue(ctx=ctx, lock_dir=str(tmp_path), name="tasks", atomic_reads=True)
    task = ("task", bytes(range(256)) * 1200)  # ~300 KB, more than a socket holds by default
    writer = threading.Thread(target=tasks._writer.send_bytes, args=(channel.pickle.dumps(task),), daemon=True)
    writer.start()
    try:
        assert tasks.get() == task
        writer.join(10.0)
        assert not writer.is_alive()
    finally:
        _close_task_queue(tasks)


def _stop_writer(writer: Any, results: Any) -> None:
    """End a test's writer process and close the result queue it wrote into."""
    writer.kill()
    writer.join(10.0)
    writer.close()
    results._reader.close()
    results._writer.close()
    results._wlock.close()


def test_a_result_writer_killed_while_the_pipe_is_full_leaves_no_part_of_its_result(tmp_path) -> None:
    """A result written in part (its writer killed while waiting for room) would make the
    reader take the next writer's bytes for the rest of it: a shared pool would stall."""
    import fcntl

    import multiprocess

    from gloader._pool import channel
    from tests.conftest import wait_until

    ctx = multiprocess.get_context("fork")
    results = channel.TrackedQueue(ctx=ctx, lock_dir=str(tmp_path), name="results")
    fd = results._writer.fileno()
    filler = b"f" * (fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) - 8192)
    results.put(filler)  # nobody reads yet: the pipe has less room left than the next result needs
    queued = channel._available(fd)
    writer = ctx.Process(target=results.put, args=(b"r" * 20000,))
    writer.start()

    def waits() -> bool:  # in the kernel's pipe write, or sleeping until the pipe has room
        with open(f"/proc/{writer.pid}/wchan") as handle:
            where = handle.read()
        return "pipe_write" in where or "nanosleep" in where

    try:
        assert wait_until(waits, 10.0)
        writer.kill()
        writer.join(10.0)
        assert channel._available(fd) == queued  # none of its result went in
        results.put("next")
        assert results._reader.recv() == filler
        assert results._reader.recv() == "next"
    finally:
        _stop_writer(writer, results)


def test_a_result_larger_than_the_pipe_holds_goes_through_a_file_and_a_message_written_whole(tmp_path) -> None:
    """Written into the pipe, a result over its capacity would go in pieces (the writer
    waits for room), and a writer killed between two would leave part of it there."""
    import fcntl
    import select

    import multiprocess

    from gloader._pool import channel

    ctx = multiprocess.get_context("fork")
    results = channel.TrackedQueue(ctx=ctx, lock_dir=str(tmp_path), name="results")
    fd = results._writer.fileno()
    big = bytes(range(256)) * (fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // 128)  # twice what the pipe holds
    writer = ctx.Process(target=results.put, args=(big,))
    writer.start()
    try:
        writer.join(10.0)
        assert writer.exitcode == 0  # nobody reads yet: all it put in the pipe fitted
        assert 0 < channel._available(fd) <= select.PIPE_BUF  # one small message, written whole
        assert results._reader.recv() == big
        assert sorted(p.name for p in tmp_path.iterdir()) == ["results.read.lock", "results.write.lock"]  # the file is gone
    finally:
        _stop_writer(writer, results)


def test_a_result_queue_left_open_at_interpreter_exit_closes_its_lock_quietly(tmp_path) -> None:
    # Its lock's __del__ may run after the os module is torn down.
    code = ("import multiprocess\nfrom gloader._pool.channel import TrackedQueue\n"
            f"queue = TrackedQueue(ctx=multiprocess.get_context('fork'), lock_dir={str(tmp_path)!r}, "
            "name='results')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == ""


def test_a_sweep_removes_pool_directories_that_no_living_process_holds(tmp_path) -> None:
    import fcntl

    from gloader._pool import directory as _pooldir

    def made(name: str, alive: bool, age_s: float = 0.0) -> str:
        path = tmp_path / f"gloader-payload-{name}"
        path.mkdir()
        (path / "tasks.read.lock").touch()
        if alive:
            (path / "alive").touch()
        when = time.time() - age_s
        os.utime(path, (when, when))
        return str(path)

    held = made("held", alive=True)  # its pool's process lives: it holds the lock
    holder = os.open(os.path.join(held, "alive"), os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_SH)
    try:
        orphan = made("orphan", alive=True)  # marked, and nobody holds it: its process is gone
        making = made("making", alive=False)  # not marked yet (or an older gloader's), recent
        stale = made("stale", alive=False, age_s=2 * _pooldir._UNMARKED_GRACE_S)
        other = tmp_path / "unrelated"
        other.mkdir()
        assert _pooldir.sweep_orphans(str(tmp_path)) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            os.path.basename(p) for p in (held, making, str(other)))
        assert not os.path.exists(orphan) and not os.path.exists(stale)
    finally:
        os.close(holder)
    assert _pooldir.sweep_orphans(str(tmp_path)) == 1  # released: the held one goes too
    assert not os.path.exists(held)


def test_a_pool_directory_is_marked_alive_and_removed_on_close() -> None:
    from gloader._pool import directory as _pooldir

    directory = _pooldir.PoolDirectory()
    try:
        assert os.listdir(directory.path) == ["alive"]
        _pooldir.sweep_orphans(os.path.dirname(directory.path))
        assert os.path.isdir(directory.path)  # a sweep leaves a living pool's directory alone
    finally:
        directory.close()
    assert not os.path.exists(directory.path)
    directory.close()  # a second close is a no-op


def test_a_pool_that_fails_to_start_removes_its_directory(monkeypatch) -> None:
    from gloader._pool import core as _pool

    def no_pool(*args: Any, **kwargs: Any) -> Any:
        raise OSError(11, "cannot start workers")

    monkeypatch.setattr(_pool, "ProcessPool", no_pool)
    before = payload_dirs()
    with pytest.raises(OSError, match="cannot start workers"):
        _pool.make_core(2, False, "fork", [])
    assert payload_dirs() - before == set()


def test_a_pool_closed_by_a_second_ctrl_c_still_removes_its_directory(monkeypatch) -> None:
    from gloader._pool import core as _pool

    before = payload_dirs()
    core = _pool.make_core(2, False, "fork", [])
    pids = [p.pid for p in core.pool.workers]
    stop = core._close_processes

    def interrupted(prompt: bool) -> None:
        if not prompt:  # Ctrl-C while the workers are asked to finish
            raise KeyboardInterrupt
        stop(prompt)

    monkeypatch.setattr(core, "_close_processes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        core.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)  # stopped (and reaped) at once
    assert payload_dirs() - before == set()


def test_tasks_of_large_cheap_batches_are_grouped_without_stalling_the_pool() -> None:
    """Batches of 900 cheap samples each are grouped many to a task; their keys (7.2 KB a
    batch) once made task messages larger than the task socket holds (~115 KB), and the pool
    stalled until the timeout."""
    with DataLoader(list(range(180_000)), batch_size=900, shuffle=True, num_workers=2, timeout=20) as loader:
        for _ in range(3):
            seen = torch.cat(list(loader)).tolist()
            assert sorted(seen) == list(range(180_000))


_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine() not in _SCHED_GETATTR,
                    reason="sched_getattr is read on Linux x86_64/aarch64 only")
def test_oversubscribed_workers_ask_for_a_longer_time_slice_and_keep_their_nice_value() -> None:
    """Workers beyond the CPUs switch less often with a longer slice; pools that fit their
    CPUs keep the default (shorter wake-up delays for the caller); the request must not reset
    the nice value the workers inherit (a `nice`d training script stays niced)."""
    cpus = len(os.sched_getaffinity(0))
    script = textwrap.dedent(f"""
        import ctypes, os, struct
        import gloader

        class Scheduling:
            def __len__(self):
                return 1

            def __getitem__(self, index):
                attr = ctypes.create_string_buffer(56)
                ctypes.CDLL(None).syscall(ctypes.c_long({_SCHED_GETATTR[platform.machine()]}), ctypes.c_long(0), attr,
                                          ctypes.c_long(56), ctypes.c_long(0))
                size, policy, flags, nice, priority, runtime = struct.unpack("IIQiIQQQII", attr.raw)[:6]
                return policy, nice, runtime, os.getpriority(os.PRIO_PROCESS, 0)

        for workers in (1, {cpus + 1}):
            with gloader.DataLoader(Scheduling(), batch_size=1, num_workers=workers) as loader:
                print(*[int(field) for field in next(iter(loader))])
        """)
    done = subprocess.run(["nice", "-n", "5", sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    fitting, oversubscribed = [tuple(map(int, line.split())) for line in done.stdout.splitlines()]
    for policy, nice, _, priority in (fitting, oversubscribed):
        assert (policy, nice, priority) == (os.SCHED_OTHER, 5, 5)
    if oversubscribed[2] == 0:
        pytest.skip("this kernel does not report time slices (custom slices need Linux 6.12+)")
    assert oversubscribed[2] == _process_setup._WORKER_SLICE_NS
    assert fitting[2] != _process_setup._WORKER_SLICE_NS


def test_files_planted_in_the_shared_temp_directory_neither_hang_nor_reach_a_new_pool(tmp_path, monkeypatch) -> None:
    """Another local user can write to /tmp: a FIFO or a link named as a pool directory's
    marker there must not block or steer a new pool, threads included."""
    import tempfile

    from gloader._pool import directory as _pooldir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / "gloader-payload-planted"
    planted.mkdir()
    os.mkfifo(planted / "alive")  # what an older gloader would have opened, blocking
    base = tmp_path / f"gloader-{os.getuid()}"
    for thread_pool in (False, True):
        with WorkerPool(1, thread_pool=thread_pool) as pool:
            with DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
                assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
            assert oct(base.stat().st_mode & 0o777) == "0o700"  # the pools' directories are in it
    assert (planted / "alive").exists()  # left alone: not ours to remove
    assert not base.exists()  # the last pool removed its empty base: nothing left in the temp directory
    base = pathlib.Path(_pooldir.user_base())
    inside = base / "gloader-payload-odd"  # even inside the user's own directory: nothing blocks
    inside.mkdir()
    os.mkfifo(inside / "alive")
    (base / "gloader-payload-link").symlink_to(planted)
    assert _pooldir.sweep_orphans(str(base)) == 0


def test_a_base_directory_others_can_use_is_left_alone_for_a_private_one_said_once(tmp_path, monkeypatch,
                                                                                   caplog) -> None:
    """Another user who makes `<tmp>/gloader-<uid>` first (here: open to everyone, then a link)
    cannot keep this user's loaders from starting, threads included: a private directory of the
    process's own serves, a warning names both paths and the fix once, and nothing of the
    other path is touched."""
    import logging
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_pooldir, "_private_base", None)
    monkeypatch.setattr(_pooldir, "_said_private", False)
    base = tmp_path / f"gloader-{os.getuid()}"
    base.mkdir(mode=0o777)
    base.chmod(0o777)  # as another user could leave it, open to everyone
    with caplog.at_level(logging.WARNING, logger="gloader"):
        for thread_pool in (False, True):
            with DataLoader(np.arange(4), batch_size=2, num_workers=1, thread_pool=thread_pool) as loader:
                assert torch.cat(list(loader)).tolist() == [0, 1, 2, 3]
        base.rmdir()
        base.symlink_to(tmp_path)
        with WorkerPool(1) as pool, DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
            assert len(list(loader)) == 2
    said = [r.getMessage() for r in caplog.records if "pool directories" in r.getMessage()]
    assert len(said) == 1 and f"{base} is a directory of uid {os.getuid()} with mode 777" in said[0]
    assert "TMPDIR" in said[0]
    assert base.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [base.name]  # the private one went


def test_a_private_base_that_went_and_came_back_as_a_link_is_not_reused(tmp_path, monkeypatch) -> None:
    """Where `<tmp>/gloader-<uid>` is someone else's, the process's private directory serves; once
    its last pool removed it, another user can put a link to a directory of theirs at its name.
    The next pool must not follow it: its directory (and the payloads workers unpickle) would be
    made where that user can swap them."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(_pooldir, "_private_base", None)
    monkeypatch.setattr(_pooldir, "_said_private", True)
    (tmp_path / f"gloader-{os.getuid()}").mkdir(mode=0o777)
    (tmp_path / f"gloader-{os.getuid()}").chmod(0o777)  # taken, open to everyone
    with WorkerPool(1) as pool, DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
        assert len(list(loader)) == 2
    private = pathlib.Path(_pooldir._private_base)
    assert not private.exists()  # the last pool removed it
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    private.symlink_to(theirs)  # what another user can do once the name is free
    with WorkerPool(1) as pool, DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
        assert len(list(loader)) == 2
        assert not pool.core.payload_dir.startswith(str(private) + os.sep)
        assert list(theirs.iterdir()) == []  # nothing of the pool's was made in their directory
    assert private.is_symlink()  # and the link, not ours, is left alone


def test_a_pool_directory_others_can_write_to_is_refused_for_payloads(tmp_path) -> None:
    """The payload of a loader joining a running pool is a pickle that workers load: it is written
    and read only in a directory of the user's alone, through no link, as a file only they can
    write; anything else is a PermissionError naming the path, and nothing is unpickled."""
    with WorkerPool(1) as pool:
        directory = pool.core.payload_dir
        os.chmod(directory, 0o777)
        try:
            with DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
                with pytest.raises(PermissionError, match=f"{directory}.*closed to others"):
                    next(iter(loader))
        finally:
            os.chmod(directory, 0o700)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "theirs.pkl").write_bytes(pickle.dumps(1))
    (private / "link.pkl").symlink_to(private / "theirs.pkl")
    with pytest.raises(OSError):  # ELOOP: a link is not followed
        _pooldir.open_private_file(str(private / "link.pkl"))
    os.chmod(private / "theirs.pkl", 0o666)
    with pytest.raises(PermissionError, match="only they can write"):
        _pooldir.open_private_file(str(private / "theirs.pkl"))
    os.mkfifo(private / "fifo.pkl", 0o600)
    with pytest.raises(PermissionError, match="not a file"):  # never blocks on a FIFO
        _pooldir.open_private_file(str(private / "fifo.pkl"))


def _big_bytes(samples: list[Any]) -> bytes:
    return b"x" * (4 << 20)  # travels in its answer, too large for the result pipe: spilled to a file


def test_a_full_temp_directory_fails_the_batch_naming_the_directory_not_the_worker(monkeypatch) -> None:
    import errno

    from gloader._pool import channel

    def full(data: bytes, directory: str) -> bytes:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(channel, "spill", full)  # inherited by the forked worker
    with DataLoader(list(range(8)), batch_size=2, num_workers=1, start_method="fork", batchify_fn=_big_bytes) as loader:
        with pytest.raises(OSError, match=r"could not write a \d+\.\d MiB result to .*gloader-payload-.*TMPDIR") as info:
            list(loader)
        assert info.value.errno == errno.ENOSPC and loader.worker_pids()  # the worker lives on


def test_joining_a_shared_pool_on_a_full_disk_names_the_file_and_the_fix(monkeypatch) -> None:
    import errno

    from gloader._pool import core as _pool

    def full(obj: Any, handle: Any, protocol: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with WorkerPool(1) as pool:
        DataLoader(np.arange(4), batch_size=2, pool=pool).close()  # the pool runs
        monkeypatch.setattr(_pool.pickle, "dump", full)
        with pytest.raises(OSError, match=r"could not write .* to .*gloader-payload-.*\.pkl\.tmp: No space left.*TMPDIR"):
            with DataLoader(np.arange(4), batch_size=2, pool=pool) as loader:
                list(loader)
        assert not [name for name in os.listdir(pool.core.payload_dir) if name.endswith(".tmp")]


def test_closing_while_a_worker_loads_a_batch_nobody_wants_is_quiet(caplog) -> None:
    """Closing mid-epoch, with a worker inside a slow sample: it is stopped, and nothing is said
    at WARNING, since nothing is wrong (an idle worker that ignores the stop still is)."""
    import logging

    from tests import _data

    with caplog.at_level(logging.WARNING, logger="gloader"):
        loader = DataLoader(_data.Sleepy(slow=2, seconds=30.0), batch_size=2, num_workers=1)
        it = iter(loader)
        next(it)  # the worker goes on to batch 1, inside sample 2 for 30 s
        pids = loader.worker_pids()
        loader.close()
    assert not [record.getMessage() for record in caplog.records]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_the_three_undocumented_names_of_multiprocess_the_pool_uses_are_in_the_installed_release() -> None:
    """The pool runs on multiprocess's documented API but for three names (the exit hooks a
    worker runs at its end, the table of children a forked child must leave, what the fork
    server preloads): a release that renames one fails here, not in a user's worker."""
    from multiprocess import forkserver, process, util

    assert callable(util._exit_function)
    assert isinstance(process._children, set)
    assert isinstance(list(forkserver._forkserver._preload_modules), list)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_forkserver_workers_fork_from_a_server_that_imported_gloader_and_torch(tmp_path: pathlib.Path) -> None:
    # In a fresh program: this one's fork server started before any loader (tests/conftest.py).
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import json

        import numpy as np
        from multiprocess import forkserver

        from gloader import DataLoader

        if __name__ == "__main__":
            forkserver.set_forkserver_preload(["__main__", "json"])  # the program's own list
            with DataLoader(np.arange(64, dtype=np.float32), batch_size=8, num_workers=2,
                            start_method="forkserver") as loader:
                total = float(sum(batch.sum() for batch in loader))
                server = forkserver._forkserver._forkserver_pid
                with open(f"/proc/{server}/maps") as maps:
                    torch_in_server = "libtorch" in maps.read()
                in_workers = []
                for pid in loader.worker_pids():
                    with open(f"/proc/{pid}/stat") as stat:
                        in_workers += [pid] if stat.read().split()[3] == str(server) else []  # its parent
            print(json.dumps({"total": total, "torch_in_server": torch_in_server, "workers_forked_by_server": len(in_workers),
                              "preload": forkserver._forkserver._preload_modules}))
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"total": float(sum(range(64))), "torch_in_server": True, "workers_forked_by_server": 2,
                   "preload": ["__main__", "json", "gloader"]}
