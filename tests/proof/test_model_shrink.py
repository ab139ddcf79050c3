"""The tiny twins of :mod:`padfree.proof.shrink`: every causal-LM type of the installed transformers builds a small
model that trains on a packed-like batch, and a user's own config keeps its features when it is shrunk."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from padfree.proof.shrink import UNBUILDABLE, VOCAB, default_config, shrink_config

TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
MAX_PARAMETERS = 2_000_000


@pytest.fixture(autouse=True)
def _quiet():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # tiny configs trip harmless rope / vocabulary warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    transformers.logging.set_verbosity(verbosity)


def _batch(length: int = 83) -> tuple[torch.Tensor, torch.Tensor]:
    """(2, length) token ids below the tiny vocabulary and positions restarting like packed rows'
    (a 70-token sequence, a 9-token one, the rest)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    lengths = [70, 9, length - 79] if length > 79 else [length]
    pos = torch.cat([torch.arange(n) for n in lengths]).repeat(2, 1)
    return ids, pos


def _walk(d: dict, path: str = ""):
    yield path, d
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            yield from _walk(value, f"{path}{key}.")


def _check_sizes(original: dict, tiny: dict) -> None:
    """The sizes an exactness test must cross stay small: windows, chunks, kernels, indexer top-k, MoE top-k."""
    before_by_path = dict(_walk(original))
    for path, d in _walk(tiny):
        before = before_by_path.get(path, {})
        for key in ("sliding_window", "sliding_window_size", "local_attention_window_len", "attention_window_size"):
            if isinstance(d.get(key), int) and before.get(key):
                assert 0 < d[key] <= 5, (path, key, d[key])
        for key in ("chunk_size", "mamba_chunk_size", "attention_chunk_size"):
            if isinstance(d.get(key), int) and d[key] > 0:
                assert d[key] <= 8, (path, key, d[key])
        for key in ("conv_kernel", "d_conv", "mamba_d_conv", "conv_L_cache", "linear_conv_kernel_dim",
                    "short_conv_kernel_size", "conv1d_width"):
            if isinstance(d.get(key), int):
                assert d[key] <= 4, (path, key, d[key])
        if isinstance(d.get("index_topk"), int):
            assert d["index_topk"] < 9, (path, d["index_topk"])  # fewer than a 9-token sequence: selection matters
        experts = next((d[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if d.get(k)), None)
        top_k = next((d[k] for k in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
                      if d.get(k)), None)
        if isinstance(experts, int) and isinstance(top_k, int) and experts > 1:
            assert top_k < experts, (path, top_k, experts)


def _train_step(model_type: str, config) -> torch.Tensor:
    """Build the tiny twin, run one fp32 forward and backward on a packed-like batch: the logits."""
    with torch.device("meta"):  # count first: a size rule that misses would allocate gigabytes
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert parameters < MAX_PARAMETERS, f"{model_type}: {parameters:,} parameters"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    ids, pos = _batch()
    if model_type == "reformer":
        # reversible layers back-propagate in training mode only, where axial position embeddings take rows of
        # exactly prod(axial_pos_shape) tokens
        model.train()
        ids, pos = _batch(math.prod(config.axial_pos_shape))
    out = model(input_ids=ids, position_ids=pos, use_cache=False)
    out.logits.float().sum().backward()
    assert out.logits.shape[:2] == ids.shape
    return out.logits


@pytest.mark.parametrize("model_type", TYPES)
def test_every_causal_lm_type_has_a_tiny_twin_that_trains(model_type, one_thread):
    original = default_config(model_type)
    config = shrink_config(original)
    # the support table stores the features of shrunk defaults; a user's config and the sweep's own models are
    # shrunk again before they are compared: shrinking twice changes nothing
    assert shrink_config(config).to_dict() == config.to_dict()
    _check_sizes(original.to_dict(), config.to_dict())
    if model_type in UNBUILDABLE:  # listed types must really fail, whatever the error
        with pytest.raises(Exception):  # noqa: B017, PT011
            _train_step(model_type, config)
        return
    assert torch.isfinite(_train_step(model_type, config)).all()


def test_unbuildable_names_installed_types_with_reasons():
    assert set(UNBUILDABLE) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert all(len(reason) > 40 for reason in UNBUILDABLE.values())


def test_a_user_llama_keeps_its_rope_scaling_window_and_tie_flags():
    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
        max_position_embeddings=131072, tie_word_embeddings=True, sliding_window=4096, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    before = config.to_dict()
    tiny = shrink_config(config)
    assert config.to_dict() == before  # the original is not modified
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.vocab_size) == (64, 4, 2, 96)
    assert tiny.tie_word_embeddings is True and tiny.attention_bias is True
    assert tiny.sliding_window == 5
    rope = tiny.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    # the context stretch keeps its ratio: 131072 / 8192 == 256 / 16
    assert tiny.max_position_embeddings / rope["original_max_position_embeddings"] == 16
    untied = shrink_config(transformers.LlamaConfig(tie_word_embeddings=False))
    assert untied.tie_word_embeddings is False
    model = AutoModelForCausalLM.from_config(tiny)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_user_qwen2_keeps_its_sliding_window_layers():
    config = transformers.Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=21,
                                      num_hidden_layers=28)
    tiny = shrink_config(config)
    assert tiny.use_sliding_window is True and tiny.sliding_window == 5
    assert tiny.layer_types == ["full_attention", "sliding_attention"]  # one layer of each kind, in order
    assert tiny.max_window_layers == 1  # still the first sliding layer
    off = shrink_config(transformers.Qwen2Config())
    assert off.use_sliding_window is False and set(off.layer_types) == {"full_attention"}


def test_head_layouts_stay_what_they_are():
    assert shrink_config(transformers.LlamaConfig()).num_key_value_heads == 4  # MHA: as many as query heads
    assert shrink_config(transformers.LlamaConfig(num_key_value_heads=1)).num_key_value_heads == 1  # MQA
    mla = shrink_config(default_config("deepseek_v3"))
    assert mla.head_dim == mla.qk_rope_head_dim and mla.num_key_value_heads == mla.num_attention_heads
    gptj = shrink_config(transformers.GPTJConfig())  # a quarter of the head dim rotates, before and after
    assert gptj.rotary_dim * 4 == gptj.n_embd // gptj.n_head


def test_long_rope_factors_follow_the_new_rotary_dim():
    config = transformers.Phi3Config(
        hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
                         "short_factor": [1.0 + i / 100 for i in range(48)],
                         "long_factor": [1.0 + i / 10 for i in range(48)]})
    tiny = shrink_config(config)
    assert len(tiny.rope_parameters["short_factor"]) == len(tiny.rope_parameters["long_factor"]) == 8
    assert tiny.original_max_position_embeddings < 83  # a packed test row still takes the long factors
    model = AutoModelForCausalLM.from_config(tiny)
    ids, pos = _batch()
    assert torch.isfinite(model(input_ids=ids, position_ids=pos).logits).all()


def test_layer_kinds_survive_and_layer_indexed_fields_are_remapped():
    gemma3n = shrink_config(default_config("gemma3n_text"))  # sliding / full, sparse activations, shared KV
    shared = gemma3n.num_kv_shared_layers
    assert 0 < shared < gemma3n.num_hidden_layers
    assert set(gemma3n.layer_types[:-shared]) == set(gemma3n.layer_types[-shared:]) == {
        "sliding_attention", "full_attention"}
    assert {0.0, 0.95} == set(gemma3n.activation_sparsity_pattern)

    deepseek = shrink_config(default_config("deepseek_v3"))  # three dense layers, then MoE
    assert deepseek.first_k_dense_replace == 1 and deepseek.num_hidden_layers == 2

    mllama = shrink_config(default_config("mllama")).text_config  # cross-attention layers by index
    assert mllama.cross_attention_layers and max(mllama.cross_attention_layers) < mllama.num_hidden_layers

    jamba = shrink_config(transformers.JambaConfig())  # attention every 8 layers, experts every 2: a refitted period
    assert {(kind, experts > 1) for kind, experts in zip(jamba.layers_block_type, jamba.layers_num_experts,
                                                           strict=True)} == {
        ("attention", False), ("mamba", True), ("mamba", False)}

    sparse_step = shrink_config(transformers.Qwen2MoeConfig(decoder_sparse_step=2, mlp_only_layers=[1],
                                                            num_hidden_layers=12))
    sparse = [(i + 1) % sparse_step.decoder_sparse_step == 0 and i not in sparse_step.mlp_only_layers
              for i in range(sparse_step.num_hidden_layers)]
    assert any(sparse) and not all(sparse) and sparse_step.mlp_only_layers

    gemma4 = shrink_config(default_config("gemma4_text")).to_dict()  # full-attention layers keep a wider head
    full = gemma4["layer_types"].index("full_attention")
    assert gemma4["per_layer_config"] == {str(full): {"head_dim": 2 * gemma4["head_dim"]}}


def test_family_fixes_fill_only_what_a_config_leaves_unset():
    assert shrink_config(default_config("nemotron")).num_key_value_heads == 2  # None in the defaults
    assert shrink_config(transformers.NemotronConfig(num_key_value_heads=48)).num_key_value_heads == 4  # MHA kept
    xmod = shrink_config(transformers.XmodConfig(languages=["de_DE", "en_XX"], default_language="en_XX"))
    assert xmod.default_language == "en_XX"
