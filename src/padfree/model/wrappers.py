"""The Hugging Face model inside the wrappers that training puts around it.

A trainer hands padfree its model wrapped — PEFT's ``PeftModel``, DDP / FSDP / DeepSpeed engines (``.module``),
``torch.compile`` (``._orig_mod``), several of them nested — while the packing state, the config and the output
head live on the transformers model inside. :func:`unwrap_model` peels the wrappers off.

>>> import torch
>>> from padfree.model.tiny import tiny_model
>>> model = tiny_model("llama")
>>> unwrap_model(torch.compile(model)) is model
True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_model"]

_MAX_DEPTH = 8  # wrappers nest a few levels at most; the bound keeps a self-referencing wrapper from looping


def unwrap_model(model: Any) -> Any:
    """The model inside PEFT (``get_base_model()``), DDP / FSDP / DeepSpeed (``.module``) and ``torch.compile``
    (``._orig_mod``) wrappers, peeled in any nesting; ``model`` itself when it wears none.

    Args:
        model: a ``torch.nn.Module``, wrapped or not (anything else comes back as it is).
    """
    for _ in range(_MAX_DEPTH):
        if callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            inner = model.module
        elif hasattr(model, "_orig_mod"):
            inner = model._orig_mod
        else:
            return model
        if inner is model:
            return model
        model = inner
    return model
