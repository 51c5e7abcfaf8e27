"""RayPool on a two-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`):
a worker node removed mid-epoch changes no batch."""
from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from gloader import DataLoader, RayPool
from tests.conftest import RAY_WORKERS_NOT_NICED

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.timeout(900),  # three nodes' processes start slowly on a loaded machine
              pytest.mark.xdist_group("ray")]  # one Ray instance at a time (pytest.ini)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head without workers' resources and two worker nodes of 2 CPUs each, which alone
    have the `cpu_node` resource the loader's actors ask for."""
    made = cluster_utils.Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 100 << 20, "include_dashboard": False,
        "_system_config": RAY_WORKERS_NOT_NICED})  # see test_ray's instance
    for _ in range(2):
        made.add_node(num_cpus=2, resources={"cpu_node": 2}, object_store_memory=100 << 20)
    made.wait_for_nodes()
    ray.init(address=made.address, log_to_driver=False, configure_logging=False)
    yield made
    ray.shutdown()
    made.shutdown()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    yield  # Ray's processes outlive a loader by design; the test checks the loader's actors


class Slow:
    def __len__(self) -> int:
        return 60

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(0.02)
        return np.full(2, index) + np.random.randint(1000)


def _node_of(actor: Any) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


def test_a_node_removed_mid_epoch_changes_no_batch(cluster: Any) -> None:
    kwargs = dict(batch_size=2, shuffle=True, seed=4)
    with DataLoader(Slow(), num_workers=0, **kwargs) as loader:
        expected = list(loader)
    pool = RayPool(4, num_cpus=0.5, resources={"cpu_node": 0.5}, actor_options={"scheduling_strategy": "SPREAD"})
    with DataLoader(Slow(), pool=pool, **kwargs) as loader:
        iterator = iter(loader)
        got = [next(iterator) for _ in range(4)]
        actors = list(loader._engine.workers.backend._actors)
        nodes = [_node_of(actor) for actor in actors]
        doomed = next(node for node in cluster.worker_nodes if node.node_id in nodes)
        cluster.remove_node(doomed)
        got += list(iterator)
        after = list(loader._engine.workers.backend._actors)
        replaced = [old for old, node in zip(actors, nodes) if node == doomed.node_id]
        assert replaced and all(old not in after for old in replaced)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
