"""The public surface is exactly the names the API reference (docs/api.md) documents."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

import gloader
from gloader import batchify, sampler


def test_all_is_sorted_and_exact() -> None:
    assert gloader.__all__ == sorted(gloader.__all__)
    assert set(gloader.__all__) == {"ArrayDataset", "BatchTimeoutError", "DataLoader", "Dataset", "IterableDataset", "RayPool",
                                    "SharedDict", "SharedList", "SimpleDataset", "WorkerExitedError", "WorkerInfo", "WorkerPool", "batchify",
                                    "get_worker_info", "sampler"}
    assert set(batchify.__all__) >= {"Dict", "Group", "List", "NamedTuple", "Pad", "Stack", "Tuple",
                                        "default_batchify_fn"}
    assert set(sampler.__all__) == {"BatchSampler", "DistributedBatchSampler", "DistributedSampler", "FilterSampler",
                                    "IntervalSampler", "RandomSampler", "Sampler", "SequentialSampler",
                                    "TokenBudgetBatchSampler", "WeightedMixtureSampler"}


def test_exported_names_report_module_gloader() -> None:
    for name in gloader.__all__:
        obj = getattr(gloader, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__ == "gloader", name


def test_dataloader_signature_matches_the_contract() -> None:
    params = inspect.signature(gloader.DataLoader).parameters
    positional = ["dataset", "batch_size", "shuffle", "sampler", "last_batch", "batch_sampler", "batchify_fn",
                  "num_workers", "pin_memory", "pin_device_id", "prefetch", "thread_pool", "timeout"]
    assert [p for p in params if params[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == positional
    defaults = {name: params[name].default for name in params if name != "dataset"}
    assert defaults == {"batch_size": 1, "shuffle": False, "sampler": None, "last_batch": None,
                        "batch_sampler": None, "batchify_fn": None, "num_workers": 0, "pin_memory": False,
                        "pin_device_id": 0, "prefetch": None, "thread_pool": False, "timeout": 120,
                        "device": None, "worker_init_fn": None, "seed": None, "start_method": None, "pool": None,
                        "progress": False, "collate_fn": None, "drop_last": None, "persistent_workers": None,
                        "prefetch_factor": None, "multiprocessing_context": None, "generator": None,
                        "in_order": True, "fetch_threads": None, "try_nopython": None, "cpu_budget": None,
                        "memory_budget": None}
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY
               for n in ("device", "worker_init_fn", "seed", "start_method", "pool", "progress", "collate_fn",
                         "drop_last", "persistent_workers", "prefetch_factor", "multiprocessing_context",
                         "generator", "in_order", "fetch_threads", "try_nopython", "cpu_budget", "memory_budget"))


def test_batchify_tuple_is_group() -> None:
    assert batchify.Tuple is batchify.Group


def test_mxnet2_try_nopython_is_accepted_and_checked() -> None:
    # Gluon 2.0 code passes it; gloader always runs the Python pipeline (MXNet's own fallback)
    expected = [b.tolist() for b in gloader.DataLoader(list(range(5)), 2)]
    for value in (None, True, False):
        assert [b.tolist() for b in gloader.DataLoader(list(range(5)), 2, try_nopython=value)] == expected
    with pytest.raises(TypeError, match="try_nopython must be True or False \\(or None\\), got 'auto'"):
        gloader.DataLoader(list(range(5)), 2, try_nopython="auto")


def test_each_argument_reaches_the_config_once_and_a_checked_one_is_also_an_attribute(monkeypatch) -> None:
    """A new argument is written in three places: the signature (with its doc), a config field
    (for one checked on its own, `_options._argument`) and the loader attribute; the rest
    (the call, the checks' wiring, vars()) follows from those."""
    from gloader._caller import options as _options

    parameters = inspect.signature(gloader.DataLoader.__init__).parameters
    seen: list[dict] = []
    build = _options.LoaderConfig.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(_options.LoaderConfig, "build",
                        classmethod(lambda cls, given: seen.append(given) or build(cls, given)))
    loader = gloader.DataLoader([1, 2, 3])
    assert list(seen[0]) == [name for name in parameters if name != "self"]
    for field in dataclasses.fields(_options.LoaderConfig):
        if "check" in field.metadata:
            name = field.metadata["argument"] or field.name
            assert name in parameters and name in vars(loader), name
