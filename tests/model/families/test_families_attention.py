"""Attention variants run per sequence (families ``alibi`` and ``attention_variants``): packed == each sequence alone.

BLOOM, MPT and Falcon (ALiBi, and Falcon's RoPE), GPT-NeoX-Japanese (hand-written attention), StableLM (a decoder
layer that drops the layout), Llama-4 (chunked attention, NoPE query temperature) and Doge (dynamic mask attention,
CDMoE router) are proven with :func:`padfree.proof.compare.prove` — logits, loss and every gradient in fp32, bf16
autocast and bf16 weights, under each attention implementation transformers has for them — next to negative
controls that the same comparison catches, and the refusals. The grouping of segments (``per_bucket``,
``buckets``) is tested in tests/model/test_model_packed.py, the attention backends alone in
tests/model/test_model_attention.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model.configure import install_packing, packing_state, unconfigure_packing
from padfree.model.families import alibi, attention_variants
from padfree.model.flight import forward_of
from padfree.model.packed import PackedLayout
from padfree.model.state import PackingState
from padfree.proof.compare import FP32_TOL, prove, stock_packed_diff

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96
_SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)


def _llama4(**extra):
    # layers: chunked + RoPE, chunked + RoPE, full + NoPE (temperature-tuned queries); a 4-token floor_scale makes
    # the temperature move within the proof's rows (8192 tokens in the real model)
    return transformers.Llama4TextConfig(**{**_SIZES, "num_hidden_layers": 3, "intermediate_size": 32,
                                            "intermediate_size_mlp": 96, "num_key_value_heads": 2, "head_dim": 16,
                                            "num_local_experts": 4, "num_experts_per_tok": 1,
                                            "no_rope_layers": [1, 1, 0], "attention_chunk_size": 8,
                                            "floor_scale": 4, **extra})


CONFIGS = {
    "bloom": lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "mpt": lambda: transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2,
                                          max_seq_len=128),
    "falcon": lambda: transformers.FalconConfig(**_SIZES),
    # 16 heads: ALiBi slopes that are not powers of two, so the bf16 bias of a position is not a pure shift
    "falcon-alibi": lambda: transformers.FalconConfig(**{**_SIZES, "num_attention_heads": 16}, alibi=True),
    "falcon-alibi-new-arch": lambda: transformers.FalconConfig(**{**_SIZES, "num_attention_heads": 16}, alibi=True,
                                                               new_decoder_architecture=True, num_kv_heads=4),
    "gpt_neox_japanese": lambda: transformers.GPTNeoXJapaneseConfig(**_SIZES, intermediate_multiple_size=2,
                                                                    max_position_embeddings=128),
    "stablelm": lambda: transformers.StableLmConfig(**_SIZES, intermediate_size=96, num_key_value_heads=2,
                                                    qk_layernorm=True),
    "llama4_text": _llama4,
    "doge": lambda: transformers.DogeConfig(**_SIZES, intermediate_size=96, num_key_value_heads=4,
                                            keep_window_size=32),
    "doge-moe": lambda: transformers.DogeConfig(**_SIZES, intermediate_size=96, num_key_value_heads=4,
                                                keep_window_size=32, is_moe=True, num_experts=16,
                                                num_experts_per_tok=2),
}
# the attention implementations transformers has for each (the first also runs bf16 autocast and bf16 weights)
IMPLEMENTATIONS = {"bloom": ("eager",), "mpt": ("eager",), "gpt_neox_japanese": ("eager",),
                   "falcon-alibi-new-arch": ("sdpa",), "doge-moe": ("sdpa",)}


def tiny(name: str, attn: str | None = None, **overrides) -> transformers.PreTrainedModel:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    attn = attn or IMPLEMENTATIONS.get(name, ("sdpa",))[0]
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval()


PROOFS = [(name, attn) for name in CONFIGS for attn in IMPLEMENTATIONS.get(name, ("sdpa", "eager"))]


@pytest.mark.parametrize(("name", "attn"), PROOFS, ids=[f"{n}-{a}" for n, a in PROOFS])
def test_packed_equals_each_sequence_alone(name, attn):
    model = tiny(name, attn)
    assert model.config._attn_implementation == attn
    first = attn == IMPLEMENTATIONS.get(name, ("sdpa",))[0]
    proof = prove(model, backends=["sdpa"], precisions=("fp32", "autocast_bf16", "bf16") if first else ("fp32",))
    assert proof.ok, f"\n{proof}"
    assert {c.backend for c in proof.checks} == {"none"}  # every attention layer runs per sequence, none on a backend
    assert all(c.sees_leaks for c in proof.checks if c.precision == "fp32")
    assert model.config._attn_implementation == attn  # transformers' own choice, untouched


# stock transformers finds packed sequences from restarting position_ids in create_causal_mask: models whose
# attention reads nothing else from the row (Falcon with RoPE, GPT-NeoX-Japanese, StableLM) are exact without padfree
STOCK_EXACT = ("falcon", "gpt_neox_japanese", "stablelm")


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in STOCK_EXACT])
def test_the_same_comparison_catches_stock_transformers_leaking(name):
    """ALiBi from positions that run on across the row (BLOOM, MPT, Falcon), chunks counted from the row's start
    (Llama-4), top-k keys and router reshapes over the row (Doge)."""
    assert stock_packed_diff(tiny(name)) > FP32_TOL


@pytest.mark.parametrize("name", STOCK_EXACT)
def test_stock_exact_models_stay_exact_per_sequence(name):
    assert stock_packed_diff(tiny(name)) <= FP32_TOL


def test_padfree_attention_without_the_stablelm_family_reads_the_owner_layout_or_refuses(monkeypatch):
    """StableLM's decoder layer drops its keyword arguments, so padfree's layout never reaches its attention that
    way: on padfree's SDPA backend alone the attention reads the layout from its model's state (exact), and an
    attention module cut off from that state refuses rather than attending causally over the whole row."""
    from padfree.model import configure, install
    from padfree.model.attention import OWNER_ATTR

    families = configure.families()
    monkeypatch.setattr(install, "families",
                        lambda: {k: v for k, v in families.items() if k != "StableLmAttention"})
    model = tiny("stablelm")
    ids, pos = torch.randint(3, VOCAB, (1, 6)), torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert install_packing(model).backend == "padfree_sdpa"
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        alone = model(input_ids=ids[:, 3:], use_cache=False).logits
    assert (packed[0, 3:] - alone[0]).abs().max() <= 1e-5
    for layer in model.model.layers:
        layer.self_attn.__dict__.pop(OWNER_ATTR)
    with pytest.raises(PackingDisabledError, match="StableLmAttention was called in a packed forward without"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    unconfigure_packing(model)


def test_llama4_nope_temperature_alone_is_caught_and_made_exact():
    """Full attention only, NoPE everywhere: stock transformers finds the packed sequences from the restarting
    position_ids and masks them apart; only the query temperature, taken from arange over the row, still leaks."""
    config = _llama4(layer_types=["full_attention"] * 3, no_rope_layers=[0, 0, 0], attention_chunk_size=None)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    assert stock_packed_diff(model) > 100 * FP32_TOL
    assert prove(model, backends=["sdpa"], precisions=["fp32"]).ok
    model.config.attn_temperature_tuning = False
    for layer in model.model.layers:
        layer.self_attn.attn_temperature_tuning = False
    assert stock_packed_diff(model) <= FP32_TOL  # the temperature was the whole leak


def test_mpt_runs_per_exact_length_and_bucketed_alibi_would_be_off():
    """MPT counts its bias back from the last key: one group per exact length, and with padded buckets the bias of
    every key would shift (harmless in exact arithmetic, different in floating point)."""
    assert alibi.REPLAYS["MptAttention"].by == "length"
    model = tiny("mpt")
    report = install_packing(model)
    assert "one length" in report.mixers["transformer.blocks.0.attn"]
    unconfigure_packing(model)


def test_segment_id_mask_with_trailing_padding():
    model = tiny("falcon-alibi")
    install_packing(model)
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10, 11, 12, 13, 14, 15, 16, 17, 18])]
    ids = torch.cat([*seqs, torch.zeros(3, dtype=torch.long)])[None]
    segments = torch.tensor([[1] * 3 + [2] + [3] * 10 + [0] * 3])
    with torch.no_grad():
        packed = model(input_ids=ids, attention_mask=segments).logits[0]
        unconfigure_packing(model)
        start = 0
        for s in seqs:
            alone = model(input_ids=s[None]).logits[0]
            assert float((packed[start:start + len(s)] - alone).abs().max()) <= FP32_TOL
            start += len(s)


def test_doge_moe_router_logits_cover_every_token():
    model = tiny("doge-moe")
    install_packing(model)
    ids = torch.randint(3, VOCAB, (2, 20))
    pos = torch.tensor([list(range(7)) + list(range(13)), list(range(20))])
    out = model(input_ids=ids, position_ids=pos, output_router_logits=True, use_cache=False)
    assert all(r.shape[:2] == (2, 40) for r in out.router_logits)  # (2, every token of the batch, keys)
    assert torch.isfinite(out.aux_loss)


# ---- refusals -----------------------------------------------------------------------------------------------------


def test_a_cache_is_refused_by_the_model_and_by_the_module():
    model = tiny("bloom")
    install_packing(model)
    ids, pos = torch.randint(3, VOCAB, (1, 6)), torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(PackingDisabledError, match="cache"):
        model(input_ids=ids, position_ids=pos, past_key_values=transformers.DynamicCache(), use_cache=True)
    with torch.no_grad(), forward_of(packing_state(model), PackedLayout.from_position_ids(pos)):
        attention = model.transformer.h[0].self_attention
        hidden = torch.zeros(1, 6, 64)
        with pytest.raises(PackingDisabledError, match="DynamicCache"):
            attention(hidden, hidden, torch.zeros(4, 1, 6), None, layer_past=transformers.DynamicCache())
        with pytest.raises(PackingDisabledError, match="does not know what a sequence alone gets for extra"):
            attention(hidden, hidden, torch.zeros(4, 1, 6), None, extra=torch.zeros(1, 6))


@pytest.mark.parametrize("name", ["bloom", "llama4_text"])
def test_cached_decoding_runs_transformers_own_code(name):
    model = tiny(name)
    prompt = torch.randint(3, VOCAB, (2, 5))

    def decode() -> list[torch.Tensor]:
        out = model(input_ids=prompt, use_cache=True)
        logits, cache = [out.logits], out.cache
        for _ in range(3):
            out = model(input_ids=logits[-1][:, -1:].argmax(-1), cache=cache, use_cache=True)
            logits.append(out.logits)
        return logits

    with torch.no_grad():
        want = decode()
        install_packing(model)
        got = decode()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    attention = next(m for m in model.modules() if "_padfree_replay" in m.__dict__)
    assert attention.forward.__func__.__module__ == attention_variants.__name__  # the family's own forward
    assert unconfigure_packing(model) and "forward" not in attention.__dict__


def test_a_model_that_also_has_backend_attention_is_refused():
    model = tiny("bloom")
    state = PackingState("padfree_sdpa", report=None)
    with pytest.raises(UnsupportedModelError, match="BloomAttention runs per sequence"):
        alibi.install(model.transformer.h[0].self_attention, state)


def test_a_forward_of_another_shape_is_refused():
    class BloomAttention(torch.nn.Module):  # same name, not the forward padfree proved
        def forward(self, hidden_states):
            return hidden_states

    with pytest.raises(UnsupportedModelError, match="not the arguments padfree proved"):
        alibi.install(BloomAttention(), PackingState("none", report=None))


def test_length_dependent_rope_refuses_rows_longer_than_its_context():
    model = tiny("stablelm", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
                                              "partial_rotary_factor": 0.25})
    model.config.max_position_embeddings = 16
    install_packing(model)
    ids = torch.randint(3, VOCAB, (1, 20))
    pos = torch.tensor([list(range(10)) * 2])
    with pytest.raises(PackingDisabledError, match="dynamic RoPE"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    short = model(input_ids=ids[:, :16], position_ids=pos[:, :16], use_cache=False)
    assert short.logits.shape == (1, 16, VOCAB)


def test_compiled_packed_steps_stay_exact_without_recompiling_per_batch():
    """Under torch.compile the per-group runs happen between the compiled graphs (``torch.compiler.disable``): new
    lengths change no guard once the graphs have gone dynamic."""
    from zoo import grad_diff, max_diff, packed_rows, run_packed, run_separately

    model = tiny("falcon-alibi", num_hidden_layers=1)
    install_packing(model)
    compiled = torch.compile(model, backend="eager")  # dynamo's capture and guards; aot_eager costs a minute here
    torch._dynamo.reset()
    try:
        for i, rows in enumerate([[[9, 8, 3], [7, 6, 5]], [[4, 12, 2], [3, 11]], [[20, 1], [5, 6, 8, 2]]]):
            ids, pos, seqs = packed_rows(rows, seed=i)
            alone, g_alone = run_separately(model, seqs)
            with torch._dynamo.config.patch(error_on_recompile=i >= 2):
                packed, g_packed = run_packed(compiled, ids, pos, seqs)
            assert max_diff(packed, alone) <= FP32_TOL and grad_diff(g_packed, g_alone) <= FP32_TOL
    finally:
        torch._dynamo.reset()
