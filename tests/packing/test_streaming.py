"""StreamPacker: online packing with a bounded buffer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import InvalidArgumentError, OverlongSequenceError, StreamPacker, pack_sequences


def _run(packer: StreamPacker, lengths, chunks: int = 1, items=None):
    bins = []
    for part in np.array_split(np.arange(len(lengths)), max(chunks, 1)):
        if len(part):
            bins += packer.add(np.asarray(lengths)[part], None if items is None else [items[i] for i in part])
    return bins + packer.flush()


@pytest.mark.parametrize("strategy", ["obfd", "obfdp", "mffd", "bfd", "ffd", "ffs", "nf", "hk"])
@pytest.mark.parametrize("policy", ["error", "split", "truncate"])
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=70), seed=st.integers(0, 99))
@settings(max_examples=25, deadline=None)
def test_equals_offline_packing_when_the_buffer_holds_everything(strategy, policy, lengths, seed):
    capacity = 64 if policy != "error" else 90
    offline = pack_sequences(lengths, capacity, strategy, seed, overlong=policy)
    bins = _run(StreamPacker(capacity, buffer_size=1000, strategy=strategy, seed=seed, overlong=policy), lengths, 3)
    assert [b.ids.tolist() for b in bins] == offline.bins
    lengths_per_bin = np.split(offline.placed_lengths, offline.bin_offsets[1:-1]) if offline.num_bins else []
    assert [b.lengths.tolist() for b in bins] == [x.tolist() for x in lengths_per_bin]


@given(
    lengths=st.lists(st.integers(1, 200), min_size=0, max_size=300),
    buffer_size=st.integers(1, 40),
    chunks=st.integers(1, 7),
    policy=st.sampled_from(["split", "truncate", "drop"]),
)
@settings(max_examples=150, deadline=None)
def test_no_token_lost_or_duplicated_and_chunking_does_not_matter(lengths, buffer_size, chunks, policy):
    capacity = 128
    packer = StreamPacker(capacity, buffer_size=buffer_size, overlong=policy)
    bins = _run(packer, lengths, chunks, items=[f"item{i}" for i in range(len(lengths))])
    covered = {}
    for b in bins:
        assert b.fill <= capacity and len(b) >= 1
        assert b.items == [f"item{i}" for i in b.ids.tolist()]
        for i, s, n in zip(b.ids.tolist(), b.starts.tolist(), b.lengths.tolist(), strict=True):
            for t in range(s, s + n):
                assert (i, t) not in covered
                covered[i, t] = True
    stats = packer.stats()
    assert len(covered) + stats["truncated_tokens"] + stats["dropped_tokens"] == sum(lengths)
    assert stats["pending"] == 0 and stats["bins"] == len(bins) and stats["items"] == len(lengths)
    # the same stream fed in one call gives the same bins
    again = _run(StreamPacker(capacity, buffer_size=buffer_size, overlong=policy), lengths, 1)
    assert [b.ids.tolist() for b in again] == [b.ids.tolist() for b in bins]


def test_buffer_is_bounded_and_items_leave_within_two_rounds():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 2048, 5000)
    packer = StreamPacker(2048, buffer_size=500)
    emitted_at = {}
    for i, length in enumerate(lengths):
        for b in packer.add(int(length)):
            for j in b.ids.tolist():
                emitted_at[j] = i
        assert packer.pending <= 500
    for b in packer.flush():
        for j in b.ids.tolist():
            emitted_at[j] = len(lengths)
    assert sorted(emitted_at) == list(range(len(lengths)))
    waited = np.array([emitted_at[j] - j for j in range(len(lengths) - 1000)])
    assert waited.max() < 2 * 500


def test_efficiency_on_long_tailed_lengths_with_a_10k_buffer():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, 200_000)), 1, 2048).astype(np.int64)
    packer = StreamPacker(2048, buffer_size=10_000)
    bins = [b for chunk in np.array_split(lengths, 50) for b in packer.add(chunk)] + packer.flush()
    assert sum(b.fill for b in bins) == lengths.sum()
    assert packer.stats()["efficiency"] >= 0.995


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="buffer_size"):
        StreamPacker(128, buffer_size=0)
    with pytest.raises(InvalidArgumentError, match="hold_fill"):
        StreamPacker(128, hold_fill=1.5)
    packer = StreamPacker(128)
    with pytest.raises(InvalidArgumentError, match="items has 1 entries but lengths has 2"):
        packer.add([3, 4], items=["a"])
    with pytest.raises(OverlongSequenceError, match=r"lengths\[1\] has 400 tokens, more than capacity=128"):
        packer.add([3, 400])
    assert packer.pending == 0, "a rejected call must not change the buffer"
    packer.add([5])
    with pytest.raises(InvalidArgumentError, match="every call"):
        packer.add([5], items=["x"])


# ---- the online mode: a bin leaves the moment next fit or harmonic-k closes it -----------------------------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(8, 48), st.sampled_from(["nf", "hk"]),
       st.integers(1, 8), st.data())
def test_online_bins_hold_every_piece_once_whatever_the_chunking(lengths, capacity, strategy, k, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(lengths)), max_size=5)))
    packer = StreamPacker(capacity, strategy=strategy, k=k, overlong="split")
    assert packer.online
    bins, open_max, start = [], 0, 0
    for end in [*cuts, len(lengths)]:
        bins += packer.add(lengths[start:end]) if end > start else []
        open_max = max(open_max, packer.pending)
        start = end
    bins += packer.finish()
    assert packer.pending == 0 and all(0 < b.fill <= capacity for b in bins)
    tokens = sorted((int(i), int(s) + t) for b in bins for i, s, n in zip(b.ids, b.starts, b.lengths, strict=True)
                    for t in range(n))
    assert tokens == sorted((i, t) for i, n in enumerate(lengths) for t in range(n))
    # chunking never changes the bins: the same stream in one call
    whole = StreamPacker(capacity, strategy=strategy, k=k, overlong="split")
    again = whole.add(lengths) + whole.finish()
    assert [b.ids.tolist() for b in again] == [b.ids.tolist() for b in bins]
    # bounded memory: next fit holds one open bin, harmonic-k one per class
    assert open_max <= (capacity if strategy == "nf" else k * capacity)


def test_online_next_fit_is_offline_next_fit_and_leaves_at_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 5_000)
    packer = StreamPacker(128, strategy="NextFit")  # SeqPacker's name, no buffer: online
    early = sum(len(packer.add(int(n))) for n in lengths[:20])  # one item per call, as a stream hands them over
    assert packer.online and early >= 5  # bins leave as they close, not after a buffer of 10,000 items
    streamed = StreamPacker(128, strategy="nf")
    online = [b.ids.tolist() for b in streamed.add(lengths) + streamed.finish()]
    assert online == pack_sequences(lengths, 128, "nf").bins
    assert "online" in repr(streamed) and "bins=" in repr(streamed)


def test_online_harmonic_k_bins_of_a_class_hold_that_many_items_of_it():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 64, 2_000)
    packer = StreamPacker(64, strategy="hk", k=6)
    bins = packer.add(lengths) + packer.finish()
    for b in bins:
        classes = {next((c for c in range(1, 6) if n * (c + 1) > 64), 6) for n in b.lengths.tolist()}
        assert len(classes) == 1  # a bin never mixes classes
        (c,) = classes
        assert c == 6 or len(b) <= c
    assert "k=6" in repr(packer)
    with pytest.raises(InvalidArgumentError, match="k must be"):
        StreamPacker(64, strategy="hk", k=0)


@pytest.mark.parametrize("strategy", ["obfd", "nf"])
def test_finish_ends_the_stream_and_flush_does_not(strategy):
    packer = StreamPacker(8, strategy=strategy)
    bins = packer.add([5, 2, 4]) + packer.flush()
    bins += packer.add([3]) + packer.finish()  # flush() empties the buffer mid-stream: adding goes on
    assert sorted(i for b in bins for i in b.ids.tolist()) == [0, 1, 2, 3]
    with pytest.raises(InvalidArgumentError, match=r"StreamPacker.add\(\[6\] \(type list\)\) after finish\(\)"):
        packer.add([6])  # its item would never be emitted: the caller stopped reading at finish()
    assert packer.finish() == [] and packer.stats()["items"] == 4
