"""Every bad input to the packing engine: one PadfreeError subclass whose message names the culprit."""

from __future__ import annotations

import numpy as np
import pytest

from padfree import (
    InvalidArgumentError,
    InvalidLengthsError,
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
