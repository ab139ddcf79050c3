"""PackingDataset and IterablePackingDataset: round trips on real text, epochs, DataLoader workers, exact resume,
one clear error per bad input."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

from torch.utils.data import DataLoader  # noqa: E402

from padfree import errors  # noqa: E402
from padfree.data.datasets import IterablePackingDataset, PackingDataset  # noqa: E402
from padfree.errors import (  # noqa: E402
    InvalidArgumentError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
    StateMismatchError,
)
from realdata import gsm8k_records  # noqa: E402

KEYS = ("input_ids", "labels", "position_ids", "seq_lens")


# --------------------------------------------------------------------------------------------------
# Data and checks
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k():
    """300 GSM8K records tokenized as prompt + answer; labels mask the prompt (completion-only training)."""
    from padfree.corpus import load_tokenizer

    records = gsm8k_records(300)
    tokenizer = load_tokenizer()
    prompts = tokenizer([r["instruction"] for r in records], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["output"] for r in records], add_special_tokens=False)["input_ids"]
    ids = [p + a for p, a in zip(prompts, answers, strict=True)]
    labels = [[-100] * len(p) + a for p, a in zip(prompts, answers, strict=True)]
    return ids, labels


def _concat(rows):
    """A padding-free collate for the tests: the rows of a batch back to back, with their lengths."""
    out = {k: torch.cat([r[k] for r in rows]) for k in KEYS}
    out["row_lens"] = torch.tensor([r["input_ids"].shape[0] for r in rows])
    return out


def _as_lists(item):
    return {k: v.tolist() for k, v in item.items()}


def _unbatch(batches):
    """The rows of ``_concat`` batches again."""
    rows = []
    for b in batches:
        row_ends = np.cumsum(b["row_lens"].numpy())
        seq_ends = np.cumsum(b["seq_lens"].numpy())
        seq_cut = np.searchsorted(seq_ends, row_ends[:-1]) + 1  # rows end where sequences end
        parts = [np.split(b[key].numpy(), row_ends[:-1]) for key in KEYS[:3]]
        parts.append(np.split(b["seq_lens"].numpy(), seq_cut))
        for row in zip(*parts, strict=True):
            rows.append({key: torch.from_numpy(p) for key, p in zip(KEYS, row, strict=True)})
    return rows


def _row_key(row):
    return tuple(tuple(row[k].tolist()) for k in KEYS)


def _pieces(rows, max_length):
    """Check the layout of every row; return the multiset of (ids, labels after the first) of its sequences."""
    got = Counter()
    for row in rows:
        x, y, pos, lens = (row[k] for k in KEYS)
        for t in (x, y, pos, lens):
            assert t.dtype == torch.long and t.ndim == 1
        assert int(lens.sum()) == x.shape[0] == y.shape[0] == pos.shape[0] <= max_length
        assert int(lens.min()) >= 1
        starts = np.cumsum(lens.numpy()) - lens.numpy()
        assert pos.tolist() == [p for n in lens.tolist() for p in range(n)]  # positions restart at every sequence
        for s, n in zip(starts.tolist(), lens.tolist(), strict=True):
            assert y[s] == -100  # no token is predicted from the previous sequence
            got[(tuple(x[s : s + n].tolist()), tuple(y[s + 1 : s + n].tolist()))] += 1
    return got


def _expected(ids, labels=None):
    labels = labels if labels is not None else [None] * len(ids)
    return Counter((tuple(i), tuple((i if lab is None else lab)[1:])) for i, lab in zip(ids, labels, strict=True))


def _split_expected(ids, labels, capacity):
    out = Counter()
    for i, lab in zip(ids, labels, strict=True):
        for s in range(0, len(i), capacity):
            out[(tuple(i[s : s + capacity]), tuple(lab[s + 1 : s + capacity]))] += 1
    return out


def _rows(ds):
    return [ds[i] for i in range(len(ds))]


# --------------------------------------------------------------------------------------------------
# Map-style
# --------------------------------------------------------------------------------------------------


def test_map_style_round_trip_over_a_tokenized_hf_dataset(gsm8k):
    ids, labels = gsm8k
    hf = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "n": list(range(len(ids)))})
    ds = PackingDataset(hf, max_length=512, seed=0)
    assert ds.lengths.tolist() == [len(i) for i in ids]
    rows = _rows(ds)
    assert _pieces(rows, 512) == _expected(ids, labels)
    assert len(ds) == ds.plan.num_bins and ds.plan.efficiency > 0.95
    # an indices mapping (select / shuffle) is honoured: the rows hold the selected samples, in their order
    sub = hf.shuffle(seed=1).select(range(0, 300, 3))
    picked = sub["n"]
    ds_sub = PackingDataset(sub, max_length=512, seed=0)
    assert ds_sub.lengths.tolist() == [len(ids[n]) for n in picked]
    assert _pieces(_rows(ds_sub), 512) == _expected([ids[n] for n in picked], [labels[n] for n in picked])
    # several Arrow chunks
    two = datasets.concatenate_datasets([
        datasets.Dataset.from_dict({"input_ids": ids[:120]}),
        datasets.Dataset.from_dict({"input_ids": ids[120:]}),
    ])
    assert two.data.column("input_ids").num_chunks == 2
    assert _pieces(_rows(PackingDataset(two, max_length=512, seed=0)), 512) == _expected(ids)


def test_map_style_over_a_list_and_over_dicts_with_labels(gsm8k):
    ids, labels = gsm8k
    ids, labels = ids[:120], labels[:120]
    assert _pieces(_rows(PackingDataset(ids, max_length=384, seed=1)), 384) == _expected(ids)
    as_arrays = [np.asarray(i, np.int32) for i in ids]
    assert _pieces(_rows(PackingDataset(as_arrays, max_length=384, seed=1)), 384) == _expected(ids)
    # dicts: labels on some samples only; the others are trained on all their tokens
    dicts = [{"input_ids": i, "labels": lab} if k % 2 else {"input_ids": i} for k, (i, lab) in
             enumerate(zip(ids, labels, strict=True))]
    want = [lab if k % 2 else None for k, lab in enumerate(labels)]
    assert _pieces(_rows(PackingDataset(dicts, max_length=384, seed=1)), 384) == _expected(ids, want)


@pytest.mark.parametrize("make", ["map", "iterable"])
def test_overlong_split_places_every_piece_once(gsm8k, make):
    ids, labels = gsm8k
    ids, labels = ids[:80], labels[:80]
    dicts = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    if make == "map":
        rows = _rows(PackingDataset(dicts, max_length=64, seed=0, overlong="split"))
    else:
        rows = list(IterablePackingDataset(dicts, max_length=64, buffer_size=50, seed=0, overlong="split"))
    assert _pieces(rows, 64) == _split_expected(ids, labels, 64)


def test_set_epoch_reshuffles_the_rows_deterministically(gsm8k):
    ids, _ = gsm8k
    a, b = PackingDataset(ids, max_length=384, seed=7), PackingDataset(ids, max_length=384, seed=7)
    first = [_row_key(r) for r in _rows(a)]
    a.set_epoch(1)
    b.set_epoch(1)
    second = [_row_key(r) for r in _rows(a)]
    assert second == [_row_key(r) for r in _rows(b)]  # same (seed, epoch): same rows in the same order
    assert second != first and sorted(second) == sorted(first)  # another epoch: same rows, another order
    a.set_epoch(0)
    assert [_row_key(r) for r in _rows(a)] == first
    unshuffled = PackingDataset(ids, max_length=384, seed=7, shuffle=False)
    unshuffled.set_epoch(3)
    assert unshuffled.order.tolist() == list(range(len(unshuffled)))
    # a randomized strategy repacks every epoch
    ffs = PackingDataset(ids, max_length=384, strategy="ffs", seed=7)
    bins0 = ffs.plan.bins
    ffs.set_epoch(1)
    assert ffs.plan.bins != bins0
    assert _pieces(_rows(ffs), 384) == _expected(ids)
    # the iterable dataset: the same rows per epoch, in another order
    stream = IterablePackingDataset(ids, max_length=384, buffer_size=100, seed=7)
    e0 = [_row_key(r) for r in stream]
    stream.set_epoch(1)
    e1 = [_row_key(r) for r in stream]
    assert e1 != e0 and sorted(e1) == sorted(e0)
    assert [_row_key(r) for r in stream] == e1


def test_map_style_under_a_dataloader_resumes_exactly(gsm8k):
    ids, labels = gsm8k
    hf = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    ds = PackingDataset(hf, max_length=384, seed=3)
    ds.set_epoch(2)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_concat)
    full = [_as_lists(b) for b in loader]
    assert _pieces(_unbatch([{k: torch.tensor(v) for k, v in b.items()} for b in full]), 384) == _expected(ids, labels)
    k = 5
    state = ds.state_dict(k, loader=loader)
    again = PackingDataset(hf, max_length=384)  # seed=None adopts the saved seed
    again.load_state_dict(state)
    assert again.epoch == 2 and len(again) == len(ds) - 4 * k
    assert [_as_lists(b) for b in DataLoader(again, batch_size=4, collate_fn=_concat)] == full[k:]


# --------------------------------------------------------------------------------------------------
# Iterable: workers and resume
# --------------------------------------------------------------------------------------------------


def test_iterable_with_zero_and_two_workers_yields_every_sequence_once(gsm8k):
    ids, labels = gsm8k
    dicts = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    stream = IterablePackingDataset(dicts, max_length=384, buffer_size=64, seed=0)
    rows0 = list(DataLoader(stream, batch_size=None))
    assert _pieces(rows0, 384) == _expected(ids, labels)
    rows2 = list(DataLoader(stream, batch_size=None, num_workers=2))
    assert [_row_key(r) for r in rows2] == [_row_key(r) for r in rows0]  # the rows do not depend on the workers
    batched = _unbatch(DataLoader(stream, batch_size=3, num_workers=2, collate_fn=_concat))
    assert Counter(map(_row_key, batched)) == Counter(map(_row_key, rows0))  # union = input, no duplicate
    assert len(batched) == len(rows0)


def test_iterable_over_a_sharded_hf_iterable_dataset_and_a_callable(gsm8k):
    ids, labels = gsm8k
    hf = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).to_iterable_dataset(num_shards=2)
    stream = IterablePackingDataset(hf, max_length=384, buffer_size=64, seed=0)
    rows2 = list(DataLoader(stream, batch_size=None, num_workers=2))
    # datasets splits an IterableDataset by worker when iterated in one; padfree reads it whole in each worker
    assert _pieces(rows2, 384) == _expected(ids, labels)
    from_fn = IterablePackingDataset(lambda: iter(ids), max_length=384, buffer_size=64, seed=0)
    assert _pieces(list(from_fn), 384) == _expected(ids)


@pytest.mark.parametrize("k", [3, 4])
def test_iterable_stop_save_resume_gives_the_identical_remaining_batches(gsm8k, k):
    ids, labels = gsm8k
    dicts = [{"input_ids": i, "labels": lab} for i, lab in zip(ids[:200], labels[:200], strict=True)]

    def make(seed=11):
        ds = IterablePackingDataset(dicts, max_length=384, buffer_size=48, seed=seed)
        ds.set_epoch(1)
        return ds

    def loader_of(ds):
        return DataLoader(ds, batch_size=3, num_workers=2, collate_fn=_concat)

    full = [_as_lists(b) for b in loader_of(make())]
    assert len(full) > 10

    ds = make()
    loader = loader_of(ds)
    it = iter(loader)
    seen = [_as_lists(next(it)) for _ in range(k)]
    del it  # the run stops here
    state = ds.state_dict(k, loader=loader)
    assert seen == full[:k]
    state = json.loads(json.dumps(state))  # a plain, serializable dict

    resumed = make(seed=None)
    resumed.load_state_dict(state)
    loader = loader_of(resumed)
    assert [_as_lists(b) for b in loader] == full[k:]
    if k == 3:  # resume a resumed run: its batches count on from the first resume point
        it = iter(loader)
        more = [_as_lists(next(it)) for _ in range(2)]
        del it
        assert more == full[k : k + 2]
        state2 = resumed.state_dict(2, loader=loader)
        assert state2["batches_consumed"] == k + 2
        third = make()
        third.load_state_dict(state2)
        assert [_as_lists(b) for b in loader_of(third)] == full[k + 2 :]
        # set_epoch to another epoch forgets the resume point
        third.set_epoch(2)
        assert len(list(third)) == len(list(make().__iter__()))


def test_rows_do_not_depend_on_how_the_stream_is_read_and_datasets_pickle(gsm8k, monkeypatch):
    import pickle

    from padfree.data import iterable as module

    ids, labels = gsm8k
    stream = IterablePackingDataset(ids, max_length=384, buffer_size=40, seed=2)
    rows = [_row_key(r) for r in stream]
    monkeypatch.setattr(module, "_READ_BLOCK", 7)
    assert [_row_key(r) for r in stream] == rows
    assert [_row_key(r) for r in pickle.loads(pickle.dumps(stream))] == rows
    hf = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    ds = PackingDataset(hf, max_length=384, seed=2)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._ids._chunks is None  # the tokens travel as the datasets.Dataset, re-read on first use
    assert [_row_key(r) for r in _rows(copy)] == [_row_key(r) for r in _rows(ds)]
    assert len(PackingDataset([], max_length=8)) == 0 and list(IterablePackingDataset([], max_length=8)) == []


def test_in_process_resume_and_single_rows(gsm8k):
    ids, _ = gsm8k
    ds = IterablePackingDataset(ids, max_length=384, buffer_size=32, seed=5)
    full = [_row_key(r) for r in ds]
    state = ds.state_dict(7)  # a plain loop over the dataset: 7 rows consumed
    again = IterablePackingDataset(ids, max_length=384, buffer_size=32, seed=5)
    again.load_state_dict(state)
    assert [_row_key(r) for r in again] == full[7:]
    assert [_row_key(r) for r in DataLoader(again, batch_size=None, num_workers=1)] == full[7:]  # 0 and 1 alike


# --------------------------------------------------------------------------------------------------
# Bad input: one clear error each
# --------------------------------------------------------------------------------------------------


def test_new_errors_are_exported_sorted_and_subclass_the_right_bases():
    assert errors.__all__ == sorted(errors.__all__)
    assert issubclass(InvalidSampleError, InvalidTokensError)
    assert issubclass(StateMismatchError, errors.PadfreeError)


@pytest.mark.parametrize("cls", [PackingDataset, IterablePackingDataset])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_length": 0}, "max_length must be an integer >= 1, got 0"),
        ({"max_length": 8, "strategy": "best"}, "strategy must be one of"),
        ({"max_length": 8, "overlong": "clip"}, "overlong must be one of"),
        ({"max_length": 8, "shuffle": "yes"}, "shuffle must be True or False"),
    ],
)
def test_bad_options(cls, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        cls([[1, 2]], **kwargs)


BAD_SAMPLES = [
    ([[1, 2], 5], InvalidSampleError, r"{s1} = 5 \(type int\) is not a sequence of token ids"),
    ([[1, 2], [3, "a"]], InvalidTokensError, r"{s1}\[1\] = 'a' \(type str\) is not an integer"),
    ([[1, 2], [3, 2.5]], InvalidTokensError, r"{s1}\[1\] = 2.5 \(type float\) is not an integer"),
    ([[1, 2], "hello"], InvalidSampleError, r"{s1} is text"),
    ([[1, 2], [3, -4]], InvalidTokensError, r"{s1}\[1\] = -4 is negative"),
    ([[1, 2], {"text": "hi"}], InvalidSampleError, r"{s1} is a dict without 'input_ids' \(keys: \['text'\]\)"),
    ([[1, 2], []], InvalidSampleError, r"{s1} has no tokens \(1 of 2 samples are empty\)"),
    ([[1, 2], {"input_ids": [3, 4, 5], "labels": [3, 4]}], InvalidSampleError,
     r"{s1}\['labels'\] has 2 entries but {s1}\['input_ids'\] has 3 tokens"),
    ([[1, 2], list(range(20))], OverlongSequenceError, r"{s1} has 20 tokens, more than max_length=8"),
]


@pytest.mark.parametrize(("samples", "error", "match"), BAD_SAMPLES)
def test_bad_samples_in_a_map_style_dataset(samples, error, match):
    with pytest.raises(error, match=match.format(s1=r"dataset\[1\]")):
        PackingDataset(samples, max_length=8)


@pytest.mark.parametrize(("samples", "error", "match"), BAD_SAMPLES)
def test_bad_samples_in_a_stream(samples, error, match):
    stream = IterablePackingDataset(samples, max_length=8, buffer_size=4)
    with pytest.raises(error, match=match.format(s1="sample 1 of the stream")):
        list(stream)


def test_bad_hf_datasets():
    with pytest.raises(InvalidSampleError, match=r"the dataset has no 'input_ids' column \(columns: \['text'\]\)"):
        PackingDataset(datasets.Dataset.from_dict({"text": ["a"]}), max_length=8)
    with pytest.raises(InvalidSampleError, match=r"dataset\[1\]\['input_ids'\] has no tokens"):
        PackingDataset(datasets.Dataset.from_dict({"input_ids": [[1], []]}), max_length=8)
    with pytest.raises(InvalidSampleError, match=r"dataset\[0\]\['labels'\] has 1 entries but .* has 2 tokens"):
        PackingDataset(datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1]]}), max_length=8)
    with pytest.raises(InvalidSampleError, match="column 'input_ids' must hold one list of integer token ids per row"):
        PackingDataset(datasets.Dataset.from_dict({"input_ids": ["ab"]}), max_length=8)
    # token values are checked in Arrow too: a negative id, or a uint64 id that int64 cannot hold, is never packed
    with pytest.raises(InvalidTokensError, match=r"row 1 \(in table order\)\['input_ids'\]\[1\] = -2 is negative"):
        PackingDataset(datasets.Dataset.from_dict({"input_ids": [[1], [1, -2]]}), max_length=8)
    big = pa.table({"input_ids": pa.array([[1, 2**63]], pa.list_(pa.uint64()))})
    with pytest.raises(InvalidTokensError, match=r"row 0 .*\]\[1\] = 9223372036854775808 does not fit int64"):
        PackingDataset(datasets.Dataset(big), max_length=8)
    stream = IterablePackingDataset(datasets.Dataset.from_dict({"text": ["a"]}), max_length=8)
    with pytest.raises(InvalidSampleError, match=r"the samples have no 'input_ids' column \(columns: \['text'\]\)"):
        list(stream)


def test_bad_sources():
    with pytest.raises(InvalidArgumentError, match="iterable is a one-shot iterator"):
        IterablePackingDataset((x for x in [[1, 2]]), max_length=8)
    with pytest.raises(InvalidArgumentError, match="iterable must be an iterable of samples or a callable"):
        IterablePackingDataset(5, max_length=8)
    with pytest.raises(InvalidArgumentError, match=r"dataset must be a datasets\.Dataset or a sequence of samples"):
        PackingDataset(iter([[1, 2]]), max_length=8)


def test_states_from_another_configuration_are_refused():
    samples = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [1] * 5]
    state = IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=1).state_dict(1, batch_size=2)
    with pytest.raises(StateMismatchError, match=r"max_length=8 \(this dataset: 9\)"):
        IterablePackingDataset(samples, max_length=9, buffer_size=4).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"buffer_size=4 \(this dataset: 5\)"):
        IterablePackingDataset(samples, max_length=8, buffer_size=5).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="saved with seed=1 but this dataset has seed=2"):
        IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=2).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"expects a state from PackingDataset\.state_dict"):
        PackingDataset(samples, max_length=8).load_state_dict(state)
    map_state = PackingDataset(samples, max_length=8, seed=1).state_dict(1)
    with pytest.raises(StateMismatchError, match="num_samples=4 \\(this dataset: 3\\)"):
        PackingDataset(samples[:3], max_length=8).load_state_dict(map_state)
    with pytest.raises(StateMismatchError, match="lengths_crc32"):
        PackingDataset([[1, 2, 3], [4, 5], [6, 7, 8, 9], [1] * 6], max_length=8).load_state_dict(map_state)
    # a state saved under 2 workers cannot be resumed under another number of workers
    two = IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=1).state_dict(1, num_workers=2)
    resumed = IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=1)
    resumed.load_state_dict(two)
    with pytest.raises(StateMismatchError, match="num_workers=2 but this one has num_workers=1"):
        list(resumed)
    # a resume point past the end of the stream (a state from longer data) is an error, not an empty epoch
    far = IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=1).state_dict(50, batch_size=2)
    short = IterablePackingDataset(samples, max_length=8, buffer_size=4, seed=1)
    short.load_state_dict(far)
    with pytest.raises(StateMismatchError, match=r"skips 100 rows of epoch 0, but the stream packs into \d+"):
        list(short)
    # states that are not what state_dict() writes: one clear error each, never a KeyError or a numpy error
    good = PackingDataset(samples, max_length=8, seed=1).state_dict(1)
    for key, value in [("seed", None), ("seed", "1"), ("epoch", -1), ("epoch", 1.5), ("seed", True)]:
        broken = {**good, key: value}
        with pytest.raises(StateMismatchError, match=rf"the state's '{key}' is .*an integer >= 0"):
            PackingDataset(samples, max_length=8).load_state_dict(broken)
        with pytest.raises(StateMismatchError, match=rf"the state's '{key}' is"):
            IterablePackingDataset(samples, max_length=8, buffer_size=4).load_state_dict(
                {**far, key: value})
    for key in ("seed", "epoch"):
        with pytest.raises(StateMismatchError, match=rf"the state's '{key}' is None"):
            PackingDataset(samples, max_length=8).load_state_dict({k: v for k, v in good.items() if k != key})
    for bad in (None, [], "state", {"format": "padfree.PackingDataset"}):
        with pytest.raises(StateMismatchError):
            PackingDataset(samples, max_length=8).load_state_dict(bad)
    ds = PackingDataset(samples, max_length=8)
    with pytest.raises(InvalidArgumentError, match="sequential sampler"):
        ds.state_dict(1, loader=DataLoader(ds, shuffle=True))


def test_a_state_saved_over_other_data_of_the_same_shape_is_refused():
    """Equal lengths, other tokens — data cut into fixed-size blocks, a shuffled copy of a corpus: the configuration
    and the lengths agree, so only a fingerprint of the tokens tells the data apart."""
    blocks = [[i * 10 + j for j in range(4)] for i in range(12)]
    other = [[i * 10 + j + 1 for j in range(4)] for i in range(12)]
    state = PackingDataset(blocks, max_length=8, seed=1).state_dict(2)
    with pytest.raises(StateMismatchError, match=r"saved over other data: the tokens .* differ \(tokens_crc32="):
        PackingDataset(other, max_length=8, seed=1).load_state_dict(state)
    again = PackingDataset(blocks, max_length=8, seed=1)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert len(again) == len(PackingDataset(blocks, max_length=8)) - 2
    # a stream: the lengths and first tokens of its first samples
    stream_state = IterablePackingDataset(blocks, max_length=8, buffer_size=4, seed=1).state_dict(1)
    for wrong in (other, blocks[1:] + blocks[:1], [b[:3] for b in blocks]):
        with pytest.raises(StateMismatchError, match=r"saved over other data: the stream .* \(stream_crc32="):
            IterablePackingDataset(wrong, max_length=8, buffer_size=4, seed=1).load_state_dict(stream_state)
    resumed = IterablePackingDataset(lambda: iter(blocks), max_length=8, buffer_size=4, seed=1)
    resumed.load_state_dict(stream_state)  # the same samples from a callable: the same stream
    assert len(list(resumed)) == len(list(IterablePackingDataset(blocks, max_length=8, buffer_size=4, seed=1))) - 1
    # a state written before states carried the fingerprint still loads
    older = {k: v for k, v in state.items() if k != "data"}
    PackingDataset(other, max_length=8, seed=1).load_state_dict(older)


def test_a_stream_source_that_gives_no_samples_is_refused_by_name():
    for made in (5, None, {"input_ids": [1, 2]}, "text"):
        with pytest.raises(InvalidArgumentError, match=r"iterable is a callable, so each call must return an "
                                                       rf"iterable of samples .* returned {re.escape(repr(made))}"):
            list(IterablePackingDataset(lambda made=made: made, max_length=8))
    with pytest.raises(InvalidArgumentError, match=r"iterable must be an iterable of samples .* got array\(5\)"):
        IterablePackingDataset(np.array(5), max_length=8)
    assert [r["input_ids"].tolist() for r in IterablePackingDataset(lambda: ([1, 2], [3]), 8, shuffle=False)] == \
        [[1, 2, 3]]


def test_rows_out_of_range_are_index_errors_by_name_and_labels_are_checked_at_read_time():
    ds = PackingDataset([[1, 2, 3], [4, 5]], max_length=3, shuffle=False)
    assert [r["input_ids"].tolist() for r in ds] == [[1, 2, 3], [4, 5]]  # iteration stops at the OutOfRangeError
    with pytest.raises(errors.OutOfRangeError, match=r"index = 2 is not a row of this epoch: it has 2 rows "
                                                     r"\(index in \[-2, 1\]"):
        ds[2]
    assert issubclass(errors.OutOfRangeError, IndexError)
    with pytest.raises(InvalidTokensError, match=r"dataset\[1\]\['labels'\]\[2\] = -7 is not a label"):
        PackingDataset([{"input_ids": [1, 2], "labels": [-100, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2, -7]}],
                       max_length=8)
    table = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, -3, 3]]})
    with pytest.raises(InvalidTokensError, match=r"row 0 \(in table order\)\['labels'\]\[1\] = -3 is not a label"):
        PackingDataset(table, max_length=8)
    # label_padding_value names another "no target" value
    own = PackingDataset([{"input_ids": [1, 2, 3], "labels": [-1, -1, 3]}], max_length=8, label_padding_value=-1)
    assert own[0]["labels"].tolist() == [-1, -1, 3]


def test_strategy_names_follow_the_packing_engine_in_any_case_and_seqpackers_aliases():
    for spelling, canonical in [("OBFD", "obfd"), ("FirstFitDecreasing", "ffd"), ("next_fit", "nf")]:
        assert PackingDataset([[1, 2], [3]], max_length=8, strategy=spelling).strategy == canonical
        assert IterablePackingDataset([[1, 2], [3]], max_length=8, strategy=spelling).strategy == canonical
    with pytest.raises(InvalidArgumentError, match="strategy"):
        PackingDataset([[1, 2]], max_length=8, strategy="tightest")


@pytest.mark.parametrize("strategy", ["obfd", "ffs", "wrapped"])
def test_a_packing_spec_gives_the_rows_of_the_keywords_on_real_text(gsm8k, strategy):
    from padfree import PackingSpec

    ids, labels = gsm8k
    samples = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]
    overlong = "split" if strategy == "wrapped" else "truncate"
    by_spec = PackingDataset(samples, spec=PackingSpec(256, strategy, seed=5, overlong=overlong))
    by_keywords = PackingDataset(samples, 256, strategy, 5, overlong=overlong)
    assert len(by_spec) == len(by_keywords) > 1
    assert [_as_lists(by_spec[i]) for i in range(len(by_spec))] == \
        [_as_lists(by_keywords[i]) for i in range(len(by_keywords))]
    if strategy != "wrapped":  # a stream cannot cut at the rows' edges of one plan
        stream = IterablePackingDataset(samples, spec=PackingSpec(256, strategy, seed=5, overlong=overlong),
                                        buffer_size=64)
        same = IterablePackingDataset(samples, 256, 64, strategy, 5, overlong=overlong)
        assert [_as_lists(r) for r in stream] == [_as_lists(r) for r in same]


def test_the_datasets_name_a_setting_given_both_ways_in_their_own_terms():
    from padfree import PackingSpec

    with pytest.raises(InvalidArgumentError, match=r"max_length=8 is given both as a keyword and in spec "
                                                   r"\(spec\.capacity=8\)"):
        PackingDataset([[1, 2]], 8, spec=PackingSpec(8))
    with pytest.raises(InvalidArgumentError, match=r"max_sequences_per_bin=2 is given both as a keyword and in spec"):
        IterablePackingDataset([[1, 2]], spec=PackingSpec(8), max_sequences_per_bin=2)
    with pytest.raises(InvalidArgumentError, match=r"^max_length must be an integer >= 1, got 0$"):
        PackingDataset([[1, 2]], 0)
    with pytest.raises(InvalidArgumentError, match=r"^max_length must be an integer >= 1, got None"):
        PackingDataset([[1, 2]])
