"""analyze_lengths: every number checked against a direct, independent computation (plain Python loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from padfree import InvalidArgumentError, InvalidLengthsError, pack_sequences
from padfree.analysis import (
    MAX_OVERLONG_FRACTION,
    MIN_EFFICIENCY,
    analyze_lengths,
    candidate_capacities,
    padded_batches,
)
from padfree.packing import STRATEGIES


def hand_padded(lengths: list[int], capacity: int, batch_size: int, seed: int) -> tuple[int, int, float]:
    """(real tokens, positions padded to the longest, attention entries) by a loop over explicit batches."""
    order = np.random.default_rng(seed).permutation(len(lengths)).tolist()
    shuffled = [min(lengths[i], capacity) for i in order]
    positions = 0
    attention = 0
    for b in range(0, len(shuffled), batch_size):
        batch = shuffled[b : b + batch_size]
        positions += len(batch) * max(batch)
        attention += len(batch) * max(batch) ** 2
    return sum(shuffled), positions, float(attention)


@pytest.mark.parametrize(("n", "capacity", "batch_size", "seed"), [(37, 64, 5, 3), (8, 100, 8, 0), (50, 30, 7, 11)])
def test_padded_batches_match_a_loop_over_batches(n, capacity, batch_size, seed):
    lengths = np.random.default_rng(100 + n).integers(1, 2 * capacity, size=n).tolist()
    real, positions, attention = hand_padded(lengths, capacity, batch_size, seed)
    p = padded_batches(lengths, capacity, batch_size, seed)
    assert p.real_tokens == real
    assert p.positions_longest == positions
    assert p.attention_longest == attention
    assert p.positions_capacity == n * capacity
    assert p.num_batches == math.ceil(n / batch_size)
    assert p.truncated_sequences == sum(x > capacity for x in lengths)
    assert p.truncated_tokens == sum(x - capacity for x in lengths if x > capacity)
    assert p.waste_longest == pytest.approx(1 - real / positions)
    assert p.waste_capacity == pytest.approx(1 - real / (n * capacity))

    # the same numbers inside a full analysis, and at every candidate capacity
    a = analyze_lengths(lengths, capacity, batch_size=batch_size, seed=seed, strategies=["obfd"], repeats=1)
    assert a.padded == p
    for c in a.candidates:
        _, positions_c, attention_c = hand_padded(lengths, c.capacity, batch_size, seed)
        assert c.padded_positions == positions_c
        assert c.attention_padded == attention_c


def test_a_small_case_worked_by_hand():
    # one batch of four: padded to 7 -> 4 * 7 = 28 positions for 16 tokens; packed: [7, 1] [7, 1] -> 2 rows of 8
    a = analyze_lengths([1, 7, 1, 7], capacity=8, batch_size=4, capacities=[8], strategies=["obfd"], repeats=1)
    assert a.padded.positions_longest == 28
    assert a.padded.waste_longest == pytest.approx(12 / 28)
    assert a.padded.waste_capacity == pytest.approx(0.5)
    c = a.candidate(8)
    assert (c.num_bins, c.packed_positions, c.efficiency) == (2, 16, 1.0)
    assert c.speedup == pytest.approx(28 / 16)
    # attention: 4 rows x 7^2 = 196 padded, 1 + 49 + 1 + 49 = 100 block-diagonal
    assert (c.attention_padded, c.attention_packed) == (196.0, 100.0)
    assert c.attention_ratio == pytest.approx(1.96)
    assert a.recommended == 8


def test_truncation_is_counted_and_applied_to_both_sides():
    a = analyze_lengths([10, 3, 4, 9], capacity=4, batch_size=2, capacities=[4], repeats=1)
    assert a.overlong == 2
    assert a.padded.truncated_tokens == 6 + 5
    assert a.padded.real_tokens == 4 + 3 + 4 + 4
    c = a.candidate(4)
    assert (c.overlong, c.truncated_tokens) == (2, 11)
    assert c.attention_packed == 16 + 9 + 16 + 16
    for row in a.strategies:
        assert row.lower_bound == math.ceil(15 / 4)


def test_statistics():
    lengths = list(range(1, 101))
    s = analyze_lengths(lengths, 128, strategies=["nf"], repeats=1).stats
    assert (s.count, s.total_tokens, s.min, s.max) == (100, 5050, 1, 100)
    assert s.mean == 50.5
    # numpy's default (linear) percentiles of 1..100: position q/100 * 99 between sorted values
    assert (s.median, s.p90, s.p99) == pytest.approx((50.5, 90.1, 99.01))


def test_strategy_table_matches_the_engine():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 700, size=400)
    lengths[:7] = 900  # a few overlong ones: packed with overlong="truncate"
    a = analyze_lengths(lengths, 512, seed=2, repeats=2)
    assert [r.name for r in a.strategies] == list(STRATEGIES)
    kept = int(np.minimum(lengths, 512).sum())
    for row in a.strategies:
        ref = pack_sequences(np.minimum(lengths, 512), 512, row.name, 2) if STRATEGIES[row.name].cuts_at_row_edges \
            else pack_sequences(lengths, 512, row.name, 2, overlong="truncate")  # the same tokens either way
        assert row.num_bins == ref.num_bins
        assert row.lower_bound == -(-kept // 512)
        assert row.efficiency == pytest.approx(kept / (ref.num_bins * 512))
        assert row.padding_tokens == ref.num_bins * 512 - kept
        assert row.online == STRATEGIES[row.name].input_order
        assert row.time_ms > 0
    assert a.overlong == int((lengths > 512).sum())
    # the candidate at the requested capacity is the default strategy's row of the table
    assert a.candidate_strategy == "obfd"
    assert a.candidate(512).num_bins == a.strategy("obfd").num_bins


def test_speedup_is_padded_positions_over_packed_positions():
    lengths = np.random.default_rng(9).lognormal(5, 1, size=300).astype(np.int64) + 1
    a = analyze_lengths(lengths, 256, batch_size=4, seed=7, strategies=["ffd", "bf"], repeats=1)
    assert a.candidate_strategy == "ffd"  # obfd not asked for: the first strategy given
    for c in a.candidates:
        _, positions, attention = hand_padded(lengths.tolist(), c.capacity, 4, 7)
        bins = pack_sequences(lengths, c.capacity, "ffd", overlong="truncate").num_bins
        assert c.packed_positions == bins * c.capacity
        assert c.speedup == pytest.approx(positions / (bins * c.capacity))
        assert c.attention_ratio == pytest.approx(attention / float((np.minimum(lengths, c.capacity) ** 2).sum()))


def test_candidate_capacities():
    assert candidate_capacities(335.0, 2048) == [128, 256, 512, 1024, 2048]
    assert candidate_capacities(512.0, 512) == [128, 256, 512, 1024]
    assert candidate_capacities(512.5, 100) == [100, 256, 512, 1024, 2048]
    assert candidate_capacities(1.0, 1) == [1, 2]
    a = analyze_lengths([5, 6, 7], 4, capacities=[16, 8], strategies=["nf"], repeats=1)
    assert [c.capacity for c in a.candidates] == [4, 8, 16]
    assert [c.requested for c in a.candidates] == [True, False, False]


def test_recommendation_keeps_a_requested_capacity_that_meets_the_bar():
    lengths = np.random.default_rng(1).integers(50, 300, size=500)
    a = analyze_lengths(lengths, 2048, strategies=["obfd"], repeats=1)
    chosen = a.candidate(2048)
    assert chosen.overlong <= MAX_OVERLONG_FRACTION * 500 and chosen.efficiency >= MIN_EFFICIENCY
    assert a.recommended == 2048
    assert "already meets" in a.reason


def test_recommendation_is_the_smallest_capacity_that_meets_the_bar():
    # 100 sequences of 1000 tokens: at 512 all are truncated; at 1024 one per row (97.7% full) meets the bar
    a = analyze_lengths([1000] * 100, 512, strategies=["obfd"], repeats=1)
    assert [c.capacity for c in a.candidates] == [256, 512, 1024, 2048]
    assert a.candidate(1024).efficiency == pytest.approx(1000 / 1024)
    assert a.recommended == 1024
    assert "smallest candidate" in a.reason and "requested 512 truncates 100" in a.reason


def test_recommendation_when_nothing_packs_well():
    # 600-token sequences: 1 per row of 1024 (58.6%), 3 per row of 2048 (87.9%): none reaches 95%
    a = analyze_lengths([600] * 30, 1024, strategies=["obfd"], repeats=1)
    assert a.candidate(2048).efficiency == pytest.approx(1800 / 2048)
    assert a.recommended == 2048
    assert "no candidate reaches" in a.reason


def test_bad_arguments():
    with pytest.raises(InvalidLengthsError, match="empty"):
        analyze_lengths([], 8)
    with pytest.raises(InvalidLengthsError, match=r"lengths\[1\] = 0"):
        analyze_lengths([3, 0], 8)
    with pytest.raises(InvalidArgumentError, match="capacity must be an integer >= 1, got 0"):
        analyze_lengths([3], 0)
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        analyze_lengths([3], 8, batch_size=0)
    with pytest.raises(InvalidArgumentError, match=r"unknown strategy 'best'.*obfd"):
        analyze_lengths([3], 8, strategies=["obfd", "best"])
