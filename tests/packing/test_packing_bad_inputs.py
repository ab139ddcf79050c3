"""Every argument of the packing engine's public API against a gallery of bad values.

Each bad value must raise one :class:`PadfreeError` subclass whose message names the argument, shows the value
and says what is accepted — never a bare TypeError, AttributeError, numba error or MemoryError, never a plan
that is silently wrong. Hand-made :class:`PackResult` plans are checked rule by rule below the gallery.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import (
    InvalidArgumentError,
    InvalidLengthsError,
    Packer,
    PackingSpec,
    PackResult,
    PadfreeError,
    RowSpec,
    StreamPacker,
    pack_sequences,
)
from padfree.packing import as_pack_result, balance_bins, inputs
from padfree.packing.inputs import MAX_PIECES, exact_sum

try:
    import torch
except ImportError:  # the gallery runs without torch; only the tensor value is left out
    torch = None

# the gallery: each value with what its message must show of it (any one of the strings)
VALUES = {
    "None": (None, ("None",)),
    "str": ("abc", ("'abc'",)),
    "float": (2.5, ("2.5",)),
    "nan": (float("nan"), ("nan",)),
    "bool": (True, ("True",)),
    "nested": ([[1, 2], [3]], ("[[1, 2], [3]]",)),
    "2d": (np.ones((2, 2), np.int64), ("(2, 2)", "[[1, 1]")),
    "negative": (-3, ("-3",)),
    "zero": (0, ("0",)),
    "empty": ([], ("[]", "0 entries")),
    "huge": (2**70, (str(2**70),)),
    "float_array": (np.array([1.5, 2.0]), ("1.5",)),
    "dict": ({"a": 1}, ("{'a': 1}",)),
    "0d_array": (np.array(5), ("array(5)", "5")),
}
if torch is not None:
    VALUES["tensor"] = (torch.tensor([1.5]), ("1.5",))

ALL = tuple(VALUES)


def _but(*valid: str) -> tuple[str, ...]:
    return tuple(key for key in ALL if key not in valid)


PLAN = pack_sequences([5, 3, 4], 8)
HAND_MADE = {"lengths": np.array([5, 3, 4]), "capacity": 8, "order": np.array([0, 1, 2]),
             "bin_offsets": np.array([0, 2, 3])}


def _pack(name):
    return lambda value: pack_sequences([3, 4], **{"capacity": 8, name: value})


def _packer(name):
    return lambda value: Packer(**{"capacity": 8, name: value}).pack([3, 4])


def _stream(name):
    return lambda value: StreamPacker(**{"capacity": 8, name: value})


def _spec(name):
    return lambda value: PackingSpec(**{"capacity": 8, name: value})


def _rows(name):
    return lambda value: RowSpec(**{name: value})


def _balance(name):
    return lambda value: balance_bins(**{"result": PLAN, "num_ranks": 2, name: value})


def _plan(name):
    return lambda value: PackResult(**{**HAND_MADE, name: value})


# (argument, call with the bad value, the gallery's bad values for it, error class, words of what is accepted)
SPECS = [
    ("lengths", lambda v: pack_sequences(v, 8), _but("empty"), InvalidLengthsError, ("integer",)),
    ("capacity", lambda v: pack_sequences([3, 4], v), _but("0d_array"), InvalidArgumentError, ("integer >= 1",)),
    ("strategy", _pack("strategy"), ALL, InvalidArgumentError, ("one of", "'obfd'")),
    ("seed", _pack("seed"), _but("None", "zero", "huge", "0d_array"), InvalidArgumentError,
     ("integer >= 0",)),
    ("overlong", _pack("overlong"), ALL, InvalidArgumentError, ("one of", "'split'")),
    ("max_sequences_per_bin", _pack("max_sequences_per_bin"), _but("None", "huge", "0d_array"),
     InvalidArgumentError, ("integer >= 1 or None",)),
    ("capacity", _packer("capacity"), _but("0d_array"), InvalidArgumentError, ("integer >= 1",)),
    ("strategy", _packer("strategy"), ALL, InvalidArgumentError, ("one of",)),
    ("overlong", _packer("overlong"), ALL, InvalidArgumentError, ("one of",)),
    ("seed", lambda v: Packer(8).pack([3, 4], seed=v), _but("None", "zero", "huge", "0d_array"),
     InvalidArgumentError, ("integer >= 0",)),
    ("lengths", lambda v: Packer(8).pack(v), _but("empty"), InvalidLengthsError, ("integer",)),
    ("capacity", _stream("capacity"), _but("0d_array"), InvalidArgumentError, ("integer >= 1",)),
    # buffer_size=None is the default: 10,000, or the online mode for nf / hk
    ("buffer_size", _stream("buffer_size"), _but("0d_array", "None"), InvalidArgumentError, ("integer >= 1",)),
    ("strategy", _stream("strategy"), ALL, InvalidArgumentError, ("one of",)),
    ("seed", _stream("seed"), _but("None", "zero", "huge", "0d_array"), InvalidArgumentError, ("integer >= 0",)),
    ("overlong", _stream("overlong"), ALL, InvalidArgumentError, ("one of",)),
    ("max_sequences_per_bin", _stream("max_sequences_per_bin"), _but("None", "huge", "0d_array"),
     InvalidArgumentError, ("integer >= 1 or None",)),
    ("hold_fill", _stream("hold_fill"), _but("zero"), InvalidArgumentError, ("number in [0, 1]",)),
    ("lengths", lambda v: StreamPacker(8).add(v), _but("empty"), InvalidLengthsError, ("integer", ">= 1")),
    ("items", lambda v: StreamPacker(8).add([1, 2], items=v), _but("None", "nested", "2d", "float_array"),
     InvalidArgumentError, ("payload",)),
    ("capacity", lambda v: PackingSpec(v), _but("0d_array"), InvalidArgumentError, ("integer >= 1",)),
    ("strategy", _spec("strategy"), ALL, InvalidArgumentError, ("one of", "'obfd'")),
    ("seed", _spec("seed"), _but("None", "zero", "huge", "0d_array"), InvalidArgumentError, ("integer >= 0",)),
    ("overlong", _spec("overlong"), ALL, InvalidArgumentError, ("one of", "'split'")),
    ("max_sequences_per_bin", _spec("max_sequences_per_bin"), _but("None", "huge", "0d_array"),
     InvalidArgumentError, ("integer >= 1 or None",)),
    ("spec", lambda v: pack_sequences([3, 4], spec=v), _but("None"), InvalidArgumentError,
     ("a PackingSpec or None",)),
    ("spec", lambda v: Packer(spec=v), _but("None"), InvalidArgumentError, ("a PackingSpec or None",)),
    ("padding", _rows("padding"), _but("None", "huge"), InvalidArgumentError, ("'capacity'",)),
    ("pad_to_multiple_of", _rows("pad_to_multiple_of"), _but("None", "huge", "0d_array"), InvalidArgumentError,
     ("integer >= 1 or None",)),
    ("padding_value", _rows("padding_value"), _but("zero", "negative"), InvalidArgumentError,
     ("integer that fits int32",)),
    ("label_padding_value", _rows("label_padding_value"), _but("zero", "negative"), InvalidArgumentError,
     ("integer that fits int32",)),
    ("attention_mask", _rows("attention_mask"), _but("None"), InvalidArgumentError, ("one of", "'binary'")),
    ("result", _balance("result"), ALL, InvalidArgumentError, ("a PackResult from pack_sequences",)),
    ("num_ranks", _balance("num_ranks"), _but("0d_array"), InvalidArgumentError, ("integer >= 1", "<= 2147483647")),
    ("micro_batch_size", _balance("micro_batch_size"), _but("0d_array"), InvalidArgumentError,
     ("integer >= 1", "<= 2147483647")),
    ("remainder", _balance("remainder"), ALL, InvalidArgumentError, ("one of", "'repeat'")),
    ("seed", _balance("seed"), _but("None", "zero", "huge", "0d_array"), InvalidArgumentError, ("integer >= 0",)),
    ("group_by", _balance("group_by"), ALL, InvalidArgumentError, ("one of", "'cost'")),
    ("bins", PLAN.take_bins, _but("empty"), InvalidArgumentError, ("1-D array of integers", "not a bin")),
    ("PackResult.lengths", _plan("lengths"), _but("empty"), InvalidLengthsError, ("1-D array of integers",)),
    ("PackResult.capacity", _plan("capacity"), _but("0d_array"), InvalidArgumentError, ("integer >= 1",)),
    ("PackResult.order", _plan("order"), _but("empty"), InvalidArgumentError, ("1-D array of integers",)),
    ("PackResult.bin_offsets", _plan("bin_offsets"), ALL, InvalidArgumentError,
     ("1-D array of integers", "start at 0")),
    ("PackResult.piece_starts", _plan("piece_starts"), _but("None"), InvalidArgumentError,
     ("1-D array of integers", "needs piece_lengths")),
    ("PackResult.piece_lengths", _plan("piece_lengths"), _but("None"), InvalidArgumentError,
     ("1-D array of integers", "one entry per piece")),
    ("PackResult.dropped", _plan("dropped"), _but("empty"), InvalidArgumentError, ("1-D array of integers",)),
    ("PackResult.truncated_tokens", _plan("truncated_tokens"), _but("zero"), InvalidArgumentError,
     ("integer >= 0", "too large")),
    ("PackResult.num_truncated", _plan("num_truncated"), _but("zero"), InvalidArgumentError,
     ("integer >= 0", "more than the 3 sequences")),
    ("PackResult.strategy", _plan("strategy"), _but("str"), InvalidArgumentError, ("string",)),
    ("PackResult.seed", _plan("seed"), _but("None", "zero", "huge", "0d_array"), InvalidArgumentError,
     ("integer >= 0",)),
    ("PackResult.packing_time_ms", _plan("packing_time_ms"), _but("None", "zero", "float", "huge"),
     InvalidArgumentError, ("number of milliseconds >= 0",)),
]


def _gallery():
    for argument, call, bad, error, accepted in SPECS:
        for key in bad:
            if key in VALUES:
                value, shown = VALUES[key]
                yield pytest.param(call, value, error, argument, accepted, shown, id=f"{argument}={key}")


@pytest.mark.parametrize(("call", "value", "error", "argument", "accepted", "shown"), list(_gallery()))
def test_a_bad_value_is_refused_by_name(call, value, error, argument, accepted, shown):
    with pytest.raises(PadfreeError) as info:
        call(value)
    message = str(info.value)
    assert type(info.value) is error, message
    assert argument.split(".")[-1] in message, message
    assert any(word in message for word in accepted), message
    assert any(text in message for text in shown), message


def _spec_cases():
    for field, valid in (("capacity", ("0d_array",)), ("strategy", ()), ("seed", ("None", "zero", "huge", "0d_array")),
                         ("overlong", ()), ("max_sequences_per_bin", ("None", "huge", "0d_array"))):
        for key in _but(*valid):
            yield pytest.param(field, VALUES[key][0], id=f"{field}={key}")


@pytest.mark.parametrize(("field", "value"), list(_spec_cases()))
def test_a_packing_spec_refuses_a_bad_value_with_the_keywords_error(field, value):
    with pytest.raises(PadfreeError) as by_keyword:
        pack_sequences([3, 4], **({"capacity": 8} | {field: value}))
    with pytest.raises(PadfreeError) as by_spec:
        PackingSpec(**({"capacity": 8} | {field: value}))
    assert type(by_spec.value) is type(by_keyword.value) and str(by_spec.value) == str(by_keyword.value)


def test_a_setting_given_both_ways_is_refused_naming_both():
    spec = PackingSpec(8, "ffd", seed=2, overlong="split", max_sequences_per_bin=3)
    for keyword, value in (("capacity", 8), ("strategy", "nf"), ("seed", 2), ("overlong", "drop"),
                           ("max_sequences_per_bin", 3)):
        with pytest.raises(InvalidArgumentError, match=rf"^{keyword}={value!r} is given both as a keyword and in spec "
                                                       rf"\(spec\.{keyword}={getattr(spec, keyword)!r}\)"):
            Packer(spec=spec, **{keyword: value})
    # a keyword left at its default defers to the spec
    assert Packer(spec=spec, strategy="obfd").spec is spec


# ---------------------------------------------------------------------------------------------------
# The values the gallery accepts, and what each gives
# ---------------------------------------------------------------------------------------------------


def test_the_gallery_values_that_are_valid_give_what_they_say():
    assert pack_sequences([], 8).num_bins == 0
    assert pack_sequences([3, 4], np.array(5)).capacity == 5  # a 0-d integer array is an integer
    assert pack_sequences([3, 4], 8, seed=2**70).bins == pack_sequences([3, 4], 8).bins  # obfd ignores the seed
    # a limit beyond every count is no limit (it used to overflow the kernels' int64)
    assert pack_sequences([3, 4, 1], 8, max_sequences_per_bin=2**70).bins == pack_sequences([3, 4, 1], 8).bins
    assert StreamPacker(8, hold_fill=np.float32(0.5)).hold_fill == 0.5
    assert PLAN.take_bins([]).num_bins == 0
    assert PLAN.take_bins([-1]).bins == [PLAN.bins[-1]]  # negative bins count from the end, as in bin()


# ---------------------------------------------------------------------------------------------------
# Counts that cannot wrap, allocations that cannot explode
# ---------------------------------------------------------------------------------------------------


def test_lengths_whose_total_passes_int64_are_refused_instead_of_wrapping():
    with pytest.raises(InvalidLengthsError, match=r"add up to 13835058055282163712 tokens, more than an int64"):
        pack_sequences([2**62] * 3, 8, overlong="truncate")
    with pytest.raises(InvalidLengthsError, match="add up to"):
        StreamPacker(8, overlong="truncate").add([2**62] * 3)


def test_totals_stay_exact_near_the_int64_limit():
    # max * n passes int64 but the total does not: accepted, and every count exact
    lengths = [2**62, 2**62 - 8, 5]
    plan = pack_sequences(lengths, 8, overlong="truncate")
    assert plan.input_tokens == 2**63 - 3
    assert plan.total_tokens == 8 + 8 + 5
    assert plan.truncated_tokens == (2**62 - 8) + (2**62 - 16) and plan.num_truncated == 2
    assert plan.total_tokens + plan.truncated_tokens == plan.input_tokens
    dropped = pack_sequences(lengths, 8, overlong="drop")
    assert dropped.dropped_tokens == 2**63 - 8 and dropped.total_tokens == 5
    assert exact_sum(np.array([2**62] * 3)) == 3 * 2**62


def test_a_split_into_more_pieces_than_the_kernels_index_is_refused_before_allocating():
    with pytest.raises(InvalidLengthsError) as info:
        pack_sequences([2**40], 16, overlong="split")
    message = str(info.value)
    assert f"{2**36} pieces" in message and str(MAX_PIECES) in message and "capacity=16" in message
    assert "overlong='truncate' or 'drop'" in message
    with pytest.raises(InvalidLengthsError, match="pieces"):
        StreamPacker(16, overlong="split").add([2**40])


def test_the_piece_limit_holds_for_every_policy(monkeypatch):
    monkeypatch.setattr(inputs, "MAX_PIECES", 4)
    for policy in ("error", "truncate", "drop", "split"):
        with pytest.raises(InvalidLengthsError, match="5 sequences, more than the 4 pieces"):
            pack_sequences([1] * 5, 8, overlong=policy)
    assert pack_sequences([8, 8], 4, overlong="split").num_pieces == 4  # at the limit: placed
    with pytest.raises(InvalidLengthsError, match="5 pieces"):
        pack_sequences([8, 9], 4, overlong="split")


def test_a_stream_buffer_or_a_step_past_the_limit_is_refused():
    with pytest.raises(InvalidArgumentError, match=rf"buffer_size must be an integer >= 1 and <= {MAX_PIECES}"):
        StreamPacker(8, buffer_size=MAX_PIECES + 1)
    with pytest.raises(InvalidArgumentError, match=r"num_ranks \* micro_batch_size must be <= 2147483647"):
        balance_bins(PLAN, 2**20, micro_batch_size=2**12)


# ---------------------------------------------------------------------------------------------------
# Hand-made plans: each rule of PackResult
# ---------------------------------------------------------------------------------------------------


def _made(**changes):
    return PackResult(**{**HAND_MADE, **changes})


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        # the segfault of old: a piece running past its sequence reached the row gather unchecked
        ({"piece_starts": [0, 0, 3], "piece_lengths": [5, 3, 4]}, InvalidArgumentError,
         r"piece 2 takes tokens \[3, 7\) of sequence order\[2\] = 2, which has lengths\[2\] = 4"),
        ({"order": [0, 1, 7]}, InvalidArgumentError,
         r"PackResult.order\[2\] = 7 is not a sequence id: lengths has 3 sequences \(ids 0..2\)"),
        ({"order": [0, -1, 2]}, InvalidArgumentError, r"PackResult.order\[1\] = -1 is not a sequence id"),
        ({"order": [0, 1, 1]}, InvalidArgumentError, r"places sequence 1 twice \(order\[1\] and order\[2\]\)"),
        ({"order": [0, 1, 1], "piece_lengths": [5, 1, 1]}, InvalidArgumentError, "places sequence 1 twice"),
        ({"order": [0, 1, 1], "piece_starts": [0, 0, 2], "piece_lengths": [5, 3, 1]}, InvalidArgumentError,
         r"pieces 1 and 2 of sequence 1 overlap: tokens \[0, 3\) and \[2, 3\)"),
        ({"bin_offsets": [1, 2, 3]}, InvalidArgumentError, r"must start at 0 and end at len\(order\) = 3"),
        ({"bin_offsets": [0, 2]}, InvalidArgumentError, r"end at len\(order\) = 3"),
        ({"bin_offsets": [0, 3, 2, 3]}, InvalidArgumentError,
         r"must not decrease, but bin_offsets\[2\] = 2 < bin_offsets\[1\] = 3"),
        ({"bin_offsets": [0, 3]}, InvalidArgumentError, "bin 0 holds 12 tokens, more than capacity=8"),
        ({"capacity": 6}, InvalidArgumentError, "bin 0 holds 8 tokens, more than capacity=6"),
        ({"capacity": 2**27}, InvalidArgumentError, r"PackResult.capacity must be an integer >= 1 and <= 67108864"),
        ({"lengths": [5, -3, 4]}, InvalidLengthsError, r"PackResult.lengths\[1\] = -3, but lengths are token counts"),
        ({"lengths": [5, 0, 4]}, InvalidArgumentError, r"order\[1\] = 1 places a sequence of 0 tokens"),
        ({"lengths": [2**62, 2**62, 4]}, InvalidLengthsError, "add up to 9223372036854775812 tokens"),
        ({"lengths": np.array([5, 2**63, 4], np.uint64)}, InvalidLengthsError,
         r"PackResult.lengths\[1\] = 9223372036854775808 does not fit in int64"),
        ({"lengths": [5.0, 3.0, 4.0]}, InvalidLengthsError, "any integer dtype"),
        ({"order": np.array([True, False, True])}, InvalidArgumentError, "got dtype bool"),
        ({"order": np.array([0, 1, 2], object)}, InvalidArgumentError, "got dtype object"),
        ({"piece_starts": [0, 0, 0]}, InvalidArgumentError, r"piece_starts = \[0, 0, 0\] .* needs piece_lengths"),
        ({"piece_lengths": [5, 3]}, InvalidArgumentError,
         r"piece_lengths must have one entry per piece of order \(3\)"),
        ({"piece_lengths": [5, 3, 4], "piece_starts": [0, 0]}, InvalidArgumentError,
         r"piece_starts must have one entry per piece"),
        ({"piece_lengths": [5, 0, 4]}, InvalidArgumentError, r"piece_lengths\[1\] = 0, but a placed piece holds"),
        ({"piece_lengths": [5, 3, 4], "piece_starts": [0, -1, 0]}, InvalidArgumentError,
         r"piece_starts\[1\] = -1, but a piece starts at a token"),
        ({"piece_lengths": [5, 3, 5]}, InvalidArgumentError, r"takes tokens \[0, 5\) of sequence order\[2\] = 2"),
        ({"dropped": [3]}, InvalidArgumentError, r"PackResult.dropped\[0\] = 3 is not a sequence id"),
        ({"dropped": [1]}, InvalidArgumentError, r"order\[1\] = 1 places a sequence that PackResult.dropped lists"),
        ({"lengths": [5, 3, 4, 9, 9], "dropped": [3, 4, 3]}, InvalidArgumentError,
         "dropped lists sequence 3 twice"),
        ({"truncated_tokens": -1}, InvalidArgumentError, "truncated_tokens must be an integer >= 0, got -1"),
        ({"truncated_tokens": 1}, InvalidArgumentError, "accounts for 13 tokens .* but lengths hold 12"),
        ({"num_truncated": 4}, InvalidArgumentError, "num_truncated = 4 is more than the 3 sequences"),
    ],
)
def test_a_hand_made_plan_that_breaks_a_rule_is_refused(changes, error, match):
    with pytest.raises(error, match=match):
        _made(**changes)


def test_disjoint_pieces_of_one_sequence_are_a_plan():
    plan = PackResult(lengths=np.array([6, 3]), capacity=4, order=np.array([0, 1, 0]),
                      bin_offsets=np.array([0, 1, 3]), piece_starts=np.array([2, 0, 0]),
                      piece_lengths=np.array([4, 3, 1]))
    assert plan.bin_fill.tolist() == [4, 4] and plan.total_tokens == 8 and plan.input_tokens == 9


def test_a_hand_made_plan_is_normalised_to_int64():
    plan = _made(lengths=np.array([5, 3, 4], np.uint8), order=[0, 1, 2], bin_offsets=np.array([0, 2, 3], np.int32),
                 dropped=[], capacity=np.int16(8), truncated_tokens=np.int64(0))
    for name in ("lengths", "order", "bin_offsets", "dropped"):
        assert getattr(plan, name).dtype == np.int64, name
    assert type(plan.capacity) is int and type(plan.truncated_tokens) is int
    assert _made(bin_offsets=[0, 0, 3, 3], capacity=12).bin_fill.tolist() == [0, 12, 0]  # empty bins are allowed


def test_as_pack_result_names_the_argument():
    assert as_pack_result(PLAN) is PLAN
    for value in ([[0, 1], [2]], {"bins": []}, None):
        with pytest.raises(InvalidArgumentError, match=r"plan must be a PackResult from pack_sequences / Packer.pack"):
            as_pack_result(value, "plan")


# ---------------------------------------------------------------------------------------------------
# The overlap check against a brute-force count of every token
# ---------------------------------------------------------------------------------------------------


@st.composite
def _pieces(draw):
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=6))
    pieces = []
    for _ in range(draw(st.integers(0, 8))):
        seq = draw(st.integers(0, len(lengths) - 1))
        if lengths[seq]:
            start = draw(st.integers(0, lengths[seq] - 1))
            pieces.append((seq, start, draw(st.integers(1, lengths[seq] - start))))
    return lengths, pieces


@given(_pieces())
@settings(max_examples=300, deadline=None)
def test_overlapping_pieces_are_refused_exactly_when_a_token_is_placed_twice(case):
    lengths, pieces = case
    covered = [[0] * n for n in lengths]
    for seq, start, n in pieces:
        for t in range(start, start + n):
            covered[seq][t] += 1
    seq, start, n = np.array(pieces, np.int64).reshape(-1, 3).T

    def make():  # one piece per bin, so that only the overlap rule can fail
        return PackResult(lengths=np.array(lengths), capacity=64, order=seq, bin_offsets=np.arange(len(pieces) + 1),
                          piece_starts=start, piece_lengths=n)

    if any(c > 1 for row in covered for c in row):
        with pytest.raises(InvalidArgumentError, match="overlap"):
            make()
    else:
        assert make().total_tokens == sum(map(sum, covered))
