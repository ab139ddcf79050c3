"""The linear-attention families: lightning attention (minimax), Kimi delta attention (kimi_linear, bailing_hybrid) and
the GatedDeltaNet under another name (lara_mini).

Whole tiny models (the sweep's, built from each config class's defaults) are proven packed == per-sequence in fp32 on
sdpa and eager, under bf16 autocast and with bf16 weights; the same comparison catches the module with its reset
switched off; each segment primitive matches the computation run on every segment alone (a length-1 segment,
segments shorter than the conv kernel or a block, segments crossing chunks and blocks, a trailing padding run); and
a cache never reaches a packed mixer.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model import configure, install  # noqa: E402
from padfree.model.families import kda, lightning, scan_mixers  # noqa: E402
from padfree.model.flight import forward_of  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.model.state import packing_state  # noqa: E402
from padfree.proof.compare import prove  # noqa: E402
from padfree.proof.sweep import PRECISIONS  # noqa: E402
from padfree.proof.tiny import build_tiny, quiet  # noqa: E402
from zoo import SCAN_WIDTH, scan_layout, scan_segments  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")



def _installed(model_type: str) -> None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


def _proof(model_type: str):
    with quiet():
        return prove(build_tiny(model_type), backends=list(PRECISIONS), precisions=PRECISIONS)


def _kimi_attention_is_taken_for_a_mixer() -> bool:
    model = build_tiny("kimi_linear")
    _, _, mixers = install.scan_model(model)
    return any(type(m).__name__ == "KimiLinearAttention" for _, m in mixers)


# ---- whole models ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["minimax", "bailing_hybrid", "lara_mini", "kimi_linear"])
def test_packed_equals_each_sequence_alone(model_type):
    _installed(model_type)
    if model_type == "kimi_linear" and _kimi_attention_is_taken_for_a_mixer():
        pytest.skip("configure's scan takes KimiLinearAttention (MLA, softmax attention) for a linear-attention "
                    "mixer by its name; its KDA layers are proven through bailing_hybrid meanwhile")
    proof = _proof(model_type)
    assert proof.ok, str(proof)
    assert {(c.backend, c.precision) for c in proof.checks} == {
        ("padfree_sdpa", "fp32"), ("padfree_sdpa", "autocast_bf16"), ("padfree_sdpa", "bf16"),
        ("padfree_eager", "fp32")}
    assert proof.mixers and not proof.blind


def _without_boundaries(lay: PackedLayout) -> PackedLayout:
    return PackedLayout.from_position_ids(torch.arange(lay.shape[1]).expand(lay.shape))


@pytest.mark.parametrize(("model_type", "module", "primitive"), [
    ("minimax", lightning, "segment_lightning_attention"),
    ("bailing_hybrid", kda, "segment_kimi_delta_attention"),
])
def test_the_same_comparison_catches_a_mixer_whose_state_is_not_reset(monkeypatch, model_type, module, primitive):
    """The negative control of the families themselves: the packed primitive run as if the row were one sequence."""
    exact = getattr(module, primitive)
    monkeypatch.setattr(module, primitive, lambda *a, **k: exact(
        *(_without_boundaries(x) if isinstance(x, PackedLayout) else x for x in a), **k))
    with quiet():
        proof = prove(build_tiny(model_type), backends=["sdpa"], precisions=["fp32"], grads=False)
    (check,) = proof.checks
    assert not check.ok and check.logits > 100 * check.tolerance


def test_a_cache_never_reaches_a_packed_mixer():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model = build_tiny("minimax")
    configure.install_packing(model)
    ids = torch.randint(3, 90, (1, 6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(PackingDisabledError, match="use_cache"):
        model(input_ids=ids, position_ids=pos, use_cache=True)
    lay = PackedLayout.from_position_ids(pos)
    layer = model.model.layers[1].self_attn
    hidden = torch.randn(1, 6, model.config.hidden_size)
    with forward_of(packing_state(model), lay), pytest.raises(PackingDisabledError, match="cache"):
        layer(hidden, position_embeddings=None, attention_mask=None, cache=MiniMaxCache())
    bailing = build_tiny("bailing_hybrid")
    configure.install_packing(bailing)
    with forward_of(packing_state(bailing), lay), pytest.raises(PackingDisabledError, match="cache"):
        bailing.model.layers[0].self_attn(hidden, cache=transformers.DynamicCache())


def test_unpacked_batches_run_transformers_own_forward():
    model = build_tiny("minimax")
    ids = torch.randint(3, 90, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        configure.install_packing(model)
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, plain)
    configure.unconfigure_packing(model)
    assert "forward" not in model.model.layers[1].self_attn.__dict__


def test_a_forward_of_another_shape_is_refused():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    def forward(self, hidden_states, **kwargs):
        return self.token_shift(hidden_states), None

    changed = type("MiniMaxLightningAttention", (MiniMaxLightningAttention,), {"forward": forward})
    with pytest.raises(UnsupportedModelError, match="token_shift"):
        lightning.install(changed.__new__(changed), None)
    with pytest.raises(UnsupportedModelError, match="not a Kimi delta attention"):
        kda.install(torch.nn.Linear(2, 2), None)


# ---- the segment primitives against every segment alone --------------------------------------------------------


def _dense_lightning(q, k, v, slope, seg):
    """``out[t] = sum_{s <= t, same segment} exp(-slope (t - s)) (q[t] . k[s]) v[s]``, all pairs at once."""
    t = torch.arange(q.shape[2], dtype=q.dtype)
    gap = t[:, None] - t[None, :]
    decay = torch.exp(-slope * gap.clamp_min(0)) * (gap >= 0)
    same = (seg[:, :, None] == seg[:, None, :]).unsqueeze(1)
    return ((q @ k.transpose(-1, -2)) * decay * same) @ v


@pytest.mark.parametrize("block_size", [8, 64, 256])
def test_lightning_primitive_matches_the_decayed_sum_per_segment(block_size):
    lay = scan_layout()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 3, SCAN_WIDTH, 8, generator=g, dtype=torch.float64).unbind(0)
    slope = torch.tensor([0.4, 0.1, 0.02], dtype=torch.float64).view(3, 1, 1)
    q.requires_grad_(True)
    out = lightning.segment_lightning_attention(q, k, v, slope, block_size, lay)
    ref = _dense_lightning(q, k, v, slope, lay.seq_idx)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad, = torch.autograd.grad(out.square().sum(), q)
    ref_grad, = torch.autograd.grad(ref.square().sum(), q)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_lightning_primitive_uses_the_module_decay_tables():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    module = build_tiny("minimax").model.layers[1].self_attn
    assert isinstance(module, MiniMaxLightningAttention)
    tables = lightning.decay_tables(module.slope_rate, module.block_size)
    for mine, theirs in zip(tables, (module.query_decay, module.key_decay, module.diagonal_decay), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def _kda_inputs(lay: PackedLayout, heads=2, dk=8, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch, seq_len = lay.shape
    q, k = torch.randn(2, batch, seq_len, heads, dk, generator=g).unbind(0)
    v = torch.randn(batch, seq_len, heads, dv, generator=g)
    decay = -torch.rand(batch, seq_len, heads, dk, generator=g)
    beta = torch.rand(batch, seq_len, heads, generator=g)
    return q, k, v, decay, beta


@pytest.mark.parametrize("rule", ["chunk", "recurrent"])
def test_kda_primitive_matches_transformers_rule_on_every_segment_alone(rule):
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    lay = scan_layout()
    q, k, v, decay, beta = _kda_inputs(lay)
    out = kda.segment_kimi_delta_attention(q, k, v, decay, beta, lay, use_qk_l2norm_in_kernel=True)
    for row, start, n in scan_segments(lay):
        piece = (x[row:row + 1, start:start + n] for x in (q, k, v, decay, beta))
        if rule == "chunk":
            alone, _ = kimi.chunk_kimi_delta_attention(*piece, use_qk_l2norm_in_kernel=True)
        else:  # the per-token recurrence: an independent reference of the chunked algebra
            alone, _ = kimi.recurrent_kimi_delta_attention(*piece, initial_state=None, output_final_state=False,
                                                           use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[row:row + 1, start:start + n], alone, rtol=1e-5, atol=1e-5)


def test_the_scan_mixers_gated_delta_net_runs_lara_minis_under_its_own_name():
    _installed("lara_mini")
    model = build_tiny("lara_mini")
    report = configure.install_packing(model)
    assert set(report.mixers) == {"model.layers.0.linear_attn"}
    assert report.mixers["model.layers.0.linear_attn"].startswith("GatedDeltaNet: scan: exact torch chunked")
    layer = model.model.layers[0].linear_attn
    assert isinstance(layer.forward, types.MethodType) and layer._padfree_mixer.kind == "gated-delta-net"
    assert scan_mixers.uninstall(model) and "forward" not in layer.__dict__
