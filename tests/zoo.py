"""Tiny random-weight causal LMs built from configs, one per model type, for the packed-vs-separate tests.

Every model has hidden size 64, 2 layers, 4 query heads over 2 key/value heads (GQA) and a vocabulary of 96; sliding
windows are 5 tokens so that sequences of 6+ tokens exercise them; MoE models get 4 experts, 2 per token.
"""

from __future__ import annotations

import logging

import torch
import transformers

VOCAB = 96

_EXTRA = {
    "mistral": dict(sliding_window=5),
    "mixtral": dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma2": dict(sliding_window=5, attn_logit_softcapping=5.0, final_logit_softcapping=None),
    "gemma3_text": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["attention", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=32),
    "starcoder2": dict(sliding_window=5),
    "phi3": dict(sliding_window=5),
}

# transformers has no SDPA path for these (softcapping, sinks): they are built with eager
_EAGER_ONLY = {"gemma2", "gpt_oss"}

ATTENTION_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo", "olmo2", "granite", "starcoder2", "gpt_oss", "granitemoehybrid", "cohere", "glm", "helium",
    "smollm3",
)


def tiny_model(model_type: str, *, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A tiny fp32 ``*ForCausalLM`` of ``model_type`` with random weights (deterministic for ``seed``)."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(_EXTRA.get(model_type, {}))
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    impl = "eager" if model_type in _EAGER_ONLY else "sdpa"
    level = logging.getLogger("transformers").level
    transformers.logging.set_verbosity_error()  # tiny configs trip harmless rope/vocab warnings
    try:
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).float()
    finally:
        logging.getLogger("transformers").setLevel(level)


def sequences(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random token ids (never 0, the padding id) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# 3 sequences of different lengths per row, 2 rows, most longer than the window of 5
LENGTHS = [9, 8, 7, 6, 5, 3]  # packs (obfd, capacity 20) into rows [9, 8, 3] and [7, 6, 5] + 2 padding
CAPACITY = 20
