"""pack_dataset: every sequence back exactly once from the Arrow rows, real text, indices mappings, label masks,
bad inputs, chunking that never changes the result, and bounded memory on a memory-mapped dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import (
    DataLoadError,
    InvalidArgumentError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
    PackingSpec,
    PadfreeError,
    RowSpec,
    pack_sequences,
)
from padfree.data.hf import COLUMNS, DEFAULT_COLUMNS, pack_dataset, pack_dataset_from_result, plan_dataset
from padfree.rows import packed_rows
from realdata import gsm8k_records

ALL = list(COLUMNS)
_PLANNING = ("capacity", "strategy", "seed")


def pack_with_plan(data, *args, **kwargs):
    """``pack_dataset(data, *args, **kwargs)`` and :func:`plan_dataset` of the same packing settings."""
    planning = dict(zip(_PLANNING, args, strict=False))
    planning |= {k: kwargs[k] for k in ("overlong", "max_sequences_per_bin") if k in kwargs}
    return pack_dataset(data, *args, **kwargs), plan_dataset(data, **planning)

datasets.disable_progress_bars()


def unpack(ds: datasets.Dataset, label_pad: int = -100) -> dict[int, list[tuple[int, list[int], list[int]]]]:
    """Cut every row of ``ds`` (written with every column) back into its pieces, checking each row's layout.

    Returns ``{sequence id: [(index of the piece in the plan, tokens, labels), ...]}``.
    """
    rows = ds[:]
    piece = 0
    out: dict[int, list[tuple[int, list[int], list[int]]]] = {}
    for r in range(len(ds)):
        ids, labels = rows["input_ids"][r], rows["labels"][r]
        pos, lens, seqs = rows["position_ids"][r], rows["seq_lens"][r], rows["sequence_ids"][r]
        mask = rows["attention_mask"][r] if "attention_mask" in rows else None
        assert len(ids) == len(labels) == len(pos)
        assert len(lens) == len(seqs) >= 1
        a = 0
        for k, (n, seq) in enumerate(zip(lens, seqs, strict=True)):
            assert n >= 1
            assert pos[a : a + n] == list(range(n))
            assert labels[a] == label_pad  # no token is predicted across a boundary
            if mask is not None:
                assert set(mask[a : a + n]) <= {1, k + 1}
            out.setdefault(seq, []).append((piece, ids[a : a + n], labels[a : a + n]))
            a += n
            piece += 1
        tail = len(ids) - a  # the padding tail: one more "sequence" with positions 0, 1, ...
        assert pos[a:] == list(range(tail))
        assert labels[a:] == [label_pad] * tail
        if mask is not None:
            assert mask[a:] == [0] * tail
    return out


# --------------------------------------------------------------------------------------------------
# Round trip
# --------------------------------------------------------------------------------------------------

sequences = st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=30), min_size=0, max_size=30)


@given(seqs=sequences, capacity=st.integers(1, 40), policy=st.sampled_from(["split", "truncate", "drop"]),
       strategy=st.sampled_from(["obfd", "ffs", "nf"]), padding=st.sampled_from(["capacity", "longest", None, 64]),
       multiple=st.sampled_from([None, 1, 8]), mask=st.sampled_from(["binary", "segments"]),
       chunk=st.sampled_from([1, 5, 37, 1 << 20]), seed=st.integers(0, 9))
@settings(max_examples=120, deadline=None)
def test_every_sequence_comes_back_exactly_once(seqs, capacity, policy, strategy, padding, multiple, mask, chunk,
                                                seed):
    rng = np.random.default_rng(seed)
    labels = [[t if rng.random() < 0.7 else -100 for t in s] for s in seqs]
    if padding == 64:
        padding = max(capacity, 64)
    ds, plan = pack_with_plan(seqs, capacity, strategy, seed, overlong=policy, padding=padding,
                              pad_to_multiple_of=multiple, attention_mask=mask, columns=ALL, labels=labels,
                              chunk_tokens=chunk)
    assert len(ds) == plan.num_bins
    assert ds.column_names == ALL
    widths = [len(row) for row in ds[:]["input_ids"]]
    if padding == "capacity":
        expected = -(-capacity // (multiple or 1)) * (multiple or 1)
        assert set(widths) <= {expected}
    pieces = unpack(ds)
    dropped = set(plan.dropped.tolist())
    for i, seq in enumerate(seqs):
        if i in dropped:
            assert i not in pieces
            continue
        parts = pieces.pop(i)  # every kept sequence is there, in one piece or (split) several
        if plan.piece_starts is not None:  # put the pieces of a split sequence back in token order
            parts.sort(key=lambda part: plan.piece_starts[part[0]])
        tokens = [t for _, ids, _ in parts for t in ids]
        got_labels = [t for _, _, lab in parts for t in lab]
        if policy == "truncate":
            assert len(parts) == 1
            seq, want = seq[:capacity], labels[i][:capacity]
        else:
            want = labels[i]
        assert tokens == seq  # each piece restarts with a masked label

        starts = np.cumsum([0] + [len(ids) for _, ids, _ in parts[:-1]])
        expect_labels = list(want)
        for s in starts:
            expect_labels[s] = -100
        assert got_labels == expect_labels
    assert not pieces  # nothing invented


@given(seqs=sequences, capacity=st.integers(1, 40), mask=st.sampled_from(["binary", "segments", None]))
@settings(max_examples=60, deadline=None)
def test_same_rows_as_packed_rows_padded(seqs, capacity, mask):
    """The Arrow writer and :meth:`padfree.rows.PackedRows.padded` agree (both run :func:`padfree.rows.fill_rows`,
    one over the input, one over already packed flat rows)."""
    plan = pack_sequences([len(s) for s in seqs], capacity, overlong="split")
    ds = pack_dataset_from_result(plan, seqs, padding_value=7, attention_mask=mask, chunk_tokens=3)
    want = packed_rows(plan, seqs).padded("capacity", padding_value=7, attention_mask=mask)
    got = ds[:]
    for name in ("input_ids", "labels", "position_ids") + (("attention_mask",) if mask else ()):
        assert np.asarray(got[name], dtype=np.int64).reshape(-1, capacity).tolist() == want[name].tolist()


def test_chunk_size_and_file_never_change_the_result(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 32_000, n).tolist() for n in rng.integers(1, 300, 2_000)]
    ref = pack_dataset(seqs, 512, columns=ALL, chunk_tokens=1 << 30, num_threads=1)
    assert ref.cache_files == []  # small: in memory
    for chunk in (1, 511, 512, 4_099, 100_000, 1 << 30):
        for threads in (2, 3):  # rows of a chunk split between threads (chunks of >= 2**16 slots per thread)
            got = pack_dataset(seqs, 512, columns=ALL, chunk_tokens=chunk, num_threads=threads)
            assert got.data.table.equals(ref.data.table)
    on_disk = pack_dataset(seqs, 512, columns=ALL, chunk_tokens=4_099, cache_file_name=tmp_path / "packed.arrow")
    assert on_disk.cache_files == [{"filename": str(tmp_path / "packed.arrow")}]
    assert on_disk.data.table.equals(ref.data.table)
    temp = pack_dataset(seqs, 512, columns=ALL, chunk_tokens=4_099, keep_in_memory=False)
    assert len(temp.cache_files) == 1 and temp.data.table.equals(ref.data.table)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # written atomically, nothing left over


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    from padfree.data import _arrow_writer

    calls = []
    original = _arrow_writer._Builder.fill

    def failing(self, a, b, out):
        calls.append(a)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return original(self, a, b, out)

    monkeypatch.setattr(_arrow_writer._Builder, "fill", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pack_dataset([[1, 2, 3]] * 100, 8, chunk_tokens=16, cache_file_name=tmp_path / "out.arrow")
    assert os.listdir(tmp_path) == []


def test_chunks_are_read_through_one_view_without_copies():
    from padfree.data.hf import one_view

    arrays = [np.arange(5, dtype=np.int32), np.arange(100, 103, dtype=np.int32), np.arange(7, 9, dtype=np.int32)]
    view, first = one_view(arrays)
    assert not view.flags.writeable
    for array, start in zip(arrays, first.tolist(), strict=True):
        assert view[start : start + array.size].tolist() == array.tolist()
        assert view[start:].ctypes.data == array.ctypes.data  # the same memory, not a copy
    raw = np.zeros(64, np.uint8)
    odd = [raw[0:16].view(np.int32), raw[5:13].view(np.int32)]  # the second is not 4-byte aligned with the first
    odd[0][:] = [1, 2, 3, 4]
    view, first = one_view(odd)
    assert view[first[1] : first[1] + 2].tolist() == odd[1].tolist() and view[:4].tolist() == [1, 2, 3, 4]


def test_columns_types_and_renaming():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ds = pack_dataset(seqs, 6)
    assert ds.column_names == list(DEFAULT_COLUMNS)
    types = {f.name: str(f.type) for f in ds.data.schema}
    assert types == {"input_ids": "list<item: int32>", "attention_mask": "list<item: int8>",
                     "labels": "list<item: int32>", "position_ids": "list<item: int32>",
                     "seq_lens": "list<item: int32>"}
    seg = pack_dataset(seqs, 6, attention_mask="segments", padding=None)
    assert seg[:]["attention_mask"] == [[1, 1, 1, 1, 2, 2], [1, 1, 1]]
    assert str(seg.data.schema.field("attention_mask").type) == "list<item: int32>"
    assert pack_dataset(seqs, 6, attention_mask=None).column_names == [c for c in DEFAULT_COLUMNS
                                                                        if c != "attention_mask"]
    trl = pack_dataset(seqs, 6, padding=None, columns={"input_ids": "input_ids", "seq_lens": "seq_lengths"})
    assert trl.column_names == ["input_ids", "seq_lengths"]
    assert trl[:] == {"input_ids": [[6, 7, 8, 9, 4, 5], [1, 2, 3]], "seq_lengths": [[4, 2], [3]]}
    big = pack_dataset([[2**40, 1], [3]], 4, padding=None)
    assert str(big.data.schema.field("input_ids").type) == "list<item: int64>"
    assert big[:]["input_ids"] == [[2**40, 1, 3]]
    longest = pack_dataset(seqs, 8, padding="longest", pad_to_multiple_of=4)
    assert {len(r) for r in longest[:]["input_ids"]} == {8}
    ragged = pack_dataset(seqs, 8, padding=None, pad_to_multiple_of=4, strategy="nf")
    assert [len(r) for r in ragged[:]["input_ids"]] == [8, 4]


def test_torch_format_gives_long_tensors():
    torch = pytest.importorskip("torch")
    row = pack_dataset([[1, 2, 3], [4, 5]], 8).with_format("torch")[0]
    assert all(row[c].dtype == torch.long for c in ("input_ids", "labels", "position_ids", "attention_mask"))


def test_empty_input_gives_empty_dataset():
    ds = pack_dataset([], 16)
    assert len(ds) == 0 and ds.column_names == list(DEFAULT_COLUMNS)
    assert len(pack_dataset([], 16, keep_in_memory=False)) == 0


# --------------------------------------------------------------------------------------------------
# Datasets: memory-mapped, indices mappings, labels and masks
# --------------------------------------------------------------------------------------------------


def _dataset(n: int, seed: int = 0, **extra: list) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 32_000, k).astype(np.int32).tolist() for k in rng.integers(1, 200, n)]
    return datasets.Dataset.from_dict({"input_ids": ids, **extra})


def test_memory_mapped_dataset_with_many_chunks(tmp_path):
    src = _dataset(3_000)
    src.save_to_disk(str(tmp_path / "src"), max_shard_size="200KB")  # several files, 1,000-row batches
    ds = datasets.load_from_disk(str(tmp_path / "src"))
    assert ds.data.column("input_ids").num_chunks > 3
    packed = pack_dataset(ds, 256, columns=ALL, keep_in_memory=False)
    # written next to the input's own files, as datasets' map does
    assert os.path.dirname(packed.cache_files[0]["filename"]) == str(tmp_path / "src")
    ref = pack_dataset(src["input_ids"][:], 256, columns=ALL)
    assert packed.data.table.equals(ref.data.table)
    pieces = unpack(packed)
    assert sorted(pieces) == list(range(len(ds)))


@pytest.mark.parametrize("how", ["select", "shuffle", "sort", "filter"])
def test_indices_mapping_is_honoured(how, tmp_path):
    base = _dataset(1_500, seed=1, tag=list(range(1_500)))
    base.save_to_disk(str(tmp_path / "base"))
    base = datasets.load_from_disk(str(tmp_path / "base"))
    view = {
        "select": lambda d: d.select(np.random.default_rng(0).permutation(len(d))[:700]),
        "shuffle": lambda d: d.shuffle(seed=3),
        "sort": lambda d: d.sort("tag", reverse=True),
        "filter": lambda d: d.filter(lambda row: row["tag"] % 3 == 0),
    }[how](base)
    packed = pack_dataset(view, 300, columns=ALL, keep_in_memory=True)
    pieces = unpack(packed)
    expected = view["input_ids"][:]
    assert sorted(pieces) == list(range(len(view)))
    for i, parts in pieces.items():
        assert [t for _, ids, _ in parts for t in ids] == expected[i]
    assert packed.data.table.equals(pack_dataset(view.flatten_indices(), 300, columns=ALL).data.table)


def test_labels_column_and_trl_masks():
    ids = [[10, 11, 12, 13], [20, 21, 22]]
    with_labels = datasets.Dataset.from_dict({"input_ids": ids, "labels": [[-100, -100, 12, 13], [20, 21, 22]],
                                              "completion_mask": [[0, 0, 0, 0], [0, 0, 0]]})
    # an explicit labels column wins, as in TRL; the masks are then not applied
    assert pack_dataset(with_labels, 8, padding=None)[:]["labels"] == [[-100, -100, 12, 13, -100, 21, 22]]
    masked = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": [[0, 0, 1, 1], [0, 1, 1]]})
    assert pack_dataset(masked, 8, padding=None)[:]["labels"] == [[-100, -100, 12, 13, -100, 21, 22]]
    both = masked.add_column("assistant_masks", [[True, True, True, False], [True, True, True]])
    assert pack_dataset(both, 8, padding=None)[:]["labels"] == [[-100, -100, 12, -100, -100, 21, 22]]
    assert pack_dataset(both, 8, padding=None, label_masks=())[:]["labels"] == [[-100, 11, 12, 13, -100, 21, 22]]
    as_dict = {"input_ids": ids, "assistant_masks": [[True, False, True, True], [1, 1, 0]]}
    assert pack_dataset(as_dict, 8, padding=None)[:]["labels"] == [[-100, -100, 12, 13, -100, 21, -100]]
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int16())), "labels": [[1, 2, 3, 4], [5, 6, 7]]})
    assert pack_dataset(table, 8, padding=None)[:]["labels"] == [[-100, 2, 3, 4, -100, 6, 7]]


def test_arrow_array_inputs():
    arr = pa.array([[5, 6], [7], [8, 9, 10]], pa.large_list(pa.int64()))
    chunked = pa.chunked_array([arr.slice(0, 1), arr.slice(1, 2)])
    for data in (arr, chunked, pa.FixedSizeListArray.from_arrays(pa.array([1, 2, 3, 4, 5, 6]), 2).slice(1)):
        out = pack_dataset(data, 4, padding=None, columns=ALL)
        assert sorted(unpack(out)) == list(range(len(data)))


# --------------------------------------------------------------------------------------------------
# Real text
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k() -> datasets.Dataset:
    from padfree.corpus import load_tokenizer

    tokenizer = load_tokenizer()
    records = gsm8k_records(400)
    prompts = [f"Question: {r['instruction']}\n{r['input']}\nAnswer: ".replace("\n\n", "\n") for r in records]
    p_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tokenizer([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    ids = [[tokenizer.bos_token_id, *p, *c, tokenizer.eos_token_id] for p, c in zip(p_ids, c_ids, strict=True)]
    mask = [[0] * (1 + len(p)) + [1] * (len(c) + 1) for p, c in zip(p_ids, c_ids, strict=True)]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": mask, "text": prompts})
    ds.tokenizer = tokenizer  # type: ignore[attr-defined]
    return ds


@pytest.mark.parametrize("strategy", ["obfd", "ffs", "wrapped"])
def test_the_spec_route_writes_the_rows_of_the_keyword_route_on_real_text(gsm8k, strategy):
    overlong = "split" if strategy == "wrapped" else "error"
    spec = PackingSpec(capacity=512, strategy=strategy, seed=3, overlong=overlong)
    rows = RowSpec(padding="longest", pad_to_multiple_of=64, padding_value=gsm8k.tokenizer.eos_token_id,
                   label_padding_value=-1, attention_mask="segments")
    by_spec = pack_dataset(gsm8k, spec=spec, rows=rows, columns=ALL)
    by_keywords = pack_dataset(gsm8k, 512, strategy, 3, gsm8k.tokenizer.eos_token_id, -1, overlong=overlong,
                               padding="longest", pad_to_multiple_of=64, attention_mask="segments", columns=ALL)
    assert by_spec[:] == by_keywords[:] and len(by_spec) > 1
    plan = plan_dataset(gsm8k, spec=spec)
    assert pack_dataset_from_result(plan, gsm8k, rows=rows, columns=ALL)[:] == by_spec[:]
    assert plan.bins == plan_dataset(gsm8k, 512, strategy, 3, overlong=overlong).bins
    if strategy == "wrapped":  # full rows in input order; every cut piece a sequence of its own
        assert plan.bin_fill[:-1].tolist() == [512] * (plan.num_bins - 1)
        assert plan.piece_starts is not None and int(plan.piece_starts.max()) > 0
        assert all(sum(row) == fill for row, fill in zip(by_spec[:]["seq_lens"], plan.bin_fill.tolist(),
                                                         strict=True))


def test_a_setting_given_both_ways_is_refused_naming_both():
    data = [[1, 2, 3], [4, 5]]
    with pytest.raises(InvalidArgumentError, match=r"overlong='drop' is given both as a keyword and in spec "
                                                   r"\(spec\.overlong='split'\)"):
        pack_dataset(data, spec=PackingSpec(4, overlong="split"), overlong="drop")
    with pytest.raises(InvalidArgumentError, match=r"capacity=4 is given both as a keyword and in spec "
                                                   r"\(spec\.capacity=4\)"):
        pack_dataset(data, 4, spec=PackingSpec(4))
    with pytest.raises(InvalidArgumentError, match=r"padding=None is given both as a keyword and in rows "
                                                   r"\(rows\.padding='longest'\)"):
        pack_dataset(data, 4, rows=RowSpec(padding="longest"), padding=None)
    with pytest.raises(InvalidArgumentError, match=r"spec must be a PackingSpec or None, got"):
        plan_dataset(data, spec={"capacity": 4})
    with pytest.raises(InvalidArgumentError, match=r"rows must be a RowSpec or None, got"):
        pack_dataset_from_result(pack_sequences([3, 2], 4), data, rows=PackingSpec(4))


@pytest.mark.parametrize(("keywords", "fields"), [
    ({"capacity": 0}, {"capacity": 0}),
    ({"capacity": 4, "strategy": "best"}, {"capacity": 4, "strategy": "best"}),
    ({"capacity": 4, "seed": -1}, {"capacity": 4, "seed": -1}),
    ({"capacity": 4, "overlong": "cut"}, {"capacity": 4, "overlong": "cut"}),
    ({"capacity": 4, "max_sequences_per_bin": 0}, {"capacity": 4, "max_sequences_per_bin": 0}),
    ({"capacity": 4, "strategy": "wrapped", "overlong": "drop"}, {"capacity": 4, "strategy": "wrapped",
                                                                  "overlong": "drop"}),
    ({"capacity": 4, "padding": 0}, {"padding": 0}),
    ({"capacity": 4, "padding": "max"}, {"padding": "max"}),
    ({"capacity": 4, "pad_to_multiple_of": 0}, {"pad_to_multiple_of": 0}),
    ({"capacity": 4, "padding_value": 1.5}, {"padding_value": 1.5}),
    ({"capacity": 4, "label_padding_value": True}, {"label_padding_value": True}),
    ({"capacity": 4, "attention_mask": "causal"}, {"attention_mask": "causal"}),
])
def test_a_spec_refuses_a_bad_value_with_the_keywords_error(keywords, fields):
    with pytest.raises(InvalidArgumentError) as by_keyword:
        pack_dataset([[1, 2, 3]], **keywords)
    is_row = next(iter(fields)) in {f for f in RowSpec.__dataclass_fields__}
    with pytest.raises(InvalidArgumentError) as by_spec:
        RowSpec(**fields) if is_row else PackingSpec(**fields)
    assert str(by_spec.value) == str(by_keyword.value)


@given(seqs=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=40), min_size=1, max_size=30),
       capacity=st.integers(1, 48), strategy=st.sampled_from(["obfd", "ffd", "nf", "ffs", "hk", "wrapped"]),
       padding=st.sampled_from(["capacity", "longest", None]))
@settings(max_examples=40, deadline=None)
def test_no_token_is_lost_or_repeated_through_the_spec_route(seqs, capacity, strategy, padding):
    ds = pack_dataset(seqs, spec=PackingSpec(capacity, strategy, seed=0, overlong="split"),
                      rows=RowSpec(padding=padding), columns=["input_ids", "seq_lens", "sequence_ids"])
    rows = ds[:]
    pieces: dict[int, list[int]] = {}
    for ids, lens, seq_ids in zip(rows["input_ids"], rows["seq_lens"], rows["sequence_ids"], strict=True):
        at = 0
        for n, i in zip(lens, seq_ids, strict=True):
            pieces.setdefault(i, []).extend(ids[at:at + n])
            at += n
    # the pieces of a sequence come in the order the plan cut them; put back together, each is its sequence
    assert {i: sorted(t) for i, t in pieces.items()} == {i: sorted(s) for i, s in enumerate(seqs)}
    assert sum(map(len, pieces.values())) == sum(map(len, seqs))


@pytest.mark.parametrize("padding", ["capacity", None])
def test_real_text_round_trip(gsm8k, padding):
    tokenizer = gsm8k.tokenizer
    packed, plan = pack_with_plan(gsm8k, 1024, padding=padding, columns=ALL, padding_value=tokenizer.eos_token_id)
    assert packed.column_names == [*ALL, "completion_mask"]  # TRL's mask is carried too, not only folded in
    assert plan.efficiency > 0.95 and len(packed) == plan.num_bins < len(gsm8k) / 4
    rows = packed[:]
    if padding == "capacity":
        assert {len(r) for r in rows["input_ids"]} == {1024}
    else:
        assert [len(r) for r in rows["input_ids"]] == [sum(s) for s in rows["seq_lens"]]
    pieces = unpack(packed)
    source = gsm8k[:]
    assert sorted(pieces) == list(range(len(gsm8k)))
    for i, [(_, ids, labels)] in pieces.items():
        assert ids == source["input_ids"][i]
        # completion-only: the prompt is masked, every answer token is a target
        want = [t if m else -100 for t, m in zip(ids, source["completion_mask"][i], strict=True)]
        want[0] = -100
        assert labels == want
    for row, ids, mask in zip(rows["sequence_ids"], rows["input_ids"], rows["completion_mask"], strict=True):
        at = 0
        for seq in row:
            n = len(source["input_ids"][seq])
            assert mask[at:at + n] == source["completion_mask"][seq]
            at += n
        assert set(mask[at:]) <= {0} and len(mask) == len(ids)
    first = rows["sequence_ids"][0][0]
    text = tokenizer.decode(rows["input_ids"][0][: rows["seq_lens"][0][0]], skip_special_tokens=True)
    assert text.startswith("Question: ") and gsm8k[first]["text"].split("\n")[0][10:40] in text


# --------------------------------------------------------------------------------------------------
# Bad input: one clear error each, naming the culprit
# --------------------------------------------------------------------------------------------------


def test_plan_and_tokens_must_agree():
    plan = pack_sequences([3, 2], 4)
    with pytest.raises(InvalidTokensError, match=r"data has 3 sequences but the plan was made for 2"):
        pack_dataset_from_result(plan, [[1, 2, 3], [4, 5], [6]])
    with pytest.raises(InvalidTokensError, match=r"data\[1\] has 3 tokens but the plan says lengths\[1\] = 2"):
        pack_dataset_from_result(plan, [[1, 2, 3], [4, 5, 6]])
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]})
    with pytest.raises(InvalidTokensError, match=r"input_ids\[1\] has 1 tokens but the plan says lengths\[1\] = 2"):
        pack_dataset_from_result(plan, ds)
    with pytest.raises(InvalidArgumentError, match="result must be a PackResult"):
        pack_dataset_from_result([[0, 1]], [[1, 2, 3], [4, 5]])


def test_empty_sequences_are_refused_not_dropped():
    with pytest.raises(InvalidTokensError, match=r"data\[1\] has no tokens.*\(2 of 3 samples are empty\)"):
        pack_dataset([[1], [], []], 4)
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], []]})
    with pytest.raises(InvalidTokensError, match=r"input_ids\[2\] has no tokens.*filter the empty ones out"):
        pack_dataset(ds, 4)
    nulls = pa.table({"input_ids": pa.array([[1, 2], None], pa.list_(pa.int32()))})
    with pytest.raises(InvalidTokensError, match=r"input_ids\[1\] is null"):
        pack_dataset(nulls, 4)


def test_labels_must_match_their_tokens():
    with pytest.raises(InvalidTokensError, match=r"labels\[1\] has 1 entries but data\[1\] has 2 tokens"):
        pack_dataset([[1, 2], [3, 4]], 4, labels=[[1, 2], [3]])
    with pytest.raises(InvalidTokensError, match=r"labels has 1 rows but data has 2"):
        pack_dataset([[1, 2], [3, 4]], 4, labels=[[1, 2]])
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4, 5]], "labels": [[1, 2], [3, 4]]})
    with pytest.raises(InvalidTokensError, match=r"labels\[1\] has 2 entries but input_ids\[1\] has 3 tokens"):
        pack_dataset(ds, 4)
    shuffled = datasets.Dataset.from_dict({"input_ids": [[1], [2, 3]], "completion_mask": [[1], [1, 1, 1]]})
    with pytest.raises(InvalidTokensError, match=r"completion_mask\[0\] has 3 entries but input_ids\[0\] has 2"):
        pack_dataset(shuffled.select([1, 0]), 4)
    with pytest.raises(InvalidArgumentError, match="add a 'labels' column"):
        pack_dataset(ds, 4, labels=[[1, 2], [3, 4, 5]])


def test_token_ids_must_be_integers():
    with pytest.raises(InvalidTokensError, match=r"data\[1\]\[0\] = 2.5 .* is not an integer"):
        pack_dataset([[1, 2], [2.5]], 4)
    floats = datasets.Dataset.from_dict({"input_ids": [[1.0, 2.0]]})
    with pytest.raises(InvalidTokensError, match=r"input_ids must hold integer token ids, got Arrow type list<.*doub"):
        pack_dataset(floats, 4)
    text = datasets.Dataset.from_dict({"input_ids": ["hello"]})
    with pytest.raises(InvalidTokensError, match=r"input_ids must hold one list of integer token ids per row"):
        pack_dataset(text, 4)
    with pytest.raises(InvalidTokensError, match="data must be a sequence of token-id sequences, got 42"):
        pack_dataset(42, 4)
    # values a list or an Arrow column can hold but a token id cannot: refused, never packed as they are or wrapped
    with pytest.raises(InvalidTokensError, match=r"data\[1\]\[1\] = -5 is negative"):
        pack_dataset([[1, 2], [3, -5]], 4)
    negative = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, -5]]})
    with pytest.raises(InvalidTokensError, match=r"input_ids\[1\]\[1\] = -5 is negative"):
        pack_dataset(negative, 4)
    huge = pa.table({"input_ids": pa.array([[1, 2**63 + 1]], pa.list_(pa.uint64()))})
    with pytest.raises(InvalidTokensError, match=r"input_ids\[0\]\[1\] = 9223372036854775809 does not fit int64"):
        pack_dataset(huge, 4)
    with pytest.raises(InvalidTokensError, match=r"data\[0\]\[1\] = 9223372036854775809 does not fit int64"):
        pack_dataset([np.array([1, 2**63 + 1], np.uint64)], 4)
    with pytest.raises(InvalidArgumentError, match=r"label_padding_value must be an integer that fits int32"):
        pack_dataset([[1, 2]], 4, label_padding_value=-100.5)


def test_a_null_row_counts_only_where_it_is_selected():
    """A null input_ids row that a select/filter left out of the dataset (it stays in the stored table) is not
    read; a selected one is refused by its index in the dataset."""
    table = pa.table({"input_ids": pa.array([[1, 2], None, [3, 4, 5]], pa.list_(pa.int64()))})
    ds = datasets.Dataset(table)
    kept = ds.select([0, 2])
    assert pack_dataset(kept, 8, padding=None)[:]["input_ids"] == [[3, 4, 5, 1, 2]]
    with pytest.raises(InvalidSampleError, match=r"input_ids\[1\] is null \(1 of 3 rows are\)"):
        pack_dataset(ds, 8)
    with pytest.raises(InvalidSampleError, match=r"input_ids\[0\] is null"):
        pack_dataset(ds.select([1, 0]), 8)


def test_overlong_sequences():
    with pytest.raises(OverlongSequenceError, match=r"data\[1\] has 5 tokens, more than capacity=4 \(1 of 2"):
        pack_dataset([[1], [1, 2, 3, 4, 5]], 4)
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [1]]})
    with pytest.raises(OverlongSequenceError, match=r"input_ids\[0\] has 5 tokens.*overlong='truncate'"):
        pack_dataset(ds, 4)
    out, plan = pack_with_plan(ds, 4, overlong="drop")
    assert plan.dropped.tolist() == [0] and out[:]["input_ids"] == [[1, 0, 0, 0]]


def test_bad_tables_and_options():
    with pytest.raises(DataLoadError, match=r"data has no 'input_ids' column \(its columns: 'text'\)"):
        pack_dataset(datasets.Dataset.from_dict({"text": ["a"]}), 4)
    with pytest.raises(InvalidArgumentError, match="pack each split on its own"):
        pack_dataset(datasets.DatasetDict({"train": _dataset(3)}), 4)
    bad = [
        ({"padding": "max"}, "padding must be one of 'capacity', 'longest'"),
        ({"padding": 2}, r"padding=2 is shorter than the longest row \(4 tokens\)"),
        ({"attention_mask": "causal"}, "attention_mask must be one of 'binary', 'segments'"),
        ({"columns": ["input_ids", "tokens"]}, "columns names 'tokens', which pack_dataset does not write"),
        ({"columns": ["attention_mask"], "attention_mask": None}, "attention_mask=None"),
        ({"columns": {"input_ids": "x", "labels": "x"}}, "names a column .* twice"),
        ({"chunk_tokens": 0}, "chunk_tokens must be an integer >= 1"),
        ({"padding_value": 2**40}, "padding_value must be an integer that fits int32"),
        ({"keep_in_memory": True, "cache_file_name": "x.arrow"}, "contradict"),
        ({"overlong": "wrap"}, "overlong must be one of"),
        ({"strategy": "best"}, "strategy must be one of"),
    ]
    for kwargs, message in bad:
        with pytest.raises(PadfreeError, match=message):
            pack_dataset([[1, 2, 3], [4]], 4, **kwargs)


# --------------------------------------------------------------------------------------------------
# Memory: a memory-mapped dataset stays memory-mapped, and the output never sits in memory
# --------------------------------------------------------------------------------------------------

_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import datasets, psutil
    from padfree.data.hf import pack_dataset
    datasets.disable_progress_bars()
    tiny = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}).cast_column("input_ids", datasets.List(
        datasets.Value("int32")))
    pack_dataset(tiny, 8, keep_in_memory=False)  # the same numba kernels loaded, datasets warmed up
    ds = datasets.load_from_disk(sys.argv[1])
    before = psutil.Process().memory_info().rss  # now, not the peak so far: the peak of packing must stand on it
    out = pack_dataset(ds, 2048, chunk_tokens=1 << 20, cache_file_name=sys.argv[2])
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS at fork time (Linux keeps it across exec)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"growth": peak - before, "rows": len(out)}))
""")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_peak_memory_stays_near_the_token_bytes(tmp_path):
    """Pack 200k rows (~40M int32 tokens, ~160 MB) from disk into ~550 MB of padded rows, in a fresh process.

    What may grow: the input pages read through the memory map (1x the token bytes) and a working set that does
    not grow with the data (two chunks of rows, the plan: ~30 MB here). The output must not: it goes to the file.
    The spec's bound, 2x the token bytes, holds with room to spare.
    """
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(np.log(120), 1.0, 200_000)), 1, 2048).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = (np.arange(offsets[-1], dtype=np.int32) & 0x3FFF)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
    datasets.Dataset(pa.table({"input_ids": column}), fingerprint="memtest").save_to_disk(str(tmp_path / "src"))
    token_bytes = ids.nbytes
    del ids, column
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(tmp_path / "src"), str(tmp_path / "out.arrow")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert os.path.getsize(tmp_path / "out.arrow") > 3 * token_bytes  # the output is much larger than the input...
    assert report["growth"] <= token_bytes + 128 * 2**20, (report, token_bytes)  # ...yet never held in memory
    assert report["growth"] <= 2 * token_bytes


def test_seqpackers_keyword_names_work_as_its_documents_write_them():
    """``pack_dataset(token_ids=..., capacity=...)`` and ``pack_dataset_from_result(result=..., token_ids=...)``
    give what the positional spelling gives; both or neither of data / token_ids is refused by name."""
    ids = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    want = pack_dataset(ids, 5)[:]
    assert pack_dataset(token_ids=ids, capacity=5)[:] == want
    plan = pack_sequences([3, 2, 4], capacity=5)
    assert pack_dataset_from_result(result=plan, token_ids=ids)[:] == pack_dataset_from_result(plan, ids)[:]
    for kwargs, got in [({}, "neither"), ({"data": ids, "token_ids": ids}, "both")]:
        with pytest.raises(InvalidArgumentError, match=rf"pass the sequences as data \(or token_ids=.*not {got}"):
            pack_dataset(capacity=5, **kwargs)
    with pytest.raises(InvalidArgumentError, match="capacity must be an integer >= 1, got None"):
        pack_dataset(ids)
    with pytest.raises(InvalidArgumentError, match="result must be a PackResult"):
        pack_dataset_from_result(result=[[0, 1]], token_ids=ids)


def test_wrapped_rows_are_full_and_every_piece_is_a_sequence_of_its_own():
    """``strategy="wrapped"`` cuts the same rows as TRL's (same tokens, input order, full rows), but each piece of a
    cut sequence restarts its positions and is not a target at its first token, so a configured model computes on
    every piece what the piece computes alone; TRL's rows, whose positions run on across the cut, differ (the
    negative control of the same comparison). The input's format carries over."""
    import torch
    from trl.data_utils import pack_dataset as trl_pack_dataset

    from padfree import configure_packing
    from padfree.packing.wrapped import wrap_sequences
    from zoo import tiny_model

    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 90, int(n)).tolist() for n in rng.integers(1, 30, 12)]
    source = datasets.Dataset.from_dict({"input_ids": seqs})
    ours = pack_dataset(source.with_format("torch"), 16, strategy="wrapped", padding=None)
    theirs = trl_pack_dataset(source, 16, strategy="wrapped")
    assert ours.format["type"] == "torch"
    rows = ours.with_format(None)[:]
    assert rows["input_ids"] == theirs[:]["input_ids"]  # the same cut of the same stream
    assert all(len(r) == 16 for r in rows["input_ids"][:-1])
    plan = wrap_sequences([len(s) for s in seqs], 16)
    assert plan.placed_lengths.sum() == sum(map(len, seqs)) and plan.num_bins == len(rows["input_ids"])

    model = tiny_model("llama")
    configure_packing(model)
    worst_ours, worst_trl = 0.0, 0.0
    for ids, pos, lens, labels in zip(rows["input_ids"], rows["position_ids"], rows["seq_lens"], rows["labels"],
                                      strict=True):
        starts = np.cumsum([0, *lens[:-1]])
        assert all(labels[k] == -100 and pos[k] == 0 for k in starts)  # every piece: positions restart, no target
        ids_t = torch.tensor([ids])
        with torch.no_grad():
            packed = model(input_ids=ids_t, position_ids=torch.tensor([pos])).logits[0]
            # TRL's positions: one run per row, continuing across every cut of a sequence
            trl = model(input_ids=ids_t, position_ids=torch.arange(len(ids))[None]).logits[0]
            start = 0
            for n in lens:
                alone = model(input_ids=ids_t[:, start:start + n]).logits[0]
                worst_ours = max(worst_ours, float((packed[start:start + n] - alone).abs().max()))
                worst_trl = max(worst_trl, float((trl[start:start + n] - alone).abs().max()))
                start += n
    assert worst_ours <= 1e-5 and worst_trl > 1e-2


def test_a_streaming_dataset_is_packed_online_into_the_same_columns():
    """A streaming ``datasets.IterableDataset`` comes back as an IterableDataset packed while it is read: with a
    buffer that holds the whole stream, the rows are the offline plan's rows (labels and masks included), in every
    padding and column option; what a stream cannot give is refused by name."""
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(1, 40, 80)]
    labels = [[t if t % 3 else -100 for t in s] for s in seqs]
    source = datasets.Dataset.from_dict({"input_ids": seqs, "labels": labels})
    for kwargs in [{}, {"padding": None, "attention_mask": None,
                        "columns": {"input_ids": "input_ids", "seq_lens": "seq_lengths"}},
                   {"attention_mask": "segments", "pad_to_multiple_of": 16}]:
        offline = pack_dataset(source, 64, **kwargs)[:]
        online = pack_dataset(source.to_iterable_dataset(), 64, buffer_size=1_000, **kwargs)
        assert isinstance(online, datasets.IterableDataset)
        rows = list(online)
        assert set(rows[0]) == set(offline)
        as_rows = [dict(zip(offline, values, strict=True)) for values in zip(*offline.values(), strict=True)]
        key = lambda r: (r["input_ids"], r.get("labels"))  # noqa: E731
        assert sorted(rows, key=key) == sorted(as_rows, key=key)
    stream = source.to_iterable_dataset()
    for kwargs, match in [({"padding": "longest"}, "padding='longest' needs every row"),
                          ({"columns": ["input_ids", "sequence_ids"]}, r"columns \['sequence_ids'\] cannot be written"),
                          ({"padding": 32}, "padding=32 is shorter than capacity=64")]:
        with pytest.raises(InvalidArgumentError, match=match):
            pack_dataset(stream, 64, **kwargs)
    with pytest.raises(InvalidArgumentError, match="plan_dataset needs a global plan, which a stream does not have"):
        plan_dataset(stream, 64)
    with pytest.raises(InvalidArgumentError, match="strategy='wrapped' cuts the sequences at the rows' edges"):
        pack_dataset(stream, 64, "wrapped")
    masked = datasets.Dataset.from_dict({"input_ids": seqs, "completion_mask": [[1] * len(s) for s in seqs]})
    with pytest.raises(InvalidArgumentError, match=r"the stream has \['completion_mask'\] but no labels"):
        pack_dataset(masked.to_iterable_dataset(), 64)
    with pytest.raises(InvalidArgumentError, match="pack_dataset_from_result needs a map-style"):
        pack_dataset_from_result(pack_sequences([len(s) for s in seqs], 64), stream)


@pytest.mark.parametrize("keep_in_memory", [True, False])
def test_other_per_token_columns_are_carried_in_parallel_with_the_ids(tmp_path, keep_in_memory):
    """``carry=`` packs other per-token columns the way TRL's pack_dataset packs every list column: each piece of
    each row holds its sequence's own values (after a shuffle's indices mapping and an overlong split too), padding
    holds 0; columns of another length than their ids, unknown names and clashes with an output name are refused."""
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, 70_000, int(n)).tolist() for n in rng.integers(1, 50, 200)]
    types = [[i % 3] * len(s) for i, s in enumerate(seqs)]
    masks = [rng.integers(0, 2, len(s)).astype(bool).tolist() for s in seqs]
    source = datasets.Dataset.from_dict({"input_ids": seqs, "token_type_ids": types, "completion_mask": masks,
                                         "text": [str(i) for i in range(len(seqs))]}).shuffle(seed=0)
    cache = None if keep_in_memory else tmp_path / "rows.arrow"
    out, plan = pack_with_plan(source, 40, overlong="split", carry="all", keep_in_memory=keep_in_memory,
                               cache_file_name=cache)
    assert out.column_names == [*DEFAULT_COLUMNS, "token_type_ids", "completion_mask"]  # "text" is not per-token
    rows = out[:]
    starts = plan.piece_starts if plan.piece_starts is not None else np.zeros(plan.num_pieces, np.int64)
    for b in range(plan.num_bins):
        at = 0
        for p in range(plan.bin_offsets[b], plan.bin_offsets[b + 1]):
            seq, s, n = int(plan.order[p]), int(starts[p]), int(plan.placed_lengths[p])
            assert rows["input_ids"][b][at:at + n] == source[seq]["input_ids"][s:s + n]
            assert rows["token_type_ids"][b][at:at + n] == source[seq]["token_type_ids"][s:s + n]
            assert rows["completion_mask"][b][at:at + n] == [int(v) for v in source[seq]["completion_mask"][s:s + n]]
            at += n
        assert set(rows["token_type_ids"][b][at:]) <= {0} and set(rows["completion_mask"][b][at:]) <= {0}
    short = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "token_type_ids": [[1, 2]]})
    with pytest.raises(InvalidTokensError, match=r"token_type_ids\[0\] has 2 entries but input_ids\[0\] has 3"):
        pack_dataset(short, 8, carry=["token_type_ids"])
    for carry, error, match in [(["nope"], DataLoadError, "carry names 'nope', which data does not have"),
                                (["labels"], InvalidArgumentError, "carry names 'labels', which pack_dataset reads"),
                                ("some", InvalidArgumentError, "carry must be 'all', None or a list")]:
        with pytest.raises(error, match=match):
            pack_dataset(source, 40, overlong="split", carry=carry)
    with pytest.raises(InvalidArgumentError, match="carried column 'token_type_ids' has the name of an output"):
        pack_dataset(source, 40, overlong="split", carry=["token_type_ids"],
                     columns={"input_ids": "token_type_ids"})


def test_per_token_columns_are_carried_by_default_as_trl_packs_them(tmp_path):
    """A TRL-tokenized dataset keeps its per-token columns through packing without asking: each piece holds its own
    sequence's values (after a shuffle and an overlong split), padding 0; the masks also build the labels. Columns
    that are not per-token (text, a scalar, a list of another length) are left out, as before."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 1000, int(n)).tolist() for n in rng.integers(2, 30, 120)]
    completion = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    assistant = [rng.integers(0, 2, len(s)).astype(bool).tolist() for s in seqs]
    types = [[i % 4] * len(s) for i, s in enumerate(seqs)]
    source = datasets.Dataset.from_dict({
        "input_ids": seqs, "completion_mask": completion, "assistant_masks": assistant, "token_type_ids": types,
        "text": [f"row {i}" for i in range(len(seqs))], "score": list(range(len(seqs))),
        "tags": [["a", "b"]] * len(seqs),
    }).shuffle(seed=1)
    out, plan = pack_with_plan(source, 24, overlong="split")
    assert out.column_names == [*DEFAULT_COLUMNS, "completion_mask", "assistant_masks", "token_type_ids"]
    rows = out[:]
    starts = plan.piece_starts if plan.piece_starts is not None else np.zeros(plan.num_pieces, np.int64)
    for b in range(plan.num_bins):
        at = 0
        for p in range(plan.bin_offsets[b], plan.bin_offsets[b + 1]):
            seq, s, n = int(plan.order[p]), int(starts[p]), int(plan.placed_lengths[p])
            row = source[seq]
            for name in ("completion_mask", "token_type_ids"):
                assert rows[name][b][at:at + n] == row[name][s:s + n]
            assert rows["assistant_masks"][b][at:at + n] == [int(v) for v in row["assistant_masks"][s:s + n]]
            # the masks still build the labels: a target only where both are nonzero (never a piece's first token)
            piece = zip(row["input_ids"][s:s + n], row["completion_mask"][s:s + n], row["assistant_masks"][s:s + n],
                        strict=True)
            want = [t if c and a else -100 for t, c, a in piece]
            assert rows["labels"][b][at + 1:at + n] == want[1:] and rows["labels"][b][at] == -100
            at += n
        for name in ("completion_mask", "assistant_masks", "token_type_ids"):
            assert set(rows[name][b][at:]) <= {0} and len(rows[name][b]) == 24
    # a dict of Python lists (booleans included) and a streaming-free Arrow table are carried the same way
    small = {"input_ids": [[1, 2, 3], [4, 5]], "completion_mask": [[False, True, True], [0, 1]]}
    assert pack_dataset(small, 5)[:]["completion_mask"] == [[0, 1, 1, 0, 1]]
    assert pack_dataset(pa.table(small | {"completion_mask": [[0, 1, 1], [0, 1]]}), 5)[:]["completion_mask"] == \
        [[0, 1, 1, 0, 1]]
    # carry= chooses instead: [] none (the masks still build the labels), a list exactly those
    none = pack_dataset(source, 24, overlong="split", carry=[])
    assert none.column_names == list(DEFAULT_COLUMNS) and none[:]["labels"] == rows["labels"]
    assert pack_dataset(source, 24, overlong="split", carry=["token_type_ids"]).column_names == \
        [*DEFAULT_COLUMNS, "token_type_ids"]
    # the carried columns are part of the content: another choice is another fingerprint (and cache file)
    saved = tmp_path / "saved"
    source.flatten_indices().save_to_disk(str(saved))
    on_disk = datasets.load_from_disk(str(saved))
    a = pack_dataset(on_disk, 24, overlong="split", carry=[], keep_in_memory=False)
    b = pack_dataset(on_disk, 24, overlong="split", carry=["token_type_ids"], keep_in_memory=False)
    assert a._fingerprint != b._fingerprint and a.cache_files != b.cache_files
    assert a.column_names == list(DEFAULT_COLUMNS) and b.column_names[-1] == "token_type_ids"


def test_a_per_token_column_that_cannot_be_carried_is_refused_not_dropped():
    seqs = [[1, 2, 3], [4, 5]]
    weights = datasets.Dataset.from_dict({"input_ids": seqs, "weights": [[0.5, 1.0, 1.0], [1.0, 0.5]]})
    with pytest.raises(InvalidArgumentError, match=r"column 'weights' holds one value per token .* holds double "
                                                   r"values.*Pass carry= naming the columns to carry without it"):
        pack_dataset(weights, 8)
    with pytest.raises(InvalidArgumentError, match=r"column 'words' holds one value per token"):
        pack_dataset({"input_ids": seqs, "words": [["a", "b", "c"], ["d", "e"]]}, 8)
    assert pack_dataset(weights, 8, carry=[]).column_names == list(DEFAULT_COLUMNS)  # dropped knowingly
    # a per-token column with a null row: refused where the row is packed, not silently left out
    holes = datasets.Dataset.from_dict({"input_ids": seqs, "completion_mask": [[0, 1, 1], None]})
    with pytest.raises(InvalidTokensError, match=r"completion_mask\[1\] has null but input_ids\[1\] has 2 tokens"):
        pack_dataset(holes, 8, label_masks=())
    # a stream carries none yet: its per-token column is refused when read, unless carry=[] leaves it out
    stream = datasets.Dataset.from_dict({"input_ids": seqs, "labels": seqs, "token_type_ids": [[1, 1, 1], [2, 2]]})
    with pytest.raises(InvalidArgumentError, match=r"the stream's column 'token_type_ids' holds one value per "
                                                   r"token .* pass carry=\[\] to leave it out"):
        list(pack_dataset(stream.to_iterable_dataset(), 8))
    assert [row["input_ids"] for row in pack_dataset(stream.to_iterable_dataset(), 8, carry=[])] == \
        [[1, 2, 3, 4, 5, 0, 0, 0]]


@pytest.mark.parametrize(("kwargs", "named"), [({"padding": 2**40}, "padding=1099511627776"),
                                               ({"pad_to_multiple_of": 2**40}, "pad_to_multiple_of=1099511627776")])
def test_a_row_width_past_the_row_limit_is_refused_before_anything_is_allocated(kwargs, named):
    with pytest.raises(InvalidArgumentError, match=rf"{named}.*a row holds at most"):
        pack_dataset([[1, 2, 3], [4, 5]], capacity=8, **kwargs)
    assert len(pack_dataset([[1, 2, 3], [4, 5]], capacity=8, pad_to_multiple_of=64)["input_ids"][0]) == 64
