"""padfree's answer to TRL's fused LM head on a packed row on the CPU: the completion tokens' log-probs, in chunks.

TRL's preference trainers patch the model with a fused LM head (``trl.trainer.utils.add_fused_lm_head``): a call
``model(..., labels=labels, fused_lm_head=True)`` returns a ``FusedCausalLMOutput`` of per-token log-probs (and the
entropies, mean logits and top-1 hits the metrics read) without building the logits. On a device without Triton it
scores *every* position it is given, prompts included, in tiles of up to 4,096 positions against the whole
vocabulary — on a packed row of thousands of tokens, temporaries of ~500 MiB each, remade for every tile of every
call, which makes a long row cost more per token than a short one. :class:`LogProbHead` answers the same call on the
packed row with :func:`padfree.model.log_probs.token_log_probs`: only the positions that have a label reach the
head, a fixed chunk of them at a time (~128 MiB of logits whatever the row's length), and every field is TRL's to
float32 rounding — the same log-probs, entropies, ``log Σ p²``, mean logits and top-1 hits, the same loss, the same
gradients.

It stands in only where it computes exactly what TRL's head computes: the head's weight on the CPU, an ``nn.Linear``
output head whose logits padfree reproduces from its input (verified once per model on a few tokens,
:func:`~padfree.model.loss.verified_head_transform`: Cohere's scale, Granite's scaling, Gemma's soft-cap), no MoE
router loss to add; at the temperature and the head precision TRL's head was patched with (GRPO's ``temperature`` and
``cast_lm_head_to_fp32``). Anywhere else — a GPU, where TRL compacts with its Triton kernels; a LoRA on the head; a
MoE model — TRL's own head runs, and the reason is logged once.

>>> head = LogProbHead(("log_probs", "entropy"))
>>> head.outputs, head.calls
(('log_probs', 'entropy'), 0)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from padfree.errors import BackendUnavailableError, InvalidArgumentError, PadfreeError, describe
from padfree.layout import IGNORE_INDEX
from padfree.model.log_probs import OUTPUTS, token_log_probs
from padfree.model.loss import head_inputs, materialised_head, verified_head_transform
from padfree.packing.inputs import as_flag

try:
    import torch
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as exc:  # pragma: no cover - trl is installed wherever this module is used
    raise BackendUnavailableError("padfree.integrations.fused_head needs trl; pip install 'padfree[trl]'") from exc

__all__ = ["FusedHeadOptions", "LogProbHead", "fused_head_on"]

logger = logging.getLogger("padfree")


@dataclasses.dataclass
class FusedHeadOptions:
    """The option of the trainers whose TRL counterparts score with a fused LM head (DPO, GRPO): a base of their
    configs, before TRL's class.

    Args:
        padfree_fused_head: in a padfree mode, on the CPU, answer TRL's fused LM head with padfree's
            (:class:`LogProbHead`): the same per-token fields, scored for the labelled (completion) tokens only in
            chunks of fixed size, where TRL's scores every position of the row in tiles of up to 4,096 positions.
            False: TRL's head everywhere. No effect on a GPU (TRL's head runs there).
    """

    padfree_fused_head: bool = dataclasses.field(
        default=True, metadata={"help": "On the CPU, score the packed rows' completion tokens with padfree's "
                                        "per-token head instead of TRL's fused head (same values, in chunks)."})


def fused_head_on(args: Any) -> bool:
    """A trainer config's ``padfree_fused_head`` (True where the config has none), checked to be a bool."""
    return as_flag(getattr(args, "padfree_fused_head", True), "padfree_fused_head")


class LogProbHead:
    """Answers a packed call ``model(..., labels=..., fused_lm_head=True)`` as TRL's fused head would, on the CPU.

    Called by :func:`padfree.integrations.unpadded.unpadded_forwards` (its ``heads``) with the unwrapped model and
    the packed row's keyword arguments: ``input_ids`` / ``position_ids`` ``(1, T)``, ``labels`` ``(1, T)`` (or
    ``shift_labels``), ``fused_lm_head=True``, ``num_items_in_batch`` and whatever else the model takes. Returns a
    ``FusedCausalLMOutput`` whose per-token fields are ``(1, T - 1)`` (``(1, T)`` with ``shift_labels``), zero where
    the label is ``-100``.

    Args:
        outputs: the per-token fields to compute besides ``log_probs``, among
            :data:`padfree.model.log_probs.OUTPUTS` — those TRL's trainer asked its head for (the others stay None).
        temperature: the logits divided by it, as TRL's head was patched (``add_fused_lm_head(temperature=...)``).
        fp32_head: the head's product in float32 outside autocast (``cast_lm_head_to_fp32=True``).

    Attributes:
        calls: how many calls it answered itself (those it handed to TRL's head are not counted).
    """

    def __init__(self, outputs: tuple[str, ...] = ("log_probs",), temperature: float = 1.0,
                 fp32_head: bool = False) -> None:
        if not isinstance(outputs, tuple) or any(o not in OUTPUTS for o in outputs):
            raise InvalidArgumentError(f"outputs must be a tuple of names among {list(OUTPUTS)}, got "
                                       f"{describe(outputs)}")
        self.outputs = outputs
        self.temperature = temperature
        self.fp32_head = bool(fp32_head)
        self.calls = 0
        self._refusals: dict[int, str | None] = {}

    def refusal(self, model: Any) -> str | None:
        """Why TRL's own head must score ``model`` (None: this head computes what it computes); read once per model.
        """
        key = id(model)
        if key not in self._refusals:
            self._refusals[key] = reason = self._why_not(model)
            name = type(model).__name__
            if reason is None:
                logger.info("padfree: %s's fused LM head on the CPU answered by padfree's per-token head (the "
                            "labelled positions only, in chunks)", name)
            else:
                logger.info("padfree: %s keeps TRL's fused LM head: %s", name, reason)
        return self._refusals[key]

    @staticmethod
    def _why_not(model: Any) -> str | None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
            return "its head is not on the CPU (TRL scores only the labelled positions there, with its kernels)"
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "output_router_logits", False):
            return "a MoE model whose loss adds the router's load-balancing loss"
        try:
            verified_head_transform(model)
        except PadfreeError as exc:
            return str(exc)
        return None

    def __call__(self, model: Any, kwargs: dict[str, Any]) -> Any:
        if (self.refusal(model) is not None or kwargs.get("output_router_logits")  # GRPO asks for a MoE's per call
                or (kwargs.get("labels") is None and kwargs.get("shift_labels") is None)):
            return model(**kwargs)  # back through the model's call: TRL's fused forward scores the packed row
        kwargs = dict(kwargs)
        kwargs.pop("fused_lm_head")
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        with head_inputs(model) as seen:  # the backbone runs, the head is skipped: its input is what we score
            model(**kwargs)
        hidden = seen[0]
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        head = materialised_head(model, hidden)
        scale, softcap = verified_head_transform(model)
        targets = targets.to(head.weight.device)
        # the product in the precision TRL's head computes it in: float32 when cast to it, else autocast's when it is
        # on, else the hidden states'
        if self.fp32_head:
            dtype = torch.float32
        else:
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
        with torch.autocast("cpu", enabled=False):
            fields = token_log_probs(hidden.to(head.weight.device, dtype), head.weight.to(dtype), targets,
                                     bias=None if head.bias is None else head.bias.to(dtype), scale=scale,
                                     softcap=softcap, temperature=self.temperature, outputs=self.outputs)
        self.calls += 1
        mask = targets != IGNORE_INDEX
        log_probs = fields["log_probs"]
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items is None else num_items)
        return FusedCausalLMOutput(loss=loss, label_mask=mask, **fields)
