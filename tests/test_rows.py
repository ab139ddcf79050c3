"""Packed rows: every token back where it came from, no label across a boundary, padding modes."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import InvalidArgumentError, InvalidTokensError, layout, pack_sequences
from padfree.rows import packed_rows
from padfree.samples import read_tokens
from realdata import gsm8k_records

sequences = st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=40), min_size=0, max_size=40)


def _masked_labels(seqs, rng):
    return [[t if rng.random() < 0.6 else -100 for t in s] for s in seqs]


@given(seqs=sequences, capacity=st.integers(1, 48), policy=st.sampled_from(["split", "truncate", "drop"]),
       strategy=st.sampled_from(["obfd", "ffs", "nf"]), seed=st.integers(0, 9))
@settings(max_examples=150, deadline=None)
def test_unpacking_gives_back_every_sequence(seqs, capacity, policy, strategy, seed):
    rng = np.random.default_rng(seed)
    labels = _masked_labels(seqs, rng)
    plan = pack_sequences([len(s) for s in seqs], capacity, strategy, seed, overlong=policy)
    rows = packed_rows(plan, seqs, labels=labels)
    starts = plan.piece_starts if plan.piece_starts is not None else np.zeros(plan.num_pieces, np.int64)
    pieces_seen = 0
    rebuilt: dict[int, list[tuple[int, list[int]]]] = {}
    for r in range(rows.num_rows):
        row = rows.row(r)
        assert row["input_ids"].shape[0] <= capacity
        cu = row["cu_seqlens"]
        assert cu[0] == 0
        assert cu[-1] == row["input_ids"].shape[0]
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            seq = int(rows.sequence_ids[pieces_seen])
            start = int(starts[pieces_seen])
            pieces_seen += 1
            piece = row["input_ids"][a:b].tolist()
            assert piece == seqs[seq][start : start + (b - a)]
            assert row["position_ids"][a:b].tolist() == list(range(b - a))
            # no prediction crosses a boundary: the first label of each piece is masked, the rest untouched
            assert row["labels"][a] == -100
            assert row["labels"][a + 1 : b].tolist() == labels[seq][start + 1 : start + (b - a)]
            rebuilt.setdefault(seq, []).append((start, piece))
    assert pieces_seen == plan.num_pieces
    for seq, parts in rebuilt.items():
        tokens = [t for _, piece in sorted(parts) for t in piece]  # pieces of a split sequence, in token order
        if policy == "split" or len(seqs[seq]) <= capacity:
            assert tokens == seqs[seq]
        else:
            assert tokens == seqs[seq][:capacity]
    if policy == "drop":
        assert sorted(rebuilt) == [i for i, s in enumerate(seqs) if len(s) <= capacity]
    else:
        assert sorted(rebuilt) == list(range(len(seqs)))


@given(seqs=sequences, pad=st.sampled_from(["capacity", "longest", 64]), multiple=st.sampled_from([None, 1, 8]))
@settings(max_examples=80, deadline=None)
def test_padded_rows_and_shifted_labels(seqs, pad, multiple):
    plan = pack_sequences([len(s) for s in seqs], 48, overlong="split")
    rows = packed_rows(plan, seqs)
    batch = rows.padded(pad, pad_to_multiple_of=multiple, padding_value=7, attention_mask="segments",
                        shift_labels=True)
    width = {"capacity": 48, "longest": int(rows.row_lengths.max(initial=0)), 64: 64}[pad]
    if multiple:
        width = -(-width // multiple) * multiple
    assert batch["input_ids"].shape == (rows.num_rows, width)
    if rows.num_rows:
        # the padded rows speak the same boundary language as padfree.layout
        assert np.array_equal(layout.segment_ids_to_position_ids(batch["attention_mask"]), batch["position_ids"])
        assert np.array_equal(layout.segment_ids_to_lengths(batch["attention_mask"]), rows.seq_lens)
    for r in range(rows.num_rows):
        n = int(rows.row_lengths[r])
        seg = batch["attention_mask"][r]
        assert (seg[n:] == 0).all()
        assert (batch["input_ids"][r, n:] == 7).all()
        assert (batch["labels"][r, n:] == -100).all()
        # the padding tail counts like one more sequence
        assert batch["position_ids"][r, n:].tolist() == list(range(width - n))
        labels, shifted = batch["labels"][r], batch["shift_labels"][r]
        for t in range(width):
            same_piece = t + 1 < n and seg[t + 1] == seg[t]
            assert shifted[t] == (labels[t + 1] if same_piece else -100)


@given(seqs=sequences, cut=st.integers(0, 50))
@settings(max_examples=60, deadline=None)
def test_a_range_of_bins_equals_the_same_rows_of_the_whole(seqs, cut):
    plan = pack_sequences([len(s) for s in seqs], 48, overlong="split")
    whole = packed_rows(plan, seqs)
    cut = min(cut, plan.num_bins)
    parts = [packed_rows(plan, seqs, bins=slice(0, cut)), packed_rows(plan, seqs, bins=slice(cut, None))]
    assert sum(p.num_rows for p in parts) == whole.num_rows
    r = 0
    for part in parts:
        for k in range(part.num_rows):
            a, b = part.row(k), whole.row(r)
            assert all(np.array_equal(a[key], b[key]) for key in a)
            r += 1
    with pytest.raises(InvalidArgumentError, match="bins must be a slice of consecutive bins"):
        packed_rows(plan, seqs, bins=slice(0, None, 2))


def test_arrow_and_csr_inputs_are_read_without_python_lists():
    seqs = [[1, 2, 3], [4], [5, 6]]
    arrow = pa.array(seqs, type=pa.list_(pa.int32()))
    sliced = arrow.slice(1)
    buf = read_tokens(sliced)
    assert [buf.values[a:b].tolist() for a, b in zip(buf.offsets[:-1], buf.offsets[1:], strict=True)] == seqs[1:]
    plan = pack_sequences([3, 1, 2], 4)
    from_arrow = packed_rows(plan, pa.chunked_array([arrow]))
    from_lists = packed_rows(plan, seqs)
    assert np.array_equal(from_arrow.input_ids, from_lists.input_ids)
    values, offsets = np.array([1, 2, 3, 4, 5, 6]), np.array([0, 3, 4, 6])
    assert np.array_equal(packed_rows(plan, (values, offsets)).labels, from_lists.labels)
    unsigned = packed_rows(plan, (values.astype(np.uint64), offsets)).padded()
    assert unsigned["input_ids"].dtype == np.int64


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.uint64])
def test_any_integer_dtype_and_strided_buffers_give_the_same_rows(dtype):
    """The layout kernel copies pieces with memcpy when source and output agree, element by element otherwise
    (another dtype, a strided view): both give the same rows."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 100, n).tolist() for n in rng.integers(1, 30, 50)]
    labels = [[t if t % 3 else -100 for t in s] for s in seqs]
    plan = pack_sequences([len(s) for s in seqs], 64, overlong="split")
    want = packed_rows(plan, seqs, labels=labels)
    flat = read_tokens(seqs)
    strided = np.zeros(2 * flat.values.shape[0], dtype)[::2]  # every other element: not contiguous
    strided[:] = flat.values
    label_flat = read_tokens(labels, "labels", kind="labels")
    for values in (flat.values.astype(dtype), strided):
        got = packed_rows(plan, (values, flat.offsets), labels=(label_flat.values.astype(np.int32), label_flat.offsets))
        assert got.input_ids.dtype == dtype
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert np.array_equal(got.labels, want.labels) and np.array_equal(got.position_ids, want.position_ids)
        for mask in ("binary", "segments"):
            a = got.padded(attention_mask=mask, shift_labels=True)
            b = want.padded(attention_mask=mask, shift_labels=True)
            assert all(np.array_equal(a[k], b[k]) and a[k].dtype == np.int64 for k in b)
    padded = want.padded("longest", attention_mask="segments")["attention_mask"]
    assert np.array_equal(want.segment_ids(), padded[padded > 0])  # flat and padded: the same segment ids


def test_real_text_round_trip():
    pytest.importorskip("transformers")
    records = gsm8k_records(300)
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in records]
    import mistral_common

    model = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    tok = _tokenizer(model)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    # the other tests' tokenizer (zoo.mistral_tokenizer: the same model, loaded from its converted tokenizer.json)
    # gives the same ids and special tokens
    from zoo import mistral_tokenizer

    fast = mistral_tokenizer(tempfile.mkdtemp())
    assert fast(texts, add_special_tokens=False)["input_ids"] == ids
    assert fast(texts[:3])["input_ids"] == tok(texts[:3])["input_ids"]
    assert (fast.bos_token_id, fast.eos_token_id, fast.unk_token_id, len(fast)) == (
        tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, len(tok))
    plan = pack_sequences([len(x) for x in ids], 512)
    rows = packed_rows(plan, ids)
    assert plan.efficiency > 0.95
    for r in range(rows.num_rows):
        row = rows.row(r)
        cu = row["cu_seqlens"]
        for k, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
            seq = int(plan.bin(r)[k])
            assert tok.decode(row["input_ids"][a:b].tolist()) == tok.decode(ids[seq])
            assert row["input_ids"][a:b].tolist() == ids[seq]


def _tokenizer(model_file: Path):
    import shutil
    import tempfile

    from transformers import LlamaTokenizer

    folder = tempfile.mkdtemp()
    shutil.copy(model_file, Path(folder) / "tokenizer.model")
    return LlamaTokenizer.from_pretrained(folder)


@pytest.mark.parametrize(
    ("tokens", "lengths", "kwargs", "match"),
    [
        ([[1, 2], [3]], [2, 1, 1], {}, "token_ids has 2 sequences but the plan was made for 3"),
        ([[1, 2], [3, 4]], [2, 1], {}, r"token_ids\[1\] has 2 tokens but the plan says lengths\[1\] = 1"),
        ([[1, 2.5], [3]], [2, 1], {}, r"token_ids\[0\]\[1\] = 2.5 \(type float\) is not an integer token id"),
        ([[1, "a"], [3]], [2, 1], {}, r"token_ids\[0\]\[1\] = 'a'"),
        ([[1, 2], 3], [2, 1], {}, r"token_ids\[1\] = 3 \(type int\) is not a sequence of token ids"),
        ([[1, 2], [-3]], [2, 1], {}, r"token_ids\[1\]\[0\] = -3 is negative; token ids are integers >= 0"),
        ([np.array([1, 2], np.uint64), np.array([2**63], np.uint64)], [2, 1], {},
         r"token_ids\[1\]\[0\] = 9223372036854775808 does not fit int64"),
        ((np.array([1, 2, 2**63], np.uint64), np.array([0, 2, 3])), [2, 1], {},
         r"token_ids\[1\]\[0\] = 9223372036854775808 does not fit int64"),
        ([[1, 2], [True]], [2, 1], {}, r"token_ids\[1\]\[0\] = True \(type bool\) is not an integer token id"),
        ("hello", [5], {}, "token_ids must be a sequence of token-id sequences"),
        ([[1, 2], [3]], [2, 1], {"labels": [[1, 2], [3, 4]]}, r"labels\[1\] has 2 entries but token_ids\[1\] has 1"),
    ],
)
def test_bad_tokens(tokens, lengths, kwargs, match):
    with pytest.raises(InvalidTokensError, match=match):
        packed_rows(pack_sequences(lengths, 8), tokens, **kwargs)


@pytest.mark.parametrize("value", [-100.5, "-100", None, True, 2**63])
def test_label_padding_value_is_an_int64(value):
    with pytest.raises(InvalidArgumentError, match=r"label_padding_value must be an integer that fits int64"):
        packed_rows(pack_sequences([2, 1], 8), [[1, 2], [3]], label_padding_value=value)


@pytest.mark.parametrize("plan", [[[0, 1]], {"order": [0, 1]}, None])
def test_a_plan_must_be_a_pack_result(plan):
    with pytest.raises(InvalidArgumentError, match=r"result must be a PackResult"):
        packed_rows(plan, [[1, 2], [3]])


def test_bad_padding_options():
    rows = packed_rows(pack_sequences([3, 3], 4), [[1, 2, 3], [4, 5, 6]])
    with pytest.raises(InvalidArgumentError, match=r"pad_to must be 'capacity', 'longest' or an int in \[3 \(the "
                                                   r"longest row\), 67108864\], got 2"):
        rows.padded(2)
    with pytest.raises(InvalidArgumentError, match=r"pad_to_multiple_of must be None or an int in \[1, 67108864\]"):
        rows.padded(pad_to_multiple_of=0)
    with pytest.raises(InvalidArgumentError, match="attention_mask must be 'binary', 'segments' or None"):
        rows.padded(attention_mask="dense")


def test_a_2d_tensor_of_token_ids_is_rows_of_equal_length():
    torch = pytest.importorskip("torch")
    plan = pack_sequences([2, 2], 4)
    block = torch.tensor([[1, 2], [3, 4]])
    assert packed_rows(plan, block).input_ids.tolist() == packed_rows(plan, [[1, 2], [3, 4]]).input_ids.tolist()
    with pytest.raises(InvalidTokensError, match=r"token_ids\[1\]\[0\] = 3 is not below the vocabulary size 3"):
        read_tokens(block, vocab_size=3)
