"""The one builder of tiny random-weight models (:func:`build`), and the configs it builds from.

Every tiny model of padfree — the sweep's, on-the-spot certification's, ``padfree verify --model-type``'s, the test
suite's — is built by :func:`build`: a config, a seed, the class (the causal-LM class of the config's type, or a
vision-language class), ``sdpa`` where the class has it, fp32. Two configs feed it:

- :func:`build_tiny`: a model type's config class defaults shrunk (:func:`padfree.proof.shrink.shrink_config`), in
  eval mode and with every weight offset a little (:func:`padfree.proof.compare.perturb`: no path silenced by a zero
  initialisation) — what the sweep proves;
- :func:`tiny_model`: a hand-made config of :data:`TINY_CONFIGS` (hidden size 64, 4 query heads over 2 key/value
  heads, head dim 16, a vocabulary of 96; sliding windows of 5 tokens, so sequences of 6+ tokens exercise them;
  MoE models with 4 experts, 2 per token; recurrent mixers with 4-tap kernels and chunks of 8, so a few dozen tokens
  cross every code path of the packed formulations), in training mode with its initial weights.

>>> model = tiny_model("llama")
>>> type(model).__name__, model.config.hidden_size, model.dtype, model.training
('LlamaForCausalLM', 64, torch.float32, True)
>>> twin = build_tiny("mamba")  # no SDPA path: built with eager
>>> type(twin).__name__, twin.training
('MambaForCausalLM', False)
>>> "qwen3_5_text" in TINY_CONFIGS and "mamba" in TINY_CONFIGS
True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from padfree.errors import BackendUnavailableError, InvalidArgumentError

__all__ = ["TINY_CONFIGS", "build", "build_tiny", "multimodal_types", "quiet", "tiny_config", "tiny_model"]

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


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers logs only errors and Python warnings are ignored inside: tiny configs trip harmless rope /
    vocabulary warnings."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)


def build(config: Any, *, seed: int = 0, attn_implementation: str | None = None, model_class: Any = None) -> Any:
    """A model of ``config`` with random weights, deterministic for ``seed``, in fp32 (training mode, as built).

    Args:
        config: a transformers config.
        seed: the torch seed the weights are drawn with.
        attn_implementation: the attention implementation to build with; None: ``"sdpa"`` where the class has it,
            else ``"eager"``, else the class's own default.
        model_class: the class to build (a vision-language class, say); None: the causal-LM class of the config's
            model type.

    Raises:
        InvalidArgumentError: the class has no ``attn_implementation`` path
            (:class:`~padfree.errors.BackendUnavailableError` where its package is not installed).

    >>> import transformers
    >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                   num_attention_heads=2, num_key_value_heads=1)
    >>> a, b = build(config, seed=3), build(config, seed=3)
    >>> bool((a.lm_head.weight == b.lm_head.weight).all()), a.config._attn_implementation
    (True, 'sdpa')
    """
    import torch
    import transformers

    tries = (attn_implementation,) if attn_implementation is not None else ("sdpa", "eager", None)
    with quiet():
        for attn in tries:
            kwargs = {} if attn is None else {"attn_implementation": attn}
            torch.manual_seed(seed)  # every try from the same seed: a refused one may have drawn weights
            try:
                if model_class is None:
                    model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
                else:
                    model = model_class._from_config(config, **kwargs)
                break
            except (ValueError, TypeError, ImportError) as exc:
                # a class without this attention path (no SDPA for softcapping, sinks, MegatronBert, Mamba)
                if attn is not tries[-1]:
                    continue
                if attn_implementation is None:
                    raise
                name = getattr(model_class, "__name__", None) or type(config).__name__
                error = BackendUnavailableError if isinstance(exc, ImportError) else InvalidArgumentError
                raise error(f"attn_implementation={attn_implementation!r} cannot build {name} "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); accepted: an attention "
                            f"implementation the class has, or None (sdpa where it has it, else eager)") from exc
    return model.float()


def multimodal_types() -> dict[str, str]:
    """The vision-language types the sweep proves apart from the causal-LM mapping: every image-text-to-text
    (and video-text-to-text) type whose class is not the causal-LM mapping's class of that type — model type ->
    class name. Their entries sit in the support table's ``multimodal`` section."""
    from transformers.models.auto import modeling_auto

    causal = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    found: dict[str, str] = {}
    for name in ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_VIDEO_TEXT_TO_TEXT_MAPPING_NAMES"):
        for model_type, cls in getattr(modeling_auto, name, {}).items():
            if isinstance(cls, str) and causal.get(model_type) != cls:
                found.setdefault(model_type, cls)
    return found


def build_tiny(model_type: str, variant: Mapping[str, Any] | None = None, *, seed: int = 0,
               multimodal: bool = False) -> Any:
    """The tiny fp32 causal LM of ``model_type`` (with ``multimodal``, its vision-language class of
    :func:`multimodal_types`): its config class's defaults shrunk, ``variant`` fields on top, built by :func:`build`
    (``sdpa`` where the class has it, ``eager`` otherwise), in eval mode, every weight offset a little
    (:func:`padfree.proof.compare.perturb`: no path silenced by a zero initialisation)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from padfree.proof.compare import perturb
    from padfree.proof.shrink import default_config, shrink_config

    if model_type not in CONFIG_MAPPING:
        raise InvalidArgumentError(f"model_type={model_type!r} is not a model type of transformers "
                                   f"{transformers.__version__}")
    if multimodal and model_type not in multimodal_types():
        raise InvalidArgumentError(f"model_type={model_type!r} has no vision-language class apart from its causal "
                                   f"LM in transformers {transformers.__version__}")
    with quiet():
        config = shrink_config(default_config(model_type), **dict(variant or {}))
    cls = getattr(transformers, multimodal_types()[model_type]) if multimodal else None
    return perturb(build(config, seed=seed, model_class=cls).eval(), seed=seed)


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
    """A tiny fp32 ``*ForCausalLM`` of ``model_type``'s hand-made config (:func:`tiny_config`, ``overrides``
    applied last) with random weights, deterministic for ``seed``, built by :func:`build` (``attn_implementation``:
    None: sdpa where the class has it, else eager)."""
    return build(tiny_config(model_type, **overrides), seed=seed, attn_implementation=attn_implementation)
