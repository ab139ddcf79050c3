"""padfree for TRL's ``GRPOTrainer``: the log-probs of the policy, the old policy and the reference computed
padding-free.

``padfree.integrations.grpo.GRPOTrainer`` is a drop-in subclass of ``trl.GRPOTrainer`` (same arguments).
Generation, rewards, advantages and every loss type TRL implements are TRL's own, untouched; what changes is the
forward that scores the completions. TRL pads each batch of prompt + completion (prompts on the left, completions
on the right) and runs the model over ``(B, prompt_len + completion_len)`` positions; in ``"padding-free batching"``
the real tokens of each micro-batch run as ONE packed row instead — each sequence its prompt then its completion,
``position_ids`` restarting at 0 per sequence (the positions generation used), no padding, no ``attention_mask`` —
and the per-token log-probs (and entropies) come back in the ``(B, completion_len)`` layout TRL's loss expects
(:func:`padfree.integrations.unpadded.unpadded_forwards`). The policy and the reference model go through
:func:`padfree.configure_packing`, which fails closed: a model it cannot make exact raises
:class:`~padfree.errors.UnsupportedModelError` instead of scoring with attention that crosses sequences.

Modes, from :class:`GRPOConfig`'s ``padding_free``:

- ``None`` (default; also a plain ``trl.GRPOConfig``): on when safe. Skipped, with the reason logged, when
  ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` is set or ``auto_padding_free=False``, when ``processing_class`` is a
  ``ProcessorMixin`` or the model is a vision-language model (or the dataset holds images), or when padfree does
  not support the model (:func:`padfree.integrations.decide.support_reason`).
- ``True``: on, even with the environment opt-out set; refuses what it cannot do exactly (a processor, a VLM, a
  model padfree does not support).
- ``False``: TRL's padded forward, untouched.

``padfree.packing_status(trainer)`` reports the mode and why; ``trainer.args.padding_free`` tells the truth after
construction, and ``trainer.padfree_forwards`` counts the packed forwards run so far (rows, real tokens, and the
padded positions TRL's forward would have computed).

The datasets are read through :mod:`padfree.integrations.preference_data` before TRL sees them: a missing
``prompt`` column (unless an ``environment_factory`` supplies the prompts), a None, a value of another type, an
empty prompt or no rows is one :class:`~padfree.errors.InvalidSampleError` naming the column and the row.

>>> cfg = GRPOConfig("out", report_to="none", use_cpu=True)
>>> cfg.padding_free, cfg.auto_padding_free
(None, True)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from padfree.errors import BackendUnavailableError, InvalidArgumentError
from padfree.integrations.base import Construction, TrainerOptions, TrainerProtocol, as_config
from padfree.integrations.decide import (
    PROMPT_LEARNING_SKIP,
    Decision,
    as_tri_state,
    auto_decision,
    first_sample,
    prompt_learning,
    refuse_prompt_learning,
    refuse_unsafe,
    skip_reason,
)
from padfree.integrations.fused_head import FusedHeadOptions, LogProbHead, fused_head_on
from padfree.integrations.preference_data import GRPO_DATA, check_datasets
from padfree.integrations.status import PADDING_FREE, STANDARD
from padfree.integrations.unpadded import unpadded_forwards
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_flag

try:
    import torch
    import trl
except ImportError as exc:  # pragma: no cover - trl is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.grpo needs trl; pip install 'padfree[trl]'"
    ) from exc

__all__ = ["GRPOConfig", "GRPOTrainer"]

logger = logging.getLogger("padfree")

# TRL's per-token scoring takes these for vision-language models only: they are laid out per padded row (or per
# image) and a packed row cannot carry them
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclasses.dataclass
class GRPOConfig(TrainerOptions, FusedHeadOptions, trl.GRPOConfig):
    """``trl.GRPOConfig`` plus padfree's padding-free switch.

    Args:
        padding_free: True: score completions padding-free (refusing what cannot be exact); False: TRL's padded
            forward; None (default): padfree decides (on when safe, see the module docstring).
        auto_padding_free: False turns the automatic choice off (as ``PADFREE_DISABLE_AUTO_PADDING_FREE=1`` does).
        padfree_telemetry: add :class:`~padfree.PackingTelemetryCallback`'s ``padfree/*`` metrics to the training
            logs when padding-free is on, measured on the packed rows the model ran.
        padfree_fused_head: padding-free, on the CPU, answer TRL's fused LM head with padfree's
            (:class:`~padfree.integrations.fused_head.FusedHeadOptions`), at the run's ``temperature`` and
            ``cast_lm_head_to_fp32``.

    Every other argument is ``trl.GRPOConfig``'s.

    >>> GRPOConfig("out", padding_free=True, report_to="none", use_cpu=True).padding_free
    True
    """


def _decide(args: Any, model: Any, config: Any, processing_class: Any, train_dataset: Any) -> Decision:
    padding_free = as_tri_state(getattr(args, "padding_free", None), "padding_free")
    sample = first_sample(train_dataset) if train_dataset is not None else None
    if padding_free:
        refuse_unsafe("padding_free=True", model, config, processing_class, None, sample)
        refuse_prompt_learning("padding_free=True", model, "use padding_free=False")
        return Decision(PADDING_FREE, "padding_free=True", auto=False)
    if padding_free is False:
        return Decision(STANDARD, "padding_free=False", auto=False)
    skip = skip_reason(args, model, config, processing_class, None, sample, returns_logits=False)
    if skip is None and prompt_learning(model):
        skip = PROMPT_LEARNING_SKIP
    return auto_decision(skip, config)


class GRPOMixin(TrainerProtocol):
    """What :class:`GRPOTrainer` adds to ``trl.GRPOTrainer`` (and :func:`padfree.enable` to its subclasses).

    ``trl.GRPOTrainer`` whose per-token log-probs (policy, old policy, reference) run padding-free: one packed
    row per micro-batch, returned in TRL's ``(B, completion_len)`` layout. See the module docstring for the modes.

    Takes exactly ``trl.GRPOTrainer``'s arguments; ``args`` may be a ``trl.GRPOConfig`` or padfree's
    :class:`GRPOConfig`. ``padding_free`` (attribute) is the switch the scoring reads: True in padding-free mode.

    Raises:
        InvalidArgumentError: ``padding_free`` that is not a bool or None; ``padding_free=True`` with a
            ``ProcessorMixin``; multimodal inputs reaching the padding-free forward.
        InvalidSampleError: a dataset TRL cannot train (no ``prompt`` column, None, wrong type, empty prompt, no
            rows).
        UnsupportedModelError: ``padding_free=True`` on a vision-language or unsupported model, or a policy or
            reference model that ``configure_packing`` cannot make exact.
    """

    padding_free = False
    _padfree_fallback = "GRPO scores completions with TRL's padded forward"
    _padfree_head_map: dict[str, LogProbHead] | None = None

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, *rest: Any, **kwargs: Any) -> None:
        args = as_config(args, model, GRPOConfig, trl.GRPOConfig, "GRPO")
        given = Construction(model, args, train_dataset, eval_dataset, processing_class, rest=rest, kwargs=kwargs)
        self._padfree_construct(given, functools.partial(super().__init__, model, reward_funcs, args, train_dataset,
                                                         eval_dataset, processing_class, *rest, **kwargs))

    def _padfree_check(self, given: Construction, config: Any) -> None:
        # an environment_factory (keyword, or TRL's 8th argument after processing_class) supplies the prompts
        environment = given.kwargs.get("environment_factory", given.rest[7] if len(given.rest) > 7 else None)
        check_datasets(GRPO_DATA, given.train_dataset, given.eval_dataset, require=environment is None)

    def _padfree_decide(self, given: Construction, config: Any) -> Decision:
        return _decide(given.args, given.model, config, given.processing_class, given.train_dataset)

    def _padfree_finish(self, given: Construction, decision: Decision) -> Any:
        self.padding_free = decision.on  # the switch the scoring reads
        self.padfree_forwards = {"rows": 0, "tokens": 0, "padded_positions": 0}

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None, *args: Any,
                                           **kwargs: Any) -> Any:
        """TRL's scoring, each micro-batch of ``batch_size`` rows run as one packed row in padding-free mode.

        Args:
            input_ids: ``(B, P + C)`` — left-padded prompts, then right-padded completions.
            attention_mask: ``(B, P + C)`` 0/1 — each row's real tokens one contiguous run.
            logits_to_keep: ``C``, the completion width scored.
        """
        if not self.padding_free:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, *args, **kwargs)
        given = [name for name in _MULTIMODAL if kwargs.get(name) is not None]
        if args or given:
            raise InvalidArgumentError(
                f"padding-free GRPO scores text-only causal LMs, but the forward got multimodal inputs "
                f"({', '.join(given) or 'positional arguments'}): a packed row cannot carry them; use "
                f"GRPOConfig(padding_free=False)")
        self._padfree_count(attention_mask, batch_size or input_ids.size(0))
        if torch.is_grad_enabled():  # the policy's training forward: its completions proven, then measured
            self._padfree_prove(model, {"input_ids": input_ids, "attention_mask": attention_mask})
            if self._padfree_telemetry is not None:
                for rows in attention_mask.split(batch_size or input_ids.size(0)):
                    self._padfree_telemetry.observe_unpadded(rows)
        with unpadded_forwards(model, heads={model: self._padfree_head(model)}):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)

    def _padfree_head(self, model: Any) -> LogProbHead | None:
        """padfree's answer to TRL's fused LM head for ``model`` (``padfree_fused_head``; None: TRL's head): the
        fields TRL's GRPO trainer patched its head with — the policy's entropy too (its metric, the high-entropy
        mask, the bonus), the reference model's log-probs alone — at the run's temperature and head precision."""
        if not fused_head_on(self.args):
            return None
        if self._padfree_head_map is None:
            self._padfree_head_map = {}
        heads = self._padfree_head_map
        reference = self.ref_model is not None and unwrap_model(model) is unwrap_model(self.ref_model)
        key = "reference" if reference else "policy"
        if key not in heads:
            heads[key] = LogProbHead(("log_probs",) if reference else ("log_probs", "entropy"),
                                     temperature=self.temperature,
                                     fp32_head=as_flag(self.args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32"))
        return heads[key]

    def _padfree_count(self, attention_mask: torch.Tensor, batch_size: int) -> None:
        rows = -(-attention_mask.size(0) // batch_size)
        counts = self.padfree_forwards
        counts["rows"] += rows
        counts["tokens"] += int(attention_mask.sum())
        counts["padded_positions"] += attention_mask.numel()



class GRPOTrainer(GRPOMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose per-token log-probs (policy, old policy, reference) run padding-free: one packed
    row per micro-batch, returned in TRL's ``(B, completion_len)`` layout. See :class:`GRPOMixin` and the module
    docstring for the modes and refusals."""
