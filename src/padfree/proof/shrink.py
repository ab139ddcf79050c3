"""A tiny twin of any causal-LM config: same class, same features, well under a million parameters.

The support sweep builds one tiny model per model type of the installed transformers from the config class's
defaults (:func:`default_config`), and on-the-spot certification builds one from a user's own config; both go
through :func:`shrink_config`. It keeps every *feature* of the config — layer types, which layers are hybrid, dense
or sparse, sliding windows, MoE routing, MLA, sparse-attention indexers, softcapping, tie flags, activation, rope
type — and shrinks every *size*:

- widths: hidden 64, 4 query heads of 16 dims, MLP 96, vocabulary 96; key/value heads 2 — or 4 where the config
  has as many as query heads (MHA, MLA), 1 where it has one (MQA); a width equal to some hidden size becomes 64;
- depth: one layer per distinct layer kind, where a kind combines every per-layer list (``layer_types``,
  ``mlp_layer_types``, ...), every list of layer indices (``attn_layer_indices``, ``moe_layers``, ...), every
  layer-range count (``first_k_dense_replace``, ``num_kv_shared_layers``, ``max_window_layers``, ...) and every
  ``per_layer_config`` override; all of them are remapped to the kept layers (at least 2, at most 10). Layers that
  follow a period the model reads (Jamba's ``attn_layer_period``, ``decoder_sparse_step``) get the fewest layers
  and a refitted period that still show every kind (else a prefix of at most 12 layers);
- MoE: at most 4 experts, at most 2 per token, expert MLPs of 32, at most 2 expert groups;
  MLA ranks of 16 / 32, rope/nope head dims of 8;
- sequence mixers: convolutions of at most 4 taps, states of 16, chunks of at most 8 tokens;
- windows: a sliding window (or attention chunk) that is set becomes at most 5 tokens (8 for chunks), so a 9-token
  sequence crosses it; sparse-attention indexers select at most 4 tokens (or 2 blocks of 4);
- rope: ``mrope_section`` rescaled to the new head dim, ``original_max_position_embeddings`` kept in the same ratio
  to ``max_position_embeddings`` (256), long-rope factor lists cut to the new rotary dim;
- token ids past the vocabulary become 0 / 1 / 2 (pad, bos, eos, ...), and every other special token (an image's, its
  markers') a distinct id at the top of the vocabulary.

A size that is off (``None``) stays off. Sub-configs (text, vision, audio, attention, FFN, ...) are shrunk the same
way. Anything the rules cannot shrink consistently is fixed per family (:data:`FAMILY_FIXES`); model types whose
causal-LM class cannot be built here are listed, with the reason, in :data:`UNBUILDABLE`. The result is validated
by the config class itself (it is rebuilt from a dict).

>>> from transformers import LlamaConfig
>>> tiny = shrink_config(LlamaConfig(num_key_value_heads=8, sliding_window=4096))
>>> tiny.hidden_size, tiny.num_attention_heads, tiny.num_key_value_heads, tiny.num_hidden_layers, tiny.vocab_size
(64, 4, 2, 2, 96)
>>> tiny.sliding_window, shrink_config(LlamaConfig()).num_key_value_heads  # Llama's defaults are MHA: 32 of 32
(5, 4)
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import itertools
import math
import re
import sys
from typing import Any

__all__ = ["FAMILY_FIXES", "UNBUILDABLE", "VOCAB", "default_config", "shrink_config"]

VOCAB = 96
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
WINDOW = 5
MAX_LAYERS = 10
MAX_PREFIX_LAYERS = 12
MAX_POSITIONS = 256

# exact key -> tiny value, set wherever the config has the key holding a number
_FIXED: dict[str, int] = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "dim": HIDDEN,
    "hidden_size_global": HIDDEN, "embed_dim": HIDDEN,
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "encoder_attention_heads": HEADS, "decoder_attention_heads": HEADS, "attention_heads": HEADS,
    "num_attention_heads_per_layer": HEADS, "swa_num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "n_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_query_groups": KV_HEADS, "kv_n_heads": KV_HEADS,
    "swa_num_key_value_heads": KV_HEADS, "num_key_value_heads_per_layer": KV_HEADS,
    "head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "kv_channels": HEAD_DIM, "d_head": HEAD_DIM,
    "dim_head": HEAD_DIM, "attention_head_size": HEAD_DIM,
    "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96, "d_ff": 96, "d_inner": 96, "dim_ff": 96,
    "ffn_hidden_size": 96, "decoder_ffn_dim": 96, "encoder_ffn_dim": 96, "feed_forward_size": 96, "dff": 96,
    "intermediate_size_mlp": 96, "dense_intermediate_size": 96, "ffn_inner_hidden_size": 96, "mlp_dim": 96,
    "max_position_embeddings": MAX_POSITIONS, "n_positions": MAX_POSITIONS, "n_ctx": MAX_POSITIONS,
    "max_seq_len": MAX_POSITIONS, "max_sequence_length": MAX_POSITIONS, "max_target_positions": MAX_POSITIONS,
    "max_source_positions": MAX_POSITIONS, "context_length": MAX_POSITIONS, "seq_length": MAX_POSITIONS,
    "model_max_length": MAX_POSITIONS,
    "embedding_size": HIDDEN, "word_embed_proj_dim": HIDDEN, "input_embedding_size": HIDDEN,
    "output_embedding_size": HIDDEN, "embedding_dim": HIDDEN,
    # mixture of experts
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "shared_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "expert_intermediate_size": 32,
    # multi-head latent attention
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM,
    "qk_head_dim": HEAD_DIM, "o_lora_rank": 16,
    # sparse-attention indexers
    "index_head_dim": HEAD_DIM, "indexer_head_dim": HEAD_DIM, "index_n_heads": 2, "indexer_n_heads": 2,
    # sequence mixers
    "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "d_state": 16,
    "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_headdim": 16, "mamba_n_groups": 2, "mamba_ngroups": 2,
    "n_groups": 2, "mamba_d_ssm": 128,
    "mamba_dt_rank": 8, "time_step_rank": 8,
    "linear_key_head_dim": HEAD_DIM, "linear_value_head_dim": HEAD_DIM, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": HEAD_DIM, "linear_num_heads": HEADS,
    "lru_width": HIDDEN, "attention_hidden_size": HIDDEN, "laurel_rank": 8,
    "num_position_embeddings": 64,  # vision position tables (a square grid)
}
# exact key -> cap: sizes that only ever shrink (a kernel of 3 stays 3; a window of 4096 becomes 5; 0 / -1 stay)
_AT_MOST: dict[str, int] = {
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_routed_experts": 4,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "zero_expert_num": 2,
    "n_group": 2, "num_expert_groups": 2, "num_expert_group": 2, "topk_group": 1,
    "num_centroids": 8,
    # per-layer input embeddings (0: off)
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB,
    # sparse-attention indexers: fewer tokens than a test sequence, so the selection matters
    "index_topk": 4, "indexer_budget": 8, "indexer_compress_ratio": 2, "index_block_size": 4, "index_topk_blocks": 2,
    # sequence mixers
    "conv_kernel": 4, "d_conv": 4, "mamba_d_conv": 4, "conv_L_cache": 4, "linear_conv_kernel_dim": 4,
    "short_conv_kernel_size": 4, "conv_kernel_size": 4, "conv1d_width": 4, "ple_conv_kernel_size": 4,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 8,
    "chunk_size": 8, "mamba_chunk_size": 8, "block_size": 8, "attention_chunk_size": 8,
    "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8,
    # windows that must be crossed by the test sequences
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    "local_attention_window_len": WINDOW, "window_size": WINDOW, "local_attention": 2 * WINDOW,
    "rel_extent": 16, "keep_window_size": 8,
    # number of experts per token
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_top_k": 2,
    "num_selected_experts": 2, "moe_k": 2, "centroid_intermediate_top_k": 2,
}
# dict key -> cap on each of its values (DeepSeek-V4's compression rate per attention type)
_AT_MOST_EACH: dict[str, int] = {"compress_rates": 8}
# names the exact tables miss: a size-like key holding a big number becomes 32 (widths) or 4 (counts)
_WIDTH_LIKE = re.compile(r"(size|dim|rank|width|hidden|inner|intermediate|ffn|channels?)$")
_COUNT_LIKE = re.compile(r"(^|_)(num|n)_\w*(heads|experts|groups)$")
_HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "depth", "num_blocks")
# other layer counts of a config (encoders of encoder-decoders, vision towers, ...): at most 2
_OTHER_LAYER_COUNT = re.compile(r"^((num|n)_\w*(layers|blocks)|(encoder|decoder)_layers|depth|\w+_num_hidden_layers)$")
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
              "sep_token_id": 2, "cls_token_id": 1, "mask_token_id": 3, "unk_token_id": 3}
# keys never touched: identifiers, dtypes, ranges that are not sizes
_KEEP = frozenset({"model_type", "architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
                   "seed", "id2label", "label2id", "time_step_limit", "num_labels", "num_nextn_predict_layers",
                   "rescale_every", "hc_sinkhorn_iters", "H_cycles", "L_cycles",
                   "max_inference_chunksize"})
_KEEP_LIKE = re.compile(r"(multiple_of|divisible_by|_cycles|_passes|_loops)$")
# sizes that some classes leave None in their defaults but every modeling file needs as a number
_NONE_TO_SIZE = ("head_dim",)
_ROPE_KEYS = ("rope_parameters", "rope_scaling")

# layer-range keys: how they define a per-layer attribute, and how they are remapped to the kept layers
_PREFIX_COUNTS = ("first_k_dense_replace", "first_k_dense", "num_dense_layers", "n_dense_layers",
                  "max_window_layers")  # layers [0, k) are special
_SUFFIX_COUNTS = ("num_kv_shared_layers",)  # the last k layers are special
_SEGMENT_COUNTS = (("n_input_layers", "n_recurrent_layers", "n_output_layers"),)  # consecutive segments
_RANGE_STARTS = ("moe_layer_start_index", "loop_layer_index_start")  # first layer of a range
_RANGE_ENDS = {"moe_layer_end_index": True, "loop_layer_index_end": False}  # last layer (inclusive?) of a range
# layer patterns the model reads as a period: layer i is special where i % period == offset (an offset key), or
# where (i + 1) % period == 0 (no offset key). Jamba's periods are superseded by a per-layer list where one spells the
# layer kinds out (Zamba's); the others are read by the modeling code itself.
_PERIODS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"),
            ("moe_layer_interval", None), ("decoder_sparse_step", None))
# lists of layer indices (0-based unless named in _ONE_BASED)
_LAYER_INDEX_LIST = re.compile(r"(layers|_idxs|_indexes|_indices|_layer_ids)$")
_ONE_BASED = frozenset({"ple_layer_ids"})
# layer kinds given as a pattern repeated over the layers (layer i is of kind pattern[i % len(pattern)])
_CYCLIC = frozenset({"block_types"})
# (heads, head dim, expand) triples of Mamba-2 style mixers: heads * head dim = expand * hidden
_MAMBA_TRIPLES = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                  ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
                  ("mamba_num_heads", "mamba_head_dim", "mamba_expand"))
# (query heads, key/value heads) pairs: MHA and MQA stay what they are
_KV_PAIRS = (("num_attention_heads", "num_key_value_heads"), ("num_attention_heads", "num_kv_heads"),
             ("n_heads", "n_kv_heads"), ("n_head", "n_kv_heads"), ("num_attention_heads", "multi_query_group_num"),
             ("num_attention_heads", "num_query_groups"), ("swa_num_attention_heads", "swa_num_key_value_heads"),
             ("linear_num_value_heads", "linear_num_key_heads"))


class _Fill:
    """A :data:`FAMILY_FIXES` value that fills a field the config leaves unset (``None``, empty or missing), before
    the generic rules (so it is given at full size), and keeps a value the config sets: the class defaults of some
    families cannot build a model, a user's config can. A callable is called with the original config dict."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"_Fill({self.value!r})"


def _layers(d: dict[str, Any]) -> int:
    return next(int(d[k]) for k in _LAYER_KEYS if isinstance(d.get(k), int))


def _tiles(d: dict[str, Any]) -> int:
    """A patch size that cuts a tiny image into 4 x 4 patches (a 2 x 2 pixel shuffle then leaves 4 tokens)."""
    return max(1, d["vision_config"]["image_size"] // 4)


#: model type -> config fields set after the generic rules, for families whose sizes are tied in ways the rules
#: cannot see, or whose class defaults cannot build a model. A dotted key reaches into a sub-config; a callable value
#: is called with the tiny config dict; a ``_Fill`` value only fills a field the config leaves unset (before the rules).
FAMILY_FIXES: dict[str, dict[str, Any]] = {
    # defaults leave rope_parameters empty although every layer type looks its own entry up
    "cohere_compass_text": {"rope_parameters": _Fill({"full_attention": {"rope_type": "default",
                                                                        "rope_theta": 10000.0}})},
    # defaults' attention sub-config has no rope_theta, which the attention layers read, and no clip_qkv, which
    # they clamp with (DBRX clips at 8)
    "dbrx": {"attn_config.rope_theta": _Fill(10000.0), "attn_config.clip_qkv": _Fill(8.0)},
    # defaults leave num_experts_per_tok None, which the router's top-k reads (DeepSeek-V2: 6)
    "deepseek_v2": {"num_experts_per_tok": _Fill(6)},
    # defaults leave the MoE sizes None although every layer past first_k_dense_replace is sparse (dots.llm1: 128
    # routed experts, 6 per token, 2 shared)
    "dots1": {"n_routed_experts": _Fill(128), "num_experts_per_tok": _Fill(6), "n_shared_experts": _Fill(2)},
    # defaults leave layer_types None, which the model indexes: LFM2-MoE's short-conv / attention hybrid, one
    # attention layer in four (as LFM2-8B-A1B)
    "lfm2_moe": {"layer_types": _Fill(lambda d: ["full_attention" if i % 4 == 2 else "conv"
                                                 for i in range(_layers(d))])},
    # defaults leave num_key_value_heads None, which the attention divides by
    "nemotron": {"num_key_value_heads": _Fill(8)},
    # defaults switch the QSA indexer on (indexed_attention layers) but leave its sizes None; the indexer needs one
    # key head and a budget that is a whole number of compressed blocks
    "qwen4_exp_text": {"indexer_n_heads": _Fill(8), "indexer_kv_heads": _Fill(1), "indexer_head_dim": _Fill(128),
                       "indexer_budget": _Fill(2048), "indexer_compress_ratio": _Fill(4)},
    # the causal-LM class asserts is_decoder; axial position embeddings must cover max_position_embeddings
    # (16 x 16); a length that is not a multiple of the chunk lengths is padded, and that padding breaks on
    # position_ids (a transformers bug), so chunks are of one token
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "local_attn_chunk_length": 1,
                 "lsh_attn_chunk_length": 1},
    # image geometry: the tokens an image becomes must be what its tower makes of the tiny image (Gemma3: patches
    # pooled to mm_tokens_per_image; Idefics: 4 x 4 patches, pixel-shuffled; LLaVA-NeXT: a resolution of whole tiles)
    "gemma3": {"mm_tokens_per_image": lambda d: (d["vision_config"]["image_size"]
                                                 // d["vision_config"]["patch_size"]) ** 2},
    "shieldgemma2": {"mm_tokens_per_image": lambda d: (d["vision_config"]["image_size"]
                                                       // d["vision_config"]["patch_size"]) ** 2},
    "idefics2": {"vision_config.patch_size": _tiles},
    "idefics3": {"vision_config.patch_size": _tiles},
    "smolvlm": {"vision_config.patch_size": _tiles},
    # Granite Docling shuffles by its tower's scale_factor (4): 8 x 8 patches, 2 x 2 tokens
    "granite_docling": {"vision_config.patch_size": lambda d: max(1, d["vision_config"]["image_size"]
                                                                 // (2 * d["vision_config"]["scale_factor"]))},
    "llava_next": {"image_grid_pinpoints": lambda d: [[2 * d["vision_config"]["image_size"]] * 2]},
    "llava_next_video": {"image_grid_pinpoints": lambda d: [[2 * d["vision_config"]["image_size"]] * 2]},
    "llava_onevision": {"image_grid_pinpoints": lambda d: [[2 * d["vision_config"]["image_size"]] * 2]},
    # Janus's aligner turns each patch into one token embedding; its class defaults make it half the language model's
    # width (so every two patches would become one token): tied as the checkpoints tie it
    "janus": {"vision_config.projection_dim": lambda d: d["text_config"]["hidden_size"]},
    # the input language must be known: the first configured one
    "xmod": {"default_language": _Fill(lambda d: next(iter(d.get("languages") or ["en_XX"])))},
    # the hierarchical stacks repeat their layers H_cycles * (L_cycles + 1) times, stored as num_hidden_layers
    "hrm_text": {"num_layers_per_stack": 1,
                 "num_hidden_layers": lambda d: d["H_cycles"] * (d["L_cycles"] + 1)},
    # the compact attention spec must describe the kept attention_layers
    "gpt_neo": {"attention_types": lambda d: [[list(d["attention_layers"]), 1]]},
    # attention-residual blocks of n layers: two blocks over the kept layers (and the looped range made of blocks)
    "inkling2_text": {"n_layers_per_attn_res_block": lambda d: max(1, d["num_hidden_layers"] // 2)},
    "inkling2_loop_text": {"n_layers_per_attn_res_block": lambda d: math.gcd(d["loop_layer_index_start"],
                                                                             d["loop_layer_index_end"])},
}
FAMILY_FIXES["qwen4_exp"] = {f"text_config.{k}": v for k, v in FAMILY_FIXES["qwen4_exp_text"].items()}

#: model type -> (layers kept per layer kind, consecutive layers that form one unit of selection), default (1, 1):
#: Zamba ties one shared transformer block across its hybrid layers, and the tie needs two of them; Dory's config
#: lists each decoder layer as an attention block followed by an MLP block
_LAYOUT: dict[str, tuple[int, int]] = {"zamba": (2, 1), "dory": (1, 2)}

#: model type -> why its causal-LM class cannot be built, or run on input ids alone, here (refused, not swept)
UNBUILDABLE: dict[str, str] = {
    "gemma4_assistant": "Gemma4AssistantForCausalLM builds but cannot run on its own: it drafts from its target "
                        "model's shared key/value states (forward requires inputs_embeds and shared_kv_states)",
    "gemma4_unified_assistant": "Gemma4UnifiedAssistantForCausalLM builds but cannot run on its own: it drafts from "
                                "its target model's shared key/value states (forward requires inputs_embeds and "
                                "shared_kv_states)",
    "gemma3n": "Gemma3nForConditionalGeneration needs the timm package (its vision tower is a TimmWrapperModel), "
               "which is not installed",
    "musicgen": "MusicgenForCausalLM is the audio-code decoder alone and needs a MusicgenDecoderConfig "
                "(model type musicgen_decoder); the musicgen config is the text-encoder / audio-encoder / decoder "
                "composite, which it cannot read",
    "musicgen_melody": "MusicgenMelodyForCausalLM is the audio-code decoder alone and needs a "
                       "MusicgenMelodyDecoderConfig (model type musicgen_melody_decoder); the musicgen_melody config "
                       "is the text-encoder / audio-encoder / decoder composite, which it cannot read",
}

# constructor arguments for config classes whose defaults do not even construct
_DEFAULT_ARGS: dict[str, dict[str, Any]] = {
    # Gemma 4's class defaults carry no vision tower and causal images, where every Gemma 4 checkpoint has a tower
    # and images that attend both ways within their block: the model users load is the one to prove
    "gemma4": {"vision_config": {}, "text_config": {"use_bidirectional_attention": "vision"}},
    # the assistant drafts for a Gemma 4 model with all layers sharing the target's KV cache, no per-layer inputs
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                                         "enable_moe_block": False, "use_double_wide_mlp": False}},
}


def default_config(model_type: str) -> Any:
    """The default config of ``model_type`` (its config class with no arguments), or, where those defaults do not
    construct (a transformers bug) or leave out what every checkpoint of the type has (Gemma 4's vision tower), the
    smallest change that does."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    args = copy.deepcopy(_DEFAULT_ARGS.get(model_type, {}))
    return config_class(**args)


class _Context:
    """Sizes seen anywhere in the original config tree: a width equal to one of its hidden sizes is a hidden size."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.hidden: set[int] = set()
        self.special: dict[int, int] = {}  # an out-of-vocabulary special token id -> its id at the vocabulary's top
        self._collect(d)

    def special_id(self, value: int) -> int:
        """A distinct id at the top of the tiny vocabulary for each distinct special token (image, video, their
        markers: one id for all would make every marker an image token)."""
        return self.special.setdefault(value, VOCAB - 1 - len(self.special))

    def _collect(self, d: dict[str, Any]) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                self._collect(value)
            elif key in _HIDDEN_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > HIDDEN:
                self.hidden.add(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink_value(key: str, value: Any, ctx: _Context) -> Any:
    if value is None and key in _NONE_TO_SIZE:
        return _FIXED[key]
    if key in _KEEP or _KEEP_LIKE.search(key) or not _is_int(value):
        return value
    if key in _FIXED:
        return _FIXED[key]
    if key in _AT_MOST:
        return min(value, _AT_MOST[key]) if value > 0 else value
    if key in _TOKEN_IDS or key.endswith("token_id") or key.endswith("token_index"):
        return value if 0 <= value < VOCAB else _TOKEN_IDS.get(key) if key in _TOKEN_IDS else ctx.special_id(value)
    if "vocab" in key:
        return min(value, VOCAB)
    if _COUNT_LIKE.search(key) and value > 4:
        return 4
    if key.endswith("head_dim") and value > HEAD_DIM:
        return HEAD_DIM
    if _WIDTH_LIKE.search(key) and value > HIDDEN:
        return HIDDEN if value in ctx.hidden else 32
    return value


def _first(d: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    return next((d[k] for k in keys if _is_int(d.get(k))), None)


_HEADS_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads")


def _head_dim(d: dict[str, Any]) -> int | None:
    """The attention head dim of a config dict: ``head_dim``, or hidden size over query heads."""
    if _is_int(d.get("head_dim")):
        return d["head_dim"]
    hidden, heads = _first(d, _HIDDEN_KEYS), _first(d, _HEADS_KEYS)
    return hidden // heads if hidden and heads else None


def _ratio(a: Any, b: Any) -> int | None:
    """``a / b`` when it is a whole number from 1 to 4."""
    if _is_int(a) and _is_int(b) and b > 0 and a % b == 0 and 1 <= a // b <= 4:
        return a // b
    return None


def _tie(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Keep the relations between sizes that the original holds and a model relies on."""
    for heads, kv in _KV_PAIRS:
        if _is_int(d.get(kv)) and _is_int(out.get(heads)):
            if d[kv] == d.get(heads):
                out[kv] = out[heads]  # MHA stays MHA (MLA, dots3: key/value heads must match)
            elif d[kv] == 1:
                out[kv] = 1  # MQA stays MQA
    for kv in ("kv_n_heads",):  # a sub-config that holds the key/value heads only
        if d.get(kv) == 1:
            out[kv] = 1
    head_dim = d.get("head_dim")
    if _is_int(d.get("qk_rope_head_dim")) and head_dim == d["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA: the rope head dim is the config's head_dim
    for whole in ("qk_head_dim", "head_dim"):  # MLA query/key head: nope part + rope part
        if all(_is_int(d.get(k)) for k in (whole, "qk_nope_head_dim", "qk_rope_head_dim")) and (
                d[whole] == d["qk_nope_head_dim"] + d["qk_rope_head_dim"]):
            out[whole] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    head_dim, new_head_dim = _head_dim(d), _head_dim(out) or HIDDEN // HEADS
    for key, value in d.items():
        if key == "head_dim" or not _is_int(value) or not _is_int(head_dim):
            continue
        if key.endswith("head_dim") and key not in _FIXED and value == head_dim:
            out[key] = new_head_dim  # swa_head_dim, global_head_dim, ... equal to head_dim stay equal
        elif key == "query_pre_attn_scalar" and value == head_dim:
            out[key] = new_head_dim
        elif key == "rotary_dim" and 0 < value <= head_dim:  # partial rotary: keep the fraction, even, >= 2
            out[key] = max(2, new_head_dim * value // head_dim // 2 * 2)
    hidden = d.get("hidden_size")
    if (k := _ratio(d.get("attention_hidden_size"), hidden)) is not None:
        out["attention_hidden_size"] = k * out["hidden_size"]  # Zamba attends over [hidden, embeddings]
        if _is_int(d.get("attention_head_dim")) and d["attention_head_dim"] * d.get("num_attention_heads", 0) == d[
                "attention_hidden_size"]:
            out["attention_head_dim"] = out["attention_hidden_size"] // out["num_attention_heads"]
    for heads, dim, expand in _MAMBA_TRIPLES:
        if all(_is_int(d.get(k)) for k in (heads, dim, expand)) and _is_int(hidden) and (
                d[heads] * d[dim] == d[expand] * hidden):
            width = d[expand] * out["hidden_size"]
            out[heads] = max(1, width // out[dim])
            for groups in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
                if _is_int(out.get(groups)) and out[heads] % out[groups]:
                    out[groups] = math.gcd(out[heads], out[groups])
    if _is_int(d.get("mamba_d_ssm")):  # Falcon-H1: the SSM width is heads x head dim
        for heads, dim, _expand in _MAMBA_TRIPLES:
            if _is_int(d.get(heads)) and _is_int(d.get(dim)) and d["mamba_d_ssm"] == d[heads] * d[dim]:
                out["mamba_d_ssm"] = out[heads] * out[dim]
    if _is_int(d.get("original_max_position_embeddings")) and _is_int(d.get("max_position_embeddings")):
        out["original_max_position_embeddings"] = _original_positions(
            d["original_max_position_embeddings"], d["max_position_embeddings"], out["max_position_embeddings"])


def _original_positions(original: int, maximum: int, new_maximum: int) -> int:
    """``original_max_position_embeddings`` in the same ratio to the new ``max_position_embeddings``."""
    return max(8, round(new_maximum * original / max(1, maximum)))


@functools.cache
def _code_default_section(model_type: Any) -> list[int] | None:
    """The ``mrope_section`` a model type's rotary embedding falls back to when its config has none (Qwen2-VL's
    ``[16, 24, 24]``: full-size, so a tiny head needs it stated, rescaled), read from its modeling code."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    module = sys.modules.get(CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_"))
    if module is None:
        try:
            module = importlib.import_module(CONFIG_MAPPING[model_type].__module__.replace(".configuration_",
                                                                                             ".modeling_"))
        except Exception:  # no modeling module to read: no fallback
            return None
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    found = re.search(r'get\("mrope_section",\s*\[([0-9,\s]+)\]\)', source)
    return [int(v) for v in found.group(1).split(",") if v.strip()] if found else None


def _shrink_rope(rope: Any, d: dict[str, Any], out: dict[str, Any]) -> Any:
    """Rope parameters (flat, or one dict per layer type) fitted to the new head dim and position range."""
    if not isinstance(rope, dict):
        return rope
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {k: _shrink_rope(v, d, out) for k, v in rope.items()}
    rope = dict(rope)
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    new_head = _head_dim(out) or HIDDEN // HEADS
    new_half = max(1, int(new_head * partial) // 2)
    section = rope.get("mrope_section", _code_default_section(d.get("model_type")) if "vocab_size" in d else None)
    if isinstance(section, list) and section and all(_is_int(s) for s in section) and sum(section) > new_half:
        rope["mrope_section"] = _split(new_half, section)
    for key in ("short_factor", "long_factor"):
        factors = rope.get(key)
        if isinstance(factors, list) and len(factors) > new_half:
            step = len(factors) / new_half
            rope[key] = [factors[int(i * step)] for i in range(new_half)]
    original = rope.get("original_max_position_embeddings")
    maximum = rope.get("max_position_embeddings", d.get("max_position_embeddings"))
    if _is_int(original) and _is_int(maximum) and _is_int(out.get("max_position_embeddings")):
        rope["original_max_position_embeddings"] = _original_positions(original, maximum,
                                                                       out["max_position_embeddings"])
    if _is_int(rope.get("max_position_embeddings")) and _is_int(out.get("max_position_embeddings")):
        rope["max_position_embeddings"] = out["max_position_embeddings"]
    return rope


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders; sums to ``total``)."""
    raw = [total * w / sum(weights) for w in weights]
    parts = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: parts[i] - raw[i])[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _is_sub_config(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _shrink_dict(d: dict[str, Any], ctx: _Context, layout: tuple[int, int] = (1, 1), *,
                 layers: bool = True, forced: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if _is_sub_config(value):
            out[key] = _shrink_dict(value, ctx)
        elif isinstance(value, list) and key.endswith("token_id"):
            out[key] = [v if _is_int(v) and 0 <= v < VOCAB else 2 for v in value]
        elif key == "per_layer_config":
            out[key] = value
        elif key in _AT_MOST_EACH and isinstance(value, dict):
            out[key] = {k: min(v, _AT_MOST_EACH[key]) if _is_int(v) and v > 0 else v for k, v in value.items()}
        else:
            out[key] = _shrink_value(key, value, ctx)
    out.update(forced or {})
    _tie(d, out)
    for key in _ROPE_KEYS:
        if isinstance(d.get(key), dict):
            out[key] = _shrink_rope(d[key], d, out)
    if isinstance(d.get("axial_pos_embds_dim"), list) and _is_int(out.get("hidden_size")):
        out["axial_pos_embds_dim"] = _split(out["hidden_size"], d["axial_pos_embds_dim"])
    if not layers:
        return out
    if isinstance(d.get("per_layer_config"), dict):  # overrides, shrunk in the context of the whole config
        out["per_layer_config"] = {i: _shrink_override(d, out, v, ctx) for i, v in d["per_layer_config"].items()}
    layers_key = next((k for k in _LAYER_KEYS if _is_int(d.get(k))), None)
    if layers_key is not None:
        _shrink_layers(d, out, layers_key, layout)
    return out


def _shrink_override(d: dict[str, Any], out: dict[str, Any], override: Any, ctx: _Context) -> Any:
    """One layer's ``per_layer_config`` entry, shrunk with the whole config around it: a size that differs from
    the config's stays different in the same direction (twice or half the tiny value: Gemma 4's full-attention
    head dim of 512 over 256 becomes 32 over 16), and sizes tied to it follow (Dots 3's sliding head dim, nope plus
    rope)."""
    if not isinstance(override, dict):
        return override
    merged = {k: v for k, v in {**d, **override}.items() if k != "per_layer_config"}
    whole = _shrink_dict(merged, ctx, layers=False)
    forced = {}
    for k, v in override.items():
        if _is_int(v) and _is_int(d.get(k)) and v != d[k] and whole.get(k) == out.get(k) and _is_int(out.get(k)):
            forced[k] = out[k] * 2 if v > d[k] else max(1, out[k] // 2)
    if forced:
        whole = _shrink_dict(merged, ctx, layers=False, forced=forced)
    return {k: v for k, v in whole.items() if v != out.get(k)}


def _shrink_layers(d: dict[str, Any], out: dict[str, Any], layers_key: str, layout: tuple[int, int]) -> None:
    """Keep one layer per distinct layer kind and remap everything indexed by layer."""
    n = int(d[layers_key])
    attrs: list[list[Any]] = [[] for _ in range(n)]

    def add(values: list[Any]) -> None:
        for i in range(n):
            attrs[i].append(values[i])

    index_lists: dict[str, list[int]] = {}
    per_layer: dict[str, list[Any]] = {}
    for k, v in d.items():
        if k in _KEEP or k.endswith("token_id") or not isinstance(v, list) or not v:
            continue
        if k in _CYCLIC and 1 < len(v) <= n:
            add([i % len(v) for i in range(n)])  # keep a whole cycle, in order
            continue
        base = 1 if k in _ONE_BASED else 0
        if (_LAYER_INDEX_LIST.search(k) and all(_is_int(x) for x in v) and v == sorted(set(v))
                and base <= v[0] and v[-1] < n + base):
            index_lists[k] = v
            members = {x - base for x in v}
            add([i in members for i in range(n)])
        elif len(v) == n and n > 2:
            per_layer[k] = v
            add([repr(_shrink_value(k.removesuffix("_per_layer"), x, _Context({}))) for x in v])
    plc = d.get("per_layer_config")
    if isinstance(plc, dict):
        overrides = {int(i): repr(v) for i, v in out["per_layer_config"].items() if v}
        add([overrides.get(i) for i in range(n)])
    counts = {k: d[k] for k in (*_PREFIX_COUNTS, *_SUFFIX_COUNTS, *_RANGE_STARTS, *_RANGE_ENDS) if _is_int(d.get(k))}
    for k, c in counts.items():
        if k in _PREFIX_COUNTS:
            add([i < c for i in range(n)])
        elif k in _SUFFIX_COUNTS:
            add([i >= n - c for i in range(n)])
        elif k in _RANGE_STARTS and c >= 0:
            add([i >= c for i in range(n)])
        elif k in _RANGE_ENDS and c >= 0:
            add([i <= c if _RANGE_ENDS[k] else i < c for i in range(n)])
    segments = [s for s in _SEGMENT_COUNTS if all(_is_int(d.get(k)) for k in s) and sum(d[k] for k in s) == n]
    for seg in segments:
        bounds = [sum(d[k] for k in seg[: j + 1]) for j in range(len(seg))]
        add([next(j for j, b in enumerate(bounds) if i < b) for i in range(n)])
    spelled_out = any(isinstance(x, str) for v in per_layer.values() for x in v)
    periods = [(period, offset, d[period], d[offset] if offset else d[period] - 1) for period, offset in _PERIODS
               if _is_int(d.get(period)) and d[period] > 1 and (offset is None or _is_int(d.get(offset)))
               and not (offset and spelled_out)]
    base = [tuple(repr(a) for a in row) for row in attrs]
    for _period, _offset, p, o in periods:
        add([i % p == o for i in range(n)])

    per_kind, group = layout
    if n % group:
        group = 1
    # a unit is `group` consecutive layers (Dory stores each layer as an attention block and an MLP block)
    keys = [tuple(repr(a) for row in attrs[u * group: (u + 1) * group] for a in row) for u in range(n // group)]
    chosen: list[int] = []
    for u, key in enumerate(keys):
        if sum(keys[j] == key for j in chosen) < per_kind:
            chosen.append(u)
    for u in range(len(keys)):
        if len(chosen) * group >= min(2, n):
            break
        if u not in chosen:
            chosen.append(u)
    chosen.sort()
    units = list(range(chosen[-1] + 1))[:MAX_PREFIX_LAYERS] if periods else chosen[:MAX_LAYERS]
    refit = _refit_periods(base, periods, n) if periods and group == 1 else None
    if refit is not None and len(refit[0]) < len(units):
        units = refit[0]
        for (period, offset, _p, _o), (p, o) in zip(periods, refit[1], strict=True):
            out[period] = p
            if offset:
                out[offset] = o
    keep = [u * group + j for u in units for j in range(group)]
    where = {old: new for new, old in enumerate(keep)}

    out[layers_key] = len(keep)
    for k, v in d.items():  # other layer counts equal to this one (xlstm's num_blocks) follow it
        if k != layers_key and k in _LAYER_KEYS and v == n:
            out[k] = len(keep)
    for k, v in per_layer.items():
        out[k] = [_shrink_value(k.removesuffix("_per_layer"), v[i], _Context({})) for i in keep]
    for k, v in index_lists.items():
        base = 1 if k in _ONE_BASED else 0
        out[k] = [where[x - base] + base for x in v if x - base in where]
    if isinstance(plc, dict):
        out["per_layer_config"] = {str(where[int(i)]): v for i, v in out["per_layer_config"].items()
                                   if int(i) in where and v}
    for k, c in counts.items():
        if k in _PREFIX_COUNTS:
            out[k] = sum(i < c for i in keep)
        elif k in _SUFFIX_COUNTS:
            out[k] = sum(i >= n - c for i in keep)
        elif k in _RANGE_STARTS and c >= 0:
            out[k] = sum(i < c for i in keep)
        elif k in _RANGE_ENDS and c >= 0:
            out[k] = sum(i <= c for i in keep) - 1 if _RANGE_ENDS[k] else sum(i < c for i in keep)
    for seg in segments:
        start = 0
        for k in seg:
            out[k] = sum(start <= i < start + d[k] for i in keep)
            start += d[k]


def _refit_periods(base: list[tuple[str, ...]], periods: list[tuple[str, Any, int, int]],
                   n: int) -> tuple[list[int], tuple[tuple[int, int], ...]] | None:
    """The fewest layers (in order), and new (period, offset) pairs, that show every layer kind of the original:
    Jamba's attention every 8 layers from layer 4 and experts every 2 from layer 1 become 3 layers, attention every
    8 from layer 0. A period without an offset key keeps its offset at period - 1. None where there are many
    periods or no fit within :data:`MAX_LAYERS`."""
    if len(periods) > 2:
        return None
    target = {(base[i], tuple(i % p == o for *_, p, o in periods)) for i in range(n)}
    kinds = sorted(set(base))
    following = [{b: next((i for i in range(start, n) if base[i] == b), None) for b in kinds} for start in range(n + 1)]
    candidates = [[(q, r) for q in range(p, 0, -1) for r in (range(q) if offset else [q - 1])]
                  for _, offset, p, _o in periods]

    def fit(length: int, combo: tuple[tuple[int, int], ...]) -> list[int] | None:
        @functools.cache
        def search(j: int, after: int, covered: frozenset) -> tuple[int, ...] | None:
            if len(target - covered) > length - j:
                return None
            if j == length:
                return ()
            phase = tuple(j % q == r for q, r in combo)
            for b in kinds:
                i = following[after][b]
                if i is not None and (b, phase) in target:
                    rest = search(j + 1, i + 1, covered | {(b, phase)})
                    if rest is not None:
                        return (i, *rest)
            return None

        found = search(0, 0, frozenset())
        return list(found) if found is not None else None

    for length in range(max(2, len(target)), min(n, MAX_LAYERS) + 1):
        for combo in itertools.product(*candidates):
            keep = fit(length, combo)
            if keep is not None:
                return keep, combo
    return None


def _other_layer_counts(d: dict[str, Any], out: dict[str, Any]) -> None:
    """Layer counts that are not the config's own depth (encoders, towers): at most 2."""
    main = next((k for k in _LAYER_KEYS if _is_int(d.get(k))), None)
    skip = {main, *_PREFIX_COUNTS, *_SUFFIX_COUNTS, *(k for s in _SEGMENT_COUNTS for k in s), *(p for p, _ in _PERIODS)}
    for k, v in d.items():
        if k in skip or k in _KEEP or _KEEP_LIKE.search(k) or not _is_int(v) or v <= 2:
            continue
        if _OTHER_LAYER_COUNT.search(k) and out.get(k) == v:
            out[k] = 2


def _tie_image_geometry(tiny: dict[str, Any], original: dict[str, Any]) -> None:
    """The sizes a vision tower shares with the rest of the model, made to agree again once shrunk: its output width
    is the language model's (the features replace token embeddings) — or, where the outer config holds the merged
    features' width (MuseGlimmer: the tower's width times its merged patches), the same multiple of the tower's —,
    and a window counted in pixels (Qwen2.5-VL's ``window_size``) spans whole merged patches."""
    vision, text = tiny.get("vision_config"), tiny.get("text_config")
    if not isinstance(vision, dict):
        return
    if isinstance(text, dict) and _is_int(vision.get("out_hidden_size")) and _is_int(text.get("hidden_size")):
        vision["out_hidden_size"] = text["hidden_size"]
    # a projector built from features of several tower layers (VipLlava: -2, -5, -8, -11, 6 of 24) reads layers the
    # shrunk tower still has: each index clamped into its hidden states (embeddings + every layer)
    depth = vision.get("num_hidden_layers")
    for key in ("vision_feature_layer", "vision_feature_layers"):
        value = tiny.get(key)
        if _is_int(depth) and isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
            tiny[key] = [max(-depth - 1, min(depth, v)) for v in value]
    wide, narrow = original.get("out_hidden_size"), (original.get("vision_config") or {}).get("hidden_size")
    if _is_int(tiny.get("out_hidden_size")) and _is_int(wide) and _is_int(narrow) and wide % narrow == 0 and \
            _is_int(vision.get("hidden_size")):
        tiny["out_hidden_size"] = vision["hidden_size"] * (wide // narrow)
    if all(_is_int(vision.get(k)) for k in ("window_size", "patch_size", "spatial_merge_size")):
        vision["window_size"] = vision["patch_size"] * vision["spatial_merge_size"] * 2


def _apply_fixes(d: dict[str, Any], fixes: dict[str, Any], fills: bool) -> None:
    """Set the fixes of one family in ``d``: the ``_Fill`` ones (``fills``) or the others."""
    for path, value in fixes.items():
        if isinstance(value, _Fill) != fills:
            continue
        *parents, key = path.split(".")
        target = d
        for p in parents:
            target = target.setdefault(p, {})
        if isinstance(value, _Fill):
            if target.get(key) not in (None, {}, []):
                continue
            value = value.value
        target[key] = value(d) if callable(value) else value


def _walk_other_counts(d: dict[str, Any], out: dict[str, Any]) -> None:
    _other_layer_counts(d, out)
    for k, v in d.items():
        if _is_sub_config(v) and isinstance(out.get(k), dict):
            _walk_other_counts(v, out[k])


def shrink_config(config: Any, **overrides: Any) -> Any:
    """A tiny copy of ``config`` (a transformers ``PretrainedConfig``): every feature kept, every size shrunk
    (see the module docstring); ``overrides`` are applied last. The original is not modified."""
    d = copy.deepcopy(config.to_dict())
    for key in ("architectures", "_name_or_path", "transformers_version"):
        d.pop(key, None)
    model_type = str(getattr(config, "model_type", ""))
    fixes = FAMILY_FIXES.get(model_type, {})
    _apply_fixes(d, fixes, fills=True)
    tiny = _shrink_dict(d, _Context(d), _LAYOUT.get(model_type, (1, 1)))
    _walk_other_counts(d, tiny)
    _tie_image_geometry(tiny, d)
    _apply_fixes(tiny, fixes, fills=False)
    tiny.update(overrides)
    new = type(config).from_dict(tiny)
    attn = getattr(config, "_attn_implementation_internal", None)
    if attn is not None:
        new._attn_implementation_internal = attn
    return new

