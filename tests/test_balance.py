"""balance_bins: equal steps per rank, balanced tokens and attention cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import InvalidArgumentError, balance_bins, pack_sequences
from padfree.packing.balance import BalancedSteps, bin_loads


@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=120),
    num_ranks=st.integers(1, 6),
    mbs=st.integers(1, 3),
    remainder=st.sampled_from(["repeat", "drop"]),
    seed=st.one_of(st.none(), st.integers(0, 9)),
)
@settings(max_examples=150, deadline=None)
def test_every_bin_scheduled_once_or_counted(lengths, num_ranks, mbs, remainder, seed):
    plan = pack_sequences(lengths, 512)
    steps = balance_bins(plan, num_ranks, micro_batch_size=mbs, remainder=remainder, seed=seed)
    assert steps.steps.shape[1:] == (num_ranks, mbs)
    scheduled = np.sort(steps.steps.reshape(-1))
    if remainder == "drop":
        assert steps.repeated_bins.size == 0
        expected = np.setdiff1d(np.arange(plan.num_bins), steps.dropped_bins)
        assert np.array_equal(scheduled, expected)
        assert steps.dropped_bins.size < num_ranks * mbs
    else:
        assert steps.dropped_bins.size == 0
        assert np.array_equal(scheduled, np.sort(np.concatenate((np.arange(plan.num_bins), steps.repeated_bins))))
        assert steps.repeated_bins.size < num_ranks * mbs
    # each rank gets the same number of steps by construction of the array; rank views agree with it
    assert all(steps.rank_bins(r).size == steps.num_steps * mbs for r in range(num_ranks))


def test_balanced_steps_beat_a_random_assignment():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, 50_000)), 1, 4096).astype(np.int64)
    plan = pack_sequences(lengths, 4096)
    tokens, cost = bin_loads(plan)
    steps = balance_bins(plan, 8, micro_batch_size=2, seed=0)
    shuffled = rng.permutation(plan.num_bins)[: (plan.num_bins // 16) * 16].reshape(-1, 8, 2)
    random = BalancedSteps(shuffled, tokens, cost, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert steps.cost_imbalance < 0.02 < random.cost_imbalance
    assert steps.cost_imbalance < random.cost_imbalance / 20
    # packed bins are nearly all full, so tokens balance almost by themselves; the cost is what needs the work
    assert steps.token_imbalance < 0.001
    assert "idle from imbalance" in steps.summary()
    worst_tokens, worst_cost = steps.worst_step()
    assert worst_tokens >= steps.token_imbalance and worst_cost >= steps.cost_imbalance


def test_loads_are_tokens_and_sum_of_squares():
    plan = pack_sequences([3, 5, 2, 6], 8)
    tokens, cost = bin_loads(plan)
    for b, seqs in enumerate(plan.bins):
        assert tokens[b] == sum([3, 5, 2, 6][s] for s in seqs)
        assert cost[b] == sum([3, 5, 2, 6][s] ** 2 for s in seqs)


def test_seed_shuffles_steps_deterministically():
    plan = pack_sequences(np.arange(1, 400), 1024)
    a, b = balance_bins(plan, 2, seed=5), balance_bins(plan, 2, seed=5)
    assert np.array_equal(a.steps, b.steps)
    assert not np.array_equal(a.steps, balance_bins(plan, 2, seed=6).steps)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_ranks": 0}, "num_ranks must be an integer >= 1, got 0"),
        ({"num_ranks": 2, "micro_batch_size": 0}, "micro_batch_size"),
        ({"num_ranks": 2, "remainder": "pad"}, "remainder must be one of 'repeat', 'drop'"),
        ({"num_ranks": 2, "seed": -1}, "seed must be None or an integer >= 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        balance_bins(pack_sequences([1, 2, 3], 4), **kwargs)
