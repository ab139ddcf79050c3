"""The Hugging Face model inside the wrappers that training puts around it.

A trainer hands padfree its model wrapped — PEFT's ``PeftModel``, DDP / FSDP / DeepSpeed engines (``.module``),
``torch.compile`` (``._orig_mod``), several of them nested — while the packing state, the config and the output
head live on the transformers model inside. :func:`unwrap_model` peels the wrappers off; :func:`transformers_model`
does the same for the model entry points and refuses, naming the argument, anything with no transformers model
inside. FSDP2 (``fully_shard``) wraps nothing: it changes the class of the model itself, which stays a
``PreTrainedModel``.

What a PEFT adapter does to packing depends on its kind. An adapter on a layer that works token by token (LoRA,
DoRA, IA³, ... on a ``Linear`` or an ``Embedding``; ``modules_to_save`` copies, which the scan treats as the modules
they copy) adds a function of each token's own input, so a packed row stays exact wherever the layer was.
A prompt-learning adapter (prefix / prompt tuning, P-tuning) prepends virtual tokens or a prefix cache to every
sequence, which a row of several sequences cannot hold (:func:`prompt_learning_adapter`), and an adapter on a
convolution over the sequence runs beside the convolution padfree makes boundary-exact (:func:`adapter_problems`):
both are refused. ``modules_to_save`` deep-copies a module with its config: a copied attention layer would keep
the base attention implementation, so its config follows the model's (:func:`follow_copied_configs`).

>>> import torch
>>> from padfree.proof.tiny import tiny_model
>>> model = tiny_model("llama")
>>> unwrap_model(torch.compile(model)) is model
True
>>> transformers_model("llama")
Traceback (most recent call last):
...
padfree.errors.UnsupportedModelError: model must be a transformers PreTrainedModel (a causal LM such as \
LlamaForCausalLM), bare or inside PEFT (PeftModel), DDP / FSDP / DeepSpeed (.module) or torch.compile wrappers; \
got 'llama' (type str)
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from padfree.errors import UnsupportedModelError, describe

__all__ = [
    "adapter_problems",
    "chain_names",
    "follow_copied_configs",
    "packable_model",
    "prompt_learning_adapter",
    "restore_copied_configs",
    "transformers_model",
    "unwrap_model",
]

#: marks a module holding its own copy of the model's config, which :func:`follow_copied_configs` switched with the
#: model and :func:`restore_copied_configs` switches back with it
COPIED_CONFIG_ATTR = "_padfree_copied_config"

_CONVS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_MAX_DEPTH = 8  # wrappers nest a few levels at most; the bound keeps a self-referencing wrapper from looping


def wrapper_chain(model: Any) -> list[Any]:
    """``[model, the model it wraps, ..., the innermost model]``: ``torch.compile`` (``._orig_mod``), PEFT
    (``get_base_model()``) and DDP / FSDP / DeepSpeed (``.module``) wrappers peeled one at a time; ``[model]`` when
    it wears none."""
    chain = [model]
    for _ in range(_MAX_DEPTH):
        # torch.compile's wrapper first: it hands every other attribute (get_base_model, module) to the model it
        # compiled, which would skip that model's own place in the chain
        if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            inner = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            inner = model.module
        else:
            break
        if inner is model:
            break
        model = inner
        chain.append(model)
    return chain


def unwrap_model(model: Any) -> Any:
    """The model inside PEFT (``get_base_model()``), DDP / FSDP / DeepSpeed (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, peeled in any nesting (:func:`wrapper_chain`); ``model`` itself when it wears none.

    Args:
        model: a ``torch.nn.Module``, wrapped or not (anything else comes back as it is).
    """
    return wrapper_chain(model)[-1]


def transformers_model(model: Any, argument: str = "model") -> Any:
    """The transformers ``PreTrainedModel`` inside ``model`` (:func:`unwrap_model`), for the entry points that
    configure, undo or check packing on it.

    Args:
        model: a ``PreTrainedModel``, bare or wrapped.
        argument: the name the caller's users know ``model`` by, for the error.

    Raises:
        UnsupportedModelError: ``model`` is not a ``PreTrainedModel`` and wraps none (a string, None, a plain
            ``torch.nn.Module``, ...); the message names ``argument``, the value and what is accepted.
    """
    from transformers import PreTrainedModel

    inner = unwrap_model(model)
    if isinstance(inner, PreTrainedModel):
        return inner
    inside = f", which wraps {_one_line(inner)}" if inner is not model else ""
    raise UnsupportedModelError(
        f"{argument} must be a transformers PreTrainedModel (a causal LM such as LlamaForCausalLM), bare or inside "
        f"PEFT (PeftModel), DDP / FSDP / DeepSpeed (.module) or torch.compile wrappers; got "
        f"{_one_line(model)}{inside}")


def packable_model(model: Any, caller: str) -> Any:
    """:func:`transformers_model`, refusing a prompt-learning adapter (:func:`prompt_learning_adapter`) whatever the
    caller's options: nothing can make a packed row of its virtual tokens exact.

    Raises:
        UnsupportedModelError: no transformers model inside ``model``, or a prompt-learning adapter on it; the
            message starts with ``caller``.
    """
    inner = transformers_model(model, "model")
    prompt = prompt_learning_adapter(model)
    if prompt is not None:
        raise UnsupportedModelError(
            f"{caller}: {chain_names(model)} has a prompt-learning PEFT adapter ({prompt}), whose virtual tokens are "
            f"prepended to every sequence and cannot be placed in a packed row of several sequences; train it "
            f"unpacked, or use an adapter on the layers (LoRA, DoRA, IA3, modules_to_save)")
    return inner


def chain_names(model: Any) -> str:
    """``model``'s wrappers and the model inside, outermost first: ``"OptimizedModule > PeftModelForCausalLM >
    LlamaForCausalLM"``."""
    return " > ".join(type(m).__name__ for m in wrapper_chain(model))


def _one_line(value: Any) -> str:
    """:func:`describe` on one line (a module's repr spans many)."""
    return " ".join(describe(value, 40).split())


def prompt_learning_adapter(model: Any) -> str | None:
    """The prompt-learning PEFT adapter (prefix tuning, prompt tuning, P-tuning) that ``model`` or a wrapper inside
    it carries, as ``"PREFIX_TUNING adapter 'default'"``; None when there is none.

    Such an adapter prepends virtual tokens (or a prefix cache) to every sequence of a batch: in a packed row of
    several sequences they would sit before the first sequence only, so no packed forward of it can be exact.
    """
    for layer in wrapper_chain(model):
        configs = getattr(layer, "peft_config", None)
        if not isinstance(configs, dict):
            continue
        for name, config in configs.items():
            if getattr(config, "is_prompt_learning", False):
                kind = getattr(config, "peft_type", None)
                return f"{getattr(kind, 'value', kind) or type(config).__name__} adapter {name!r}"
    return None


def adapter_problems(model: torch.nn.Module) -> dict[str, str]:
    """Qualified name -> why, for every PEFT adapter layer of ``model`` that a packed row cannot run exactly.

    An adapter layer (peft's ``BaseTunerLayer``: LoRA, DoRA, LoHa, IA³, ``target_parameters``, ...) wraps a base
    layer and changes what it computes from its input. On a layer that works token by token (``Linear``,
    ``Embedding``, a norm, an MoE expert bank) the result stays a function of each token alone. On a convolution
    with a kernel longer than one token it is a convolution over the sequence that padfree's boundary-resetting
    primitive does not run (that primitive reads the base layer's weight), so it is refused.
    """
    peft = sys.modules.get("peft")  # adapters exist only once peft is imported: no import for a model without any
    if peft is None:
        return {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    problems: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if any(name.startswith(seen + ".") for seen in problems):
            continue
        base = module.get_base_layer()
        adapter = f"{type(module).__module__}.{type(module).__name__}"
        if isinstance(base, _CONVS) and any(k > 1 for k in base.kernel_size):
            problems[name] = (
                f"a PEFT adapter ({adapter}) on a convolution over the sequence ({type(base).__name__}, kernel "
                f"{tuple(base.kernel_size)}) is a second convolution across the tokens, which padfree's "
                f"boundary-exact convolution does not run: in a packed row it would read the previous sequence; "
                f"adapt the layers that work token by token (the Linear projections), not the convolution")
    return problems


def _configs(config: Any) -> list[Any]:
    """``config`` and every sub-config under it (a multimodal model's text / vision configs, ...)."""
    found = [config]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "sub_configs"):
            found += _configs(sub)
    return found


def follow_copied_configs(model: Any, attention_modules: list[str]) -> dict[str, str]:
    """Switch the attention modules of ``model`` that hold a *copy* of its config to the implementation the model's
    own config now has; qualified name -> why for a copy that cannot follow.

    transformers picks an attention module's function from ``self.config._attn_implementation``, and every module
    normally shares the model's config, which ``configure_packing`` switches to padfree's backend. A module
    deep-copied after the model was built — PEFT's ``modules_to_save`` copy of an attention (or decoder) layer —
    holds a config of its own, which would keep the base backend: plain SDPA over the whole packed row, every
    sequence attending to the ones before it. Each such copy takes the implementation of the model's config of
    its class (its sub-configs untouched) and is marked, so that :func:`restore_copied_configs` makes it follow
    the model's config again when packing is undone.

    Args:
        model: the transformers model, configured.
        attention_modules: qualified names of its attention modules (``PackingReport.attention_modules``).
    """
    problems: dict[str, str] = {}
    for name in attention_modules:
        module = model.get_submodule(name)
        if _follow(model, module) is False:
            problems[name] = (f"it holds a {type(module.config).__name__} of its own, not one of the model's "
                              f"configs, so the attention implementation padfree configures would not reach it")
        elif _copied(model, module):  # switched now, or copied from a config switched already
            module.__dict__[COPIED_CONFIG_ATTR] = True
    return problems


def restore_copied_configs(model: torch.nn.Module) -> None:
    """Make every copy :func:`follow_copied_configs` switched follow the model's config again (call it once the
    model's own attention implementation is restored)."""
    for module in model.modules():
        if module.__dict__.pop(COPIED_CONFIG_ATTR, None) is not None:
            _follow(model, module)


def _copied(model: Any, module: torch.nn.Module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and all(config is not c for c in _configs(model.config))


def _follow(model: Any, module: torch.nn.Module) -> bool | None:
    """Give ``module``'s own copy of a config the attention implementation of the model's config of its class: True
    if switched, None if there was nothing to do (no config, the model's own, or the same already), False if the
    model has no config of that class."""
    config = getattr(module, "config", None)
    own = _configs(model.config)
    if config is None or not hasattr(config, "_attn_implementation") or any(config is c for c in own):
        return None
    origin = next((c for c in own if type(c) is type(config)), None)
    if origin is None:
        return False
    if config._attn_implementation == origin._attn_implementation:
        return None
    config._attn_implementation = {"": origin._attn_implementation}  # a dict leaves its sub-configs as they are
    return True
