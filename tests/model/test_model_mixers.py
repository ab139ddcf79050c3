"""Boundary-exact sequence mixers (padfree.model.families.scan_mixers): the pieces behind the support matrix's hybrid
rows.

Every whole-model packed-vs-separate proof per type and backend lives in tests/model/test_model_matrix.py (it
generates the README table); this module covers what the matrix does not: both GatedDeltaNet formulations inside a
model, LLaMA-Factory segment masks, activation checkpointing, the models without attention (hooked at the top), the
guards, the module scan, every reference primitive against transformers' own function run on every segment alone, and
the kernel selection — usable, failing to import, failing at the first call — with its report.
Tiny fp32 random-weight models (tests/zoo.py); rows hold a length-1 sequence, sequences shorter than the conv kernel
(4) and sequences crossing the GatedDeltaNet chunk (64) and many SSD chunks (8).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree import configure_packing  # noqa: E402
from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model import configure, cuda_kernels, install, scans  # noqa: E402
from padfree.model.families import scan_mixers as mixers  # noqa: E402
from padfree.model.flight import forward_of, layout_in_flight  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.model.state import PackingState  # noqa: E402
from zoo import (  # noqa: E402
    MIXER_ROWS,
    SSM_TYPES,
    grad_diff,
    loss_of,
    max_diff,
    packed_rows,
    run_packed,
    run_separately,
    tiny_model,
    with_unknown_mixer,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- whole models: what the matrix does not cover -----------------------------------------------------------------


@pytest.mark.parametrize("formulation", ["masked", "per-segment"])
def test_both_gated_delta_rule_formulations_in_a_model(formulation):
    model = tiny_model("qwen3_5_text")
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    alone, alone_grads = run_separately(model, seqs)
    configure_packing(model)
    state = configure.packing_state(model)
    for layer in (model.model.layers[0].linear_attn, model.model.layers[2].linear_attn):
        assert f"({formulation})" in mixers.install(layer, state, formulation=formulation)
    out, grads = run_packed(model, ids, pos, seqs)
    assert max_diff(out, alone) <= 1e-5
    assert grad_diff(grads, alone_grads) <= 1e-5


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "jamba", "mamba"])
def test_segment_mask_with_trailing_padding(model_type):
    """LLaMA-Factory masks ``[1, 1, 2, 2, 2, 0]``: the padding run is a segment of its own and leaks into nothing.
    (Mamba multiplies hidden states by ``attention_mask``: the hook must consume a segment mask, never let it reach
    the mixer as a scale.)"""
    model = tiny_model(model_type)
    rows = [[1, 3, 70, 9], [2, 40, 30]]  # the second row ends in 11 padding tokens
    ids, _, seqs = packed_rows(rows)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        col = 0
        for i, n in enumerate(row):
            mask[b, col:col + n] = i + 1
            col += n
    alone, alone_grads = run_separately(model, seqs)
    configure_packing(model)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    per_seq = [logits[b, start:start + len(s)] for b, start, s in seqs]
    loss_of(per_seq, seqs, sum(len(s) - 1 for _, _, s in seqs)).backward()
    assert max_diff([x.detach() for x in per_seq], alone) <= 1e-5
    assert grad_diff({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, alone_grads) <= 1e-5


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_gradient_checkpointing_recomputes_with_the_same_boundaries(model_type):
    model = tiny_model(model_type)
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    _, alone_grads = run_separately(model, seqs)
    configure_packing(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _, grads = run_packed(model, ids, pos, seqs)
    assert grad_diff(grads, alone_grads) <= 1e-5


def test_report_names_the_implementation_of_every_mixer():
    model = tiny_model("qwen3_next")
    report = configure_packing(model)
    assert sorted(report.mixers) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    for description in report.mixers.values():
        assert description.startswith("GatedDeltaNet: scan: ")
        assert "exact torch chunked delta rule" in description and "conv: exact torch conv" in description
        if not torch.cuda.is_available():
            assert "need a CUDA GPU" in description  # why the kernels were not taken
    assert list(report.mixer_kinds.values()) == [["model.layers.0.linear_attn", "model.layers.2.linear_attn"]]
    assert "mixers          2 layers (model.layers.0.linear_attn, ...): GatedDeltaNet: scan: exact" in str(report)
    olmo = configure_packing(tiny_model("olmo_hybrid"))  # the scan looks inside its *LinearAttentionDecoderLayer
    assert sorted(olmo.mixers) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    assert all(d.startswith("GatedDeltaNet: scan: exact torch") for d in olmo.mixers.values())
    lfm2 = configure_packing(tiny_model("lfm2"))
    assert all(d.startswith("short convolution: conv: exact torch conv") for d in lfm2.mixers.values())
    jamba = configure_packing(tiny_model("jamba"))
    assert all("selective scan, decay zeroed" in d for d in jamba.mixers.values())


def test_unpacked_batches_run_transformers_own_code_and_unconfigure_restores_it():
    model = tiny_model("bamba")
    ids, pos, _ = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        leaky = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    configure_packing(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)
        assert not torch.allclose(model(input_ids=ids, position_ids=pos).logits, leaky)
    configure.unconfigure_packing(model)  # removes the mixers' instance patches too
    assert "forward" not in model.model.layers[0].mamba.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, position_ids=pos, use_cache=False).logits, leaky)
    configure_packing(model)  # configuring again re-installs
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, position_ids=pos).logits, leaky)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba", "lfm2", "mamba2"])
def test_a_one_sequence_batch_with_boundary_kwargs_runs_as_unpacked(model_type):
    """A padding-free collator given one sample still sends cu_seq_lens / seq_idx; transformers' own mixers refuse
    them without CUDA kernels, so the configured model must drop the (trivial) boundaries and match a plain run."""
    import padfree

    model = tiny_model(model_type)
    configure_packing(model)
    batch = padfree.PaddingFreeCollator(return_dict=True, seq_idx=True)([{"input_ids": [5, 6, 7, 8, 9, 10, 11]}])
    assert {"cu_seq_lens_q", "seq_idx"} <= set(batch)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, model(input_ids=batch["input_ids"]).logits)


def test_a_stale_layout_never_reaches_a_mixer_whose_model_lost_its_hooks():
    """Defence in depth: a mixer whose state's hooks are gone (a refused or undone configure) runs transformers'
    own forward even inside a frame of its model with a layout of the right shape."""
    model = tiny_model("lfm2")
    ids, pos, _ = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        leaky = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    configure_packing(model)
    state = configure.packing_state(model)
    for handle in state.handles:
        handle.remove()
    with torch.no_grad(), forward_of(state, PackedLayout.from_position_ids(pos)):
        assert torch.equal(model(input_ids=ids, position_ids=pos, use_cache=False).logits, leaky)


def test_a_packed_batch_with_a_cache_is_refused():
    model = tiny_model("qwen3_5_text")
    configure_packing(model)
    ids, pos, _ = packed_rows(MIXER_ROWS)
    with pytest.raises(PackingDisabledError, match="use_cache"):
        model(input_ids=ids, position_ids=pos, use_cache=True)


# ---- models without attention: hooked at the top, where the caller's boundaries arrive ----------------------------


@pytest.mark.parametrize("model_type", SSM_TYPES)
def test_models_without_attention_are_configured_at_the_top(model_type):
    """mamba-family *ForCausalLM and their backbones take no ``position_ids`` (a packed one would vanish into
    ``**kwargs``): the hook sits on the configured model itself and consumes the boundary arguments there."""
    model = tiny_model(model_type)
    report = configure_packing(model)
    assert report.backend == "none" and not report.attention_modules and len(report.mixers) == 2
    assert "no attention layer runs through padfree's backends" in report.reason
    state = configure.packing_state(model)
    assert len(model._forward_pre_hooks) == 1 and not model.get_decoder()._forward_pre_hooks
    seen, layouts = {}, []
    model.get_decoder().register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    mixer = next(m for m in model.modules() if "_padfree_mixer" in m.__dict__)
    mixer.register_forward_pre_hook(lambda m, a: layouts.append(layout_in_flight(state)))
    ids, pos, _ = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    assert layouts[0].num_segments == 8 and layout_in_flight(state) is None  # the layout left with its forward
    assert "position_ids" not in seen and seen["attention_mask"] is None
    with pytest.raises(PackingDisabledError, match="cache_params"):
        model(input_ids=ids, position_ids=pos, cache_params=object())
    assert configure.unconfigure_packing(model) and model.config.use_cache  # no attention implementation to restore
    assert not any("_padfree_mixer" in m.__dict__ for m in model.modules())


# ---- the module scan: what counts as a mixer, and what is refused by name -----------------------------------------


def _named(name: str, *, config: bool = False) -> torch.nn.Module:
    module = type(name, (torch.nn.Module,), {})()
    if config:
        module.config = object()
    return module


def test_scan_classifies_linear_attention_as_a_mixer_and_skips_norms_and_containers():
    from transformers.modeling_layers import GradientCheckpointingLayer

    root = torch.nn.Module()
    layer = type("MambaBlock", (GradientCheckpointingLayer,), {})()
    layer.mixer = _named("MambaMixer")
    layer.norm = _named("MambaRMSNormGated")
    root.layers = torch.nn.ModuleList([layer])
    # invented class names: no family claims them, so the scan alone decides what they are
    for name in ("ToyLinearDeltaAttention", "ToyHybridDeltaAttention", "ToyLightningAttention", "ToyRwkvSelfAttention",
                 "LlamaAttention", "ToyTextNGramEmbedding", "ToyTextIndexer", "Mamba2RMSNorm",
                 "FalconMambaWeightlessRMSNorm", "Qwen3NextRotaryEmbedding"):
        root.add_module(name, _named(name, config=True))
    attention, handled, found = install.scan_model(root)
    assert [n for n, _ in attention] == ["LlamaAttention"]
    assert [n for n, _ in handled] == ["layers.0.mixer"]  # MambaMixer: the mixers family claims it
    assert [n for n, _ in found] == [
        "ToyLinearDeltaAttention", "ToyHybridDeltaAttention", "ToyLightningAttention", "ToyRwkvSelfAttention",
        "ToyTextNGramEmbedding", "ToyTextIndexer"]


def test_an_unknown_stateful_mixer_is_refused_by_name():
    """A real transformers model holding a stateful mixer padfree has not proven: strict refuses naming the class
    and the module, non-strict reports it and configures the rest."""
    model = with_unknown_mixer(tiny_model("llama"))
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp: ToyRecurrentMixer carries state"):
        configure_packing(model)
    assert configure.packing_state(model) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = configure_packing(model, strict=False)
    assert not report.supported
    assert list(report.unsupported) == ["model.layers.0.mlp"]


def test_a_handler_that_refuses_lands_in_the_report(monkeypatch):
    """A known mixer class whose installer refuses (e.g. a transformers version with another forward) is an
    unsupported module: strict raises and leaves no mixer patched, non-strict reports it and configures the rest."""
    def refuse(module, state):
        raise UnsupportedModelError(f"{type(module).__name__}: not this version's forward")

    monkeypatch.setattr(mixers, "install", refuse)
    model = tiny_model("lfm2")
    with pytest.raises(UnsupportedModelError, match="not this version's forward"):
        configure_packing(model)
    assert configure.packing_state(model) is None
    with pytest.warns(UserWarning, match="only partly packing-exact"):
        report = configure_packing(model, strict=False)
    assert sorted(report.unsupported) == ["model.layers.0.conv", "model.layers.2.conv"]
    assert not report.mixers and report.attention_modules == ["model.layers.1.self_attn"]


def test_every_mixer_class_is_routed_to_the_mixers_family():
    for name in mixers.CLASSES:
        assert configure.families()[name] is mixers


# ---- each reference primitive against transformers' own function run on every segment alone ------------------------


def _layout(rows):
    _, pos, _ = packed_rows(rows)
    return PackedLayout.from_position_ids(pos), pos


def _per_segment(fn, lay, *tensors, dim):
    """Run ``fn`` on every segment alone (tensors sliced along ``dim``, batch 1) and put the pieces back."""
    outs = []
    for b in range(lay.shape[0]):
        starts = torch.nonzero(lay.segment_ids[b, 1:] != lay.segment_ids[b, :-1]).reshape(-1) + 1
        bounds = [0, *starts.tolist(), lay.shape[1]]
        row = [fn(*(t[b:b + 1].narrow(dim, s, e - s) for t in tensors)) for s, e in itertools.pairwise(bounds)]
        outs.append(torch.cat(row, dim=dim))
    return torch.cat(outs, dim=0)


def test_reference_conv_matches_transformers_per_segment():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    lay, _ = _layout([[1, 2, 3, 9], [4, 1, 10]])
    torch.manual_seed(0)
    x, w, bias = torch.randn(2, 6, 15), torch.randn(6, 4), torch.randn(6)
    for activation in (None, "silu"):
        got = scans.segment_causal_conv1d(x, w, bias, activation, lay)
        want = _per_segment(lambda t, act=activation: causal_conv1d_fn(t, w, bias, activation=act), lay, x, dim=2)
        assert float((got - want).abs().max()) <= 1e-6


def _gdr_inputs(rows, hk=2, hv=4, dk=8, dv=8, seed=0):
    lay, _ = _layout(rows)
    batch_, length = lay.shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch_, length, hk, dk, generator=g)
    k = torch.randn(batch_, length, hk, dk, generator=g)
    v = torch.randn(batch_, length, hv, dv, generator=g)
    decay = -torch.rand(batch_, length, hv, generator=g) * torch.tensor([0.01, 0.5, 3.0, 30.0])  # slow .. instant
    beta = torch.rand(batch_, length, hv, generator=g)
    return lay, q, k, v, decay, beta


@pytest.mark.parametrize("rows", [[[1, 3, 70, 9], [2, 40, 30, 11]], [[130, 1, 2], [64, 64, 5]]])
def test_reference_gated_delta_rule_both_formulations(rows):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    lay, q, k, v, decay, beta = _gdr_inputs(rows)

    def alone(q, k, v, decay, beta):
        return torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]

    want = _per_segment(alone, lay, q, k, v, decay, beta, dim=1)
    got = {form: scans.segment_gated_delta_rule(q, k, v, decay, beta, lay, use_qk_l2norm_in_kernel=True,
                                                 formulation=form) for form in ("masked", "per-segment", "auto")}
    for out in got.values():
        assert out.shape == want.shape and float((out - want).abs().max()) <= 1e-5
    assert float((got["masked"] - got["per-segment"]).abs().max()) <= 1e-5


def test_gated_delta_rule_formulation_choice():
    few, _ = _layout([[600, 700, 748]])
    short, _ = _layout([[16, 30, 45, 1] * 16])
    tiny_segments, _ = _layout([[4] * 256])
    assert scans.gdr_formulation(few, 64) == "per-segment"  # little padding to whole chunks
    assert scans.gdr_formulation(short, 64) == "per-segment"  # one chunk each, padded to multiples of 16 only
    assert scans.gdr_formulation(tiny_segments, 64) == "masked"  # 4-token segments would pad 4x
    groups = scans.gdr_groups(short, 64)
    assert [(length, chunk) for length, chunk, *_ in groups] == [(48, 48), (32, 32), (16, 16)]


def test_reference_gated_delta_rule_never_builds_denormals():
    """Strong decays: every exp() factor the reference multiplies with is 0 or a normal float (no denormal
    slow path), whatever the global flush-denormal mode."""
    lay, q, k, v, _, beta = _gdr_inputs([[200, 56]], hk=4, hv=4)
    decay = torch.full(beta.shape, -5.0)
    seen = []
    real_exp = torch.Tensor.exp

    def spy(t):
        out = real_exp(t)
        seen.append(out.detach())
        return out

    try:
        torch.Tensor.exp = spy
        scans.segment_gated_delta_rule(q, k, v, decay, beta, lay, formulation="masked")
    finally:
        torch.Tensor.exp = real_exp
    assert seen
    tiny_normal = torch.finfo(torch.float32).tiny
    for out in seen:
        assert not ((out != 0) & (out.abs() < tiny_normal)).any()


def test_reference_ssd_scan_matches_transformers_per_segment():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    lay, _ = _layout([[1, 3, 20, 9], [2, 8, 12, 11]])
    batch_, length = lay.shape
    g = torch.Generator().manual_seed(0)
    heads, head_dim, groups, state = 4, 8, 2, 6
    x = torch.randn(batch_, length, heads, head_dim, generator=g)
    dt = torch.randn(batch_, length, heads, generator=g)
    a = -torch.rand(heads, generator=g) * 4
    b_, c_ = (torch.randn(batch_, length, groups, state, generator=g) for _ in range(2))
    d, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    opts = dict(D=d, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")))
    got = scans.segment_ssd_scan(x, dt, a, b_, c_, 8, lay, **opts)
    want = _per_segment(lambda x, dt, b_, c_: mamba2_chunk_scan(x, dt, a, b_, c_, 8, **opts), lay, x, dt, b_, c_,
                        dim=1)
    assert float((got - want).abs().max()) <= 1e-5


def test_reference_selective_scan_matches_transformers_per_segment():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    lay, _ = _layout([[1, 3, 20, 9], [2, 8, 12, 11]])
    batch_, length = lay.shape
    g = torch.Generator().manual_seed(0)
    channels, state = 6, 4
    x, dt, z = (torch.randn(batch_, channels, length, generator=g) for _ in range(3))
    a = -torch.rand(channels, state, generator=g) * 3
    b_, c_ = (torch.randn(batch_, state, length, generator=g) for _ in range(2))
    d, bias = torch.randn(channels, generator=g), torch.randn(channels, generator=g)
    opts = dict(D=d, delta_bias=bias, delta_softplus=True)
    got = scans.segment_selective_scan(x, dt, a, b_, c_, lay, z=z, **opts)
    want = _per_segment(lambda x, dt, b_, c_, z: mamba_selective_scan(x, dt, a, b_, c_, z=z, **opts), lay,
                        x, dt, b_, c_, z, dim=2)
    assert float((got - want).abs().max()) <= 1e-6


# ---- kernels: chosen when usable, a broken one falls back to the reference with its reason -------------------------


@pytest.fixture
def fresh_kernels(monkeypatch):
    monkeypatch.setattr(cuda_kernels, "_loaded", {})
    monkeypatch.setattr(cuda_kernels, "_broken", {})
    return monkeypatch


def _fake_fla(calls):
    """flash-linear-attention's chunk_gated_delta_rule contract (batch 1, cu_seqlens over the flat stream), computed
    by transformers' reference on every sequence."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):
        calls.append(cu_seqlens.tolist())
        assert q.shape[0] == 1 and initial_state is None
        pieces = [torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                  for s, e in itertools.pairwise(cu_seqlens.tolist())]
        return torch.cat(pieces, dim=1), None

    return chunk_gated_delta_rule


def test_kernel_path_is_used_when_usable(fresh_kernels):
    calls = []
    fresh_kernels.setitem(cuda_kernels._loaded, "fla", (_fake_fla(calls), ""))
    fresh_kernels.setattr(cuda_kernels, "_on_accelerator", lambda t: True)
    model = tiny_model("qwen3_5_text").to(torch.bfloat16)  # flash-linear-attention takes bf16/fp16 only
    report = configure_packing(model)
    assert all("flash-linear-attention chunk_gated_delta_rule with cu_seqlens" in d for d in report.mixers.values())
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits
        alone = [model(input_ids=s[None]).logits[0] for _, _, s in seqs]
    assert calls and calls[0] == [0, 1, 4, 74, 83, 85, 125, 155, 166]
    packed_seqs = [out[b, start:start + len(s)] for b, start, s in seqs]
    assert max_diff([x.float() for x in packed_seqs], [x.float() for x in alone]) <= 0.1  # bf16 noise, no leak


def _runs(seq_idx_row):
    """``[(start, end)]`` of the equal-value runs of a 1-D ``seq_idx``."""
    cut = (torch.nonzero(seq_idx_row[1:] != seq_idx_row[:-1]).reshape(-1) + 1).tolist()
    return list(itertools.pairwise([0, *cut, seq_idx_row.numel()]))


def test_mamba_ssm_and_causal_conv1d_kernel_paths(fresh_kernels):
    """The causal-conv1d and mamba_ssm calls follow those kernels' contracts (channels-last ``x`` with ``seq_idx``;
    ``seq_idx`` of the flat stream): fakes that honour the contracts with transformers' reference give exact numbers."""
    from transformers.models.bamba.modeling_bamba import causal_conv1d_fn, mamba2_chunk_scan

    calls = {"conv": 0, "scan": 0}

    def fake_conv(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                  final_states_out=None, activation=None):
        assert x.stride(1) == 1 and seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2])
        calls["conv"] += 1
        return torch.cat([torch.cat([causal_conv1d_fn(x[b:b + 1, :, s:e], weight, bias, activation=activation)
                                     for s, e in _runs(seq_idx[b])], dim=2) for b in range(x.shape[0])])

    def fake_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
                  dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
        assert z is None and initial_states is None and not return_final_states
        calls["scan"] += 1
        opts = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        return torch.cat([torch.cat([mamba2_chunk_scan(x[b:b + 1, s:e], dt[b:b + 1, s:e], A, B[b:b + 1, s:e],
                                                       C[b:b + 1, s:e], chunk_size, **opts)
                                     for s, e in _runs(seq_idx[b])], dim=1) for b in range(x.shape[0])])

    fresh_kernels.setitem(cuda_kernels._loaded, "causal_conv1d", (fake_conv, ""))
    fresh_kernels.setitem(cuda_kernels._loaded, "mamba_ssm", (fake_scan, ""))
    fresh_kernels.setattr(cuda_kernels, "_on_accelerator", lambda t: True)
    model = tiny_model("bamba")
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    alone, _ = run_separately(model, seqs)
    report = configure_packing(model)
    assert all("mamba_chunk_scan_combined with seq_idx" in d and "causal-conv1d with seq_idx" in d
               for d in report.mixers.values())
    out, _ = run_packed(model, ids, pos, seqs, grad=False)
    assert calls == {"conv": 2, "scan": 2}
    assert max_diff(out, alone) <= 1e-5


@pytest.mark.parametrize(("kernel", "model_type", "dtype"), [
    ("fla", "qwen3_5_text", torch.bfloat16),  # flash-linear-attention takes bf16/fp16 only
    ("causal_conv1d", "lfm2", torch.float32),
    ("mamba_ssm", "bamba", torch.float32),
])
def test_a_kernel_that_fails_at_its_first_call_falls_back_to_the_reference(fresh_kernels, caplog, kernel, model_type,
                                                                            dtype):
    """What triton without a usable GPU does to flash-linear-attention: it imports, then raises at the first call.
    The kernel is a callable that raises (transformers untouched); the batch is computed by the exact reference,
    the kernel is never called again, and the configured model's report is rewritten to say what runs and why."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("triton: 0 active drivers")

    fresh_kernels.setitem(cuda_kernels._loaded, kernel, (broken, ""))
    fresh_kernels.setattr(cuda_kernels, "_on_accelerator", lambda t: True)
    model = tiny_model(model_type).to(dtype)
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        alone = [model(input_ids=s[None], use_cache=False).logits[0] for _, _, s in seqs]
    report = configure_packing(model)
    selected = mixers.KERNEL_DOC[kernel]
    assert all(selected in d for d in report.mixers.values())  # selected: importable, and may run on CUDA tensors
    with caplog.at_level(logging.WARNING, logger="padfree"), torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits
        again = model(input_ids=ids, position_ids=pos).logits
    assert len(calls) == 1 and torch.equal(out, again)
    assert "using the exact PyTorch reference" in caplog.text
    assert cuda_kernels.kernel_status(kernel) == (False, cuda_kernels._broken[kernel])
    for description in configure.packing_state(model).report.mixers.values():
        assert "failed at its first call (RuntimeError: triton: 0 active drivers)" in description
        assert selected not in description
    if dtype == torch.float32:  # exact: packed == every sequence alone
        assert max_diff([out[b, c:c + len(s)] for b, c, s in seqs], alone) <= 1e-5
    else:  # bf16: the same numbers as the reference path taken from the start
        fresh_kernels.setattr(cuda_kernels, "_on_accelerator", lambda t: False)
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, position_ids=pos).logits, out)


def test_a_kernel_that_fails_to_import_is_reported_and_never_used(fresh_kernels):
    real_import = importlib.import_module

    def import_module(name, *args):
        if name.startswith(("fla", "causal_conv1d")):
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return real_import(name, *args)

    fresh_kernels.setattr(cuda_kernels, "_cuda_available", lambda: True)
    fresh_kernels.setattr(cuda_kernels.importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(name=name))
    fresh_kernels.setattr(cuda_kernels.importlib, "import_module", import_module)
    usable, why = cuda_kernels.kernel_status("fla")
    assert not usable and "failed to import (RuntimeError: 0 active drivers" in why
    report = configure_packing(tiny_model("qwen3_5_text"))
    assert all("flash-linear-attention is installed but fla.ops.gated_delta_rule.chunk_gated_delta_rule failed to "
               "import" in d for d in report.mixers.values())


def test_no_kernel_package_is_imported_without_cuda(fresh_kernels):
    """Without CUDA padfree never even imports a kernel package (a triton without a GPU can crash at import)."""
    asked = []
    real_import = importlib.import_module
    fresh_kernels.setattr(cuda_kernels, "_cuda_available", lambda: False)
    fresh_kernels.setattr(cuda_kernels.importlib, "import_module",
                          lambda name, *a: asked.append(name) or real_import(name))
    model = tiny_model("bamba")
    report = configure_packing(model)
    ids, pos, _ = packed_rows(MIXER_ROWS)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    assert not [name for name in asked if name.split(".")[0] in ("fla", "mamba_ssm", "causal_conv1d", "triton")]
    assert all("need a CUDA GPU, none here" in d for d in report.mixers.values())


def test_an_unknown_forward_shape_is_refused(monkeypatch):
    """A mixer class whose forward calls a global function padfree does not know is refused, not guessed."""
    from transformers.models.lfm2 import modeling_lfm2

    source = modeling_lfm2.Lfm2ShortConv

    def forward(self, hidden_states, past_key_values=None, attention_mask=None, **kwargs):
        return some_new_scan(hidden_states)  # noqa: F821

    cls = type("Lfm2ShortConv", (source,), {"forward": forward, "__module__": source.__module__})
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    with pytest.raises(UnsupportedModelError, match="some_new_scan"):
        mixers.install(module, PackingState("padfree_sdpa", report=None))
