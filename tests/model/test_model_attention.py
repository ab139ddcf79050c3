"""The boundary-exact attention backends (padfree.model.attention), called directly on random q/k/v.

Every backend against ``scaled_dot_product_attention`` run on each segment alone (fp32, <= 1e-5), with the options
transformers' attention modules hand over (scaling, GQA/MQA, sliding windows, softcapping, sinks, dropout), next to
a negative control the same comparison catches (causal attention over the whole row); the registered attention and
mask functions, packed and unpacked; and every refusal, with its reason. flex_attention compiles its kernel on the
CPU (about half a minute a call here): one call covers it. varlen_attn needs CUDA.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import padfree
from padfree.errors import BackendUnavailableError, InvalidLayoutError, PackingDisabledError
from padfree.model.attention import BACKENDS, LAYOUT_KWARG, PACKED_FORWARD, packed_forward, register_backends
from padfree.model.packed import PackedLayout
from padfree.proof.tiny import build_tiny
from zoo import packed_case

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
HEADS, DIM = 4, 16
_SIZES = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
# length-1 segments, one longer than its row's other segments together, one past a bucket's grid step (37 -> 40),
# rows of different counts, and a padding tail in the second row
ROWS = [[1, 5, 37, 1, 3], [9, 2, 20]]
WIDTH = 47


def attention_module(kv_heads: int = 2) -> torch.nn.Module:
    """A real transformers attention module (the backends read its class name and ``training`` flag)."""
    config = transformers.LlamaConfig(**_SIZES, num_key_value_heads=kv_heads)
    return transformers.models.llama.modeling_llama.LlamaAttention(config, 0).eval()


def segments_of(rows: list[list[int]], width: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The segment-id mask of ``rows`` (trailing padding 0) and every real sequence's ``(row, start, length)``."""
    seg = torch.zeros(len(rows), width, dtype=torch.int64)
    spans = []
    for b, row in enumerate(rows):
        col = 0
        for k, n in enumerate(row):
            seg[b, col:col + n] = k + 1
            spans.append((b, col, n))
            col += n
    return seg, spans


def qkv(kv_heads: int = 2, seed: int = 0, width: int = WIDTH, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, width, DIM, generator=gen)
    k, v = (torch.randn(batch, kv_heads, width, DIM, generator=gen) for _ in range(2))
    return q, k, v


def reference(q, k, v, spans, *, scaling=None, window=None, softcap=None, sinks=None, bias=None, token_sinks=None,
              bias_from_row_start=False):
    """``(B, T, H, D)``: every sequence attending to itself alone — ``F.scaled_dot_product_attention`` on its own
    slice, or (softcap, sinks, a position bias, per-query sinks) the written-out softmax of the same slice. A
    ``(B | 1, H | 1, T, T)`` bias gives each sequence the block between its own tokens (the control
    ``bias_from_row_start``: the block at the row's start, as a sequence alone would build it from positions 0 ..
    n-1 of an absolute table). Padding: 0."""
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    groups = q.shape[1] // k.shape[1]
    scale = DIM ** -0.5 if scaling is None else scaling
    for b, start, n in spans:
        qs, ks, vs = (x[b:b + 1, :, start:start + n] for x in (q, k, v))
        i = torch.arange(n)
        allowed = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] < window) if window else True)
        if softcap is None and sinks is None and bias is None and token_sinks is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=groups > 1)
        else:
            ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
            s = qs @ ks.transpose(-1, -2) * scale
            if bias is not None:
                at, row = (0, 0) if bias_from_row_start else (start, b if bias.shape[0] > 1 else 0)
                s = s + bias[row:row + 1, :, at:at + n, at:at + n]
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(1, -1, n, 1)], dim=-1)
            if token_sinks is not None:
                s = torch.cat([s, token_sinks[b:b + 1, :, start:start + n]], dim=-1)
            o = s.softmax(-1)[..., :n] @ vs
        out[b, start:start + n] = o[0].transpose(0, 1)
    return out


def worst(got, want, spans) -> float:
    """Largest |got - want| over every real token."""
    return max(float((got[b, s:s + n] - want[b, s:s + n]).abs().max()) for b, s, n in spans)


_GEN = torch.Generator().manual_seed(11)
VARIANTS = {
    "plain": dict(kv_heads=4, opts={}),
    "gqa": dict(kv_heads=2, opts={}),
    "mqa": dict(kv_heads=1, opts={}),
    "scaling": dict(kv_heads=2, opts={"scaling": 0.05}),
    "window 1": dict(kv_heads=2, opts={"sliding_window": 1}),
    "window 4": dict(kv_heads=2, opts={"sliding_window": 4}),
    "window past every segment": dict(kv_heads=2, opts={"sliding_window": 64}),
    "softcap": dict(kv_heads=2, opts={"softcap": 2.0, "scaling": 0.5}),
    "softcap and window": dict(kv_heads=2, opts={"softcap": 2.0, "sliding_window": 4}),
    "sinks": dict(kv_heads=2, opts={"s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0])}),
    "sinks and window": dict(kv_heads=2, opts={"s_aux": torch.tensor([0.5, -1.0, 2.0, 0.0]), "sliding_window": 4}),
    "dropout in eval": dict(kv_heads=2, opts={"dropout": 0.5}),
    # Inkling's relative position bias (B, H, T, T), and one over every row and head; Inkling2's per-query sinks
    "position bias": dict(kv_heads=2, opts={"position_bias": torch.randn(2, HEADS, WIDTH, WIDTH, generator=_GEN)}),
    "position bias for every row and head": dict(
        kv_heads=2, opts={"position_bias": torch.randn(1, 1, WIDTH, WIDTH, generator=_GEN), "sliding_window": 4}),
    "per-query sinks": dict(kv_heads=2, opts={"sinks": torch.randn(2, HEADS, WIDTH, 1, generator=_GEN)}),
    "per-query sinks and a position bias": dict(
        kv_heads=2, opts={"sinks": torch.randn(2, HEADS, WIDTH, 1, generator=_GEN),
                          "position_bias": torch.randn(2, HEADS, WIDTH, WIDTH, generator=_GEN)}),
}


def _reference_options(opts: dict) -> dict:
    return dict(scaling=opts.get("scaling"), window=opts.get("sliding_window"), softcap=opts.get("softcap"),
                sinks=opts.get("s_aux"), bias=opts.get("position_bias"), token_sinks=opts.get("sinks"))


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("backend", ["padfree_sdpa", "padfree_eager"])
@pytest.mark.parametrize("source", ["segment_ids", "position_ids"])
def test_bucketed_backends_equal_each_segment_alone(backend, variant, source):
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    if source == "position_ids":
        lay = PackedLayout.from_position_ids(lay.position_ids)  # the padding run: a segment of its own
    q, k, v = qkv(variant["kv_heads"])
    got = packed_forward(backend, attention_module(variant["kv_heads"]), q, k, v, lay, **variant["opts"])
    assert got.shape == (2, WIDTH, HEADS, DIM)
    assert worst(got, reference(q, k, v, spans, **_reference_options(variant["opts"])), spans) <= TOL
    assert torch.isfinite(got).all()  # the padding run too


@pytest.mark.parametrize("backend", ["padfree_sdpa", "padfree_eager"])
def test_gradients_equal_each_segment_alone(backend):
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    real = seg > 0
    grads = []
    for run in (lambda q, k, v: packed_forward(backend, attention_module(), q, k, v, lay, sliding_window=6),
                lambda q, k, v: reference(q, k, v, spans, window=6)):
        q, k, v = (x.requires_grad_() for x in qkv(2, seed=1))
        weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2))
        (run(q, k, v) * weight)[real].sum().backward()  # the loss reads real tokens only
        grads.append((q.grad, k.grad, v.grad))
    for got, want in zip(*grads, strict=True):
        assert float((got - want).abs().max()) <= TOL


@pytest.mark.parametrize("backend", ["padfree_sdpa", "padfree_eager"])
def test_a_position_bias_and_per_query_sinks_get_their_gradients_and_their_own_blocks(backend):
    """The bias and the sinks are model outputs (Inkling's relative logits, Inkling2's sink projection): their
    gradients, like q/k/v's, are each segment's alone. The control reads every segment's bias block at the row's
    start — what a table of absolute positions would hand a sequence alone — and is caught."""
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    real = seg > 0
    grads = []
    for run in (lambda q, k, v, b, z: packed_forward(backend, attention_module(), q, k, v, lay, position_bias=b,
                                                     sinks=z),
                lambda q, k, v, b, z: reference(q, k, v, spans, bias=b, token_sinks=z)):
        q, k, v = (x.requires_grad_() for x in qkv(2, seed=1))
        gen = torch.Generator().manual_seed(4)
        b, z = torch.randn(2, HEADS, WIDTH, WIDTH, generator=gen).requires_grad_(), torch.randn(
            2, HEADS, WIDTH, 1, generator=gen).requires_grad_()
        weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2))
        (run(q, k, v, b, z) * weight)[real].sum().backward()
        grads.append((q.grad, k.grad, v.grad, b.grad, z.grad))
    for got, want in zip(*grads, strict=True):
        assert float((got - want).abs().max()) <= TOL
    q, k, v = qkv(2, seed=1)
    bias = torch.randn(2, HEADS, WIDTH, WIDTH, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = packed_forward(backend, attention_module(), q, k, v, lay, position_bias=bias)
    assert worst(got, reference(q, k, v, spans, bias=bias, bias_from_row_start=True), spans) > 1000 * TOL


def test_negative_control_attention_over_the_whole_row_is_caught():
    """The comparison above sees a leak: causal SDPA over the whole row (what an unpacked backend computes) differs
    from each segment alone by far more than the tolerance, and so does a window off by one."""
    seg, spans = segments_of(ROWS, WIDTH)
    q, k, v = qkv(2)
    want = reference(q, k, v, spans)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert worst(whole, want, spans) > 1000 * TOL
    lay = PackedLayout.from_segment_ids(seg)
    off = packed_forward("padfree_sdpa", attention_module(), q, k, v, lay, sliding_window=5)
    assert worst(off, reference(q, k, v, spans, window=4), spans) > 1000 * TOL
    one_row = PackedLayout.from_position_ids(torch.arange(WIDTH).expand(2, WIDTH))  # boundaries lost
    assert worst(packed_forward("padfree_sdpa", attention_module(), q, k, v, one_row), want, spans) > 1000 * TOL


def test_dropout_is_applied_in_training_and_only_there():
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    q, k, v = qkv(2)
    want = reference(q, k, v, spans)
    module = attention_module().train()
    for backend in ("padfree_sdpa", "padfree_eager"):
        assert worst(packed_forward(backend, module, q, k, v, lay, dropout=0.0), want, spans) <= TOL
        dropped = packed_forward(backend, module, q, k, v, lay, dropout=0.5)
        assert worst(dropped, want, spans) > 1000 * TOL and torch.isfinite(dropped).all()


def test_routing_keyword_arguments_change_nothing():
    """What transformers hands every attention function alongside the tensors (positions, flash offsets, output
    switches, the loss normaliser) describes the batch, never the attention: accepted and ignored."""
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    q, k, v = qkv(2)
    got = packed_forward("padfree_sdpa", attention_module(), q, k, v, lay, position_ids=lay.position_ids,
                         cu_seq_lens_q=lay.cu_seqlens, cu_seq_lens_k=lay.cu_seqlens, max_length_q=37,
                         max_length_k=37, cache_position=torch.arange(WIDTH), output_attentions=False, use_cache=False,
                         num_items_in_batch=torch.tensor(50), is_causal=True, position_bias=None, layer_idx=0)
    assert worst(got, reference(q, k, v, spans), spans) <= TOL


# ---- the registered functions ------------------------------------------------------------------------------------


def test_registered_attention_functions_run_packed_with_a_layout_and_the_base_backend_without():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_backends()
    register_backends()  # idempotent
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    module = attention_module()
    q, k, v = qkv(2)
    want = reference(q, k, v, spans)
    for name in ("padfree_sdpa", "padfree_eager"):
        out, weights = ALL_ATTENTION_FUNCTIONS[name](module, q, k, v, None, scaling=DIM ** -0.5, **{LAYOUT_KWARG: lay})
        assert weights is None and worst(out, want, spans) <= TOL
        # unpacked (no layout, outside a packed forward): exactly the backend it wraps, causal over the whole row
        base = ALL_ATTENTION_FUNCTIONS["sdpa"] if name == "padfree_sdpa" else transformers.models.llama.\
            modeling_llama.eager_attention_forward
        mask = torch.zeros(2, 1, WIDTH, WIDTH).masked_fill(torch.ones(WIDTH, WIDTH, dtype=torch.bool).triu(1), -1e9)
        unpacked = ALL_ATTENTION_FUNCTIONS[name](module, q, k, v, mask, scaling=DIM ** -0.5)[0]
        assert torch.equal(unpacked, base(module, q, k, v, mask, scaling=DIM ** -0.5)[0])
        assert worst(unpacked, want, spans) > 1000 * TOL
    assert set(BACKENDS) <= set(ALL_ATTENTION_FUNCTIONS.keys())


def test_mask_functions_build_nothing_during_a_packed_forward():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    register_backends()
    args = dict(batch_size=1, q_length=5, kv_length=5, allow_is_bidirectional_skip=False)
    for name, backend in BACKENDS.items():
        if backend.base == "flex_attention":
            continue  # its base builds a BlockMask (compiled): the packed-forward half is the same function
        want = ALL_MASK_ATTENTION_FUNCTIONS[backend.base](**args)
        got = ALL_MASK_ATTENTION_FUNCTIONS[name](**args)
        assert (got is None and want is None) or torch.equal(got, want), name
        token = PACKED_FORWARD.set(True)
        try:
            assert ALL_MASK_ATTENTION_FUNCTIONS[name](**args) is None, name
        finally:
            PACKED_FORWARD.reset(token)
    token = PACKED_FORWARD.set(True)
    try:
        assert ALL_MASK_ATTENTION_FUNCTIONS["padfree_flex"](**args) is None
    finally:
        PACKED_FORWARD.reset(token)


def test_backend_attention_without_the_layout_in_a_packed_forward_is_refused():
    """A decoder layer that drops its keyword arguments would hand padfree's attention nothing to go by."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_backends()
    module = transformers.models.llama.modeling_llama.LlamaAttention(transformers.LlamaConfig(**_SIZES), 0)
    q = torch.randn(1, 4, 5, 16)
    for name in ("padfree_sdpa", "padfree_eager"):  # (flex compiles its kernel on first use: a minute here)
        token = PACKED_FORWARD.set(True)
        try:
            with pytest.raises(PackingDisabledError, match="without padfree's layout"):
                ALL_ATTENTION_FUNCTIONS[name](module, q, q, q, None, scaling=0.25)
        finally:
            PACKED_FORWARD.reset(token)
        out = ALL_ATTENTION_FUNCTIONS[name](module, q, q, q, None, scaling=0.25)[0]  # unpacked: the base backend
        assert out.shape == (1, 5, 4, 16)



# ---- refusals ------------------------------------------------------------------------------------------------------


def _packed_call(backend="padfree_sdpa", kv_heads=2, key_width=WIDTH, **opts):
    seg, _ = segments_of(ROWS, WIDTH)
    q, _, _ = qkv(kv_heads)
    _, k, v = qkv(kv_heads, width=key_width)
    return packed_forward(backend, attention_module(kv_heads), q, k, v, PackedLayout.from_segment_ids(seg), **opts)


REFUSED = {
    "a dense mask": (dict(attention_mask=torch.ones(2, 1, WIDTH, WIDTH, dtype=torch.bool)), PackingDisabledError,
                     r"LlamaAttention hands its attention function attention_mask= \(a tensor of shape "
                     r"\(2, 1, 47, 47\)\), which padfree's packed attention does not apply"),
    "a bias of another shape": (dict(position_bias=torch.zeros(1, HEADS, WIDTH, WIDTH - 1)), PackingDisabledError,
                                r"position_bias of shape \(1, 4, 47, 46\); the packed path applies a "
                                r"\(B \| 1, H \| 1, T, T\) bias"),
    "a bias next to softcapping": (dict(position_bias=torch.zeros(1, HEADS, WIDTH, WIDTH), softcap=2.0),
                                   PackingDisabledError, r"position_bias, which padfree adds per bucket on "
                                                         r"padfree_sdpa and padfree_eager only"),
    "a bias under flex": (dict(backend="padfree_flex", position_bias=torch.zeros(1, HEADS, WIDTH, WIDTH)),
                          PackingDisabledError, r"position_bias, .* \(not with padfree_flex"),
    "per-query sinks of another shape": (dict(sinks=torch.zeros(2, HEADS, WIDTH)), PackingDisabledError,
                                         r"sinks of shape \(2, 4, 47\); the packed path applies one sink logit per "
                                         r"query, \(2, 4, 47, 1\)"),
    "per-query sinks under flex": (dict(backend="padfree_flex", sinks=torch.zeros(2, HEADS, WIDTH, 1)),
                                   PackingDisabledError, r"a sink logit per query, which padfree applies on the eager "
                                                         r"path alone \(not with padfree_flex"),
    "bidirectional": (dict(is_causal=False), PackingDisabledError, r"is_causal=False \(bidirectional attention\)"),
    # eager_attention_forward ignores is_causal (the mask makes a layer bidirectional, and padfree builds none)
    "bidirectional under eager": (dict(backend="padfree_eager", is_causal=False), PackingDisabledError,
                                  r"is_causal=False \(bidirectional attention\)"),
    "cross-attention": (dict(key_width=12), InvalidLayoutError,
                        r"LlamaAttention attention keys got inputs of shape \(2, 12\) but the packed layout of this "
                        r"forward is \(2, 47\)"),
    "flex with sinks on the CPU": (dict(backend="padfree_flex", s_aux=torch.zeros(HEADS)), BackendUnavailableError,
                                   "LlamaAttention has attention sinks, which flex_attention cannot apply on the CPU"),
}


@pytest.mark.parametrize(("call", "error", "match"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_packed_path_cannot_apply_is_refused_with_the_reason(call, error, match):
    with pytest.raises(error, match=match):
        _packed_call(**call)


# ---- what the attention function applies, not what it is called ---------------------------------------------------


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, relative_bias=None,
                            **kwargs):
    """The eager attention of a modeling file whose formula takes what padfree's packed path does not apply: an
    additive ``relative_bias`` ``(B | 1, H | 1, T, T)`` in its signature, and an output ``gate`` ``(B, H, T, 1)``
    it looks up in its ``**kwargs`` — what a transformers release may add. ``(B, T, H, D)`` out."""
    groups = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(groups, 1).transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    if relative_bias is not None:
        scores = scores + relative_bias
    out = F.dropout(scores.softmax(-1), p=dropout, training=module.training) @ value.repeat_interleave(groups, 1)
    if kwargs.get("gate") is not None:
        out = out * kwargs["gate"]
    return out.transpose(1, 2).contiguous(), None


class BiasedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """An attention module of this file: its eager backend is the function above."""


def _causal(width: int) -> torch.Tensor:
    return torch.zeros(1, 1, width, width).masked_fill(torch.ones(width, width, dtype=torch.bool).triu(1), -1e9)


@pytest.mark.parametrize("name", ["relative_bias", "gate"])
def test_a_tensor_the_base_attention_function_applies_is_refused_by_name(name):
    """A tensor the base backend's function reads — a parameter of its signature, or a key it looks up in its
    ``**kwargs`` — changes what one sequence computes and the packed path does not apply it: refused, named."""
    seg, _ = segments_of(ROWS, WIDTH)
    q, k, v = qkv(2)
    module = BiasedAttention(transformers.LlamaConfig(**_SIZES, num_key_value_heads=2), 0).eval()
    shape = (1, HEADS, WIDTH, WIDTH) if name == "relative_bias" else (2, HEADS, WIDTH, 1)
    extra = {name: torch.randn(*shape, generator=torch.Generator().manual_seed(3))}
    applied = eager_attention_forward(module, q, k, v, _causal(WIDTH), DIM ** -0.5, **extra)[0]
    assert (applied - eager_attention_forward(module, q, k, v, _causal(WIDTH), DIM ** -0.5)[0]).abs().max() > 0.1
    with pytest.raises(PackingDisabledError, match=rf"BiasedAttention hands its attention function {name}= \(a "
                                                   rf"tensor of shape \({', '.join(map(str, shape))}\)\), which "
                                                   rf"padfree's packed attention does not apply"):
        packed_forward("padfree_eager", module, q, k, v, PackedLayout.from_segment_ids(seg), scaling=DIM ** -0.5,
                       **extra)


def test_tensors_the_base_attention_function_ignores_change_nothing_and_are_not_refused():
    """A model's forward hands its ``**kwargs`` down through its layers (gemma4 hands its attention ``labels``):
    a tensor the base backend's function never reads cannot change the attention it computes — on the base
    function itself, and on the packed path, which equals each segment alone with or without them."""
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    q, k, v = qkv(2)
    want = reference(q, k, v, spans)
    passed = dict(labels=torch.randint(0, 96, (2, WIDTH)), logits_to_keep=torch.tensor(0),
                  num_items_in_batch=torch.tensor(50), token_type_ids=torch.zeros(2, WIDTH, dtype=torch.long))
    module = attention_module()
    for backend, base in (("padfree_sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"]),
                          ("padfree_eager", transformers.models.llama.modeling_llama.eager_attention_forward)):
        plain = base(module, q, k, v, _causal(WIDTH), scaling=DIM ** -0.5)[0]
        assert torch.equal(base(module, q, k, v, _causal(WIDTH), scaling=DIM ** -0.5, **passed)[0], plain)
        assert worst(packed_forward(backend, module, q, k, v, lay, **passed), want, spans) <= TOL
    # a bias only another backend's function reads: sdpa_attention_forward does not, so the packed SDPA path runs
    biased = BiasedAttention(transformers.LlamaConfig(**_SIZES, num_key_value_heads=2), 0).eval()
    got = packed_forward("padfree_sdpa", biased, q, k, v, lay, relative_bias=torch.ones(1, HEADS, WIDTH, WIDTH))
    assert worst(got, want, spans) <= TOL
    # the negative control the same comparison catches: causal attention over the whole row
    assert worst(ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, None, is_causal=True)[0], want, spans) > 1000 * TOL


def test_when_what_the_base_function_reads_cannot_be_told_every_tensor_is_refused(monkeypatch):
    """A base function that hands its ``**kwargs`` on to another function could read any name: every tensor the
    packed path does not apply is refused, labels included (the guard fails closed)."""
    modeling = types.ModuleType("padfree_test_modeling_handing_on")
    exec(  # a modeling file of its own: the eager function padfree_eager wraps is looked up by the module's module
        "import transformers\n"
        "def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):\n"
        "    return transformers.models.llama.modeling_llama.eager_attention_forward(\n"
        "        module, query, key, value, attention_mask, scaling, dropout, **kwargs)\n"
        "class HandingOnAttention(transformers.models.llama.modeling_llama.LlamaAttention):\n"
        "    pass\n", modeling.__dict__)
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    module = modeling.HandingOnAttention(transformers.LlamaConfig(**_SIZES, num_key_value_heads=2), 0).eval()
    seg, spans = segments_of(ROWS, WIDTH)
    lay = PackedLayout.from_segment_ids(seg)
    q, k, v = qkv(2)
    with pytest.raises(PackingDisabledError, match=r"HandingOnAttention hands its attention function labels= "):
        packed_forward("padfree_eager", module, q, k, v, lay, labels=torch.zeros(2, WIDTH, dtype=torch.long))
    got = packed_forward("padfree_eager", module, q, k, v, lay, position_ids=lay.position_ids, use_cache=False)
    assert worst(got, reference(q, k, v, spans), spans) <= TOL  # what describes the batch still passes


def _labels(ids: torch.Tensor, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """Every sequence's own ids, ``-100`` at its first token and over the filler run."""
    labels = torch.full_like(ids, -100)
    for r, s, n in spans:
        labels[r, s + 1:s + n] = ids[r, s + 1:s + n]
    return labels


def _scaled(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) / max(1.0, float(want[n].abs().max())) for n in want)


@pytest.mark.parametrize("model_type", ["gemma4", "gemma3", "llama"])
def test_a_packed_training_step_with_labels_equals_each_sequence_alone(model_type):
    """What a trainer runs: ``model(input_ids, position_ids, labels=...)`` in training mode, the model's own loss
    and its backward. gemma4 hands its attention modules the forward's ``**kwargs``, labels among them; gemma3 and
    llama hand theirs the decoder's. The loss and every gradient equal the token-mean over each sequence run alone
    (fp32, 1e-5) on padfree_sdpa and padfree_eager; positions that run on over the row (the control) are caught."""
    model = build_tiny(model_type).train()
    ids, pos, spans = packed_case(model.config.get_text_config().vocab_size, [[5, 9, 3], [7, 10]], filler=2)
    labels, total = _labels(ids, spans), sum(n - 1 for *_, n in spans)
    model.zero_grad()
    want = 0.0
    for r, s, n in spans:
        seq = ids[r:r + 1, s:s + n]
        loss = F.cross_entropy(model(input_ids=seq, use_cache=False).logits[0, :-1], seq[0, 1:], reduction="sum")
        (loss / total).backward()
        want += float(loss.detach()) / total
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    running_on = torch.arange(ids.shape[1]).expand_as(ids)
    for backend in ("sdpa", "eager"):
        padfree.configure_packing(model, backend=backend)
        for positions, exact in ((pos, True), (running_on, False)):
            model.zero_grad()
            out = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False)
            out.loss.backward()
            got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            loss_diff, grad_diff = abs(float(out.loss) - want), _scaled(got, ref)
            if exact:
                assert loss_diff <= TOL * max(1.0, want) and grad_diff <= TOL, (backend, loss_diff, grad_diff)
            else:
                assert loss_diff > 100 * TOL and grad_diff > 100 * TOL, (backend, loss_diff, grad_diff)
        padfree.unconfigure_packing(model)


def test_queries_of_another_batch_are_refused():
    seg, _ = segments_of(ROWS, WIDTH)
    q, k, v = qkv(2, width=WIDTH - 1)
    with pytest.raises(InvalidLayoutError, match=r"LlamaAttention attention got inputs of shape \(2, 46\) but the "
                                                 r"packed layout of this forward is \(2, 47\)"):
        packed_forward("padfree_eager", attention_module(), q, k, v, PackedLayout.from_segment_ids(seg))


@pytest.mark.parametrize("option", [{"softcap": 2.0}, {"s_aux": torch.zeros(HEADS)}, {"dropout": 0.1}],
                         ids=["softcap", "sinks", "dropout"])
def test_varlen_refuses_what_varlen_attn_does_not_offer(option):
    pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    with pytest.raises(PackingDisabledError, match="needs softcapping, sinks or attention dropout, which varlen_attn "
                                                   "does not offer; configure the model with backend='padfree_sdpa'"):
        _packed_call("padfree_varlen", **option)


def test_a_mask_handed_to_the_registered_function_in_a_packed_forward_is_refused():
    """In a packed forward padfree's mask functions build nothing, so a mask that reaches the attention function was
    built by the model itself (a bias, say): next to the layout the packed path would drop it, without the layout
    the base backend would apply it across the whole row. Both are refused; unpacked, the mask is the base's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_backends()
    seg, _ = segments_of(ROWS, WIDTH)
    q, k, v = qkv(2)
    bias = torch.randn(2, 1, WIDTH, WIDTH, generator=torch.Generator().manual_seed(3))
    module = attention_module()
    for name in ("padfree_sdpa", "padfree_eager"):
        fn = ALL_ATTENTION_FUNCTIONS[name]
        with pytest.raises(PackingDisabledError, match=r"LlamaAttention was handed an attention mask its model "
                                                       r"built itself \(a float32 tensor of shape \(2, 1, 47, 47\)"):
            fn(module, q, k, v, bias, **{LAYOUT_KWARG: PackedLayout.from_segment_ids(seg)})
        token = PACKED_FORWARD.set(True)
        try:
            with pytest.raises(PackingDisabledError, match="handed an attention mask its model built itself"):
                fn(module, q, k, v, bias)
        finally:
            PACKED_FORWARD.reset(token)
        base = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              attn_mask=bias).transpose(1, 2)
        assert (fn(module, q, k, v, bias, scaling=DIM ** -0.5)[0] - base).abs().max() < TOL


def test_a_model_that_hands_its_attention_a_mask_of_its_own_is_refused_when_packed():
    """A real model whose attention module is handed a bias the model built (as a model folding a bias into its
    mask would): its packed forward is refused by name, its unpacked forward applies the bias."""
    from padfree import configure_packing

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SIZES, num_key_value_heads=2)).eval()
    configure_packing(model)
    attn = model.model.layers[1].self_attn
    own = attn.forward

    def with_a_bias(hidden_states, position_embeddings, attention_mask=None, **kwargs):
        width = hidden_states.shape[1]
        bias = torch.zeros(hidden_states.shape[0], 1, width, width).masked_fill(
            torch.ones(width, width, dtype=torch.bool).triu(1), float("-inf"))
        bias[..., 0] = -2.0  # every query leans away from the row's first token
        return own(hidden_states, position_embeddings, attention_mask=bias, **kwargs)

    attn.forward = with_a_bias
    ids = torch.arange(1, 10).unsqueeze(0)
    with torch.no_grad():
        with pytest.raises(PackingDisabledError, match=r"LlamaAttention was handed an attention mask its model built "
                                                       r"itself .* needs a padfree family for LlamaAttention"):
            model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]]))
        biased = model(input_ids=ids).logits  # one sequence, unpacked: transformers' own path, the bias applied
        attn.forward = own
        plain = model(input_ids=ids).logits
    assert (biased - plain).abs().max() > 1e-3


def test_the_backend_table():
    assert {b.base for b in BACKENDS.values()} == {"sdpa", "eager", "flex_attention"}
    assert BACKENDS["padfree_varlen"].device == "cuda" and not BACKENDS["padfree_varlen"].softcap
    assert not BACKENDS["padfree_flex"].dropout  # flex_attention has no attention dropout
    assert all(b.softcap and b.sinks for name, b in BACKENDS.items() if name != "padfree_varlen")


# ---- flex_attention (CPU: forward only) and varlen_attn (CUDA) -----------------------------------------------------


@pytest.mark.slow
def test_flex_equals_each_segment_alone():
    """One call (flex compiles per score_mod and shape): GQA, a sliding window, softcapping, a scale and a padding
    tail that no query sees, against each segment alone; the whole-row causal control shows the check can fail."""
    seg, spans = segments_of(ROWS, WIDTH)
    q, k, v = qkv(2)
    opts = dict(scaling=0.5, sliding_window=6, softcap=2.0)
    with torch.no_grad():
        got = packed_forward("padfree_flex", attention_module(), q, k, v, PackedLayout.from_segment_ids(seg), **opts)
    want = reference(q, k, v, spans, scaling=0.5, window=6, softcap=2.0)
    assert got.shape == (2, WIDTH, HEADS, DIM)
    assert worst(got, want, spans) <= TOL
    assert worst(reference(q, k, v, [(b, 0, WIDTH) for b in range(2)], scaling=0.5, window=6, softcap=2.0), want,
                 spans) > 1000 * TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn runs on CUDA only (flash attention kernels)")
@pytest.mark.parametrize("window", [None, 4])
def test_varlen_equals_each_segment_alone(window):
    pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen_attn")
    seg, spans = segments_of(ROWS, WIDTH)
    q, k, v = (x.to(torch.bfloat16) for x in qkv(2))  # flash kernels: half precision only
    lay = PackedLayout.from_segment_ids(seg.cuda())
    got = packed_forward("padfree_varlen", attention_module(), q.cuda(), k.cuda(), v.cuda(), lay,
                         sliding_window=window).float().cpu()
    q, k, v = q.float(), k.float(), v.float()  # the reference: the same bf16 inputs, fp32 arithmetic
    tol = 2e-2  # bf16 rounding of the output (about 4e-3 relative) and of the kernel's probabilities
    assert worst(got, reference(q, k, v, spans, window=window), spans) <= tol
    control = reference(q, k, v, spans, window=3 if window else 1)
    assert worst(got, control, spans) > 10 * tol
