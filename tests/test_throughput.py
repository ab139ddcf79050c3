"""padfree.throughput: the same real tokens laid out as padded, grouped, TRL, packed and ideal steps, then trained."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
import transformers

from padfree.errors import InvalidArgumentError, PadfreeError
from padfree.throughput import (
    MEGABATCH_MULT,
    MODES,
    boundary_leak,
    build_plans,
    compare_training,
    length_grouped_order,
    sample_sequences,
)

VOCAB = 97


def tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(2, 30, 80), rng.integers(60, 200, 6)])  # short records, a long tail
    return [rng.integers(1, VOCAB, n) for n in rng.permutation(lengths)]


def real_tokens_of(step: dict, mode: str) -> np.ndarray:
    """The sample tokens a step holds (padding removed), in row order."""
    ids = step["input_ids"]
    if "attention_mask" in step:
        return ids[step["attention_mask"] == 1].numpy()
    if mode == "packed":
        pos, labels = step["position_ids"].reshape(-1), step["labels"].reshape(-1)
        starts = [*torch.nonzero(pos == 0).flatten().tolist(), pos.numel()]
        keep = torch.zeros(pos.numel(), dtype=torch.bool)
        # padding tails restart at 0 too, with every label -100 (each sequence here has >= 2 tokens: a target)
        for a, b in itertools.pairwise(starts):
            if (labels[a + 1:b] != -100).any():
                keep[a:b] = True
        return ids.reshape(-1)[keep].numpy()
    return ids.reshape(-1).numpy()


# ---- the sample ----------------------------------------------------------------------------------


def test_sample_truncates_or_splits_and_respects_the_budget(sequences):
    lengths = np.array([len(s) for s in sequences])
    full = sample_sequences(sequences, None, 64, seed=None)
    assert full.lengths.tolist() == np.minimum(lengths, 64).tolist()
    split = sample_sequences(sequences, None, 64, overlong="split", seed=None)
    assert split.values.tolist() == np.concatenate(sequences).tolist()  # no token lost, order kept
    assert split.lengths.max() <= 64
    some = sample_sequences(sequences, 500, 64, seed=3)
    assert 500 <= some.lengths.sum() < 500 + 64
    assert some.lengths.sum() - some.lengths[-1] < 500  # stops at the first sequence that reaches the budget
    again = sample_sequences(sequences, 500, 64, seed=3)
    assert np.array_equal(some.values, again.values)
    other = sample_sequences(sequences, 500, 64, seed=4)
    assert not np.array_equal(some.values[:50], other.values[:50])


def test_sample_refuses_bad_input():
    with pytest.raises(InvalidArgumentError, match="no non-empty sequence"):
        sample_sequences([[], []], None, 8)
    with pytest.raises(PadfreeError, match="capacity"):
        sample_sequences([[1, 2]], None, 0)
    with pytest.raises(PadfreeError, match="overlong"):
        sample_sequences([[1, 2]], None, 8, overlong="drop")


# ---- plans ---------------------------------------------------------------------------------------


def test_every_plan_holds_exactly_the_sample(sequences):
    sample = sample_sequences(sequences, None, 64, seed=1)
    plans = build_plans(sample, 64, 4, tuple(MODES), seed=1)
    assert list(plans) == list(MODES)
    expected = np.sort(sample.values)
    for mode, plan in plans.items():
        assert plan.real_tokens == int(sample.lengths.sum()), mode
        assert plan.sequences == len(sample)
        got = np.concatenate([real_tokens_of(s.inputs, mode) for s in plan.steps])
        assert np.array_equal(np.sort(got), expected), mode
        for step in plan.steps:
            assert step.inputs["input_ids"].numel() == step.positions
            assert step.positions <= 4 * 64 or mode == "trl"
            assert step.inputs["use_cache"] is False
    assert plans["ideal"].positions == plans["ideal"].real_tokens  # no padding at all
    assert plans["trl"].positions == plans["trl"].real_tokens
    assert plans["packed"].efficiency > plans["padded"].efficiency
    assert all(s.inputs["input_ids"].shape[1] == 64 for s in plans["packed"].steps)
    # the ideal rows are the sample's tokens in order, cut into rows of C
    assert np.array_equal(np.concatenate([s.inputs["input_ids"].reshape(-1).numpy() for s in plans["ideal"].steps]),
                          sample.values)


def test_padded_steps_are_what_the_hf_collator_makes(sequences):
    sample = sample_sequences(sequences, None, 64, seed=None)
    plan = build_plans(sample, 64, 3, ("padded",), seed=None)["padded"]
    step = plan.steps[0].inputs
    lens = sample.lengths[:3]
    assert step["input_ids"].shape == (3, int(lens.max()))
    assert step["attention_mask"].sum(1).tolist() == lens.tolist()
    assert torch.equal(step["labels"] == -100, step["attention_mask"] == 0)
    for row, n in enumerate(lens):
        start = int(sample.offsets[row])
        assert step["input_ids"][row, :n].tolist() == sample.values[start:start + n].tolist()
        assert (step["input_ids"][row, n:] == 0).all()


def test_length_grouped_order_sorts_each_megabatch():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 500, 1000)
    order = length_grouped_order(lengths, batch_size=4, seed=2)
    assert sorted(order.tolist()) == list(range(1000))
    assert lengths[order[0]] == lengths.max()  # the longest first, as in transformers
    size = MEGABATCH_MULT * 4
    for start in range(size, 1000, size):  # past the first megabatch (its head was swapped)
        chunk = lengths[order[start:start + size]]
        assert (np.diff(chunk) <= 0).all()


def test_build_plans_refuses_bad_input(sequences):
    sample = sample_sequences(sequences, None, 64, seed=None)
    with pytest.raises(InvalidArgumentError, match="longer than capacity"):
        build_plans(sample, 32, 2, ("packed",))
    with pytest.raises(PadfreeError, match="modes"):
        build_plans(sample, 64, 2, ("packed", "shuffled"))
    with pytest.raises(PadfreeError, match="rows"):
        build_plans(sample, 64, 0, ("packed",))


# ---- training ------------------------------------------------------------------------------------


def test_compare_training_measures_every_mode_from_the_same_weights(sequences):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen: list[tuple[str, int]] = []
    report = compare_training(model, sequences, capacity=64, rows=4, budget=600, repetitions=2, seed=0,
                              modes=("padded", "grouped", "packed", "ideal"),
                              progress=lambda mode, rep, n: seen.append((mode, rep)))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the caller's weights are given back
    assert list(report.results) == ["padded", "grouped", "packed", "ideal"]
    for r in report.results.values():
        assert len(r.seconds) == 2 and all(s > 0 for s in r.seconds)
        assert r.steps == len(r.losses) == len(r.step_tokens)
        assert np.isfinite(r.losses).all() and r.losses[0] > r.losses[-1] - 1.0
        assert r.tokens_per_second == pytest.approx(r.real_tokens / np.median(r.seconds))
        assert np.isfinite(r.final_loss())
    assert {rep for _, rep in seen} == {-1, 0, 1}  # warm-up, then two passes
    assert report.speedup("packed", "padded") == pytest.approx(
        report["packed"].tokens_per_second / report["padded"].tokens_per_second)
    assert set(report.ratios()) == {"padded", "grouped", "ideal"}
    assert report.exactness.ok and report.exactness.num_sequences >= 2
    assert "packed" in str(report) and "tokens/s" in str(report)
    json.dumps(report.as_dict())


def test_the_first_steps_of_packed_and_padded_agree_when_they_hold_the_same_sequences(sequences):
    # one packed row and one padded batch of the same sequences: the same token-mean loss from the same weights
    model = tiny_llama()
    sample = sample_sequences(sequences[:5], None, 200, seed=None)
    plans = build_plans(sample, int(sample.lengths.sum()), 5, ("padded", "packed"), seed=None)
    assert len(plans["padded"].steps) == len(plans["packed"].steps) == 1
    report = compare_training(model, None, capacity=int(sample.lengths.sum()), rows=5, plans=plans, repetitions=1)
    assert report["packed"].losses[0] == pytest.approx(report["padded"].losses[0], abs=1e-5)


def test_trl_mode_runs_trl_collator_and_reports_its_boundaries(sequences):
    pytest.importorskip("trl")
    model = tiny_llama()
    report = compare_training(model, sequences, capacity=64, rows=2, budget=300, repetitions=1,
                              modes=("trl", "packed"))
    # stock llama, one flattened row with restarting position_ids and use_cache=False: transformers makes it exact
    assert report.leaks["trl"] < 1e-4
    trl_steps = report["trl"].steps
    assert report.cross_targets["trl"] == report.sequences - trl_steps
    assert report.cross_targets["packed"] == 0


def test_trl_mode_takes_its_loss_through_trls_fused_head_as_sfttrainer_does(sequences):
    utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head: the trl mode uses the stock loss")
    sample = sample_sequences(sequences, 300, 64, seed=0)
    plans = build_plans(sample, 64, 2, ("trl",), seed=0)
    assert plans["trl"].loss == "trl"
    plans["trl_stock"] = dataclasses.replace(plans["trl"], mode="trl_stock", loss="stock")
    report = compare_training(tiny_llama(), None, capacity=64, rows=2, plans=plans, repetitions=1)
    # the same steps, the same weights and AdamW: TRL's head gives the stock loss, step after step
    assert len(report["trl"].losses) >= 2
    assert report["trl"].losses == pytest.approx(report["trl_stock"].losses, abs=1e-5)


def test_boundary_leak_sees_a_model_that_mixes_sequences():
    model = tiny_llama()
    ids = torch.randint(1, VOCAB, (1, 30))
    restart = torch.cat([torch.arange(10), torch.arange(20)])[None]
    # with restarting position_ids transformers keeps the two sequences apart ...
    assert boundary_leak(model, {"input_ids": ids, "position_ids": restart, "use_cache": False}, [10, 20]) < 1e-4
    # ... with a 0/1 attention mask it does not
    mixed = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    assert boundary_leak(model, mixed, [10, 20]) > 1e-3


def test_compare_training_refuses_bad_arguments(sequences):
    model = tiny_llama()
    with pytest.raises(PadfreeError, match="repetitions"):
        compare_training(model, sequences, capacity=64, rows=2, repetitions=0)
    with pytest.raises(InvalidArgumentError, match="lr"):
        compare_training(model, sequences, capacity=64, rows=2, lr=float("nan"))
