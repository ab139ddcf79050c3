"""The recurrent families: RecurrentGemma's RG-LRU block, RWKV, xLSTM, and the short convolutions of LFM3, Inkling,
Inkling2 and Zamba's Mamba-1 mixer.

Whole tiny models (the sweep's, built from each config class's defaults) are proven packed == per-sequence in fp32 on
sdpa and eager (one backend where the model has no attention), under bf16 autocast and with bf16 weights; the same
comparison catches each family with its reset switched off; each segment primitive matches transformers' own
computation run on every segment alone (a length-1 segment, segments shorter than the conv kernel or a chunk,
segments crossing chunks, a trailing padding run); and a cache never reaches a packed module.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model import configure, install, rebind  # noqa: E402
from padfree.model.families import convs, rglru, rwkv, scan_mixers, xlstm  # noqa: E402
from padfree.model.flight import forward_of  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.proof.compare import prove  # noqa: E402
from padfree.proof.sweep import PRECISIONS  # noqa: E402
from padfree.proof.tiny import build_tiny, quiet  # noqa: E402
from zoo import SCAN_WIDTH, scan_layout, scan_segments  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NO_ATTENTION = {"sdpa": ("fp32", "autocast_bf16", "bf16")}  # backend "none": sdpa and eager are one run


def _without_boundaries(lay: PackedLayout) -> PackedLayout:
    return PackedLayout.from_position_ids(torch.arange(lay.shape[1]).expand(lay.shape))


def _proof(model_type: str, plan=PRECISIONS, **kwargs):
    with quiet():
        return prove(build_tiny(model_type), backends=list(plan), precisions=plan, **kwargs)


# ---- whole models ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["lfm3", "zamba", "recurrent_gemma"])
def test_packed_equals_each_sequence_alone(model_type):
    proof = _proof(model_type)
    assert proof.ok, str(proof)
    assert {(c.backend, c.precision) for c in proof.checks} == {
        ("padfree_sdpa", "fp32"), ("padfree_sdpa", "autocast_bf16"), ("padfree_sdpa", "bf16"),
        ("padfree_eager", "fp32")}
    assert proof.mixers and not proof.blind


def test_rwkv_packed_equals_each_sequence_alone():
    proof = _proof("rwkv", NO_ATTENTION)
    assert proof.ok, str(proof)
    assert {c.precision for c in proof.checks} == {"fp32", "autocast_bf16", "bf16"}
    assert sorted(set(proof.mixers.values())) == [
        "RWKV channel mixing: token shift zeroed at segment starts",
        "RWKV time mixing: token shift zeroed at segment starts; WKV: transformers' recurrence over the tokens (its "
        "CPU path), state restarted at segment starts"]


def test_xlstm_packed_equals_each_sequence_alone():
    proof = _proof("xlstm", {"sdpa": ("fp32", "autocast_bf16")})
    assert proof.ok, str(proof)
    assert {c.precision for c in proof.checks} == {"fp32", "autocast_bf16"}


def test_xlstm_with_bf16_weights_fails_in_transformers_itself():
    """Why xlstm's bf16-weight check cannot run: transformers' own chunkwise kernel mixes its fp32 initial state with
    bf16 keys for any sequence of a chunk or more, unpacked. When this starts passing, prove bf16 above."""
    model = build_tiny("xlstm").to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="same dtype"):
        model(input_ids=torch.randint(3, 90, (1, model.config.chunk_size)), use_cache=False)


def _leaky(lay):
    return _without_boundaries(lay) if isinstance(lay, PackedLayout) else lay


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm", "lfm3", "recurrent_gemma"])
def test_the_same_comparison_catches_a_family_whose_reset_is_off(monkeypatch, model_type):
    """The negative control of the families themselves: their primitives run as if the row were one sequence."""
    if model_type == "rwkv":
        monkeypatch.setattr(rwkv, "_starts", lambda lay: rglru.segment_positions(_leaky(lay)) == 0)
    elif model_type == "xlstm":
        exact = xlstm.chunk_plan
        monkeypatch.setattr(xlstm, "chunk_plan", lambda lay, chunk: exact(_leaky(lay), chunk))
    elif model_type == "lfm3":
        exact = scan_mixers.segment_causal_conv1d
        monkeypatch.setattr(scan_mixers, "segment_causal_conv1d", lambda *a: exact(*map(_leaky, a)))
    else:
        exact_conv, exact_pos = rglru.segment_causal_conv1d, rglru.segment_positions
        monkeypatch.setattr(rglru, "segment_causal_conv1d", lambda *a: exact_conv(*map(_leaky, a)))
        monkeypatch.setattr(rglru, "segment_positions", lambda lay: exact_pos(_leaky(lay)))
    proof = _proof(model_type, {"sdpa": ("fp32",)}, grads=False)
    (check,) = proof.checks
    assert not check.ok and check.logits > 100 * check.tolerance


def test_unpacked_batches_run_transformers_own_code_and_uninstall_restores_it():
    model = build_tiny("rwkv")
    ids = torch.randint(3, 90, (2, 20))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        report = configure.install_packing(model)
        assert set(report.mixers) == {f"rwkv.blocks.{i}.{m}" for i in (0, 1) for m in ("attention", "feed_forward")}
        assert torch.equal(model(input_ids=ids).logits, plain)
    block = model.rwkv.blocks[0]
    assert "forward" in block.attention.time_shift.__dict__
    configure.unconfigure_packing(model)
    assert "forward" not in block.attention.__dict__ and "forward" not in block.attention.time_shift.__dict__


# ---- the segment primitives against transformers' code on every segment alone ----------------------------------


def test_wkv_matches_transformers_recurrence_on_every_segment_alone():
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu

    lay = scan_layout()
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, *lay.shape, 8, generator=g).unbind(0)
    decay, first = torch.randn(2, 8, generator=g).unbind(0)
    key.requires_grad_(True)
    out = rwkv.segment_wkv(decay, first, key, value, lay)
    for row, start, n in scan_segments(lay):
        alone, _ = rwkv_linear_attention_cpu(decay, first, key[row:row + 1, start:start + n],
                                             value[row:row + 1, start:start + n])
        torch.testing.assert_close(out[row:row + 1, start:start + n], alone, rtol=0, atol=0)
    grad, = torch.autograd.grad(out[0, 4:74].sum(), key)
    assert grad[:, :4].abs().max() == 0 and grad[1].abs().max() == 0  # the 70-token segment reads nothing else


def test_token_shift_restarts_at_every_segment():
    module = build_tiny("rwkv").rwkv.blocks[1].feed_forward
    rwkv.install(module, None)
    lay = scan_layout()
    hidden = torch.randn(*lay.shape, module.key.in_features)
    token = rwkv._LAYOUT.set(lay)
    try:
        shifted = module.time_shift(hidden)
    finally:
        rwkv._LAYOUT.reset(token)
    for row, start, n in scan_segments(lay):
        alone = torch.nn.functional.pad(hidden[row, start:start + n], (0, 0, 1, -1))
        torch.testing.assert_close(shifted[row, start:start + n], alone, rtol=0, atol=0)


def test_chunk_plan_puts_every_segment_on_chunks_of_its_own():
    lay = scan_layout()
    gather, where, starts = xlstm.chunk_plan(lay, 8)
    total = lay.shape[0] * lay.shape[1]
    # row 0: 1 + 1 + 9 + 2 chunks for lengths 1, 3, 70, 9; row 1: 1 + 5 + 4 + 2 for 2, 40, 30 and the padding run
    assert starts.shape == (2, 13)
    assert starts[0].nonzero().flatten().tolist() == [0, 1, 2, 11]
    assert starts[1].nonzero().flatten().tolist() == [0, 1, 6, 10, 12]  # the padding chunk after row 1 included
    assert torch.equal(gather.reshape(-1)[where], torch.arange(total))
    assert int((gather < total).sum()) == total


def test_mlstm_matches_transformers_backend_on_every_segment_alone():
    layer = build_tiny("xlstm").backbone.blocks[0].mlstm_layer
    backend, config = layer.mlstm_backend, layer.config
    lay = scan_layout()
    g = torch.Generator().manual_seed(0)
    heads = config.num_heads
    q, k = torch.randn(2, 2, heads, SCAN_WIDTH, config.qk_head_dim, generator=g).unbind(0)
    v = torch.randn(2, heads, SCAN_WIDTH, config.v_head_dim, generator=g)
    i, f = (3 * torch.randn(2, heads, SCAN_WIDTH, generator=g) for _ in range(2))
    q.requires_grad_(True)
    parallel = __import__(type(layer).__module__, fromlist=["x"]).mlstm_chunkwise_parallel_fw_H
    out = xlstm.segment_mlstm(q, k, v, i, f, lay, chunk_size=config.chunk_size, eps=config.eps, parallel=parallel)
    for row, start, n in scan_segments(lay):
        piece = [x[row:row + 1, :, start:start + n] for x in (q, k, v, i, f)]
        alone, _ = type(backend).forward(backend, *piece)  # chunkwise, then token by token for the partial chunk
        torch.testing.assert_close(out[row:row + 1, :, start:start + n], alone, rtol=1e-5, atol=1e-5)
    grad, = torch.autograd.grad(out[0, :, 4:74].sum(), q)
    assert grad[..., :4, :].abs().max() == 0 and grad[1].abs().max() == 0


def test_recurrent_gemma_conv_restarts_at_every_segment():
    conv = build_tiny("recurrent_gemma").model.layers[0].temporal_block.conv_1d
    lay = scan_layout()
    x = torch.randn(lay.shape[0], conv.in_channels, SCAN_WIDTH)
    with torch.no_grad():
        out = rglru.segment_conv(x, conv.weight, conv.bias, lay)
        for row, start, n in scan_segments(lay):  # lengths 1, 2 and 3 are shorter than the 4-tap kernel
            alone = conv(x[row:row + 1, :, start:start + n])[..., :n]
            torch.testing.assert_close(out[row:row + 1, :, start:start + n], alone, rtol=1e-6, atol=1e-6)
    assert rglru.segment_positions(lay)[1, 72:].tolist() == list(range(11))  # the padding run restarts too


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_convolutions_restart_at_every_segment(model_type):
    """Inkling2's static convolutions (rebound) and dynamic ones (given seq_idx), module by module: its whole model
    is refused for its attention (see the report), not for these."""
    model = build_tiny(model_type)
    lay = scan_layout()
    seen = set()
    for module in model.modules():
        name = type(module).__name__
        if not (name in convs.CLASSES or name.endswith("ShortConvolution")) or name in seen:
            continue
        seen.add(name)
        width = module.conv1d.in_channels if hasattr(module, "conv1d") else module.static_weight.shape[1]
        hidden = torch.randn(*lay.shape, width)
        args = (hidden, torch.randn(*lay.shape, model.config.get_text_config().hidden_size)) \
            if hasattr(module, "static_weight") else (hidden,)
        install.families()[name].install(module, None)  # its family: the dynamic ones convs, the rest scan_mixers
        with torch.no_grad():
            out = rebind.run_packed(module, lay, *args, cache_offset=0)
        for row, start, n in scan_segments(lay):
            with torch.no_grad():
                alone = type(module).forward(module, *(a[row:row + 1, start:start + n] for a in args))
            torch.testing.assert_close(out[row:row + 1, start:start + n], alone, rtol=1e-6, atol=1e-6)
    assert len(seen) == 2


# ---- caches and foreign forwards ----------------------------------------------------------------------------------


def _packed_call(model):
    ids = torch.randint(3, 90, (1, 6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    configure.install_packing(model)
    with pytest.raises(PackingDisabledError):
        model(input_ids=ids, position_ids=pos, use_cache=True)
    model(input_ids=ids, position_ids=pos)
    # the packed forward is over and took its layout with it: a module called on its own sees one when entered
    return forward_of(configure.packing_state(model), PackedLayout.from_position_ids(pos))


def test_a_cache_never_reaches_a_packed_module():
    hidden = torch.randn(1, 6, 64)
    model = build_tiny("rwkv")
    with _packed_call(model):
        attention = model.rwkv.blocks[0].attention
        state = [torch.zeros(1, 64, 2) for _ in range(5)]
        with pytest.raises(PackingDisabledError, match="state"):
            attention(hidden, state=state)
        with pytest.raises(PackingDisabledError, match="use_cache"):
            attention(hidden, use_cache=True)

    model = build_tiny("xlstm")
    with _packed_call(model):
        layer = model.backbone.blocks[0].mlstm_layer
        with pytest.raises(PackingDisabledError, match="recurrent state"):
            layer(hidden, state=(torch.zeros(1), torch.zeros(1), torch.zeros(1)))

    model = build_tiny("lfm3")
    with _packed_call(model), pytest.raises(PackingDisabledError, match="cache"):
        model.model.layers[0].conv(hidden, cache=transformers.DynamicCache())

    model = build_tiny("recurrent_gemma")
    with _packed_call(model):
        block = model.model.layers[0].temporal_block
        pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
        with pytest.raises(PackingDisabledError, match="use_cache"):
            block(hidden, pos, None, use_cache=True)
        with pytest.raises(PackingDisabledError, match="cache"):
            block(hidden, pos, None, use_cache=False, cache=transformers.DynamicCache())


def test_a_forward_of_another_shape_is_refused():
    from transformers.models.rwkv.modeling_rwkv import RwkvSelfAttention

    def forward(self, hidden, state=None, use_cache=False):
        return torch.cumsum(hidden, 1), state

    changed = type("RwkvSelfAttention", (RwkvSelfAttention,), {"forward": forward})
    module = build_tiny("rwkv").rwkv.blocks[0].attention
    module.__class__ = changed
    with pytest.raises(UnsupportedModelError, match="proved exact"):
        rwkv.install(module, None)
    block = build_tiny("recurrent_gemma").model.layers[0].temporal_block
    block.conv_1d.padding = (0,)
    with pytest.raises(UnsupportedModelError, match="depthwise causal"):
        rglru.install(block, None)
    with pytest.raises(UnsupportedModelError, match="not a convolution"):
        convs.install(torch.nn.Linear(2, 2), None)
