"""Arrange packed bins into data-parallel steps with the same number of steps per rank and balanced load.

A step gives ``micro_batch_size`` bins to each of ``num_ranks`` ranks. Two loads matter: tokens (the cost of the
MLPs and projections, linear in tokens) and Σ len² over the sequences of a bin (the cost of block-diagonal
attention, quadratic in each sequence). A rank that waits for a slower rank at every step wastes the difference,
so both are balanced: bins are ranked by (Σ len², tokens), consecutive bins of that ranking form a step — bins
of a step therefore cost nearly the same — and inside a step the bins are dealt to ranks greedily (largest first,
to the least-loaded rank). The order of steps is then shuffled with the seed, so that training does not see
cheap steps first and expensive ones last.

Grouping by cost changes which bins share a step. Where that must not change — bins that are single samples of a
padding-free run, whose steps should stay random draws — ``group_by="random"`` takes each step's bins from a seeded
permutation, as a random sampler would, and only deals them to the ranks by load: the step's union (hence its
gradient under a loss normalised over the whole step) is untouched, only who computes what.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from padfree.errors import InvalidArgumentError
from padfree.packing.inputs import MAX_PIECES, as_choice, as_positive_int, as_seed
from padfree.packing.result import PackResult, as_pack_result

__all__ = ["BalancedSteps", "balance_bins"]

REMAINDER_POLICIES = ("repeat", "drop")
GROUPINGS = ("cost", "random")


@dataclass(frozen=True, eq=False)
class BalancedSteps:
    """Bins arranged into data-parallel steps.

    Attributes:
        steps: ``(num_steps, num_ranks, micro_batch_size) int64`` — the bin each rank processes in each step.
        tokens: ``(num_bins,) int64`` and ``cost``: ``(num_bins,) int64`` — each bin's tokens and Σ len².
        dropped_bins: ``(d,) int64`` — bins left out by ``remainder="drop"``.
        repeated_bins: ``(r,) int64`` — bins scheduled a second time by ``remainder="repeat"``.
    """

    steps: np.ndarray
    tokens: np.ndarray
    cost: np.ndarray
    dropped_bins: np.ndarray
    repeated_bins: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    @property
    def num_ranks(self) -> int:
        return int(self.steps.shape[1])

    def rank_bins(self, rank: int) -> np.ndarray:
        """``(num_steps * micro_batch_size,) int64`` — the bins of ``rank``, step after step."""
        return self.steps[:, rank, :].reshape(-1)

    def _per_rank(self, per_bin: np.ndarray) -> np.ndarray:
        return per_bin[self.steps].sum(axis=2).astype(np.float64)  # (num_steps, num_ranks)

    def _idle(self, per_bin: np.ndarray) -> float:
        load = self._per_rank(per_bin)
        total = load.mean(axis=1).sum() if load.size else 0.0
        return float(load.max(axis=1).sum() / total - 1.0) if total > 0 else 0.0

    @property
    def token_imbalance(self) -> float:
        """Idle fraction from token imbalance: ``Σ_steps max_rank / Σ_steps mean_rank - 1`` (0 = perfect).

        This is the share of extra time the ranks spend waiting for the slowest rank of each step when time is
        proportional to tokens.
        """
        return self._idle(self.tokens)

    @property
    def cost_imbalance(self) -> float:
        """Idle fraction from attention-cost (Σ len²) imbalance, defined as :attr:`token_imbalance`."""
        return self._idle(self.cost)

    def worst_step(self) -> tuple[float, float]:
        """``(tokens, cost)``: the largest ``max_rank / mean_rank - 1`` of any single step."""
        out = []
        for per_bin in (self.tokens, self.cost):
            load = self._per_rank(per_bin)
            mean = load.mean(axis=1) if load.size else np.zeros(0)
            ok = mean > 0
            out.append(float((load.max(axis=1)[ok] / mean[ok]).max() - 1.0) if ok.any() else 0.0)
        return out[0], out[1]

    def summary(self) -> str:
        """A one-paragraph report of the arrangement and the imbalance it achieved."""
        return (
            f"{self.num_steps} steps x {self.num_ranks} ranks x {self.steps.shape[2]} bins; "
            f"{self.dropped_bins.size} bins dropped, {self.repeated_bins.size} repeated; "
            f"idle from imbalance: tokens {100 * self.token_imbalance:.3f}%, "
            f"attention cost {100 * self.cost_imbalance:.3f}%"
        )


def bin_loads(result: PackResult) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, cost)``: per-bin token count and Σ len² over its pieces, both ``(num_bins,) int64``."""
    if result.num_bins == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lengths = result.placed_lengths
    return result.bin_fill, np.add.reduceat(lengths * lengths, result.bin_offsets[:-1])


def balance_bins(
    result: PackResult,
    num_ranks: int,
    *,
    micro_batch_size: int = 1,
    remainder: str = "repeat",
    seed: int | None = 0,
    group_by: str = "cost",
) -> BalancedSteps:
    """Arrange the bins of ``result`` into steps of ``num_ranks x micro_batch_size`` bins, balanced per step.

    Every rank gets the same number of steps, so no rank waits forever at the end of an epoch. When the bins do
    not divide evenly, ``remainder`` decides: ``"repeat"`` (default, like ``DistributedSampler``) schedules the
    cheapest bins a second time to complete the last step; ``"drop"`` leaves out the cheapest bins. Either way
    the bins concerned are listed in the result.

    Args:
        result: a packing plan.
        num_ranks: data-parallel world size, ``>= 1``.
        micro_batch_size: bins per rank per step, ``>= 1``.
        remainder: ``"repeat"`` or ``"drop"``.
        seed: shuffles the order of steps (``None``: keep steps sorted from cheapest to most expensive).
        group_by: which bins share a step. ``"cost"`` (default): bins of nearly equal cost, the best balance.
            ``"random"``: consecutive bins of a permutation drawn from ``seed`` (``None``: the bins in their own
            order), so a step holds what a random sampler would have drawn; only the dealing to ranks is balanced.
            Balancing then needs ``micro_batch_size > 1`` (with one bin per rank there is no choice to make).

    >>> from padfree import pack_sequences
    >>> plan = pack_sequences([4000, 96, 2000, 2000, 1000, 1000, 1000, 1000, 4096], capacity=4096)
    >>> steps = balance_bins(plan, num_ranks=2, seed=None)
    >>> plan.bins
    [[8], [0], [2, 3], [4, 5, 6, 7, 1]]
    >>> steps.steps[:, :, 0].tolist()  # the bins of each step: [rank 0, rank 1]
    [[3, 2], [1, 0]]
    >>> print(steps.summary())
    2 steps x 2 ranks x 1 bins; 0 bins dropped, 0 repeated; idle from imbalance: tokens 1.186%, attention cost 10.646%

    Single samples as bins, steps of 4 drawn in order (``seed=None``), dealt 2 per rank by load:

    >>> samples = pack_sequences([50, 10, 40, 20, 5, 5, 30, 30], capacity=50, strategy="nf", max_sequences_per_bin=1)
    >>> balance_bins(samples, 2, micro_batch_size=2, seed=None, group_by="random").steps.tolist()
    [[[0, 1], [2, 3]], [[7, 5], [6, 4]]]
    """
    result = as_pack_result(result)
    num_ranks = as_positive_int(num_ranks, "num_ranks")
    micro_batch_size = as_positive_int(micro_batch_size, "micro_batch_size")
    remainder = as_choice(remainder, "remainder", REMAINDER_POLICIES)
    seed = as_seed(seed)
    group_by = as_choice(group_by, "group_by", GROUPINGS)
    per_step = num_ranks * micro_batch_size  # type: ignore[operator]
    if per_step > MAX_PIECES:
        # a step is allocated whole, repeats and all: no plan has this many bins (pieces are int32-indexed)
        raise InvalidArgumentError(
            f"num_ranks * micro_batch_size must be <= {MAX_PIECES} (the most bins a plan can have), got "
            f"{num_ranks} * {micro_batch_size} = {per_step}"
        )
    tokens, cost = bin_loads(result)
    num_bins = tokens.shape[0]
    # cheapest first: (cost, tokens, bin id) — the id makes the ranking total, hence deterministic
    ranking = np.lexsort((np.arange(num_bins), tokens, cost))
    place = np.empty(num_bins, np.int64)
    place[ranking] = np.arange(num_bins)  # each bin's place in that ranking
    if group_by == "random":
        order = np.arange(num_bins) if seed is None else np.random.default_rng(seed).permutation(num_bins)
    else:
        order = ranking
    extra = (-num_bins) % per_step
    dropped = np.zeros(0, np.int64)
    repeated = np.zeros(0, np.int64)
    if extra and remainder == "drop":
        dropped = np.sort(ranking[: per_step - extra])
        order = order[place[order] >= per_step - extra]
    elif extra:
        repeated = np.resize(ranking, extra)  # the cheapest bins, cycled if there are fewer than `extra`
        order = np.concatenate((order, repeated))
        if group_by == "cost":  # the repeats join the cheapest step, not the last
            order = order[np.argsort(place[order], kind="stable")]
    num_steps = order.shape[0] // per_step
    groups = order.reshape(num_steps, per_step)
    # _deal wants each step's bins cheapest first (a no-op for cost groups but for the repeated bins)
    groups = np.take_along_axis(groups, np.argsort(place[groups], axis=1, kind="stable"), axis=1)
    steps = _deal(groups, cost, tokens, num_ranks, micro_batch_size)  # type: ignore[arg-type]
    if seed is not None and group_by == "cost":
        steps = steps[np.random.default_rng(seed).permutation(num_steps)]
    return BalancedSteps(steps, tokens, cost, dropped, np.sort(repeated))


def _deal(groups: np.ndarray, cost: np.ndarray, tokens: np.ndarray, num_ranks: int, mbs: int) -> np.ndarray:
    """Greedy largest-first dealing of each step's bins to ranks, vectorized across steps.

    ``groups: (num_steps, num_ranks * mbs)`` bin ids, sorted ascending by cost within each step.
    Returns ``(num_steps, num_ranks, mbs)``.
    """
    num_steps = groups.shape[0]
    if mbs == 1:
        return groups.reshape(num_steps, num_ranks, 1)
    out = np.empty((num_steps, num_ranks, mbs), np.int64)
    load = np.zeros((num_steps, num_ranks), np.float64)
    filled = np.zeros((num_steps, num_ranks), np.int64)
    rows = np.arange(num_steps)
    # normalised combined load: attention cost and tokens weigh equally
    scale_c = max(float(cost.max()), 1.0) if cost.size else 1.0
    scale_t = max(float(tokens.max()), 1.0) if tokens.size else 1.0
    for j in range(groups.shape[1] - 1, -1, -1):  # per bin slot, not per token: num_ranks * mbs iterations
        b = groups[:, j]
        masked = np.where(filled < mbs, load, np.inf)
        r = np.argmin(masked, axis=1)
        out[rows, r, filled[rows, r]] = b
        filled[rows, r] += 1
        load[rows, r] += cost[b] / scale_c + tokens[b] / scale_t
    return out
