"""The encoders family (padfree.model.families.encoders): BERT and its descendants, RoFormer, XLM, GIT and
ModernBERT's decoder run per packed sequence — self-attention per bucket of equal-length sequences under the mask each
sequence gets alone, learned positions restarting.

Every type is proven with the sweep's own measurement (padfree.proof.compare.prove: packed against every sequence
alone, logits, loss and every gradient, in fp32 on sdpa and eager and in bf16 / autocast on sdpa, each with its
leaking control) on the tiny model of the sweep's config as a decoder (``is_decoder=True``; XLM ``causal=True``),
and a few in the configs' default bidirectional mode; the same comparison must catch stock transformers and the family
switched off. The rest: the per-bucket primitives against every segment alone (length-1 sequences, sequences past a
sliding window, a trailing padding run), XLM's padding rule, segment masks, the refusals (a cache, BigBird's
block-sparse attention, cross-attention, GIT's image tokens, XLM's lengths, an implementation without masks) and
unpacked batches and generation running transformers' own code.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model.configure import install_packing, packing_state, unconfigure_packing  # noqa: E402
from padfree.model.families import encoders  # noqa: E402
from padfree.model.flight import forward_of  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.proof.compare import FP32_TOL, prove, stock_packed_diff  # noqa: E402
from padfree.proof.sweep import PRECISIONS  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import alone_logits as _alone  # noqa: E402
from zoo import packed_case as _rows  # noqa: E402
from zoo import worst_diff as _worst  # noqa: E402

# model type -> the config fields that make its causal-LM class a decoder
DECODER = {t: {"is_decoder": True} for t in (
    "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
    "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod")}
DECODER.update({"xlm": {"causal": True}, "git": {}, "modernbert-decoder": {}})
# Xmod's language adapter fails under autocast in transformers' own code, for one sequence alone; GIT's own loss
# from labels= skips image tokens it was not given (its packed step is proven on the cross-entropy of its logits)
UNRUNNABLE = {"xmod": {"none/autocast_bf16"}, "git": {"labels"}}

pytestmark = pytest.mark.usefixtures("one_thread")


def _build(model_type, variant=None, **kwargs):
    transformers.logging.set_verbosity_error()
    if kwargs:
        return build_tiny(model_type, {**(variant or {}), **kwargs})
    return build_tiny(model_type, variant)








# ---- every type: the sweep's proof, and the same comparison catching a leak -----------------------------------------


@pytest.mark.parametrize("model_type", sorted(DECODER))
def test_packed_equals_each_sequence_alone(model_type):
    model = _build(model_type, DECODER[model_type])
    proof = prove(model, backends=list(PRECISIONS), precisions=PRECISIONS)
    assert proof.ok, str(proof)
    assert set(proof.unrunnable) == UNRUNNABLE.get(model_type, set()), str(proof)
    assert proof.mixers and all("per packed sequence" in d or "restarting" in d or "cross-attention" in d
                                for d in proof.mixers.values())


@pytest.mark.parametrize("model_type", ["bert", "megatron-bert", "xlm"])
def test_bidirectional_defaults_are_exact_per_sequence(model_type):
    model = _build(model_type)  # the config class's defaults: is_decoder=False / causal=False
    proof = prove(model, backends=["sdpa"], precisions=["fp32", "autocast_bf16"])
    assert proof.ok, str(proof)
    assert any(d.startswith("bidirectional") or "bidirectional" in d for d in proof.mixers.values())


def test_eager_implementation_is_exact():
    model = _build("bert", DECODER["bert"])
    model.set_attn_implementation("eager")
    proof = prove(model, backends=["eager"], precisions=["fp32"])
    assert proof.ok, str(proof)


@pytest.mark.parametrize("model_type", ["bert", "roformer", "modernbert-decoder"])
def test_stock_and_switched_off_family_leak(model_type):
    model = _build(model_type, DECODER[model_type])
    if model_type != "modernbert-decoder":  # stock ModernBERT's decoder reads packed position_ids itself
        assert stock_packed_diff(model) > FP32_TOL

    def without_family(m, backend):
        report = install_packing(m, backend=backend)
        encoders.uninstall(m)  # hooks live, family off: the same comparison must see the rows leak
        return report

    proof = prove(model, backends=["sdpa"], precisions=["fp32"], grads=False, configure=without_family)
    assert not proof.ok


def test_xmod_autocast_fails_unpacked_too():
    model = _build("xmod", DECODER["xmod"])
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="dtypes match"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


# ---- the per-bucket primitives against every segment alone -----------------------------------------------------------


def _segment_layout():
    """Sequences of 1, 3, 9 and 2 tokens, then a trailing padding run (segment id 0), and a second row."""
    seg = torch.tensor([[1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 0, 0],
                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
    return PackedLayout.from_segment_ids(seg)


@pytest.mark.parametrize(("causal", "window"), [(True, None), (False, None), (True, 5)])
def test_bucket_masks_are_each_segment_alone(causal, window):
    lay = _segment_layout()
    plan = lay.buckets()
    masks = encoders.bucket_masks(lay, causal, window)
    bases = torch.tensor([0, *plan.sizes]).cumsum(0)
    for start, n in zip((lay.lengths.cumsum() - lay.lengths).tolist(), lay.lengths.tolist(), strict=True):
        slot = int(plan.inverse[start])  # the segment's first slot: column 0 of a row of its bucket
        i = int(torch.searchsorted(bases, slot, right=True)) - 1
        row, col = divmod(slot - int(bases[i]), plan.lengths[i])
        assert col == 0
        k = torch.arange(n)
        want = torch.ones(n, n, dtype=torch.bool)
        if causal:
            want &= k[:, None] >= k[None, :]
        if window is not None:
            want &= (k[:, None] - k[None, :]) < window
        assert torch.equal(masks[i][row, :n, :n], want), (start, n)
        assert not masks[i][row, :n, n:].any()  # no real query sees a slot that pads the bucket
        assert masks[i][row, n:].any(-1).all()  # and every padding slot keeps a key (no empty softmax)


def _attention(model_type, path):
    model = _build(model_type, DECODER[model_type])
    module = model.get_submodule(path)
    return model, module


@pytest.mark.parametrize(("model_type", "path"), [
    ("bert", "bert.encoder.layer.0.attention.self"),
    ("megatron-bert", "bert.encoder.layer.0.attention.self"),
    ("modernbert-decoder", "model.layers.1.attn"),
])
def test_per_segment_attention_is_each_segment_alone(model_type, path):
    model, module = _attention(model_type, path)
    lay = _segment_layout()
    spec = encoders.ATTENTION[type(module).__name__]
    hidden = torch.randn(*lay.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    named = {spec.hidden: hidden, spec.mask: None}
    extra = {}
    if model_type == "modernbert-decoder":  # rotary tables of the row, as the model builds them for 0..T-1
        rope = model.model.rotary_emb
        pos = torch.arange(lay.shape[1]).expand(lay.shape)
        named["position_embeddings"] = rope(hidden, pos, "sliding_attention")
        assert module.sliding_window is not None
    with torch.no_grad():
        packed = encoders.per_segment(module, spec, named, lay)[0]
        causal, window = spec.causal(module), spec.window(module)
        for r, s, n in _spans(lay):
            i = torch.arange(n)
            allowed = torch.ones(n, n, dtype=torch.bool)
            if causal:
                allowed &= i[:, None] >= i[None, :]
            if window is not None:
                allowed &= (i[:, None] - i[None, :]) < window
            additive = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
            if model_type == "modernbert-decoder":
                extra["position_embeddings"] = model.model.rotary_emb(hidden, i[None], "sliding_attention")
            mask = allowed[None, None] if getattr(model.config, "_attn_implementation", "") == "sdpa" and \
                spec.interface else additive
            alone = type(module).forward(module, hidden[r:r + 1, s:s + n], attention_mask=mask, **extra)[0]
            assert float((packed[r, s:s + n] - alone[0]).abs().max()) <= 1e-5, (r, s, n)


def _spans(lay):
    width = lay.shape[1]
    start = 0
    for n in lay.lengths.tolist():
        yield start // width, start % width, n
        start += n


def test_position_tables_read_each_sequence_positions():
    lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]))
    # a table whose row of position p holds p: from 0..T-1 (what a model counts itself) or from the layout's own
    counted = torch.arange(6.0).view(1, 6, 1).expand(2, 6, 1)
    built = lay.position_ids.float().unsqueeze(-1)
    plan = lay.buckets()
    for table, source in ((counted, None), (counted, torch.arange(6).expand(2, 6)), (built, lay.position_ids)):
        blocks = encoders.gather_table(table, lay, "position_ids", source)
        got = torch.cat([b.reshape(-1) for b in blocks]).index_select(0, plan.inverse).view(2, 6)
        assert torch.equal(got, lay.position_ids.float())
    foreign = torch.tensor([[3, 4, 5, 6, 7, 8]]).expand(2, 6)
    with pytest.raises(Exception, match="neither"):
        encoders.gather_table(counted, PackedLayout.from_position_ids(lay.position_ids), "position_ids", foreign)


def test_xlm_padding_rule_per_sequence():
    lay = _segment_layout()
    ids = torch.full(lay.shape, 7)
    ids[0, 2] = 2  # the 3-token sequence holds one pad id: alone it keeps its first 2 tokens
    ids[0, 15:] = 2  # the trailing padding run
    keep = encoders.xlm_keep(lay, ids, pad=2)
    assert keep[0, :4].tolist() == [1, 1, 1, 0]
    assert keep[0, 15:].tolist() == [0, 0] and keep[1].all()


@pytest.mark.parametrize("variant", [{"causal": False}, {"causal": True}])
def test_xlm_pad_ids_inside_a_sequence(variant):
    model = _build("xlm", variant)
    ids, pos, spans = _rows(model.config.vocab_size, [(3, 9, 5), (12, 4)])
    ids[0, 5] = model.config.pad_index  # a pad id inside the second sequence: XLM drops its last token alone
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert _worst(packed, spans, alone) <= 1e-5


# ---- inputs: segment masks, unpacked batches, generation -------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", "xlm", "roformer"])
def test_segment_mask_with_trailing_padding(model_type):
    model = _build(model_type, DECODER[model_type])
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    seg = torch.tensor([[1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 0, 0, 0]])
    spans = [(0, 0, 1), (0, 1, 3), (0, 4, 9)]
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=seg, use_cache=False).logits
    assert _worst(packed, spans, alone) <= 1e-5


def test_unpacked_batches_and_generation_run_transformers_code():
    model = _build("bert", DECODER["bert"])
    prompt = torch.tensor([[5, 6, 7, 8]])
    padded = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        want = model(input_ids=padded, attention_mask=mask).logits
        gen = model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    install_packing(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=padded, attention_mask=mask).logits, want)
        assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=True,
                                          pad_token_id=0), gen)
    assert unconfigure_packing(model)
    assert not any("_padfree_encoder" in m.__dict__ for m in model.modules())


def test_activation_checkpointing_recomputes_per_sequence():
    model = _build("megatron-bert", DECODER["megatron-bert"]).train()
    ids, pos, spans = _rows(model.config.vocab_size, [(1, 7, 12), (15, 5)])
    model.eval()
    alone = _alone(model, ids, spans)
    install_packing(model)
    model.activation_checkpointing_enable()
    model.train()
    for module in model.modules():  # dropout off: the recomputation must meet the same numbers
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    packed.sum().backward()
    assert _worst(packed.detach(), spans, alone) <= 1e-5
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_compiled_packed_steps_are_exact_and_do_not_recompile_per_batch():
    torch._dynamo.reset()
    model = _build("bert", DECODER["bert"])
    install_packing(model)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        for i, rows in enumerate([[(7, 10, 3)], [(3, 12, 5)], [(1, 2, 17)]]):
            ids, pos, spans = _rows(model.config.vocab_size, rows, seed=i)
            with torch.no_grad():
                alone = [model(input_ids=ids[r:r + 1, s:s + n], position_ids=torch.arange(n)[None],
                               use_cache=False).logits[0] for r, s, n in spans]
            # the first batch compiles for its shapes, the second makes them dynamic; no later batch recompiles
            with torch._dynamo.config.patch(error_on_recompile=i >= 2), torch.no_grad():
                packed = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
            assert _worst(packed, spans, alone) <= 1e-5
    finally:
        torch._dynamo.reset()


# ---- refusals --------------------------------------------------------------------------------------------------------


def test_cache_reaching_a_packed_attention_is_refused():
    model = _build("bert", DECODER["bert"])
    ids, pos, _ = _rows(model.config.vocab_size, [(3, 5)])
    install_packing(model)
    with torch.no_grad():
        attn = model.bert.encoder.layer[0].attention.self
        hidden = torch.zeros(*ids.shape, model.config.hidden_size)
        with forward_of(packing_state(model), PackedLayout.from_position_ids(pos)), \
                pytest.raises(PackingDisabledError, match="cache"):
            attn(hidden, cache=transformers.DynamicCache(config=model.config))
        with pytest.raises(PackingDisabledError, match="cache"):
            model(input_ids=ids, position_ids=pos, cache=transformers.DynamicCache(config=model.config))


def test_bigbird_block_sparse_row_is_refused():
    model = _build("big_bird", DECODER["big_bird"])  # still block-sparse: no short batch has switched it yet
    ids, pos, _ = _rows(model.config.vocab_size, [(40, 40, 20)])  # a row past block-sparse's minimum of 88 tokens
    install_packing(model)
    with torch.no_grad(), pytest.raises(PackingDisabledError, match="block-sparse"):
        model(input_ids=ids, position_ids=pos, use_cache=False)


def test_cross_attention_inputs_are_refused():
    model = _build("bert", DECODER["bert"], add_cross_attention=True)
    ids, pos, _ = _rows(model.config.vocab_size, [(3, 5)])
    states = torch.randn(1, 4, model.config.hidden_size)
    install_packing(model)
    with torch.no_grad():
        model(input_ids=ids[:, :3], encoder_hidden_states=states, use_cache=False)  # unpacked: transformers' own
        with pytest.raises(PackingDisabledError, match="cross-attention"):
            model(input_ids=ids, position_ids=pos, encoder_hidden_states=states, use_cache=False)


def test_git_image_tokens_in_a_packed_row_are_refused():
    model = _build("git")
    ids, pos, _ = _rows(model.config.vocab_size, [(3, 5)])
    vision = model.config.vision_config
    pixels = torch.randn(1, vision.num_channels, vision.image_size, vision.image_size)
    install_packing(model)
    with torch.no_grad(), pytest.raises(PackingDisabledError, match=r"image|non-text"):
        model(input_ids=ids, position_ids=pos, pixel_values=pixels, use_cache=False)


def test_xlm_row_lengths_are_refused():
    model = _build("xlm", DECODER["xlm"])
    ids, pos, _ = _rows(model.config.vocab_size, [(3, 5)])
    install_packing(model)
    with torch.no_grad(), pytest.raises(PackingDisabledError, match="lengths"):
        model(input_ids=ids, position_ids=pos, lengths=torch.tensor([8]), use_cache=False)


def test_implementation_without_masks_is_refused():
    model = _build("bert", DECODER["bert"])
    model.set_attn_implementation("flex_attention")  # takes no per-sequence tensor mask (nor does flash-attn)
    with pytest.raises(UnsupportedModelError, match=r"BertSelfAttention.*flex_attention"):
        install_packing(model)
    assert packing_state(model) is None
