"""A forward's boundaries travel with that forward (:mod:`padfree.model.flight`).

Activation checkpointing recomputes a layer during backward, after other forwards may have run: an unpacked one, a
packed one of the same width with other boundaries, another configured model's (a reference model), a probe inside
``compute_loss``. Every case here runs the packed forward under test, then such forwards, then its backward, and
compares the gradients with each sequence run alone (fp32, 1e-5) — or expects a refusal by name. The negative
control runs the same comparison with the binding switched off (the recompute reads no layout, as a stale-state
design would after an unpacked forward) and must see the leak.
"""

from __future__ import annotations

import copy
import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper  # noqa: E402

import padfree  # noqa: E402
from padfree.errors import PackingDisabledError  # noqa: E402
from padfree.model import flight  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import MIXER_TYPES, grad_diff, packed_case, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
ROWS = [[3, 9, 5], [6, 11]]  # the forward under test: 2 rows of 17 tokens
OTHER = [[8, 4, 5], [2, 2, 13]]  # a forward of the same width with other boundaries


def _model(model_type: str, **overrides) -> transformers.PreTrainedModel:
    # the zoo's hybrids interleave mixer and attention layers (a class-default shrink may keep attention only)
    model = tiny_model(model_type, **overrides) if overrides or model_type in MIXER_TYPES else build_tiny(model_type)
    for module in model.modules():  # the runs must compute the same function: no dropout or layer-drop draws
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if ("dropout" in name or "layerdrop" in name) and isinstance(value, float):
                setattr(module, name, 0.0)
    return model.train()  # the reference and the packed step in one mode: checkpointing runs in training only


def _vocab(model) -> int:
    return model.get_input_embeddings().num_embeddings


def _loss(logits, ids, spans):
    """Token-mean next-token cross-entropy over the spans (the same normaliser packed and alone)."""
    total = sum(n - 1 for *_, n in spans)
    return sum(torch.nn.functional.cross_entropy(logits[r, s:s + n - 1].float(), ids[r, s + 1:s + n],
                                                 reduction="sum") for r, s, n in spans) / total


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, by the name it has without wrappers (compile's, checkpoint_wrapper's)."""
    return {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _alone(model, ids, spans) -> dict[str, torch.Tensor]:
    """The gradients of the loss with every span run alone (transformers' own code: no packing)."""
    model.zero_grad()
    total = sum(n - 1 for *_, n in spans)
    for r, s, n in spans:
        logits = model(input_ids=ids[r:r + 1, s:s + n], use_cache=False).logits
        (_loss(logits, ids[r:r + 1, s:s + n], [(0, 0, n)]) * (n - 1) / total).backward()
    return _grads(model)


def _checkpointed(model, route: str):
    """``model`` with its decoder layers checkpointed by ``route``: transformers' own (``reentrant`` /
    ``non-reentrant``), or ``checkpoint_wrapper`` around each layer (what FSDP's activation checkpointing applies)."""
    if route in ("reentrant", "non-reentrant"):
        kwargs = {"use_reentrant": route == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers before the rename
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        for layers in lists[:1]:
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
    model.train()
    return model


def _interleaved_step(model, case, *others):
    """Gradients of ``case``'s packed loss, its backward run after the forwards ``others`` (kept alive)."""
    ids, pos, spans = case
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    kept = [other() for other in others]
    _loss(logits, ids, spans).backward()
    del kept
    return _grads(model)


def _others(model, other):
    """An unpacked forward and a packed forward of the same width with other boundaries, both with autograd."""
    ids, pos, _ = other
    return (lambda: model(input_ids=ids, use_cache=False).logits,
            lambda: model(input_ids=ids, position_ids=pos, use_cache=False).logits)


# one model type per module kind that reads the layout of its forward without being handed it
READERS = {
    "llama": "attention (the layout arrives as a keyword argument)",
    "nemotron": "attention of a decoder layer that does not hand its keyword arguments on",
    "qwen3_5_text": "GatedDeltaNet + attention",
    "falcon_h1": "Mamba-2 mixers beside attention",
    "jamba": "Mamba-1 scan",
    "lfm2": "short convolutions",
    "mamba": "a model without attention, hooked at the top",
    "zamba2": "hybrid with a shared attention block",
    "bloom": "ALiBi attention",
    "stablelm": "an attention variant",
    "lfm3": "newer short convolutions",
    "minimax": "lightning attention",
    "kimi_linear": "Kimi delta attention",
    "recurrent_gemma": "RG-LRU",
    "rwkv": "RWKV time and channel mixing",
    "xlstm": "xLSTM",
    "deepseek_v32": "a top-k key indexer",
    "zaya": "a convolutional attention projection",
    "bert": "an encoder family as a decoder",
    "mvp": "learned absolute positions",
    "openai-gpt": "a model that adds its own positions",
    "inkling2_text": "dynamic short convolutions and attention across a token's own blocks",
    "lara_mini": "a GatedDeltaNet variant",
    "zamba": "Zamba's Mamba-1",
}


def _route(model) -> str:
    return "reentrant" if model.supports_gradient_checkpointing else "checkpoint_wrapper"


@pytest.mark.parametrize("model_type", sorted(READERS))
def test_a_recompute_gets_its_own_forwards_layout_whatever_ran_in_between(model_type):
    """Every kind of module that reads the layout, checkpointed (transformers' reentrant route where the model
    supports it), backward after an unpacked and a differently packed forward of the same width."""
    model = _model(model_type)
    case, other = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
    want = _alone(model, case[0], case[2])
    report = padfree.configure_packing(model)
    assert bool(report.mixers) == (model_type not in ("llama", "nemotron"))  # the module kind named above is there
    _checkpointed(model, _route(model))
    got = _interleaved_step(model, case, *_others(model, other))
    assert grad_diff(got, want) <= ATOL, grad_diff(got, want)


@pytest.mark.parametrize("route", ["reentrant", "non-reentrant", "checkpoint_wrapper"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba"])
def test_every_checkpoint_route_recomputes_both_interleaved_packed_forwards_exactly(model_type, route):
    """Two packed forwards of one model, both backwards after both forwards: each recompute reads its own
    boundaries (mamba's layers take no keyword arguments: a layer-hook route finds its frame by its input)."""
    model = _model(model_type)
    a, b = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
    want_a, want_b = _alone(model, a[0], a[2]), _alone(model, b[0], b[2])
    padfree.configure_packing(model)
    _checkpointed(model, route)
    model.zero_grad()
    logits_a = model(input_ids=a[0], position_ids=a[1], use_cache=False).logits
    logits_b = model(input_ids=b[0], position_ids=b[1], use_cache=False).logits
    _loss(logits_a, a[0], a[2]).backward()
    got_a = _grads(model)
    model.zero_grad()
    _loss(logits_b, b[0], b[2]).backward()
    assert grad_diff(got_a, want_a) <= ATOL
    assert grad_diff(_grads(model), want_b) <= ATOL


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "mamba", "falcon_h1"])
def test_control_a_recompute_without_its_layout_is_caught(model_type, monkeypatch):
    """The negative control: with the binding off, the recompute after an unpacked forward reads no layout — the
    stale-state behaviour — and the same comparison sees gradients far beyond the tolerance."""
    model = _model(model_type)
    case, other = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
    want = _alone(model, case[0], case[2])
    padfree.configure_packing(model)
    _checkpointed(model, "reentrant")
    monkeypatch.setattr(flight, "_replay", lambda frames, function, *a, **k: function(*a, **k))
    monkeypatch.setattr(flight, "_in_backward", lambda: False)
    got = _interleaved_step(model, case, _others(model, other)[0])
    assert grad_diff(got, want) > 20 * ATOL  # falcon_h1 leaks least: 3.4e-4


def test_two_configured_models_interleaved_each_recompute_their_own():
    """A policy and a reference model (both configured, the reference's packed forward with other boundaries
    between the policy's forward and backward, as a preference loss runs them)."""
    policy = _model("qwen3_5_text")
    reference = copy.deepcopy(policy)
    case, other = packed_case(_vocab(policy), ROWS, 1), packed_case(_vocab(policy), OTHER, 2)
    want = _alone(policy, case[0], case[2])
    padfree.configure_packing(policy)
    padfree.configure_packing(reference)
    _checkpointed(policy, "reentrant")
    _checkpointed(reference, "reentrant")
    got = _interleaved_step(policy, case,
                            lambda: reference(input_ids=other[0], position_ids=other[1], use_cache=False).logits)
    assert grad_diff(got, want) <= ATOL


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bloom"])
def test_a_deep_copy_of_a_configured_model_runs_its_own_hooks_with_its_own_state(model_type):
    """TRL's ``create_reference_model`` (a deep copy), an EMA copy: the copy's hooks, mixers and attention read the
    copy's state — its packed step is exact, interleaved with the original's — and undoing one leaves the other."""
    trl = pytest.importorskip("trl")
    model = _model(model_type)
    case, other = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
    want = _alone(model, case[0], case[2])
    padfree.configure_packing(model)
    _checkpointed(model, "reentrant")
    copied = trl.create_reference_model(model)
    copied.train()
    for p in copied.parameters():
        p.requires_grad_(True)
    got = _interleaved_step(copied, case, lambda: model(input_ids=other[0], position_ids=other[1],
                                                          use_cache=False).logits)
    assert grad_diff(got, want) <= ATOL
    assert padfree.unconfigure_packing(copied)
    assert grad_diff(_interleaved_step(model, case, *_others(copied, other)), want) <= ATOL


def test_a_forward_nested_in_another_models_forward_reads_its_own_layout():
    """A configured model called inside another's forward (a reward or reference model in a layer hook): the inner
    forward's frame is innermost, and the outer model's layers still read the outer layout."""
    outer, inner = _model("qwen3_5_text"), _model("lfm2")
    case, other = packed_case(_vocab(outer), ROWS, 1), packed_case(_vocab(inner), OTHER, 2)
    want = _alone(outer, case[0], case[2])
    padfree.configure_packing(outer)
    padfree.configure_packing(inner)
    _checkpointed(outer, "reentrant")
    inside = []
    layer = outer.model.layers[1]
    hook = layer.register_forward_hook(
        lambda *_: inside.append(inner(input_ids=other[0], position_ids=other[1], use_cache=False).logits))
    got = _interleaved_step(outer, case)
    hook.remove()
    assert inside and grad_diff(got, want) <= ATOL


def test_a_recompute_padfree_cannot_bind_is_refused_by_name():
    """A checkpoint around a mixer alone (not a decoder layer) recomputes it outside any forward: refused, never
    run with another forward's boundaries or none."""
    model = _model("qwen3_5_text")
    padfree.configure_packing(model)
    layer = model.model.layers[0]
    layer.linear_attn = checkpoint_wrapper(layer.linear_attn)
    model.train()
    ids, pos, spans = packed_case(_vocab(model), ROWS, 1)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    with pytest.raises(PackingDisabledError, match="recomputed during backward"):
        _loss(logits, ids, spans).backward()


def test_one_input_tensor_fed_to_two_differently_packed_forwards_is_refused_on_recompute():
    """mamba's first layer takes ``inputs_embeds`` as it is: the same tensor in two forwards with other boundaries
    leaves a layer-hook recompute no way to tell them apart, so it refuses rather than guess."""
    model = _model("mamba")
    padfree.configure_packing(model)
    _checkpointed(model, "checkpoint_wrapper")
    a, b = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
    embeds = model.get_input_embeddings()(a[0]).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, position_ids=a[1], use_cache=False).logits
    kept = model(inputs_embeds=embeds, position_ids=b[1], use_cache=False).logits
    with pytest.raises(PackingDisabledError, match="two forwards"):
        _loss(logits, a[0], a[2]).backward()
    del kept


@pytest.fixture(scope="module")
def rows_32k(tmp_path_factory):
    """Packed rows of real GSM8K text (Mistral's 32k vocabulary), prompt masked: a trainer's train set."""
    datasets = pytest.importorskip("datasets")
    from padfree.integrations.trainer_data import pack_for_trainer
    from realdata import gsm8k_records
    from zoo import mistral_tokenizer

    tok = mistral_tokenizer(tmp_path_factory.mktemp("spm"))
    samples = []
    for r in gsm8k_records(12):
        prompt = tok(r["instruction"])["input_ids"][:40]
        answer = tok(r["output"], add_special_tokens=False)["input_ids"][:40]
        samples.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return pack_for_trainer(datasets.Dataset.from_list(samples), max_length=200)


class _ProbingTrainer(padfree.Trainer):
    """A trainer whose loss runs a probe forward of the model (unpacked, no grad) before the backward, as a KL term or
    an evaluation probe inside ``compute_loss`` does."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        with torch.no_grad():
            ids = inputs["input_ids"]
            model(input_ids=ids[:, : ids.shape[1] // 2], use_cache=False)
        return loss


@pytest.mark.parametrize("reentrant", [True, False])
def test_trainer_flag_with_a_probe_forward_inside_compute_loss_gives_the_plain_update(rows_32k, tmp_path, reentrant):
    """``TrainingArguments(activation_checkpointing=True)`` on a hybrid, a probe forward inside ``compute_loss``: one
    SGD step moves every weight as the same step without checkpointing and without the probe."""
    from padfree.integrations.trainer_data import PackedRowsCollator

    def step(model, trainer_cls, **kwargs):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=len(rows_32k), max_steps=1, learning_rate=1.0,
            lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, weight_decay=0.0, report_to="none",
            use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, **kwargs)
        trainer_cls(model=model, args=args, train_dataset=rows_32k, data_collator=PackedRowsCollator()).train()
        assert model.model.layers[0].gradient_checkpointing == bool(kwargs)  # the recompute under test ran
        return {n: (p.detach() - before[n]) for n, p in model.named_parameters()}

    model = _model("qwen3_5_text", vocab_size=32000)
    plain = step(copy.deepcopy(model), padfree.Trainer)
    got = step(model, _ProbingTrainer, activation_checkpointing=True,
               activation_checkpointing_kwargs={"use_reentrant": reentrant})
    assert max(float((got[n] - plain[n]).abs().max()) for n in plain) <= ATOL


def test_compiled_checkpointed_hybrid_recomputes_its_own_layout():
    """``torch.compile`` over a checkpointed hybrid: the recompute after an interleaved forward of other
    boundaries reads its own."""
    torch._dynamo.reset()
    try:
        model = _model("qwen3_5_text")
        case, other = packed_case(_vocab(model), ROWS, 1), packed_case(_vocab(model), OTHER, 2)
        want = _alone(model, case[0], case[2])
        padfree.configure_packing(model)
        _checkpointed(model, "non-reentrant")
        compiled = torch.compile(model, backend="aot_eager")
        got = _interleaved_step(compiled, case, *_others(compiled, other))
        assert grad_diff(got, want) <= ATOL
    finally:
        torch._dynamo.reset()


def test_unconfigure_gives_the_checkpoint_functions_back():
    model = _model("qwen3_5_text")
    padfree.configure_packing(model)
    _checkpointed(model, "reentrant")
    ids, pos, _ = packed_case(_vocab(model), ROWS, 1)
    model(input_ids=ids, position_ids=pos, use_cache=False)  # binds the functions transformers put on the layers
    layer = model.model.layers[0]
    assert type(layer._gradient_checkpointing_func).__module__ == flight.__name__  # padfree's bound recompute
    padfree.unconfigure_packing(model)
    assert isinstance(layer._gradient_checkpointing_func, functools.partial)
