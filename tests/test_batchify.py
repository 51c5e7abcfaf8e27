"""Batchify: dtype and structure rules, planned and materialized the same way."""
from __future__ import annotations

import collections.abc
import re
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gloader import DataLoader
from gloader.batchify import Append, AsList, Dict, Group, List, NamedTuple, Pad, Stack, Tuple, default_batchify_fn
from tests import _data


def test_default_rules_for_scalars_and_strings() -> None:
    assert default_batchify_fn([1, 2]).dtype == torch.int64
    assert default_batchify_fn([1.0, 2]).dtype == torch.float64
    assert default_batchify_fn([True, False]).dtype == torch.bool
    assert default_batchify_fn(["a", "b"]) == ["a", "b"]
    assert default_batchify_fn([b"x", b"y"]) == [b"x", b"y"]


def test_default_stacks_arrays_and_tensors_keeping_dtype() -> None:
    for dtype in (np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64,
                  np.complex64, np.bool_):
        out = default_batchify_fn([np.zeros((2, 3), dtype), np.ones((2, 3), dtype)])
        assert out.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype and out.shape == (2, 2, 3)
    out = default_batchify_fn([torch.zeros(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)])
    assert out.dtype == torch.bfloat16 and out.tolist() == [[0, 0], [1, 1]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_mxnet_ndarrays_from_gluon_datasets_batch_as_their_arrays(num_workers: int) -> None:
    from tests import _data

    with DataLoader(_data.GluonImages(), batch_size=4, num_workers=num_workers) as loader:
        batches = list(loader)
    images, labels = batches[1]
    assert images.dtype == torch.uint8 and images.shape == (4, 2, 3) and images[:, 0, 0].tolist() == [4, 5, 6, 7]
    assert labels.tolist() == [4, 5, 6, 7]
    assert default_batchify_fn([_data.FakeNDArray([1.5]), np.array([2.5])]).tolist() == [[1.5], [2.5]]


def test_default_recurses_into_tuples_and_dicts() -> None:
    out = default_batchify_fn([(np.array([1]), {"k": 1.5, "s": "a"}), (np.array([2]), {"k": 2.5, "s": "b"})])
    assert isinstance(out, list) and out[0].tolist() == [[1], [2]]
    assert out[1]["k"].tolist() == [1.5, 2.5] and out[1]["s"] == ["a", "b"]


@pytest.mark.parametrize("samples, lengths", [([(1, 2), (3,)], "[1, 2]"), ([(1,), (2, 3), (4,)], "[1, 2]"),
                                              ([[1, 2], [3, 4, 5]], "[2, 3]")])
def test_default_rejects_sequence_samples_of_different_lengths(samples: list, lengths: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"same length, got lengths {lengths}")):
        default_batchify_fn(samples)


def test_a_sequence_sample_that_fails_to_iterate_keeps_its_own_error() -> None:
    class Broken(collections.abc.Sequence):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> Any:
            if index == 0:
                return 0
            raise ValueError("field unreadable") if index == 1 else IndexError(index)

    with pytest.raises(ValueError, match="field unreadable"):
        default_batchify_fn([Broken(), Broken()])


@pytest.mark.parametrize("second", [np.zeros(3), np.zeros((2, 4)), np.zeros(2), np.zeros((2, 3, 1)), np.zeros((3, 3)),
                                    np.zeros(())],
                         ids=["length", "inner", "fewer-dims", "more-dims", "length-2d", "no-dims"])
def test_default_rejects_different_shapes_and_suggests_pad(second: np.ndarray) -> None:
    first = np.zeros(2) if second.shape == (3,) else np.zeros((2, 3))
    with pytest.raises(ValueError, match="different shapes.*Pad"):
        default_batchify_fn([first, second])


def test_pad_pads_to_longest_with_lengths_and_round_to() -> None:
    padded, lengths = Pad(pad_val=-1, ret_length=True, round_to=4)([np.array([1, 2]), np.array([3, 4, 5])])
    assert padded.tolist() == [[1, 2, -1, -1], [3, 4, 5, -1]]
    assert lengths.tolist() == [2, 3] and lengths.dtype == torch.int64


@pytest.mark.parametrize("samples", [["ab", "c"], [np.array([None]), np.array([1])]], ids=["strings", "objects"])
def test_pad_names_a_sample_that_is_not_numeric(samples: list[Any]) -> None:
    with pytest.raises(TypeError, match=r"Pad needs numeric arrays.*List\(\)"):
        Pad()(samples)


@pytest.mark.parametrize("call, error, match", [
    (lambda: Stack()([]), ValueError, "Stack needs at least one sample"),
    (lambda: Pad()([]), ValueError, "Pad needs at least one sample"),
    (lambda: Append()([np.zeros(2), "a"]), TypeError, r"Append needs numeric arrays.*'a'.*List\(\)"),
    (lambda: Pad(val=1, pad_val=2), ValueError, "val=1 and pad_val=2 both give the padding value.*pass one"),
    (lambda: Dict([Stack()]), TypeError, r"Dict takes a mapping of key -> batchify function.*got list"),
    (lambda: Dict({"x": Stack()}, x=Stack()), ValueError, r"keys \['x'\] both in the mapping and as keywords"),
    (lambda: default_batchify_fn([2**70, 1]), OverflowError, r"cannot batch \[1180591620717411303424\] as torch.int64"),
    (lambda: default_batchify_fn([np.zeros(2, ">f4")] * 2), TypeError, r"dtype >f4.*byte order.*newbyteorder"),
    (lambda: Stack()([np.zeros(2, ">f4")] * 2), TypeError, r"dtype >f4.*byte order.*newbyteorder"),
], ids=["stack-empty", "pad-empty", "append-string", "pad-val-with-pad-val", "dict-of-a-list", "dict-key-twice",
        "int-overflow", "byte-order", "stack-byte-order"])
def test_bad_batches_and_arguments_get_errors_that_name_them(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


class _GradSamples:
    """Sample i: row i of a weight that requires grad, times 2 (part of the weight's graph);
    odd rows as float64 when `mixed` (the row-by-row copy instead of one stack)."""

    def __init__(self, mixed: bool) -> None:
        self.weight = torch.randn(8, 3, requires_grad=True)
        self.mixed = mixed

    def __len__(self) -> int:
        return 8

    def __getitem__(self, idx: int) -> torch.Tensor:
        row = self.weight[idx] * 2
        return row.double() if self.mixed and idx % 2 else row


@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2, "thread_pool": True}], ids=["in-process", "threads"])
@pytest.mark.parametrize("mixed", [False, True], ids=["one-dtype", "mixed-dtypes"])
def test_samples_that_require_grad_batch_with_their_graph_as_torch_batches_them(mode: dict, mixed: bool) -> None:
    dataset = _GradSamples(mixed)
    expected = torch.utils.data.default_collate([dataset[i] for i in range(4)])
    with DataLoader(dataset, batch_size=4, **mode) as loader:
        batch = next(iter(loader))
    assert batch.dtype == expected.dtype and torch.equal(batch, expected) and batch.grad_fn is not None
    batch.sum().backward()  # the graph reaches the dataset's weight
    assert torch.equal(dataset.weight.grad[:4], torch.full((4, 3), 2.0)) and not dataset.weight.grad[4:].any()


def test_samples_that_require_grad_cross_processes_as_tensors_that_require_grad() -> None:
    """A graph cannot cross processes (torch's workers raise there): the batch comes back as a
    tensor that requires grad, its values those of the stacked samples."""
    dataset = _GradSamples(False)
    with DataLoader(dataset, batch_size=4, num_workers=2) as loader:
        batch = next(iter(loader))
    assert batch.requires_grad and torch.equal(batch.detach(), (dataset.weight[:4] * 2).detach())


def test_dict_samples_with_their_keys_in_another_order_batch_by_the_first_samples_keys() -> None:
    samples = [{"a": 1, "b": 2.0}, {"b": 4.0, "a": 3}]
    expected = torch.utils.data.default_collate(samples)
    got = default_batchify_fn(samples)
    assert list(got) == list(expected) == ["a", "b"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="dict samples of one batch must have the same keys"):
        default_batchify_fn([{"a": 1}, {"a": 2, "c": 3}])


@pytest.mark.parametrize("pad", [Pad(pad_val=-1), Pad(val=-1)], ids=["gluonnlp", "mxnet2"])
def test_pad_takes_reversed_views_as_their_copies(pad: Pad) -> None:
    reversed_view = np.arange(4.0)[::-1]  # negative strides, as x[::-1] augmentations make
    assert pad([reversed_view, np.ones(2)]).tolist() == pad([reversed_view.copy(), np.ones(2)]).tolist()


def test_pad_along_inner_axis_and_dtype() -> None:
    out = Pad(axis=1, dtype="float32")([np.ones((2, 1)), np.ones((2, 3))])
    assert out.shape == (2, 2, 3) and out.dtype == torch.float32
    assert out[0, :, 1:].abs().sum() == 0


def test_pad_rejects_mismatched_other_axes() -> None:
    with pytest.raises(ValueError, match="agree on every other axis"):
        Pad(axis=0)([np.ones((2, 2)), np.ones((3, 3))])


def test_group_dict_list_stack() -> None:
    out = Group(Stack(), Pad(), List())([(1, [1], "a"), (2, [1, 2], "b")])
    assert isinstance(out, tuple) and out[0].tolist() == [1, 2] and out[1].tolist() == [[1, 0], [1, 2]]
    assert out[2] == ["a", "b"]
    assert Tuple([Stack(), Stack()])([(1, 2), (3, 4)])[1].tolist() == [2, 4]
    d = Dict(x=Stack(dtype=np.float32), y=List())([{"x": 1, "y": "p"}, {"x": 2, "y": "q"}])
    assert d["x"].dtype == torch.float32 and d["y"] == ["p", "q"]
    with pytest.raises(ValueError, match="needs samples with 2 fields"):
        Group(Stack(), Stack())([(1, 2, 3)])
    with pytest.raises(ValueError, match="exactly these keys"):
        Dict(x=Stack())([{"y": 1}])


def test_user_callables_inside_group_work() -> None:
    out = Group(lambda xs: np.array(xs) * 2, Stack())([(1, 2), (3, 4)])
    assert out[0].tolist() == [2, 6] and isinstance(out[0], torch.Tensor)


@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=8), st.integers(-3, 3))
def test_pad_property_every_row_holds_its_sample_then_padding(lengths: list[int], pad_val: int) -> None:
    samples = [np.arange(n) + 10 for n in lengths]
    out = Pad(pad_val=pad_val)(samples)
    assert out.shape == (len(samples), max(lengths))
    for row, sample in zip(out.tolist(), samples):
        assert row[:len(sample)] == sample.tolist() and all(v == pad_val for v in row[len(sample):])


def test_bad_batchify_arguments_name_the_value() -> None:
    with pytest.raises(TypeError, match="dtype must be a numeric numpy or torch dtype, got 'text'"):
        Stack(dtype="text")
    with pytest.raises(ValueError, match="round_to must be an integer >= 1 or None, got 0"):
        Pad(round_to=0)
    with pytest.raises(TypeError, match="Group needs one or more batchify functions"):
        Group()


def test_namedtuple_samples_come_back_as_the_same_namedtuple() -> None:
    out = default_batchify_fn([_data.Point(np.zeros(2, np.float32), 1), _data.Point(np.ones(2, np.float32), 2)])
    assert type(out) is _data.Point and out.label.tolist() == [1, 2] and out.image.shape == (2, 2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_namedtuple_batches_cross_process_workers_as_namedtuples(num_workers: int) -> None:
    with DataLoader(_data.NamedSamples(), batch_size=4, num_workers=num_workers) as loader:
        batches = list(loader)
    assert all(type(b) is _data.Point for b in batches)
    assert batches[1].label.tolist() == [4, 5, 6, 7] and batches[1].image[:, 0].tolist() == [4, 5, 6, 7]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True},
                                  {"num_workers": 1, "start_method": "spawn"}], ids=["inline", "fork", "threads", "spawn"])
@pytest.mark.parametrize("batch_size", [4, None], ids=["batched", "unbatched"])
def test_a_namedtuple_made_in_a_class_body_comes_back_as_that_class(mode: dict, batch_size: int | None) -> None:
    """Its qualified name finds nothing, so the stdlib pickler refused it and dill sent a copy of
    the class: `isinstance(batch, Dataset.Sample)` was False with process workers."""
    with DataLoader(_data.NestedNamedSamples(), batch_size=batch_size, **mode) as loader:
        batches = list(loader)
    assert all(type(b) is _data.NestedNamedSamples.Sample for b in batches)
    assert torch.cat([torch.as_tensor(b.label).reshape(-1) for b in batches]).tolist() == list(range(8))


@pytest.mark.timeout(120)
def test_a_class_body_namedtuple_of_a_main_script_comes_back_through_spawned_workers(tmp_path: Any) -> None:
    """A spawned worker runs the script as `__mp_main__` and holds a copy of the dataset's
    class: the namedtuple it makes is found by name and fields, and sent as `__main__`'s."""
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import collections
        import gloader

        class Rows(gloader.Dataset):
            Row = collections.namedtuple("Row", ["value"])

            def __len__(self):
                return 4

            def __getitem__(self, idx):
                return self.Row(idx)

        if __name__ == "__main__":
            with gloader.DataLoader(Rows(), batch_size=2, num_workers=1, start_method="spawn") as loader:
                batches = list(loader)
            print(all(type(b) is Rows.Row for b in batches), [b.value.tolist() for b in batches])
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and done.stdout.strip() == "True [[0, 1], [2, 3]]", done.stderr[-3000:]


def test_any_sequence_sample_is_transposed_into_a_list_of_fields() -> None:
    class Row(collections.abc.Sequence):  # a user Sequence, neither tuple nor list
        def __init__(self, *items: Any) -> None:
            self.items = items

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: Any) -> Any:
            return self.items[i]

    out = default_batchify_fn([Row(1, 2.5), Row(3, 4.5)])
    assert out[0].tolist() == [1, 3] and out[0].dtype == torch.int64 and out[1].dtype == torch.float64


def test_strings_of_every_kind_stay_a_list_and_object_arrays_raise_as_in_torch() -> None:
    assert default_batchify_fn([np.str_("a"), np.str_("b")]) == ["a", "b"]
    assert default_batchify_fn([b"x", b"y"]) == [b"x", b"y"]
    texts = default_batchify_fn([np.array(["a", "b"]), np.array(["c", "d"])])
    assert isinstance(texts, list) and [t.tolist() for t in texts] == [["a", "b"], ["c", "d"]]
    with pytest.raises(TypeError, match="cannot batch numpy arrays of dtype object"):
        default_batchify_fn([np.array([None]), np.array([1], dtype=object)])


@pytest.mark.timeout(60)
def test_text_rows_in_numpy_format_batch_through_workers() -> None:
    with DataLoader(_data.TextRows(), batch_size=3, num_workers=2) as loader:
        first = next(iter(loader))
    assert first["text"] == ["row number 0", "row number 1", "row number 2"]
    assert first["label"].tolist() == [0, 1, 0] and first["label"].dtype == torch.int64


def test_python_and_numpy_numbers_mix_numpy_first_and_none_is_a_type_error() -> None:
    assert default_batchify_fn([1, np.int64(2), 3]).dtype == torch.int64
    assert default_batchify_fn([np.int64(2), 1]).dtype == torch.int64
    assert default_batchify_fn([1, 2.5, np.float32(1)]).dtype == torch.float64
    assert default_batchify_fn([True, np.bool_(False)]).dtype == torch.bool
    with pytest.raises(TypeError, match=r"cannot batch numbers together with \[None\] \(batch \[1, None\]\)"):
        default_batchify_fn([1, None])


_MIXED_DTYPES = [
    (np.array([1.5], np.float32), np.array([1e-50])),  # float32 alone would make the second 0
    (np.array([1]), np.array([1.5], np.float32)),  # torch's promotion: float32, not numpy's float64
    (np.array([200], np.uint8), np.array([-1], np.int8)),
    (np.array([True]), np.array([5])),
    (np.float32(1.5), np.float64(1e-50)),
    (np.int32(1), np.float64(1.5)),
    (torch.tensor([1]), torch.tensor([1.5])),  # int64 alone would make the second 1
    (torch.tensor([1.5]), torch.tensor([1e-50], dtype=torch.float64)),
    (torch.tensor(1), torch.tensor(1.5)),
]


@pytest.mark.parametrize("first, other", _MIXED_DTYPES, ids=lambda value: str(value.dtype))
def test_a_field_of_several_dtypes_is_promoted_as_torchs_default_collate_does(first: Any, other: Any) -> None:
    for samples in ([first, other], [other, first], [first, first, other, first]):
        expected = torch.utils.data.default_collate(samples)
        for batchify in (default_batchify_fn, Stack()):
            got = batchify(samples)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (batchify, samples)


def test_numpy_without_casting_in_stack_batches_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy before 1.24 (which MXNet 1.9 needs) has no casting= in np.stack; its fill by
    concatenation gives the same batches, promoted dtypes included."""
    from gloader._wire import plans as _plans

    monkeypatch.setattr(_plans, "_STACK_CASTS", False)
    cases = [*_MIXED_DTYPES, (np.float32(1.5), np.float32(2.5)), (np.int64(3), np.int64(4))]
    for first, other in cases:
        for samples in ([first, other], [other, first, first]):
            expected = torch.utils.data.default_collate(samples)
            got = default_batchify_fn(samples)
            assert got.dtype == expected.dtype and torch.equal(got, expected), samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers, threads", [(0, False), (2, False), (2, True)],
                         ids=["in-process", "processes", "threads"])
@pytest.mark.parametrize("size", [4, 8192], ids=["small", "row-wise"])  # 8192 float32: written row by row
def test_samples_of_several_dtypes_batch_through_workers_with_the_promoted_dtype(num_workers: int, threads: bool,
                                                                                 size: int) -> None:
    samples = [(np.full(size, i + 0.25, np.float32 if i % 3 else np.float64), i) for i in range(12)]
    with DataLoader(samples, batch_size=4, num_workers=num_workers, thread_pool=threads) as loader:
        batches = list(loader)
    assert [b[0].dtype for b in batches] == [torch.float64] * 3
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.tensor(np.stack([s[0] for s in samples])))
    one_dtype = [(np.full(size, i, np.float32), i) for i in range(8)]
    with DataLoader(one_dtype, batch_size=4, num_workers=num_workers, thread_pool=threads) as loader:
        assert [b[0].dtype for b in loader] == [torch.float32] * 2


def test_an_array_of_the_other_byte_order_after_the_first_batches_with_its_values() -> None:
    batch = default_batchify_fn([np.array([1.5, 2.5], "<f4"), np.array([3.5, 4.5], ">f4")])
    assert batch.dtype == torch.float32 and batch.tolist() == [[1.5, 2.5], [3.5, 4.5]]


def test_fields_that_cannot_become_one_tensor_say_what_they_hold() -> None:
    with pytest.raises(TypeError, match=r"numpy dtypes \['<U1', 'float64'\] into one tensor: torch has no dtype for <U1"):
        default_batchify_fn([np.array([1.5]), np.array(["a"])])
    with pytest.raises(TypeError, match="cannot batch tensors of layout torch.sparse_coo .*tensor.to_dense"):
        default_batchify_fn([torch.eye(2).to_sparse(), torch.eye(2).to_sparse()])
    assert List()([torch.eye(2).to_sparse()])[0].is_sparse


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_fields_of_other_objects_stay_a_list_where_torch_raises(num_workers: int) -> None:
    samples = [(i, None, {i}, _data.Spot(i, -i)) for i in range(4)]
    with pytest.raises(TypeError, match="default_collate: batch must contain"):
        torch.utils.data.default_collate(samples)
    with DataLoader(samples, batch_size=4, num_workers=num_workers) as loader:
        (batch,) = list(loader)
    assert batch[0].tolist() == [0, 1, 2, 3]
    assert batch[1:] == [[None] * 4, [{0}, {1}, {2}, {3}], [_data.Spot(i, -i) for i in range(4)]]


@pytest.mark.timeout(60)
def test_nested_tensors_pass_through_process_workers() -> None:
    with DataLoader([np.arange(n) for n in (1, 2, 3, 4)], batch_size=2, num_workers=1,
                    batchify_fn=_data.nested_batchify) as loader:
        batches = list(loader)
    assert all(b.is_nested for b in batches)
    assert [t.tolist() for t in batches[1].unbind()] == [[0, 1, 2], [0, 1, 2, 3]]


def test_mxnet2_pad_pads_every_axis_and_rounds_each() -> None:
    out = Pad(val=-1)([np.ones((1, 3)), np.ones((2, 2))])
    assert out.shape == (2, 2, 3) and out[0, 1].tolist() == [-1, -1, -1] and out[1, :, 2].tolist() == [-1, -1]
    assert Pad(val=None, round_to=4)([np.ones((1, 3))]).shape == (1, 4, 4)
    assert Pad(val=0, dtype="float32")([np.ones(2, np.int64)]).dtype == torch.float32


@pytest.mark.parametrize("axis", [1, -1])
def test_gluonnlp_1_pad_with_val_and_axis_pads_that_axis_only(axis: int) -> None:
    # GluonNLP 1.0 spells it Pad(val=..., axis=...): one axis, as GluonNLP 0.x's pad_val does
    samples = [np.array([[1, 2, 3, 4], [5, 6, 7, 8]]), np.array([[5, 8], [1, 2]])]
    out = Pad(axis=axis, val=-1)(samples)
    assert out.tolist() == [[[1, 2, 3, 4], [5, 6, 7, 8]], [[5, 8, -1, -1], [1, 2, -1, -1]]]
    assert torch.equal(out, Pad(axis=axis, pad_val=-1)(samples))
    with pytest.raises(ValueError, match="agree on every other axis"):  # one axis: the others must agree
        Pad(axis=axis, val=-1)([np.ones((2, 3)), np.ones((3, 4))])
    padded, lengths = Pad(val=-1, ret_length=True)([np.ones(2), np.ones(3)])  # ret_length: one axis, 0
    assert padded.tolist() == [[1, 1, -1], [1, 1, 1]] and lengths.tolist() == [2, 3]


_Pair = collections.namedtuple("_Pair", ["data", "label"])


@pytest.mark.parametrize("workers", [0, 2])
def test_gluonnlp_namedtuple_and_dict_of_a_mapping_batch_through_workers(workers: int) -> None:
    pairs = [_Pair(np.arange(i + 1), i) for i in range(8)]
    for fns in ([Pad(val=-1), Stack()], (Pad(val=-1), Stack()), {"label": Stack(), "data": Pad(val=-1)}):
        with DataLoader(pairs, batch_size=4, num_workers=workers, batchify_fn=NamedTuple(_Pair, fns)) as loader:
            batch = list(loader)[1]
        assert isinstance(batch, _Pair) and batch.label.tolist() == [4, 5, 6, 7]
        assert batch.data.tolist()[0] == [0, 1, 2, 3, 4, -1, -1, -1]
    keyed = [{0: np.arange(i + 1), "y": i} for i in range(4)]  # a key that no keyword can spell
    with DataLoader(keyed, batch_size=4, num_workers=workers,
                    batchify_fn=Dict({0: Pad()}, y=Stack())) as loader:
        (batch,) = list(loader)
    assert batch[0].tolist()[1] == [0, 1, 0, 0] and batch["y"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("call, match", [
    (lambda: NamedTuple(_Pair, {"data0": Stack(), "label": Stack()}), r"one batchify function per field \['data', "),
    (lambda: NamedTuple(_Pair, [Stack()] * 3), "needs a list of 2 batchify functions"),
    (lambda: NamedTuple(_Pair, [1, 2]), "needs callable batchify functions"),
    (lambda: NamedTuple(_Pair, [Stack(), Stack()])([(1, 2)]), r"needs _Pair samples, got tuple \(1, 2\)"),
], ids=["unknown-field", "too-many", "not-callable", "not-that-class"])
def test_gluonnlp_namedtuple_names_what_does_not_match_its_fields(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
    with pytest.raises(TypeError, match="container must be a namedtuple class, got <class 'tuple'>"):
        NamedTuple(tuple, [Stack()])


def test_aslist_and_append_keep_samples_apart() -> None:
    assert AsList()(["a", 1]) == ["a", 1]
    out = Append()([np.zeros(2), np.ones(3)])
    assert [tuple(t.shape) for t in out] == [(1, 2), (1, 3)]
    assert [tuple(t.shape) for t in Append(expand=False)([np.zeros(2)])] == [(2,)]


def test_batchify_functions_show_as_they_were_written_in_errors() -> None:
    written = ["Stack()", "Stack(dtype='float32')", "Pad()", "Pad(axis=1, pad_val=-1, ret_length=True, round_to=8)",
               "Pad(val=-1)", "Pad(val=None)", "Group(Stack(), Pad(val=0))", "Dict({'x': Stack()})",
               "Dict({0: Pad()})", "NamedTuple(_Pair, [Stack(), List()])", "List()",
               "Append(expand=False, batch_axis=1)"]
    for text in written:
        assert repr(eval(text)) == text
    with pytest.raises(TypeError, match=re.escape("got (Stack(), 3)")):
        Group(Stack(), 3)
