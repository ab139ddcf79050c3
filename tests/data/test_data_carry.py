"""Columns carried beside the tokens by the collators (:mod:`padfree.data.carry`): per-token ones laid out like the
tokens in every row, per-sample ones (a processor's pixels and grids) concatenated in the order the samples sit in
the rows, and what cannot keep its place beside its tokens refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from padfree import PaddingFreeCollator, packed_collate_fn
from padfree.errors import InvalidArgumentError, InvalidSampleError


def _samples():
    """Four samples; each one's grid row holds its index, each of its pixel rows its index, token types mark its
    second token."""
    out = []
    for i, n in enumerate([2, 5, 3, 4]):
        out.append({"input_ids": list(range(10 * i + 1, 10 * i + 1 + n)), "types": [0, 1] + [0] * (n - 2),
                    "pixels": torch.full((i + 1, 3), float(i)), "grid": torch.tensor([[i, i, i]])})
    return out


def test_per_token_columns_follow_the_tokens_and_per_sample_ones_the_row_order():
    samples = _samples()
    batch = packed_collate_fn(7, carry=["types", "pixels", "grid"])(samples)
    order = batch.sequence_ids.tolist()
    assert order != sorted(order)  # the packer reordered the samples: the check below can see the order
    ids, types = batch.input_ids, batch.carried["types"]
    for row in range(batch.batch_size):
        for col in range(batch.seq_len):
            token = int(ids[row, col])
            want = 0 if token == 0 else int(samples[(token - 1) // 10]["types"][(token - 1) % 10])
            assert int(types[row, col]) == want
    assert batch.carried["grid"][:, 0].tolist() == order
    assert batch.carried["pixels"][:, 0].tolist() == [float(i) for i in order for _ in range(i + 1)]
    inputs = batch.model_inputs()
    assert inputs["pixels"] is batch.carried["pixels"] and inputs["types"] is batch.carried["types"]
    moved = batch.to("cpu")
    assert moved.carried.keys() == batch.carried.keys()


def test_padding_free_rows_carry_the_same_columns():
    samples = _samples()
    batch = PaddingFreeCollator(carry=["types", "grid"], pad_to_multiple_of=8)(samples)
    assert batch.carried["types"].tolist() == [[t for s in samples for t in s["types"]] + [0, 0]]
    assert batch.carried["grid"][:, 0].tolist() == [0, 1, 2, 3]


def test_a_sample_without_a_per_sample_value_adds_nothing():
    samples = _samples()
    del samples[1]["grid"]
    samples[2]["grid"] = None
    batch = PaddingFreeCollator(carry=["grid"])(samples)
    assert batch.carried["grid"][:, 0].tolist() == [0, 3]


def test_what_cannot_keep_its_place_is_refused_by_name():
    samples = _samples()
    with pytest.raises(InvalidSampleError, match=r"samples\[1\] carries 'grid' but its tokens were split"):
        packed_collate_fn(4, overlong="split", carry=["grid"])(samples)
    with pytest.raises(InvalidSampleError, match=r"samples\[1\] carries 'grid' but its tokens were split"):
        packed_collate_fn(4, overlong="truncate", carry=["grid"])(samples)
    assert packed_collate_fn(4, overlong="drop", carry=["grid"])(samples).carried["grid"][:, 0].tolist() != []
    packed = [{"input_ids": [1, 2, 3, 4], "seq_lens": [2, 2], "grid": [[1, 1, 1]]}]
    with pytest.raises(InvalidSampleError, match="already-packed samples"):
        packed_collate_fn(8, carry=["grid"])(packed)
    samples[0]["types"] = [0, 1, 0]
    with pytest.raises(InvalidSampleError, match=r"samples\[0\]\['types'\].*one value per token of its 2"):
        PaddingFreeCollator(carry=["types"])(samples)
    samples = _samples()
    samples[2]["pixels"] = torch.zeros(2, 4)
    with pytest.raises(InvalidSampleError, match="'pixels' values cannot be concatenated"):
        PaddingFreeCollator(carry=["pixels"])(samples)
    samples = _samples()
    samples[0]["types"] = np.array([0.5, 0])
    with pytest.raises(InvalidSampleError, match="float64 values"):
        PaddingFreeCollator(carry=["types"])(samples)
    for bad, why in [(["labels"], "builds itself"), ([3], "list of column names"), ({"a": 1}, "list of column")]:
        with pytest.raises(InvalidArgumentError, match=why):
            packed_collate_fn(8, carry=bad)
