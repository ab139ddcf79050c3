"""One model, every attention backend available here: what does ``configure_packing`` do with it, and is a packed
step exact? The engine of ``padfree verify``.

For each backend, :func:`check_support` calls :func:`~padfree.configure_packing` and :func:`~padfree.verify` on the
same weights and the same packed rows (three sequences of different lengths per row, two rows, one ending in
padding; lengths 1–9 cross sliding windows of 5 and short-convolution kernels of 4), and collects the outcome per
backend (:attr:`BackendCheck.status`): ``exact`` (configured here and proven: logits, loss and every gradient),
``not exact`` (configured here, and the proof failed), ``refused`` (``configure_packing`` refuses it for this model
or on this device, with its reason) or ``unavailable`` (it cannot run here: a package or a device it needs is
missing). It also records which backend ``configure_packing(backend="auto")`` picks here. The row is exact when
every backend ``configure_packing`` accepts here is proven exact — the one ``auto`` picks among them.

>>> from padfree.proof.tiny import tiny_model
>>> row = check_support(tiny_model("llama"), backends=["sdpa", "eager"])
>>> row.ok, row.auto_backend, [(c.backend, c.status, c.auto) for c in row.checks]
(True, 'padfree_sdpa', [('padfree_sdpa', 'exact', True), ('padfree_eager', 'exact', False)])
>>> print(row.markdown())
| llama | ✓ `padfree_sdpa` | ✓ `padfree_eager` |
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from typing import Any, Literal

import torch

from padfree.data.batch import as_device
from padfree.errors import BackendUnavailableError, InvalidArgumentError, PadfreeError, describe
from padfree.model.configure import configure_packing, unconfigure_packing
from padfree.proof.check import VerifyReport, verify

__all__ = ["check_support"]

#: three sequences per row, two rows (capacity 20: [9, 8, 3] and [7, 6, 5] + 2 padding), as the test matrix uses
LENGTHS = (9, 8, 7, 6, 5, 3)
CAPACITY = 20
_ALL = ("sdpa", "eager", "flex_attention", "varlen", "flash_attention_2")

Status = Literal["exact", "not exact", "refused", "unavailable"]


@dataclasses.dataclass(frozen=True)
class BackendCheck:
    """The outcome for one requested backend.

    Attributes:
        requested: the ``backend=`` passed to :func:`~padfree.configure_packing`.
        backend: the implementation it resolved to (``padfree_sdpa``, ...), or None when it was not configured.
        report: the :class:`~padfree.proof.check.VerifyReport` (None when the backend was not configured).
        error: why ``configure_packing`` did not configure it here (None when it was).
        unavailable: the backend cannot run here (``configure_packing`` raised
            :class:`~padfree.errors.BackendUnavailableError`: a package or a device it needs is missing); False
            for a refusal (the backend cannot be made exact for this model, or on this device: ``flex_attention``
            on the CPU) and for a backend that ran.
        auto: ``backend`` is the one ``configure_packing(backend="auto")`` picks for this model here.
    """

    requested: str
    backend: str | None
    report: VerifyReport | None
    error: str | None = None
    unavailable: bool = False
    auto: bool = False

    @property
    def ok(self) -> bool:
        """Configured here and proven exact."""
        return self.report is not None and self.report.ok

    @property
    def status(self) -> Status:
        """``"exact"``, ``"not exact"`` (both: configured here and checked), ``"refused"`` or ``"unavailable"``."""
        if self.report is not None:
            return "exact" if self.report.ok else "not exact"
        return "unavailable" if self.unavailable else "refused"

    @property
    def cell(self) -> str:
        """The support-table cell: ``✓ `backend```, ``✗ mismatch``, ``refused`` or ``—`` (cannot run here)."""
        return {"exact": f"✓ `{self.backend}`", "not exact": "✗ mismatch", "refused": "refused",
                "unavailable": "—"}[self.status]


@dataclasses.dataclass(frozen=True)
class SupportRow:
    """Every backend's :class:`BackendCheck` for one model.

    ``ok`` when at least one backend was configured and proven, and every backend ``configure_packing`` configured
    here is exact: refused and unavailable backends are reported, they are no mismatch (``configure_packing``
    never runs them). ``auto_backend`` is what ``configure_packing(backend="auto")`` picks here (None when it
    refuses the model: ``auto_error`` says why).
    """

    model_type: str
    checks: list[BackendCheck]
    mixers: dict[str, str]
    auto_backend: str | None = None
    auto_error: str | None = None

    @property
    def ok(self) -> bool:
        ran = [c for c in self.checks if c.report is not None]
        return bool(ran) and all(c.ok for c in ran)

    @property
    def verdict(self) -> str:
        """One line: whether the model is exact here, on which backend ``auto`` picks, and what is not."""
        ran = [c for c in self.checks if c.report is not None]
        if not ran:
            return f"{self.model_type}: no backend could run here"
        bad = sorted({c.backend for c in ran if not c.ok})
        picked = [c for c in ran if c.auto]
        if bad:
            auto = " (the backend configure_packing picks here)" if self.auto_backend in bad else ""
            return f"{self.model_type}: NOT exact on {', '.join(bad)}{auto}, which configure_packing accepts here"
        proven = ", ".join(sorted({c.backend for c in ran}))
        if picked:
            return (f"{self.model_type}: exact — configure_packing picks {self.auto_backend} here (backend='auto'); "
                    f"proven exact: {proven}")
        auto = (f"configure_packing picks {self.auto_backend} here (not checked)" if self.auto_backend is not None
                else f"configure_packing(backend='auto') refuses it: {self.auto_error}")
        return f"{self.model_type}: exact on every backend checked ({proven}); {auto}"

    def markdown(self) -> str:
        """This model's row of a markdown table with one column per backend checked (in the order of ``checks``)."""
        return f"| {self.model_type} | " + " | ".join(c.cell for c in self.checks) + " |"

    def __str__(self) -> str:
        width = max(len(c.requested) for c in self.checks)
        lines = [self.verdict]
        for c in self.checks:
            head = f"  {c.requested:<{width}}  {c.status.upper() if c.status == 'not exact' else c.status:<11}"
            if c.report is None:
                lines.append(f"{head} {c.error}")
                continue
            r = c.report
            auto = " (auto)" if c.auto else ""
            lines.append(f"{head} {c.backend}{auto}: max |Δlogit| {r.max_logit_diff:.1e}, |Δloss| {r.loss_diff:.1e}, "
                         f"max |Δgrad| {r.max_grad_diff:.1e}")
        if self.mixers:
            kinds = sorted(set(self.mixers.values()))
            lines.append(f"  recurrent mixers: {len(self.mixers)} ({'; '.join(kinds)})")
        return "\n".join(lines)


def available_backends(device: Any = "cpu") -> list[str]:
    """The backends :func:`check_support` tries by default on ``device``: ``sdpa`` and ``eager`` everywhere,
    ``flex_attention`` when torch has it (on the CPU too, where the check reports that ``configure_packing`` refuses
    it), ``varlen`` and ``flash_attention_2`` on CUDA."""
    device = as_device(device) or torch.device("cpu")
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

    A backend that ``configure_packing`` refuses (for this model, or on this device) or that cannot run here
    becomes a check with its ``error``; a mismatch is a check whose report is not ok — neither raises. The backend
    ``configure_packing(backend="auto")`` picks is recorded (``SupportRow.auto_backend``) and its checks marked
    (``BackendCheck.auto``). The model is left unconfigured afterwards.
    """
    device = next(model.parameters()).device
    names = available_backends(device) if backends is None else list(backends)
    unknown = [b for b in names if not isinstance(b, str) or b not in (*_ALL, "auto")]
    if unknown or not names:
        raise InvalidArgumentError(
            f"backends must be a non-empty list of {', '.join((*_ALL, 'auto'))}; got {describe(backends)}")
    seqs = _sequences(model, seed)
    checks, mixers = [], {}
    auto_backend = auto_error = None
    try:
        try:
            auto_backend = configure_packing(model, backend="auto").backend
        except PadfreeError as exc:
            auto_error = str(exc).splitlines()[0]
        for name in names:
            try:
                report = configure_packing(model, backend=name)
            except PadfreeError as exc:
                checks.append(BackendCheck(name, None, None, error=str(exc).splitlines()[0],
                                           unavailable=isinstance(exc, BackendUnavailableError)))
                continue
            mixers = report.mixers
            result = verify(model, seqs, atol=atol, capacity=CAPACITY)
            checks.append(BackendCheck(name, report.backend, result, auto=report.backend == auto_backend))
    finally:
        unconfigure_packing(model)
    return SupportRow(str(getattr(model.config, "model_type", type(model).__name__)), checks, dict(mixers),
                      auto_backend, auto_error)
