"""Packing telemetry: what packing bought, measured on the batches actually trained on.

:class:`PackingTelemetryCallback` (added automatically by padfree's trainers) adds, at every logging step:
``padfree/real_token_fraction`` (real tokens / positions), ``padfree/sequences_per_row``,
``padfree/tokens_per_second`` (real tokens), ``padfree/attention_flops_saved`` (1 − the attention work done / the
work of padding every micro-batch's sequences to its longest: Σ len² against n · max_len²; 0 for ordinary padded
batches) and ``padfree/attention`` / ``padfree/mixers``, the implementations ``configure_packing`` installed. The
counts stay on the device until a log is written: no sync per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from padfree.errors import BackendUnavailableError
from padfree.layout import IGNORE_INDEX, segment_ids_to_batch_seq_idx
from padfree.model.state import packing_state
from padfree.model.wrappers import unwrap_model
from padfree.step_loss import sequence_ids

try:
    import torch
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    raise BackendUnavailableError(
        "padfree.integrations.telemetry needs torch and transformers; pip install 'padfree[torch,hf]'"
    ) from exc

__all__ = ["PackingTelemetryCallback", "TelemetryLogMixin"]

logger = logging.getLogger("padfree")

_STATS = ("rows", "positions", "tokens", "sequences", "attn_done", "attn_padded")


def is_train_log(logs: Mapping[str, Any]) -> bool:
    """Whether ``logs`` is the Trainer's training log (it has ``loss``, no ``eval_`` / ``test_`` metric): the one
    the telemetry joins."""
    return "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs)


class PackingTelemetryCallback(TrainerCallback):
    """Logs, per logging step, what packing bought: measured on the batches actually trained on.

    Keys added to the logged metrics (and written to the ``padfree`` logger at INFO):

    - ``padfree/real_token_fraction`` — real tokens / positions the model ran (1.0 without padding);
    - ``padfree/sequences_per_row`` — sequences per batch row;
    - ``padfree/tokens_per_second`` — real tokens per second of wall time since the previous log;
    - ``padfree/attention_flops_saved`` — 1 − (attention work done) / (work of padding each micro-batch's sequences
      to its longest), with work ∝ Σ len² for block-diagonal packed attention and B·T² for padded rows;
    - ``padfree/attention``, ``padfree/mixers`` — the implementations ``configure_packing`` installed (strings).

    padfree's trainers add it and feed it every micro-batch; with another trainer, call :meth:`observe` on each
    batch of model inputs (e.g. from ``training_step``) and :meth:`pop_metrics` when logging.

    Args:
        pad_token_ids: token ids that mark a padding tail (a row-final sequence made only of these ids, with no
            target) in packed rows padded to capacity; padding-free rows have no padding at all.

    >>> import torch
    >>> cb = PackingTelemetryCallback()
    >>> cb.observe({"input_ids": torch.tensor([[5, 6, 7, 8, 9, 3, 0, 0]]),
    ...             "labels": torch.tensor([[-100, 6, 7, -100, 9, -100, -100, -100]]),
    ...             "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])})
    >>> m = cb.pop_metrics()
    >>> m["padfree/real_token_fraction"], m["padfree/sequences_per_row"], round(m["padfree/attention_flops_saved"], 4)
    (0.75, 3.0, 0.4815)
    """

    def __init__(self, *, pad_token_ids: Sequence[int] = (0,)) -> None:
        self.pad_token_ids = tuple(int(i) for i in pad_token_ids)
        self.attention: str | None = None
        self.mixers: str | None = None
        self._acc: torch.Tensor | None = None
        self._since = time.perf_counter()
        self.last: dict[str, Any] = {}

    # ---- measuring -------------------------------------------------------------------------------------

    def observe(self, inputs: Mapping[str, Any]) -> None:
        """Count one micro-batch of model inputs (``input_ids``, ``labels``, ``position_ids`` and/or
        ``attention_mask``); the counts stay on the batch's device.

        Packed rows are read from a LLaMA-Factory integer ``attention_mask`` (segment ids ``[1, 1, 2, 2, 2, 0]``)
        or from ``position_ids`` that restart at 0; a 0/1 ``attention_mask`` is an ordinary padded batch."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        stats = _batch_stats(inputs, self.pad_token_ids)
        self._acc = stats if self._acc is None else self._acc + stats

    def observe_unpadded(self, attention_mask: torch.Tensor) -> None:
        """Count a padded micro-batch that padfree ran as ONE packed row (:mod:`padfree.integrations.unpadded`, as
        the DPO, reward and GRPO trainers do): one row of its real tokens, each ``(N, L)`` mask row a sequence.

        >>> cb = PackingTelemetryCallback()
        >>> cb.observe_unpadded(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))
        >>> m = cb.pop_metrics()  # 3² + 2² of attention work, against 2 · 3² padded to the longest
        >>> m["padfree/real_token_fraction"], m["padfree/sequences_per_row"], m["padfree/attention_flops_saved"]
        (1.0, 2.0, 0.2777777777777778)
        """
        lens = attention_mask.ne(0).sum(1).to(torch.float64)
        lens = lens[lens > 0]
        total = lens.sum().reshape(1)
        stats = torch.cat([torch.ones(1, dtype=torch.float64, device=lens.device), total, _packed_stats(lens)])
        self._acc = stats if self._acc is None else self._acc + stats

    def pop_metrics(self) -> dict[str, Any]:
        """The metrics since the previous call (empty if no batch was observed), then start counting afresh."""
        now = time.perf_counter()
        if self._acc is None:
            return {}
        acc = dict(zip(_STATS, self._acc.tolist(), strict=True))  # the one device sync per log
        elapsed = max(now - self._since, 1e-9)
        self._acc, self._since = None, now
        metrics: dict[str, Any] = {
            "padfree/real_token_fraction": acc["tokens"] / max(acc["positions"], 1.0),
            "padfree/sequences_per_row": acc["sequences"] / max(acc["rows"], 1.0),
            "padfree/tokens_per_second": acc["tokens"] / elapsed,
            "padfree/attention_flops_saved": 1.0 - acc["attn_done"] / max(acc["attn_padded"], 1.0),
        }
        if self.attention is not None:
            metrics["padfree/attention"] = self.attention
        if self.mixers:
            metrics["padfree/mixers"] = self.mixers
        self.last = metrics
        logger.info("padfree telemetry: %s", ", ".join(
            f"{k.split('/', 1)[1]}={v:.4g}" if isinstance(v, float) else f"{k.split('/', 1)[1]}={v}"
            for k, v in metrics.items()))
        return metrics

    # ---- TrainerCallback ---------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._since, self._acc = time.perf_counter(), None
        base = unwrap_model(model) if model is not None else None
        st = packing_state(base) if base is not None else None
        if st is not None:
            self.attention = st.report.backend
            self.mixers = "; ".join(f"{k}: {v}" for k, v in st.report.mixers.items()) or None
        elif base is not None and getattr(base, "config", None) is not None:
            self.attention = f"{base.config._attn_implementation} (transformers, not configured by padfree)"

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
               ) -> None:
        # padfree's trainers merge the metrics in Trainer.log (so they reach log_history); with another trainer
        # they are added here, for the callbacks after this one
        if logs is not None and is_train_log(logs) and "padfree/real_token_fraction" not in logs:
            logs.update(self.pop_metrics())


def attach_telemetry(trainer: Any, **kwargs: Any) -> PackingTelemetryCallback:
    """A :class:`PackingTelemetryCallback` (``kwargs`` its arguments) put first among ``trainer``'s callbacks, so the
    reporting callbacks (TensorBoard, W&B, the console) see its keys."""
    callback = PackingTelemetryCallback(**kwargs)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


class TelemetryLogMixin:
    """For a ``transformers.Trainer`` subclass (before it in the bases): the telemetry's metrics merged into the
    training log in ``log``, so that they reach ``log_history`` and every reporting callback.

    ``_padfree_attach_telemetry`` adds the callback (its arguments from ``_padfree_telemetry_options``); a trainer
    feeds it its micro-batches (``observe`` / ``observe_unpadded``)."""

    _padfree_telemetry: PackingTelemetryCallback | None = None

    def _padfree_telemetry_options(self) -> dict[str, Any]:
        """Keyword arguments of the :class:`PackingTelemetryCallback` this trainer attaches."""
        return {}

    def _padfree_attach_telemetry(self) -> None:
        self._padfree_telemetry = attach_telemetry(self, **self._padfree_telemetry_options())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._padfree_telemetry is not None and is_train_log(logs):
            logs.update(self._padfree_telemetry.pop_metrics())
        super().log(logs, start_time)


def _batch_stats(inputs: Mapping[str, Any], pad_ids: tuple[int, ...]) -> torch.Tensor:
    """``(6,) float64`` on the batch's device: rows, positions, real tokens, sequences, attention work done
    (Σ len² packed, B·T² padded), attention work of padded batching (n · max_len²).

    Boundaries come from a LLaMA-Factory integer ``attention_mask`` (segment ids ``[1, 1, 2, 2, 2, 0]``: 0 is
    padding), else from ``position_ids`` restarting at 0; a 0/1 ``attention_mask`` or neither is an ordinary batch.
    """
    ids = inputs["input_ids"]
    rows, width = ids.shape
    dev = ids.device
    f = torch.float64
    pos, mask, labels = inputs.get("position_ids"), inputs.get("attention_mask"), inputs.get("labels")
    if pos is not None and pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        # an ordinary batch: one sequence per row, the attention runs over the whole padded width
        stats = _padded_stats(mask.ne(0).sum(1).to(f), rows, width)
        if not mask.dtype.is_floating_point and mask.dtype != torch.bool:
            # segment ids or a 0/1 mask: which one is decided on the device (values > 1 somewhere), since asking
            # would sync every step
            stats = torch.where((mask > 1).any(), _packed_stats(_segment_lengths(mask)), stats)
    elif pos is None or pos.shape != ids.shape:
        stats = _padded_stats(torch.full((rows,), float(width), dtype=f, device=dev), rows, width)
    else:
        seq = sequence_ids(pos)
        flat = seq.reshape(-1)
        count = rows * width
        lens = torch.bincount(flat, minlength=count)[:count].to(f)
        is_pad = torch.isin(ids, torch.tensor(pad_ids, device=dev))
        if isinstance(labels, torch.Tensor) and labels.shape == ids.shape:
            is_pad &= labels == IGNORE_INDEX
        pad_count = torch.bincount(flat, weights=is_pad.reshape(-1).to(f), minlength=count)[:count]
        final = torch.zeros(count, dtype=torch.bool, device=dev)
        final[seq[:, -1]] = True
        tail = final & (pad_count == lens) & (lens > 0)
        stats = _packed_stats(lens.masked_fill(tail, 0.0))
    return torch.cat([torch.tensor([float(rows), float(rows * width)], dtype=f, device=dev), stats])


def _padded_stats(lens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``(4,) float64``: real tokens, sequences, attention work done (B·T²: every row attends over the padded
    width) and of padding to the longest, from the ``(rows,)`` real lengths of an ordinary batch."""
    done = torch.full((), float(rows * width * width), dtype=lens.dtype, device=lens.device)
    return _stats(lens, done)


def _packed_stats(lens: torch.Tensor) -> torch.Tensor:
    """``(4,) float64`` as :func:`_padded_stats`, for block-diagonal attention over sequences of length ``lens``
    (zeros for empty slots allowed): the work done is Σ len²."""
    return _stats(lens, (lens * lens).sum())


def _stats(lens: torch.Tensor, done: torch.Tensor) -> torch.Tensor:
    n = (lens > 0).sum().to(lens.dtype)
    padded = n * lens.max() ** 2 if lens.numel() else torch.zeros((), dtype=lens.dtype, device=lens.device)
    return torch.stack([lens.sum(), n, done, padded])


def _segment_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``(B·T,) float64`` — the real tokens of every segment of a LLaMA-Factory ``(B, T)`` integer mask, one slot
    per position (padding runs and unused slots hold 0). Unchecked, so any id values work — no assumption that they
    count 1, 2, 3 — and nothing syncs: a segment is a run of equal ids in a row."""
    seg = segment_ids_to_batch_seq_idx(mask, check=False)
    count = mask.numel()
    return torch.bincount(seg.reshape(-1), weights=(mask != 0).reshape(-1).to(torch.float64), minlength=count)[:count]
