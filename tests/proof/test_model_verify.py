"""``padfree.verify`` refuses token ids its model cannot embed — by sample, position and vocabulary size — before it
runs anything (torch would stop inside the embedding with an IndexError, or a device-side assert on CUDA)."""

from __future__ import annotations

import pytest
import torch
import transformers

import padfree
from padfree import pack_result_to_tensors, pack_sequences, verify
from padfree.errors import InvalidArgumentError, InvalidTokensError, PackingMismatchError

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config).train()


def untouched(model: torch.nn.Module) -> bool:
    return model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("data", "message"), [
    ([[5, 6, 7], [8, VOCAB]], f"data[1][1] = {VOCAB} is not below the vocabulary size {VOCAB}"),
    ([[5, 6, 7], [8, 9, 10_000]], f"data[1][2] = 10000 is not below the vocabulary size {VOCAB}"),
    ([[5, 6, -1], [8, 9]], "data[0][2] = -1 is negative; token ids are integers >= 0"),
    ([torch.tensor([5, 6]), torch.tensor([7, 8, VOCAB + 3])],
     f"data[1][2] = {VOCAB + 3} is not below the vocabulary size {VOCAB}"),
])
def test_an_id_outside_the_vocabulary_is_named_by_sample_and_position(model, data, message):
    with pytest.raises(InvalidTokensError) as caught:
        verify(model, data)
    assert str(caught.value) == message
    assert untouched(model)


def test_a_packed_batch_is_checked_slot_by_slot(model):
    seqs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    batch = pack_result_to_tensors(pack_sequences([len(s) for s in seqs], 8), seqs, pad_to="longest")
    batch.input_ids[0, 3] = VOCAB
    with pytest.raises(InvalidTokensError, match=rf"^data\.input_ids\[0\]\[3\] = {VOCAB} is not below the "
                                                 rf"vocabulary size {VOCAB}$"):
        verify(model, batch)
    assert untouched(model)


def test_the_vocabulary_is_what_the_embedding_holds_not_what_the_config_says(model):
    # a config edited by hand (or a model resized without updating it) must not let an id past the embedding
    model.config.vocab_size = 10 * VOCAB
    try:
        with pytest.raises(InvalidTokensError, match=f"is not below the vocabulary size {VOCAB}$"):
            verify(model, [[1, 2, 3], [4, VOCAB + 1]])
    finally:
        model.config.vocab_size = VOCAB
    assert verify(model, [[1, 2, 3], [4, VOCAB - 1]]).num_sequences == 2  # the last id of the vocabulary is fine


# ---- the tolerance the run calibrates itself (atol="auto") ------------------------------------------------------

SEQS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23]]


def _tiny(model_type: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from padfree.proof.tiny import build_tiny

    return build_tiny(model_type).to(dtype)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_under_bf16_autocast_the_tolerance_is_what_rounding_moves_each_sequence(model_type):
    """fp32 weights under autocast: the bound is three times each sequence's bf16-vs-fp32 distance (far above
    fp32's), the packed row is within it, and the control — positions never restarting — lands beyond it."""
    model = _tiny(model_type)
    padfree.configure_packing(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = verify(model, SEQS)
    assert report.rounding is not None and report.atol == pytest.approx(3 * report.rounding)
    assert report.atol > 100 * 1e-5 and report.ok, report
    assert report.conclusive and report.control > 10 * report.atol, report
    assert "leaking control" in str(report) and "a leak would show" in str(report)


def test_bf16_weights_are_calibrated_against_an_ordinary_padded_batch():
    model = _tiny("llama", torch.bfloat16)
    padfree.configure_packing(model)
    report = verify(model, SEQS)
    assert report.rounding is not None and report.ok and report.conclusive, report


def test_the_same_calibrated_check_catches_a_model_that_leaks():
    """The negative control of the check itself: transformers' own Mamba on a packed row (not configured) carries its
    state across the boundaries; under autocast that is far beyond the calibrated bound."""
    model = _tiny("mamba")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = verify(model, SEQS)
    assert not report.ok and report.max_logit_diff > 10 * report.atol, report
    with pytest.raises(PackingMismatchError, match="MISMATCH"):
        report.raise_for_mismatch()


def test_fp32_keeps_the_1e_5_bound_and_a_given_atol_is_used_as_given(model):
    padfree.configure_packing(model)
    auto = verify(model, SEQS)
    assert auto.atol == 1e-5 and auto.rounding < 1e-6 and auto.ok and auto.conclusive  # fp32 rounding: far below
    given = verify(model, SEQS, atol=1e-3)
    assert given.atol == given.loss_atol == given.grad_atol == 1e-3 and given.control is None
    with pytest.raises(InvalidArgumentError, match='atol must be "auto" or a finite number'):
        verify(model, SEQS, atol="rounding")


def test_a_model_whose_fp32_rounding_exceeds_1e_5_is_bounded_by_its_own_rounding():
    """Large weights (a policy far from its initialisation) make fp32 GatedDeltaNet runs differ by ~3e-4 between two
    exact chunkings; the packed row is within three times that, and the leak is still far beyond it."""
    model = _tiny("qwen3_5_text")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    padfree.configure_packing(model)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (71, 68, 56, 33)]
    report = verify(model, seqs, check_grads=False)
    assert report.ok and report.conclusive, report
    assert report.max_logit_diff > 1e-5, report  # beyond the fixed fp32 bound: rounding, not a leak


# ---- what the calibrated check runs -------------------------------------------------------------------------------


def _forwards(model: torch.nn.Module, run) -> tuple[list[tuple[int, ...]], int]:
    """The ``(rows, width)`` of every forward ``run()`` makes with an ``attention_mask`` (an ordinary padded batch),
    and how many positions in all the output head projects to logits."""
    padded, projected = [], []
    pre = model.register_forward_pre_hook(
        lambda m, a, k: padded.append(tuple(k["input_ids"].shape)) if k.get("attention_mask") is not None else None,
        with_kwargs=True)
    head = model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: projected.append(out.shape[:-1].numel()))
    try:
        run()
    finally:
        pre.remove()
        head.remove()
    return padded, sum(projected)


def test_the_calibration_pads_once_and_projects_only_real_tokens_to_logits():
    """fp32: the right- and left-padded references are one ordinary batch (a sequence as long as the widest is the
    same row on both sides), the padding's logits are not computed, and the control computes the logits of the
    sequences after each row's first only — the same comparisons, at 71 projected positions where there were 93."""
    model = _tiny("llama")
    padfree.configure_packing(model)
    report = None

    def run():
        nonlocal report
        report = verify(model, SEQS, check_grads=False)

    padded, projected = _forwards(model, run)
    assert report.ok and report.conclusive and report.atol == 1e-5, report
    assert padded == [(5, 7)]  # 7, 6, 4 right-padded; 6 and 4 left-padded (7 fills its row either way)
    # packed row 17 + alone 7 + 6 + 4 + control (the 6 and the 4 after the row's first) 10 + right 17 + left 10
    assert projected == 17 + 17 + 10 + 17 + 10


def test_under_autocast_the_fp32_reference_and_the_left_padded_rows_are_the_calibration():
    model = _tiny("qwen3_5_text")
    padfree.configure_packing(model)
    report = None

    def run():
        nonlocal report
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = verify(model, SEQS, check_grads=False)

    padded, projected = _forwards(model, run)
    assert report.ok and report.conclusive and report.control > 10 * report.atol, report
    assert padded == [(3, 7)]
    assert projected == 17 + 17 + 17 + 10 + 17  # packed, alone, alone in fp32, control, left-padded


def test_a_head_the_check_cannot_narrow_gives_the_same_verdict(monkeypatch):
    """A model whose output head is not reachable (``get_output_embeddings()`` None: a compiled or custom head) is
    checked on every position's logits: the same tolerance, control and verdict."""
    model = _tiny("llama")
    padfree.configure_packing(model)
    narrowed = verify(model, SEQS)
    monkeypatch.setattr(type(model), "get_output_embeddings", lambda self: None)
    monkeypatch.setattr(type(model), "forward", _without_logits_to_keep(type(model).forward))
    full = verify(model, SEQS)
    assert (full.ok, full.conclusive, full.atol) == (narrowed.ok, narrowed.conclusive, narrowed.atol) == (True, True,
                                                                                                         1e-5)
    assert full.control == pytest.approx(narrowed.control, rel=1e-4)
    assert full.loss_atol == pytest.approx(narrowed.loss_atol, rel=1e-4)
    assert full.max_grad_diff <= full.grad_atol and narrowed.max_grad_diff <= narrowed.grad_atol


def _without_logits_to_keep(forward):
    """``forward`` behind a signature without ``logits_to_keep`` (as a wrapper taking ``**kwargs`` has)."""
    def wrapped(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return wrapped


def test_a_compiled_model_is_run_as_it_was_compiled():
    """torch.compile's graph took no ``logits_to_keep`` and no head hook: the check adds neither (either would compile
    the model again), and computes every position's logits."""
    model = _tiny("llama")
    padfree.configure_packing(model)
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(sorted(k)), with_kwargs=True)
    compiled = torch.compile(model, backend="eager")
    report = verify(compiled, SEQS, check_grads=False)
    assert report.ok and report.conclusive, report
    assert not any("logits_to_keep" in keys for keys in calls) and len(calls) == 6, calls  # the padding in one
    assert not model.get_output_embeddings()._forward_pre_hooks


def test_a_model_that_reshapes_its_logits_by_the_batch_is_checked_on_every_position(monkeypatch):
    model = _tiny("llama")
    padfree.configure_packing(model)
    forward = type(model).forward

    def reshaping(self, input_ids=None, **kwargs):
        out = forward(self, input_ids=input_ids, **kwargs)
        out.logits = out.logits.reshape(*input_ids.shape, -1)  # as a model that reads its logits per row does
        return out

    monkeypatch.setattr(type(model), "forward", reshaping)
    report = verify(model, SEQS)
    assert report.ok and report.conclusive and report.atol == 1e-5, report
