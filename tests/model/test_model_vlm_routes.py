"""Vision-language models packed with images on the routes users train them by: activation checkpointing (both
``use_reentrant`` modes, forwards interleaved before a backward), a PEFT LoRA wrapper, ``torch.compile`` and bf16
autocast.

Every case configures the model with :func:`padfree.configure_packing`, packs the probe samples of
:func:`padfree.model.images.probe_samples` (an image; text only; two images) into one row
(:func:`padfree.model.images.pack_samples`) and compares one training step of that row with each sample run alone
through transformers: logits, the token-mean loss and every gradient — the vision tower's included where it trains —
in fp32 within 1e-5 (gradients relative to their parameter's largest, at least 1). Each has a negative control the
same comparison catches: the packed row with positions running on over the row (no boundary), or, for a recompute, a
stale-state design that hands it the boundaries of the model's latest forward. Under bf16 autocast the bound is three
times what rounding moves the per-sample run from fp32, and the control lands beyond it.

One model per image route: Qwen2-VL (``rope``: per-sample mRoPE rows), Qwen3.5 (mRoPE and GatedDeltaNet layers, whose
recompute must reset at its own forward's boundaries), Gemma3 (``blocks``: bidirectional image blocks), LLaVA
(``causal``); PaliGemma for the blocks route under autocast (each sample's prefix a block).
"""

from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import padfree  # noqa: E402
from padfree.model import flight, images  # noqa: E402
from padfree.proof.compare import perturb  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import span_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
ROUTES = {"qwen2_vl": "rope", "qwen3_5": "rope", "gemma3": "blocks", "llava": "causal", "paligemma": "blocks"}
TOWER = re.compile(r"(visual|vision_tower|multi_modal_projector)\.")  # the image path's parameters


def _build(model_type: str) -> transformers.PreTrainedModel:
    """The tiny vision-language model of ``model_type`` in training mode (checkpointing runs in training only), no
    dropout draws (every run computes the same function)."""
    if model_type == "gemma3":  # its class shares the causal-LM mapping: built here, with a consistent image geometry
        cfg = shrink_config(default_config("gemma3"))
        cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id = 90, 91, 92
        cfg.mm_tokens_per_image = 4
        cfg.vision_config.image_size, cfg.vision_config.patch_size = 64, 16
        torch.manual_seed(0)
        model = perturb(transformers.Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation="sdpa"))
    else:
        model = build_tiny(model_type, multimodal=True)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


@dataclasses.dataclass
class Case:
    """A model, its probe samples, their packed row, and the reference step of each sample alone (fp32)."""

    model: transformers.PreTrainedModel
    samples: list
    row: dict
    logits: torch.Tensor
    loss: float
    grads: dict


def _grads(model) -> dict[str, torch.Tensor]:
    """Every gradient, by the parameter's name without compile's prefix."""
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _spans(samples) -> list[tuple[int, int]]:
    lengths = [s["input_ids"].shape[1] for s in samples]
    return [(sum(lengths[:i]), n) for i, n in enumerate(lengths)]


def _alone(model, samples) -> tuple[torch.Tensor, float, dict]:
    """Logits of every sample run alone (concatenated), the token-mean loss over them all and its gradients."""
    model.zero_grad(set_to_none=True)
    total = sum(s["input_ids"].shape[1] - 1 for s in samples)
    logits, loss = [], 0.0
    for s in samples:
        n = s["input_ids"].shape[1]
        out = model(**s, use_cache=False).logits
        part = span_loss(out.float(), s["input_ids"], [(0, n)]) * (n - 1) / total
        part.backward()
        loss += float(part)
        logits.append(out[0].detach().float())
    return torch.cat(logits), loss, _grads(model)


def _forward(model, row, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed row's logits ``(1, T, V)`` and its token-mean loss over the samples (graph kept)."""
    out = model(**row, use_cache=False).logits
    return out, span_loss(out.float(), row["input_ids"], _spans(samples))


def _packed(model, row, samples) -> tuple[torch.Tensor, float, dict]:
    model.zero_grad(set_to_none=True)
    logits, loss = _forward(model, row, samples)
    loss.backward()
    return logits[0].detach().float(), float(loss), _grads(model)


def _relative(got: dict, want: dict) -> float:
    """The largest gradient difference relative to its parameter's largest gradient (at least 1)."""
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max()) / max(1.0, float(want[k].abs().max())) for k in want)


def _running_on(row: dict) -> dict:
    """The control: the packed row with positions running on over the whole row (no sample boundary)."""
    return {**row, "position_ids": torch.arange(row["input_ids"].shape[1])[None]}


def _assert_exact(step, case: Case) -> None:
    logits, loss, grads = step
    assert float((logits - case.logits).abs().max()) <= ATOL
    assert abs(loss - case.loss) <= ATOL
    assert _relative(grads, case.grads) <= ATOL
    assert any(TOWER.search(name) for name in grads)  # the vision tower's gradients compared too


@pytest.fixture(scope="module")
def cases():
    """``model_type -> Case``, built at first use and shared by the module's tests (each test leaves its model
    unconfigured, without checkpointing, its gradients cleared)."""
    built: dict[str, Case] = {}

    def get(model_type: str) -> Case:
        if model_type not in built:
            model = _build(model_type)
            assert images.image_route(model) == ROUTES[model_type]
            samples = images.probe_samples(model)
            built[model_type] = Case(model, samples, images.pack_samples(model, samples), *_alone(model, samples))
        return built[model_type]

    return get


@pytest.fixture
def restore():
    """Models a test configured or checkpointed (and hooks it added), given back as built."""
    models = []
    yield lambda *given: models.extend(given)
    for model in models:
        if isinstance(model, torch.utils.hooks.RemovableHandle):
            model.remove()
            continue
        padfree.unconfigure_packing(model)
        model.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)


def _checkpointed(model, reentrant: bool, restore) -> list[int]:
    """Checkpoint ``model``'s layers (transformers' own route) and configure it; returns a counter of the first
    decoder layer's MLP calls (a recompute calls it again)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    padfree.configure_packing(model)
    calls = [0]
    mlp = model.get_decoder().layers[0].mlp
    restore(mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)))
    return calls


# ---- activation checkpointing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_5", "gemma3", "llava"])
def test_checkpointed_packed_step_with_images_equals_each_sample_alone(cases, restore, model_type, reentrant):
    case = cases(model_type)
    restore(case.model)
    calls = _checkpointed(case.model, reentrant, restore)
    _assert_exact(_packed(case.model, case.row, case.samples), case)
    assert calls[0] == 2  # the forward and its recompute in the backward
    leak, leak_loss, leak_grads = _packed(case.model, _running_on(case.row), case.samples)  # the control
    assert float((leak - case.logits).abs().max()) > 1e-3 and abs(leak_loss - case.loss) > 1e-4
    assert _relative(leak_grads, case.grads) > 1e-3


def _stale_recompute(monkeypatch) -> None:
    """A stale-state design, for the control: every recompute reads the boundaries of its model's latest packed
    forward instead of the ones its own forward saved."""
    latest = {}
    enter = flight.enter

    def remember(state, layout, unbound=""):
        if layout is not None:
            latest[id(state)] = layout
        return enter(state, layout, unbound)

    def replay(frames, function, *args, **kwargs):
        with flight.forward_of(frames[-1].state, latest[id(frames[-1].state)]):
            return function(*args, **kwargs)

    monkeypatch.setattr(flight, "enter", remember)
    monkeypatch.setattr(flight, "_replay", replay)


def _interleaved(case: Case) -> tuple[tuple, tuple]:
    """Two packed forwards of the samples, in order and reversed (other boundaries, the same width), then the first
    one's backward and the second's: each step's ``(logits, loss, grads)``."""
    model, samples = case.model, case.samples
    model.zero_grad(set_to_none=True)
    first = _forward(model, case.row, samples)
    second = _forward(model, images.pack_samples(model, samples[::-1]), samples[::-1])
    first[1].backward()
    got_first = (first[0][0].detach(), float(first[1]), _grads(model))
    model.zero_grad(set_to_none=True)
    second[1].backward()
    # the reversed row's logits back in sample order: the same reference applies
    spans = _spans(samples[::-1])
    pieces = [second[0][0, s:s + n].detach() for s, n in spans][::-1]
    return got_first, (torch.cat(pieces), float(second[1]), _grads(model))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_5", "gemma3", "llava"])
def test_interleaved_checkpointed_forwards_each_recompute_their_own_boundaries(cases, restore, model_type, reentrant):
    """Two packed forwards with images and different boundaries, then the first one's backward: its recompute runs
    after the second forward and must read its own layout (GatedDeltaNet's resets, the image blocks)."""
    case = cases(model_type)
    restore(case.model)
    calls = _checkpointed(case.model, reentrant, restore)
    first, second = _interleaved(case)
    assert calls[0] == 4  # two forwards, two recomputes
    _assert_exact(first, case)
    _assert_exact(second, case)


def test_control_a_recompute_reading_the_latest_forwards_boundaries_is_caught(cases, restore, monkeypatch):
    """Qwen3.5's GatedDeltaNet reads its boundaries from the forward in flight: handed the second forward's on
    recompute, the first step's gradients are off, and the same comparison sees it."""
    case = cases("qwen3_5")
    restore(case.model)
    _checkpointed(case.model, True, restore)
    _stale_recompute(monkeypatch)
    (logits, _, grads), _ = _interleaved(case)
    assert float((logits - case.logits).abs().max()) <= ATOL  # the forward itself ran with its own boundaries
    assert _relative(grads, case.grads) > 1e-3


# ---- PEFT ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "reentrant-checkpointing"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava"])
def test_a_lora_wrapped_vlm_trains_packed_images_as_each_sample_alone(model_type, checkpointing):
    """LoRA on the language model's q/v projections (LLaVA's CLIP tower has q/v projections too, left alone), the
    PeftModel configured: packed with images vs alone, every adapter gradient."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    adapter = peft.LoraConfig(r=4, target_modules=r".*language_model.*\.(q_proj|v_proj)", init_lora_weights=False)
    model = peft.get_peft_model(_build(model_type), adapter)
    base = model.get_base_model()
    samples = images.probe_samples(base)
    row = images.pack_samples(base, samples)
    case = Case(model, samples, row, *_alone(model, samples))
    assert len(case.grads) == 8 and all("lora_" in n and "language_model" in n for n in case.grads)  # 2 layers x q, v
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    padfree.configure_packing(model)
    logits, loss, grads = _packed(model, row, samples)
    assert float((logits - case.logits).abs().max()) <= ATOL and abs(loss - case.loss) <= ATOL
    assert _relative(grads, case.grads) <= ATOL
    leak, _, leak_grads = _packed(model, _running_on(row), samples)
    assert float((leak - case.logits).abs().max()) > 1e-3 and _relative(leak_grads, case.grads) > 1e-3


# ---- torch.compile ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llava"])  # qwen2_vl is exact too (6e-8), in 40 s here instead of 25
def test_a_compiled_vlm_trains_packed_images_as_each_sample_alone(cases, restore, model_type):
    """The whole model compiled (aot_eager: dynamo's capture and guards and AOTAutograd's backward, without inductor's
    C++ build; see test_model_compile): two packed rows with other boundaries, each as its samples alone."""
    case = cases(model_type)
    restore(case.model)
    torch._dynamo.reset()
    try:
        padfree.configure_packing(case.model)
        compiled = torch.compile(case.model, backend="aot_eager")
        _assert_exact(_packed(compiled, case.row, case.samples), case)
        _, second = _interleaved(dataclasses.replace(case, model=compiled))
        _assert_exact(second, case)
        leak, _, leak_grads = _packed(compiled, _running_on(case.row), case.samples)
        assert float((leak - case.logits).abs().max()) > 1e-3 and _relative(leak_grads, case.grads) > 1e-3
    finally:
        torch._dynamo.reset()


# ---- bf16 autocast ---------------------------------------------------------------------------------------------------


def _control(model, row: dict) -> dict:
    """The route's control: positions running on (causal), the image blocks left out (blocks)."""
    rule = images.block_rule(model)
    if rule is None:
        return _running_on(row)
    return {**row, rule.source: torch.zeros_like(row[rule.source])}


@pytest.mark.parametrize("model_type", ["llava", "paligemma"])
def test_images_under_bf16_autocast_are_exact_within_rounding(cases, restore, model_type):
    """fp32 weights under bf16 autocast: packed vs each sample alone within three times what rounding moves the
    per-sample run from fp32 (logits, loss, gradients); the control lands beyond it."""
    case = cases(model_type)
    restore(case.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_loss, want_grads = _alone(case.model, case.samples)
        padfree.configure_packing(case.model)
        got, loss, grads = _packed(case.model, case.row, case.samples)
        leak, _, _ = _packed(case.model, _control(case.model, case.row), case.samples)
    rounding = float((want - case.logits).abs().max())
    grad_rounding = _relative(want_grads, case.grads)
    assert rounding > 0 and float((got - want).abs().max()) <= 3 * rounding
    assert abs(loss - want_loss) <= 3 * max(abs(want_loss - case.loss), ATOL)
    assert _relative(grads, want_grads) <= 3 * grad_rounding
    assert float((leak - want).abs().max()) > 3 * rounding
