"""The causal-LM loss without the logits: cross-entropy fused with the LM head, over target positions only.

A packed row is long, so its logits are the largest tensor of a training step: ``positions x vocabulary`` floats
(8k positions x 32k vocabulary = 1 GB in float32), written by the head, read and rewritten by the softmax and its
backward, several times over. :func:`linear_cross_entropy` computes the loss a chunk of positions at a time and the
gradients of the hidden states and of the head in the same pass, so no logits outlive their chunk and the chunk's
buffer is reused: memory drops from a few ``N x V`` tensors to one ``chunk x V`` buffer, and the step from
``N x V`` memory traffic several times over to once. Positions without a target (the first token of every sequence,
padding, a masked prompt) are left out before the head, so they cost nothing.

:func:`causal_lm_loss` runs a Hugging Face causal LM up to its head (the head's input is caught, the head itself
is not run), then applies the head the way the model does — its scale (Cohere's ``logit_scale``, Granite's
``logits_scaling``) and final soft-capping (Gemma 2 / 3) included — and refuses a model whose logits it cannot
reproduce (checked once per model on a few tokens).

>>> import torch
>>> from padfree.proof.tiny import tiny_model
>>> model = tiny_model("llama")
>>> ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
>>> labels = torch.tensor([[-100, 6, 7, -100, 9, 10]])  # two sequences: [5, 6, 7] and [8, 9, 10]
>>> inputs = {"input_ids": ids, "labels": labels, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
>>> stock = model(**inputs, use_cache=False).loss  # no cache: transformers honours the restarting positions
>>> fused = causal_lm_loss(model, inputs)
>>> bool(torch.allclose(fused, stock, atol=1e-6))
True
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from padfree.errors import InvalidArgumentError, UnsupportedModelError, describe
from padfree.layout import IGNORE_INDEX
from padfree.model.wrappers import unwrap_model
from padfree.packing.inputs import as_int
from padfree.step_loss import LossRule

__all__ = ["causal_lm_loss", "check_head_arguments", "chunk_logits", "default_chunk_size", "head_inputs",
           "linear_cross_entropy", "materialised_head", "verified_head_transform"]

_INT64_MAX = 2**63 - 1
_CHUNK_BYTES = 1 << 27  # one chunk of float32 logits: 128 MiB (1,024 positions of a 32k vocabulary)


def default_chunk_size(vocab_size: int) -> int:
    """Positions per chunk: a float32 ``chunk x vocab`` buffer of about 128 MiB, a multiple of 8, at least 128.

    >>> default_chunk_size(32000), default_chunk_size(151936)
    (1048, 216)
    """
    return max(128, _CHUNK_BYTES // (4 * max(int(vocab_size), 1)) // 8 * 8)


def chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float, z: torch.Tensor,
                 low: torch.Tensor | None) -> torch.Tensor:
    """One chunk's scaled logits ``scale · (h @ weight.T + bias)`` into the float32 buffer ``z`` ``(rows, V)``; the
    product runs in the head's precision when that is not float32 (``low``, its buffer of ``z``'s shape), as the
    model's own head computes it, and is upcast. The fused heads' soft-cap and the rest follow on ``z``."""
    if low is not None:
        torch.mm(h, weight.t(), out=low)
        if bias is not None:
            low.add_(bias)
        z.copy_(low)
    else:
        torch.mm(h, weight.t(), out=z)
        if bias is not None:
            z.add_(bias)
    if scale != 1.0:
        z.mul_(scale)
    return z


class _LinearCrossEntropy(torch.autograd.Function):
    """Σ over rows of ``-log softmax(f(h W^T + b))[target]``, the gradients computed in the same pass."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, weights: torch.Tensor | None, scale: float, softcap: float | None, chunk: int,
                stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        f32, dev = torch.float32, hidden.device
        low = hidden.dtype != f32  # bf16 / fp16: the head runs in that precision, the loss in float32
        total = torch.zeros((), dtype=f32, device=dev)
        entropy = torch.zeros((), dtype=f32, device=dev)  # Σ entropy of the predicted distributions (stats)
        correct = torch.zeros((), dtype=torch.int64, device=dev)  # targets that are the arg-max (stats)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=f32, device=dev) if need_w else None
        db = torch.zeros(vocab, dtype=f32, device=dev) if need_b else None
        rows = max(min(chunk, n), 1)
        # buffers reused by every chunk: fresh chunk x V tensors would be allocated (and, on the CPU, faulted in
        # page by page) again and again
        z_buf = torch.empty((rows, vocab), dtype=f32, device=dev)
        low_buf = torch.empty((rows, vocab), dtype=hidden.dtype, device=dev) if low else None
        cap_buf = torch.empty((rows, vocab), dtype=f32, device=dev) if softcap is not None else None
        w_tmp = torch.empty_like(weight) if need_w and low else None
        ent_buf = torch.empty((rows, vocab), dtype=f32, device=dev) if stats else None
        arange = torch.arange(rows, device=dev)
        for a in range(0, n, rows):  # over chunks of positions, never over tokens
            b = min(a + rows, n)
            h, t, z, idx = hidden[a:b], targets[a:b], z_buf[: b - a], arange[: b - a]
            w = None if weights is None else weights[a:b]
            chunk_logits(h, weight, bias, scale, z, low_buf[: b - a] if low else None)
            if softcap is not None:
                z.div_(softcap).tanh_()
                torch.mul(z, z, out=cap_buf[: b - a]).neg_().add_(1.0)  # d tanh = 1 - tanh^2, for the backward
                z.mul_(softcap)
            # log-sum-exp in place (torch.logsumexp would allocate a chunk-sized temporary for the exponentials)
            top = z.amax(dim=1, keepdim=True)
            target = z[idx, t] - top[:, 0]
            z.sub_(top).exp_()
            sums = z.sum(dim=1)
            losses = sums.log() - target
            total += (losses if w is None else losses * w).sum()
            if stats:  # H = log S - Σ e·z' / S with e = exp(z'), z' = logits - max: one more pass, in a buffer
                correct += (target == 0).sum()
                entropy += (sums.log() - torch.xlogy(z, z, out=ent_buf[: b - a]).sum(dim=1) / sums).sum()
            if not (need_h or need_w or need_b):
                continue
            g = z.div_(sums[:, None])  # d loss / d logits = softmax - one_hot, in place
            g[idx, t] -= 1.0
            if softcap is not None:
                g.mul_(cap_buf[: b - a])
            if scale != 1.0:
                g.mul_(scale)
            if w is not None:
                g.mul_(w[:, None])
            if need_b:
                db += g.sum(dim=0)
            gl = low_buf[: b - a].copy_(g) if low else g
            if need_h:
                torch.mm(gl, weight, out=dh[a:b])
            if need_w:
                if low:  # a GEMM in the model's precision, accumulated over chunks in float32
                    dw += torch.mm(gl.t(), h, out=w_tmp)
                else:
                    dw.addmm_(gl.t(), h)
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(entropy, correct)
        return total, entropy, correct

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[Any, ...]:
        dh, dw, db = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        return (None if dh is None else dh * grad.to(dh.dtype),
                None if dw is None else (dw * grad).to(w_dtype),
                None if db is None else (db * grad).to(b_dtype),
                None, None, None, None, None, None)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    with_stats: bool = False,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """``(loss_sum, num_targets)``: Σ cross-entropy of ``softcap(scale * (hidden @ weight.T + bias))`` against
    ``targets``, never holding more than ``chunk_size`` rows of logits.

    Equal to ``F.cross_entropy(logits.float(), targets, reduction="sum", ignore_index=ignore_index)`` on the full
    logits (to float32 rounding), with the same gradients for ``hidden``, ``weight`` and ``bias``. The gradients
    are computed during the forward pass (the logits are gone by the backward), so a call under
    ``torch.no_grad()`` or on tensors that need no gradient computes only the loss.

    Args:
        hidden: ``(..., H)`` — the head's input, any float dtype; flattened over the leading dimensions.
        weight: ``(V, H)`` — the head's weight, same dtype.
        targets: ``(...)`` integer, the leading shape of ``hidden``; ``ignore_index`` marks positions without a
            target, which are dropped before the head.
        bias: ``(V,)`` or None.
        scale: multiplies the logits (Cohere's ``logit_scale``; ``1 / logits_scaling`` for Granite).
        softcap: ``softcap * tanh(logits / softcap)`` after the scale (Gemma 2 / 3's ``final_logit_softcapping``).
        chunk_size: rows of logits per chunk (default :func:`default_chunk_size`).
        weights: ``(...)`` float, the leading shape of ``hidden``, or None: each position's loss (and gradient) is
            multiplied by its weight in the sum — e.g. ``1 / (targets in its sequence)`` for a mean per sequence.
        with_stats: also return, over the targets, the summed entropy of the predicted distributions and the count
            of targets that are the arg-max (the "entropy" and "token accuracy" trainers log; one more pass over
            each chunk).

    Returns:
        ``loss_sum``: ``()`` float32, differentiable; ``num_targets``: ``()`` int64, the positions that had one;
        with ``with_stats``, then ``entropy_sum`` ``()`` float32 and ``num_correct`` ``()`` int64 (no gradient).

    >>> torch.manual_seed(0) is not None
    True
    >>> h, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    >>> t = torch.tensor([[1, 2, -100, 4, 5], [6, 7, 8, -100, 10]])
    >>> loss, n = linear_cross_entropy(h, w, t, chunk_size=3)
    >>> ref = F.cross_entropy((h @ w.T).reshape(-1, 11), t.reshape(-1), reduction="sum")
    >>> int(n), bool(torch.allclose(loss, ref))
    (8, True)
    """
    return _linear_cross_entropy(hidden, weight, targets, bias=bias, scale=scale, softcap=softcap,
                                 ignore_index=ignore_index, chunk_size=chunk_size, with_stats=with_stats,
                                 weights=weights, checked=False)


def check_head_arguments(hidden: Any, weight: Any, targets: Any, bias: Any, scale: Any, softcap: Any,
                         chunk_size: Any) -> None:
    """Refuse what a fused head cannot score: ``hidden`` ``(..., H)``, ``weight`` ``(V, H)``, integer ``targets`` of
    ``hidden``'s leading shape, ``bias`` None or a tensor, a finite ``scale``, ``softcap`` None or > 0, ``chunk_size``
    None or a positive int — one :class:`~padfree.errors.InvalidArgumentError` naming the argument and the value."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch tensor, got {describe(value)}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InvalidArgumentError(f"bias must be None or a torch tensor, got {describe(bias)}")
    if not math.isfinite(_number(scale, "scale", "a finite number")):
        raise InvalidArgumentError(f"scale must be a finite number, got {describe(scale)}")
    if softcap is not None:
        _number(softcap, "softcap", "None or a number > 0")
    as_int(chunk_size, "chunk_size", minimum=1, allow_none=True)
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise InvalidArgumentError(f"hidden must be (..., H) and weight (V, H) with the same H, got hidden "
                                   f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise InvalidArgumentError(f"targets must have the leading shape of hidden {tuple(hidden.shape[:-1])}, got "
                                   f"{tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise InvalidArgumentError(f"targets must be integer class ids, got dtype {targets.dtype}")
    if softcap is not None and not softcap > 0:
        raise InvalidArgumentError(f"softcap must be None or > 0, got {describe(softcap)}")


def _linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          bias: torch.Tensor | None, scale: float, softcap: float | None, ignore_index: int,
                          chunk_size: int | None, with_stats: bool, weights: torch.Tensor | None,
                          checked: bool) -> tuple[torch.Tensor, ...]:
    """:func:`linear_cross_entropy`; ``checked``: the targets' range was already checked by the caller (in the one
    host read it makes anyway), so it is not read back again here."""
    check_head_arguments(hidden, weight, targets, bias, scale, softcap, chunk_size)
    if weights is not None and not isinstance(weights, torch.Tensor):
        raise InvalidArgumentError(f"weights must be None or a torch tensor, got {describe(weights)}")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else int(chunk_size)
    flat_t = targets.reshape(-1)
    keep = (flat_t != ignore_index).nonzero().squeeze(1)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)  # positions without a target never reach the head
    t = flat_t.index_select(0, keep).long()
    w = None
    if weights is not None:
        if tuple(weights.shape) != tuple(targets.shape) or not weights.dtype.is_floating_point:
            raise InvalidArgumentError(f"weights must be floats of the targets' shape {tuple(targets.shape)}, got "
                                       f"{tuple(weights.shape)} {weights.dtype}")
        w = weights.reshape(-1).index_select(0, keep).float().detach()
    if not checked and t.numel():
        lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one host read for both ends
        if lo < 0 or hi >= weight.shape[0]:
            bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
            where = _first(bad)
            raise InvalidArgumentError(f"targets{list(where)} = {int(targets[where])} is not a class: targets must be "
                                       f"in [0, {weight.shape[0]}) or ignore_index={ignore_index}")
    count = torch.tensor(t.numel(), dtype=torch.int64)
    if t.numel() == 0:  # keep the graph: a zero that still flows into every input's gradient
        zero = (hidden.sum() * 0 + weight.sum() * 0).float()
        loss = zero if bias is None else zero + bias.sum().float() * 0
        entropy, correct = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    else:
        loss, entropy, correct = _LinearCrossEntropy.apply(h, weight, bias, t, w, float(scale), softcap, chunk,
                                                           bool(with_stats))
    return (loss, count, entropy, correct) if with_stats else (loss, count)


# --------------------------------------------------------------------------------------------------
# A Hugging Face causal LM
# --------------------------------------------------------------------------------------------------


def _number(value: Any, name: str, accepted: str) -> float:
    """``float(value)`` of a real number (a numpy or 0-d torch one too), never a bool or a string."""
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidArgumentError(f"{name} must be {accepted}, got {describe(value)}") from None


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """The index of the first True of ``bad``, row-major (error path only)."""
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def _vocabulary(module: Any, config: Any) -> int:
    """Rows of an embedding or head — or the config's ``vocab_size`` where its weight is not materialised here."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] > 0:
        return int(weight.shape[0])
    return int(getattr(config, "vocab_size", 0) or 0)


def _check_ids_and_labels(base: Any, inputs: Mapping[str, Any], key: str) -> None:
    """Refuse, before the forward, ids the input embedding has no row for and labels that are not a class of the
    head nor the ignored label — the embedding would stop with a bare IndexError (a device-side assert on CUDA),
    the loss with another. One host read for the whole check, which the loss makes anyway (it used to read the
    targets' range back after the forward); the offender is located only on the error path."""
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    labels = inputs[key]
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise InvalidArgumentError(f"inputs[{key!r}] must be an integer tensor of labels, got {describe(labels)}")
    ids = inputs.get("input_ids")
    ids = ids if isinstance(ids, torch.Tensor) and not ids.dtype.is_floating_point else None
    head_vocab = _vocabulary(base.get_output_embeddings(), config)
    in_vocab = _vocabulary(base.get_input_embeddings(), config) if hasattr(base, "get_input_embeddings") else 0
    if key == "labels":  # the first label of a row is shifted out, never a target (transformers ignores it too)
        labels = labels[..., 1:]
    real = labels != IGNORE_INDEX
    ends = []  # min and max of the labels that are targets, then of the ids: gathered on one device, read once
    if labels.numel():
        masked = torch.where(real, labels, 0)
        ends += [masked.min(), masked.max()]
    with_ids = ids is not None and in_vocab > 0 and ids.numel() > 0
    if with_ids:
        ends += [ids.min().to(labels.device), ids.max().to(labels.device)]
    values = torch.stack([e.to(torch.int64) for e in ends]).tolist() if ends else []
    if labels.numel() and (values[0] < 0 or (head_vocab and values[1] >= head_vocab)):
        where = _first(real & ((labels < 0) | (labels >= (head_vocab or _INT64_MAX))))
        value = int(labels[where])
        if key == "labels":
            where = (*where[:-1], where[-1] + 1)
        raise InvalidArgumentError(
            f"{key}{list(where)} = {value} is not a target of the model: a label is a token id in "
            f"[0, {head_vocab}) (the head's vocabulary) or {IGNORE_INDEX} (no target)")
    if with_ids and (values[-2] < 0 or values[-1] >= in_vocab):
        where = _first((ids < 0) | (ids >= in_vocab))
        raise InvalidArgumentError(
            f"input_ids{list(where)} = {int(ids[where])} is not a token of the model: its vocabulary has {in_vocab} "
            f"ids, [0, {in_vocab}) (the input embedding's rows)")


def head_transform(model: Any) -> tuple[float, float | None]:
    """``(scale, softcap)`` that turn the head's output into the model's logits, read from its config.

    Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``, Gemma 2 / 3 soft-cap with
    ``final_logit_softcapping``; everything else is ``(1.0, None)``. :func:`causal_lm_loss` checks the result on
    the model itself before trusting it.

    >>> from padfree.proof.tiny import tiny_model
    >>> head_transform(tiny_model("llama")), head_transform(tiny_model("cohere"))
    ((1.0, None), (0.0625, None))
    """
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    scale, softcap = 1.0, None
    model_type = str(getattr(config, "model_type", ""))
    if model_type.startswith("cohere") and getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if model_type.startswith("granite") and getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        softcap = float(cap)
    return scale, softcap


@contextlib.contextmanager
def head_inputs(model: Any) -> Iterator[list[torch.Tensor]]:
    """Within the block, the model's output head records its input and returns empty logits ``(..., 0)``
    instead of computing them (the rest of the forward runs unchanged)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise UnsupportedModelError(
            f"padfree's fused LM head needs a model whose output head is an nn.Linear (get_output_embeddings()), got "
            f"{type(head).__name__} in {type(model).__name__}")
    seen: list[torch.Tensor] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        # (..., 0) logits that cost nothing but still hang off the head's parameters in the autograd graph: DDP
        # with find_unused_parameters walks the graph from the forward's outputs, and a head it could not reach
        # would be reduced as unused, then marked ready a second time when its real gradient arrives
        return F.linear(x, head.weight[:0], None if head.bias is None else head.bias[:0])

    head.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's forward
    try:
        yield seen
    finally:
        del head.forward


def materialised_head(model: Any, hidden: torch.Tensor) -> torch.nn.Linear:
    """The output head, refused when its weight is not there outside its own forward (DeepSpeed ZeRO-3 gathers a
    module's parameters only inside it, and the fused loss uses them after)."""
    head = model.get_output_embeddings()
    if head.weight.dim() != 2 or head.weight.shape[1] != hidden.shape[-1]:
        raise UnsupportedModelError(
            f"causal_lm_loss: the output head's weight is {tuple(head.weight.shape)} outside the head's forward, not "
            f"(vocab, {hidden.shape[-1]}): its parameters are partitioned or not materialised there; use the model's "
            f"own loss (padfree_fused_loss=False)")
    return head


def verified_head_transform(model: Any) -> tuple[float, float | None]:
    """The model's :func:`head_transform`, once verified on a few tokens (cached on the model)."""
    cached = getattr(model, "_padfree_head_transform", None)
    if cached is not None:
        return cached
    scale, softcap = head_transform(model)
    head = model.get_output_embeddings()
    # the vocabulary from the config: a head partitioned outside its forward has no rows to count here
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or head.weight.shape[0] or 8)
    ids = (torch.arange(7, device=head.weight.device) * 7919 + 3) % vocab
    training = model.training
    model.eval()  # dropout would make the two runs differ
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits.float()
            with head_inputs(model) as seen:
                model(input_ids=ids[None], use_cache=False)
            if len(seen) != 1:
                raise UnsupportedModelError(f"{type(model).__name__} calls its output head {len(seen)} times per "
                                            f"forward; padfree's fused LM head cannot stand in for it")
            head = materialised_head(model, seen[0])
            mine = F.linear(seen[0], head.weight, head.bias).float() * scale
            if softcap is not None:
                mine = torch.tanh(mine / softcap) * softcap
    finally:
        model.train(training)
    tol = 1e-5 if head.weight.dtype == torch.float32 else 2e-2
    err = float((mine - logits).abs().max()) / max(float(logits.abs().max()), 1.0)
    if mine.shape != logits.shape or not err <= tol:
        raise UnsupportedModelError(
            f"padfree's fused LM head cannot reproduce the logits of {type(model).__name__} (model_type "
            f"{getattr(model.config, 'model_type', '?')!r}) from its head (scale={scale}, softcap={softcap}): "
            f"relative difference {err:.3g}; use the model's own loss (model(**inputs).loss)")
    model._padfree_head_transform = (scale, softcap)
    return scale, softcap


def causal_lm_loss(
    model: Any,
    inputs: Mapping[str, Any],
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    reduction: str = "mean",
    chunk_size: int | None = None,
    with_stats: bool = False,
    weights: torch.Tensor | None = None,
) -> Any:
    """The loss ``model(**inputs).loss`` computes, without materialising the logits.

    Runs ``model`` on ``inputs`` minus the labels with its output head short-circuited (its input is caught),
    then :func:`linear_cross_entropy` over the positions that have a target. Works for any Hugging Face causal LM
    whose logits are its ``nn.Linear`` head's output, possibly scaled and soft-capped (verified once per model
    against its own logits; :class:`~padfree.UnsupportedModelError` otherwise), packed or not — configured by
    :func:`padfree.configure_packing` or not. A MoE model's router auxiliary loss is added as its own loss adds it.
    ``use_cache`` defaults to False (a training forward has no use for a cache, and with one transformers stops
    honouring restarting ``position_ids`` in unconfigured models).

    Args:
        model: a ``*ForCausalLM`` (or a DDP / accelerate wrapper around one: the wrapper's forward is called).
        inputs: the model's keyword arguments with ``labels`` (aligned with ``input_ids``; the loss shifts them, as
            transformers does) or ``shift_labels`` (already shifted: target of position ``i`` at ``i``).
        num_items_in_batch: divide the sum by this (the Trainer's count of the whole step's targets) instead of
            this batch's count. As in transformers, a mean over nothing is NaN: no target at all (without
            ``num_items_in_batch``), or ``num_items_in_batch=0``.
        reduction: ``"mean"`` (default; over targets, or ``num_items_in_batch``) or ``"sum"``.
        chunk_size: positions per chunk of logits (default :func:`default_chunk_size`).
        weights: floats shaped like the labels given (``labels`` or ``shift_labels``): the weight of each label's
            loss in the sum (None: 1 each) — e.g. ``1 / (targets of its sequence)`` for a mean per sequence.
        with_stats: also return ``{"targets", "entropy", "correct"}`` — the positions with a target, the summed
            entropy of their predicted distributions and how many targets are the arg-max (``()`` tensors, no
            gradient): what a trainer logs as entropy and token accuracy, without the logits.

    Returns:
        ``()`` float32 — the loss, differentiable through the model (and the stats with ``with_stats``).

    Input ids outside the input embedding and target labels that are neither a class of the head nor ``-100`` are
    refused before the forward (:class:`~padfree.errors.InvalidArgumentError` naming the value and its position), in
    one read back to the host — the one that used to check the targets after the forward.
    """
    if reduction not in ("mean", "sum"):
        raise InvalidArgumentError(f"reduction must be 'mean' or 'sum', got {describe(reduction)}")
    has_labels, has_shifted = inputs.get("labels") is not None, inputs.get("shift_labels") is not None
    if has_labels == has_shifted:
        raise InvalidArgumentError("inputs must hold exactly one of labels (aligned with input_ids) or shift_labels "
                                   f"(pre-shifted), got keys {sorted(inputs)}")
    base = unwrap_model(model)
    scale, softcap = verified_head_transform(base)
    _check_ids_and_labels(base, inputs, "shift_labels" if has_shifted else "labels")
    kwargs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
    kwargs.setdefault("use_cache", False)
    with head_inputs(base) as seen:
        out = model(**kwargs)
    if len(seen) != 1:
        raise UnsupportedModelError(f"{type(base).__name__} called its output head {len(seen)} times")
    hidden = seen[0]
    if has_shifted:
        targets = inputs["shift_labels"]
    else:
        labels = inputs["labels"]
        targets = F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
        if weights is not None:  # shifted with the labels they weigh
            if tuple(weights.shape) != tuple(labels.shape):
                raise InvalidArgumentError(f"weights must have the labels' shape {tuple(labels.shape)}, got "
                                           f"{tuple(weights.shape)}")
            weights = F.pad(weights[..., 1:], (0, 1), value=0.0)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise InvalidArgumentError(f"the labels' shape {tuple(targets.shape)} does not match the model's positions "
                                   f"{tuple(hidden.shape[:-1])}")
    head = materialised_head(base, hidden)
    loss, count, *stats = _linear_cross_entropy(hidden, head.weight, targets.to(hidden.device), bias=head.bias,
                                                scale=scale, softcap=softcap, ignore_index=IGNORE_INDEX,
                                                chunk_size=chunk_size, with_stats=with_stats,
                                                weights=None if weights is None else weights.to(hidden.device),
                                                checked=True)
    if reduction == "mean":
        # transformers' mean: over no target (or a step count of 0) NaN, never a silent 0
        loss = LossRule.divide(loss, count if num_items_in_batch is None else num_items_in_batch, empty="nan")
    aux = getattr(out, "aux_loss", None)
    coef = getattr(base.config, "router_aux_loss_coef", None)
    if aux is not None and coef is not None:  # as the MoE models' own forward adds it when given labels
        loss = loss + coef * aux.to(loss.device)
    if with_stats:
        return loss, {"targets": count, "entropy": stats[0], "correct": stats[1]}
    return loss
