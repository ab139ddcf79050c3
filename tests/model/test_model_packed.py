"""PackedLayout (padfree.model.packed): the boundaries of one packed forward and every form derived from them.

Every constructor (``from_position_ids``, ``from_segment_ids``, ``from_cu_seqlens``) against a token-by-token
reference and against each other, every derived form (``cu_seqlens``, ``seq_idx``, position ids, the bucket plans,
the local and flex masks) against :mod:`padfree.layout`'s conversions, the grouping behind :func:`per_bucket`, and
every bad input: one PadfreeError naming the argument.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import layout
from padfree.errors import InvalidArgumentError, InvalidLayoutError, PadfreeError
from padfree.model.packed import PackedLayout, bucket_length, per_bucket

# ---- a batch written token by token -----------------------------------------------------------------------------


def spellings(rows: list[list[int]], width: int) -> dict:
    """Every spelling of ``rows`` (per row, the lengths of its sequences) in rows of ``width`` tokens, the tail of
    a row being padding, written token by token: ``position_ids`` (the padding counts 0, 1, ... as one more
    segment), ``segment_ids`` (padding 0), ``cu`` (offsets over the flattened ``B·T`` stream, padding runs
    included), ``ids`` (the segment ids a layout without a mask sees: padding is segment k + 1), ``lengths``,
    ``seq_idx`` (every segment's index in the stream) and ``real`` (whether each segment is a sequence)."""
    pos = np.zeros((len(rows), width), np.int64)
    seg = np.zeros((len(rows), width), np.int64)
    ids = np.zeros((len(rows), width), np.int64)
    idx = np.zeros((len(rows), width), np.int64)
    cu, lengths, real = [0], [], []
    for b, row in enumerate(rows):
        col = 0
        runs = [(n, True) for n in row] + ([(width - sum(row), False)] if sum(row) < width else [])
        for k, (n, is_real) in enumerate(runs):
            for t in range(n):
                pos[b, col], seg[b, col], ids[b, col], idx[b, col] = t, k + 1 if is_real else 0, k + 1, len(lengths)
                col += 1
            cu.append(b * width + col)
            lengths.append(n)
            real.append(is_real)
    return dict(position_ids=torch.from_numpy(pos), segment_ids=torch.from_numpy(seg), ids=torch.from_numpy(ids),
                cu=torch.tensor(cu, dtype=torch.int32), lengths=np.array(lengths, np.int64),
                seq_idx=torch.from_numpy(idx), real=np.array(real))


def every_constructor(s: dict) -> dict[str, PackedLayout]:
    batch, width = s["position_ids"].shape
    return {"position_ids": PackedLayout.from_position_ids(s["position_ids"]),
            "segment_ids": PackedLayout.from_segment_ids(s["segment_ids"]),
            "cu_seqlens": PackedLayout.from_cu_seqlens(s["cu"], batch, width)}


def assert_layout_is(lay: PackedLayout, s: dict, *, mask: bool) -> None:
    """``lay`` is the layout of the reference ``s``: same segments, positions, offsets and seq_idx; the segment ids
    of a padding run are 0 when it came from a segment-id ``mask``, k + 1 otherwise."""
    batch, width = s["position_ids"].shape
    assert lay.shape == (batch, width)
    assert lay.lengths.tolist() == s["lengths"].tolist()
    assert lay.num_segments == len(s["lengths"])
    assert lay.max_seqlen == (int(s["lengths"].max()) if s["lengths"].size else 0)
    assert lay.is_packed == (len(s["lengths"]) > batch)
    assert torch.equal(lay.position_ids, s["position_ids"])
    assert lay.cu_seqlens.dtype == torch.int32 and lay.seq_idx.dtype == torch.int32
    assert torch.equal(lay.cu_seqlens, s["cu"])
    assert torch.equal(lay.seq_idx.long(), s["seq_idx"])
    assert torch.equal(lay.segment_ids, s["segment_ids"] if mask else s["ids"])


def assert_same_layout(rows: list[list[int]], width: int) -> None:
    """The three constructors give the layout of the reference, and the same bucket plans."""
    s = spellings(rows, width)
    lays = every_constructor(s)
    for name, lay in lays.items():
        assert_layout_is(lay, s, mask=name == "segment_ids")
    base = lays["position_ids"]
    for by in ("bucket", "length", "sequence"):
        plan = base.buckets(by)
        for name, lay in lays.items():
            other = lay.buckets(by)
            assert (other.lengths, other.counts) == (plan.lengths, plan.counts), (name, by)
            assert torch.equal(other.slots, plan.slots) and torch.equal(other.inverse, plan.inverse), (name, by)


CASES = {
    "one sequence per row": ([[5], [5]], 5),
    "one sequence then padding": ([[3], [5]], 5),
    "rows of different counts": ([[1, 3, 9, 1], [2, 12]], 15),
    "length-1 sequences": ([[1, 1, 1], [1]], 3),
    "an all-padding row": ([[2, 2], []], 4),
    "one row": ([[4, 4]], 8),
    "long segments": ([[70, 1, 29], [100]], 100),
}


@pytest.mark.parametrize(("rows", "width"), CASES.values(), ids=CASES.keys())
def test_every_constructor_gives_the_layout_of_the_same_boundaries(rows, width):
    assert_same_layout(rows, width)


@settings(deadline=None, max_examples=60)
@given(st.lists(st.lists(st.integers(1, 9), max_size=4), min_size=1, max_size=4), st.integers(0, 3))
def test_random_boundaries_give_one_layout_from_every_spelling(rows, pad):
    assert_same_layout(rows, max(1, max(sum(r) for r in rows) + pad))


def test_negative_control_a_boundary_one_token_off_is_caught():
    """The comparison above sees a boundary moved by one token, and a padding run read as a sequence."""
    s = spellings([[2, 3]], 5)
    assert_layout_is(PackedLayout.from_position_ids(torch.tensor([[0, 1, 0, 1, 2]])), s, mask=False)
    with pytest.raises(AssertionError):
        assert_layout_is(PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]])), s, mask=False)
    padded = spellings([[2], [3]], 3)
    with pytest.raises(AssertionError):  # the right boundaries, but the padding is not marked as padding
        assert_layout_is(PackedLayout.from_position_ids(padded["position_ids"]), padded, mask=True)


def test_hand_checked_values():
    lay = PackedLayout.from_segment_ids(torch.tensor([[1, 1, 1, 2, 2, 3], [1, 1, 2, 2, 0, 0]]))
    assert lay.lengths.tolist() == [3, 2, 1, 2, 2, 2] and lay.source == "attention_mask"
    assert lay.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 10, 12]
    assert lay.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 5, 5]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 0, 1]]
    assert (lay.max_seqlen, lay.num_segments, lay.is_packed, lay.shape) == (3, 6, True, (2, 6))
    plan = lay.buckets()  # every segment rounds up to 8, capped at the row width: one bucket of 6 slots each
    assert (plan.lengths, plan.counts, plan.sizes) == ((6,), (6,), [36])
    assert plan.slots[:12].tolist() == [0, 1, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4]  # past its end, a segment's last token
    assert plan.inverse[:6].tolist() == [0, 1, 2, 6, 7, 12]
    exact = lay.buckets("length")
    assert (exact.lengths, exact.counts) == ((3, 2, 1), (1, 4, 1))
    assert PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])).is_packed is False


# ---- derived forms against padfree.layout ------------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "width"), CASES.values(), ids=CASES.keys())
def test_derived_forms_agree_with_padfree_layout(rows, width):
    s = spellings(rows, width)
    seg, pos = s["segment_ids"], s["position_ids"]
    by_mask = PackedLayout.from_segment_ids(seg)
    by_pos = PackedLayout.from_position_ids(pos)
    for lay in (by_mask, by_pos):
        assert torch.equal(lay.position_ids, layout.segment_ids_to_position_ids(seg))
        # without a mask, layout counts the padding run as one more sequence, as the layout does
        assert lay.lengths.tolist() == layout.position_ids_to_lengths(pos).tolist()
        assert torch.equal(lay.cu_seqlens, layout.position_ids_to_cu_seqlens(pos))
        assert torch.equal(lay.cu_seqlens, layout.lengths_to_cu_seqlens(torch.from_numpy(lay.lengths)))
        assert torch.equal(lay.seq_idx.long(), layout.segment_ids_to_batch_seq_idx(seg))
        per_row = lay.seq_idx - lay.seq_idx[:, :1]  # Mamba's per-row seq_idx: padding one more sequence
        assert torch.equal(per_row, layout.segment_ids_to_seq_idx(seg))
    # with the mask, layout drops the padding runs: the layout's real segments
    assert by_mask.lengths[s["real"]].tolist() == layout.segment_ids_to_lengths(seg).tolist()
    assert torch.equal(layout.position_ids_to_segment_ids(pos, attention_mask=seg), by_mask.segment_ids)
    assert torch.equal(layout.position_ids_to_segment_ids(pos), by_pos.segment_ids)


@pytest.mark.parametrize("window", [None, 1, 3, 8])
@pytest.mark.parametrize("length", [1, 5, 16])
def test_local_mask_is_the_block_causal_mask_of_one_segment(length, window):
    lay = PackedLayout.from_position_ids(torch.arange(length)[None])
    want = layout.block_causal_mask(torch.ones(1, length, dtype=torch.int64), sliding_window=window)[0, 0]
    assert lay.local_mask(length, window).dtype == torch.bool
    assert torch.equal(lay.local_mask(length, window), want)


def test_the_block_mask_of_a_padding_tail_lets_no_token_see_it():
    """From a segment-id mask the padding run sees nothing and nothing sees it; from position ids the same run is
    a segment of its own (it sees itself, no real token sees it), as :func:`padfree.layout.block_mask` does."""
    from torch.nn.attention.flex_attention import create_mask

    s = spellings([[2, 3], [4]], 7)
    for lay, seg in ((PackedLayout.from_segment_ids(s["segment_ids"]), s["segment_ids"]),
                     (PackedLayout.from_position_ids(s["position_ids"]), s["ids"])):
        got = create_mask(lay.block_mask(None, 4).mask_mod, 2, 1, 7, 7)[:, 0]
        want = layout.block_causal_mask(seg)[:, 0]
        assert torch.equal(got, want)
    pad = s["segment_ids"] == 0
    got = create_mask(PackedLayout.from_segment_ids(s["segment_ids"]).block_mask(None, 4).mask_mod, 2, 1, 7, 7)[:, 0]
    assert not got[pad].any() and not got.transpose(1, 2)[pad].any()
    real = ~pad
    assert got[real].any(-1).all()  # every real token sees itself at least


# ---- the grouping -----------------------------------------------------------------------------------------------


def test_bucket_length_is_a_quarter_octave_grid():
    n = np.arange(1, 5000)
    got = bucket_length(n)
    step = np.maximum(8, 2 ** np.floor(np.log2(n)).astype(np.int64) // 4)
    assert (got >= n).all() and (got % step == 0).all() and (got - n < step).all()
    assert (got[n <= 8] == 8).all()
    assert (got[n >= 32] < 1.25 * n[n >= 32]).all()  # at most a quarter more slots than tokens above 32
    assert (np.diff(got) >= 0).all()
    assert bucket_length(np.array([1, 8, 9, 100, 1000, 1500])).tolist() == [8, 8, 16, 112, 1024, 1536]


@pytest.mark.parametrize("by", ["bucket", "length", "sequence"])
def test_bucket_slots_stay_in_their_segment_and_inverse_puts_every_token_back(by):
    s = spellings([[1, 3, 9, 1], [2, 12]], 15)
    lay = PackedLayout.from_position_ids(s["position_ids"])
    plan = lay.buckets(by)
    flat = torch.arange(lay.shape[0] * lay.shape[1])
    assert sum(plan.sizes) == plan.slots.numel()
    assert torch.equal(flat.index_select(0, plan.slots).index_select(0, plan.inverse), flat)
    seq = lay.seq_idx.reshape(-1)
    for part, length, count in zip(plan.slots.split(plan.sizes), plan.lengths, plan.counts, strict=True):
        slots = part.view(count, length)
        assert (seq[slots] == seq[slots[:, :1]]).all()  # every slot of a segment is a token of that segment
        assert (slots[:, 1:] >= slots[:, :-1]).all()
    if by != "bucket":  # exact lengths: no repeated slot
        assert torch.equal(plan.slots.sort().values, flat)


def test_derived_forms_are_built_once_per_layout():
    lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert lay.cu_seqlens is lay.cu_seqlens and lay.seq_idx is lay.seq_idx
    assert lay.buckets() is lay.buckets("bucket") and lay.buckets("sequence") is lay.buckets("sequence")
    assert lay.local_mask(3, None) is lay.local_mask(3, None) and lay.local_mask(3, 2) is not lay.local_mask(3, None)
    assert lay.block_mask(None, 4) is lay.block_mask(None, 4)
    other = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert other.cu_seqlens is not lay.cu_seqlens  # the cache is the layout's own, not shared between batches


# ---- the grouping -------------------------------------------------------------------------------------------------

ROWS = [[1, 3, 9, 1], [2, 12, 0]]  # length-1 segments, shorter and longer than an 8-token chunk; 0: padding to the end


def _layout() -> tuple[PackedLayout, list[tuple[int, int, int]]]:
    width = max(sum(r) for r in ROWS) + 1
    pos = torch.zeros(len(ROWS), width, dtype=torch.long)
    segments = []
    for b, row in enumerate(ROWS):
        col = 0
        for n in [n for n in row if n]:
            pos[b, col:col + n] = torch.arange(n)
            segments.append((b, col, n))
            col += n
        pos[b, col:] = torch.arange(width - col)  # the trailing padding run: a segment of its own
        segments.append((b, col, width - col))
    return PackedLayout.from_position_ids(pos), segments


@pytest.mark.parametrize("by", ["bucket", "length", "sequence"])
def test_per_bucket_runs_every_segment_alone(by):
    lay, segments = _layout()
    x = torch.randn(*lay.shape, 3, dtype=torch.float64, requires_grad=True)
    got = per_bucket(lambda n, m, b: b.cumsum(1), lay, x, by=by)  # a running sum: sees every earlier token
    for b, start, n in segments:
        assert torch.equal(got[b, start:start + n], x[b, start:start + n].cumsum(0))
    got.sum().backward()  # token j of a segment of n feeds the n - j sums from j on, and nothing outside it
    want = torch.cat([torch.arange(n, 0, -1, dtype=x.dtype) for *_, n in segments]).view(lay.shape)
    assert torch.equal(x.grad, want[..., None].expand_as(x))


def test_bucket_plans():
    lay, segments = _layout()
    lengths = sorted(n for *_, n in segments)
    bucket = lay.buckets()
    assert max(bucket.lengths) <= lay.shape[1]  # never padded past the row
    assert sorted(bucket.lengths) == sorted(set(min(int(bucket_length(n)), lay.shape[1]) for n in lengths))
    exact = lay.buckets("length")
    assert sum(exact.sizes) == lay.shape[0] * lay.shape[1]  # no repeated slot
    assert sorted(exact.lengths) == sorted(set(lengths))
    single = lay.buckets("sequence")
    assert single.counts == (1,) * len(segments) and sorted(single.lengths) == lengths
    assert lay.buckets("length") is exact  # built once per batch
    with pytest.raises(InvalidArgumentError, match="by must be one of"):
        lay.buckets("chunk")


# ---- the flex BlockMask of a layout, built from per-block segment ranges -------------------------------------------


def _random_segments(gen, rows, width, pad):
    """``(rows, width)`` segment ids: runs 1, 2, ... of random lengths (1 included), a trailing 0 run in some rows."""
    seg = torch.zeros(rows, width, dtype=torch.int64)
    for r in range(rows):
        end = width - (int(torch.randint(1, width // 2, (1,), generator=gen)) if pad and r % 2 else 0)
        col, sid = 0, 1
        while col < end:
            n = min(end - col, int(torch.randint(1, 3 if sid % 3 == 0 else 40, (1,), generator=gen)))
            seg[r, col:col + n] = sid
            col, sid = col + n, sid + 1
    return seg


@pytest.mark.parametrize("block_size", [4, 16, 128])
@pytest.mark.parametrize("window", [None, 1, 5, 17])
def test_layout_block_mask_equals_the_one_evaluated_on_every_pair(block_size, window):
    """PackedLayout.block_mask (block ranges, no T x T grid) lists exactly the blocks — partial and full, in the same
    order — that create_block_mask finds by evaluating mask_mod on every pair (padfree.layout.block_mask)."""
    from padfree import layout
    from padfree.model.packed import PackedLayout

    gen = torch.Generator().manual_seed(block_size * 1000 + (window or 0))
    for width, pad in ((96, False), (101, True), (256, True)):
        seg = _random_segments(gen, 3, width, pad)
        got = PackedLayout.from_segment_ids(seg).block_mask(window, block_size)
        want = layout.block_mask(seg, window, block_size=block_size)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, width)
        assert got.shape == want.shape and tuple(got.BLOCK_SIZE) == tuple(want.BLOCK_SIZE)
        from torch.nn.attention.flex_attention import create_mask

        assert torch.equal(create_mask(got.mask_mod, 3, 1, width, width),
                           create_mask(want.mask_mod, 3, 1, width, width))



# ---- bad input: one PadfreeError naming the argument ------------------------------------------------------------

_ROW = torch.tensor([[0, 1, 2, 0, 1]])
BAD = {
    "position_ids 1-D": (lambda: PackedLayout.from_position_ids(torch.tensor([0, 1, 0])), InvalidLayoutError,
                         r"position_ids must be 2-D \(batch, seq\), got shape \(3,\)"),
    "position_ids float": (lambda: PackedLayout.from_position_ids(_ROW.float()), InvalidLayoutError,
                           "position_ids must hold integers, got dtype torch.float32"),
    "position_ids jump": (lambda: PackedLayout.from_position_ids(torch.tensor([[0, 2, 0]])), InvalidLayoutError,
                          r"position_ids\[0, 1\] = 2 follows 0"),
    "position_ids negative": (lambda: PackedLayout.from_position_ids(torch.tensor([[0, 1, -1]])),
                              InvalidLayoutError, r"position_ids\[0, 2\] = -1 is negative"),
    "position_ids not from 0": (lambda: PackedLayout.from_position_ids(torch.tensor([[1, 2, 0]])),
                                InvalidLayoutError, r"position_ids\[0, 0\] = 1, but a row starts a sequence"),
    "segment_ids 1-D": (lambda: PackedLayout.from_segment_ids(torch.tensor([1, 1, 2])), InvalidLayoutError,
                        r"segment_ids must be 2-D \(batch, seq\), got shape \(3,\)"),
    "segment_ids float": (lambda: PackedLayout.from_segment_ids(torch.tensor([[1.0, 2.0]])), InvalidLayoutError,
                          "segment_ids must hold integers or booleans, got dtype torch.float32"),
    "segment_ids inner padding": (lambda: PackedLayout.from_segment_ids(torch.tensor([[1, 0, 2]])),
                                  InvalidLayoutError, r"segment_ids\[0, 2\] = 2 follows padding \(0\) at column 1"),
    "segment_ids reappearing": (lambda: PackedLayout.from_segment_ids(torch.tensor([[1, 2, 1]])),
                                InvalidLayoutError, r"segment_ids\[0, 2\] = 1 follows 2"),
    "segment_ids not from 1": (lambda: PackedLayout.from_segment_ids(torch.tensor([[2, 2, 3]])),
                               InvalidLayoutError, r"segment_ids\[0, 0\] = 2, but the first sequence of a row"),
    "segment_ids negative": (lambda: PackedLayout.from_segment_ids(torch.tensor([[1, -1]])), InvalidLayoutError,
                             r"segment_ids\[0, 1\] = -1 is negative"),
    "cu_seqlens empty": (lambda: PackedLayout.from_cu_seqlens(torch.tensor([], dtype=torch.int32), 2, 3),
                         InvalidLayoutError, r"cu_seq_lens_q = \[\] does not describe the flattened batch of 2 x 3"),
    "cu_seqlens not from 0": (lambda: PackedLayout.from_cu_seqlens(torch.tensor([1, 3, 6]), 2, 3),
                              InvalidLayoutError, r"cu_seq_lens_q = \[1, 3, 6\] .* must start at 0"),
    "cu_seqlens repeated": (lambda: PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 3, 6]), 2, 3),
                            InvalidLayoutError, r"cu_seq_lens_q = \[0, 3, 3, 6\] .* increase strictly"),
    "cu_seqlens short": (lambda: PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 5]), 2, 3), InvalidLayoutError,
                         r"2 x 3 = 6 tokens: .* end at 6"),
    "cu_seqlens across rows": (lambda: PackedLayout.from_cu_seqlens(torch.tensor([0, 4, 6]), 2, 3),
                               InvalidLayoutError, r"cu_seq_lens_q lets a sequence cross from row 0 into row 1"),
    "buckets by": (lambda: PackedLayout.from_position_ids(_ROW).buckets("chunk"), InvalidArgumentError,
                   "by must be one of bucket, length, sequence, got 'chunk'"),
    "another batch's tokens": (lambda: PackedLayout.from_position_ids(_ROW).check_tokens(torch.zeros(1, 4, 2), "Att"),
                               InvalidLayoutError, r"Att got inputs of shape \(1, 4\) but the packed layout of this "
                               r"forward is \(1, 5\)"),
}


@pytest.mark.parametrize(("call", "error", "match"), BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_padfree_error_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, PadfreeError)


def test_check_tokens_accepts_the_layouts_own_shape():
    lay = PackedLayout.from_position_ids(_ROW)
    assert lay.check_tokens(torch.zeros(1, 5, 4, 2), "Att") is None  # (B, T, ...) of the layout: no refusal


# Inputs that once crashed with a bare Python error or were silently misread: each is now refused by name
# (``argument``: a regex the message must match), or, for an array-like spelling, read to the right layout
# (``lengths``).
def _bug(call, argument, lengths, *, id, reason):
    return pytest.param(call, argument, lengths, id=id)


_NOT_A_TENSOR = "from_position_ids / from_segment_ids call .to() on their input: AttributeError, not read or refused"
BUGS = [
    _bug(lambda: PackedLayout.from_position_ids(np.array([[0, 1, 0]])), "position_ids", [2, 1],
         id="position_ids as a numpy array", reason=_NOT_A_TENSOR),
    _bug(lambda: PackedLayout.from_position_ids([[0, 1, 0]]), "position_ids", [2, 1],
         id="position_ids as a list", reason=_NOT_A_TENSOR),
    _bug(lambda: PackedLayout.from_segment_ids(np.array([[1, 1, 2]])), "segment_ids", [2, 1],
         id="segment_ids as a numpy array", reason=_NOT_A_TENSOR),
    _bug(lambda: PackedLayout.from_cu_seqlens(torch.tensor([0.0, 2.5, 3.0, 6.0]), 2, 3), r"cu_seq.*2\.5", None,
         id="cu_seqlens with a fraction",
         reason="from_cu_seqlens casts float offsets to int64: 0.0, 2.5, 3.0, 6.0 is silently read as lengths 2, 1, 3"),
    _bug(lambda: PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 6]), "2", 3), "batch.*'2'", None,
         id="batch as a string", reason="from_cu_seqlens does not check batch: '2' * 3 makes the message say "
         "'2 x 3 = 222 tokens'"),
    _bug(lambda: PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 6]), -2, -3), "batch.*-2", None,
         id="negative batch", reason="from_cu_seqlens does not check batch / seq_len: torch's RuntimeError "
         "(invalid shape dimension -2)"),
    _bug(lambda: PackedLayout.from_cu_seqlens(torch.tensor([0]), 2, 0), "seq_len.*0", None,
         id="seq_len 0", reason="from_cu_seqlens does not check seq_len: np.arange(0, 0, 0) raises ZeroDivisionError"),
]


@pytest.mark.parametrize(("call", "argument", "lengths"), BUGS)
def test_array_likes_are_read_and_bad_arguments_refused_by_name(call, argument, lengths):
    if lengths is not None:  # the array-like spellings: read right, or refused by name
        try:
            lay = call()
        except PadfreeError as err:
            message = str(err)
        else:
            message = argument
            assert lay.lengths.tolist() == lengths
        assert re.search(argument, message)
    else:
        with pytest.raises(PadfreeError, match=argument):
            call()
