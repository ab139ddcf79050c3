"""PackedBatch and the collators: every sample back token for token, flash kwargs as transformers derives them,
HF's flattening collator matched, real-text DataLoader with workers, a tiny Llama exact when packed."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import (
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
    PadfreeError,
    layout,
    pack_dataset,
    pack_sequences,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids  # noqa: E402

from padfree.data.batch import (  # noqa: E402
    PackedBatch,
    PackedCollator,
    PaddingFreeCollator,
    pack_result_to_tensors,
    packed_collate_fn,
)
from realdata import gsm8k_records  # noqa: E402

token_lists = st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=30), min_size=1, max_size=16)


def _samples(seqs, seed, with_labels, as_tensors=False):
    rng = np.random.default_rng(seed)
    out = []
    for s in seqs:
        ids = torch.tensor(s) if as_tensors else list(s)
        sample = {"input_ids": ids}
        if with_labels:
            lab = [t if rng.random() < 0.6 else -100 for t in s]
            sample["labels"] = torch.tensor(lab) if as_tensors else lab
        out.append(sample)
    return out


def _segments(batch: PackedBatch) -> list[dict[str, list[int]]]:
    """Cut the real tokens of the batch at cu_seqlens: one dict per packed sequence."""
    cu = batch.cu_seqlens.tolist()
    names = ["input_ids", "labels", "position_ids"] + (["shift_labels"] if batch.shift_labels is not None else [])
    flat = {name: batch.unpad(getattr(batch, name)).tolist() for name in names}
    return [{name: flat[name][a:b] for name in names} for a, b in itertools.pairwise(cu)]


def _check_structure(batch: PackedBatch, padding_value: int = 0) -> None:
    """Invariants every batch satisfies, whatever produced it."""
    B, T = batch.input_ids.shape
    for name in ("input_ids", "labels", "position_ids"):
        assert getattr(batch, name).dtype == torch.int64 and getattr(batch, name).shape == (B, T)
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens_padded.dtype == torch.int32
    assert batch.seq_lens.tolist() == torch.diff(batch.cu_seqlens).tolist()
    assert int(batch.seqs_per_row.sum()) == batch.num_sequences == batch.sequence_ids.shape[0]
    assert batch.max_seqlen == (max(batch.seq_lens.tolist()) if batch.num_sequences else 0)
    # padding, read back through the layout helpers
    seg = layout.lengths_to_segment_ids(batch.seq_lens, batch.seqs_per_row, T)
    pad = seg == 0
    assert batch.input_ids[pad].eq(padding_value).all()
    assert batch.labels[pad].eq(-100).all()
    assert torch.equal(batch.position_ids, layout.segment_ids_to_position_ids(seg))
    assert batch.num_padding == int(pad.sum())
    # the flash kwargs are exactly what transformers derives from position_ids (int32 offsets, same max)
    (cu_q, _), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch.position_ids)
    assert torch.equal(batch.cu_seqlens_padded, cu_q) and cu_q.dtype == torch.int32
    assert batch.max_seqlen_padded == int(max_q)
    if batch.attention_mask is not None:
        expected = seg if batch.mask_kind == "segments" else (seg > 0).long()
        assert torch.equal(batch.attention_mask, expected)
    if batch.seq_idx is not None:
        assert batch.seq_idx.dtype == torch.int32
        assert torch.equal(batch.seq_idx, layout.segment_ids_to_seq_idx(seg))
    if batch.shift_labels is not None:
        assert batch.shift_labels[pad].eq(-100).all()


def _check_segments(batch: PackedBatch, samples, capacity: int | None, policy: str = "error") -> None:
    """Unpacking gives back every sample, token for token and label for label; no label crosses a boundary."""
    pieces: dict[int, list[tuple[list[int], list[int]]]] = {}
    for sid, seg in zip(batch.sequence_ids.tolist(), _segments(batch), strict=True):
        n = len(seg["input_ids"])
        assert seg["position_ids"] == list(range(n))
        assert seg["labels"][0] == -100  # the first token of a packed sequence is never a target
        if "shift_labels" in seg:  # shift_labels[t] = labels[t + 1] inside the sequence, nothing past its end
            assert seg["shift_labels"] == [*seg["labels"][1:], -100]
        pieces.setdefault(sid, []).append((seg["input_ids"], seg["labels"]))
    for i, sample in enumerate(samples):
        ids = list(map(int, sample["input_ids"]))
        labels = list(map(int, sample.get("labels", ids)))
        if capacity is None or len(ids) <= capacity:
            chunks = [(ids, labels)]
        elif policy == "drop":
            assert i not in pieces
            continue
        elif policy == "truncate":
            chunks = [(ids[:capacity], labels[:capacity])]
        else:
            chunks = [(ids[a : a + capacity], labels[a : a + capacity]) for a in range(0, len(ids), capacity)]
        got = pieces.pop(i)
        assert sorted(p[0] for p in got) == sorted(c[0] for c in chunks)
        for got_ids, got_labels in got:
            (want_labels,) = [c[1] for c in chunks if c[0] == got_ids][:1]
            assert got_labels[1:] == want_labels[1:]
    assert not pieces


@given(seqs=token_lists, capacity=st.integers(1, 40), policy=st.sampled_from(["split", "truncate", "drop"]),
       strategy=st.sampled_from(["obfd", "ffs", "nf"]), seed=st.integers(0, 5), with_labels=st.booleans(),
       pad_to=st.sampled_from(["capacity", "longest", 64]), multiple=st.sampled_from([None, 8]),
       mask=st.sampled_from([None, "binary", "segments"]), flags=st.booleans())
@settings(max_examples=120, deadline=None)
def test_packed_collate_round_trip(seqs, capacity, policy, strategy, seed, with_labels, pad_to, multiple, mask, flags):
    samples = _samples(seqs, seed, with_labels, as_tensors=seed % 2 == 1)
    if pad_to == 64:
        capacity = min(capacity, 64)
    collate = packed_collate_fn(capacity, strategy, seed, padding_value=7, overlong=policy, pad_to=pad_to,
                                pad_to_multiple_of=multiple, attention_mask=mask, seq_idx=flags, shift_labels=flags)
    lengths = np.array([len(s) for s in seqs])
    if policy == "drop" and (lengths > capacity).all():
        batch = collate(samples)
        assert batch.batch_size == 0 and batch.num_sequences == 0 and batch.num_dropped == len(seqs)
        return
    batch = collate(samples)
    _check_structure(batch, padding_value=7)
    _check_segments(batch, samples, capacity, policy)
    T = batch.seq_len
    if pad_to == "capacity":
        assert -(-capacity // (multiple or 1)) * (multiple or 1) == T
    assert all(int(f) <= capacity for f in batch.seq_lens)
    assert batch.num_dropped == (int((lengths > capacity).sum()) if policy == "drop" else 0)
    if policy == "truncate":
        assert batch.truncated_tokens == int(np.maximum(lengths - capacity, 0).sum())


@given(seqs=token_lists, seed=st.integers(0, 5), with_labels=st.booleans(), flags=st.booleans(),
       mask=st.sampled_from([None, "binary", "segments"]), multiple=st.sampled_from([None, 1, 8, 64]))
@settings(max_examples=80, deadline=None)
def test_padding_free_round_trip(seqs, seed, with_labels, flags, mask, multiple):
    samples = _samples(seqs, seed, with_labels, as_tensors=seed % 2 == 1)
    batch = PaddingFreeCollator(attention_mask=mask, seq_idx=flags, shift_labels=flags, pad_to_multiple_of=multiple,
                                padding_value=7)(samples)
    total = sum(map(len, seqs))
    width = total if multiple is None else -(-total // multiple) * multiple
    assert batch.batch_size == 1 and batch.seq_len == width and batch.num_padding == width - total
    assert batch.sequence_ids.tolist() == list(range(len(seqs)))  # input order, one row
    # the padding tail (if any) is one more segment of the padded stream, and no sequence of the real one
    tail = [width] if width > total else []
    assert batch.cu_seqlens_padded.tolist() == [*batch.cu_seqlens.tolist(), *tail]
    _check_structure(batch, padding_value=7)
    _check_segments(batch, samples, None)


def test_plain_sequences_and_numpy_arrays_are_samples_too():
    seqs = [[3, 4, 5], np.array([6, 7], np.int32), torch.tensor([8], dtype=torch.int16)]
    batch = packed_collate_fn(4, pad_to="longest")(seqs)
    assert batch.input_ids.tolist() == [[3, 4, 5, 8], [6, 7, 0, 0]]
    assert batch.sequence_ids.tolist() == [0, 2, 1]
    flat = PaddingFreeCollator()(seqs)
    assert flat.input_ids.tolist() == [[3, 4, 5, 6, 7, 8]]


# ---- pack_result_to_tensors ---------------------------------------------------------------------------------------


def test_pack_result_to_tensors_matches_rows_and_moves():
    seqs = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    labels = [[-100, -100, 3, 4, 5], [6, 7], [-100, 9, 10]]
    plan = pack_sequences([5, 2, 3], capacity=4, overlong="split")
    batch = pack_result_to_tensors(plan, seqs, padding_value=-1, labels=labels, device="cpu", attention_mask="segments",
                                   seq_idx=True, shift_labels=True)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, -1, -1]]
    assert batch.labels.tolist() == [[-100, -100, 3, 4], [-100, 9, 10, -100], [-100, 7, -100, -100]]
    assert batch.shift_labels.tolist() == [[-100, 3, 4, -100], [9, 10, -100, -100], [7, -100, -100, -100]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 0, 0]]
    assert batch.seq_idx.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]]
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 8, 10]
    assert batch.cu_seqlens_padded.tolist() == [0, 4, 7, 8, 10, 12]
    assert (batch.max_seqlen, batch.max_seqlen_padded, batch.num_tokens, batch.num_padding) == (4, 4, 10, 2)
    _check_structure(batch, padding_value=-1)
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert isinstance(moved, PackedBatch) and moved.input_ids.device.type == "cpu"
    meta = batch.to("meta")
    assert all(t.device.type == "meta" for t in (meta.input_ids, meta.cu_seqlens, meta.seq_idx, meta.shift_labels))
    assert meta.max_seqlen == 4 and batch.input_ids.device.type == "cpu"  # the original is untouched
    assert "rows=3" in repr(batch) and "seq_len=4" in repr(batch)


def test_pack_result_to_tensors_shares_the_numpy_buffers():
    plan = pack_sequences([2, 2], capacity=4)
    batch = pack_result_to_tensors(plan, [np.array([1, 2]), np.array([3, 4])])
    assert batch.input_ids.is_contiguous() and batch.input_ids.dtype == torch.int64
    assert batch.input_ids.tolist() == [[1, 2, 3, 4]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs an accelerator")
def test_pin_memory_and_cuda():  # pragma: no cover - runs on GPU machines only
    batch = packed_collate_fn(8)([[1, 2, 3], [4, 5]]).pin_memory()
    assert batch.input_ids.is_pinned()
    cuda = batch.to("cuda", non_blocking=True)
    assert cuda.cu_seqlens_padded.device.type == "cuda" and cuda.num_tokens == 5


# ---- model_inputs ---------------------------------------------------------------------------------------------------


def test_model_inputs_keys_and_never_an_all_ones_mask():
    samples = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    base = {"input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
            "use_cache"}
    for mask in (None, "binary"):
        for collate in (packed_collate_fn(5, attention_mask=mask), PaddingFreeCollator(attention_mask=mask)):
            inputs = collate(samples).model_inputs()
            assert set(inputs) == base  # a 0/1 mask would switch transformers' packed detection off
            assert inputs["use_cache"] is False
            assert isinstance(inputs["max_length_q"], int) and inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"]
    batch = packed_collate_fn(5, attention_mask="segments", seq_idx=True, shift_labels=True)(samples)
    inputs = batch.model_inputs()
    assert set(inputs) == base | {"attention_mask", "seq_idx", "shift_labels"}
    assert inputs["attention_mask"].max() == 2  # segment ids, for models configured to read them
    assert set(batch.model_inputs(include_labels=False, flash_kwargs=False, use_cache=None)) == {
        "input_ids", "position_ids", "attention_mask", "seq_idx"}


def test_flash_kwargs_match_transformers_on_padded_rows():
    rng = np.random.default_rng(0)
    samples = [rng.integers(0, 100, int(n)).tolist() for n in rng.integers(1, 50, 40)]
    batch = packed_collate_fn(64, pad_to_multiple_of=16)(samples)
    assert batch.batch_size > 1 and batch.num_padding > 0
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch.position_ids)
    inputs = batch.model_inputs()
    assert torch.equal(inputs["cu_seq_lens_q"], cu_q) and torch.equal(inputs["cu_seq_lens_k"], cu_k)
    assert inputs["max_length_q"] == int(max_q) == inputs["max_length_k"] == int(max_k)
    # every row starts a segment of the flattened stream, and each padding tail is one segment of its own
    starts = set(inputs["cu_seq_lens_q"].tolist())
    assert all(r * batch.seq_len in starts for r in range(batch.batch_size))
    seg = layout.lengths_to_segment_ids(batch.seq_lens, batch.seqs_per_row, batch.seq_len)
    padded_rows = int((seg[:, -1] == 0).sum())
    assert padded_rows > 0 and len(starts) - 1 == batch.num_sequences + padded_rows  # - 1: the end offset


# ---- transformers' DataCollatorWithFlattening ------------------------------------------------------------------------


def test_padding_free_collator_matches_data_collator_with_flattening():
    from transformers import DataCollatorWithFlattening

    rng = np.random.default_rng(1)
    plain = [{"input_ids": rng.integers(0, 100, int(n)).tolist()} for n in rng.integers(1, 30, 9)]
    labelled = [dict(s, labels=[t if rng.random() < 0.5 else -100 for t in s["input_ids"]]) for s in plain]
    for samples in (plain, labelled):
        hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(samples)
        ours = PaddingFreeCollator(seq_idx=True)(samples)
        inputs = ours.model_inputs()
        for key in ("input_ids", "position_ids", "labels", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k"):
            assert torch.equal(inputs[key], hf[key]), key
            assert inputs[key].dtype == hf[key].dtype, key
        assert inputs["max_length_q"] == hf["max_length_q"] and inputs["max_length_k"] == hf["max_length_k"]
        assert torch.equal(ours.cu_seqlens, hf["cu_seq_lens_q"])
    # an empty sample is a fault of the data (transformers < 5.24 misaligned every later label on it): refused
    with pytest.raises(InvalidTokensError, match=r"samples\[1\]\['input_ids'\] has no tokens"):
        PaddingFreeCollator()([{"input_ids": [1, 2]}, {"input_ids": []}, {"input_ids": [3, 4]}])


# ---- DataLoader over real text --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_samples():
    from padfree.corpus import load_tokenizer

    records = gsm8k_records(256)
    tok = load_tokenizer()
    prompts = tok([r["instruction"] + "\n" for r in records], add_special_tokens=False)["input_ids"]
    answers = tok([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    samples = []
    for p, a in zip(prompts, answers, strict=True):
        ids = [tok.bos_token_id, *p, *a, tok.eos_token_id]
        samples.append({"input_ids": ids, "labels": [-100] * (1 + len(p)) + [*a, tok.eos_token_id]})
    return samples


def test_dataloader_with_workers_over_gsm8k(gsm8k_samples):
    capacity = 512
    collate = packed_collate_fn(capacity, strategy="ffs", seed=3, shift_labels=True)
    loader = torch.utils.data.DataLoader(gsm8k_samples, batch_size=32, num_workers=2, collate_fn=collate)
    seen = []
    first_pass = []
    for k, batch in enumerate(loader):
        assert isinstance(batch, PackedBatch) and batch.seq_len == capacity
        _check_structure(batch)
        chunk = gsm8k_samples[32 * k : 32 * (k + 1)]
        _check_segments(batch, chunk, capacity)
        seen.extend(32 * k + i for i in batch.sequence_ids.tolist())
        first_pass.append(batch.input_ids)
        assert batch.num_tokens == sum(len(s["input_ids"]) for s in chunk)
    assert sorted(seen) == list(range(len(gsm8k_samples)))
    # reproducible for a fixed seed and worker count; the calls draw different shuffles
    again = [b.input_ids for b in torch.utils.data.DataLoader(gsm8k_samples, batch_size=32, num_workers=2,
                                                               collate_fn=collate)]
    assert all(torch.equal(a, b) for a, b in zip(first_pass, again, strict=True))
    # every call draws its own shuffle: the same samples three times, three different packings
    orders = {tuple(collate(gsm8k_samples[:32]).sequence_ids.tolist()) for _ in range(3)}
    assert len(orders) == 3
    # Trainer-style: a plain dict of model kwargs
    dict_loader = torch.utils.data.DataLoader(gsm8k_samples[:64], batch_size=32, num_workers=2,
                                              collate_fn=PaddingFreeCollator(return_dict=True))
    for inputs in dict_loader:
        assert type(inputs) is dict and inputs["input_ids"].shape[0] == 1 and "attention_mask" not in inputs


def test_collators_pickle():
    for collate in (packed_collate_fn(16, "ffs", seed=1, attention_mask="segments"), PaddingFreeCollator(seq_idx=True)):
        clone = pickle.loads(pickle.dumps(collate))
        a, b = collate([[1, 2, 3], [4, 5]]), clone([[1, 2, 3], [4, 5]])
        assert torch.equal(a.input_ids, b.input_ids) and repr(collate) == repr(clone)
    assert isinstance(packed_collate_fn(8), PackedCollator)


# ---- a tiny model: packed == alone ----------------------------------------------------------------------------------


def _varlen_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What flash_attn_varlen_func computes, in plain torch: causal attention inside each segment of the flattened
    (B·T) stream that ``cu_seq_lens_q`` describes, nothing across. It sees no mask and no position_ids."""
    cu = kwargs["cu_seq_lens_q"]
    assert attention_mask is None and torch.equal(cu, kwargs["cu_seq_lens_k"]) and cu.dtype == torch.int32
    assert kwargs["max_length_q"] == int(torch.diff(cu).max())
    batch, heads, seq, dim = query.shape
    group = heads // key.shape[1]
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)
    k = key.repeat_interleave(group, dim=1).transpose(1, 2).reshape(batch * seq, heads, dim)
    v = value.repeat_interleave(group, dim=1).transpose(1, 2).reshape(batch * seq, heads, dim)
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(cu.tolist()):
        seg = [t[a:b].transpose(0, 1) for t in (q, k, v)]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(*seg, is_causal=True, scale=scaling).transpose(0, 1)
    return out.reshape(batch, seq, heads, dim), None


@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen_reference"])
def test_tiny_llama_packed_forward_is_exact(attn):
    transformers.AttentionInterface.register("varlen_reference", _varlen_reference)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      attn_implementation=attn)
    assert config.use_cache  # the default that would switch packed detection off; model_inputs passes use_cache=False
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(2)
    samples = []
    for n in rng.integers(2, 30, 10):
        ids = rng.integers(0, 96, int(n)).tolist()
        samples.append({"input_ids": ids, "labels": [-100] * (int(n) // 3) + ids[int(n) // 3 :]})
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = [model(input_ids=torch.tensor([s["input_ids"]]), use_cache=False).logits[0] for s in samples]
        model.set_attn_implementation(attn)
        token_losses = []
        for s, logits in zip(samples, alone, strict=True):
            target = torch.tensor(s["labels"][1:])
            losses = torch.nn.functional.cross_entropy(logits[:-1], target, reduction="none")
            token_losses.append(losses[target != -100])
        want_loss = torch.cat(token_losses).mean()
        # pad_to=56 > capacity: every row ends in padding, so a wrong offset convention would misalign the rows
        for collate in (packed_collate_fn(40, pad_to=56), packed_collate_fn(48, shift_labels=True),
                        PaddingFreeCollator()):
            batch = collate(samples)
            assert batch.num_sequences == len(samples)
            out = model(**batch.model_inputs())
            flat = batch.unpad(out.logits)
            cu = batch.cu_seqlens.tolist()
            for j, sid in enumerate(batch.sequence_ids.tolist()):
                torch.testing.assert_close(flat[cu[j] : cu[j + 1]], alone[sid], rtol=0, atol=1e-5)
            torch.testing.assert_close(out.loss, want_loss, rtol=0, atol=1e-5)


# ---- bad input: one clear error naming the culprit ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "error", "match"),
    [
        ([{"input_ids": [1, 2]}, {"ids": [3]}], InvalidSampleError,
         r"samples\[1\] is a dict without 'input_ids' \(keys: \['ids'\]"),
        ([{"input_ids": [1, 2]}, {"input_ids": [3, 4.5]}], InvalidTokensError,
         r"samples\[1\]\['input_ids'\]\[1\] = 4.5 \(type float\) is not an integer token id"),
        ([[1, 2], ["a", 3]], InvalidTokensError, r"samples\[1\]\[0\] = 'a' \(type str\) is not an integer"),
        ([[1, 2], [True, False]], InvalidTokensError, r"samples\[1\]\[0\] = True \(type bool\)"),
        ([{"input_ids": torch.tensor([1.0, 2.0])}], InvalidTokensError,
         r"samples\[0\]\['input_ids'\] must hold integer token ids, got dtype float32 \(first value 1.0"),
        ([[1, 2], np.array([True, False])], InvalidTokensError,
         r"samples\[1\] holds booleans .*not integer token ids"),
        ([[1, 2], (3, None)], InvalidTokensError, r"samples\[1\]\[1\] = None \(type NoneType\) is not an integer"),
        ([[[1, 2]]], InvalidTokensError, r"samples\[0\]\[0\] = \[1, 2\] \(type list\) is not an integer token id"),
        ([[1, 2**64]], InvalidTokensError, r"samples\[0\]\[1\] = 18446744073709551616 does not fit int64"),
        ([np.array([2**63], np.uint64)], InvalidTokensError, r"samples\[0\]\[0\] = 9223372036854775808 does not fit"),
        ([{"input_ids": [1], "labels": [0.5]}], InvalidTokensError, r"samples\[0\]\['labels'\]\[0\] = 0.5"),
        ([{"input_ids": [1, 2]}, {"input_ids": []}], InvalidTokensError, r"samples\[1\]\['input_ids'\] has no tokens"),
        ([[1, 2], torch.zeros(0, dtype=torch.long)], InvalidSampleError, r"samples\[1\] has no tokens"),
        ([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3, 4], "labels": [4]}], InvalidTokensError,
         r"samples\[1\]\['labels'\] has 1 entries but its input_ids has 2 tokens"),
        ([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [3]}], InvalidTokensError,
         r"samples\[0\] has 'labels' but samples\[1\] has none"),
        ([{"input_ids": [1, 2]}, [3]], InvalidSampleError,
         r"samples\[1\] is \[3\] .*but samples\[0\] is \{'input_ids'"),
        ([[1, 2], {"input_ids": [3]}], InvalidSampleError,
         r"samples\[1\] is \{'input_ids': \[3\]\} .* but samples\[0\] is \[1, 2\]"),
        ([[1, -2]], InvalidTokensError, r"samples\[0\]\[1\] = -2 is negative"),
        ([{"input_ids": torch.tensor([[1, 2]])}], InvalidTokensError,
         r"must be 1-D \(one sequence of token ids\), got shape \(1, 2\)"),
        ([[1, 2], "hello"], InvalidSampleError, r"samples\[1\] is text \('hello'.*tokenize it first"),
        ([], InvalidSampleError, "samples is empty; a batch needs at least one sample"),
        ({"input_ids": [[1, 2]]}, InvalidSampleError, "samples must be a list of samples"),
        ([[1, 2], torch.tensor([3, -4])], InvalidTokensError, r"samples\[1\]\[1\] = -4 is negative"),
    ],
)
def test_bad_samples_name_the_culprit(samples, error, match):
    for collate in (packed_collate_fn(8), PaddingFreeCollator()):
        with pytest.raises(error, match=match):
            collate(samples)


def test_overlong_and_bad_options():
    with pytest.raises(OverlongSequenceError, match=r"samples\[1\] has 9 tokens, more than capacity=8"):
        packed_collate_fn(8)([[1], list(range(9))])
    with pytest.raises(OverlongSequenceError, match="more than max_tokens=4"):
        PaddingFreeCollator(max_tokens=4)([[1, 2, 3], [4, 5]])
    bad = [
        (lambda: packed_collate_fn(0), "capacity must be"),
        (lambda: packed_collate_fn(8, strategy="best"), "strategy must be one of"),
        (lambda: packed_collate_fn(8, overlong="cut"), "overlong must be one of"),
        (lambda: packed_collate_fn(8, pad_to=4), r"pad_to must be 'capacity', 'longest' or a row length in \[8 "
                                                 r"\(capacity\), 67108864\], got 4"),
        (lambda: packed_collate_fn(8, pad_to_multiple_of=0), "pad_to_multiple_of must be an integer >= 1"),
        (lambda: packed_collate_fn(8, attention_mask="causal"), "attention_mask must be one of 'binary', 'segments'"),
        (lambda: packed_collate_fn(8, padding_value=0.5), "padding_value must be an integer"),
        (lambda: PaddingFreeCollator(label_padding_value="x"), "label_padding_value must be an integer"),
        (lambda: pack_result_to_tensors(pack_sequences([2], 4), [[1, 2]], padding_value=None),
         "padding_value must be an integer"),
    ]
    for make, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            make()
    with pytest.raises(InvalidTokensError, match=r"token_ids\[0\] has 3 tokens but the plan says lengths\[0\] = 2"):
        pack_result_to_tensors(pack_sequences([2], 4), [[1, 2, 3]])
    assert issubclass(InvalidTokensError, PadfreeError)


def test_hf_trainer_takes_return_dict_collators(tmp_path):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, 64, int(n)).tolist()} for n in rng.integers(2, 30, 32)]
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=16, max_steps=2, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)
    for collate in (packed_collate_fn(64, return_dict=True, shift_labels=True), PaddingFreeCollator(return_dict=True)):
        out = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate).train()
        assert np.isfinite(out.training_loss)
    # the batch object itself is not a dict: the Trainer's first question gets a clear answer
    batch = packed_collate_fn(64)(data[:4])
    for probe in (lambda: "labels" in batch, lambda: dict(batch)):
        with pytest.raises(TypeError, match="return_dict=True"):
            probe()


def test_already_packed_rows_keep_every_boundary_inside_them():
    from padfree.data.datasets import PackingDataset

    rng = np.random.default_rng(4)
    seqs = [rng.integers(1, 500, int(n)).tolist() for n in rng.integers(1, 40, 60)]
    rows = [row for row in PackingDataset(seqs, max_length=64, shuffle=False)]
    inner = np.concatenate([row["seq_lens"].numpy() for row in rows])
    flat = PaddingFreeCollator()(rows[:5])
    assert flat.seq_lens.tolist() == np.concatenate([r["seq_lens"].numpy() for r in rows[:5]]).tolist()
    starts = np.concatenate(([0], np.cumsum(flat.seq_lens.numpy())[:-1]))
    assert (flat.position_ids[0, starts] == 0).all()
    assert (flat.labels[0, starts] == -100).all()
    # re-packing packed rows packs their sequences, never a row as one sequence
    repacked = packed_collate_fn(64)(rows)
    assert sorted(repacked.seq_lens.tolist()) == sorted(inner.tolist())
    # a sample without boundaries next to packed rows is one sequence of its own
    mixed = PaddingFreeCollator()([rows[0], {"input_ids": [1, 2], "labels": [1, 2]}])
    assert mixed.seq_lens.tolist() == [*rows[0]["seq_lens"].tolist(), 2]
    bad = dict(rows[0], seq_lens=[1])
    with pytest.raises(InvalidLayoutError, match=r"samples\[0\]\['seq_lens'\] = \[1\] must be lengths >= 1 summing"):
        PaddingFreeCollator()([bad])


@pytest.mark.parametrize("collate", [PaddingFreeCollator(), packed_collate_fn(16)], ids=["padding_free", "packed"])
def test_rows_packed_elsewhere_keep_their_boundaries_whatever_the_spelling(collate):
    """A row packed by TRL (``seq_lengths``), by padfree under TRL's column name, or carrying restarting
    ``position_ids`` only, is cut into its sequences: positions restart, no first token is a target, and the same
    check that reads the boundaries catches a collator that ignores them (one sequence per row)."""
    ids = [11, 12, 13, 14, 21, 22, 31, 32, 33, 41]
    want_pos, want_starts = [0, 1, 2, 3, 0, 1, 0, 1, 2, 0], [0, 4, 6, 9]
    trl_row = pack_dataset([ids[:4], ids[4:6], ids[6:9], ids[9:]], 16, padding=None,
                           columns={"input_ids": "input_ids", "seq_lens": "seq_lengths"})[0]
    spellings = [
        {"input_ids": ids, "seq_lengths": [4, 2, 3, 1]},
        {"input_ids": ids, "position_ids": want_pos},
        {"input_ids": ids, "seq_lens": [4, 2, 3, 1], "position_ids": want_pos},
    ]
    assert sorted(trl_row["seq_lengths"]) == [1, 2, 3, 4]
    for sample in [*spellings, trl_row]:
        batch = collate([sample])
        starts = batch.cu_seqlens[:-1].tolist()
        assert sorted(batch.seq_lens.tolist()) == [1, 2, 3, 4], sample
        assert (batch.position_ids.flatten()[starts] == 0).all() and (batch.labels.flatten()[starts] == -100).all()
        if sample is not trl_row and collate.__class__ is PaddingFreeCollator:
            assert batch.position_ids[0].tolist() == want_pos and starts == want_starts
    # negative control: the same row without its boundaries is one sequence, which the checks above reject
    glued = collate([{"input_ids": ids}])
    assert glued.seq_lens.tolist() == [10] and glued.position_ids.flatten()[:10].tolist() != want_pos
    for bad, match in [({"position_ids": [0, 1, 5, 0, 1, 0, 1, 2, 0, 1]}, r"\['position_ids'\] = .* follows 1"),
                       ({"position_ids": want_pos, "seq_lens": [5, 1, 3, 1]}, "disagree on where the sequences"),
                       ({"position_ids": want_pos[:9]}, "has 9 entries but the sample has 10 tokens"),
                       ({"seq_lengths": [4, 4]}, r"\['seq_lengths'\] = \[4, 4\] must be lengths >= 1 summing")]:
        with pytest.raises(InvalidLayoutError, match=match):
            collate([{"input_ids": ids, **bad}])


# ---- every spelling of a row's boundaries, in every collator -------------------------------------------------------

ROW = [11, 12, 13, 14, 21, 22, 31, 32, 33, 41]
ROW_LABELS = [11, -100, 13, 14, 21, 22, -100, 32, 33, 41]
ROW_POSITIONS = [0, 1, 2, 3, 0, 1, 0, 1, 2, 0]
PIECES = [{"input_ids": ROW[a:b], "labels": ROW_LABELS[a:b]} for a, b in itertools.pairwise([0, 4, 6, 9, 10])]
SPELLINGS = {
    "seq_lens": {"seq_lens": [4, 2, 3, 1]},
    "seq_lengths": {"seq_lengths": np.array([4, 2, 3, 1])},
    "cu_seq_lens": {"cu_seq_lens": [0, 4, 6, 9, 10]},
    "cu_seqlens": {"cu_seqlens": torch.tensor([0, 4, 6, 9, 10], dtype=torch.int32)},
    "position_ids": {"position_ids": ROW_POSITIONS},
    "segment_mask": {"attention_mask": [1, 1, 1, 1, 2, 2, 3, 3, 3, 4]},
    "segment_mask_tensor": {"attention_mask": torch.tensor([1, 1, 1, 1, 2, 2, 3, 3, 3, 4])},
}
SPELLINGS["all_together"] = {k: v for spelling in SPELLINGS.values() for k, v in spelling.items()}
# a plain sample beside the row: a 0/1 mask of ones marks no boundary, it is one sequence
PLAIN = {"input_ids": [51, 52, 53], "labels": [51, 52, 53], "attention_mask": [1, 1, 1]}
BOTH_COLLATORS = pytest.mark.parametrize("collate", [PaddingFreeCollator(), packed_collate_fn(6)],
                                         ids=["padding_free", "packed"])


@BOTH_COLLATORS
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_every_boundary_spelling_cuts_the_row_into_its_sequences(collate, spelling):
    batch = collate([PLAIN, {"input_ids": ROW, "labels": ROW_LABELS, **SPELLINGS[spelling]}])
    _check_structure(batch)
    # every sequence back token for token, positions restarting, its first token no target (sequence_ids count
    # the sequences of the batch: the plain sample, then the four of the row)
    _check_segments(batch, [PLAIN, *PIECES], 6)
    if isinstance(collate, PaddingFreeCollator):
        assert batch.position_ids[0].tolist() == [0, 1, 2, *ROW_POSITIONS]
        assert batch.cu_seqlens.tolist() == [0, 3, 7, 9, 12, 13]
        assert batch.labels[0].tolist() == [-100, 52, 53, -100, -100, 13, 14, -100, 22, -100, 32, 33, -100]


@pytest.mark.parametrize("collate", [PaddingFreeCollator(), packed_collate_fn(16)], ids=["padding_free", "packed"])
@pytest.mark.parametrize("bare", [{}, {"attention_mask": [1] * 10}, {"attention_mask": torch.ones(10, dtype=bool)}],
                         ids=["nothing", "ones", "bool_ones"])
def test_negative_control_a_row_without_boundaries_is_one_sequence_and_the_checks_catch_it(collate, bare):
    batch = collate([{"input_ids": ROW, "labels": ROW_LABELS, **bare}])
    assert batch.seq_lens.tolist() == [10] and batch.position_ids[0, :10].tolist() == list(range(10))
    with pytest.raises(AssertionError):
        _check_segments(batch, PIECES, 16)


@BOTH_COLLATORS
@pytest.mark.parametrize(("fields", "match"), [
    ({"seq_lens": [4, 2, 3, 1], "cu_seqlens": [0, 4, 6, 8, 10]},
     r"samples\[1\]\['seq_lens'\] and samples\[1\]\['cu_seqlens'\] disagree on where the sequences of the row start "
     r"\(\[4, 2, 3, 1\] vs \[4, 2, 2, 2\]\)"),
    ({"position_ids": ROW_POSITIONS, "attention_mask": [1, 1, 1, 1, 2, 2, 2, 3, 3, 4]},
     r"samples\[1\]\['position_ids'\] and samples\[1\]\['attention_mask'\] disagree"),
    ({"seq_lengths": [4, 2, 3, 1], "cu_seq_lens": [0, 10]}, r"\['seq_lengths'\] and samples\[1\]\['cu_seq_lens'\]"),
    ({"cu_seq_lens": [0, 4, 6, 9]}, r"samples\[1\]\['cu_seq_lens'\] = \[0, 4, 6, 9\] .*must be offsets from 0 to the "
                                    r"sample's 10 tokens, strictly increasing"),
    ({"cu_seqlens": [1, 4, 6, 9, 10]}, r"\['cu_seqlens'\] = \[1, 4, 6, 9, 10\] .*must be offsets from 0"),
    ({"cu_seqlens": [0, 4, 4, 9, 10]}, r"\['cu_seqlens'\] = \[0, 4, 4, 9, 10\] .*strictly increasing"),
    ({"cu_seqlens": [0]}, r"\['cu_seqlens'\] = \[0\] .*must be offsets from 0 to the sample's 10 tokens"),
    ({"cu_seq_lens": []}, r"\['cu_seq_lens'\] = \[\] .*must be offsets from 0 to the sample's 10 tokens"),
    ({"cu_seqlens": [0.0, 10.0]}, r"\['cu_seqlens'\] = .* must be a 1-D sequence of integers, got dtype float64"),
    ({"attention_mask": [1, 1, 1, 1, 2, 2, 3, 3, 3, 0]},
     r"samples\[1\]\['attention_mask'\]\[9\] = 0 marks padding, but a sample holds no padding"),
    ({"attention_mask": [1] * 8 + [0, 0]}, r"\['attention_mask'\]\[8\] = 0 marks padding"),
    ({"attention_mask": np.array([True] * 9 + [False])}, r"\['attention_mask'\]\[9\] = 0 marks padding"),
    ({"attention_mask": [-1] + [1] * 9}, r"\['attention_mask'\]\[0\] = -1 is negative"),
    ({"attention_mask": [1, 1, 2, 2, 1, 1, 3, 3, 3, 4]},
     r"\['attention_mask'\] = .* is not a segment mask \(segment_ids\[0, 4\] = 1 follows 2\)"),
    ({"attention_mask": [2] * 10}, r"is not a segment mask \(segment_ids\[0, 0\] = 2, but the first sequence"),
    ({"attention_mask": [1] * 9}, r"\['attention_mask'\] = .* has 9 entries but the sample has 10 tokens"),
    ({"seq_lens": "4231"}, r"\['seq_lens'\] = '4231' .* must be a 1-D sequence of integers, got type str"),
])
def test_boundary_spellings_that_are_wrong_or_disagree_are_refused_by_name(collate, fields, match):
    with pytest.raises(InvalidLayoutError, match=match):
        collate([PLAIN, {"input_ids": ROW, "labels": ROW_LABELS, **fields}])


def test_padding_to_a_multiple_leaves_the_logits_of_the_real_tokens_unchanged():
    """PaddingFreeCollator(pad_to_multiple_of=...) pads the one row with a tail that is a sequence of its own: a
    configured tiny llama gives the real tokens the logits (and the loss) of the unpadded row."""
    from padfree import configure_packing
    from zoo import sequences, tiny_model

    model = tiny_model("llama").eval()
    configure_packing(model)
    samples = [{"input_ids": s} for s in sequences([9, 8, 6, 1, 5])]
    plain, padded = PaddingFreeCollator()(samples), PaddingFreeCollator(pad_to_multiple_of=16)(samples)
    assert (plain.seq_len, padded.seq_len) == (29, 32)
    assert padded.position_ids[0, 29:].tolist() == [0, 1, 2] and padded.labels[0, 29:].eq(-100).all()
    with torch.no_grad():
        want, got = model(**plain.model_inputs()), model(**padded.model_inputs())
        torch.testing.assert_close(got.logits[0, :29], want.logits[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=1e-6)
        # negative control: the same comparison sees what boundaries change (the row run as one sequence)
        glued = model(input_ids=plain.input_ids, use_cache=False).logits[0]
    assert (glued - want.logits[0]).abs().max() > 1e-3


def test_per_row_cu_seqlens_are_the_flat_offsets_cut_at_the_rows():
    """SeqPacker's per-row ``cu_seqlens``: row r's offsets, from 0 to its real tokens, are the flat offsets of the
    batch cut at the rows' edges and restarted; every row's sequences are exactly its ``seq_lens``."""
    rng = np.random.default_rng(11)
    seqs = [rng.integers(1, 50, int(n)).tolist() for n in rng.integers(1, 30, 40)]
    batch = pack_result_to_tensors(pack_sequences([len(s) for s in seqs], 48), seqs, pad_to_multiple_of=16)
    per_row = batch.cu_seqlens_per_row
    assert len(per_row) == batch.batch_size and all(c.dtype == torch.int32 and c[0] == 0 for c in per_row)
    ends = np.cumsum(batch.seqs_per_row.numpy())
    flat = batch.cu_seqlens.numpy()
    for r, cu in enumerate(per_row):
        start = ends[r] - batch.seqs_per_row[r].item()
        assert np.array_equal(cu.numpy(), flat[start:ends[r] + 1] - flat[start])
        assert int(cu[-1]) == int((batch.position_ids[r] >= 0).sum()) - (batch.seq_len - int(cu[-1]))


def test_labels_are_token_ids_or_an_ignored_label_and_tokens_are_never_bools():
    collate = packed_collate_fn(8)
    with pytest.raises(InvalidTokensError, match=r"samples\[1\]\['labels'\]\[1\] = -7 is not a label: a label is a "
                                                 r"token id >= 0 or the ignored label -100"):
        collate([{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [1, 2, 3], "labels": [-100, -7, 2]}])
    # a collator with another label_padding_value also takes that one as "no target"
    own = packed_collate_fn(8, label_padding_value=-1)
    assert own([{"input_ids": [1, 2, 3], "labels": [-1, -100, 3]}]).labels.tolist() == [[-1, -100, 3, -1, -1, -1,
                                                                                         -1, -1]]
    with pytest.raises(InvalidTokensError, match=r"= -5 is not a label: .* ignored label -100 or -1"):
        own([{"input_ids": [1, 2, 3], "labels": [-1, -5, 3]}])
    for make in (lambda: [[5, True, 7]], lambda: [torch.tensor([5, 6]), [7, False]]):
        with pytest.raises(InvalidTokensError, match=r"= (True|False) \(type bool\) is not an integer token id"):
            PaddingFreeCollator()(make())
    # ids 0 and 1 are ordinary tokens (padding, BOS): only a bool is refused
    assert PaddingFreeCollator()([[1, 0, 1], [0]]).input_ids.tolist() == [[1, 0, 1, 0]]


def test_row_lengths_are_bounded_before_anything_is_allocated_and_real_roundings_still_work():
    plan = pack_sequences([3, 2, 2], 4)
    ids = [[1, 2, 3], [4, 5], [6, 7]]
    # what users pass: a row length above the capacity, a rounding for tensor cores
    assert pack_result_to_tensors(plan, ids, pad_to=100, pad_to_multiple_of=64).input_ids.shape == (2, 128)
    assert packed_collate_fn(100, pad_to=128)(ids).input_ids.shape == (1, 128)
    assert PaddingFreeCollator(pad_to_multiple_of=128)(ids).input_ids.shape == (1, 128)
    for call in (lambda: packed_collate_fn(8, pad_to=2**40), lambda: packed_collate_fn(8, pad_to_multiple_of=2**40),
                 lambda: pack_result_to_tensors(plan, ids, pad_to=2**40),
                 lambda: pack_result_to_tensors(plan, ids, pad_to=2**26, pad_to_multiple_of=2**26 - 1)):
        with pytest.raises(InvalidArgumentError, match=r"67108864"):
            call()
    # within a row's bound, but more positions than int32 flash-attn offsets index: refused before the padding
    many = pack_sequences([1] * 64, 1)
    with pytest.raises(InvalidArgumentError, match=r"64 rows x 67108864 tokens .* more than int32 flash-attn"):
        pack_result_to_tensors(many, [[1]] * 64, pad_to=2**26)


def test_a_device_torch_cannot_parse_or_reach_is_named():
    plan = pack_sequences([3], 4)
    assert pack_result_to_tensors(plan, [[1, 2, 3]], device="cpu").device == torch.device("cpu")
    assert pack_result_to_tensors(plan, [[1, 2, 3]], device=torch.device("cpu")).to("meta").device.type == "meta"
    with pytest.raises(InvalidArgumentError, match=r"device must be None, a torch.device, .* got 'nonexistent'"):
        pack_result_to_tensors(plan, [[1, 2, 3]], device="nonexistent")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgumentError, match=r"device='cuda' is not usable on this machine"):
            pack_result_to_tensors(plan, [[1, 2, 3]], device="cuda")


def _batch_lists(batch: PackedBatch) -> dict:
    return {k: getattr(batch, k).tolist() for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_lens",
                                                    "sequence_ids") } | {
        "attention_mask": None if batch.attention_mask is None else batch.attention_mask.tolist()}


@pytest.mark.parametrize("strategy", ["obfd", "ffs", "wrapped"])
def test_the_collator_gives_the_same_batch_through_its_options_objects_on_real_text(strategy):
    from padfree import PackingSpec, RowSpec

    records = gsm8k_records(64)
    from padfree.corpus import load_tokenizer

    tok = load_tokenizer()
    samples = [{"input_ids": ids} for ids in tok([r["output"] for r in records], add_special_tokens=False)["input_ids"]]
    overlong = "split" if strategy == "wrapped" else "truncate"
    by_objects = packed_collate_fn(
        spec=PackingSpec(128, strategy, seed=1, overlong=overlong),
        rows=RowSpec(padding="longest", pad_to_multiple_of=16, padding_value=tok.eos_token_id,
                     label_padding_value=-1, attention_mask="segments"))
    by_keywords = packed_collate_fn(128, strategy, 1, tok.eos_token_id, -1, overlong=overlong, pad_to="longest",
                                    pad_to_multiple_of=16, attention_mask="segments")
    a, b = by_objects(samples), by_keywords(samples)
    assert a.input_ids.shape[0] > 1 and _batch_lists(a) == _batch_lists(b)


def test_the_collator_names_its_own_keyword_when_a_setting_is_given_both_ways():
    from padfree import PackingSpec, RowSpec

    with pytest.raises(InvalidArgumentError, match=r"pad_to='longest' is given both as a keyword and in rows "
                                                   r"\(rows\.padding='capacity'\)"):
        packed_collate_fn(8, rows=RowSpec(), pad_to="longest")
    with pytest.raises(InvalidArgumentError, match=r"attention_mask='binary' is given both as a keyword and in rows"):
        PackedCollator(8, rows=RowSpec(), attention_mask="binary")
    with pytest.raises(InvalidArgumentError, match=r"seed=3 is given both as a keyword and in spec"):
        packed_collate_fn(seed=3, spec=PackingSpec(8))
    with pytest.raises(InvalidArgumentError, match=r"pad_to must be 'capacity', 'longest' or a row length"):
        packed_collate_fn(spec=PackingSpec(8), rows=RowSpec(padding=None))  # a collator pads its rows
