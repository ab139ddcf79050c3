"""One model, every attention backend available here: is a packed step exact? The engine of ``padfree verify``.

For each backend, :func:`check_support` calls :func:`~padfree.configure_packing` and :func:`~padfree.verify` on the
same weights and the same packed rows (three sequences of different lengths per row, two rows, one ending in
padding; lengths 1–9 cross sliding windows of 5 and short-convolution kernels of 4), and collects the outcome: the
resolved backend and its numbers, or why it could not run here. Backends whose backward does not exist on this
device (``flex_attention`` on the CPU) are checked forward only and say so.

>>> from padfree.model.tiny import tiny_model
>>> row = check_support(tiny_model("llama"), backends=["sdpa", "eager"])
>>> row.ok, [c.backend for c in row.checks]
(True, ['padfree_sdpa', 'padfree_eager'])
>>> print(row.markdown())
| llama | ✓ `padfree_sdpa` | ✓ `padfree_eager` |
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from padfree.errors import InvalidArgumentError, PadfreeError, describe
from padfree.model.configure import configure_packing, unconfigure_packing
from padfree.model.verify import VerifyReport, verify

__all__ = ["BackendCheck", "SupportRow", "available_backends", "check_support"]

#: three sequences per row, two rows (capacity 20: [9, 8, 3] and [7, 6, 5] + 2 padding), as the test matrix uses
LENGTHS = (9, 8, 7, 6, 5, 3)
CAPACITY = 20
_ALL = ("sdpa", "eager", "flex_attention", "varlen", "flash_attention_2")


@dataclasses.dataclass(frozen=True)
class BackendCheck:
    """The outcome for one requested backend.

    Attributes:
        requested: the ``backend=`` passed to :func:`~padfree.configure_packing`.
        backend: the implementation it resolved to (``padfree_sdpa``, ...), or None when it refused.
        report: the :class:`~padfree.model.verify.VerifyReport` (None when the backend could not be configured).
        error: why the backend could not be configured or run here (None when it ran).
        forward_only: gradients were not compared (no backward on this device).
    """

    requested: str
    backend: str | None
    report: VerifyReport | None
    error: str | None = None
    forward_only: bool = False

    @property
    def ok(self) -> bool:
        return self.report is not None and self.report.ok

    @property
    def cell(self) -> str:
        """The support-table cell: ``✓ `backend```, ``✓ fwd``, ``✗ mismatch`` or ``—`` (not run here)."""
        if self.report is None:
            return "—"
        if not self.report.ok:
            return "✗ mismatch"
        return "✓ fwd" if self.forward_only else f"✓ `{self.backend}`"


@dataclasses.dataclass(frozen=True)
class SupportRow:
    """Every backend's :class:`BackendCheck` for one model; ``ok`` when every backend that ran was exact."""

    model_type: str
    checks: list[BackendCheck]
    mixers: dict[str, str]

    @property
    def ok(self) -> bool:
        ran = [c for c in self.checks if c.report is not None]
        return bool(ran) and all(c.ok for c in ran)

    def markdown(self) -> str:
        """This model's row of the README support table (columns in the order of ``checks``)."""
        return f"| {self.model_type} | " + " | ".join(c.cell for c in self.checks) + " |"

    def __str__(self) -> str:
        width = max(len(c.requested) for c in self.checks)
        ran = any(c.report is not None for c in self.checks)
        verdict = ("exact on every backend that ran" if self.ok else "NOT exact" if ran
                   else "no backend could run here")
        lines = [f"{self.model_type}: {verdict}"]
        for c in self.checks:
            if c.report is None:
                lines.append(f"  {c.requested:<{width}}  not run: {c.error}")
                continue
            r = c.report
            grads = "not compared (no backward here)" if r.max_grad_diff is None else f"{r.max_grad_diff:.1e}"
            lines.append(f"  {c.requested:<{width}}  {'OK      ' if r.ok else 'MISMATCH'} {c.backend}: max |Δlogit| "
                         f"{r.max_logit_diff:.1e}, |Δloss| {r.loss_diff:.1e}, max |Δgrad| {grads}")
        if self.mixers:
            kinds = sorted(set(self.mixers.values()))
            lines.append(f"  recurrent mixers: {len(self.mixers)} ({'; '.join(kinds)})")
        return "\n".join(lines)


def available_backends(device: Any = "cpu") -> list[str]:
    """The backends :func:`check_support` tries by default on ``device``: ``sdpa`` and ``eager`` everywhere,
    ``flex_attention`` when torch has it, ``varlen`` and ``flash_attention_2`` on CUDA."""
    device = torch.device(device)
    names = ["sdpa", "eager"]
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is not None:
        names.append("flex_attention")
    if device.type == "cuda":
        names += ["varlen", "flash_attention_2"]
    return names


def _sequences(model: Any, seed: int) -> list[list[int]]:
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 4:
        raise InvalidArgumentError(f"the model's config.vocab_size must be >= 4 to draw test tokens, got {vocab}")
    g = torch.Generator().manual_seed(seed)
    low = min(3, vocab - 1)  # keep clear of the usual pad / bos / eos ids
    return [torch.randint(low, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def check_support(
    model: Any, backends: Sequence[str] | None = None, *, atol: float = 1e-5, seed: int = 1,
) -> SupportRow:
    """Configure ``model`` for every backend in turn and :func:`~padfree.verify` it on packed rows.

    Args:
        model: a transformers causal LM (fp32 for the 1e-5 tolerance), on the device to check.
        backends: names accepted by :func:`~padfree.configure_packing`; default :func:`available_backends`.
        atol: tolerance on logits, loss and gradients.
        seed: seeds the random test tokens.

    A backend that cannot be configured here (no CUDA, no flash-attn, a model type padfree does not support)
    becomes a check with its ``error``; a mismatch is a check whose report is not ok — neither raises. The model
    is left unconfigured afterwards.
    """
    device = next(model.parameters()).device
    names = available_backends(device) if backends is None else list(backends)
    unknown = [b for b in names if not isinstance(b, str) or b not in (*_ALL, "auto")]
    if unknown or not names:
        raise InvalidArgumentError(
            f"backends must be a non-empty list of {', '.join((*_ALL, 'auto'))}; got {describe(backends)}")
    seqs = _sequences(model, seed)
    checks, mixers = [], {}
    try:
        for name in names:
            try:
                report = configure_packing(model, backend=name)
            except PadfreeError as exc:
                checks.append(BackendCheck(name, None, None, error=str(exc).splitlines()[0]))
                continue
            mixers = report.mixers
            forward_only = report.backend == "padfree_flex" and device.type == "cpu"  # torch: no CPU backward
            result = verify(model, seqs, atol=atol, check_grads=not forward_only, capacity=CAPACITY)
            checks.append(BackendCheck(name, report.backend, result, forward_only=forward_only))
    finally:
        unconfigure_packing(model)
    return SupportRow(str(getattr(model.config, "model_type", type(model).__name__)), checks, dict(mixers))
