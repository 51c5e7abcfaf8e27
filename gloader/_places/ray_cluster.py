"""What a Ray cluster offers a `RayPool` (see `_places.ray`): whether anything answers at its
address, and whether the pool's actors fit in its resources, said before the loader waits on
them. Runs in the caller's process; Ray's module is passed in, never imported here.
"""
from __future__ import annotations

import socket
import time
import warnings
from typing import Any

__all__ = ["amounts", "check_reachable", "resources_each", "warn_if_no_room"]

# Ray frees an ended actor's resources a moment after `ray.kill`: a loader's start looks again for
# this long before it says its actors wait for resources held by others.
_FREEING_S = 1.0
# Ports of a Ray cluster's address, said in the error for an address where nothing answers.
_RAY_PORTS = "a head node's GCS listens on 6379, a Ray client server on 10001"


def check_reachable(address: str | None, timeout_s: float) -> None:
    """Raise ConnectionError when nothing accepts a connection at a cluster's `host:port` (or
    `ray://host:port`) within `timeout_s`. None, 'auto' and 'local' are found by ray.init itself."""
    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return  # not host:port: ray.init says what is wrong with it
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"RayPool could not reach the Ray cluster at {address!r}: nothing answers on "
                              f"{host}:{port} within the loader's timeout={timeout_s:g} ({exc.strerror or exc}); check "
                              f"the address and the port ({_RAY_PORTS}) and that the head node is up") from exc


def resources_each(pool: Any) -> dict[str, float]:
    """What each actor of the pool reserves."""
    return {"CPU": pool.num_cpus, **pool.resources}


def _fitting(needed: dict[str, float], available: dict[str, float]) -> int:
    """How many actors each needing `needed` fit in `available` (resources a cluster lists)."""
    return min(int(available.get(name, 0.0) // amount) for name, amount in needed.items() if amount > 0)


def warn_if_no_room(ray: Any, pool: Any, timeout_s: float) -> None:
    """Say at once when the pool's actors cannot all be placed: the cluster is smaller than they
    need, or other actors (another loader's) hold what they need. Those that do not fit wait
    for room (an autoscaler may add it, or the other actors may end), and the loader runs on
    the others; while none is placed, a batch fails at its timeout, saying so."""
    needed = resources_each(pool)
    total, available = ray.cluster_resources(), ray.available_resources()
    cpus, wanted = total.get("CPU", 0.0), pool.num_cpus * pool.num_workers
    if wanted > cpus:
        warnings.warn(f"{pool!r} reserves {wanted:g} CPUs (num_cpus={pool.num_cpus:g} per actor) and the Ray cluster "
                      f"has {cpus:g}: actors that do not fit wait for room, and the loader runs on the others; "
                      "lower num_cpus or num_workers, or add nodes", RuntimeWarning, stacklevel=7)
        return
    deadline = time.monotonic() + min(_FREEING_S, timeout_s / 4)  # actors just ended (a loader closed) free theirs a moment later
    while _fitting(needed, available) < pool.num_workers and time.monotonic() < deadline:
        time.sleep(0.05)
        available = ray.available_resources()
    waiting = pool.num_workers - _fitting(needed, available)
    if waiting > 0:
        warnings.warn(f"{pool!r}: {waiting} of its {pool.num_workers} Ray actors wait for resources: each needs "
                      f"{needed}, and the cluster has {amounts(available, needed)} available of "
                      f"{amounts(total, needed)} (other actors hold the rest, another loader's on this pool too); "
                      "they start once it is free, and until one has, a batch fails at the loader's timeout",
                      RuntimeWarning, stacklevel=7)


def amounts(resources: dict[str, float], names: dict[str, float]) -> dict[str, float]:
    return {name: resources.get(name, 0.0) for name in names}
