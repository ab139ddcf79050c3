"""The positions family (padfree.model.families.positions): absolute positions restarted per packed sequence, the
hand-written attention of encoder-decoder decoders and GPT-1 run per bucket of sequences, and the row-mixing models
(CPM-Ant, XLNet, ProphetNet) run per group of equal-length sequences.

Every type is proven with the sweep's own measurement (padfree.proof.compare.prove: packed against every sequence
alone, logits, loss and every gradient, in fp32 on sdpa and eager and in bf16 / autocast on sdpa, each with its
leaking control) on the sweep's tiny model; stock transformers must leak on the same rows (the negative control).
The rest covers what the proof does not: config variants the defaults leave off, the grouping primitive against a
per-segment loop, segment masks with a trailing padding run, the refusals (a cache, an encoder's output, a forward of
another shape) and generation with a cache running transformers' own code.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree.errors import PackingDisabledError, UnsupportedModelError  # noqa: E402
from padfree.model.configure import install_packing, packing_state, unconfigure_packing  # noqa: E402
from padfree.model.families import positions  # noqa: E402
from padfree.model.flight import forward_of  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.proof.compare import FP32_TOL, prove, stock_packed_diff  # noqa: E402
from padfree.proof.sweep import PRECISIONS  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import alone_logits as _alone  # noqa: E402
from zoo import packed_case as _rows  # noqa: E402
from zoo import worst_diff as _worst  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# model type -> the words its report must show for the family's modules
TYPES = {
    "bart": "learned position table", "mbart": "learned position table", "plbart": "learned position table",
    "pegasus": "sinusoidal position table", "blenderbot": "learned position table",
    "blenderbot-small": "learned position table", "bigbird_pegasus": "learned position table",
    "marian": "sinusoidal position table", "mvp": "its own attention per bucket",
    "trocr": "its own attention per bucket", "xglm": "sinusoidal positions", "openai-gpt": "GPT-1's own causal mask",
    "cpmant": "per group of equal-length sequences", "xlnet": "per group of equal-length sequences",
    "prophetnet": "per group of equal-length sequences",
}


def _quiet_build(model_type, variant=None):
    transformers.logging.set_verbosity_error()
    return build_tiny(model_type, variant)








# ---- every type: the sweep's proof, and stock transformers leaking on the same rows ---------------------------------


@pytest.mark.parametrize("model_type", sorted(TYPES))
def test_packed_equals_each_sequence_alone(model_type):
    model = _quiet_build(model_type)
    assert stock_packed_diff(model) > FP32_TOL  # the negative control: unconfigured, the rows leak
    proof = prove(model, backends=list(PRECISIONS), precisions=PRECISIONS)
    assert proof.ok, str(proof)
    assert not proof.blind
    assert {c.precision for c in proof.checks} == {"fp32", "autocast_bf16", "bf16"}
    assert any(TYPES[model_type] in impl for impl in proof.mixers.values()), proof.mixers
    assert not any("_padfree_positions" in vars(m) for m in model.modules())  # left unconfigured


@pytest.mark.parametrize(("model_type", "variant", "words"), [
    ("trocr", {"use_learned_position_embeddings": False}, "counted from each sequence's start"),
    ("mvp", {"use_prompt": True, "prompt_length": 3, "prompt_mid_dim": 16}, "its own attention per bucket"),
])
def test_config_variants_the_defaults_leave_off(model_type, variant, words):
    model = _quiet_build(model_type, variant)
    proof = prove(model, backends=["sdpa"], precisions=["fp32", "autocast_bf16"])
    assert proof.ok, str(proof)
    assert any(words in impl for impl in proof.mixers.values()), proof.mixers


def test_trocr_sinusoidal_positions_skip_padding_tokens_inside_each_sequence():
    model = _quiet_build("trocr", {"use_learned_position_embeddings": False})
    pad = model.config.pad_token_id
    ids, pos, spans = _rows(model.config.vocab_size, [[4, 6, 3], [7, 5]])
    ids[0, 5] = ids[0, 6] = ids[1, 0] = ids[1, 9] = pad  # padding tokens inside sequences: they keep no position
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert _worst(packed, spans, alone) <= 1e-5


def test_prophetnet_ngram_streams_equal_each_sequence_alone():
    model = _quiet_build("prophetnet")
    ids, pos, spans = _rows(model.config.vocab_size, [[1, 5, 9], [7, 4]])
    with torch.no_grad():
        alone = [model(input_ids=ids[r:r + 1, s:s + n], use_cache=False).logits_ngram[0] for r, s, n in spans]
        install_packing(model)
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits_ngram
    for (r, s, n), a in zip(spans, alone, strict=True):  # (ngram, T, vocab)
        assert float((packed[r, :, s:s + n] - a).abs().max()) <= 1e-5


def test_xlnet_one_directional_attention():
    # attn_type="uni" (causal): not proven by prove(), whose padded batch trips transformers' own broadcast bug
    model = _quiet_build("xlnet", {"attn_type": "uni"})
    ids, pos, spans = _rows(model.config.vocab_size, [[1, 5, 9], [7, 4]])
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert _worst(packed, spans, alone) <= 1e-5


def test_gpt1_buckets_stay_within_its_causal_mask_buffer():
    # a 37-token sequence falls in a 40-slot bucket; GPT-1 crops its causal mask from an n_positions = 38 buffer
    model = _quiet_build("openai-gpt", {"n_positions": 38})
    ids, pos, spans = _rows(model.config.vocab_size, [[37], [2, 30]])
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits
    assert _worst(packed, spans, alone) <= 1e-5


@pytest.mark.parametrize("model_type", ["bart", "mvp", "xlnet"])
def test_segment_mask_with_a_trailing_padding_run(model_type):
    model = _quiet_build(model_type)
    lengths = [[1, 6, 3], [4, 5]]
    ids, _, spans = _rows(model.config.vocab_size, lengths)
    seg = torch.tensor([[1] + [2] * 6 + [3] * 3, [1] * 4 + [2] * 5 + [0]])  # LLaMA-Factory ids, row 2 padded
    alone = _alone(model, ids, spans)
    install_packing(model)
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=seg, use_cache=False).logits
    assert _worst(packed, spans, alone) <= 1e-5


def _without_dropout(model):
    for m in model.modules():  # a training step that is deterministic
        for name in ("dropout", "activation_dropout", "layerdrop"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return model


def _assert_training_step_exact(model, rows):
    """One packed training step (loss and every gradient) against every sequence alone, in training mode."""
    model.train()
    ids, pos, spans = _rows(model.config.vocab_size, rows)

    def loss_and_grads(run):
        model.zero_grad()
        loss = sum(torch.nn.functional.cross_entropy(logits[:-1], ids[r, s + 1:s + n], reduction="sum")
                   for (r, s, n), logits in zip(spans, run(), strict=True))
        loss.backward()
        return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    want = loss_and_grads(lambda: [model(input_ids=ids[r:r + 1, s:s + n], use_cache=False).logits[0]
                                   for r, s, n in spans])
    install_packing(model)
    got = loss_and_grads(lambda: [x[r, s:s + n] for x in [model(input_ids=ids, position_ids=pos, use_cache=False)
                                                           .logits] for r, s, n in spans])
    assert abs(got[0] - want[0]) <= 1e-4
    assert want[1].keys() == got[1].keys()
    assert max(float((got[1][k] - want[1][k]).abs().max()) for k in want[1]) <= 1e-5


def test_activation_checkpointing_recomputes_each_bucket_with_the_same_boundaries():
    model = _without_dropout(_quiet_build("mvp"))
    model.activation_checkpointing_enable()
    _assert_training_step_exact(model, [[1, 5, 9], [7, 4]])


def test_reformer_with_learned_positions_trains_exactly_and_axial_positions_are_refused():
    # reversible layers compute gradients in training mode only, where prove() cannot run: measured here instead
    no_dropout = {k: 0.0 for k in ("hidden_dropout_prob", "attention_probs_dropout_prob",
                                   "lsh_attention_probs_dropout_prob", "local_attention_probs_dropout_prob")}
    model = _quiet_build("reformer", {"axial_pos_embds": False, "hash_seed": 3, **no_dropout})
    assert model.config.attn_layers == ["local", "lsh"]
    _assert_training_step_exact(model, [[1, 5, 9], [7, 4, 3]])
    with pytest.raises(UnsupportedModelError, match="AxialPositionEmbeddings"):
        install_packing(_quiet_build("reformer"))


# ---- the grouping primitive -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"cap": 12}, {"exact": True}])
def test_bucketed_equals_a_loop_over_segments(options):
    # a length-1 segment, segments shorter and longer than a bucket step, a trailing padding run (segment id 0)
    seg = torch.tensor([[1, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 0, 0],
                        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    lay = PackedLayout.from_segment_ids(seg)
    x = torch.randn(2, 18, 3, requires_grad=True)
    calls = []

    def run(length, count, block):
        calls.append((length, count))
        return block.cumsum(1) * torch.arange(1.0, length + 1).view(1, -1, 1)  # causal: no slot sees a later one

    got = positions.bucketed(run, lay, x, **options)
    flat, pieces, start = x.reshape(-1, 3), [], 0
    for n in lay.lengths.tolist():  # segments never cross rows: a loop over the flattened stream
        pieces.append(flat[start:start + n].cumsum(0) * torch.arange(1.0, n + 1).view(-1, 1))
        start += n
    want = torch.cat(pieces).view_as(got)
    assert torch.allclose(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    assert torch.allclose(g_got, g_want)
    if "cap" in options:  # buckets of 8, 16 and 24 slots capped at 12; the 18-token segment runs at its length
        assert sorted({length for length, _ in calls}) == [8, 12, 18]
    if "exact" in options:
        assert sorted(length for length, _ in calls) == [1, 2, 3, 10, 18]


# ---- refusals -------------------------------------------------------------------------------------------------------


def _packed_forward_in_flight(model):
    """Configure ``model`` and run one packed forward; ``(ids, layout, a frame of that forward)`` for calling its
    modules on their own as that forward would."""
    ids, pos, _ = _rows(model.config.vocab_size, [[3, 4], [2, 5]])
    install_packing(model)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, use_cache=False)
    lay = PackedLayout.from_position_ids(pos)
    return ids, lay, forward_of(packing_state(model), lay)


def test_a_packed_batch_with_a_cache_is_refused_by_the_hook_and_by_every_module():
    from transformers import DynamicCache

    model = _quiet_build("mvp")
    ids, lay, frame = _packed_forward_in_flight(model)
    with pytest.raises(PackingDisabledError, match="cache"):
        model(input_ids=ids, position_ids=lay.position_ids, cache=DynamicCache(config=model.config), use_cache=True)
    decoder = model.model.decoder
    hidden = torch.zeros(*ids.shape, model.config.d_model)
    with frame:
        with pytest.raises(PackingDisabledError, match="cache_length"):
            decoder.embed_positions(ids, 2)
        with pytest.raises(PackingDisabledError, match="cache=DynamicCache"):
            decoder.layers[0].self_attn(hidden, cache=DynamicCache(config=model.config))

    xlnet = _quiet_build("xlnet")
    ids, lay, frame = _packed_forward_in_flight(xlnet)
    mems = [torch.zeros(2, ids.shape[0], xlnet.config.d_model)] * xlnet.config.n_layer
    with frame, pytest.raises(PackingDisabledError, match="mems"):
        xlnet.transformer(input_ids=ids, mems=mems)


@pytest.mark.parametrize("model_type", ["mvp", "trocr", "prophetnet"])
def test_a_packed_batch_with_an_encoder_output_is_refused(model_type):
    model = _quiet_build(model_type)
    ids, pos, _ = _rows(model.config.vocab_size, [[3, 3], [6]])
    install_packing(model)
    encoder = torch.randn(2, 6, model.config.hidden_size)
    with pytest.raises(PackingDisabledError, match="encoder"):
        model(input_ids=ids, position_ids=pos, encoder_hidden_states=encoder, use_cache=False)


def test_a_position_table_of_another_shape_is_refused(monkeypatch):
    from transformers.models.bart import modeling_bart

    model = _quiet_build("bart")
    original = modeling_bart.BartLearnedPositionalEmbedding.forward

    def shifted(self, input_ids, cache_length=0, position_ids=None):  # a release that counts positions from 1
        return original(self, input_ids, cache_length + 1, position_ids)

    monkeypatch.setattr(modeling_bart.BartLearnedPositionalEmbedding, "forward", shifted)
    with pytest.raises(UnsupportedModelError, match="BartLearnedPositionalEmbedding"):
        install_packing(model)
    assert packing_state(model) is None


# ---- ordinary batches and generation run transformers' own code -----------------------------------------------------


@pytest.mark.parametrize("model_type", ["bart", "mvp", "openai-gpt", "xglm"])
def test_generation_with_a_cache_is_unchanged_and_unconfigure_restores_the_modules(model_type):
    model = _quiet_build(model_type)
    prompt = torch.tensor([[5, 9, 17, 4]])
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(prompt, **settings)
    install_packing(model)
    model.config.use_cache = True  # generation with a cache: an ordinary batch, transformers' own forward
    assert torch.equal(model.generate(prompt, **settings), want)
    assert unconfigure_packing(model)
    assert not any("_padfree_positions" in vars(m) or "forward" in vars(m) for m in model.modules())
