"""Boundary-exact sequence mixers (padfree.model.mixers): packed == per-sequence for every hybrid / SSM model type.

Tiny fp32 random-weight models built from configs (hidden 64, attention and mixer layers where the model is hybrid).
Each test packs sequences of different lengths into 2 rows — a sequence of length 1, sequences shorter than the conv
kernel (4), sequences crossing the GatedDeltaNet chunk (64) and many SSD chunks (8) — and compares logits and
parameter gradients of one packed forward/backward with running every sequence alone. A negative control shows that
the same packed call without ``configure_packing`` leaks across the boundaries.
"""

from __future__ import annotations

import importlib
import itertools
import logging
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from padfree import configure_packing  # noqa: E402
from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model import configure, mixers  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
           num_hidden_layers=3)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
           mamba_chunk_size=8)
CONFIGS = {
    "qwen3_next": dict(GDN, **MOE, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(GDN),
    "qwen3_5_moe_text": dict(GDN, **MOE, shared_expert_intermediate_size=32),
    "olmo_hybrid": dict(GDN),
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4,
                 block_multiple_of=16),
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4,
                     num_dense_layers=1, **MOE),
    "bamba": dict(SSD, num_hidden_layers=3, attn_layer_indices=[1]),
    "falcon_h1": dict(SSD, num_hidden_layers=2, mamba_d_ssm=128),
    "granitemoehybrid": dict(SSD, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mamba"], mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=8),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], n_mamba_heads=8,
                   mamba_d_state=16, mamba_ngroups=2, chunk_size=8, mamba_headdim=16),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_dt_rank=8),
    # no attention at all: configure_packing's module scan cannot take them yet (see test_ssm_only_models)
    "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4,
                   chunk_size=8),
    "mamba": dict(num_hidden_layers=2, state_size=8),
    "falcon_mamba": dict(num_hidden_layers=2, state_size=8),
}
HYBRIDS = [t for t in CONFIGS if t not in ("mamba2", "mamba", "falcon_mamba")]
GDN_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
SSD_TYPES = ("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")

# per row: a length-1 sequence, sequences shorter than the conv kernel, one crossing the 64-token GatedDeltaNet chunk
ROWS = [[1, 3, 70, 9], [2, 40, 30, 11]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and a shared 2-core machine turns OpenMP barriers into
    multi-second stalls: run this module on one thread and give the setting back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _have(model_type: str) -> bool:
    try:
        transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        return False
    return True


def tiny(model_type: str, attn: str | None = "sdpa") -> transformers.PreTrainedModel:
    if not _have(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type!r}")
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **CONFIGS[model_type]})
    torch.manual_seed(0)
    level = logging.getLogger("transformers").level
    transformers.logging.set_verbosity_error()
    try:
        kwargs = {} if attn is None else {"attn_implementation": attn}
        return transformers.AutoModelForCausalLM.from_config(config, **kwargs).float()
    finally:
        logging.getLogger("transformers").setLevel(level)


def batch(rows: list[list[int]], seed: int = 1):
    """``(input_ids, position_ids, [(row, start, ids)])`` of rows packed from random sequences of these lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros_like(ids)
    seqs = []
    for b, row in enumerate(rows):
        col = 0
        for n in row:
            s = torch.randint(3, VOCAB, (n,), generator=g)
            ids[b, col:col + n], pos[b, col:col + n] = s, torch.arange(n)
            seqs.append((b, col, s))
            col += n
        pos[b, col:] = torch.arange(width - col)  # a trailing filler run is a segment of its own
    return ids, pos, seqs


def loss_of(logits_of_seq, seqs, total):
    """Token-mean next-token cross-entropy over every sequence (the same normaliser packed and alone)."""
    loss = 0.0
    for (_, _, s), logits in zip(seqs, logits_of_seq, strict=True):
        if len(s) > 1:
            loss = loss + F.cross_entropy(logits[:-1], s[1:], reduction="sum")
    return loss / total


def separate(model, seqs):
    """Logits of every sequence run alone and the parameter gradients of the summed loss."""
    model.zero_grad()
    total = sum(len(s) - 1 for _, _, s in seqs)
    outs = []
    for _, _, s in seqs:
        logits = model(input_ids=s[None], use_cache=False).logits[0]
        if len(s) > 1:
            loss_of([logits], [(0, 0, s)], total).backward()
        outs.append(logits.detach())
    return outs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed(model, ids, pos, seqs, *, grad=True, **kwargs):
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    per_seq = [logits[b, start:start + len(s)] for b, start, s in seqs]
    grads = {}
    if grad:
        loss_of(per_seq, seqs, sum(len(s) - 1 for _, _, s in seqs)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in per_seq], grads


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def grad_diff(ga, gb):
    assert ga.keys() == gb.keys()
    return max(float((ga[k] - gb[k]).abs().max()) for k in ga)


# ---- whole models: packed == per sequence, and the leak without configure_packing ----------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_packed_equals_separate(model_type, backend):
    model = tiny(model_type, attn=backend)
    ids, pos, seqs = batch(ROWS)
    alone, alone_grads = separate(model, seqs)
    leaky, _ = packed(model, ids, pos, seqs, grad=False)
    report = configure_packing(model, backend=backend)
    assert report.supported and not report.unsupported and report.mixers
    out, grads = packed(model, ids, pos, seqs)
    assert max_diff(out, alone) <= 1e-5
    assert grad_diff(grads, alone_grads) <= 1e-5
    if backend == "sdpa":  # negative control: the unconfigured packed call runs state across the boundaries
        assert max_diff(leaky, alone) > 1e-4


@pytest.mark.parametrize("formulation", ["masked", "per-segment"])
def test_both_gated_delta_rule_formulations_in_a_model(formulation):
    model = tiny("qwen3_5_text")
    ids, pos, seqs = batch(ROWS)
    alone, alone_grads = separate(model, seqs)
    configure_packing(model)
    state = configure.packing_state(model)
    for layer in (model.model.layers[0].linear_attn, model.model.layers[2].linear_attn):
        assert f"({formulation})" in mixers.install(layer, state, formulation=formulation)
    out, grads = packed(model, ids, pos, seqs)
    assert max_diff(out, alone) <= 1e-5
    assert grad_diff(grads, alone_grads) <= 1e-5


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid", "jamba"])
def test_segment_mask_with_trailing_padding(model_type):
    """LLaMA-Factory masks ``[1, 1, 2, 2, 2, 0]``: the padding run is a segment of its own and leaks into nothing."""
    model = tiny(model_type)
    rows = [[1, 3, 70, 9], [2, 40, 30]]  # the second row ends in 11 padding tokens
    ids, _, seqs = batch(rows)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        col = 0
        for i, n in enumerate(row):
            mask[b, col:col + n] = i + 1
            col += n
    alone, alone_grads = separate(model, seqs)
    configure_packing(model)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    per_seq = [logits[b, start:start + len(s)] for b, start, s in seqs]
    loss_of(per_seq, seqs, sum(len(s) - 1 for _, _, s in seqs)).backward()
    assert max_diff([x.detach() for x in per_seq], alone) <= 1e-5
    assert grad_diff({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, alone_grads) <= 1e-5


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba"])
def test_gradient_checkpointing_recomputes_with_the_same_boundaries(model_type):
    model = tiny(model_type)
    ids, pos, seqs = batch(ROWS)
    _, alone_grads = separate(model, seqs)
    configure_packing(model)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _, grads = packed(model, ids, pos, seqs)
    assert grad_diff(grads, alone_grads) <= 1e-5


def test_report_names_the_implementation_of_every_mixer():
    model = tiny("qwen3_next")
    report = configure_packing(model)
    assert sorted(report.mixers) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    for description in report.mixers.values():
        assert description.startswith("GatedDeltaNet: scan: ")
        assert "exact torch chunked delta rule" in description and "conv: exact torch conv" in description
        if not torch.cuda.is_available():
            assert "need a CUDA GPU" in description  # why the kernels were not taken
    assert "mixer           model.layers.0.linear_attn: GatedDeltaNet" in str(report)
    olmo = configure_packing(tiny("olmo_hybrid"))  # its decoder layer is what the scan finds: the mixer inside is named
    assert all(d.startswith("linear_attn: GatedDeltaNet") for d in olmo.mixers.values())
    lfm2 = configure_packing(tiny("lfm2"))
    assert all(d.startswith("short convolution: conv: exact torch conv") for d in lfm2.mixers.values())
    jamba = configure_packing(tiny("jamba"))
    assert all("selective scan, decay zeroed" in d for d in jamba.mixers.values())


def test_unpacked_batches_run_transformers_own_code_and_unconfigure_restores_it():
    model = tiny("bamba")
    ids, pos, _ = batch(ROWS)
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


def test_a_stale_layout_never_reaches_a_mixer_whose_model_lost_its_hooks():
    """Defence in depth: a mixer whose state's hooks are gone (a refused or undone configure) runs transformers'
    own forward even if a layout of the right shape is still set."""
    model = tiny("lfm2")
    ids, pos, _ = batch(ROWS)
    with torch.no_grad():
        leaky = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    configure_packing(model)
    state = configure.packing_state(model)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos)
    assert state.layout is not None
    for handle in state.handles:
        handle.remove()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, position_ids=pos, use_cache=False).logits, leaky)


def test_a_packed_batch_with_a_cache_is_refused():
    model = tiny("qwen3_5_text")
    configure_packing(model)
    ids, pos, _ = batch(ROWS)
    with pytest.raises(PackingDisabledError, match="use_cache"):
        model(input_ids=ids, position_ids=pos, use_cache=True)


def _configure_ssm_only(model):
    """What configure_packing does, for a model without attention (its scan refuses those today): the layout hook —
    on the outer model, because these *ForCausalLM wrappers drop ``position_ids`` before calling the backbone — and
    the mixers installed against that state."""
    state = configure._State("padfree_sdpa", report=None)
    config = model.config
    state.handles = [
        model.register_forward_pre_hook(lambda m, a, k: configure._before(state, config, a, k), with_kwargs=True),
        model.register_forward_hook(lambda m, a, k, o: configure._after(state), with_kwargs=True, always_call=True),
    ]
    model._padfree_state = state
    return [mixers.install(m, state) for m in model.modules() if type(m).__name__ in mixers.MIXER_CLASSES]


@pytest.mark.parametrize("model_type", ["mamba2", "mamba", "falcon_mamba"])
def test_ssm_only_models(model_type):
    """Pure state-space models: the mixers are exact; configure_packing itself refuses these types until its module
    scan stops classifying the whole model (its class name contains "Mamba") as one mixer."""
    model = tiny(model_type, attn=None)
    with pytest.raises(UnsupportedModelError):
        configure_packing(model)
    ids, pos, seqs = batch(ROWS)
    alone, alone_grads = separate(model, seqs)
    leaky, _ = packed(model, ids, pos, seqs, grad=False)
    descriptions = _configure_ssm_only(model)
    assert len(descriptions) == 2
    out, grads = packed(model, ids, pos, seqs)
    assert max_diff(out, alone) <= 1e-5
    assert grad_diff(grads, alone_grads) <= 1e-5
    assert max_diff(leaky, alone) > 1e-4


def test_registry():
    for model_type in mixers.MODEL_TYPES:
        assert model_type in configure.SUPPORTED_MODEL_TYPES
    for name in (*mixers.MIXER_CLASSES, *mixers.CONTAINER_CLASSES):
        assert configure.MIXER_HANDLERS[name] is mixers.install
    assert "mamba" not in configure.SUPPORTED_MODEL_TYPES  # refused by configure_packing's scan, see above


# ---- each reference primitive against transformers' own function run on every segment alone ------------------------


def _layout(rows):
    _, pos, _ = batch(rows)
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
        got = mixers.segment_causal_conv1d(x, w, bias, activation, lay)
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
    got = {form: mixers.segment_gated_delta_rule(q, k, v, decay, beta, lay, use_qk_l2norm_in_kernel=True,
                                                 formulation=form) for form in ("masked", "per-segment", "auto")}
    for out in got.values():
        assert out.shape == want.shape and float((out - want).abs().max()) <= 1e-5
    assert float((got["masked"] - got["per-segment"]).abs().max()) <= 1e-5


def test_gated_delta_rule_formulation_choice():
    few, _ = _layout([[600, 700, 748]])
    many, _ = _layout([[16] * 64])
    assert mixers._gdr_formulation(few, 64) == "per-segment"  # little padding to whole chunks
    assert mixers._gdr_formulation(many, 64) == "masked"  # 64 one-chunk segments would pad 4x


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
        mixers.segment_gated_delta_rule(q, k, v, decay, beta, lay, formulation="masked")
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
    got = mixers.segment_ssd_scan(x, dt, a, b_, c_, 8, lay, **opts)
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
    got = mixers.segment_selective_scan(x, dt, a, b_, c_, lay, z=z, **opts)
    want = _per_segment(lambda x, dt, b_, c_, z: mamba_selective_scan(x, dt, a, b_, c_, z=z, **opts), lay,
                        x, dt, b_, c_, z, dim=2)
    assert float((got - want).abs().max()) <= 1e-6


# ---- kernels: chosen when usable, a broken one falls back to the reference with its reason -------------------------


@pytest.fixture
def fresh_kernels(monkeypatch):
    monkeypatch.setattr(mixers, "_loaded", {})
    monkeypatch.setattr(mixers, "_broken", {})
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
    fresh_kernels.setitem(mixers._loaded, "fla", (_fake_fla(calls), ""))
    fresh_kernels.setattr(mixers, "_on_accelerator", lambda t: True)
    model = tiny("qwen3_5_text").to(torch.bfloat16)  # flash-linear-attention takes bf16/fp16 only
    report = configure_packing(model)
    assert all("flash-linear-attention chunk_gated_delta_rule with cu_seqlens" in d for d in report.mixers.values())
    ids, pos, seqs = batch(ROWS)
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

    fresh_kernels.setitem(mixers._loaded, "causal_conv1d", (fake_conv, ""))
    fresh_kernels.setitem(mixers._loaded, "mamba_ssm", (fake_scan, ""))
    fresh_kernels.setattr(mixers, "_on_accelerator", lambda t: True)
    model = tiny("bamba")
    ids, pos, seqs = batch(ROWS)
    alone, _ = separate(model, seqs)
    report = configure_packing(model)
    assert all("mamba_chunk_scan_combined with seq_idx" in d and "causal-conv1d with seq_idx" in d
               for d in report.mixers.values())
    out, _ = packed(model, ids, pos, seqs, grad=False)
    assert calls == {"conv": 2, "scan": 2}
    assert max_diff(out, alone) <= 1e-5


def test_a_kernel_that_fails_at_its_first_call_falls_back_to_the_reference(fresh_kernels, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("triton: no GPU driver")

    fresh_kernels.setitem(mixers._loaded, "fla", (broken, ""))
    fresh_kernels.setattr(mixers, "_on_accelerator", lambda t: True)
    model = tiny("qwen3_5_text").to(torch.bfloat16)
    configure_packing(model)
    ids, pos, _ = batch(ROWS)
    with caplog.at_level(logging.WARNING, logger="padfree"), torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits
    assert "RuntimeError: triton: no GPU driver" in mixers._broken["fla"]
    assert "using the exact PyTorch reference" in caplog.text
    assert mixers.kernel_status("fla") == (False, mixers._broken["fla"])
    fresh_kernels.setattr(mixers, "_on_accelerator", lambda t: False)
    with torch.no_grad():  # the same model on the reference path gives the same numbers
        assert torch.equal(model(input_ids=ids, position_ids=pos).logits, out)


def test_a_kernel_that_fails_to_import_is_reported_and_never_used(fresh_kernels):
    real_import = importlib.import_module

    def import_module(name, *args):
        if name.startswith(("fla", "causal_conv1d")):
            raise RuntimeError("0 active drivers ([]). There should only be one.")
        return real_import(name, *args)

    fresh_kernels.setattr(mixers, "_cuda_available", lambda: True)
    fresh_kernels.setattr(mixers.importlib.util, "find_spec", lambda name, *a: types.SimpleNamespace(name=name))
    fresh_kernels.setattr(mixers.importlib, "import_module", import_module)
    usable, why = mixers.kernel_status("fla")
    assert not usable and "failed to import (RuntimeError: 0 active drivers" in why
    report = configure_packing(tiny("qwen3_5_text"))
    assert all("flash-linear-attention is installed but fla.ops.gated_delta_rule.chunk_gated_delta_rule failed to "
               "import" in d for d in report.mixers.values())


def test_no_kernel_package_is_imported_without_cuda(fresh_kernels):
    """Without CUDA padfree never even imports a kernel package (a triton without a GPU can crash at import)."""
    asked = []
    real_import = importlib.import_module
    fresh_kernels.setattr(mixers, "_cuda_available", lambda: False)
    fresh_kernels.setattr(mixers.importlib, "import_module", lambda name, *a: asked.append(name) or real_import(name))
    model = tiny("bamba")
    report = configure_packing(model)
    ids, pos, _ = batch(ROWS)
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
        mixers.install(module, configure._State("padfree_sdpa", report=None))


def test_container_with_an_unknown_mixer_is_refused():
    class JambaMambaDecoderLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 3, groups=4)

    with pytest.raises(UnsupportedModelError, match="Conv1d"):
        mixers.install(JambaMambaDecoderLayer(), configure._State("padfree_sdpa", report=None))
