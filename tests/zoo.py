"""Tiny random-weight causal LMs built from configs, one per model type, for the packed-vs-separate tests.

Every model has hidden size 64, 2 layers, 4 query heads over 2 key/value heads (GQA) and a vocabulary of 96; sliding
windows are 5 tokens so that sequences of 6+ tokens exercise them; MoE models get 4 experts, 2 per token.
Models with sequence mixers (:data:`MIXER_TYPES`) have 2-3 layers, mixer layers around an attention layer where the
model is hybrid: conv kernels of 4 taps, GatedDeltaNet chunks of 64 tokens, SSD chunks of 8.

The helpers at the end pack sequences of *any* length (1 included, which :func:`padfree.verify` does not take) into
rows and compare one packed forward/backward with every sequence run alone.
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
    "starcoder2": dict(sliding_window=5),
    "phi3": dict(sliding_window=5),
}

_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_hidden_layers=3)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_SSD = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=8)
_MIXER_EXTRA = {
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
    "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4,
                   chunk_size=8),
    "mamba": dict(num_hidden_layers=2, state_size=8),
    "falcon_mamba": dict(num_hidden_layers=2, state_size=8),
}

# hybrids: attention layers (sdpa / eager) and sequence mixers; SSM_TYPES: sequence mixers only, no attention
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lfm2", "lfm2_moe", "bamba",
                "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2", "jamba")
SSM_TYPES = ("mamba", "mamba2", "falcon_mamba")
MIXER_TYPES = HYBRID_TYPES + SSM_TYPES

# transformers has no SDPA path for these (softcapping, sinks): they are built with eager
_EAGER_ONLY = {"gemma2", "gpt_oss"}

ATTENTION_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo", "olmo2", "granite", "starcoder2", "gpt_oss", "cohere", "glm", "helium", "smollm3",
)  # granitemoehybrid is a hybrid (HYBRID_TYPES): its tiny model has attention and Mamba-2 layers


def tiny_model(model_type: str, *, seed: int = 0, attn: str | None = None, **overrides
               ) -> transformers.PreTrainedModel:
    """A tiny fp32 ``*ForCausalLM`` of ``model_type`` with random weights (deterministic for ``seed``), built with
    attention ``attn`` (default: sdpa, eager where transformers has no SDPA path, none for :data:`SSM_TYPES`)."""
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(_EXTRA.get(model_type, {}))
    kwargs.update(_MIXER_EXTRA.get(model_type, {}))
    kwargs.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    if attn is None and model_type not in SSM_TYPES:
        attn = "eager" if model_type in _EAGER_ONLY else "sdpa"
    level = logging.getLogger("transformers").level
    transformers.logging.set_verbosity_error()  # tiny configs trip harmless rope/vocab warnings
    try:
        extra = {} if attn is None else {"attn_implementation": attn}
        return transformers.AutoModelForCausalLM.from_config(config, **extra).float()
    finally:
        logging.getLogger("transformers").setLevel(level)


def sequences(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random token ids (never 0, the padding id) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# 3 sequences of different lengths per row, 2 rows, most longer than the window of 5
LENGTHS = [9, 8, 7, 6, 5, 3]  # packs (obfd, capacity 20) into rows [9, 8, 3] and [7, 6, 5] + 2 padding
CAPACITY = 20


# ---- packed rows of sequences of any length, and the per-sequence reference ---------------------------------------

# per row: a length-1 sequence, sequences shorter than the conv kernel (4), one crossing the 64-token GatedDeltaNet
# chunk and many 8-token SSD chunks; the second row ends in a filler run (a segment of its own)
MIXER_ROWS = [[1, 3, 70, 9], [2, 40, 30, 11]]


def packed_rows(rows: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(input_ids, position_ids, [(row, start, ids)])``: random sequences of these lengths packed into rows."""
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
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], s[1:], reduction="sum")
    return loss / total


def run_separately(model, seqs):
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


def run_packed(model, ids, pos, seqs, *, grad=True, **kwargs):
    """Per-sequence logits of one packed forward and the parameter gradients of its loss (none without ``grad``)."""
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    per_seq = [logits[b, start:start + len(s)] for b, start, s in seqs]
    grads = {}
    if grad:
        loss_of(per_seq, seqs, sum(len(s) - 1 for _, _, s in seqs)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [x.detach() for x in per_seq], grads


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def grad_diff(ga, gb) -> float:
    assert ga.keys() == gb.keys()
    return max(float((ga[k] - gb[k]).abs().max()) for k in ga)
