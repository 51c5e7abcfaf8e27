"""What a loader's state was made for, and the checks a state must pass to load: the batch
policy and the order's samples (`describe` of gloader's samplers), the seed given, and a digest
of the keys of the batches after it (global batches for the samplers of a global order, so that
it is the same on every rank). A state that does not fit raises a ValueError naming each
difference, except the changes elastic resume allows (another number of ranks or workers with the
same global batch: none of them is recorded). Runs in the caller's process; nothing here starts
a process.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from .._checks import is_int
from .._wire.protocol import encode_keys
from .elastic import GlobalBatchSampler

__all__ = ["check_fields", "check_made_for", "made_for"]

_STATE_KEYS = ("epoch", "batches_yielded", "sampler", "seed")
# A state's digest covers the keys of this many batches after it (global batches for the samplers
# of `elastic`): what tells a state loaded into a loader whose batches would differ.
_DIGEST_BATCHES = 4


def check_fields(state: Any) -> None:
    """Raise TypeError/ValueError unless `state` has the fields `state_dict` writes, each possible."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict made by DataLoader.state_dict(), got {state!r:.80}")
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"state is missing {missing}; pass a dict made by DataLoader.state_dict()")
    for key in ("epoch", "batches_yielded", "seed"):
        if not is_int(state[key]) or state[key] < 0:
            raise ValueError(f"state[{key!r}] must be an integer >= 0, got {state[key]!r}")


def made_for(batch_sampler: Any, samples: int | None, start_state: Any, skip: int,
             works: Callable[[Any], Iterator[Any]]) -> dict[str, Any]:
    """What a state of `batch_sampler` at `skip` batches into the epoch drawn from `start_state`
    is made for: the batch policy (`describe` of gloader's samplers), the order's `samples`, and a
    digest of the batches after it (`works`: a batch sampler's epoch as the schedule sends it)."""
    describe = getattr(batch_sampler, "describe", None)
    made: dict[str, Any] = describe() if callable(describe) else {"batches": type(batch_sampler).__name__}
    made["samples"] = samples
    made["next_batches"] = _next_digest(batch_sampler, start_state, skip, works)
    return made


def check_made_for(state: Mapping[str, Any], given_seed: int | None, now: dict[str, Any]) -> None:
    """Raise ValueError naming each way this loader (`given_seed` its seed=, `now` what a state of
    it would be made for) differs from the one `state` was made for (a state without that
    record, from an older gloader, is not checked)."""
    made = state.get("made_for")
    if not isinstance(made, Mapping):
        return
    differences = []
    if given_seed is not None and state["seed"] != given_seed:
        differences.append(f"seed {state['seed']} (this loader's seed={given_seed})")
    differences += [f"{key} {made.get(key)!r} (this loader's: {now.get(key)!r})"
                    for key in sorted(set(made) | set(now)) if key != "next_batches" and made.get(key) != now.get(key)]
    if not differences and None not in (made.get("next_batches"), now.get("next_batches")) \
            and made["next_batches"] != now["next_batches"]:  # what the policy does not say: the dataset's order
        differences.append("the indices of the next batches (the sampler draws another order from this state)")
    if differences:
        raise ValueError("this state was made for another loader: " + "; ".join(differences) + ". A state resumes "
                         "the loader it was made for, with the same seed, dataset and batches (with a "
                         "DistributedBatchSampler or TokenBudgetBatchSampler, also on another number of ranks "
                         "with the same global batch): build the loader as it was, or start this one afresh")


def _next_digest(batch_sampler: Any, start_state: Any, skip: int,
                 works: Callable[[Any], Iterator[Any]]) -> str | None:
    """A digest of the keys of the `_DIGEST_BATCHES` batches after the first `skip` of the epoch
    that `batch_sampler` draws from `start_state`, drawn from a copy (the sampler and its
    dataset are left alone); global batches for a sampler of a global order, so that it is the
    same on every rank. None where it cannot be drawn so (a sampler without state)."""
    if start_state is None or not hasattr(batch_sampler, "load_state_dict"):
        return None
    inner = getattr(batch_sampler, "sampler", None)
    shared = {id(value): value for value in (getattr(inner, "_dataset", None), getattr(inner, "data_source", None))
              if value is not None}
    try:
        probe = copy.deepcopy(batch_sampler, shared)
        probe.load_state_dict(start_state)
        digest = hashlib.sha256()
        if isinstance(probe, GlobalBatchSampler):
            order, bounds = probe._global_epoch()
            batches: Iterator[Any] = (encode_keys(order[start:end]) for start, end in bounds)
        else:
            batches = works(probe)
        for work in itertools.islice(batches, skip, skip + _DIGEST_BATCHES):
            digest.update(work if isinstance(work, bytes) else repr(work).encode())
        return digest.hexdigest()[:16]
    except Exception:  # a sampler that cannot be copied or drawn so: its batches are not checked
        return None

