"""configure_packing: the report, every way of passing boundaries, the fail-closed guards, bad input, and that
ordinary (unpacked) batches and unconfigured models are left exactly as transformers computes them."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

import padfree
from padfree import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidLayoutError,
    PackingDisabledError,
    UnsupportedModelError,
    configure_packing,
    unconfigure_packing,
    verify,
)
from realdata import gsm8k_records
from zoo import CAPACITY, LENGTHS, VOCAB, sequences, tiny_model

ATOL = 1e-5


@pytest.fixture(scope="module")
def seqs():
    return sequences(LENGTHS)


@pytest.fixture(scope="module")
def batch(seqs):
    return padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs)


def _alone(model, seqs):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s]), use_cache=False).logits[0] for s in seqs]


def _max_diff(packed, batch, alone):
    """Largest |packed - alone| over every real sequence of the batch."""
    starts = batch.cu_seqlens[:-1].tolist()
    rows = torch.repeat_interleave(torch.arange(batch.input_ids.shape[0]), batch.seqs_per_row).tolist()
    first = {}
    for i, r in enumerate(rows):
        first.setdefault(r, starts[i])
    worst = 0.0
    for i, sid in enumerate(batch.sequence_ids.tolist()):
        c, n = starts[i] - first[rows[i]], len(alone[sid])
        worst = max(worst, float((packed[rows[i], c:c + n] - alone[sid]).abs().max()))
    return worst


# ---- the report ------------------------------------------------------------------------------------------------------


def test_report_names_the_model_backend_modules_and_cache():
    model = tiny_model("qwen2")
    assert model.config.use_cache
    report = configure_packing(model)
    assert report.model_type == "qwen2" and report.supported and not report.unsupported
    assert report.backend == "padfree_sdpa" and report.reason.startswith("auto")
    assert report.attention_modules == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert report.cache_disabled and model.config.use_cache is False
    assert {"flash_attn", "torch varlen_attn", "flex_attention"} <= set(report.kernels)
    assert not report.kernels["torch varlen_attn"] or torch.cuda.is_available()
    text = str(report)
    assert "qwen2 (supported)" in text and "padfree_sdpa" in text and "2 boundary-exact" in text
    assert padfree.model.configure.packing_state(model).report is report


def test_softcap_and_sinks_models_get_the_eager_math_backend():
    for model_type in ("gemma2", "gpt_oss"):
        report = configure_packing(tiny_model(model_type), backend="sdpa")
        assert report.backend == "padfree_eager" and "no SDPA path" in report.reason


def test_calling_twice_is_harmless_and_can_switch_backend(seqs, batch):
    model = tiny_model("llama")
    configure_packing(model)
    configure_packing(model)
    state = padfree.model.configure.packing_state(model)
    assert len(model.model._forward_pre_hooks) == 1 and len(state.handles) == 2 + 2 * len(model.model.layers)
    assert all(len(layer._forward_pre_hooks) == 1 for layer in model.model.layers)
    assert configure_packing(model, backend="eager").backend == "padfree_eager"
    assert verify(model, seqs, capacity=CAPACITY).ok


def test_unconfigure_restores_the_model():
    model = tiny_model("llama")
    configure_packing(model)
    assert unconfigure_packing(model) and not unconfigure_packing(model)
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is True
    assert not model.model._forward_pre_hooks and padfree.model.configure.packing_state(model) is None


# ---- every spelling of the boundaries --------------------------------------------------------------------------------


def test_segment_mask_cu_seqlens_and_position_ids_give_the_same_exact_logits(seqs, batch):
    model = tiny_model("mistral")  # sliding window 5: boundaries and windows both matter
    configure_packing(model)
    alone = _alone(model, seqs)
    segments = padfree.pack_result_to_tensors(
        padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs, attention_mask="segments")
    assert segments.attention_mask[1, -1] == 0  # padding marked 0: LLaMA-Factory's convention
    flat = {"input_ids": batch.input_ids, "cu_seq_lens_q": batch.cu_seqlens_padded}
    with torch.no_grad():
        by_positions = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        by_mask = model(input_ids=batch.input_ids, attention_mask=segments.attention_mask).logits
        by_cu = model(**flat).logits
        by_all = model(**batch.model_inputs(include_labels=False)).logits
    for logits in (by_positions, by_mask, by_cu, by_all):
        assert _max_diff(logits, batch, alone) <= ATOL


def test_unpacked_padded_batches_run_exactly_transformers_code(seqs):
    """Right- and left-padded batches (0/1 masks, no restarts): the configured model computes bit-for-bit what
    the unconfigured one does."""
    plain, configured = tiny_model("qwen2"), tiny_model("qwen2")
    configure_packing(configured)
    longest = max(map(len, seqs))
    for side in ("right", "left"):
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            span = slice(0, len(s)) if side == "right" else slice(longest - len(s), longest)
            ids[i, span], mask[i, span] = torch.tensor(s), 1
        with torch.no_grad():
            a = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
            b = configured(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_generation_with_a_cache_still_works():
    plain, configured = tiny_model("llama"), tiny_model("llama")
    configure_packing(configured)
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=5, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(plain.generate(prompt, **kwargs), configured.generate(prompt, **kwargs))
    # a left-padded batch: every decoding step's 0/1 mask covers the cache as well as the new token
    prompts = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    assert torch.equal(plain.generate(prompts, attention_mask=mask, **kwargs),
                       configured.generate(prompts, attention_mask=mask, **kwargs))


def test_other_models_are_not_touched(seqs, batch):
    configured, other = tiny_model("llama"), tiny_model("llama")
    configure_packing(configured)
    assert other.config._attn_implementation == "sdpa" and not other.model._forward_pre_hooks
    with torch.no_grad():  # stock transformers still leaks with an active cache: padfree did not change it
        leaky = other(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True).logits
    assert _max_diff(leaky, batch, _alone(other, seqs)) > 1e-2


def test_gradient_checkpointing_recomputes_with_the_right_boundaries(batch):
    """Activation checkpointing re-runs attention during backward, after the forward hook returned: the layout
    travels with the layer's keyword arguments, so the recomputed step has the same gradients."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("llama")
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        configure_packing(model)
        model.train()
        calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *a, seen=calls: seen.append(1))
        out = model(**batch.model_inputs())
        out.loss.backward()
        assert len(calls) == (2 if checkpointing else 1)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert (g - grads[1][name]).abs().max() <= 1e-6, name


def test_real_text_through_the_collator_is_exact():
    """Real GSM8K questions, the offline Mistral tokenizer, padfree's collator, a configured qwen3."""
    from padfree.corpus import load_tokenizer

    records = gsm8k_records(12)
    tok = load_tokenizer()
    ids = [[i % VOCAB for i in tok(r["instruction"])["input_ids"]][:40] for r in records]
    collate = padfree.packed_collate_fn(capacity=96)
    batch = collate([{"input_ids": s} for s in ids])
    assert batch.input_ids.shape[0] >= 2 and int(batch.seqs_per_row.min()) >= 2
    model = tiny_model("qwen3")
    configure_packing(model)
    report = verify(model, batch)
    assert report.ok, str(report)
    assert report.num_sequences == len(ids)


# ---- guards: fail closed ---------------------------------------------------------------------------------------------


def test_packed_batch_with_use_cache_is_refused(batch):
    model = tiny_model("llama")
    configure_packing(model)
    with pytest.raises(PackingDisabledError, match="use_cache=True"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True)
    model.config.use_cache = True  # the config default is read when the call says nothing
    with pytest.raises(PackingDisabledError, match="use_cache"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids)


def _cache_keywords(model) -> list[str]:
    """Every keyword the installed forward takes a cache under: the cache-like parameters of its signature and the
    deprecated spellings transformers still renames (``past_key_values``, ``cache_params``)."""
    names = [n for n in inspect.signature(model.forward).parameters
             if ("cache" in n or "past" in n) and n not in ("use_cache", "cache_position")]
    return list(dict.fromkeys([*names, "past_key_values", "cache_params"]))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text", "mamba2", "mamba"])  # dense, hybrid, SSM
def test_packed_batch_with_a_cache_is_refused_under_every_name(model_type):
    """Whatever carries the cache — today's ``cache``, the deprecated names transformers still accepts, or a
    positional argument — a packed batch with it is refused; without padfree the same call runs (and leaks)."""
    model = tiny_model(model_type)
    ids = torch.randint(3, 90, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])

    def cache():  # the cache object the model itself builds
        with torch.no_grad():
            out = model(input_ids=ids[:, :2], use_cache=True)
            # the output names it after the forward's argument: `cache` from transformers 5.24, before it
            # `past_key_values` (`cache_params` for the Mamba family)
            return next(getattr(out, k) for k in ("cache", "past_key_values", "cache_params") if k in out)

    accepted = []
    for name in _cache_keywords(model):
        try:
            with torch.no_grad():
                model(input_ids=ids, position_ids=pos, use_cache=False, **{name: cache()})
        except TypeError:  # not a keyword this forward takes
            continue
        accepted.append(name)
    assert "cache" in accepted or "past_key_values" in accepted
    params = list(inspect.signature(model.forward).parameters)
    index = params.index(next(k for k in ("cache", "past_key_values", "cache_params") if k in params))
    configure_packing(model)
    for name in accepted:
        with pytest.raises(PackingDisabledError, match=r"\w+=\w*Cache \(a cache\)"):
            model(input_ids=ids, position_ids=pos, use_cache=False, **{name: cache()})
    positional = [ids, None, pos] if params[:3] == ["input_ids", "attention_mask", "position_ids"] else None
    if positional is not None:
        args = [*positional, *[None] * (index - 3), cache()]
        with pytest.raises(PackingDisabledError, match="a cache"):
            model(*args, use_cache=False)
    out = model(input_ids=ids, position_ids=pos, use_cache=False)  # the same batch without a cache runs
    assert out.logits.shape[:2] == (1, 7)


@pytest.mark.parametrize("kind", ["all-ones", "padding", "4-D"])
def test_packed_batch_with_a_binary_or_prepared_mask_is_refused(batch, kind):
    model = tiny_model("llama")
    configure_packing(model)
    ones = torch.ones_like(batch.input_ids)
    mask = {"all-ones": ones, "padding": batch.input_ids != 0,
            "4-D": torch.ones(*batch.input_ids.shape[:1], 1, *batch.input_ids.shape[1:2] * 2, dtype=torch.bool)}[kind]
    with pytest.raises(PackingDisabledError, match="attention_mask") as err:
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask.long()
              if kind != "4-D" else mask)
    assert "PackedBatch.model_inputs()" in str(err.value)


def test_dense_masks_are_refused_whatever_carries_them(batch):
    """A dense mask is recognised by its shape, not its name: positional, a per-layer-type mapping (transformers'
    ``{"full_attention": mask}``), a 3-D mask, or under a keyword a later release might invent."""
    model = tiny_model("llama")
    configure_packing(model)
    ids, pos = batch.input_ids, batch.position_ids
    b, t = ids.shape
    four = torch.ones(b, 1, t, t, dtype=torch.bool).tril()
    with pytest.raises(PackingDisabledError, match="0/1 attention_mask"):
        model(ids, torch.ones_like(ids), pos, use_cache=False)  # positional 0/1 mask
    with pytest.raises(PackingDisabledError, match=r"'full_attention' entry is a 4-D mask"):
        model(input_ids=ids, position_ids=pos, attention_mask={"full_attention": four}, use_cache=False)
    with pytest.raises(PackingDisabledError, match="3-D mask"):
        model(input_ids=ids, position_ids=pos, attention_mask=four[:, 0], use_cache=False)
    with pytest.raises(PackingDisabledError, match=r"some_future_mask \(a 4-D mask"):
        model(input_ids=ids, position_ids=pos, some_future_mask=four, use_cache=False)


def test_unconfigured_model_is_not_guarded(batch):
    model = tiny_model("llama")
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=True)  # leaks: padfree is off
    assert out.logits.shape[:2] == batch.input_ids.shape and padfree.model.configure.packing_state(model) is None


# ---- bad input -------------------------------------------------------------------------------------------------------


def test_not_a_causal_lm_is_refused():
    with pytest.raises(UnsupportedModelError, match="PreTrainedModel"):
        configure_packing(torch.nn.Linear(2, 2))
    cfg = tiny_model("llama").config
    with pytest.raises(UnsupportedModelError, match="LlamaForSequenceClassification"):
        configure_packing(transformers.LlamaForSequenceClassification(cfg))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        configure_packing(t5)


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(InvalidArgumentError, match="sdpa, eager, flex_attention") as err:
        configure_packing(tiny_model("llama"), backend="flash")
    assert "'flash'" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
@pytest.mark.parametrize("backend", ["flash_attention_2", "varlen"])
def test_gpu_backends_without_a_gpu_are_refused(backend):
    with pytest.raises(BackendUnavailableError, match=backend):
        configure_packing(tiny_model("llama"), backend=backend)


def test_flex_with_sinks_on_cpu_is_refused():
    with pytest.raises(UnsupportedModelError, match="sinks"):
        configure_packing(tiny_model("gpt_oss"), backend="flex_attention")


def test_cu_seqlens_that_disagree_with_the_input_are_refused(batch):
    model = tiny_model("llama")
    configure_packing(model)
    total = batch.input_ids.numel()
    with pytest.raises(InvalidLayoutError, match=f"end at {total}"):
        model(input_ids=batch.input_ids, cu_seq_lens_q=torch.tensor([0, 5, total - 1], dtype=torch.int32))
    width = batch.input_ids.shape[1]
    with pytest.raises(InvalidLayoutError, match="cross from row 0 into row 1"):
        model(input_ids=batch.input_ids, cu_seq_lens_q=torch.tensor([0, width + 2, total], dtype=torch.int32))
    wrong = batch.cu_seqlens_padded.clone()
    wrong[1] += 1
    with pytest.raises(InvalidLayoutError, match="disagree"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=wrong)


def test_position_ids_that_are_not_a_packing_are_refused(batch):
    model = tiny_model("llama")
    configure_packing(model)
    bad = batch.position_ids.clone()
    bad[0, 4] = 7
    with pytest.raises(InvalidLayoutError, match=r"position_ids\[0, 4\] = 7"):
        model(input_ids=batch.input_ids, position_ids=bad)


def test_strict_must_be_a_bool():
    with pytest.raises(InvalidArgumentError, match="strict"):
        configure_packing(tiny_model("llama"), strict="yes")


def test_a_multimodal_model_packs_text_only_and_refuses_images_in_a_packed_batch():
    """Gemma3ForConditionalGeneration builds its per-layer-type masks above the language model: a packed text batch
    runs exactly (the sweep proves it), and a packed batch carrying pixel_values without the token types that make
    its images' blocks is refused before any work."""
    from padfree.proof.tiny import build_tiny

    model = build_tiny("gemma3")
    report = configure_packing(model)
    assert report.supported and not any("vision" in name for name in report.attention_modules)
    ids = torch.randint(3, 90, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    vision = model.config.vision_config
    pixels = torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)
    with pytest.raises(PackingDisabledError, match=r"with images reached Gemma3ForConditionalGeneration without .*"
                                                   r"token_type_ids"):
        model(input_ids=ids, position_ids=pos, pixel_values=pixels, use_cache=False)
    # the model folds its attention_mask into per-layer-type masks above the language model: a 0/1 mask next to
    # restarting positions is refused there, as the language model's own hook refuses it
    with pytest.raises(PackingDisabledError, match=r"0/1 attention_mask next to position_ids that restart"):
        model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    out = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    alone = model(input_ids=ids[:, 3:], use_cache=False).logits
    assert (out[0, 3:] - alone[0]).abs().max() <= ATOL * max(1.0, float(alone.abs().max()))


def test_the_report_says_when_a_models_attention_cannot_be_switched():
    """GPT-Neo computes its attention in its own code: transformers cannot switch it to padfree's backend, and the
    report says what runs instead of claiming padfree's (the sweep proved it exact as it runs)."""
    from padfree.proof.tiny import build_tiny

    neo = build_tiny("gpt_neo")
    report = padfree.configure_packing(neo)
    assert neo.config._attn_implementation == "eager" and report.backend == "padfree_eager"
    assert "GPTNeoForCausalLM cannot switch its attention implementation (it stays 'eager')" in report.reason
    assert report.supported and "padfree_eager" in report.proof  # the sweep's table, or certified on the spot
    llama = tiny_model("llama")
    report = padfree.configure_packing(llama)
    assert llama.config._attn_implementation == report.backend and "cannot switch" not in report.reason
