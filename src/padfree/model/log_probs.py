"""Per-token log-probabilities of a causal LM's targets, computed from the head's input without the logits.

Preference and RL losses (DPO, KTO, GRPO) need, for every completion token, ``log p(target)`` with its gradient — and
for their metrics the entropy of the prediction, its mean logit and whether the target is the arg-max. The logits
behind them are ``positions x vocabulary`` floats, the largest tensors of such a step. :func:`token_log_probs`
computes every per-token field a chunk of positions at a time in two reused ``chunk x vocabulary`` buffers (about
128 MiB each, whatever the row's length), and only for the positions that have a target: the prompt and the first
token of every sequence never reach the head. Its backward recomputes each chunk's logits (they are gone by then)
and turns them into the gradients of the head's input, weight and bias in place.

>>> import torch
>>> torch.manual_seed(0) is not None
True
>>> hidden, weight = torch.randn(6, 8), torch.randn(11, 8)
>>> targets = torch.tensor([-100, 3, 4, -100, 9, 2])  # -100: no target there (a prompt token, say)
>>> out = token_log_probs(hidden, weight, targets, outputs=("log_probs", "is_top1"), chunk_size=2)
>>> full = torch.log_softmax(hidden @ weight.T, dim=-1).gather(1, targets.clamp(min=0)[:, None])[:, 0]
>>> bool(torch.allclose(out["log_probs"], torch.where(targets >= 0, full, 0.0)))
True
>>> sorted(out), out["is_top1"].dtype
(['is_top1', 'log_probs'], torch.bool)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from padfree.errors import InvalidArgumentError, describe
from padfree.layout import IGNORE_INDEX
from padfree.model.loss import check_head_arguments, chunk_logits, default_chunk_size

__all__ = ["OUTPUTS", "token_log_probs"]

#: the per-token fields :func:`token_log_probs` can compute (``log_probs`` always)
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float, softcap: float | None,
            inv_t: float, z: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    """One chunk's final logits into the float32 buffer ``z``: :func:`~padfree.model.loss.chunk_logits` (the product
    in the head's precision, ``low`` its buffer, and the scale), then soft-cap and ``1 / temperature``."""
    chunk_logits(h, weight, bias, scale, z, low)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


class _TokenLogProbs(torch.autograd.Function):
    """``log softmax(f(h W^T + b))[target]`` per row and the requested statistics; the logits exist one chunk at a
    time, in the forward and again in the backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, scale: float, softcap: float | None, inv_t: float, chunk: int,
                wanted: frozenset[str]) -> tuple[torch.Tensor | None, ...]:
        ctx.set_materialize_grads(False)  # an entropy logged, not trained on, brings no gradient to fold in
        n, vocab = hidden.shape[0], weight.shape[0]
        f32, dev = torch.float32, hidden.device
        rows = max(min(chunk, n), 1)
        z_buf = torch.empty((rows, vocab), dtype=f32, device=dev)
        e_buf = torch.empty((rows, vocab), dtype=f32, device=dev)
        low_buf = torch.empty((rows, vocab), dtype=hidden.dtype, device=dev) if hidden.dtype != f32 else None
        log_probs, log_z = torch.empty(n, dtype=f32, device=dev), torch.empty(n, dtype=f32, device=dev)
        entropy = torch.empty(n, dtype=f32, device=dev) if "entropy" in wanted else None
        sum_sq = torch.empty(n, dtype=f32, device=dev) if "log_sum_sq_probs" in wanted else None
        mean = torch.empty(n, dtype=f32, device=dev) if "mean_logits" in wanted else None
        top1 = torch.empty(n, dtype=torch.bool, device=dev) if "is_top1" in wanted else None
        arange = torch.arange(rows, device=dev)
        for a in range(0, n, rows):  # over chunks of positions, never over tokens
            b = min(a + rows, n)
            t, idx = targets[a:b], arange[: b - a]
            z = _logits(hidden[a:b], weight, bias, scale, softcap, inv_t, z_buf[: b - a],
                        None if low_buf is None else low_buf[: b - a])
            if mean is not None:
                torch.sum(z, dim=1, out=mean[a:b]).div_(vocab)
            if top1 is not None:  # the first maximum, as argmax picks it: a tie is not a hit for a later index
                torch.eq(z.argmax(dim=1), t, out=top1[a:b])
            top = z.amax(dim=1)
            z.sub_(top[:, None])  # z' = logits - max, kept: the entropy reads it
            e = torch.exp(z, out=e_buf[: b - a])
            sums = e.sum(dim=1)
            log_sums = sums.log()
            torch.sub(z[idx, t], log_sums, out=log_probs[a:b])
            torch.add(top, log_sums, out=log_z[a:b])
            # z' is read for the last time below, so its buffer takes the products (summed by torch's reductions:
            # a 1 x V by V x 1 product would add the vocabulary's terms in one long chain, less accurately)
            if entropy is not None:  # H = log S - Σ e·z' / S
                torch.sub(log_sums, z.mul_(e).sum(dim=1) / sums, out=entropy[a:b])
            if sum_sq is not None:  # log Σ p² = log Σ e² - 2 log S
                torch.sub(torch.mul(e, e, out=z).sum(dim=1).log(), 2 * log_sums, out=sum_sq[a:b])
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy)
        ctx.settings = (scale, softcap, inv_t, rows)
        ctx.mark_non_differentiable(*(x for x in (sum_sq, mean, top1) if x is not None))
        return log_probs, entropy, sum_sq, mean, top1

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None, *_: Any) -> tuple[Any, ...]:
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        scale, softcap, inv_t, rows = ctx.settings
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        nothing = (None,) * 9
        if (g_lp is None and g_ent is None) or not (need_h or need_w or need_b):
            return nothing
        n, vocab = hidden.shape[0], weight.shape[0]
        f32, dev = torch.float32, hidden.device
        low = hidden.dtype != f32
        z_buf = torch.empty((rows, vocab), dtype=f32, device=dev)
        p_buf = torch.empty((rows, vocab), dtype=f32, device=dev)
        low_buf = torch.empty((rows, vocab), dtype=hidden.dtype, device=dev) if low else None
        cap_buf = torch.empty((rows, vocab), dtype=f32, device=dev) if softcap is not None else None
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=f32, device=dev) if need_w else None
        w_tmp = torch.empty_like(weight) if need_w and low else None
        db = torch.zeros(vocab, dtype=f32, device=dev) if need_b else None
        g_lp = None if g_lp is None else g_lp.float()
        g_ent = None if g_ent is None else g_ent.float()
        arange = torch.arange(rows, device=dev)
        for a in range(0, n, rows):
            b = min(a + rows, n)
            h, t, idx = hidden[a:b], targets[a:b], arange[: b - a]
            z = _logits(h, weight, bias, scale, softcap, inv_t, z_buf[: b - a],
                        None if low_buf is None else low_buf[: b - a])
            if softcap is not None:  # d(c·tanh(u/c))/du = 1 - tanh², read off the capped logits (z = c·tanh / T)
                cap = torch.mul(z, 1.0 / (inv_t * softcap), out=cap_buf[: b - a])
                cap.mul_(cap).neg_().add_(1.0)
            z.sub_(log_z[a:b, None])  # log p
            p = torch.exp(z, out=p_buf[: b - a])
            # d/dz of g_lp·log p[t] + g_ent·H:  g_lp·(onehot - p) - g_ent·p·(log p + H)
            if g_ent is not None:
                g = z.add_(entropy[a:b, None]).mul_(p).mul_(g_ent[a:b, None])
                if g_lp is not None:
                    g.addcmul_(p, g_lp[a:b, None])
                g.neg_()
            else:
                g = p.mul_(g_lp[a:b, None]).neg_()
            if g_lp is not None:
                g[idx, t] += g_lp[a:b]
            if cap_buf is not None:
                g.mul_(cap)
            if scale * inv_t != 1.0:
                g.mul_(scale * inv_t)
            if db is not None:
                db += g.sum(dim=0)
            gl = low_buf[: b - a].copy_(g) if low else g
            if dh is not None:
                torch.mm(gl, weight, out=dh[a:b])
            if dw is not None:
                if low:  # the GEMM in the head's precision, accumulated over chunks in float32
                    dw += torch.mm(gl.t(), h, out=w_tmp)
                else:
                    dw.addmm_(gl.t(), h)
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None, None)


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
    outputs: Sequence[str] = ("log_probs",),
) -> dict[str, torch.Tensor]:
    """Per position, the log-probability of its target under ``softmax(softcap(scale · (hidden @ weight.T + bias)) /
    temperature)``
    and the requested statistics of that distribution, never holding more than ``chunk_size`` rows of logits.

    Equal (to float32 rounding) to reading them off the full logits — ``log_softmax(logits.float())`` at the target,
    its entropy, ``log Σ p²``, the logits' mean, ``argmax == target`` — with the same gradients for ``hidden``,
    ``weight`` and ``bias`` through ``log_probs`` and ``entropy``. The product runs in ``hidden``'s dtype (pass
    ``hidden`` and ``weight`` in the precision the head computes in, e.g. autocast's), everything after it in float32.

    Args:
        hidden: ``(..., H)`` — the head's input; flattened over the leading dimensions.
        weight: ``(V, H)`` — the head's weight, ``hidden``'s dtype.
        targets: ``(...)`` integer, the leading shape of ``hidden``; ``ignore_index`` marks positions without a
            target: they never reach the head and read 0 (``False``) in every output.
        bias: ``(V,)`` or None.
        scale: multiplies the logits (Cohere's ``logit_scale``; ``1 / logits_scaling`` for Granite).
        softcap: ``softcap · tanh(logits / softcap)`` after the scale (Gemma 2 / 3's ``final_logit_softcapping``).
        temperature: divides the logits last (a sampler's temperature, as RL trainers score with it); > 0.
        chunk_size: positions per chunk (default :func:`~padfree.model.loss.default_chunk_size`: ~128 MiB of
            float32 logits).
        outputs: which of :data:`OUTPUTS` to compute (``log_probs`` always is): ``entropy`` (differentiable),
            ``log_sum_sq_probs``, ``mean_logits`` (float32, no gradient), ``is_top1`` (bool).

    Returns:
        ``{name: (...)}`` for ``log_probs`` and each requested output, shaped like ``targets``; float32 (``is_top1``
        bool).

    Raises:
        InvalidArgumentError: a shape, dtype or setting out of range (named), an unknown output, or a target that is
            neither a class of the head nor ``ignore_index``.
    """
    check_head_arguments(hidden, weight, targets, bias, scale, softcap, chunk_size)
    if isinstance(outputs, str) or not isinstance(outputs, Sequence) or any(o not in OUTPUTS for o in outputs):
        raise InvalidArgumentError(f"outputs must be a sequence of names among {list(OUTPUTS)}, got "
                                   f"{describe(outputs)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise InvalidArgumentError(f"temperature must be a finite number > 0, got {describe(temperature)}")
    wanted = frozenset(outputs) | {"log_probs"}
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else int(chunk_size)
    shape = targets.shape
    flat = targets.reshape(-1)
    keep = (flat != ignore_index).nonzero().squeeze(1)
    t = flat.index_select(0, keep).long()
    if t.numel():
        lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one host read for both ends
        if lo < 0 or hi >= weight.shape[0]:
            bad = (targets != ignore_index) & ((targets < 0) | (targets >= weight.shape[0]))
            where = [int(i) for i in bad.nonzero()[0].tolist()]
            raise InvalidArgumentError(f"targets{where} = {int(targets[tuple(where)])} is not a class: targets must "
                                       f"be in [0, {weight.shape[0]}) or ignore_index={ignore_index}")
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, keep)  # positions without a target never reach the head
    fields = _TokenLogProbs.apply(h, weight, bias, t, float(scale), None if softcap is None else float(softcap),
                                  1.0 / float(temperature), chunk, wanted)
    out = {}
    for name, value in zip(OUTPUTS, fields, strict=True):
        if name not in wanted:
            continue
        # scattered back into zeros: still connected to the head when no position has a target, so such a batch
        # gives a differentiable zero, not a failing backward
        full = value.new_zeros(flat.shape).index_copy(0, keep, value)
        out[name] = full.view(shape)
    return out
