"""Changes to the dataset between epochs: seen by the next epoch, with worker processes too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gloader import DataLoader, WorkerPool
from gloader._caller.snapshot import first_difference, picture
from tests import _data


class _Holder:
    def __init__(self) -> None:
        self.scale = 1.0
        self.ratio = float("nan")
        self.items = [1, 2]
        self.options = {"crop": 224}
        self.inner = _data.Scaled(3)
        self.array = np.zeros(3)
        self.loop = self


@pytest.mark.parametrize("change, path", [
    (lambda h: setattr(h, "scale", 2.0), "dataset.scale"),
    (lambda h: h.items.append(3), "dataset.items"),
    (lambda h: h.options.update(crop=160), "dataset.options['crop']"),
    (lambda h: setattr(h.inner, "scale", 10), "dataset.inner.scale"),
    (lambda h: setattr(h, "array", np.ones(3)), "dataset.array"),
    (lambda h: setattr(h, "added", 1), "dataset.added"),
])
def test_the_picture_of_a_dataset_sees_attributes_items_and_objects_replaced(change, path) -> None:
    holder = _Holder()
    before = picture(holder)
    assert first_difference(before, picture(holder)) is None  # NaN and the cycle read the same twice
    change(holder)
    assert first_difference(before, picture(holder)) == path


def test_the_picture_does_not_see_inside_arrays() -> None:
    holder = _Holder()
    before = picture(holder)
    holder.array[0] = 5  # documented: assign a new array instead
    assert first_difference(before, picture(holder)) is None


def test_a_dataset_that_refers_to_its_loader_does_not_change_with_each_epoch() -> None:
    holder = _Holder()
    with DataLoader(list(range(4)), batch_size=2) as loader:
        holder.loader, holder.torch_loader = loader, torch.utils.data.DataLoader(list(range(4)), batch_size=2)
        before = picture(holder)
        list(loader), list(holder.torch_loader)  # new iterators on both
        assert first_difference(before, picture(holder)) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("thread_pool", [False, True], ids=["processes", "threads"])
def test_a_dataset_changed_between_epochs_is_loaded_as_changed_by_the_next_epoch(thread_pool: bool) -> None:
    dataset = _data.Scaled(12)
    scales = [1, 10, 10, 1000]
    epochs, pids = [], []
    with DataLoader(dataset, batch_size=4, shuffle=True, seed=3, num_workers=2, thread_pool=thread_pool) as loader:
        for scale in scales:
            dataset.scale = scale
            epochs.append(torch.cat(list(loader)).tolist())
            pids.append(loader.worker_pids())
    with DataLoader(_data.Scaled(12), batch_size=4, shuffle=True, seed=3) as reference:
        keys = [torch.cat(list(reference)).tolist() for _ in scales]
    # The same order as without workers (the epochs opened ahead were dispatched again), each
    # epoch with the scale set before it.
    assert epochs == [[key * scale for key in epoch] for epoch, scale in zip(keys, scales)]
    if not thread_pool:  # new workers where the dataset changed, the same ones where it did not
        assert pids[1] != pids[0] and pids[2] == pids[1] and pids[3] != pids[2]


@pytest.mark.timeout(120)
def test_persistent_workers_keep_their_copy_of_the_dataset_as_torchs_do() -> None:
    dataset = _data.Scaled(8)
    with DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        assert loader.persistent_workers is True
        first = torch.cat(list(loader)).tolist()
        pids = loader.worker_pids()
        dataset.scale = 10
        assert torch.cat(list(loader)).tolist() == first == list(range(8))
        assert loader.worker_pids() == pids


@pytest.mark.timeout(120)
def test_a_dataset_changed_under_a_shared_pool_gets_a_warning_that_says_what_to_do() -> None:
    dataset = _data.Scaled(8)
    with WorkerPool(2) as pool, DataLoader(dataset, batch_size=4, num_workers=2, pool=pool) as loader:
        assert torch.cat(list(loader)).tolist() == list(range(8))
        dataset.scale = 10
        with pytest.warns(RuntimeWarning, match=r"dataset.scale changed since this DataLoader joined its "
                                                r"WorkerPool.*make a new DataLoader on the pool") as said:
            batches = list(loader)
        assert said[0].filename == __file__  # points at the user's iteration, not into gloader
        assert torch.cat(batches).tolist() == list(range(8))  # the pool's copy, as the warning says
        assert torch.cat(list(loader)).tolist() == list(range(8))  # said once per change
    with WorkerPool(2) as pool, DataLoader(dataset, batch_size=4, num_workers=2, pool=pool) as fresh:
        assert torch.cat(list(fresh)).tolist() == [key * 10 for key in range(8)]
