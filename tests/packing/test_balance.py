"""balance_bins: equal steps per rank, balanced tokens and attention cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from padfree import InvalidArgumentError, pack_sequences
from padfree.packing import balance_bins
from padfree.packing.balance import BalancedSteps, bin_loads


@given(
    lengths=st.lists(st.integers(1, 300), min_size=0, max_size=120),
    num_ranks=st.integers(1, 6),
    mbs=st.integers(1, 3),
    remainder=st.sampled_from(["repeat", "drop"]),
    seed=st.one_of(st.none(), st.integers(0, 9)),
    group_by=st.sampled_from(["cost", "random"]),
)
@settings(max_examples=150, deadline=None)
def test_every_bin_scheduled_once_or_counted(lengths, num_ranks, mbs, remainder, seed, group_by):
    plan = pack_sequences(lengths, 512)
    steps = balance_bins(plan, num_ranks, micro_batch_size=mbs, remainder=remainder, seed=seed, group_by=group_by)
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


def _singletons(lengths) -> object:
    """A plan with one sample per bin, in order (the bins of a padding-free run)."""
    return pack_sequences(lengths, int(max(lengths)), strategy="nf", max_sequences_per_bin=1)


def test_random_grouping_keeps_the_random_steps_and_balances_within_them():
    rng = np.random.default_rng(4)
    lengths = np.clip(np.round(rng.lognormal(np.log(250), 1.0, 4_000)), 1, 4096).astype(np.int64)
    plan = _singletons(lengths)
    num_ranks, mbs = 4, 8
    steps = balance_bins(plan, num_ranks, micro_batch_size=mbs, seed=7, group_by="random", remainder="drop")
    # the steps are consecutive draws of the seeded permutation, whatever the costs: a random sampler's steps
    perm = np.random.default_rng(7).permutation(plan.num_bins)
    perm = perm[~np.isin(perm, steps.dropped_bins)]
    per_step = num_ranks * mbs
    assert np.array_equal(np.sort(steps.steps.reshape(steps.num_steps, -1), axis=1),
                          np.sort(perm.reshape(-1, per_step), axis=1))
    # dealing within the step: far less idle than the same steps cut into ranks by position
    tokens, cost = bin_loads(plan)
    naive = BalancedSteps(perm.reshape(-1, num_ranks, mbs), tokens, cost, steps.dropped_bins, steps.repeated_bins)
    assert steps.token_imbalance < naive.token_imbalance / 3
    # Σ len² of single samples is ruled by the giants (one 4096-token sample costs 270 median ones): no dealing
    # beats max(the step's costliest sample, its mean per rank); the dealing comes close to that bound
    per_step_cost = cost[steps.steps.reshape(steps.num_steps, -1)]
    mean = per_step_cost.sum(axis=1) / num_ranks
    bound = np.maximum(per_step_cost.max(axis=1), mean).sum() / mean.sum() - 1
    assert steps.cost_imbalance < min(naive.cost_imbalance, bound + 0.1)
    # a different seed draws different steps; cost grouping would have put similar samples together instead
    other = balance_bins(plan, num_ranks, micro_batch_size=mbs, seed=8, group_by="random")
    assert not np.array_equal(np.sort(other.steps[0].reshape(-1)), np.sort(steps.steps[0].reshape(-1)))
    by_cost = balance_bins(plan, num_ranks, micro_batch_size=mbs, seed=7)
    spread = [np.ptp(lengths[s.steps.reshape(s.num_steps, -1)], axis=1).mean() for s in (steps, by_cost)]
    assert spread[0] > 10 * spread[1]


def test_random_grouping_without_seed_takes_bins_in_order():
    plan = _singletons([50, 10, 40, 20, 5, 5, 30, 30, 7])
    steps = balance_bins(plan, 2, micro_batch_size=2, seed=None, group_by="random", remainder="repeat")
    assert [sorted(s.reshape(-1).tolist()) for s in steps.steps[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(steps.steps[2].reshape(-1).tolist()) == [4, 5, 8, 8]  # 8, then the 3 cheapest bins again
    assert steps.repeated_bins.tolist() == [4, 5, 8]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_ranks": 0}, "num_ranks must be an integer >= 1, got 0"),
        ({"num_ranks": 2, "micro_batch_size": 0}, "micro_batch_size"),
        ({"num_ranks": 2, "remainder": "pad"}, "remainder must be one of 'repeat', 'drop'"),
        ({"num_ranks": 2, "seed": -1}, "seed must be None or an integer >= 0"),
        ({"num_ranks": 2, "group_by": "length"}, "group_by must be one of 'cost', 'random'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        balance_bins(pack_sequences([1, 2, 3], 4), **kwargs)
