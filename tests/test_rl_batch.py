"""The RL batch protocol: row operations, meta merging and data-only serialisation."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from shardwise.data.batch import Batch


def make_batch(rows: int = 6) -> Batch:
    """Row i holds i everywhere, so row order can be read back from any field."""
    return Batch.from_dict(
        tensors={
            "ids": torch.arange(rows * 3, dtype=torch.int64).reshape(rows, 3),
            "row": torch.arange(rows, dtype=torch.float32),
        },
        arrays={
            "prompt": [f"p{i}" for i in range(rows)],
            "gid": np.arange(rows) // 2,
        },
        meta={"step": 7},
    )


def row_order(batch: Batch) -> list[int]:
    order = [int(x) for x in batch.tensors["row"].tolist()]
    # every part of the batch must agree on which rows it holds
    assert batch.tensors["ids"][:, 0].tolist() == [3 * i for i in order]
    assert batch.arrays["prompt"].tolist() == [f"p{i}" for i in order]
    assert batch.arrays["gid"].tolist() == [i // 2 for i in order]
    return order


def assert_same(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype, k
        assert torch.equal(a.tensors[k], b.tensors[k]), k
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype, k
        assert a.arrays[k].shape == b.arrays[k].shape, k
        assert a.arrays[k].tolist() == b.arrays[k].tolist(), k
    assert a.meta == b.meta


# ------------------------------------------------------------------ construction


def test_len_and_from_dict_makes_object_arrays():
    b = make_batch(4)
    assert len(b) == 4
    assert b.arrays["prompt"].dtype == object
    # a list of lists stays one list per row, not a 2-d array
    nested = Batch.from_dict(arrays={"gt": [[1, 2], [3, 4]]})
    assert nested.arrays["gt"].shape == (2,)
    assert nested.arrays["gt"][1] == [3, 4]
    assert len(Batch()) == 0


def test_first_dimension_mismatch_names_the_key():
    with pytest.raises(ValueError, match="'mask' has 3 rows but 'ids' has 4"):
        Batch.from_dict(tensors={"ids": torch.zeros(4, 2), "mask": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="'prompt' has 5 rows"):
        Batch.from_dict(tensors={"ids": torch.zeros(4, 2)}, arrays={"prompt": ["a"] * 5})
    with pytest.raises(ValueError, match="0-dimensional"):
        Batch(tensors={"loss": torch.tensor(1.0)})


# ------------------------------------------------------------------ row selection


def test_getitem_int_slice_tensor_list_and_mask():
    b = make_batch(6)
    assert row_order(b[2]) == [2]
    assert row_order(b[-1]) == [5]
    assert row_order(b[1:4]) == [1, 2, 3]
    assert row_order(b[torch.tensor([4, 0, 4])]) == [4, 0, 4]
    assert row_order(b[[5, 1]]) == [5, 1]
    assert row_order(b[np.array([3])]) == [3]
    assert row_order(b[torch.tensor([True, False, True, False, False, True])]) == [0, 2, 5]
    assert len(b[[]]) == 0
    with pytest.raises(IndexError):
        b[6]


def test_select_keeps_only_named_keys():
    b = make_batch(3)
    b.meta["metrics"] = {"loss": 1.0}
    s = b.select(tensor_keys=["row"], array_keys=[], meta_keys=["step"])
    assert list(s.tensors) == ["row"] and s.arrays == {} and s.meta == {"step": 7}
    everything = b.select()
    assert set(everything.tensors) == {"ids", "row"} and set(everything.meta) == {"step", "metrics"}
    with pytest.raises(ValueError, match="did you mean 'ids'"):
        b.select(tensor_keys=["idz"])


def test_chunk_then_concat_round_trip():
    b = make_batch(6)
    parts = b.chunk(3)
    assert [row_order(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p.meta == {"step": 7} for p in parts)
    assert_same(Batch.concat(parts), b)


def test_chunk_indivisible_points_to_pad_to_divisor():
    with pytest.raises(ValueError, match="pad_to_divisor"):
        make_batch(5).chunk(2)


def test_split_sizes():
    b = make_batch(7)
    assert [row_order(p) for p in b.split(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [len(p) for p in b.split(7)] == [7]
    assert [len(p) for p in b.split(10)] == [7]
    assert [len(p) for p in b.split(1)] == [1] * 7


def test_repeat_interleaved_and_tiled_row_order():
    b = make_batch(3)
    assert row_order(b.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    assert row_order(b.repeat(3, interleave=False)) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert row_order(b.repeat(1)) == [0, 1, 2]


def test_reorder_is_a_permutation():
    b = make_batch(4)
    assert row_order(b.reorder([2, 0, 3, 1])) == [2, 0, 3, 1]
    assert row_order(b.reorder(torch.tensor([3, 2, 1, 0]))) == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2])


@pytest.mark.parametrize("divisor", range(2, 8))
@pytest.mark.parametrize("rows", range(1, 20))
def test_pad_to_divisor_and_unpad(rows, divisor):
    b = make_batch(rows)
    padded, pad = b.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0
    assert pad == (-rows) % divisor and len(padded) == rows + pad
    # padding repeats rows from the start, cyclically
    assert row_order(padded) == list(range(rows)) + [i % rows for i in range(pad)]
    parts = padded.chunk(divisor)
    assert_same(Batch.concat(parts).unpad(pad), b)


def test_pad_single_row_to_seven():
    padded, pad = make_batch(1).pad_to_divisor(7)
    assert pad == 6 and row_order(padded) == [0] * 7


# ------------------------------------------------------------------ meta merging


def test_concat_merges_metrics_into_lists():
    a, b, c = make_batch(2), make_batch(2), make_batch(1)
    a.meta["metrics"] = {"loss": 1.0, "lr": 0.1}
    b.meta["metrics"] = {"loss": [2.0, 3.0]}
    c.meta["metrics"] = {"loss": 4.0, "lr": 0.2}
    out = Batch.concat([a, b, c])
    assert out.meta["metrics"] == {"loss": [1.0, 2.0, 3.0, 4.0], "lr": [0.1, 0.2]}
    assert out.meta["step"] == 7
    assert len(out) == 5
    # the inputs are untouched
    assert a.meta["metrics"] == {"loss": 1.0, "lr": 0.1}


def test_concat_conflicting_meta_names_the_key():
    a, b = make_batch(2), make_batch(2)
    b.meta["step"] = 8
    with pytest.raises(ValueError, match="'step'"):
        Batch.concat([a, b])
    del b.meta["step"]
    with pytest.raises(ValueError, match="'step' is missing"):
        Batch.concat([a, b])


def test_concat_requires_same_keys():
    a, b = make_batch(2), make_batch(2).select(tensor_keys=["ids"])
    with pytest.raises(ValueError, match="tensors keys"):
        Batch.concat([a, b])


def test_union_joins_keys_and_rejects_conflicts():
    b = make_batch(3)
    extra = Batch.from_dict(
        tensors={"row": torch.arange(3, dtype=torch.float32), "logp": torch.full((3, 2), -1.0)},
        meta={"step": 7, "metrics": {"gen_s": 2.0}},
    )
    b.meta["metrics"] = {"reward": 0.5}
    u = b.union(extra)
    assert set(u.tensors) == {"ids", "row", "logp"}
    assert torch.equal(u.tensors["logp"], torch.full((3, 2), -1.0))
    assert u.meta["metrics"] == {"reward": 0.5, "gen_s": 2.0}
    assert row_order(u) == [0, 1, 2]

    clash = Batch.from_dict(tensors={"row": torch.tensor([0.0, 1.0, 9.0])})
    with pytest.raises(ValueError, match="tensor 'row'"):
        b.union(clash)
    with pytest.raises(ValueError, match="meta 'step'"):
        b.union(Batch.from_dict(tensors={"row": torch.arange(3.0)}, meta={"step": 1}))
    with pytest.raises(ValueError, match="array 'prompt'"):
        b.union(Batch.from_dict(arrays={"prompt": ["p0", "p1", "x"]}))
    with pytest.raises(ValueError, match="rows"):
        b.union(make_batch(4))


# ------------------------------------------------------------------ serialisation


def rich_batch() -> Batch:
    return Batch.from_dict(
        tensors={
            "bf16": torch.tensor([[1.5, -2.25], [3.0e-3, 7.0]], dtype=torch.bfloat16),
            "f32": torch.tensor([[0.1, float("inf")], [float("nan"), -0.0]]),
            "i64": torch.tensor([2**40, -3]),
            "mask": torch.tensor([[True, False], [False, True]]),
            "u8": torch.tensor([[[1], [2]], [[3], [255]]], dtype=torch.uint8),
        },
        arrays={
            "prompt": ["héllo", None],
            "gt": [{"answer": [1, 2.5], "ok": True}, [3, "x"]],
            "gid": np.array([10, 11], dtype=np.int32),
            "score": np.array([[0.25, 1e-30], [2.0, -1.0]], dtype=np.float32),
            "tag": np.array(["a", "bcd"]),
            "flag": np.array([True, False]),
        },
        meta={"metrics": {"loss": [1.0, 2.0]}, "step": 3, "name": "run", "none": None},
    )


def assert_bitwise_same(a: Batch, b: Batch) -> None:
    assert list(a.tensors) == list(b.tensors)
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        # compare bits so NaN and -0.0 count too
        assert x.contiguous().view(torch.uint8).tolist() == y.contiguous().view(torch.uint8).tolist(), k
    assert list(a.arrays) == list(b.arrays)
    for k in a.arrays:
        x, y = a.arrays[k], b.arrays[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), k
        assert x.tobytes() == y.tobytes() if x.dtype != object else x.tolist() == y.tolist(), k
    assert a.meta == b.meta


def test_to_bytes_round_trip_keeps_dtypes_shapes_and_values():
    b = rich_batch()
    data = b.to_bytes()
    assert isinstance(data, bytes)
    assert_bitwise_same(Batch.from_bytes(data), b)
    back = Batch.from_bytes(data)
    assert back.arrays["gt"][0] == {"answer": [1, 2.5], "ok": True}
    assert back.arrays["prompt"][1] is None


def test_round_trip_of_a_non_contiguous_slice_and_empty_batch():
    b = rich_batch()
    view = Batch(tensors={"t": torch.arange(12.0).reshape(3, 4)[:, ::2]})
    assert torch.equal(Batch.from_bytes(view.to_bytes()).tensors["t"], torch.tensor([[0.0, 2], [4, 6], [8, 10]]))
    empty = b[[]]
    back = Batch.from_bytes(empty.to_bytes())
    assert len(back) == 0 and back.tensors["u8"].shape == (0, 2, 1) and back.arrays["score"].shape == (0, 2)


def test_pickle_goes_through_to_bytes():
    b = rich_batch()
    back = pickle.loads(pickle.dumps(b))
    assert_bitwise_same(back, b)
    # a value JSON cannot carry fails in pickling too: proof that pickle uses to_bytes
    b.meta["bad"] = object()
    with pytest.raises(TypeError, match="meta\\['bad'\\]"):
        pickle.dumps(b)


def test_deepcopy_does_not_go_through_json():
    b = make_batch(2)
    b.meta["obj"] = (1, 2)  # a tuple, which to_bytes refuses
    c = copy.deepcopy(b)
    assert c.meta["obj"] == (1, 2)
    c.tensors["row"][0] = 99.0
    assert b.tensors["row"][0] == 0.0


@pytest.mark.parametrize(
    "arrays, meta, where",
    [
        ({"x": np.array([np.int64(1), 2], dtype=object)}, {}, "arrays\\['x'\\] element 0.*item"),
        ({"x": [object(), 1]}, {}, "arrays\\['x'\\] element 0"),
        ({"x": [(1, 2), 1]}, {}, "tuple"),
        ({"x": np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]")}, {}, "datetime64"),
        ({}, {"metrics": {"loss": torch.tensor(1.0)}}, "meta\\['metrics'\\]\\['loss'\\].*item"),
        ({}, {"m": {1: 2}}, "non-str key"),
    ],
)
def test_to_bytes_refuses_values_json_cannot_carry(arrays, meta, where):
    b = Batch.from_dict(tensors={"t": torch.zeros(2)}, arrays=arrays, meta=meta)
    with pytest.raises(TypeError, match=where):
        b.to_bytes()


def test_from_bytes_rejects_foreign_bytes():
    with pytest.raises(ValueError, match="magic"):
        Batch.from_bytes(b"not a batch at all")
