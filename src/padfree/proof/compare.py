"""Packed against per-sequence on one model, per backend and precision: the measurement behind every support claim.

The support sweep of the test suite (which writes the table ``configure_packing`` reads), the on-the-spot
certification of a model the table does not cover, and ``padfree verify --model-type`` all run :func:`prove`:

1. a fixed packed case (:data:`ROWS`): two rows holding a length-1 sequence, sequences shorter than a 4-tap
   convolution, one crossing a 64-token chunk and many 8-token chunks, sequences longer than a 5-token sliding
   window, and a trailing filler run (a row's padding, a segment of its own);
2. every sequence run alone as an unpacked batch of one (the model's own default positions), in fp32 (the
   reference), with the gradient of the token-mean cross-entropy;
3. for every backend: ``configure_packing``'s machinery installed, an ordinary padded batch checked unchanged,
   then per precision a packed **training step** — the forward with ``labels=`` (each sequence's first token and
   the filler run ``-100``; pre-shifted for a model whose loss does not shift them: BART's, XLNet's and other
   decoders of encoder-decoder families), the model's own loss from them, and its backward — and a **negative
   control** — the
   same rows with positions that never restart, which any model that mixes tokens leaks on;
4. the verdict: fp32 within ``1e-5`` (logits relative to their scale, the model's loss against the token-mean
   loss of the sequences alone, every gradient); a low precision within three times what
   rounding alone moves the per-sequence run from its fp32 reference (``bf16`` weights, or fp32 weights under
   ``autocast``; see :data:`ROUNDING_FACTOR`), measured per sequence as relative Frobenius distances; and on every
   backend a negative control beyond the tolerance (in fp32 at least: a model whose leak is smaller than bf16
   rounding cannot show it in bf16, and its bf16 checks are marked so), so a proof that cannot see a leak never
   passes.

>>> from padfree.proof.tiny import tiny_model
>>> result = prove(tiny_model("llama"), backends=["sdpa"], precisions=["fp32", "autocast_bf16"])
>>> [(c.backend, c.precision, c.ok) for c in result.checks]
[('padfree_sdpa', 'fp32', True), ('padfree_sdpa', 'autocast_bf16', True)]
>>> result.ok, result.unpacked_unchanged
(True, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from padfree.errors import InvalidArgumentError, PadfreeError, describe
from padfree.layout import IGNORE_INDEX

__all__ = ["first_divergence", "perturb", "prove", "stock_packed_diff"]

#: sequence lengths per packed row; the second row ends in an 11-token filler run (a padding segment)
ROWS: tuple[tuple[int, ...], ...] = ((1, 3, 70, 9), (2, 40, 30))
_WIDTH = 83

#: ``fp32``; ``bf16`` / ``fp16``: the weights cast; ``autocast_bf16`` / ``autocast_fp16``: fp32 weights under autocast
PRECISIONS = ("fp32", "bf16", "autocast_bf16", "fp16", "autocast_fp16")
FP32_TOL = 1e-5
#: a low-precision packed run may differ from the per-sequence run by this many times what rounding moves the
#: per-sequence run from fp32. Both runs round independently, each about that far from exact; measured over the sweep
#: of transformers 5.24's types the ratio is below 1 for all but two, and 2.5 at most (MoE models whose routing flips
#: near a tie), while the leaking control measures 25-160 times it on all but four models (whose checks in that
#: precision are then marked blind, the fp32 check being the one that sees a leak).
ROUNDING_FACTOR = 3.0


@dataclasses.dataclass(frozen=True)
class Check:
    """One backend in one precision.

    Attributes:
        backend: the attention implementation that ran (``padfree_sdpa``, ..., ``none`` without attention).
        precision: one of :data:`PRECISIONS`.
        logits: fp32: the largest ``|packed - alone|`` over every logit, divided by ``max(1, max |logit|)``; low
            precision: ``‖packed - alone‖ / ‖alone_fp32‖`` over every sequence's logits.
        grads: the same measure over every parameter gradient (None when not compared).
        loss: ``|packed - alone|``: the loss the packed model computes itself from ``labels=`` against the
            token-mean cross-entropy of every sequence alone.
        tolerance: the bound ``logits`` must meet; ``grads_tolerance`` for ``grads``, ``loss_tolerance`` for
            ``loss``.
        leak: the ``logits`` measure of the negative control (positions that never restart); must exceed
            ``tolerance``.
        worst: the parameter with the largest gradient difference.
    """

    backend: str
    precision: str
    logits: float
    loss: float
    grads: float | None
    tolerance: float
    grads_tolerance: float
    loss_tolerance: float
    leak: float
    worst: str | None = None

    @property
    def ok(self) -> bool:
        """Logits, loss and gradients within tolerance (whether the control could see a leak is
        :attr:`sees_leaks`; a :class:`Proof` needs that of at least one precision per backend)."""
        grads_ok = self.grads is None or self.grads <= self.grads_tolerance
        return self.logits <= self.tolerance and self.loss <= self.loss_tolerance and grads_ok

    @property
    def sees_leaks(self) -> bool:
        """The negative control exceeded the tolerance: this check can tell a leak from rounding."""
        return self.leak > self.tolerance

    def __str__(self) -> str:
        grads = "not compared" if self.grads is None else f"{self.grads:.1e} (tol {self.grads_tolerance:.1e})"
        verdict = ("MISMATCH" if not self.ok else "OK" if self.sees_leaks else "OK*")
        control = "" if self.sees_leaks else " (within rounding: this precision cannot see a leak here)"
        return (f"{verdict:<8} {self.backend:<14} {self.precision:<14} logits {self.logits:.1e} (tol "
                f"{self.tolerance:.1e}), loss {self.loss:.1e}, grads {grads}, leaking control {self.leak:.1e}{control}")


@dataclasses.dataclass
class Proof:
    """Every :class:`Check` of one model, the backends that could not be configured, and the unpacked check.

    Attributes:
        checks: one per (backend, precision) that ran.
        refused: requested backend -> why ``configure_packing`` refused it (its first line).
        unpacked_unchanged: an ordinary padded batch gives the same logits configured and unconfigured.
        mixers: the report's mixer descriptions (qualified name -> implementation).
        unrunnable: ``"backend/precision"`` -> why the model's own per-sequence forward fails there (nothing for a
            packed run to match; the precision is not proven, and not counted against the model); ``"labels"`` ->
            why the model's own loss from ``labels=`` fails or is not the token-mean cross-entropy of its logits on
            a sequence alone (the packed step's loss is then that cross-entropy, computed here).
    """

    checks: list[Check]
    refused: dict[str, str]
    unpacked_unchanged: bool
    mixers: dict[str, str] = dataclasses.field(default_factory=dict)
    unrunnable: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def blind(self) -> list[str]:
        """Backends on which no precision's leaking control exceeded its tolerance (the proof cannot see a leak)."""
        backends = dict.fromkeys(c.backend for c in self.checks)
        return [b for b in backends if not any(c.sees_leaks for c in self.checks if c.backend == b)]

    @property
    def ok(self) -> bool:
        """At least one check ran, every check is within tolerance, every backend's proof can see a leak (its
        control exceeds the tolerance in some precision, fp32 in practice), and unpacked batches are untouched."""
        return (bool(self.checks) and all(c.ok for c in self.checks) and not self.blind
                and self.unpacked_unchanged)

    def __str__(self) -> str:
        lines = [str(c) for c in self.checks]
        lines += [f"REFUSED    {name}: {why}" for name, why in self.refused.items()]
        lines += [f"NOT RUN    {name}: {why}" for name, why in self.unrunnable.items()]
        lines.append(f"unpacked batch {'unchanged' if self.unpacked_unchanged else 'CHANGED'} by configuring")
        return "\n".join(lines)


def perturb(model: torch.nn.Module, *, seed: int = 0, scale: float = 0.02) -> torch.nn.Module:
    """Add ``N(0, scale²)`` to every floating-point parameter of ``model`` (in place; returns it).

    Models initialise some paths to exactly zero (relative-position projections, gates, residual scales); a leak
    through such a path is invisible on freshly initialised tiny weights. A small offset everywhere makes every path
    carry signal, so the proof sees what trained weights would do.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return model


# ---- the case ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Case:
    ids: torch.Tensor  # (B, T)
    positions: torch.Tensor  # (B, T), restarting per sequence and for the filler run
    labels: torch.Tensor  # (B, T): the ids, IGNORE_INDEX at each sequence's first token and over the filler run
    shifted: torch.Tensor  # (B, T): each token's next id in its sequence, IGNORE_INDEX at its last and the filler
    segments: tuple[tuple[int, int, int], ...]  # (row, start, length) of every real sequence
    targets: int  # next-token targets over every sequence

    @classmethod
    def build(cls, vocab: int, device: torch.device, seed: int) -> _Case:
        g = torch.Generator().manual_seed(seed)
        low = min(3, vocab - 1)  # clear of the usual pad / bos / eos ids
        ids = torch.randint(low, vocab, (len(ROWS), _WIDTH), generator=g)
        pos = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE_INDEX)
        shifted = torch.full_like(ids, IGNORE_INDEX)
        segments = []
        for row, lengths in enumerate(ROWS):
            col = 0
            for n in lengths:
                pos[row, col:col + n] = torch.arange(n)
                labels[row, col + 1:col + n] = ids[row, col + 1:col + n]
                shifted[row, col:col + n - 1] = ids[row, col + 1:col + n]
                segments.append((row, col, n))
                col += n
            pos[row, col:] = torch.arange(_WIDTH - col)
        return cls(ids.to(device), pos.to(device), labels.to(device), shifted.to(device), tuple(segments),
                   sum(n - 1 for *_, n in segments))


def _logits(model: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    return model(**_with_types(model, inputs), use_cache=False).logits


def _with_types(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs``, with the token types of a text row for a model whose attention is causal only by them (a
    prefix-LM such as PaliGemma: every text token a prefix token, type 0) — without them its backends disagree on a
    sequence alone, and padfree refuses the row."""
    from padfree.model import images

    rule = images.block_rule(model)
    if rule is None or not rule.per_sample or rule.source in inputs:
        return inputs
    return {**inputs, rule.source: torch.zeros_like(inputs["input_ids"])}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _alone(model: torch.nn.Module, case: _Case, grads: bool) -> tuple[list[torch.Tensor], float, dict]:
    """Every sequence alone: its logits, the token-mean loss over all of them, and the gradient of that loss."""
    model.zero_grad(set_to_none=True)
    outs, total = [], 0.0
    for row, start, n in case.segments:
        ids = case.ids[row:row + 1, start:start + n]
        with torch.set_grad_enabled(grads):  # the model's own default positions, as an unpacked run has them
            logits = _logits(model, input_ids=ids)[0]
            loss = _ce(logits, ids[0]) / case.targets if n > 1 else None
        if grads and loss is not None:
            loss.backward()
        total += 0.0 if loss is None else float(loss.detach())
        outs.append(logits.detach().float())
    return outs, total, _grads(model) if grads else {}


def _packed_logits(model: torch.nn.Module, case: _Case, *, leak: bool = False) -> list[torch.Tensor]:
    """Every sequence's logits from one packed forward without labels or gradients; ``leak``: positions that
    never restart (the negative control)."""
    pos = torch.arange(_WIDTH, device=case.ids.device).expand_as(case.ids) if leak else case.positions
    with torch.no_grad():
        logits = _logits(model, input_ids=case.ids, position_ids=pos)
    return [logits[row, start:start + n].float() for row, start, n in case.segments]


@dataclasses.dataclass(frozen=True)
class _LossRoute:
    """How the packed step gets its loss: ``labels`` handed to the forward (``shifted``: pre-shifted), and the
    model's ``own`` loss from them compared (else the token-mean cross-entropy of the packed logits); ``why`` not,
    when not."""

    labels: bool = True
    own: bool = True
    shifted: bool = False
    why: str | None = None


def _loss_route(model: torch.nn.Module, case: _Case, ref_logits: Sequence[torch.Tensor]) -> _LossRoute:
    """Whether the model's own loss from ``labels=`` runs on the longest sequence alone (transformers' own code,
    unconfigured) and equals the token-mean cross-entropy of its logits there: with the labels aligned to the ids
    (the model shifts them, the Hugging Face convention), or else pre-shifted (BART's decoder and its kin do not
    shift). A model whose own code does neither (GIT counts image tokens it was not given; a router's auxiliary
    term) still has its packed step proven, on the cross-entropy."""
    i = max(range(len(case.segments)), key=lambda j: case.segments[j][2])
    row, start, n = case.segments[i]
    ids = case.ids[row:row + 1, start:start + n]
    want = float(_ce(ref_logits[i], ids[0])) / (n - 1)
    found = []
    for shifted in (False, True):
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1) if shifted else ids
        try:
            with torch.no_grad():
                own = model(**_with_types(model, {"input_ids": ids}), labels=labels, use_cache=False).loss
        except Exception as exc:
            found.append(exc)
            continue
        if own is not None and abs(float(own) - want) <= FP32_TOL * max(1.0, abs(want)):
            return _LossRoute(shifted=shifted)
        found.append(own)
    if isinstance(found[0], Exception):
        return _LossRoute(False, False, why=f"transformers' own loss from labels= fails on a sequence alone "
                                            f"({type(found[0]).__name__}: {str(found[0])[:160]})")
    got = "no loss" if found[0] is None else f"{float(found[0]):.6g}"
    return _LossRoute(True, False, why=f"the model's own loss from labels= on a sequence alone ({got}) is not the "
                                       f"token-mean cross-entropy of its logits ({want:.6g}), the labels aligned "
                                       f"or pre-shifted")


def _packed(model: torch.nn.Module, case: _Case, grads: bool, route: _LossRoute = _LossRoute()
            ) -> tuple[list[torch.Tensor], float, dict]:
    """One packed training step: the forward with ``labels=`` and the loss the model computes from them (what a
    trainer runs: the labels travel down the model's ``**kwargs`` next to the layout), and its backward."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        labels = (case.shifted if route.shifted else case.labels) if route.labels else None
        out = model(**_with_types(model, {"input_ids": case.ids, "position_ids": case.positions}), labels=labels,
                    use_cache=False)
        loss = out.loss
        if not route.own:
            loss = sum(_ce(out.logits[row, start:start + n], case.ids[row, start:start + n])
                       for row, start, n in case.segments if n > 1) / case.targets
    if grads:
        loss.backward()
    per = [out.logits[row, start:start + n].detach().float() for row, start, n in case.segments]
    return per, float(loss.detach()), _grads(model) if grads else {}


def _flat(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _rel(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a - b).norm() / scale.norm().clamp_min(1e-30))


def _max_scaled(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    fa, fb = _flat(a), _flat(b)
    return float((fa - fb).abs().max() / max(1.0, float(fb.abs().max())))


def _grad_measure(got: dict, ref: dict, scale: dict | None) -> tuple[float, str | None]:
    """fp32 (``scale`` None): the largest scaled absolute difference and where; else the relative distance."""
    names = sorted(ref.keys() | got.keys())
    if not names:
        return 0.0, None

    def get(d, n):
        return d[n] if n in d else torch.zeros_like(ref.get(n, got.get(n)))

    if scale is None:
        worst, where = -1.0, None
        for n in names:
            d = float((get(got, n) - get(ref, n)).abs().max() / max(1.0, float(get(ref, n).abs().max())))
            if d > worst:
                worst, where = d, n
        return worst, where
    a, b, s = (_flat([get(d, n) for n in names]) for d in (got, ref, scale))
    per = {n: float((get(got, n) - get(ref, n)).norm()) for n in names}
    return _rel(a, b, s), max(per, key=per.get)


# ---- precisions --------------------------------------------------------------------------------------------------


def _low_dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision.endswith("fp16") else torch.bfloat16


@contextlib.contextmanager
def _precision(model: torch.nn.Module, precision: str, configure: Callable[[torch.nn.Module], Any]
               ) -> Iterator[torch.nn.Module]:
    """The model to run in ``precision`` (a configured low-precision copy for cast weights), inside autocast
    where the precision asks for it."""
    device = next(model.parameters()).device
    if precision in ("bf16", "fp16"):
        twin = copy.deepcopy(model).to(_low_dtype(precision))
        configure(twin)
        yield twin
    elif precision.startswith("autocast_"):
        with torch.autocast(device.type, dtype=_low_dtype(precision)):
            yield model
    else:
        yield model


# ---- the proof ---------------------------------------------------------------------------------------------------


def _vocab(model: torch.nn.Module) -> int:
    """The size of the vocabulary the model reads (a multimodal model's is its text config's)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "vocab_size", 0) or getattr(text, "vocab_size", 0) or 0)


def _unpacked_logits(model: torch.nn.Module, case: _Case) -> torch.Tensor:
    """An ordinary right-padded batch of two sequences with a 0/1 mask (transformers' own path)."""
    (r0, s0, n0), (r1, s1, n1) = case.segments[2], case.segments[-1]
    width = max(n0, n1)
    ids = torch.zeros(2, width, dtype=case.ids.dtype, device=case.ids.device)
    mask = torch.zeros_like(ids)
    for i, (row, start, n) in enumerate(((r0, s0, n0), (r1, s1, n1))):
        ids[i, :n] = case.ids[row, start:start + n]
        mask[i, :n] = 1
    with torch.no_grad():
        logits = _logits(model, input_ids=ids, attention_mask=mask).float()
    return logits * mask.unsqueeze(-1)  # padded positions are not compared


def prove(
    model: torch.nn.Module, backends: Sequence[str] = ("sdpa",),
    precisions: Sequence[str] | Mapping[str, Sequence[str]] = ("fp32",), *,
    grads: bool = True, seed: int = 1, configure: Callable[..., Any] | None = None,
) -> Proof:
    """Configure ``model`` for each backend and measure packed against per-sequence in each precision.

    Args:
        model: an fp32 transformers causal LM (a tiny one: the check runs the fixed case of :data:`ROWS`);
            it is left unconfigured afterwards, its weights untouched.
        backends: names ``configure_packing`` accepts; a backend it refuses is recorded in ``Proof.refused``.
        precisions: from :data:`PRECISIONS` (``fp16`` variants need CUDA), for every backend, or a mapping
            backend -> precisions (a backend it does not name runs fp32 only).
        grads: compare every parameter gradient too.
        seed: the random tokens of the case.
        configure: ``f(model, backend=...)`` that installs the packing machinery; default: configure_packing's
            machinery without its support decision (what is being decided here).
    """
    from padfree.model import install as _install

    if configure is None:
        configure = _install.install_packing
    per_backend = dict(precisions) if isinstance(precisions, Mapping) else {b: tuple(precisions) for b in backends}
    named = [p for ps in per_backend.values() for p in ps]
    unknown = [p for p in named if p not in PRECISIONS]
    if unknown or not named:
        raise InvalidArgumentError(f"precisions must be a non-empty list of {', '.join(PRECISIONS)}; got "
                                   f"{describe(precisions)}")
    params = list(model.parameters())
    if not params or params[0].dtype != torch.float32:
        raise InvalidArgumentError(f"prove() takes an fp32 model (the fp32 run is the reference); got "
                                   f"{describe(params[0].dtype if params else None)}")
    device = params[0].device
    vocab = _vocab(model)
    if vocab < 4:
        raise InvalidArgumentError(f"the model's config.vocab_size must be >= 4 to draw test tokens, got {vocab}")
    case = _Case.build(vocab, device, seed)
    was_training = model.training
    model.eval()
    checks, refused, unchanged, mixers, unrunnable = [], {}, True, {}, {}
    # the caller's autocast (configure_packing called inside one certifies here) would turn the fp32 reference
    # into a bf16 run: off, and each autocast precision switches its own on
    ambient = torch.autocast(device.type, enabled=False)
    ambient.__enter__()
    try:
        base = _unpacked_logits(model, case)
        ref_logits, ref_loss, ref_grads = _alone(model, case, grads)
        route = _loss_route(model, case, ref_logits)
        if route.why is not None:
            unrunnable["labels"] = route.why
        for backend in backends:
            try:
                report = configure(model, backend=backend)
            except PadfreeError as exc:
                refused[backend] = str(exc).splitlines()[0]
                continue
            mixers = dict(getattr(report, "mixers", {}) or {})
            name = getattr(report, "backend", backend)
            after = _unpacked_logits(model, case)
            unchanged &= _max_scaled([after], [base]) <= FP32_TOL
            for precision in per_backend.get(backend, ("fp32",)):
                try:
                    checks.append(_check(model, case, name, precision, grads, (ref_logits, ref_loss, ref_grads),
                                         lambda m, b=backend: configure(m, backend=b), route))
                except _Unrunnable as exc:
                    unrunnable[f"{name}/{precision}"] = str(exc)
            _install.unconfigure_packing(model)
    finally:
        ambient.__exit__(None, None, None)
        _install.unconfigure_packing(model)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return Proof(checks, refused, unchanged, mixers, unrunnable)


class _Unrunnable(Exception):
    """The per-sequence reference itself cannot run in this precision (a limitation of the model's own code)."""


def _check(model: torch.nn.Module, case: _Case, backend: str, precision: str, grads: bool,
           reference: tuple[list[torch.Tensor], float, dict], configure: Callable, route: _LossRoute) -> Check:
    ref_logits, ref_loss, ref_grads = reference
    with _precision(model, precision, configure) as run:
        if precision == "fp32":
            alone_logits, alone_loss, alone_grads = ref_logits, ref_loss, ref_grads
        else:
            try:  # every sequence alone runs transformers' own code: if that fails, there is nothing to match
                alone_logits, alone_loss, alone_grads = _alone(run, case, grads)
            except Exception as exc:
                raise _Unrunnable(f"transformers' own per-sequence forward fails in {precision} "
                                  f"({type(exc).__name__}: {str(exc)[:160]})") from exc
        packed_logits, packed_loss, packed_grads = _packed(run, case, grads, route)
        leak_logits = _packed_logits(run, case, leak=True)
        run.zero_grad(set_to_none=True)
    loss = abs(packed_loss - alone_loss)
    if precision == "fp32":
        measure = _max_scaled(packed_logits, alone_logits)
        g, worst = _grad_measure(packed_grads, alone_grads, None) if grads else (None, None)
        return Check(backend, precision, measure, loss, g, FP32_TOL, FP32_TOL, FP32_TOL * max(1.0, abs(ref_loss)),
                     _max_scaled(leak_logits, alone_logits), worst)
    # per sequence, relative to its fp32 logits: a leak concentrates on the sequences that follow a boundary,
    # rounding spreads evenly; the largest per-sequence distance keeps both visible
    noise = _per_sequence(alone_logits, ref_logits, ref_logits)
    tol = max(ROUNDING_FACTOR * noise, FP32_TOL)
    measure = _per_sequence(packed_logits, alone_logits, ref_logits)
    leak = _per_sequence(leak_logits, alone_logits, ref_logits)
    g, g_tol, worst = None, tol, None
    if grads:
        g_noise, _ = _grad_measure(alone_grads, ref_grads, ref_grads)
        g_tol = max(ROUNDING_FACTOR * g_noise, FP32_TOL)
        g, worst = _grad_measure(packed_grads, alone_grads, ref_grads)
    # the loss averages every token: its rounding is at most the logits' relative rounding times its size
    loss_tol = max(ROUNDING_FACTOR * abs(alone_loss - ref_loss), tol * max(1.0, abs(ref_loss)))
    return Check(backend, precision, measure, loss if math.isfinite(loss) else math.inf, g, tol, g_tol, loss_tol,
                 leak, worst)


def _per_sequence(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    """The largest ``‖got_i - want_i‖ / ‖ref_i‖`` over the sequences."""
    return max(_rel(a, b, r) for a, b, r in zip(got, want, ref, strict=True))


# ---- where a mismatch starts -------------------------------------------------------------------------------------


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    if hasattr(output, "to_tuple"):
        return _first_tensor(output.to_tuple())
    return None


def _token_tensor(value: Any, shape: tuple[int, int]) -> torch.Tensor | None:
    """``value`` (or its first tensor) when it is a float ``(rows, tokens, ...)`` tensor of ``shape``, or one row
    broadcast over the batch; else None."""
    out = _first_tensor(value)
    if (out is not None and out.dim() >= 2 and out.shape[1] == shape[1] and out.shape[0] in (1, shape[0])
            and out.is_floating_point()):
        return out.detach().float()
    return None


@dataclasses.dataclass
class _Call:
    name: str
    inputs: torch.Tensor | None
    output: torch.Tensor | None


@contextlib.contextmanager
def _recording(model: torch.nn.Module, shape: tuple[int, int]) -> Iterator[list[_Call]]:
    """Every module call, in completion order, with its token-shaped input (the first positional tensor or
    ``hidden_states``) and output over a ``shape = (rows, tokens)`` batch."""
    calls: list[_Call] = []
    pending: dict[int, list[torch.Tensor | None]] = {}
    handles = []
    for name, module in model.named_modules():
        def before(mod, args, kwargs):
            first = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            pending.setdefault(id(mod), []).append(_token_tensor(first, shape))

        def after(mod, args, kwargs, output, name=name):
            stack = pending.get(id(mod)) or [None]
            calls.append(_Call(name, stack.pop(), _token_tensor(output, shape)))

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def first_divergence(model: torch.nn.Module, backend: str = "auto", *, seed: int = 1,
                     configure: Callable[..., Any] | None = None) -> str | None:
    """The qualified name of the module where a packing leak enters: the first module call (in completion order)
    whose output on the packed case differs from its output on the sequence alone — or, when its input already
    differed, the innermost enclosing module whose input still agreed (the leak is in that module's own code, as
    with an attention module computing its own mask). None if no module output differs.

    Tensors are compared on the real tokens of every sequence; a module called several times per forward is
    compared call by call. ``model`` (fp32) is left unconfigured.
    """
    from padfree.model import install as _install

    configure = configure or _install.install_packing
    device = next(model.parameters()).device
    case = _Case.build(_vocab(model), device, seed)
    was_training = model.training
    model.eval()
    alone: list[list[_Call]] = []
    try:
        with torch.no_grad():
            for row, start, n in case.segments:
                with _recording(model, (1, n)) as calls:
                    _logits(model, input_ids=case.ids[row:row + 1, start:start + n])
                alone.append(calls)
            configure(model, backend=backend)
            with _recording(model, tuple(case.ids.shape)) as packed:
                _logits(model, input_ids=case.ids, position_ids=case.positions)
    finally:
        _install.unconfigure_packing(model)
        model.train(was_training)

    def differs(got: torch.Tensor | None, name: str, k: int, field: str) -> bool | None:
        """Whether the packed tensor differs from the lone ones on any sequence (None: nothing to compare)."""
        verdict = None
        for (row, start, n), calls in zip(case.segments, alone, strict=True):
            mine = [getattr(c, field) for c in calls if c.name == name]
            ref = mine[k] if k < len(mine) else None
            if got is None or ref is None or ref.shape[2:] != got.shape[2:]:
                continue
            piece = got[row if got.shape[0] > 1 else 0, start:start + n]
            if float((piece - ref[0]).abs().max()) > 1e-4 * max(1.0, float(ref[0].abs().max())):
                return True
            verdict = False
        return verdict

    seen: dict[str, int] = {}
    index = {}  # (name, k) -> packed call
    order = []
    for call in packed:
        k = seen[call.name] = seen.get(call.name, -1) + 1
        index[call.name, k] = call
        order.append((call.name, k))
    for name, k in order:
        if not differs(index[name, k].output, name, k, "output"):
            continue
        while differs(index[name, k].inputs, name, k, "inputs") and name:  # it came in: look at the caller
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            k = max((j for (n, j) in index if n == parent), default=0)
            if (parent, k) not in index:
                break
            name = parent
        return name or type(model).__name__
    return None


def stock_packed_diff(model: torch.nn.Module, *, seed: int = 1) -> float:
    """What stock transformers does with the packed case on an unconfigured ``model``: the fp32 logits measure
    (largest scaled ``|packed - alone|``) of restarting ``position_ids``, no mask and no cache. Raises what the
    model raises."""
    device = next(model.parameters()).device
    case = _Case.build(_vocab(model), device, seed)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone, _, _ = _alone(model, case, False)
            packed = _packed_logits(model, case)
    finally:
        model.train(was_training)
    return _max_scaled(packed, alone)
