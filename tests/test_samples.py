"""The front door for samples (padfree.samples): every accepted form of the same sequences reads to the same flat
buffers, every spelling of a packed row's boundaries to the same lengths, and each fault to one error naming the
sample and the field."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree.errors import InvalidLayoutError, InvalidSampleError, InvalidTokensError
from padfree.samples import BOUNDARY_KEYS, TokenBuffers, read_samples, read_tokens, row_boundaries


@pytest.fixture(scope="module")
def sequences(tok, gsm8k):
    """Real token ids: the first 40 GSM8K answers through mistral-common's 32k SentencePiece tokenizer."""
    return [tok(r["output"], add_special_tokens=False)["input_ids"] for r in gsm8k[:40]]


def _forms(seqs):
    """The same sequences in every form read_tokens accepts."""
    import pyarrow as pa
    import torch

    flat = np.concatenate([np.asarray(s, np.int64) for s in seqs])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    chunked = pa.chunked_array([pa.array(seqs[: len(seqs) // 2]), pa.array(seqs[len(seqs) // 2:])])
    return {
        "lists": [list(s) for s in seqs],
        "tuples": [tuple(s) for s in seqs],
        "int32 arrays": [np.asarray(s, np.int32) for s in seqs],
        "uint16 arrays": [np.asarray(s, np.uint16) for s in seqs],
        "tensors": [torch.tensor(s) for s in seqs],
        "arrow list": pa.array(seqs),
        "arrow large list": pa.array(seqs, type=pa.large_list(pa.int64())),
        "arrow chunks": chunked,
        "values and offsets": (flat, offsets),
        "TokenBuffers": TokenBuffers(flat, offsets),
    }


def test_every_form_reads_to_the_same_buffers(sequences):
    want_values = [t for s in sequences for t in s]
    want_lengths = [len(s) for s in sequences]
    for form, tokens in _forms(sequences).items():
        buf = read_tokens(tokens)
        start = int(buf.offsets[0])  # a sliced Arrow array may keep its parent's values before it
        assert buf.values[start:int(buf.offsets[-1])].tolist() == want_values, form
        assert buf.lengths.tolist() == want_lengths, form


def test_a_block_of_equal_rows_is_one_view(sequences):
    block = np.asarray([s[:8] for s in sequences if len(s) >= 8], np.int64)
    buf = read_tokens(block)
    assert np.shares_memory(buf.values, block) and buf.lengths.tolist() == [8] * block.shape[0]


@pytest.mark.parametrize(("tokens", "error", "message"), [
    ([[5, 6], [7, True]], InvalidTokensError, r"token_ids\[1\]\[1\] = True"),
    ([[5, 6], [7, 2.5]], InvalidTokensError, r"token_ids\[1\]"),
    ([[5, 6], [7, 2 ** 63]], InvalidTokensError, r"token_ids\[1\]"),
    ([[5, 6], [-3, 7]], InvalidTokensError, r"token_ids\[1\]\[0\] = -3 is negative"),
    ("not tokens", InvalidSampleError, r"token_ids must be a sequence of token-id sequences"),
    ({"input_ids": [1]}, InvalidSampleError, r"token_ids must be a sequence of token-id sequences"),
])
def test_each_bad_token_is_one_error_naming_it(tokens, error, message):
    with pytest.raises(error, match=message):
        read_tokens(tokens)


def test_the_vocabulary_bound_names_the_token(sequences):
    vocab = max(max(s) for s in sequences)  # the largest id is out of a vocabulary that size
    with pytest.raises(InvalidTokensError, match=rf"is not below the vocabulary size {vocab}"):
        read_tokens(sequences, vocab_size=vocab)
    assert read_tokens(sequences, vocab_size=vocab + 1).lengths.tolist() == [len(s) for s in sequences]


@pytest.mark.parametrize(("samples", "message"), [
    ([{"input_ids": [1, 2, 3], "labels": [-100, 2]}], r"samples\[0\]\['labels'\] has 2 entries but its input_ids "
                                                      r"has 3 tokens"),
    ([{"input_ids": [1, 2]}, [3, 4]], r"samples\[1\] is .* but samples\[0\] is"),
    ([{"labels": [1, 2]}], r"samples\[0\]"),
    ([], r"samples is empty"),
    ([{"input_ids": [1, 2]}, {"input_ids": []}], r"samples\[1\]\['input_ids'\]"),
    ({"input_ids": [1, 2]}, r"samples must be a list of samples"),
])
def test_each_bad_sample_is_one_error_naming_it(samples, message):
    with pytest.raises(InvalidSampleError, match=message):
        read_samples(samples)


def test_labels_take_the_ignored_label_and_nothing_else_negative():
    got = read_samples([{"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}])
    assert got.labels.values.tolist() == [-100, 5, 6]
    with pytest.raises(InvalidTokensError, match=r"samples\[0\]\['labels'\]\[0\] = -1"):
        read_samples([{"input_ids": [4, 5, 6], "labels": [-1, 5, 6]}])
    assert read_samples([{"input_ids": [4, 5], "labels": [-1, 5]}], ignored=(-1,)).labels.values.tolist() == [-1, 5]


# ---- a packed row's boundaries, in every spelling ----------------------------------------------------------------

def _spellings(lengths):
    """Every spelling of one row's boundaries (BOUNDARY_KEYS), from its sequences' lengths."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    positions = [i for n in lengths for i in range(n)]
    segments = [k + 1 for k, n in enumerate(lengths) for _ in range(n)]
    return {"seq_lens": list(lengths), "seq_lengths": list(lengths), "cu_seq_lens": offsets, "cu_seqlens": offsets,
            "position_ids": positions, "attention_mask": segments}


def test_the_spellings_cover_every_boundary_key():
    assert set(_spellings([2, 3])) == set(BOUNDARY_KEYS)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=8), st.data())
def test_every_spelling_and_every_combination_gives_the_same_lengths(lengths, data):
    spellings = _spellings(lengths)
    keys = data.draw(st.lists(st.sampled_from(BOUNDARY_KEYS), min_size=1, unique=True))
    sample = {"input_ids": list(range(1, sum(lengths) + 1)), **{k: spellings[k] for k in keys}}
    got = row_boundaries(sample, sum(lengths))
    if len(lengths) == 1 and keys == ["attention_mask"]:
        assert got is None or got.tolist() == lengths  # a mask of 1s marks no boundary: one sequence either way
    else:
        assert got.tolist() == lengths


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=5), min_size=1, max_size=6),
       st.sampled_from(BOUNDARY_KEYS))
def test_packed_rows_are_cut_into_their_sequences_no_token_lost_or_duplicated(rows, key):
    samples, start = [], 1
    for lengths in rows:
        n = sum(lengths)
        samples.append({"input_ids": list(range(start, start + n)), key: _spellings(lengths)[key]})
        start += n
    got = read_samples(samples)
    assert got.ids.values.tolist() == list(range(1, start))  # every token once, in order
    flat = [n for lengths in rows for n in lengths]
    if got.row_offsets is None:  # every row one sequence (or a mask of 1s): nothing to cut
        assert all(len(lengths) == 1 for lengths in rows) or key == "attention_mask"
        assert got.ids.lengths.tolist() == [sum(lengths) for lengths in rows]
    else:
        assert got.ids.lengths.tolist() == flat
        assert np.diff(got.row_offsets).tolist() == [len(lengths) for lengths in rows]


@pytest.mark.parametrize(("sample", "message"), [
    ({"seq_lens": [2, 2]}, r"row\['seq_lens'\]"),
    ({"cu_seqlens": [0, 3, 2, 5]}, r"row\['cu_seqlens'\]"),
    ({"position_ids": [0, 1, 2, 0, 2]}, r"row\['position_ids'\]"),
    ({"attention_mask": [1, 1, 0, 1, 1]}, r"row\['attention_mask'\]\[2\] = 0 marks padding"),
    ({"seq_lens": [2, 3], "cu_seq_lens": [0, 3, 5]}, r"disagree on where the sequences of the row start"),
])
def test_a_wrong_or_disagreeing_spelling_is_refused_by_name(sample, message):
    with pytest.raises(InvalidLayoutError, match=message):
        row_boundaries({"input_ids": [1, 2, 3, 4, 5], **sample}, 5, "row")
