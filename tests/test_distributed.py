"""torch.distributed: real ranks (gloo, localhost), each with its own gloader."""
from __future__ import annotations

import pytest

from examples import distributed

pytestmark = pytest.mark.timeout(120)


def test_two_gloo_ranks_cover_the_dataset_disjointly_and_reshuffle_per_epoch() -> None:
    length = 103
    seen = distributed.main(length=length, epochs=2, world_size=2)
    for epoch in range(2):
        shards = [rank[epoch] for rank in seen]
        assert len(shards[0]) == len(shards[1]) == 52  # pad: ceil(103 / 2) each
        flat = shards[0] + shards[1]
        assert set(flat) == set(range(length))
        assert len(flat) - len(set(flat)) == 1  # exactly the one documented padding index
    assert seen[0][0] != seen[0][1] and seen[1][0] != seen[1][1]
