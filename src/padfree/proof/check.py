"""``verify(model, data)``: prove, on your own model and data, that a packed step equals the per-sequence steps.

One packed forward (and backward) against one forward (and backward) per sequence, on the same weights, compared
three ways: the logits of every sequence, the token-mean cross-entropy, and every parameter's gradient. The loss is
the mean over every next-token target of every sequence in both runs, so the gradients are directly comparable.

>>> import torch, transformers
>>> from padfree import configure_packing, verify
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(cfg)
>>> _ = configure_packing(model)
>>> report = verify(model, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]])
>>> report.ok, report.num_sequences
(True, 3)
>>> report.max_logit_diff < 1e-5, report.max_grad_diff < 1e-5
(True, True)
>>> report.raise_for_mismatch()  # silent when ok; raises PackingMismatchError with the table otherwise

In the precision you train in (bf16 weights, or fp32 weights under autocast) no fixed tolerance fits every model:
``atol="auto"`` (the default) takes it from the run itself — three times what rounding alone moves each sequence
between exact computations (alone; right- and left-padded in one batch), at least 1e-5 — and runs a
leaking control (the rows with positions that never restart) that must land beyond it.

>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     low = verify(model, [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]])
>>> low.ok, low.conclusive, low.atol > 1e-5  # within rounding; the control beyond it
(True, True, True)

Token ids the model has no embedding for are refused before anything runs:

>>> verify(model, [[5, 6, 7], [8, 64]])
Traceback (most recent call last):
...
padfree.errors.InvalidTokensError: data[1][1] = 64 is not below the vocabulary size 64
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from padfree.data.batch import PackedBatch, pack_result_to_tensors
from padfree.errors import (
    InvalidArgumentError,
    InvalidTokensError,
    PackingMismatchError,
    describe,
)
from padfree.layout import IGNORE_INDEX
from padfree.model.wrappers import packable_model, wrapper_chain
from padfree.packing.inputs import as_positive_int
from padfree.packing.packer import pack_sequences
from padfree.proof.compare import FP32_TOL, ROUNDING_FACTOR
from padfree.samples import check_tokens, read_tokens

__all__ = ["VerifyReport", "verify"]


@dataclasses.dataclass(frozen=True)
class SequenceCheck:
    """One sequence of the packed batch: where it sits and how far the packed run is from running it alone."""

    row: int
    offset: int
    length: int
    max_logit_diff: float
    loss_packed: float
    loss_separate: float


@dataclasses.dataclass
class VerifyReport:
    """Packed vs per-sequence comparison (see :func:`verify`).

    Attributes:
        sequences: one :class:`SequenceCheck` per sequence.
        max_logit_diff: the largest ``|packed - separate|`` over every logit of every sequence.
        loss_packed, loss_separate: token-mean cross-entropy over every next-token target.
        max_grad_diff: the largest ``|packed - separate|`` over every parameter gradient (None without grads).
        worst_parameter: the parameter where that maximum is.
        atol: the tolerance of ``ok`` for logits (given, or calibrated: see :func:`verify`).
        backend: the model's ``config._attn_implementation`` during the check.
        rows: packed rows of the check.
        loss_atol, grad_atol: the tolerances of the loss and of the gradients.
        rounding: what rounding alone moves each sequence's logits (None: a fixed ``atol`` was given).
        control: the leaking control's largest logit difference (None: not run — a fixed ``atol``, or no row holds
            two sequences).
    """

    sequences: list[SequenceCheck]
    max_logit_diff: float
    loss_packed: float
    loss_separate: float
    max_grad_diff: float | None
    worst_parameter: str | None
    atol: float
    backend: str
    rows: int
    loss_atol: float | None = None
    grad_atol: float | None = None
    rounding: float | None = None
    control: float | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_packed - self.loss_separate)

    @property
    def ok(self) -> bool:
        """Logits, loss and (when checked) gradients all agree within their tolerances."""
        loss_atol = self.atol if self.loss_atol is None else self.loss_atol
        grad_atol = self.atol if self.grad_atol is None else self.grad_atol
        grads_ok = self.max_grad_diff is None or self.max_grad_diff <= grad_atol
        return self.max_logit_diff <= self.atol and self.loss_diff <= loss_atol and grads_ok

    @property
    def conclusive(self) -> bool | None:
        """Whether this check can tell a leak from rounding: the leaking control landed beyond ``atol``. None when no
        control ran (a fixed ``atol``, or one sequence per row)."""
        return None if self.control is None else self.control > self.atol

    def raise_for_mismatch(self) -> None:
        """Raise :class:`PackingMismatchError` (with the table) unless :attr:`ok`."""
        if not self.ok:
            raise PackingMismatchError(f"packed and per-sequence runs differ beyond atol={self.atol:g}:\n{self}")

    def __str__(self) -> str:
        head = f"{'row':>4} {'offset':>7} {'length':>7} {'max |Δlogit|':>13} {'loss packed':>12} {'loss alone':>12}"
        lines = [f"verify: {self.num_sequences} sequences in {self.rows} rows, backend {self.backend}", head]
        for s in self.sequences:
            lines.append(f"{s.row:>4} {s.offset:>7} {s.length:>7} {s.max_logit_diff:>13.2e} "
                         f"{s.loss_packed:>12.6f} {s.loss_separate:>12.6f}")
        grads = ("not checked" if self.max_grad_diff is None
                 else f"{self.max_grad_diff:.2e} (worst: {self.worst_parameter})")
        lines.append(f"max |Δlogit| {self.max_logit_diff:.2e}   |Δloss| {self.loss_diff:.2e}   max |Δgrad| {grads}")
        if self.rounding is not None:
            lines.append(f"rounding moves each sequence by up to {self.rounding:.2e}: atol {self.atol:.2e} (loss "
                         f"{self.loss_atol:.2e}, gradients {self.grad_atol:.2e})")
        if self.control is not None:
            seen = "beyond atol: a leak would show" if self.conclusive else \
                "within atol: this precision cannot tell a leak from rounding here, so the check proves nothing"
            lines.append(f"leaking control (positions never restarting): max |Δlogit| {self.control:.2e}, {seen}")
        lines.append(f"{'OK' if self.ok else 'MISMATCH'} at atol={self.atol:g}")
        return "\n".join(lines)


def _as_batch(data: Any, capacity: int | None, vocab: int | None) -> PackedBatch:
    if isinstance(data, PackedBatch):
        if capacity is not None:
            raise InvalidArgumentError("capacity applies to a list of sequences; a PackedBatch is already packed")
        ids = data.input_ids.detach().cpu().numpy()  # padding is embedded too: every slot of every row is checked
        rows, width = ids.shape
        check_tokens(ids.reshape(-1), np.arange(rows, dtype=np.int64) * width, np.full(rows, width, np.int64),
                     lambda r: f"data.input_ids[{r}]", vocab_size=vocab)
        return data
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
        raise InvalidTokensError(
            f"data must be a PackedBatch or a non-empty list of token-id sequences, got {describe(data)}")
    tokens = read_tokens(data, "data", vocab_size=vocab)
    lengths = tokens.lengths
    if lengths.min() < 2:
        i = int(np.argmax(lengths < 2))
        raise InvalidTokensError(f"data[{i}] has {lengths[i]} token(s), but every sequence needs at least 2 (a "
                                 f"token and the next one to predict), got {describe(data[i])}")
    cap = int(lengths.sum()) if capacity is None else as_positive_int(capacity, "capacity")
    return pack_result_to_tensors(pack_sequences(lengths, cap), tokens, pad_to="longest")


def _vocab_size(model: torch.nn.Module) -> int | None:
    """How many token ids ``model`` can embed: its input embedding's rows, else its config's ``vocab_size``."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without a token embedding
        rows = None
    if rows is None:
        config = getattr(model, "config", None)
        rows = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", None)
    return int(rows) if isinstance(rows, int) and rows > 0 else None


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# the elements of logits a loss or a distance is taken over at a time: a slice of rows of about 2 MB in fp32 (64 MB on
# an accelerator), so that no temporary the size of the whole logits is made — on a CPU, page-faulting a fresh buffer
# of a few hundred MB costs more than the arithmetic done in it
_CHUNK_ELEMENTS = {"cpu": 1 << 19}
_DEFAULT_CHUNK_ELEMENTS = 1 << 24


def _row_chunks(values: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` over the rows of a ``(N, V)`` tensor, each about :data:`_CHUNK_ELEMENTS` elements."""
    rows, width = values.shape[0], max(int(values.shape[-1]), 1)
    step = max(1, _CHUNK_ELEMENTS.get(values.device.type, _DEFAULT_CHUNK_ELEMENTS) // width)
    return [(i, min(i + step, rows)) for i in range(0, rows, step)]


def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``(N,)`` fp32: the cross-entropy of each of ``N`` positions' logits ``(N, V)`` with its target ``(N,)``, 0 where
    the target is ignored; computed a slice of rows at a time (skipping slices that train nothing), differentiable."""
    real = (targets != IGNORE_INDEX).cpu().numpy()
    parts = [F.cross_entropy(logits[i:j].float(), targets[i:j], ignore_index=IGNORE_INDEX, reduction="none")
             if real[i:j].any() else torch.zeros(j - i, device=logits.device) for i, j in _row_chunks(logits)]
    return torch.cat(parts) if parts else torch.zeros(0, device=logits.device)


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _token_ce(logits, targets).sum()


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` over logits ``(..., V)`` of the same shape, a slice of rows at a time (NaN if either holds a
    NaN)."""
    a, b = a.detach().reshape(-1, a.shape[-1]), b.detach().reshape(-1, b.shape[-1])
    worst = torch.zeros((), device=a.device)
    for i, j in _row_chunks(a):
        lo, hi = torch.aminmax(a[i:j].float() - b[i:j].float())
        worst = torch.maximum(worst, torch.maximum(-lo, hi))
    return float(worst)


def _max_abs(a: torch.Tensor) -> float:
    """``max |a|``, without a temporary of ``a``'s size."""
    lo, hi = torch.aminmax(a.detach())
    return max(-float(lo), float(hi))


def verify(
    model: torch.nn.Module, data: Any, *, atol: float | str = "auto", check_grads: bool = True,
    capacity: int | None = None, compute_dtype: torch.dtype | None = None,
) -> VerifyReport:
    """Run ``model`` packed and per sequence on the same weights and compare logits, loss and gradients.

    Args:
        model: a transformers causal LM returning ``.logits`` (normally after :func:`padfree.configure_packing`;
            an unconfigured model can be checked too, to see whether — and how much — it leaks), bare or wrapped
            as :func:`~padfree.configure_packing` takes it (PEFT, DDP / FSDP, ``torch.compile``): the wrapper is
            what runs, so its adapters are part of the check and its gradients are the ones compared.
        data: a list of token-id sequences (each ``(n_i,)``, ``n_i >= 2``), packed here into rows of ``capacity``
            tokens (default: all in one row), or a :class:`~padfree.PackedBatch` (its real sequences are checked;
            padding tails are not sequences).
        atol: tolerance of :attr:`VerifyReport.ok` for logits, loss and gradients, or ``"auto"``: three times what
            rounding alone moves each sequence — its logits, the loss, every gradient — between exact computations
            in the run's precision (alone; right-padded with the others in one ordinary batch, or, under autocast
            with fp32 weights, alone in fp32; left-padded, every sequence at another offset), at
            least 1e-5 and one unit in the last place of the values compared; and a leaking control (every row
            with positions that never restart) whose distance must exceed it (:attr:`VerifyReport.conclusive`).
        check_grads: also run both backwards and compare every parameter gradient (the model's existing ``.grad``
            are kept and restored).
        capacity: row length when ``data`` is a list.
        compute_dtype: with ``atol="auto"``, the dtype the model computes in when the call cannot show it (a
            forward that applies autocast itself, as accelerate's mixed precision does, and returns fp32 logits):
            the run is calibrated as a low-precision one, against an ordinary padded batch. None: read from the
            logits' dtype and the autocast around the call.

    Raises:
        UnsupportedModelError: ``model`` holds no transformers model, or carries a prompt-learning PEFT adapter
            (its virtual tokens make a packed row and its sequences different inputs).
        InvalidTokensError: ``data`` is not token-id sequences, or holds an id the model has no embedding for
            (negative, or at least its vocabulary size); the message names the sample and the position.

    The model runs in eval mode (dropout would make the runs differ) and is put back in its mode afterwards. The
    packed run feeds ``PackedBatch.model_inputs()``; each sequence alone gets its own ids with positions ``0..n-1``
    and no mask. Cost: one packed and ``n`` single forwards (and backwards); with ``atol="auto"``, two forwards
    more: the leaking control (its logits computed from each row's second sequence on: the ones compared) and one
    ordinary padded batch holding the sequences right- and left-padded (at most ``2n`` rows; a backward per side;
    the padding's logits are not computed) — under autocast with fp32 weights, left-padded only, and each sequence
    alone again in fp32 (``n`` forwards and backwards).
    """
    calibrate = isinstance(atol, str) and atol == "auto"
    if not calibrate and (isinstance(atol, bool) or not isinstance(atol, (int, float)) or not math.isfinite(atol)
                          or atol < 0):
        raise InvalidArgumentError(f"atol must be \"auto\" or a finite number >= 0, got {describe(atol)}")
    inner = packable_model(model, "verify")
    batch = _as_batch(data, capacity, _vocab_size(inner))
    device = next(model.parameters()).device
    batch = batch.to(device) if hasattr(batch, "to") else batch
    was_training = model.training
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.eval()
    calibration = None
    try:
        with torch.set_grad_enabled(check_grads):
            for p in model.parameters():
                p.grad = None
            logits = model(**batch.model_inputs(include_labels=False)).logits
            ids, labels = batch.input_ids, batch.labels
            n_targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
            # each row's next-token losses, once: the loss sums them, each sequence's packed loss is its span of them
            row_ce = [_token_ce(logits[r, :-1], labels[r, 1:]) for r in range(logits.shape[0])]
            loss = torch.stack([ce.sum() for ce in row_ce]).sum() / max(n_targets, 1)
            if check_grads:
                if loss.requires_grad:  # else no trainable parameter reaches the packed logits: all its grads are 0
                    loss.backward()
                packed_grads = _grads(model)
                for p in model.parameters():
                    p.grad = None
            checks, total, pieces = [], 0.0, []
            rows = np.repeat(np.arange(len(batch.seqs_per_row)), batch.seqs_per_row.cpu().numpy())
            cols = _columns(batch)
            for i, n in enumerate(batch.seq_lens.tolist()):
                r, c = int(rows[i]), int(cols[i])
                seq = ids[r, c:c + n][None]
                alone = model(input_ids=seq, position_ids=torch.arange(n, device=device)[None],
                              use_cache=False).logits[0]
                target = labels[r, c + 1:c + n]
                ce_alone = _ce_sum(alone[:-1], target)
                if check_grads and ce_alone.requires_grad:
                    (ce_alone / max(n_targets, 1)).backward()
                packed_part = logits[r, c:c + n]
                ce_packed = row_ce[r][c:c + n - 1].sum()
                count = max(int((target != IGNORE_INDEX).sum()), 1)
                checks.append(SequenceCheck(r, c, n, _max_abs_diff(packed_part, alone),
                                            float(ce_packed.detach()) / count, float(ce_alone.detach()) / count))
                total += float(ce_alone.detach())
                pieces.append((r, c, n, alone.detach()))
            alone_grads = _grads(model) if check_grads else {}
            control = _control(model, inner, batch, pieces) if calibrate else None
            if calibrate:
                low = compute_dtype not in (None, torch.float32) or _low_precision(logits, device)
                calibration = _calibrate(model, batch, pieces, total / max(n_targets, 1), alone_grads, n_targets,
                                         check_grads, compute_dtype if low else torch.float32, control)
        worst, worst_name = None, None
        if check_grads:
            worst, worst_name = _worst(packed_grads, alone_grads)
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
        model.train(was_training)
    loss_separate = total / max(n_targets, 1)
    if calibration is not None:
        rounding, loss_rounding, grad_rounding = calibration
        tol = max(FP32_TOL, ROUNDING_FACTOR * rounding)
        # the loss averages every token: at least the logits' bound relative to its size
        tolerances = {"atol": tol, "loss_atol": max(ROUNDING_FACTOR * loss_rounding, tol * max(1.0, loss_separate)),
                      "grad_atol": max(FP32_TOL, ROUNDING_FACTOR * grad_rounding), "rounding": rounding}
    else:
        tolerances = {"atol": float(atol), "loss_atol": float(atol), "grad_atol": float(atol)}
    return VerifyReport(
        sequences=checks, max_logit_diff=max(s.max_logit_diff for s in checks), loss_packed=float(loss.detach()),
        loss_separate=loss_separate, max_grad_diff=worst, worst_parameter=worst_name,
        backend=str(getattr(inner.config, "_attn_implementation", "?")), rows=int(batch.input_ids.shape[0]),
        control=control, **tolerances,
    )


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float | None, str | None]:
    """The largest ``|got - want|`` over every parameter's gradient, and that parameter (a parameter one run reaches
    and the other does not has a zero gradient there, not no difference)."""
    worst, name = None, None
    zero = torch.zeros(())  # a 0-dim CPU tensor broadcasts against a gradient on any device
    for key in sorted(got.keys() | want.keys()):
        d = float((got.get(key, zero) - want.get(key, zero)).abs().max())
        if worst is None or d > worst:
            worst, name = d, key
    return worst, name


def _low_precision(logits: torch.Tensor, device: torch.device) -> bool:
    """The run computes in less than fp32: low-precision logits, or autocast on around the call."""
    return logits.dtype != torch.float32 or torch.is_autocast_enabled(device.type)


def _alone_runs(model: torch.nn.Module, batch: PackedBatch, pieces: list, n_targets: int, check_grads: bool
                ) -> tuple[list[torch.Tensor], float, dict[str, torch.Tensor]]:
    """Each sequence alone again (its logits, the token-mean loss, the gradients): the reference runs of
    :func:`_calibrate`."""
    for p in model.parameters():
        p.grad = None
    logits, total = [], 0.0
    for r, c, n, _ in pieces:
        out = model(input_ids=batch.input_ids[r, c:c + n][None],
                    position_ids=torch.arange(n, device=batch.input_ids.device)[None], use_cache=False).logits[0]
        ce = _ce_sum(out[:-1], batch.labels[r, c + 1:c + n])
        if check_grads and ce.requires_grad:
            (ce / max(n_targets, 1)).backward()
        logits.append(out.detach())
        total += float(ce.detach())
    grads = _grads(model)
    for p in model.parameters():
        p.grad = None
    return logits, total / max(n_targets, 1), grads


def _padded_runs(model: torch.nn.Module, batch: PackedBatch, pieces: list, n_targets: int, check_grads: bool,
                 sides: Sequence[str] = ("right",)) -> list[tuple[list[torch.Tensor], float, dict[str, torch.Tensor]]]:
    """The sequences right- and / or left-padded (``sides``) in one ordinary batch (``attention_mask``; the model's
    own unpacked path) of one forward: per side, each sequence's logits ``(n_i, V)``, the token-mean loss and the
    gradients (each side's loss backward on its own). A sequence as long as the widest is the same row on both
    sides; only the real tokens are projected to logits (:func:`_real_logits`)."""
    device = batch.input_ids.device
    width = max(n for _, _, n, _ in pieces)
    slots: dict[tuple[int, int], int] = {}  # (sequence, its first column) -> row of the batch
    for side in sides:
        for j, (_, _, n, _) in enumerate(pieces):
            slots.setdefault((j, width - n if side == "left" else 0), len(slots))
    ids = torch.zeros(len(slots), width, dtype=batch.input_ids.dtype, device=device)
    mask = torch.zeros(len(slots), width, dtype=torch.long, device=device)
    for (j, start), row in slots.items():
        r, c, n, _ = pieces[j]
        ids[row, start:start + n], mask[row, start:start + n] = batch.input_ids[r, c:c + n], 1
    for p in model.parameters():
        p.grad = None
    # no position_ids: the model's own (a rotary model is invariant to the left padding's shift up to rounding; one
    # that is not moves the sequences as a leak would, and the reference is left out)
    padded = _real_logits(model, mask, input_ids=ids, attention_mask=mask, use_cache=False)
    out, ce, logits = [], {}, {}  # a row both sides share: one loss, one logits tensor
    for k, side in enumerate(sides):
        rows = [(slots[(j, width - n if side == "left" else 0)], width - n if side == "left" else 0, r, c, n)
                for j, (r, c, n, _) in enumerate(pieces)]
        for row, s, r, c, n in rows:
            if row not in ce:  # each sequence's own next-token targets, as alone (a padding position predicts none)
                ce[row] = _ce_sum(padded[row, s:s + n - 1], batch.labels[r, c + 1:c + n])
                logits[row] = padded[row, s:s + n].detach()
        loss = torch.stack([ce[row] for row, *_ in rows]).sum() / max(n_targets, 1)
        if check_grads and loss.requires_grad:
            loss.backward(retain_graph=k < len(sides) - 1)
        grads = _grads(model)
        for p in model.parameters():
            p.grad = None
        out.append(([logits[row] for row, *_ in rows], float(loss.detach()), grads))
    return out


class _RealLogits:
    """The logits of an ordinary padded batch at its real tokens only: ``self[row, start:stop]`` is ``(n, V)``, read
    from the ``(B, T, V)`` logits or from the ``(1, N, V)`` ones of the real tokens in row-major order."""

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        self.logits, self.flat = logits, logits.shape[:2] != mask.shape
        counts = mask.sum(dim=1).cpu()
        self.offsets = (torch.cumsum(counts, 0) - counts).tolist()
        self.first = (mask.shape[1] - counts).tolist() if self.flat else None  # left-aligned or right-aligned row
        self.left = mask[:, -1].bool().cpu().tolist()

    def __getitem__(self, key: tuple[int, slice]) -> torch.Tensor:
        row, cols = key
        if not self.flat:
            return self.logits[row, cols]
        shift = self.offsets[row] - (self.first[row] if self.left[row] else 0)
        return self.logits[0, cols.start + shift:cols.stop + shift]


def _real_logits(model: torch.nn.Module, mask: torch.Tensor, **inputs: Any) -> _RealLogits:
    """``model(**inputs).logits`` of an ordinary batch whose real tokens are ``mask`` ``(B, T)`` — each row's one
    contiguous run, at its start or its end — with the output head (``get_output_embeddings()``) applied to those
    tokens only: the padding's logits are compared with nothing, and at a vocabulary of 32k they are most of the
    forward's cost. Each position's logits are the head applied to its hidden state either way. A compiled model (a
    hook would compile it again), one whose head is not that module and one whose forward reshapes the logits by the
    batch's shape give every position, read as such."""
    real = mask.bool()
    try:
        head = None if _compiled(model) else packable_model(model, "verify").get_output_embeddings()
    except (AttributeError, NotImplementedError):  # a model without a head module: every position
        head = None

    def gather(module: torch.nn.Module, args: tuple) -> tuple | None:
        if args and args[0].dim() == 3 and tuple(args[0].shape[:2]) == tuple(real.shape):
            return (args[0][real][None], *args[1:])
        return None

    handle = head.register_forward_pre_hook(gather) if isinstance(head, torch.nn.Module) else None
    logits = None
    try:
        logits = model(**inputs).logits
    except RuntimeError:  # a model that reshapes its logits by the batch's shape: every position, below
        if handle is None:
            raise
    finally:
        if handle is not None:
            handle.remove()
    if logits is None or (logits.shape[:2] != real.shape and tuple(logits.shape[:2]) != (1, int(real.sum()))):
        logits = model(**inputs).logits  # every position, as the model gives them
    return _RealLogits(logits, mask)


def _calibrate(model: torch.nn.Module, batch: PackedBatch, pieces: list, loss_alone: float,
               alone_grads: dict[str, torch.Tensor], n_targets: int, check_grads: bool,
               compute_dtype: torch.dtype | None = None, control: float | None = None
               ) -> tuple[float, float, float]:
    """``(logits, loss, gradient)``: how far rounding alone moves each sequence's run, in the precision of the run.

    Under autocast with fp32 weights the reference is each sequence alone with autocast off (fp32), as the support
    sweep measures it; with low-precision weights, the same sequences right-padded in one ordinary batch — two exact
    computations that differ only by rounding. Either distance is at least the resolution of the run's dtype at the
    size of the values compared (one unit in the last place can always flip)."""
    device = batch.input_ids.device
    fp32_weights = all(p.dtype == torch.float32 for p in model.parameters() if p.is_floating_point())
    dtype = compute_dtype or (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else
                              next(p.dtype for p in model.parameters() if p.is_floating_point()))
    if torch.is_autocast_enabled(device.type) and fp32_weights and dtype != torch.float32:
        with torch.autocast(device.type, enabled=False):
            references = [_alone_runs(model, batch, pieces, n_targets, check_grads)]
        sides: tuple[str, ...] = ("left",)
    else:
        references, sides = [], ("right", "left")
    # the same sequences left-padded: every sequence at another offset, a chunked scan cut elsewhere — as far from
    # the sequence alone as rounding moves a computation that chunks differently (the packed path does). A model
    # whose padding leaks into its tokens moves them as far as the leaking control does: such a reference measures
    # the leak, not rounding, and is left out (kept only within a thousandth of the control). Right- and
    # left-padded rows run as one ordinary batch: one forward
    *right, left = _padded_runs(model, batch, pieces, n_targets, check_grads, sides)
    references += right
    alone = [p[3] for p in pieces]
    seen: dict[int, float] = {}  # by the reference's logits: a row both sides share is measured once

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        if id(b) not in seen:
            seen[id(b)] = _max_abs_diff(a, b)
        return seen[id(b)]

    moved = [distance(a, b) for a, b in zip(alone, left[0], strict=True)]
    distances = [[distance(a, b) for a, b in zip(alone, ref, strict=True)] for ref, _, _ in references]
    if control is not None and max(moved) <= control / 1000:
        references.append(left)
        distances.append(moved)
    eps = torch.finfo(dtype).eps
    ulps = [eps * _max_abs(a) for a in alone]
    rounding = max(max(d, u) for ds in distances for d, u in zip(ds, ulps, strict=True))
    grad_rounding = 0.0
    if check_grads and alone_grads:
        grad_rounding = max(max(_worst(alone_grads, grads)[0] or 0.0 for _, _, grads in references),
                            eps * max(_max_abs(g) for g in alone_grads.values()))
    return rounding, max(abs(loss_alone - loss) for _, loss, _ in references), grad_rounding


def _control(model: torch.nn.Module, inner: torch.nn.Module, batch: PackedBatch, pieces: list) -> float | None:
    """The leaking control: every row as one sequence (positions ``0..width-1``, no boundaries), so each sequence
    after a row's first attends to — and, in a recurrent layer, carries state from — the ones before it. Its largest
    logit distance from those sequences alone; None when no row holds two sequences. Only the columns from the first
    later sequence on are projected to logits (``logits_to_keep``, where the model takes it): the others are
    compared with nothing."""
    later = [(r, c, n, alone) for r, c, n, alone in pieces if c > 0]
    if not later:
        return None
    ids = batch.input_ids
    width = ids.shape[1]
    positions = torch.arange(width, device=ids.device).expand(ids.shape[0], -1)
    keep = width - min(c for _, c, _, _ in later)
    kept = {"logits_to_keep": keep} if _takes_logits_to_keep(inner) and not _compiled(model) else {}
    with torch.no_grad():
        leaked = model(input_ids=ids, position_ids=positions, use_cache=False, **kept).logits
        if leaked.shape[1] not in (keep, width):  # a wrapper that read it otherwise: every column, as it always can
            leaked = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    first = width - leaked.shape[1]  # the column of the first logits returned (0: every column)
    return max(_max_abs_diff(leaked[r, c - first:c - first + n], alone) for r, c, n, alone in later)


def _compiled(model: torch.nn.Module) -> bool:
    """Whether ``torch.compile`` runs ``model`` or a model it wraps (a ``._orig_mod`` wrapper, or
    ``Module.compile()``): a keyword or a hook it was not compiled with would compile it again, which costs far more
    than the logits it saves."""
    return any(isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)
               or getattr(m, "_compiled_call_impl", None) is not None for m in wrapper_chain(model))


def _takes_logits_to_keep(inner: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (transformers' causal LMs: only the last columns are
    projected to logits)."""
    try:
        return "logits_to_keep" in inspect.signature(type(inner).forward).parameters
    except (TypeError, ValueError):
        return False


def _columns(batch: PackedBatch) -> np.ndarray:
    """Column where every real sequence starts inside its row."""
    lens = batch.seq_lens.cpu().numpy()
    per_row = batch.seqs_per_row.cpu().numpy()
    first = np.cumsum(np.concatenate([[0], per_row]))[:-1]
    ends = np.cumsum(lens)
    starts = ends - lens
    row_of = np.repeat(np.arange(per_row.size), per_row)
    return starts - starts[first[row_of]] if lens.size else starts
