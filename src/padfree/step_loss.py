"""The loss rule: a packed step trains exactly what the unpacked step trains.

padfree's loss is the **token mean over every real label token of the optimizer step** — all gradient-accumulation
micro-batches and all data-parallel ranks together — so how sequences are cut into rows and micro-batches changes
nothing::

    loss(step) = Σ_{targets t of the step} -log p(t) / (number of targets of the step)

A *target* is a label that is not ``-100`` after the causal shift: the first token of every sequence never is (the
model has nothing to predict it from), nor is padding or a prompt token under completion-only / assistant-only loss.
:func:`count_loss_items` counts them per batch; a trainer sums the counts of the micro-batches it draws for one
optimizer step, adds them up across ranks, and divides every micro-batch's loss sum (:func:`token_losses`,
:func:`reduce_loss`) by the step total times the data-parallel world size, since DDP averages gradients. The rule
``"sequence"`` weights sequences instead of tokens: every sequence's own mean token loss, averaged over the
sequences of the step — a weighting that packing cannot change either, since it never looks at rows.

:class:`LossRule` is that rule as one object — the step's counts (:class:`StepCounts`), the denominator, the
reduction of a micro-batch, the per-sequence target weights, the division — which padfree's trainers, the fused loss
(:func:`padfree.causal_lm_loss`), packed DPO's pair weighting (the rule ``"pair"``: a micro-batch's mean over its
pairs, weighed by them) and sequence parallelism's ``target_weights`` all call.

Why not leave it to transformers: its ``Trainer`` normalises by ``num_items_in_batch`` only when the model's forward
accepts loss kwargs (otherwise every micro-batch's *mean* is averaged over the accumulation steps, which weights a
short micro-batch's tokens more), and across ranks only with ``average_tokens_across_devices``. padfree computes the
token losses itself (fp32 cross-entropy over the shifted logits, exactly transformers' ``ForCausalLMLoss``) and needs
neither.

>>> import torch
>>> batch = {"labels": torch.tensor([[-100, 12, 13, -100, 22, -100]]),   # a packed row: [11 12 13] [21 22] + pad
...          "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
>>> count_loss_items(batch)          # (targets, sequences with at least one target)
(3, 2)
>>> sequence_ids(batch["position_ids"]).tolist()  # which sequence each token belongs to (padding tail: its own)
[[0, 0, 0, 1, 1, 2]]
>>> step = step_counts([batch, batch], device="cpu")  # two micro-batches of one optimizer step
>>> step.targets.item(), step.sequences.item()
(6.0, 4.0)
>>> LossRule("token").denominator(step, world=2).item()  # DDP averages 2 ranks: each divides by 6 / 2
3.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.layout import IGNORE_INDEX, position_ids_to_segment_ids, segment_ids_to_batch_seq_idx

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError("padfree.step_loss needs torch; pip install 'padfree[torch]'") from exc

__all__ = [
    "LOSS_MODES",
    "RULES",
    "LossRule",
    "StepCounts",
    "count_loss_items",
    "count_loss_tensors",
    "loss_count",
    "reduce_loss",
    "refuse_with_own_nll",
    "scored_labels",
    "sequence_ids",
    "sequence_weights",
    "step_counts",
    "token_losses",
]

#: ``"token"``: the token mean over the step; ``"sequence"``: the mean over the step's sequences of their token means
LOSS_MODES = ("token", "sequence")
#: every rule :class:`LossRule` knows: the two a user picks, and ``"pair"`` (packed DPO: the mean over the step's pairs)
RULES = (*LOSS_MODES, "pair")


class StepCounts(NamedTuple):
    """The counts of one optimizer step, over its micro-batches and every rank: ``()`` float64 tensors each."""

    targets: torch.Tensor  #: labels scored after the causal shift: what the token rule divides by
    sequences: torch.Tensor  #: sequences with at least one target: what the sequence rule divides by


@dataclasses.dataclass(frozen=True)
class LossRule:
    """The loss rule: the optimizer step's loss is the mean over all of its ``mode`` units — targets (``"token"``),
    sequences (``"sequence"``: each sequence's own mean token loss) or preference pairs (``"pair"``) — whatever
    rows, micro-batches and ranks they were cut into.

    A micro-batch's share of that mean is its sum over its units divided by the :meth:`denominator`, the step's
    count over the data-parallel world size (DDP averages the ranks' gradients).

    >>> rule = LossRule("token")
    >>> batch = {"labels": torch.tensor([[-100, 12, 13, -100, 22]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    >>> token_loss = torch.tensor([[1.0, 2.0, 0.0, 3.0]])  # of labels[:, 1:]: targets 12, 13, 22
    >>> rule.reduce(token_loss, token_loss > 0, batch, None).item()  # alone: its own mean
    2.0
    >>> rule.reduce(token_loss, token_loss > 0, batch, torch.tensor(6.0)).item()  # its share of 6 targets
    1.0
    """

    mode: str

    def __post_init__(self) -> None:
        if self.mode not in RULES:
            raise InvalidArgumentError(f"the loss rule must be one of {list(RULES)}, got {describe(self.mode)}")

    def count(self, step: StepCounts | torch.Tensor) -> torch.Tensor:
        """The step's count of this rule's units (a ``"pair"`` step is counted as a tensor)."""
        if isinstance(step, torch.Tensor):
            return step
        if self.mode == "pair":
            raise InvalidArgumentError("the pair rule counts pairs, not a step's targets and sequences")
        return step.targets if self.mode == "token" else step.sequences

    def denominator(self, step: StepCounts | torch.Tensor | None, world: int) -> torch.Tensor | None:
        """What a micro-batch's sum is divided by: the step's count over the ``world`` ranks DDP averages (None
        outside a counted step: each batch is then divided by its own count)."""
        return None if step is None else self.count(step) / world

    def batch_count(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """``()`` float64: this rule's units in one batch (:func:`loss_count`; pairs: half the rows)."""
        if self.mode == "pair":
            return torch.tensor(int(batch["input_ids"].shape[0]) // 2, dtype=torch.float64)
        return loss_count(batch, self.mode)

    def weights(self, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """The per-label weights that turn a sum of token losses into this rule's sum (None: 1 each)."""
        return sequence_weights(batch) if self.mode == "sequence" else None

    def reduce(self, token_loss: torch.Tensor, mask: torch.Tensor, batch: Mapping[str, Any],
               denominator: torch.Tensor | float | None, shifted: bool = True) -> torch.Tensor:
        """A micro-batch's share of the step's loss (:func:`reduce_loss`)."""
        return reduce_loss(token_loss, mask, batch, self.mode, denominator, shifted=shifted)

    def mean_share(self, units: int, step: torch.Tensor, world: int, accumulation: int) -> torch.Tensor:
        """The factor that makes a micro-batch's loss — a mean over its ``units`` (TRL's DPO loss: its pairs), which
        the Trainer divides by the ``accumulation`` steps and DDP averages over ``world`` ranks — its share of the
        mean over the ``step``'s units."""
        return units * accumulation * world / step

    @staticmethod
    def nonempty(count: torch.Tensor) -> torch.Tensor:
        """``count`` with an empty count made 1: the rule's loss of a batch without targets is 0, not NaN."""
        return torch.where(count > 0, count, torch.ones_like(count))

    @staticmethod
    def target_weights(target: torch.Tensor, seq: torch.Tensor, slots: int | None = None) -> torch.Tensor:
        """float32 shaped like ``target``: ``1 / (targets of its sequence)`` at every target, 0 elsewhere — the
        sequence rule's weights. ``target``: bool, which positions are targets; ``seq``: int64, the sequence of
        each position, below ``slots`` (default ``seq.numel()``)."""
        slots = seq.numel() if slots is None else slots
        counts = torch.bincount(seq.masked_fill(~target, slots).reshape(-1), minlength=slots + 1)[:-1]
        return torch.where(target, 1.0 / counts.clamp(min=1)[seq].float(), 0.0)

    @staticmethod
    def divide(total: torch.Tensor, denominator: Any, *, empty: str = "zero") -> torch.Tensor:
        """``total / denominator``; an empty denominator gives 0 (``empty="zero"``: the rule's batch without
        targets) or, as transformers' causal-LM mean does, NaN with zero gradients (``empty="nan"``). A count may
        be a fraction (a step's count over the world size, a slice's share of its sequences)."""
        if empty == "nan":
            d = denominator.to(total.device) if isinstance(denominator, torch.Tensor) else torch.tensor(
                float(denominator), device=total.device)
            d = d.to(total.dtype)
            is_empty = d == 0
            safe = torch.where(is_empty, torch.ones_like(d), d)
            # the value of total / 0 (NaN for a sum of no targets), added without a gradient: the gradients stay
            # those of total / 1, which are zero when there is no target — what F.cross_entropy's empty mean gives
            nothing = total.detach() / d - total.detach()
            return total / safe + torch.where(is_empty, nothing, torch.zeros_like(nothing))
        d = torch.as_tensor(denominator, device=total.device, dtype=total.dtype)
        return total / torch.where(d > 0, d, torch.ones_like(d))


def step_counts(batches: Sequence[Mapping[str, Any]], device: Any, gather: Callable[[torch.Tensor], torch.Tensor]
                | None = None, replicas: int = 1) -> StepCounts:
    """The :class:`StepCounts` of the micro-batches of one optimizer step (each with ``labels`` or
    ``shift_labels``), on ``device``; with ``gather`` (accelerate's), summed over every rank and divided by the
    ``replicas`` that saw the same batches."""
    counts = torch.stack([torch.stack(count_loss_tensors(b)) for b in batches]).sum(0)
    counts = counts.to(device=device, dtype=torch.float64)
    if gather is not None:
        counts = gather(counts.unsqueeze(0)).sum(0) / replicas
    return StepCounts(counts[0], counts[1])


def sequence_ids(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, T) int64`` — the index of the sequence every token belongs to, counted over the whole batch.

    A sequence starts at every row start and wherever ``position_ids`` is 0 (packed rows restart there; a padding
    tail counted ``0, 1, ...`` is a sequence of its own). Without ``position_ids`` pass ``None``: every row is one
    sequence (an ordinary padded batch).

    Args:
        position_ids: ``(B, T)`` or ``(T,)`` integer positions, or None.
        attention_mask: only used for its shape when ``position_ids`` is None.
    """
    ref = position_ids if position_ids is not None else attention_mask
    if ref is None:
        raise InvalidArgumentError("sequence_ids needs position_ids or an attention_mask to know the batch shape")
    if ref.dim() == 1:
        ref = ref.unsqueeze(0)
    if position_ids is None:
        rows, width = ref.shape
        return torch.arange(rows, device=ref.device).unsqueeze(1).expand(rows, width)
    # unchecked: a check would sync the device at every micro-batch, padfree's collators have validated the rows
    # they made, and positions of an ordinary batch (even left-padded: 1, 1, 0, 1, 2) still split into runs
    return segment_ids_to_batch_seq_idx(position_ids_to_segment_ids(ref, check=False), check=False)


def scored_labels(batch: Mapping[str, Any]) -> tuple[torch.Tensor, bool]:
    """``(targets, shifted)``: the label of every scored position — ``shift_labels`` as given, else
    ``labels[:, 1:]`` (the causal shift), ``(B, T)`` or ``(B, T - 1)`` — and whether the caller's logits must drop
    their last position."""
    shift = batch.get("shift_labels")
    if shift is not None:
        return shift, False
    labels = batch["labels"]
    if labels.dim() == 1:
        labels = labels.unsqueeze(0)
    return labels[:, 1:], True


def count_loss_items(batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(targets, sequences)`` of one model-input batch: labels that are scored after the causal shift, and the
    sequences that have at least one of them (what the per-sequence loss averages over).

    ``batch`` holds ``labels`` (``(B, T)``, Hugging Face aligned: the model shifts) or ``shift_labels``, and
    ``position_ids`` when rows are packed. Counting ``labels[:, 1:]`` rather than all labels matters for unpacked
    rows, whose first token is a label but never a target; packed rows already hold ``-100`` there.
    """
    t, s = count_loss_tensors(batch)
    return int(t), int(s)


def count_loss_tensors(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`count_loss_items` as two ``()`` int64 tensors on the batch's device: counting never syncs."""
    targets, shifted = scored_labels(batch)
    mask = targets != IGNORE_INDEX
    seq, slots = _target_sequences(batch, targets.shape, shifted)
    has = torch.zeros(slots + 1, dtype=torch.bool, device=targets.device)
    has[seq.masked_fill(~mask, slots).reshape(-1)] = True
    return mask.sum(), has[:-1].sum()


def _target_sequences(batch: Mapping[str, Any], shape: torch.Size, shifted: bool) -> tuple[torch.Tensor, int]:
    """``(sequence of every scored position, number of token slots)``: the target at ``t`` is token ``t + 1``
    when ``shifted``; with ``shift_labels`` it is at ``t`` and belongs to the sequence of token ``t`` (the label
    before a boundary is ignored). Sequence ids are below the slot count ``B * T``."""
    ref = batch.get("labels") if batch.get("labels") is not None else batch.get("shift_labels")
    if ref.dim() == 1:
        ref = ref.unsqueeze(0)
    pos = batch.get("position_ids")
    if pos is not None:
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.shape[0] == 1 and ref.shape[0] > 1:
            pos = pos.expand(ref.shape[0], -1)
    seq = sequence_ids(pos, ref)
    return (seq[:, 1:] if shifted else seq.reshape(shape)), seq.numel()


def loss_count(batch: Mapping[str, Any], mode: str) -> torch.Tensor:
    """``()`` float64: what the loss rule divides a batch's loss sum by when the batch stands alone — its targets
    (``"token"``) or its sequences with a target (``"sequence"``). A sequence-parallel slice holds a share of its
    sequences: the sum of its ``target_weights`` (the shares of a row's slices add up to the row's count)."""
    weights = _row_weights(batch)
    if mode == "sequence" and weights is not None:
        return weights.sum(dtype=torch.float64)
    return count_loss_tensors(batch)[0 if mode == "token" else 1].to(torch.float64)


def _row_weights(batch: Mapping[str, Any]) -> torch.Tensor | None:
    """The whole row's per-target sequence weights a sequence-parallel slice carries (``target_weights``, aligned
    with its ``shift_labels``); None for any other batch. A slice cannot tell them itself: its sequences continue on
    other ranks."""
    weights = getattr(batch, "target_weights", None)
    return weights if isinstance(weights, torch.Tensor) and batch.get("shift_labels") is not None else None


def sequence_weights(batch: Mapping[str, Any]) -> torch.Tensor:
    """Floats shaped like the batch's labels (``labels`` or ``shift_labels``): ``1 / (targets of its sequence)``
    for every label that is a target, 0 elsewhere — the weights that make a sum of token losses the sum of the
    sequences' mean losses (the ``"sequence"`` rule, before its division by the sequence count). A
    sequence-parallel slice's come with it, counted over the whole row."""
    weights = _row_weights(batch)
    if weights is not None:
        return weights
    targets, shifted = scored_labels(batch)
    mask = targets != IGNORE_INDEX
    seq, slots = _target_sequences(batch, targets.shape, shifted)
    scored = LossRule.target_weights(mask, seq, slots)
    return torch.nn.functional.pad(scored, (1, 0)) if shifted else scored


def token_losses(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, mask)``, both ``(B, T - 1)`` (``(B, T)`` with ``shift_labels``): the fp32 cross-entropy of every
    scored position (0 where ignored) and whether it is a target — what transformers' ``ForCausalLMLoss`` sums.

    Args:
        logits: ``(B, T, V)`` from the model.
        batch: the model inputs, with ``labels`` or ``shift_labels``.
    """
    targets, shifted = scored_labels(batch)
    if shifted:
        logits = logits[:, :-1]
    mask = targets != IGNORE_INDEX
    flat = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.masked_fill(~mask, 0).reshape(-1), reduction="none"
    )
    return flat.view(targets.shape) * mask, mask


def reduce_loss(token_loss: torch.Tensor, mask: torch.Tensor, batch: Mapping[str, Any], mode: str,
                denominator: torch.Tensor | float | None, shifted: bool = True) -> torch.Tensor:
    """The loss of one micro-batch under the loss rule: the sum over its targets (``"token"``) or over its
    sequences' mean token losses (``"sequence"``), divided by ``denominator`` (the step's targets or sequences,
    already scaled by the data-parallel world size), or by this batch's own count when it is None.

    Args:
        token_loss, mask: from :func:`token_losses`.
        batch: the model inputs the losses came from (``position_ids`` tell the sequences apart; a
            sequence-parallel slice's ``target_weights`` weigh its token losses by their sequences' whole-row
            targets).
        mode: one of :data:`LOSS_MODES`.
        denominator: the step's count over the world size, or None.
        shifted: the losses are of ``labels[:, 1:]`` (False: of ``shift_labels``).

    Returns:
        ``()`` — the micro-batch's share of the step's loss.
    """
    weights = _row_weights(batch) if mode == "sequence" else None
    if mode == "token":
        total = token_loss.sum()
        count = mask.sum()
    elif weights is not None:  # a slice of a row: its sequences' targets counted over the whole row
        total = (token_loss * weights.to(token_loss.dtype)).sum()
        count = weights.sum(dtype=torch.float64)
    else:
        seq, slots = _target_sequences(batch, token_loss.shape, shifted)
        idx = seq.masked_fill(~mask, slots).reshape(-1)
        sums = torch.zeros(slots + 1, dtype=token_loss.dtype, device=token_loss.device)
        sums.index_add_(0, idx, token_loss.reshape(-1))
        counts = torch.bincount(idx, minlength=slots + 1)[:-1]
        total = (sums[:-1] / counts.clamp(min=1)).sum()
        count = (counts > 0).sum()
    # an empty count is replaced, and then the sum it divides is 0 too
    return LossRule.divide(total, count if denominator is None else denominator)


def refuse_with_own_nll(what: str, args: Any, compute_loss_func: Any) -> None:
    """InvalidArgumentError when ``args`` / ``compute_loss_func`` would change the loss away from the plain negative
    log-likelihood that ``what`` (the sequence rule, the fused loss) computes itself.

    Args:
        what: the setting that computes the loss itself, as the user wrote it (``"padfree_loss='sequence'"``).
        args: the trainer's ``TrainingArguments`` (TRL's ``loss_type`` and ``label_smoothing_factor`` are read).
        compute_loss_func: the trainer's ``compute_loss_func`` argument.
    """
    conflicts = []
    loss_type = getattr(args, "loss_type", "nll")  # TRL's SFTConfig: "nll" or "dft"
    if loss_type not in (None, "nll"):
        conflicts.append(f"loss_type={loss_type!r}")
    smoothing = getattr(args, "label_smoothing_factor", 0.0) or 0.0
    if smoothing > 0:
        conflicts.append(f"label_smoothing_factor={smoothing}")
    if compute_loss_func is not None:
        conflicts.append("a compute_loss_func")
    if conflicts:
        raise InvalidArgumentError(
            f"{what} computes the negative log-likelihood itself; it cannot be combined with "
            f"{', '.join(conflicts)} (accepted: loss_type='nll', no label smoothing, no compute_loss_func)")
