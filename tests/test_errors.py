"""Every bad input to the packing engine: one PadfreeError subclass whose message names the culprit."""

from __future__ import annotations

import numpy as np
import pytest

from padfree import (
    InvalidArgumentError,
    InvalidLengthsError,
    InvalidTokensError,
    OverlongSequenceError,
    Packer,
    PadfreeError,
    pack_sequences,
)


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([[1, 2], [3, 4]], r"lengths must be 1-D, got an array of shape \(2, 2\)"),
        (5, "lengths must be a 1-D sequence of integers, got 5"),
        ("abc", "lengths must be a 1-D sequence of integers, got 'abc'"),
        ([3, 2.5], r"lengths\[1\] = 2.5 is not an integer"),
        ([3, float("nan")], r"lengths\[1\] = nan is not an integer"),
        ([3, None], r"lengths\[1\] = None \(type NoneType\) is not an integer"),
        ([3, "7"], "lengths must hold integers, got dtype <U21"),
        ([True, False], "got booleans"),
        ([4, 0, -2], r"lengths\[1\] = 0, but every length must be >= 1 \(2 of 3 values are < 1\)"),
        (np.array([2**64 - 1], np.uint64), r"lengths\[0\] = 18446744073709551615 does not fit in int64"),
    ],
)
def test_bad_lengths(lengths, match):
    with pytest.raises(InvalidLengthsError, match=match):
        pack_sequences(lengths, 16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity must be an integer >= 1, got 0"),
        ({"capacity": 20.5}, r"capacity must be an integer >= 1, got 20.5 \(type float\)"),
        ({"capacity": True}, "capacity must be an integer >= 1, got True"),
        ({"capacity": 2**40}, "capacity must be an integer >= 1 and <= 67108864, got 1099511627776"),
        ({"capacity": 16, "strategy": "best"}, "strategy must be one of 'nf', 'ff', 'bf', 'wf', 'ffd', 'bfd', 'obfd'"),
        ({"capacity": 16, "seed": -3}, "seed must be None or an integer >= 0, got -3"),
        ({"capacity": 16, "seed": "0"}, "seed must be None or an integer >= 0, got '0'"),
        ({"capacity": 16, "overlong": "clip"}, "overlong must be one of 'error', 'truncate', 'split', 'drop'"),
        ({"capacity": 16, "max_sequences_per_bin": 0}, "max_sequences_per_bin must be an integer >= 1 or None"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        pack_sequences([1, 2, 3], **kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        Packer(**kwargs).pack([1, 2, 3])


def test_overlong_error_names_the_first_offender_and_the_count():
    with pytest.raises(OverlongSequenceError) as info:
        pack_sequences([3, 40, 5, 99, 17], 16)
    message = str(info.value)
    assert "lengths[1] has 40 tokens, more than capacity=16" in message
    assert "3 of 5 sequences are longer, the longest has 99" in message
    assert "overlong='truncate', 'split' or 'drop'" in message


def test_errors_are_value_errors():
    assert issubclass(PadfreeError, ValueError)
    for cls in (InvalidArgumentError, InvalidLengthsError, OverlongSequenceError):
        assert issubclass(cls, PadfreeError)


def test_a_cuda_like_tensor_that_cannot_become_an_array_is_reported():
    class DeviceTensor:
        def __array__(self, *args, **kwargs):
            raise TypeError("can't convert cuda:0 device type tensor to numpy")

        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise TypeError("no host copy")

    with pytest.raises(InvalidLengthsError, match=r"could not be read as an array.*CPU tensor"):
        pack_sequences(DeviceTensor(), 16)


# ---------------------------------------------------------------------------------------------------
# The library's entry points beyond the engine: one PadfreeError subclass naming the argument and the value
# ---------------------------------------------------------------------------------------------------


def _api_cases():
    """``(id, call, error class, the argument's name, the value as the message shows it)`` — every case a bare
    Python exception, a MemoryError or a message without its argument or value before."""
    try:
        import torch
    except ImportError:  # the engine's tests above run without torch; these entry points need it
        return []
    from padfree import errors, layout, samples
    from padfree.data.batch import PaddingFreeCollator, pack_result_to_tensors, packed_collate_fn
    from padfree.data.datasets import IterablePackingDataset, PackingDataset
    from padfree.model.loss import linear_cross_entropy
    from padfree.packing import StreamPacker
    from padfree.rows import packed_rows

    plan = pack_sequences([3, 2], 4)
    ids = [[1, 2, 3], [4, 5]]
    huge = 2**40  # 8 TiB of int64 per row: refused before anything is allocated

    def finished():
        packer = StreamPacker(8)
        packer.finish()
        return packer

    return [
        ("collator pad_to", lambda: packed_collate_fn(8, pad_to=huge), InvalidArgumentError, "pad_to", str(huge)),
        ("tensors pad_to", lambda: pack_result_to_tensors(plan, ids, pad_to=huge), InvalidArgumentError, "pad_to",
         str(huge)),
        ("tensors pad_to_multiple_of", lambda: pack_result_to_tensors(plan, ids, pad_to_multiple_of=huge),
         InvalidArgumentError, "pad_to_multiple_of", str(huge)),
        ("flattening pad_to_multiple_of", lambda: PaddingFreeCollator(pad_to_multiple_of=huge), InvalidArgumentError,
         "pad_to_multiple_of", str(huge)),
        ("rows pad_to", lambda: packed_rows(plan, ids).padded(huge), InvalidArgumentError, "pad_to", str(huge)),
        ("rows pad_to array", lambda: packed_rows(plan, ids).padded(np.ones((2, 2), np.int64)), InvalidArgumentError,
         "pad_to", "array([[1, 1]"),
        ("rows padding_value", lambda: packed_rows(plan, ids).padded(padding_value=None), InvalidArgumentError,
         "padding_value", "None"),
        ("segment ids seq_len", lambda: layout.lengths_to_segment_ids([2, 3], seq_len=huge), InvalidArgumentError,
         "seq_len", str(huge)),
        ("position ids seq_len", lambda: layout.lengths_to_position_ids([2, 3], seq_len=huge), InvalidArgumentError,
         "seq_len", str(huge)),
        ("device", lambda: pack_result_to_tensors(plan, ids, device="nonexistent"), InvalidArgumentError, "device",
         "'nonexistent'"),
        ("device of to()", lambda: pack_result_to_tensors(plan, ids).to("nonexistent"), InvalidArgumentError,
         "device", "'nonexistent'"),
        ("device list", lambda: pack_result_to_tensors(plan, ids, device=[0]), InvalidArgumentError, "device",
         "[0]"),
        ("flag array", lambda: packed_collate_fn(8, seq_idx=np.ones((2, 2))), InvalidArgumentError, "seq_idx",
         "array([[1., 1.]"),
        ("callable returning no iterable", lambda: list(IterablePackingDataset(lambda: 5, 8)), InvalidArgumentError,
         "iterable", "returned 5"),
        ("callable returning a dict", lambda: list(IterablePackingDataset(lambda: {"input_ids": [1]}, 8)),
         InvalidArgumentError, "iterable", "{'input_ids': [1]}"),
        ("0-d array stream", lambda: IterablePackingDataset(np.array(5), 8), InvalidArgumentError, "iterable",
         "array(5)"),
        ("0-d array dataset", lambda: PackingDataset(np.array(5), 8), InvalidArgumentError, "dataset", "array(5)"),
        ("0-d array token_ids", lambda: pack_result_to_tensors(plan, np.array(5)), errors.InvalidSampleError,
         "token_ids", "array(5)"),
        ("labels -5 (collator)", lambda: packed_collate_fn(8)([{"input_ids": [1, 2, 3], "labels": [-5, -7, 2]}]),
         InvalidTokensError, "samples[0]['labels'][0]", "-5"),
        ("labels -5 (flattening)", lambda: PaddingFreeCollator()([{"input_ids": [1, 2, 3], "labels": [2, -7, 2]}]),
         InvalidTokensError, "samples[0]['labels'][1]", "-7"),
        ("labels -5 (tensors)", lambda: pack_result_to_tensors(plan, ids, labels=[[-100, 2, 3], [4, -5]]),
         InvalidTokensError, "labels[1][1]", "-5"),
        ("labels -5 (dataset)", lambda: PackingDataset([{"input_ids": [1, 2, 3], "labels": [-5, -7, 2]}], 8),
         InvalidTokensError, "dataset[0]['labels'][0]", "-5"),
        ("labels -5 (stream)",
         lambda: list(IterablePackingDataset([{"input_ids": [1, 2, 3], "labels": [-5, -7, 2]}], 8)),
         InvalidTokensError, "sample 0 of the stream['labels'][0]", "-5"),
        ("token True (collator)", lambda: packed_collate_fn(8)([[1, True, 3]]), InvalidTokensError, "samples[0][1]",
         "True"),
        ("token True (tensors)", lambda: pack_result_to_tensors(plan, [[1, 2, True], [4, 5]]), InvalidTokensError,
         "token_ids[0][2]", "True"),
        ("token True (dataset)", lambda: PackingDataset([{"input_ids": [7, True]}], 8), InvalidTokensError,
         "dataset[0]['input_ids'][1]", "True"),
        ("token True (stream)", lambda: list(IterablePackingDataset([[7, 1, True]], 8)), InvalidTokensError,
         "sample 0 of the stream[2]", "True"),
        ("token True (object array)", lambda: packed_collate_fn(8)([np.array([3, True], object)]),
         InvalidTokensError, "samples[0][1]", "True"),
        ("label True", lambda: packed_collate_fn(8)([{"input_ids": [1, 2], "labels": [-100, True]}]),
         InvalidTokensError, "samples[0]['labels'][1]", "True"),
        ("length True", lambda: pack_sequences([3, True], 8), InvalidLengthsError, "lengths[1]", "True"),
        ("add after finish", lambda: finished().add([3]), InvalidArgumentError, "add", "finish()"),
        ("bin of a plan", lambda: plan.bin("abc"), InvalidArgumentError, "b", "'abc'"),
        ("bin out of range", lambda: plan.bin(5), errors.OutOfRangeError, "b", "5"),
        ("row out of range", lambda: PackingDataset(ids, 8)[5], errors.OutOfRangeError, "index", "5"),
        ("row index bool", lambda: PackingDataset(ids, 8)[True], InvalidArgumentError, "index", "True"),
        ("loader", lambda: PackingDataset(ids, 8).state_dict(1, loader="abc"), InvalidArgumentError, "loader",
         "'abc'"),
        ("state", lambda: PackingDataset(ids, 8).load_state_dict({"a": 1}), errors.StateMismatchError,
         "load_state_dict", "{'a': 1}"),
        ("row_boundaries sample", lambda: samples.row_boundaries(None, 3), errors.InvalidSampleError, "sample",
         "None"),
        ("ragged segment ids", lambda: layout.segment_ids_to_lengths([[1, 2], [3]]), errors.InvalidLayoutError,
         "segment_ids", "[[1, 2], [3]]"),
        ("generator segment ids", lambda: layout.segment_ids_to_lengths(i for i in range(3)),
         errors.InvalidLayoutError, "segment_ids", "generator"),
        ("empty list segment ids", lambda: layout.seqs_per_row([]), errors.InvalidLayoutError, "segment_ids", "[]"),
        ("ragged mask", lambda: layout.block_causal_mask_to_segment_ids([[1], [2, 3]]), errors.InvalidLayoutError,
         "mask", "[[1], [2, 3]]"),
        ("fused loss targets", lambda: linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), [1, 2]),
         InvalidArgumentError, "targets", "[1, 2]"),
        ("fused loss scale", lambda: linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([1, 2]),
                                                          scale="a"), InvalidArgumentError, "scale", "'a'"),
    ]


@pytest.mark.parametrize(("call", "error", "argument", "value"),
                         [pytest.param(*case[1:], id=case[0]) for case in _api_cases()])
def test_an_api_error_names_the_argument_and_the_value(call, error, argument, value):
    with pytest.raises(PadfreeError) as info:
        call()
    message = str(info.value)
    assert type(info.value) is error, f"{type(info.value).__name__}: {message}"
    assert argument in message, message
    assert value in message, message
