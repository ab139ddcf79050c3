"""The loss rule (padfree.step_loss.LossRule): a step's loss is the same mean however its tokens are cut.

The property: the same sequences, with the same per-target losses, cut into rows (packed back to back, positions
restarting) and the rows into micro-batches of one optimizer step in two different ways — each micro-batch reduced
by the rule with the step's denominator, the shares summed — give the token mean over every target of the step (and,
for the sequence rule, the mean of the sequences' means). The control: each micro-batch's own mean, averaged over
the micro-batches (what a Trainer without the rule computes), moves with the cut.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from padfree.errors import InvalidArgumentError  # noqa: E402
from padfree.step_loss import LossRule, StepCounts, step_counts  # noqa: E402

IGNORE = -100


def _sequences(draw: st.DrawFn) -> list[tuple[list[bool], list[float]]]:
    """Sequences as (is a target, loss) per token; the first token is never a target."""
    out = []
    for _ in range(draw(st.integers(2, 7))):
        n = draw(st.integers(1, 6))
        targets = [False] + [draw(st.booleans()) for _ in range(n - 1)]
        losses = [draw(st.floats(0.01, 8.0)) if t else 0.0 for t in targets]
        out.append((targets, losses))
    return out


def _cut(draw: st.DrawFn, n: int) -> list[list[int]]:
    """``range(n)`` cut into consecutive non-empty groups."""
    ends = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=n - 1)))) if n > 1 else []
    bounds = [0, *ends, n]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _batch(rows: list[list[tuple[list[bool], list[float]]]]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A micro-batch of packed rows (right-padded to the longest with a padding tail of its own): the model
    inputs, the token losses of ``labels[:, 1:]`` and their target mask."""
    width = max(sum(len(t) for t, _ in row) for row in rows) + 1
    labels = torch.full((len(rows), width), IGNORE)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    losses = torch.zeros((len(rows), width))
    for r, row in enumerate(rows):
        at = 0
        for targets, values in row:
            for i, (t, v) in enumerate(zip(targets, values, strict=True)):
                labels[r, at + i] = 7 if t else IGNORE
                losses[r, at + i] = v
                positions[r, at + i] = i
            at += len(targets)
        positions[r, at:] = torch.arange(width - at)  # the padding tail: a sequence of its own, no target
    mask = labels[:, 1:] != IGNORE
    return {"labels": labels, "position_ids": positions}, losses[:, 1:] * mask, mask


def _step_loss(rule: LossRule, batches: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> float:
    step = step_counts([b for b, _, _ in batches], device="cpu")
    denominator = rule.denominator(step, world=1)
    return float(sum(rule.reduce(loss, mask, b, denominator) for b, loss, mask in batches))


@st.composite
def _recut(draw: st.DrawFn) -> tuple[list, list, list]:
    """The same sequences cut two ways: into rows, and the rows into micro-batches."""
    seqs = _sequences(draw)
    cuts = []
    for _ in range(2):
        rows = [[seqs[i] for i in group] for group in _cut(draw, len(seqs))]
        cuts.append([_batch([rows[i] for i in group]) for group in _cut(draw, len(rows))])
    return seqs, cuts[0], cuts[1]


@settings(max_examples=60, deadline=None)
@given(_recut())
def test_the_token_rule_is_the_same_mean_however_rows_and_micro_batches_are_cut(case):
    seqs, first, second = case
    losses = [v for targets, values in seqs for t, v in zip(targets, values, strict=True) if t]
    expected = sum(losses) / len(losses) if losses else 0.0
    means = [sum(v for t, v in zip(*s, strict=True) if t) / sum(s[0]) for s in seqs if any(s[0])]
    for rule, want in ((LossRule("token"), expected), (LossRule("sequence"), sum(means) / max(len(means), 1))):
        for cut in (first, second):
            assert _step_loss(rule, cut) == pytest.approx(want, rel=1e-5, abs=1e-6), rule.mode


def test_the_mean_of_micro_batch_means_moves_with_the_cut_and_the_rule_does_not():
    short, long = ([False, True], [0.0, 4.0]), ([False, True, True, True], [0.0, 1.0, 1.0, 1.0])
    rule = LossRule("token")
    apart = [_batch([[short]]), _batch([[long]])]
    together = [_batch([[short, long]])]
    assert _step_loss(rule, apart) == pytest.approx(_step_loss(rule, together)) == pytest.approx(7.0 / 4)
    # the control: each micro-batch's own mean, averaged over the step's micro-batches
    naive = sum(float(rule.reduce(loss, mask, b, None)) for b, loss, mask in apart) / len(apart)
    assert naive == pytest.approx((4.0 + 1.0) / 2) != pytest.approx(7.0 / 4)


def test_step_counts_and_the_denominator_over_ranks():
    batch, _, _ = _batch([[([False, True, True], [0.0, 1.0, 1.0]), ([False, True], [0.0, 1.0])]])
    step = step_counts([batch, batch], device="cpu")
    assert isinstance(step, StepCounts) and (float(step.targets), float(step.sequences)) == (6.0, 4.0)
    assert float(LossRule("sequence").denominator(step, world=2)) == 2.0
    assert LossRule("token").denominator(None, world=2) is None
    pairs = {"input_ids": torch.zeros(6, 3, dtype=torch.long)}
    assert float(LossRule("pair").batch_count(pairs)) == 3.0
    with pytest.raises(InvalidArgumentError, match="pairs"):
        LossRule("pair").count(step)
    with pytest.raises(InvalidArgumentError, match=r"one of \['token', 'sequence', 'pair'\], got 'tokens'"):
        LossRule("tokens")


def test_divide_gives_the_rule_zero_and_transformers_nan_for_an_empty_count():
    total = torch.tensor(0.0, requires_grad=True)
    assert float(LossRule.divide(total, 0).detach()) == 0.0
    nan = LossRule.divide(total, torch.tensor(0.0), empty="nan")
    assert torch.isnan(nan)
    nan.backward()
    assert float(total.grad) == 1.0  # the gradient of total / 1: a sum of no target has none to pass on
    assert float(LossRule.divide(torch.tensor(3.0), torch.tensor(1.5), empty="nan")) == 2.0
