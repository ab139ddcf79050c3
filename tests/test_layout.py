"""Boundary spellings: every conversion against a slow per-token reference, round trips, and every bad input."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import layout
from padfree.errors import BackendUnavailableError, InvalidArgumentError, InvalidLayoutError, PadfreeError

torch = pytest.importorskip("torch")

# ---------------------------------------------------------------------------------------------------
# A batch drawn as Python lists, and its every spelling written token by token
# ---------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    rows: list[list[int]]  # per row, the lengths of its sequences
    seq_len: int
    lengths: np.ndarray
    seqs_per_row: np.ndarray
    segment_ids: np.ndarray
    position_ids: np.ndarray
    seq_idx: np.ndarray


def reference(rows: list[list[int]], seq_len: int) -> Batch:
    seg = np.zeros((len(rows), seq_len), np.int64)
    pos = np.zeros((len(rows), seq_len), np.int64)
    idx = np.zeros((len(rows), seq_len), np.int32)
    for r, row in enumerate(rows):
        col = 0
        for k, n in enumerate(row):
            for t in range(n):
                seg[r, col], pos[r, col], idx[r, col] = k + 1, t, k
                col += 1
        for c in range(col, seq_len):
            # padding: one extra trailing segment, positions counting from 0
            idx[r, c], pos[r, c] = len(row), c - col
    lengths = np.array([n for row in rows for n in row], np.int64)
    return Batch(rows, seq_len, lengths, np.array([len(row) for row in rows], np.int64), seg, pos, idx)


@st.composite
def batches(draw, max_rows=4, max_seqs=4, max_len=6, max_pad=3):
    rows = draw(st.lists(st.lists(st.integers(1, max_len), max_size=max_seqs), min_size=1, max_size=max_rows))
    seq_len = max(1, max(sum(row) for row in rows) + draw(st.integers(0, max_pad)))
    return reference(rows, seq_len)


backends = st.sampled_from(["numpy", "torch"])


def to(backend, x):
    return torch.as_tensor(x) if backend == "torch" else np.asarray(x)


def out(backend, x, dtype):
    """``x`` as numpy, after checking it is in ``backend`` with ``dtype`` (and on the CPU, the input's device)."""
    if backend == "torch":
        assert isinstance(x, torch.Tensor), type(x)
        assert x.device.type == "cpu"
        assert x.dtype == getattr(torch, dtype), x.dtype
        return x.numpy()
    assert isinstance(x, np.ndarray), type(x)
    assert x.dtype == np.dtype(dtype), x.dtype
    return x


def slow_mask(seg: np.ndarray, window: int | None) -> np.ndarray:
    rows, seq = seg.shape
    mask = np.zeros((rows, 1, seq, seq), bool)
    for b in range(rows):
        for i in range(seq):
            for j in range(seq):
                mask[b, 0, i, j] = (
                    seg[b, i] > 0 and seg[b, i] == seg[b, j] and j <= i and (window is None or i - j < window)
                )
    return mask


# ---------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(st.lists(st.integers(1, 1000), max_size=30), backends)
def test_lengths_cu_seqlens_round_trip(lengths, backend):
    cu = out(backend, layout.lengths_to_cu_seqlens(to(backend, np.array(lengths, np.int64))), "int32")
    assert cu.tolist() == [0, *np.cumsum(lengths, dtype=np.int64).tolist()]
    assert out(backend, layout.cu_seqlens_to_lengths(to(backend, cu)), "int64").tolist() == lengths


@settings(deadline=None)
@given(batches(), backends)
def test_lengths_and_segment_ids(b, backend):
    seg = layout.lengths_to_segment_ids(to(backend, b.lengths), to(backend, b.seqs_per_row), b.seq_len)
    np.testing.assert_array_equal(out(backend, seg, "int64"), b.segment_ids)
    np.testing.assert_array_equal(out(backend, layout.segment_ids_to_lengths(seg), "int64"), b.lengths)
    np.testing.assert_array_equal(out(backend, layout.get_seqlens_in_batch(seg), "int64"), b.lengths)
    np.testing.assert_array_equal(out(backend, layout.seqs_per_row(seg), "int64"), b.seqs_per_row)
    cu = layout.segment_ids_to_cu_seqlens(seg)
    np.testing.assert_array_equal(out(backend, cu, "int32"), layout.lengths_to_cu_seqlens(b.lengths))
    # a 0/1 (or boolean) mask is segment ids with one sequence per row
    single = to(backend, b.segment_ids > 0)
    np.testing.assert_array_equal(out(backend, layout.segment_ids_to_lengths(single), "int64"),
                                  [sum(row) for row in b.rows if row])


@settings(deadline=None)
@given(batches(), backends, st.data())
def test_position_ids(b, backend, data):
    seg, real = to(backend, b.segment_ids), b.segment_ids > 0
    pos = layout.segment_ids_to_position_ids(seg)
    np.testing.assert_array_equal(out(backend, pos, "int64"), b.position_ids)
    built = layout.lengths_to_position_ids(to(backend, b.lengths), to(backend, b.seqs_per_row), b.seq_len)
    np.testing.assert_array_equal(out(backend, built, "int64"), b.position_ids)
    for mask in (to(backend, real), to(backend, real.astype(np.int64)), seg):
        back = layout.position_ids_to_segment_ids(pos, attention_mask=mask)
        np.testing.assert_array_equal(out(backend, back, "int64"), b.segment_ids)
        lengths = layout.position_ids_to_lengths(pos, attention_mask=mask)
        np.testing.assert_array_equal(out(backend, lengths, "int64"), b.lengths)
        cu = layout.position_ids_to_cu_seqlens(pos, attention_mask=mask)
        np.testing.assert_array_equal(out(backend, cu, "int32"), layout.lengths_to_cu_seqlens(b.lengths))
    # with a mask, whatever padding carries (HF continues counting, TRL writes 0, some write -100) is ignored
    noisy = b.position_ids.copy()
    noisy[~real] = data.draw(st.integers(-100, 100))
    back = layout.position_ids_to_segment_ids(to(backend, noisy), attention_mask=to(backend, real))
    np.testing.assert_array_equal(out(backend, back, "int64"), b.segment_ids)
    # without one, the padding tail reads as one more sequence, so no real token can see it
    alone = [n for row, pad in zip(b.rows, (~real).sum(1), strict=True) for n in [*row, *([pad] if pad else [])]]
    np.testing.assert_array_equal(out(backend, layout.position_ids_to_lengths(pos), "int64"), alone)


@settings(deadline=None)
@given(batches(), backends)
def test_seq_idx(b, backend):
    seg, real = to(backend, b.segment_ids), b.segment_ids > 0
    idx = layout.segment_ids_to_seq_idx(seg)
    np.testing.assert_array_equal(out(backend, idx, "int32"), b.seq_idx)
    built = layout.lengths_to_seq_idx(to(backend, b.lengths), to(backend, b.seqs_per_row), b.seq_len)
    np.testing.assert_array_equal(out(backend, built, "int32"), b.seq_idx)
    assert (np.diff(b.seq_idx, axis=1) >= 0).all()  # what mamba kernels assume
    for mask in (to(backend, real), seg):
        back = layout.seq_idx_to_segment_ids(idx, attention_mask=mask)
        np.testing.assert_array_equal(out(backend, back, "int64"), b.segment_ids)
    # without a mask the padding reads as one more sequence at the end of its row
    alone = [n for row, pad in zip(b.rows, (~real).sum(1), strict=True) for n in [*row, *([pad] if pad else [])]]
    np.testing.assert_array_equal(layout.segment_ids_to_lengths(layout.seq_idx_to_segment_ids(idx)), alone)


@settings(deadline=None)
@given(batches(), backends)
def test_get_unpad_data(b, backend):
    indices, cu, max_seqlen = layout.get_unpad_data(to(backend, b.segment_ids))
    np.testing.assert_array_equal(out(backend, indices, "int64"), np.flatnonzero(b.segment_ids.ravel()))
    np.testing.assert_array_equal(out(backend, cu, "int32"), layout.lengths_to_cu_seqlens(b.lengths))
    assert type(max_seqlen) is int
    assert max_seqlen == max(b.lengths.tolist(), default=0)


@settings(deadline=None)
@given(batches(max_seqs=3, max_len=5), backends, st.sampled_from([None, 1, 2, 3, 5]))
def test_block_causal_mask_matches_slow_reference_and_reads_back(b, backend, window):
    seg = to(backend, b.segment_ids)
    expected = slow_mask(b.segment_ids, window)
    mask = layout.block_causal_mask(seg, sliding_window=window)
    np.testing.assert_array_equal(out(backend, mask, "bool"), expected)
    dtype = torch.bfloat16 if backend == "torch" else np.float32
    additive = layout.block_causal_mask(seg, sliding_window=window, dtype=dtype)
    lowest = torch.finfo(dtype).min if backend == "torch" else np.finfo(dtype).min
    values = additive.float().numpy() if backend == "torch" else additive
    np.testing.assert_array_equal(values, np.where(expected, 0.0, np.float32(lowest)))
    if window != 1:
        for m in (mask, additive):
            np.testing.assert_array_equal(out(backend, layout.block_causal_mask_to_segment_ids(m, window), "int64"),
                                          b.segment_ids)


@settings(deadline=None, max_examples=30)
@given(batches(max_rows=3, max_seqs=3, max_len=5), st.sampled_from([None, 2, 4]), st.sampled_from([2, 4, 128]))
def test_block_mask_matches_dense_mask(b, window, block_size):
    seg = torch.as_tensor(b.segment_ids)
    bm = layout.block_mask(seg, sliding_window=window, block_size=block_size)
    dense = slow_mask(b.segment_ids, window)
    # token level: the mask_mod on every pair
    from torch.nn.attention.flex_attention import create_mask

    rows, seq = b.segment_ids.shape
    np.testing.assert_array_equal(create_mask(bm.mask_mod, rows, 1, seq, seq).numpy(), dense)
    # block level: a block is listed iff it holds an allowed pair, and a "full" block holds only allowed pairs
    nb = -(-seq // block_size)
    padded = np.zeros((rows, 1, nb * block_size, nb * block_size), bool)
    padded[:, :, :seq, :seq] = dense
    blocks = padded.reshape(rows, 1, nb, block_size, nb, block_size)
    np.testing.assert_array_equal(bm.to_dense().numpy().astype(bool), blocks.any(axis=(3, 5)))
    np.testing.assert_array_equal(layout.block_mask_to_segment_ids(bm, window).numpy(), b.segment_ids)


def test_masks_give_per_sequence_attention():
    """sdpa with either dense mask computes, for every real token, exactly causal attention within its sequence."""
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    q, k, v = torch.randn(3, 2, 2, 6, 8, dtype=torch.float64).unbind(0)
    expected = torch.zeros_like(q)
    for r, (start, n) in enumerate([(0, 2), (2, 3), (0, 1), (1, 2), (3, 3)]):
        row = 0 if r < 2 else 1
        sl = slice(start, start + n)
        expected[row, :, sl] = torch.nn.functional.scaled_dot_product_attention(
            q[row, :, sl], k[row, :, sl], v[row, :, sl], is_causal=True)
    for dtype in (None, torch.float64):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.block_causal_mask(seg,
                                                                                                             dtype=dtype))
        assert torch.isfinite(got).all()
        real = (seg > 0)[:, None, :, None].expand_as(got)
        torch.testing.assert_close(got[real], expected[real])


# ---------------------------------------------------------------------------------------------------
# The LLaMA-Factory example, exactly
# ---------------------------------------------------------------------------------------------------

LF_MASK = [[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_llama_factory_example(backend):
    mask = to(backend, LF_MASK)
    assert out(backend, layout.get_seqlens_in_batch(mask), "int64").tolist() == [2, 3, 1, 2, 3]
    indices, cu_seqlens, max_seqlen = layout.get_unpad_data(mask)
    assert out(backend, indices, "int64").tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert out(backend, cu_seqlens, "int32").tolist() == [0, 2, 5, 6, 8, 11]
    assert max_seqlen == 3
    assert type(max_seqlen) is int


def test_llama_factory_example_any_integer_dtype():
    for dtype in (torch.int32, torch.int8, torch.uint8):
        assert layout.get_seqlens_in_batch(torch.tensor(LF_MASK, dtype=dtype)).tolist() == [2, 3, 1, 2, 3]
    assert layout.get_seqlens_in_batch(np.array(LF_MASK, np.uint16)).tolist() == [2, 3, 1, 2, 3]


def test_empty_and_all_padding():
    assert layout.get_unpad_data(np.zeros((2, 3), np.int64))[1].tolist() == [0]
    assert layout.get_unpad_data(np.zeros((2, 3), np.int64))[2] == 0
    assert layout.lengths_to_cu_seqlens([]).tolist() == [0]
    assert layout.lengths_to_segment_ids([], seqs_per_row=[0, 0], seq_len=2).tolist() == [[0, 0], [0, 0]]
    assert layout.segment_ids_to_seq_idx(np.zeros((1, 3), np.int64)).tolist() == [[0, 0, 0]]


def test_check_false_never_reads_values_back():
    """On the meta device any host read fails: the (batch, seq) conversions and the mask never sync, and stay put."""
    seg = torch.zeros(2, 6, dtype=torch.int64, device="meta")
    calls = [
        (layout.segment_ids_to_position_ids(seg, check=False), torch.int64),
        (layout.segment_ids_to_seq_idx(seg, check=False), torch.int32),
        (layout.position_ids_to_segment_ids(seg, seg, check=False), torch.int64),
        (layout.seq_idx_to_segment_ids(seg, seg, check=False), torch.int64),
        (layout.block_causal_mask(seg, 3, check=False), torch.bool),
        (layout.block_causal_mask(seg, 3, torch.bfloat16, check=False), torch.bfloat16),
        (layout.block_causal_mask_to_segment_ids(torch.ones(2, 1, 6, 6, dtype=torch.bool, device="meta"), check=False),
         torch.int64),
    ]
    for result, dtype in calls:
        assert result.device.type == "meta"
        assert result.dtype == dtype


def test_layout_does_not_import_torch():
    code = "import sys, padfree, padfree.layout; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]", out


# ---------------------------------------------------------------------------------------------------
# Every bad input: one error whose message names the culprit
# ---------------------------------------------------------------------------------------------------

BAD = [
    (layout.lengths_to_cu_seqlens, ([2, 0, 3],), r"lengths\[1\] = 0, but every sequence length must be >= 1"),
    (layout.lengths_to_cu_seqlens, ([2.0, 3.0],), "lengths must hold integers, got dtype (torch.)?float64"),
    (layout.lengths_to_cu_seqlens, ([[2, 3]],), r"lengths must be 1-D \(n,\), got shape \(1, 2\)"),
    (layout.lengths_to_cu_seqlens, (5,), r"lengths must be a 1-D integer array \(n,\), got 5"),
    (layout.lengths_to_cu_seqlens, ([2**31, 1],), "lengths sum to 2147483649 tokens, more than int32"),
    (layout.cu_seqlens_to_lengths, ([1, 3, 5],), r"cu_seqlens\[0\] = 1, but offsets start at 0"),
    (layout.cu_seqlens_to_lengths, ([0, 3, 3, 5],), r"cu_seqlens\[2\] = 3 follows 3; offsets must strictly increase"),
    (layout.cu_seqlens_to_lengths, ([0, 4, 2],), r"cu_seqlens\[2\] = 2 follows 4"),
    (layout.cu_seqlens_to_lengths, ([],), "cu_seqlens is empty"),
    (layout.segment_ids_to_lengths, ([[1, 1, 2, 1]],), r"segment_ids\[0, 3\] = 1 follows 2; a packed row is runs"),
    (layout.segment_ids_to_lengths, ([[1, 1], [1, 3]],), r"segment_ids\[1, 1\] = 3 follows 1"),
    (layout.segment_ids_to_lengths, ([[1, 0, 2]],), r"segment_ids\[0, 2\] = 2 follows padding \(0\) at column 1"),
    (layout.segment_ids_to_lengths, ([[0, 1, 1]],), r"segment_ids\[0, 1\] = 1 follows padding"),
    (layout.segment_ids_to_lengths, ([[2, 2]],), r"segment_ids\[0, 0\] = 2, but the first sequence of a row has id 1"),
    (layout.segment_ids_to_lengths, ([[1, -1]],), r"segment_ids\[0, 1\] = -1 is negative"),
    (layout.segment_ids_to_lengths, ([1, 1, 2],), r"segment_ids must be 2-D \(batch, seq\), got shape \(3,\)"),
    (layout.segment_ids_to_lengths, ([[0.5, 1.0]],), "segment_ids must hold integers or booleans, got dtype .*float64"),
    (layout.get_unpad_data, ([[1, 2, 1]],), r"attention_mask\[0, 2\] = 1 follows 2"),
    (layout.get_seqlens_in_batch, ([[1, 1, 0, 2]],), r"attention_mask\[0, 3\] = 2 follows padding"),
    (layout.position_ids_to_segment_ids, ([[0, 1, 3]],),
     r"position_ids\[0, 2\] = 3 follows 1; a position is the previous one \+ 1 or a restart at 0"),
    (layout.position_ids_to_segment_ids, ([[0, 1, 1]],), r"position_ids\[0, 2\] = 1 follows 1"),
    (layout.position_ids_to_segment_ids, ([[0, 1], [1, 2]],),
     r"position_ids\[1, 0\] = 1, but a row starts a sequence at position 0"),
    (layout.position_ids_to_segment_ids, ([[0, 1, -100]],),
     r"position_ids\[0, 2\] = -100 is negative; if it is padding, pass attention_mask"),
    (layout.position_ids_to_segment_ids, ([[True, False]],), "position_ids must hold integers, got dtype .*bool"),
    (layout.position_ids_to_lengths, ([[0, 1, 2]], [[1, 0, 1]]),
     r"attention_mask\[0, 2\] marks a real token after padding at column 1"),
    (layout.position_ids_to_cu_seqlens, ([[0, 1, 2]], [[1, 1]]), r"attention_mask has shape \(1, 2\), but the ids"),
    (layout.position_ids_to_segment_ids, ([[0, 1, 0]], [[1, 2, 2]]),
     r"attention_mask\[0, 1\] = 2, but position_ids put that token in sequence 1"),
    (layout.position_ids_to_segment_ids, ([[0, 1]], [[1, -1]]), r"attention_mask\[0, 1\] = -1 is negative"),
    (layout.seq_idx_to_segment_ids, ([[0, 0, 2]],), r"seq_idx\[0, 2\] = 2 follows 0; within a row seq_idx stays"),
    (layout.seq_idx_to_segment_ids, ([[1, 1]],), r"seq_idx\[0, 0\] = 1, but a row's seq_idx starts at 0"),
    (layout.seq_idx_to_segment_ids, ([[0, 1, 0]],), r"seq_idx\[0, 2\] = 0 follows 1"),
    (layout.lengths_to_segment_ids, ([2, 3], [1, 2]), "seqs_per_row sums to 3, but lengths holds 2 sequences"),
    (layout.lengths_to_segment_ids, ([2, 3], [3, -1]), r"seqs_per_row\[1\] = -1, but a row holds >= 0 sequences"),
    (layout.lengths_to_segment_ids, ([2, 3], [1, 1], 2), "row 1 holds 3 tokens, more than seq_len=2"),
    (layout.lengths_to_position_ids, ([2, -3],), r"lengths\[1\] = -3"),
    (layout.block_causal_mask_to_segment_ids, (np.ones((1, 1, 3, 3), bool),),
     r"mask\[0, 0, 0, 1\] says attend, but the block-diagonal causal mask"),
    (layout.block_causal_mask_to_segment_ids, (np.diag([True, False, True])[None, None],),
     r"mask\[0, :, 2, 2\] lets token 2 attend itself after padding at token 1"),
    (layout.block_causal_mask_to_segment_ids, (np.ones((3, 3), bool),), r"mask must be a 4-D array"),
    (layout.block_causal_mask_to_segment_ids, (np.ones((1, 1, 2, 2), np.int64),), "mask must be boolean"),
]


@pytest.mark.parametrize(("fn", "args", "match"), BAD,
                         ids=lambda x: getattr(x, "__name__", None))
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bad_input_names_the_culprit(fn, args, match, backend):
    if backend == "torch":
        if not all(isinstance(a, (list, np.ndarray)) for a in args):
            pytest.skip("a scalar or shape error, backend-independent")
        args = tuple(torch.as_tensor(np.asarray(a, np.int64 if isinstance(a, list) and not a else None)) for a in args)
    with pytest.raises(InvalidLayoutError, match=match):
        fn(*args)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: layout.block_causal_mask([[1, 1]], sliding_window=0), "sliding_window must be an integer >= 1 or"),
        (lambda: layout.block_causal_mask([[1, 1]], dtype=np.int32), "dtype must be None or bool"),
        (lambda: layout.block_causal_mask(torch.tensor([[1, 1]]), dtype=np.float32), "a floating torch dtype"),
        (lambda: layout.block_causal_mask_to_segment_ids(np.ones((1, 1, 2, 2), bool), 1), "sliding_window=1 lets"),
        (lambda: layout.lengths_to_segment_ids([2], seq_len=0), "seq_len must be an integer >= 1, got 0"),
        (lambda: layout.block_mask([[1, 1]], block_size=0), "block_size must be an integer >= 1"),
        (lambda: layout.block_mask_to_segment_ids(np.ones((1, 1, 2, 2))), "block_mask must be a torch.nn.attention"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call()


def test_missing_flex_attention_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)
    with pytest.raises(BackendUnavailableError, match=r"block_mask needs torch.nn.attention.flex_attention") as info:
        layout.block_mask([[1, 1]])
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value, PadfreeError)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_row_length_past_any_row_is_refused_before_it_is_allocated(backend):
    lengths = [2, 3, 1, 2, 3]
    lengths = torch.tensor(lengths) if backend == "torch" else np.array(lengths)
    for build in (layout.lengths_to_segment_ids, layout.lengths_to_position_ids, layout.lengths_to_seq_idx):
        # seq_len=2**40 asked numpy / torch for 8 TiB per row
        with pytest.raises(InvalidArgumentError, match=r"seq_len must be None \(the fullest row\) or an integer "
                                                       r"in \[6 \(the fullest row\), 67108864\] .* got "
                                                       r"seq_len=1099511627776"):
            build(lengths, [2, 3], seq_len=2**40)
        # 40 rows of 2**26: each row within a capacity's bound, the batch past what int32 offsets index
        with pytest.raises(InvalidArgumentError, match=r"\[2 \(the fullest row\), 53687091\] .* 40 rows"):
            build(lengths[:1].repeat(40) if backend == "torch" else np.repeat(lengths[:1], 40), [1] * 40,
                  seq_len=2**26)
        assert tuple(build(lengths, [2, 3], seq_len=64).shape) == (2, 64)  # a padded row length: as before
