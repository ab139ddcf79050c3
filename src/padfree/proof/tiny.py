"""Tiny random-weight causal LMs built from configs: one per model type padfree supports.

``padfree verify --model-type T`` checks a model type without downloading anything, and the test suite proves the
support matrix on the same models. Every model has hidden size 64, 4 query heads over 2 key/value heads (GQA, head
dim 16) and a vocabulary of 96; sliding windows are 5 tokens, so sequences of 6+ tokens exercise them; MoE models get
4 experts, 2 per token; recurrent mixers get short kernels (4 taps) and short chunks (8), so a few dozen tokens cross
every code path of the packed formulations.

>>> model = tiny_model("llama")
>>> type(model).__name__, model.config.hidden_size, model.dtype
('LlamaForCausalLM', 64, torch.float32)
>>> "qwen3_5_text" in TINY_CONFIGS and "mamba" in TINY_CONFIGS
True
"""

from __future__ import annotations

import logging
from typing import Any

from padfree.errors import InvalidArgumentError

__all__ = ["TINY_CONFIGS", "tiny_config", "tiny_model"]

VOCAB = 96

_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_hidden_layers=3)
_SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8)

#: model type -> the config fields that differ from the shared tiny base
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # attention only
    "llama": {},
    "mistral": dict(sliding_window=5),
    "mixtral": dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3": {},
    "qwen3_moe": dict(_MOE),
    "gemma": {},
    "gemma2": dict(sliding_window=5, attn_logit_softcapping=5.0, final_logit_softcapping=None),
    "gemma3_text": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(sliding_window=5),
    "olmo": {},
    "olmo2": {},
    "granite": {},
    "starcoder2": dict(sliding_window=5),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"]),
    "cohere": {},
    "glm": {},
    "helium": {},
    "smollm3": {},
    # attention + recurrent mixers
    "qwen3_next": dict(_GDN, **_MOE, shared_expert_intermediate_size=32),
    "qwen3_5_text": dict(_GDN),
    "qwen3_5_moe_text": dict(_GDN, **_MOE, shared_expert_intermediate_size=32),
    "olmo_hybrid": dict(_GDN),
    "lfm2": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4,
                 block_multiple_of=16),
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=4,
                     num_dense_layers=1, **_MOE),
    "bamba": dict(_SSD, num_hidden_layers=3, attn_layer_indices=[1]),
    "falcon_h1": dict(_SSD, num_hidden_layers=2, mamba_d_ssm=128),
    "granitemoehybrid": dict(_SSD, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=3, layers_block_type=["mamba", "attention", "mamba"], mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, expand=2, chunk_size=8),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], n_mamba_heads=8,
                   mamba_d_state=16, mamba_ngroups=2, chunk_size=8, mamba_headdim=16),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, mamba_d_state=8, mamba_dt_rank=8),
    # recurrent only
    "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16,
                   conv_kernel=4, chunk_size=8),
    "mamba": dict(num_hidden_layers=2, state_size=8),
    "falcon_mamba": dict(num_hidden_layers=2, state_size=8),
    # encoder families as causal decoders: their config defaults are bidirectional (the sweep proves those too);
    # this variant proves the causal mode their *ForCausalLM classes are meant for
    # (dropout off: the tiny model is compared run against run, in training mode too)
    **{t: dict(is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0) for t in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
        "xmod")},
    "xlm": dict(causal=True, dropout=0.0, attention_dropout=0.0),
    "xmod": dict(is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                 default_language="en_XX"),  # its forward refuses to guess the language of its adapters
    "falcon": dict(alibi=True, num_attention_heads=16, num_kv_heads=16),  # ALiBi (16 heads: slopes that are
    # not all powers of two, where a leak of the bias shows)
}

# transformers has no SDPA path for these (logit softcapping, attention sinks): they are built with eager
_EAGER_ONLY = frozenset({"gemma2", "gpt_oss"})
# no attention layers at all: transformers refuses any attn_implementation for them
_NO_ATTENTION = frozenset({"mamba", "mamba2", "falcon_mamba"})


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The ``transformers`` config of the tiny ``model_type`` model, with ``overrides`` applied last."""
    if model_type not in TINY_CONFIGS:
        raise InvalidArgumentError(
            f"model_type={model_type!r} has no tiny config; accepted: {', '.join(sorted(TINY_CONFIGS))}"
        )
    import transformers

    kwargs = {**_BASE, **TINY_CONFIGS[model_type], **overrides}
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]  # its read-only properties are derived from other fields: never passed
    derived = {k for k in kwargs if isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None}
    return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in kwargs.items() if k not in derived})


def tiny_model(model_type: str, *, seed: int = 0, attn_implementation: str | None = None, **overrides: Any) -> Any:
    """A tiny fp32 ``*ForCausalLM`` of ``model_type`` with random weights, deterministic for ``seed``.

    ``attn_implementation`` defaults to ``"sdpa"`` (``"eager"`` for the types transformers runs only eagerly or
    whose class has no SDPA path, none for the types without attention).
    """
    import torch
    import transformers

    config = tiny_config(model_type, **overrides)
    impl = attn_implementation or ("eager" if model_type in _EAGER_ONLY else "sdpa")
    extra = {} if model_type in _NO_ATTENTION else {"attn_implementation": impl}
    torch.manual_seed(seed)
    log = logging.getLogger("transformers")
    level = log.level
    transformers.logging.set_verbosity_error()  # tiny configs trip harmless rope / vocabulary warnings
    try:
        try:
            return transformers.AutoModelForCausalLM.from_config(config, **extra).float()
        except ValueError:  # a class without an SDPA path (MegatronBert, RemBert, ...) when none was asked for
            if attn_implementation is not None or impl != "sdpa":
                raise
            torch.manual_seed(seed)
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    finally:
        log.setLevel(level)
