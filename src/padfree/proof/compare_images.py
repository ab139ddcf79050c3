"""Images in a packed row against each sample alone, on one tiny vision-language model: the images verdict.

:func:`prove_images` takes :func:`padfree.model.images.probe_samples`' three samples (an image; text only; two
images), runs each alone through the model as transformers runs it (the reference), then installs padfree's
packing machinery and runs them as one packed row (:func:`padfree.model.images.pack_samples`: tokens side by side,
``position_ids`` restarting, the images concatenated in row order) — a training step: the model's own loss from
``labels=`` and its backward. It compares logits, the loss (the token mean over every sample) and every gradient,
the vision tower's included, and runs a negative control the same comparison must catch: the images in the wrong
order (causal route), positions that never restart (rope route), the blocks left out (blocks route).

Under ``precision="autocast_bf16"`` (fp32 weights, bf16 autocast, as users train) the packed row may differ from the
samples alone by :data:`padfree.proof.compare.ROUNDING_FACTOR` times what rounding moves the samples alone from their
fp32 run — per measure —, and the control must land beyond that.

>>> import transformers
>>> from padfree.proof.shrink import default_config, shrink_config
>>> torch.manual_seed(0) and None
>>> model = transformers.LlavaForConditionalGeneration(shrink_config(default_config("llava")))
>>> proof = prove_images(model)
>>> proof.route, proof.ok
('causal', True)
>>> {precision: proof.ok for precision, proof in prove_images_in(model).items()}  # both, sharing the fp32 runs
{'fp32': True, 'autocast_bf16': True}
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch

from padfree.errors import InvalidArgumentError, PadfreeError
from padfree.layout import IGNORE_INDEX
from padfree.model import images
from padfree.model.install import install_packing, unconfigure_packing
from padfree.proof.compare import ROUNDING_FACTOR

__all__ = ["prove_images", "prove_images_in"]

FP32_TOL = 1e-5
#: the precisions :func:`prove_images` runs in
IMAGE_PRECISIONS = ("fp32", "autocast_bf16")
# parameters on the image path (the tower, its projector, a resampler): at least one must have a compared gradient
_IMAGE_PATH = re.compile(r"(vision|visual|image|multi_modal|mm_|projector|connector|perceiver|resampler)")


@dataclasses.dataclass(frozen=True)
class ImageProof:
    """The images verdict of one model on one backend (fp32).

    Attributes:
        model_type: the model's ``config.model_type``.
        route: :func:`padfree.model.images.image_route` (``"rope"``, ``"blocks"``, ``"causal"``) or None.
        backend: the attention backend the packed row ran on (None when it did not run).
        logits: the largest ``|packed - alone|`` over every logit, divided by ``max(1, max |logit|)``.
        loss: ``|packed - alone|``: the model's own loss on the packed row against the token mean of every sample's.
        grads: the largest gradient difference of any parameter, divided by ``max(1, its largest gradient)``.
        image_grads: how many parameters of the image path (tower, projector) had their gradients compared.
        control: the ``logits`` measure of the negative control; must exceed ``tolerance``.
        refused: why padfree refuses this model's images (naming the module), or why the proof could not run;
            None when it ran.
        tolerance: the bound of ``logits`` (and of the control's floor): ``FP32_TOL`` in fp32, else the rounding
            bound.
        loss_tolerance, grad_tolerance: the bounds of ``loss`` and ``grads``.
        precision: one of :data:`IMAGE_PRECISIONS`.
    """

    model_type: str
    route: str | None
    backend: str | None = None
    logits: float | None = None
    loss: float | None = None
    grads: float | None = None
    image_grads: int = 0
    control: float | None = None
    refused: str | None = None
    tolerance: float = FP32_TOL
    loss_tolerance: float = FP32_TOL
    grad_tolerance: float = FP32_TOL
    precision: str = "fp32"

    @property
    def ok(self) -> bool:
        """Exact: it ran, every measure within its tolerance, the image path's gradients compared, and the control
        caught."""
        measures = (self.logits, self.loss, self.grads, self.control)
        return self.refused is None and None not in measures and self.logits <= self.tolerance and \
            self.loss <= self.loss_tolerance and self.grads <= self.grad_tolerance and \
            self.control > self.tolerance and self.image_grads > 0


def _labels(ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``ids`` as labels with every sample's first token ignored (nothing predicts it from the sample before)."""
    labels = ids.clone()
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    labels[0, starts] = IGNORE_INDEX
    return labels


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _alone(model: torch.nn.Module, samples: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, float, dict]:
    model.zero_grad(set_to_none=True)
    total = sum(s["input_ids"].shape[1] - 1 for s in samples)
    logits, loss = [], 0.0
    for s in samples:
        out = model(**s, labels=s["input_ids"], use_cache=False)
        part = out.loss * (s["input_ids"].shape[1] - 1) / total
        part.backward()
        loss += float(part.detach())
        logits.append(out.logits[0].detach())
    return torch.cat(logits), loss, _grads(model)


def _packed(model: torch.nn.Module, row: dict[str, Any], lengths: Sequence[int], grads: bool = True
            ) -> tuple[torch.Tensor, float, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**row, labels=_labels(row["input_ids"], lengths), use_cache=False)
    if grads:
        out.loss.backward()
    return out.logits[0].detach(), float(out.loss.detach()), _grads(model) if grads else {}


def _scaled(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def _grad_measure(got: dict, want: dict) -> float:
    names = got.keys() | want.keys()

    def get(d, n):
        return d[n] if n in d else torch.zeros_like(want.get(n, got.get(n)))

    return max((_scaled(get(got, n), get(want, n)) for n in names), default=0.0)


def _control(model: torch.nn.Module, route: str, row: dict[str, Any], samples: Sequence[dict[str, Any]]
             ) -> dict[str, Any]:
    """The packed row with the one thing wrong that the route's layout must get right."""
    if route == "rope":  # positions running on over the row: one sequence, rotary rows over the whole row
        return {**row, "position_ids": torch.arange(row["input_ids"].shape[1])[None]}
    if route == "blocks":  # no blocks: the images causal
        source = images.block_rule(model).source
        return {**row, source: torch.zeros_like(row[source])}
    # causal: the samples' images in reverse sample order (the placeholder counts still add up, each sample's
    # placeholders get another sample's features)
    flipped = images.pack_samples(model, list(reversed(samples)))
    return {**row, **{k: v for k, v in flipped.items() if k not in ("input_ids", "position_ids")}}


def _autocast(precision: str, device: torch.device) -> Any:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def prove_images(model: torch.nn.Module, backend: str = "sdpa", *, seed: int = 0,
                 precision: str = "fp32") -> ImageProof:
    """Packed against alone for ``model``'s images (see the module's docstring).

    Args:
        model: a tiny fp32 vision-language model, not configured; it is left unconfigured, in the mode it came in,
            its weights untouched (its gradients cleared).
        backend: the attention backend ``install_packing`` takes (``"sdpa"``, ``"eager"``, ...).
        seed: the random tokens and pixels of the probe samples.
        precision: ``"fp32"`` or ``"autocast_bf16"`` (:data:`IMAGE_PRECISIONS`).

    Returns:
        An :class:`ImageProof`: ``refused`` says why it did not run (no route — the model's own reason —, no probe
        samples for its config, padfree refusing the backend, the model's own forward failing on the samples).
    """
    return prove_images_in(model, (precision,), backend, seed=seed)[precision]


def prove_images_in(model: torch.nn.Module, precisions: Sequence[str] = IMAGE_PRECISIONS, backend: str = "sdpa", *,
                    seed: int = 0) -> dict[str, ImageProof]:
    """:func:`prove_images` in each of ``precisions`` (a subset of :data:`IMAGE_PRECISIONS`), sharing what they
    have in common: the probe samples, their fp32 runs alone (every low precision's reference) and one
    ``install_packing``. Each proof is the one :func:`prove_images` gives in that precision (the module's example
    runs it).
    """
    precisions = tuple(precisions) if not isinstance(precisions, str) else (precisions,)
    bad = [p for p in precisions if p not in IMAGE_PRECISIONS]
    if bad or not precisions:
        raise InvalidArgumentError(f"precision must be one of {IMAGE_PRECISIONS}, got "
                                   f"{bad[0] if bad else precisions!r}")
    model_type = str(getattr(model.config, "model_type", type(model).__name__))
    route = images.image_route(model)

    def every(**fields: Any) -> dict[str, ImageProof]:  # one verdict for every precision (the proof did not run)
        return {p: ImageProof(model_type, route, precision=p, **fields) for p in precisions}

    if route is None:
        return every(refused=images.image_refusal(model))
    try:
        samples = images.probe_samples(model, seed=seed)
    except (RuntimeError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        return every(refused=f"no probe samples for this {type(model).__name__} config: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    if samples is None:
        return every(refused=f"no probe samples for this {type(model).__name__} config "
                             f"(its image tokens or resolutions do not fit its tower)")
    lengths = [s["input_ids"].shape[1] for s in samples]
    row = images.pack_samples(model, samples)
    device = next(model.parameters()).device
    samples = [{k: v.to(device) for k, v in s.items()} for s in samples]
    row = {k: v.to(device) for k, v in row.items()}
    was_training = model.training
    model.eval()
    try:
        def alone_failed(exc: Exception) -> str:
            return f"the samples do not run alone through {type(model).__name__}: {str(exc).splitlines()[0]}"

        try:
            exact, exact_loss, exact_grads = _alone(model, samples)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            return every(refused=alone_failed(exc))
        fp32 = {"tolerance": FP32_TOL, "loss_tolerance": FP32_TOL, "grad_tolerance": FP32_TOL}
        references, tolerances, proofs = {}, {}, {}
        for p in precisions:
            if p == "fp32":
                references[p], tolerances[p] = (exact, exact_loss, exact_grads), fp32
                continue
            try:
                with _autocast(p, device):
                    want, want_loss, want_grads = references[p] = _alone(model, samples)
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                proofs[p] = ImageProof(model_type, route, refused=alone_failed(exc), precision=p)
                continue
            # what rounding alone moves the samples from their fp32 run
            tolerances[p] = {"tolerance": max(FP32_TOL, ROUNDING_FACTOR * _scaled(want.float(), exact)),
                             "loss_tolerance": max(FP32_TOL, ROUNDING_FACTOR * abs(want_loss - exact_loss)),
                             "grad_tolerance": max(FP32_TOL, ROUNDING_FACTOR * _grad_measure(want_grads, exact_grads))}
        try:
            report = install_packing(model, backend=backend)
        except PadfreeError as exc:
            return {**every(refused=str(exc).splitlines()[0]), **proofs}
        ran = getattr(report, "backend", backend)
        for p in (p for p in precisions if p not in proofs):
            want, want_loss, want_grads = references[p]
            try:
                with _autocast(p, device):
                    got, loss, grads = _packed(model, row, lengths)
                    with torch.no_grad():
                        wrong, _, _ = _packed(model, _control(model, route, row, samples), lengths, grads=False)
            except PadfreeError as exc:
                proofs[p] = ImageProof(model_type, route, ran, refused=str(exc).splitlines()[0], precision=p)
                continue
            compared = [n for n in want_grads if _IMAGE_PATH.search(n) and not n.startswith("lm_head")]
            proofs[p] = ImageProof(model_type, route, ran, logits=_scaled(got.float(), want.float()),
                                   loss=abs(loss - want_loss), grads=_grad_measure(grads, want_grads),
                                   image_grads=len(compared), control=_scaled(wrong.float(), want.float()),
                                   precision=p, **tolerances[p])
        return {p: proofs[p] for p in precisions}
    finally:
        unconfigure_packing(model)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
