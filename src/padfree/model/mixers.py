"""Boundary-exact sequence mixers: GatedDeltaNet, Mamba-2 (SSD), Mamba-1 selective scan and short convolutions.

Linear-attention and state-space layers carry a recurrent state and a short causal convolution from token to token.
In a packed row both run straight across the boundary between two sequences unless every layer is told where the
sequences start. :func:`padfree.configure_packing` reads :data:`CLASSES` and calls :func:`install` on every instance
of those classes; the installer patches that module *instance* (never its class, never transformers' module
globals) so that

- an ordinary batch runs transformers' own forward, unchanged;
- a packed batch runs the *same forward code* with its sequence primitives swapped for boundary-exact ones
  (a kernel when one is usable, the exact pure-PyTorch reference otherwise):

  - ``causal_conv1d_fn`` -> causal-conv1d with ``seq_idx``; reference: transformers' depthwise conv over the
    flattened batch with ``K - 1`` zeros spread before every segment (the zero history a lone sequence has);
  - ``torch_chunk_gated_delta_rule`` -> flash-linear-attention ``chunk_gated_delta_rule`` with ``cu_seqlens``
    (bf16/fp16); reference: the chunked delta rule, either in one call with per-segment masks inside the chunks or
    per segment (segments with the same number of chunks batched), whichever is cheaper for the layout;
  - ``mamba2_chunk_scan`` -> mamba_ssm ``mamba_chunk_scan_combined`` with ``seq_idx``; reference: the SSD scan with
    its intra-chunk, chunk-state and inter-chunk terms masked to the segment;
  - ``mamba_selective_scan`` -> reference only (mamba_ssm's ``selective_scan_fn`` takes no boundaries): the scan
    with the state's decay set to exactly 0 at every segment start;
  - the fused conv+scan paths report "unavailable" (the model then runs conv and scan separately), and the
    one-token cached-decode functions refuse: a packed batch never has a cache.

Only the token-mixing primitives are replaced: projections, gates, norms and every model-specific multiplier stay
transformers' code, so a packed forward computes, per sequence, what the model computes for that sequence alone.
Kernels are used when importable *and* runnable (CUDA tensors, and the dtypes the kernel accepts); a kernel import or
call that fails falls back to the exact reference with a logged reason (and the configured model's report says so) —
never a crash mid-training, never a leak.
No kernel is imported without CUDA (a broken triton then cannot even be touched).

The references never build denormal floats (decay factors below ``exp(DECAY_FLOOR)`` are exact zeros, far below fp32
resolution), so their speed does not depend on a global flush-denormal mode, which padfree never touches.

Recognised classes (class name -> family): see :data:`MIXER_CLASSES`. ``configure_packing`` finds them by scanning
the model (decoder layers and the model itself are containers it looks inside); a stateful class it finds and this
module does not know is refused by name.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> x = torch.arange(1.0, 6.0).view(1, 1, 5)  # (batch, channels, tokens)
>>> segment_causal_conv1d(x, torch.ones(1, 2), None, None, lay).tolist()  # out[t] = x[t-1] + x[t] within a segment
[[[1.0, 3.0, 5.0, 4.0, 9.0]]]
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import importlib
import importlib.util
import inspect
import logging
import sys
import types
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import guards
from padfree.model.packed import PackedLayout
from padfree.model.state import current_layout, hooks_live

__all__ = [
    "CLASSES",
    "MIXER_CLASSES",
    "install",
    "kernel_name",
    "kernel_status",
    "segment_causal_conv1d",
    "segment_gated_delta_rule",
    "segment_selective_scan",
    "segment_ssd_scan",
    "uninstall",
]

log = logging.getLogger("padfree")

# ---- kernels: importable and runnable, or a reason ---------------------------------------------------------------

# name -> (distribution, module, attribute)
_KERNELS = {
    "causal_conv1d": ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn"),
    "fla": ("flash-linear-attention", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "mamba_ssm": ("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
}
_loaded: dict[str, tuple[Callable | None, str]] = {}
_broken: dict[str, str] = {}  # kernels whose call raised once: the reference runs from then on


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _on_accelerator(t: torch.Tensor) -> bool:
    """Whether a kernel may run on ``t`` (a CUDA tensor)."""
    return t.is_cuda


def _load_kernel(name: str) -> tuple[Callable | None, str]:
    """``(function, "")`` when kernel ``name`` imports here, else ``(None, why not)``; never imports without CUDA."""
    if name in _loaded:
        return _loaded[name]
    dist, module, attr = _KERNELS[name]
    top = module.split(".")[0]
    if not _cuda_available():
        result: tuple[Callable | None, str] = (None, f"{dist} kernels need a CUDA GPU, none here")
    elif importlib.util.find_spec(top) is None:
        result = (None, f"{dist} is not installed")
    else:
        try:
            result = (getattr(importlib.import_module(module), attr), "")
        except Exception as exc:  # a broken install (e.g. triton without a GPU driver) must not take training down
            result = (None, f"{dist} is installed but {module}.{attr} failed to import ({type(exc).__name__}: "
                            f"{str(exc)[:120]})")
    _loaded[name] = result
    return result


def kernel_name(name: str) -> str:
    """The distribution that provides kernel ``name`` (``"fla"`` -> ``"flash-linear-attention"``)."""
    return _KERNELS[name][0]


def kernel_status(name: str) -> tuple[bool, str]:
    """``(usable, reason)`` for one of ``"causal_conv1d"``, ``"fla"``, ``"mamba_ssm"``."""
    if name in _broken:
        return False, _broken[name]
    fn, why = _load_kernel(name)
    return fn is not None, why or "importable, CUDA present"


def _call_kernel(name: str, run: Callable[[Callable], Any]) -> Any:
    """``run(kernel)``, or None (the caller then runs the reference) when the kernel is unusable or raises."""
    if name in _broken:
        return None
    fn, _ = _load_kernel(name)
    if fn is None:
        return None
    try:
        return run(fn)
    except Exception as exc:
        dist = _KERNELS[name][0]
        _broken[name] = (f"{dist} failed at its first call ({type(exc).__name__}: {str(exc)[:160]}); the exact "
                         f"reference runs instead")
        log.warning("padfree: %s kernel failed (%s); using the exact PyTorch reference from now on",
                    dist, _broken[name])
        return None


# ---- the boundaries, in the forms the references want (cached on the layout: built once per batch) ---------------


def _positions(lay: PackedLayout) -> torch.Tensor:
    """``(B, T) int64``: index of every token inside its segment (padding runs count as segments)."""
    def build() -> torch.Tensor:
        lengths = lay.lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        pos = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        return torch.from_numpy(pos).to(lay.device).view(lay.shape)
    return lay._cached(("padfree.mixers", "positions"), build)


def _conv_spread(lay: PackedLayout, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gather (N',) int64, where (B·T,) int64)``: the flattened stream with ``width - 1`` zero slots before every
    segment (gather index ``B·T`` reads a zero column), and where each token's convolution output lands in it."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        lengths, pad = lay.lengths, width - 1
        total = int(lengths.sum())
        token = np.arange(total, dtype=np.int64)
        spread = token + pad * (np.repeat(np.arange(lengths.size, dtype=np.int64), lengths) + 1)
        gather = np.full(total + pad * lengths.size, total, dtype=np.int64)
        gather[spread] = token
        return torch.from_numpy(gather).to(lay.device), torch.from_numpy(spread - pad).to(lay.device)
    return lay._cached(("padfree.mixers", "conv", width), build)


def _act(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


# ---- short causal convolution ------------------------------------------------------------------------------------


def segment_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, lay: PackedLayout,
) -> torch.Tensor:
    """Depthwise causal convolution that restarts (zero history) at every segment: the exact torch reference.

    Args:
        x: ``(B, C, T)`` — channels first, as transformers' ``causal_conv1d_fn`` takes them.
        weight: ``(C, K)`` taps; ``out[t] = bias + sum_s weight[:, K-1-s] * x[t-s]`` over ``s <= pos(t)``.
        bias: ``(C,)`` or None.
        activation: a transformers activation name (``"silu"``) or None.
        lay: the batch's :class:`~padfree.model.packed.PackedLayout`.

    Returns:
        ``(B, C, T)`` in ``x``'s dtype. One ``F.conv1d`` — transformers' own call, so autocast and the weights'
        dtype act on it exactly as they do on a lone sequence — over the flattened batch with ``K - 1`` zeros
        spread before every segment: each output then reads its own segment and the zero history a lone
        sequence's ``padding=K - 1`` gives it, nothing else.
    """
    batch, channels, seq_len = x.shape
    width = weight.shape[-1]
    gather, where = _conv_spread(lay, width)
    flat = x.to(weight.dtype).transpose(0, 1).reshape(channels, batch * seq_len)
    flat = torch.cat([flat, flat.new_zeros(channels, 1)], dim=1).index_select(1, gather)
    out = F.conv1d(flat.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0].index_select(1, where)
    out = out.view(channels, batch, seq_len).transpose(0, 1)
    if activation is not None:
        out = _act(activation)(out)
    return out.to(x.dtype)


def _conv_kernel(x, weight, bias, activation, lay):
    if activation not in (None, "silu", "swish") or not _on_accelerator(x):
        return None

    def run(fn):
        xc = x if x.stride(1) == 1 else x.transpose(1, 2).contiguous().transpose(1, 2)  # seq_idx wants channels-last
        return fn(xc, weight, bias, seq_idx=lay.seq_idx, activation=activation)

    return _call_kernel("causal_conv1d", run)


# ---- gated delta rule --------------------------------------------------------------------------------------------


# Log-decays below this are exact zeros in the references: a factor under exp(-30) ~ 1e-13 is six orders of magnitude
# below the fp32 resolution of the sums it enters (each of which holds its own undecayed term), and cutting it keeps
# every intermediate out of the denormal range, where x86 CPUs run 10-100x slower (before the floor, one GatedDeltaNet
# layer took 83 ms or 5.8 s fwd+bwd on the same shape, depending on the data). No global floating-point mode is
# touched. The Mamba-1 scan keeps transformers' exact arithmetic: its decay only ever multiplies the running state.
DECAY_FLOOR = -30.0


def _exp_floor(x: torch.Tensor, blocked: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(x)``, exactly 0 where ``x < DECAY_FLOOR`` or ``blocked``."""
    cut = x < DECAY_FLOOR
    return x.masked_fill(cut if blocked is None else cut | blocked, float("-inf")).exp()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gdr_chunked(q, k, v, beta, g, seg: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """The chunked gated delta rule on ``(R, H, L, D)`` fp32 inputs (``beta``, ``g``: ``(R, H, L)``), each row
    starting from a zero state; ``seg`` (``(R, L)`` segment ids) additionally restarts the state wherever it changes.

    Same algebra as transformers' ``torch_chunk_gated_delta_rule``; with ``seg`` every within-chunk pair of tokens of
    two segments gets decay exactly 0 (masked before ``exp``, so no large-negative trick and no denormals), the state
    carried into a chunk is read only by tokens of the segment it belongs to, and only the chunk's last segment
    writes the state carried out.
    """
    rows, heads, length, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (length + pad) // chunk
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(rows, heads, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(rows, heads, n, chunk)
    blocked = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    if seg is not None:
        s = F.pad(seg, (0, pad), value=-1).view(rows, n, chunk)  # padding: a segment of its own
        blocked = blocked | (s.unsqueeze(-1) != s.unsqueeze(-2)).unsqueeze(1)
        before = torch.cat([s.new_full((rows, 1), -2), s[:, :-1, -1]], dim=1)  # segment the carried state belongs to
        carried = (s == before.unsqueeze(-1)).unsqueeze(1)  # (R, 1, n, C): token reads the carried state
        in_last = (s == s[..., -1:]).unsqueeze(1)  # token belongs to the segment the chunk hands on
    decay = _exp_floor(cum.unsqueeze(-1) - cum.unsqueeze(-2), blocked)
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    cum_exp = _exp_floor(cum)
    decayed_k_beta = k_beta * cum_exp.unsqueeze(-1)
    q = q * cum_exp.unsqueeze(-1)
    k = k * _exp_floor(cum[..., -1:] - cum).unsqueeze(-1)
    chunk_decay = cum_exp[..., -1]
    if seg is not None:
        decayed_k_beta = decayed_k_beta * carried.unsqueeze(-1)
        q = q * carried.unsqueeze(-1)
        k = k * in_last.unsqueeze(-1)
        chunk_decay = chunk_decay * carried[..., -1]
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    state = q.new_zeros(rows, heads, dk, dv)
    outs = []
    for i in range(n):  # the recurrence over chunks: inherent to the chunked algorithm
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(rows, heads, -1, dv)[:, :, :length]


# Segments no longer than a chunk run as one chunk padded to a multiple of this many tokens (not to a whole chunk):
# the chunked rule is exact for any chunk size, and one chunk of 16-48 tokens costs a fraction of a 64-token one.
SHORT_STEP = 16


def _gdr_padded(lengths: np.ndarray, chunk: int) -> np.ndarray:
    """The padded length of every segment in the per-segment formulation: whole chunks, or for a segment no longer
    than a chunk, one chunk of the next multiple of :data:`SHORT_STEP`."""
    step = min(SHORT_STEP, chunk)
    return np.where(lengths > chunk, -(-lengths // chunk) * chunk, -(-lengths // step) * step)


def _gdr_groups(lay: PackedLayout, chunk: int
                ) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Segments grouped by padded length: ``(length L, chunk, gather (m, L), valid (m*L,), dest)``; slots past a
    segment's end point at index ``B*T`` (a zero row appended by the caller)."""
    def build():
        lengths = lay.lengths
        total = int(lengths.sum())
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        padded = _gdr_padded(lengths, chunk)
        out = []
        for size in np.unique(padded)[::-1]:
            members = np.flatnonzero(padded == size)
            col = np.arange(int(size))
            valid = col < lengths[members, None]
            gather = np.where(valid, starts[members, None] + col, total)
            out.append((int(size), min(int(size), chunk), torch.from_numpy(gather).to(lay.device),
                        torch.from_numpy(valid.reshape(-1)).to(lay.device),
                        torch.from_numpy(gather[valid]).to(lay.device)))
        return out
    return lay._cached(("padfree.mixers", "gdr_groups", chunk), build)


def _gdr_per_segment(q, k, v, beta, g, lay: PackedLayout, chunk: int) -> torch.Tensor:
    """Every segment as its own row (segments of equal padded length in one call): ``(B, H, T, D)`` in and out."""
    batch, heads, seq_len, _ = q.shape
    total = batch * seq_len

    def flat(x):  # (B, H, T, ...) -> (B*T + 1, H, ...) with a zero row at the end
        x = x.movedim(2, 1).reshape(total, heads, *x.shape[3:])
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    fq, fk, fv, fb, fg = (flat(x) for x in (q, k, v, beta, g))
    pieces, dest = [], []
    for _, group_chunk, gather, valid, to in _gdr_groups(lay, chunk):
        def rows(x, gather=gather):
            return x[gather].movedim(2, 1)  # (m, L, H, ...) -> (m, H, L, ...)
        out = _gdr_chunked(rows(fq), rows(fk), rows(fv), rows(fb), rows(fg), None, group_chunk)
        pieces.append(out.movedim(1, 2).reshape(-1, heads, out.shape[-1])[valid])
        dest.append(to)
    result = q.new_empty(total, heads, v.shape[-1]).index_copy(0, torch.cat(dest), torch.cat(pieces))
    return result.view(batch, seq_len, heads, -1).movedim(2, 1)


def _gdr_formulation(lay: PackedLayout, chunk: int) -> str:
    """``"per-segment"`` unless padding the segments (:func:`_gdr_padded`) adds more than half the batch's tokens
    (very many very short segments), then ``"masked"``. Measured in ``benchmarks/bench_mixers.py`` (BENCHMARKS.md):
    per-segment is the faster formulation for 7 and 64 sequences per row at T = 2k and 8k."""
    def build() -> str:
        padded = int(_gdr_padded(lay.lengths, chunk).sum())
        return "per-segment" if padded <= 1.5 * lay.lengths.sum() else "masked"
    return lay._cached(("padfree.mixers", "gdr_form", chunk), build)


def segment_gated_delta_rule(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    lay: PackedLayout, *, chunk_size: int = 64, use_qk_l2norm_in_kernel: bool = False, formulation: str = "auto",
) -> torch.Tensor:
    """The gated delta rule with the state restarting from zero at every segment: the exact torch reference.

    Args:
        query, key: ``(B, T, Hk, Dk)``; value: ``(B, T, Hv, Dv)`` with ``Hv % Hk == 0`` (grouped value heads).
        g: ``(B, T, Hv)`` log-decay (``<= 0``); beta: ``(B, T, Hv)``.
        lay: the batch's layout.
        chunk_size: 64, as transformers.
        use_qk_l2norm_in_kernel: L2-normalise queries and keys first (in fp32), as the models ask.
        formulation: ``"masked"`` (one call, per-segment masks inside the chunks), ``"per-segment"`` (each segment
            its own row, segments of the same padded length batched; a segment no longer than a chunk is one
            chunk of its own length rounded up to :data:`SHORT_STEP`) or ``"auto"`` (the cheaper for this layout).

    Returns:
        ``(B, T, Hv, Dv)`` in ``query``'s dtype (computed in fp32, as transformers does).
    """
    dtype = query.dtype
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, b, gg = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                      for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if formulation == "auto":
        formulation = _gdr_formulation(lay, chunk_size)
    if formulation == "per-segment":
        out = _gdr_per_segment(q, k, v, b, gg, lay, chunk_size)
    elif formulation == "masked":
        out = _gdr_chunked(q, k, v, b, gg, lay.seq_idx.to(torch.int64), chunk_size)
    else:
        raise ValueError(f"formulation must be 'auto', 'masked' or 'per-segment', got {formulation!r}")
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


def _gdr_kernel(query, key, value, g, beta, lay, use_qk_l2norm_in_kernel):
    if not _on_accelerator(query) or query.dtype not in (torch.bfloat16, torch.float16):
        return None  # flash-linear-attention refuses fp32

    def run(fn):
        hk, hv = key.shape[2], value.shape[2]
        q, k = query, key
        if hk != hv:  # older fla releases have no grouped value heads
            q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        batch, seq_len = q.shape[:2]

        def flat(x):
            return x.reshape(1, batch * seq_len, *x.shape[2:])

        out, _ = fn(flat(q), flat(k), flat(value), g=flat(g), beta=flat(beta), initial_state=None,
                    output_final_state=False, cu_seqlens=lay.cu_seqlens.to(torch.long),
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out.reshape(batch, seq_len, hv, -1)

    return _call_kernel("fla", run)


# ---- Mamba-2 SSD scan --------------------------------------------------------------------------------------------


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``segment_sum``: ``[..., i, j] = sum(x[..., j+1 : i+1])`` for ``i >= j``, ``-inf`` above."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    x = x.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0),
                           -torch.inf)


def segment_ssd_scan(
    hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    chunk_size: int, lay: PackedLayout, *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Mamba-2's SSD chunk scan with the state restarting at every segment (mamba_ssm's ``seq_idx``): exact reference.

    Args:
        hidden_states: ``(b, l, h, p)``; dt: ``(b, l, h)``; A: ``(h,)``; B, C: ``(b, l, g, n)``; D: ``(h,)``.
        chunk_size, dt_bias, dt_softplus, dt_limit: as transformers' ``mamba2_chunk_scan``.
        lay: the batch's layout.

    Returns:
        ``(b, l, h, p)`` fp32, as transformers' reference. The three terms of the scan are masked to the segment:
        intra-chunk pairs of two segments, chunk states of tokens that are not in the chunk's last segment, chunk
        states handed across a segment start, and the read of the carried state by tokens of a later segment.
    """
    batch, length, heads, _ = hidden_states.shape
    groups = B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    x = hidden_states.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    pad = (chunk_size - length % chunk_size) % chunk_size
    d_residual = None if D is None else D[..., None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()

    def chunks(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, -1, chunk_size, *t.shape[2:])

    x, A, B, C = (chunks(t) for t in (x, A, B, C))
    seg = F.pad(lay.seq_idx.to(torch.int64), (0, pad), value=-1).view(batch, -1, chunk_size)
    A = A.permute(0, 3, 1, 2)
    a_cumsum = torch.cumsum(A, dim=-1)

    same = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).unsqueeze(1)  # (b, 1, c, l, s)
    L = _exp_floor(_segsum(A), ~same)
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)

    last = seg[..., -1]  # (b, c): the segment a chunk hands its state to
    in_last = (seg == last.unsqueeze(-1)).unsqueeze(1)
    decay_states = _exp_floor(a_cumsum[:, :, :, -1:] - a_cumsum) * in_last
    b_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", b_decay, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    handed = F.pad(last, (1, 0), value=-3)  # (b, c + 1): entry 0 is the zero initial state
    ok = handed.unsqueeze(-1) == handed.unsqueeze(-2)
    ok[:, :, 0] = True
    decay_chunk = _exp_floor(_segsum(F.pad(a_cumsum[:, :, :, -1], (1, 0))), ~ok.unsqueeze(1))
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk.transpose(1, 3), states)
    states = new_states[:, :-1]
    carried = (seg == handed[:, :-1].unsqueeze(-1)).unsqueeze(1)  # token continues the segment of the carried state
    state_decay_out = _exp_floor(a_cumsum) * carried
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * state_decay_out.permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).contiguous().reshape(batch, -1, heads, x.shape[-1])
    if d_residual is not None:
        y = y + d_residual
    return y[:, :length] if pad else y


def _ssd_kernel(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, lay):
    if not _on_accelerator(hidden_states):
        return None
    return _call_kernel("mamba_ssm", lambda fn: fn(
        hidden_states, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=None,
        seq_idx=lay.seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=False))


# ---- Mamba-1 selective scan --------------------------------------------------------------------------------------


def _starts(lay: PackedLayout) -> torch.Tensor:
    return lay._cached(("padfree.mixers", "starts"), lambda: _positions(lay) == 0)


def segment_selective_scan(
    hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    lay: PackedLayout, *, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
) -> torch.Tensor:
    """Mamba-1's selective scan with the state restarting at every segment: exact reference.

    Args:
        hidden_states, dt, z: ``(b, d, l)``; A: ``(d, n)``; B, C: ``(b, n, l)``; D: ``(d,)``.
        lay: the batch's layout.

    Returns:
        ``(b, d, l)``: transformers' sequential scan, with the state's decay ``exp(A * dt)`` set to exactly 0 at
        every segment start — ``0 * state + dt B x`` is bit-for-bit the fresh state a lone sequence starts from.
    """
    batch, channels, _ = hidden_states.shape
    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_a = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    discrete_a = discrete_a.masked_fill(_starts(lay)[:, None, :, None], 0.0)
    delta_b_u = dt[:, :, :, None] * B[:, None, :, :].float() * hidden_states[:, :, :, None].float()
    state = torch.zeros(batch, channels, A.shape[-1], dtype=input_dtype, device=hidden_states.device)
    outs = []
    # transformers' recurrence, one step per token, on unbound slices: indexing ``x[:, :, i]`` in the loop would make
    # autograd write a full-size zero gradient per step (quadratic in the length); unbind's backward stacks once
    steps = zip(discrete_a.unbind(2), delta_b_u.unbind(2), C.unsqueeze(-1).unbind(1), strict=True)
    for decay, update, read in steps:
        state = decay * state + update
        outs.append(torch.matmul(state.to(input_dtype), read)[:, :, 0])
    y = torch.stack(outs, dim=-1)
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return y


# ---- the packed primitives (transformers' signatures), reading the layout of the call in flight ------------------


# The primitives below run outside torch.compile's graphs (torch.compiler.disable): they read the boundaries on the
# host, and traced, every new set of lengths would be a recompile. The projections around them still compile.


@dataclasses.dataclass
class _Call:
    lay: PackedLayout
    mixer: _Mixer


_CALL: ContextVar[_Call | None] = ContextVar("padfree_mixer_call", default=None)


def _current(what: str) -> _Call:
    call = _CALL.get()
    if call is None:  # only reachable if someone calls the rebound forward by hand
        raise PackingDisabledError(f"{what} ran for a packed batch outside a configured mixer's forward")
    return call


@torch.compiler.disable
def _packed_conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
    call = _current("causal_conv1d_fn")
    if call.mixer.use_conv_kernel:
        out = _conv_kernel(hidden_states, weight, bias, activation, call.lay)
        if out is not None:
            return out
        _fall_back(call.mixer, "causal_conv1d")
    return segment_causal_conv1d(hidden_states, weight, bias, activation, call.lay)


@torch.compiler.disable
def _packed_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, **kwargs):
    call = _current("chunk_gated_delta_rule")
    if initial_state is not None:
        raise PackingDisabledError("a packed batch reached a GatedDeltaNet with a recurrent state from a cache; "
                                   "packed training never uses a cache (pass use_cache=False)")
    if call.mixer.use_scan_kernel:
        out = _gdr_kernel(query, key, value, g, beta, call.lay, use_qk_l2norm_in_kernel)
        if out is not None:
            return out, None
        _fall_back(call.mixer, "fla")
    out = segment_gated_delta_rule(query, key, value, g, beta, call.lay, chunk_size=chunk_size,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, formulation=call.mixer.formulation)
    return out, None


@torch.compiler.disable
def _packed_ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    call = _current("mamba2_chunk_scan")
    if initial_states is not None or return_final_states:
        raise PackingDisabledError("a packed batch reached a Mamba-2 mixer with a cache; packed training never uses "
                                   "a cache (pass use_cache=False)")
    if call.mixer.use_scan_kernel:
        out = _ssd_kernel(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, call.lay)
        if out is not None:
            return out
        _fall_back(call.mixer, "mamba_ssm")
    return segment_ssd_scan(hidden_states, dt, A, B, C, chunk_size, call.lay, D=D, dt_bias=dt_bias,
                            dt_softplus=dt_softplus, dt_limit=dt_limit)


@torch.compiler.disable
def _packed_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
    call = _current("mamba_selective_scan")
    if return_last_state:
        raise PackingDisabledError("a packed batch reached a Mamba mixer with a cache; packed training never uses a "
                                   "cache (pass use_cache=False)")
    return segment_selective_scan(hidden_states, dt, A, B, C, call.lay, D=D, z=z, delta_bias=delta_bias,
                                  delta_softplus=delta_softplus)


def _no_fused_path(*args, **kwargs):
    """The fused conv+scan kernels take no boundaries here: report "unavailable" so the model runs its unfused path
    (conv and scan separately, each boundary-exact)."""
    return None


def _no_decode(*args, **kwargs):
    raise PackingDisabledError("a packed batch reached a one-token cached decode step; packed training never uses a "
                               "cache (pass use_cache=False)")


# ---- families: which primitives a mixer's forward calls, and their packed replacements -------------------------


@dataclasses.dataclass(frozen=True)
class _Family:
    """One kind of mixer: the packed replacement of each sequence primitive its forward may call (``replace``), the
    leading parameter names transformers' primitive must have for the replacement to be a drop-in (``signatures``),
    the primitives its forward must call (``required``), and the kernels that may serve its conv and its scan.
    Any other global function the forward calls must be a per-token helper (``_PER_TOKEN_GLOBALS``) or a class."""

    name: str
    replace: dict[str, Callable]
    signatures: dict[str, tuple[str, ...]]
    required: tuple[str, ...]
    conv_kernel: str | None
    scan_kernel: str | None


_PER_TOKEN_GLOBALS = frozenset({
    "apply_mask_to_padding_states", "torch", "F", "nn", "hasattr", "getattr", "isinstance", "len", "int", "float",
    "min", "max", "tuple", "list", "super", "ACT2FN", "logger", "math", "is_torchdynamo_compiling",
})
_CONV = ("hidden_states", "weight", "bias", "activation")
_CONV_REPLACE = {"causal_conv1d_fn": _packed_conv1d, "causal_conv1d_update": _no_decode}

FAMILIES = {
    "gated-delta-net": _Family(
        "GatedDeltaNet",
        {**_CONV_REPLACE, "torch_chunk_gated_delta_rule": _packed_gated_delta_rule,
         "torch_recurrent_gated_delta_rule": _no_decode},
        {"causal_conv1d_fn": _CONV, "torch_chunk_gated_delta_rule": (
            "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
            "use_qk_l2norm_in_kernel")},
        ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"), "causal_conv1d", "fla"),
    "mamba2": _Family(
        "Mamba-2 (SSD)",
        {**_CONV_REPLACE, "mamba2_chunk_scan": _packed_ssd, "mamba2_selective_state_update": _no_decode,
         "mamba2_split_conv1d_scan_combined": _no_fused_path},
        {"causal_conv1d_fn": _CONV, "mamba2_chunk_scan": (
            "hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus",
            "dt_limit", "return_final_states")},
        ("causal_conv1d_fn", "mamba2_chunk_scan"), "causal_conv1d", "mamba_ssm"),
    "mamba": _Family(
        "Mamba-1 (selective scan)",
        {**_CONV_REPLACE, "mamba_selective_scan": _packed_selective_scan, "mamba_selective_state_update": _no_decode,
         "mamba_inner_fn": _no_fused_path},
        {"causal_conv1d_fn": _CONV, "mamba_selective_scan": (
            "hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state")},
        ("causal_conv1d_fn", "mamba_selective_scan"), "causal_conv1d", None),
    "short-conv": _Family(
        "short convolution", dict(_CONV_REPLACE), {"causal_conv1d_fn": _CONV}, ("causal_conv1d_fn",),
        "causal_conv1d", None),
}

MIXER_CLASSES: dict[str, str] = {
    # class name -> family; each one proven packed == per-sequence by the support sweep and tests/test_model_mixers.py
    "Qwen3NextGatedDeltaNet": "gated-delta-net",
    "Qwen3_5GatedDeltaNet": "gated-delta-net",
    "Qwen3_5MoeGatedDeltaNet": "gated-delta-net",
    "OlmoHybridGatedDeltaNet": "gated-delta-net",
    "BambaMixer": "mamba2",
    "FalconH1Mixer": "mamba2",
    "GraniteMoeHybridMambaLayer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2",
    "Mamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "mamba2",
    "JambaMambaMixer": "mamba",
    "MambaMixer": "mamba",
    "FalconMambaMixer": "mamba",
    "Lfm2ShortConv": "short-conv",
    "Lfm2MoeShortConv": "short-conv",
}
#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES = MIXER_CLASSES

def unwrap_function(fn: Callable) -> Callable:
    """The function inside ``fn``'s decorators (``functools.wraps`` chains, followed through ``__wrapped__``)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _globals_used(fn: Callable) -> set[str]:
    return {ins.argval for ins in dis.get_instructions(unwrap_function(fn)) if ins.opname == "LOAD_GLOBAL"}


def _rebind(fn: Callable, scope: dict[str, Any]) -> Callable:
    """A copy of ``fn`` (and of the decorator wrappers around it) whose innermost function resolves globals in
    ``scope`` instead of its module: the same code, other primitives, nothing shared mutated."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
        return new
    rebound = _rebind(inner, scope)
    cells, swapped = [], False
    for cell in fn.__closure__ or ():
        try:
            hit = cell.cell_contents is inner
        except ValueError:
            hit = False
        cells.append(types.CellType(rebound) if hit else cell)
        swapped |= hit
    if not swapped:
        raise UnsupportedModelError(f"cannot rebuild the decorated forward {fn.__qualname__}: its wrapper does not "
                                    f"hold the wrapped function in a closure")
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, rebound)
    return new


@functools.cache
def _packed_forward(cls: type) -> Callable:
    """The packed forward of mixer class ``cls``: its own forward, primitives replaced; refuses a forward that calls
    something padfree does not know (a new transformers version must be proven again before it is trusted)."""
    family = FAMILIES[MIXER_CLASSES[cls.__name__]]
    forward = cls.forward
    module_globals = sys.modules[unwrap_function(forward).__module__].__dict__
    used = _globals_used(forward)
    missing = [name for name in family.required if name not in used]
    unknown = sorted(used - set(family.replace) - _PER_TOKEN_GLOBALS - {k for k, v in module_globals.items()
                                                                          if isinstance(v, type)})
    if missing or unknown:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward (transformers {_transformers_version()}) does not have the shape padfree proved "
            f"exact: missing calls {missing}, unknown global functions {unknown}; it cannot be made packing-exact "
            f"until tests/test_model_mixers.py covers this version"
        )
    for name, params in family.signatures.items():
        have = tuple(inspect.signature(unwrap_function(module_globals[name])).parameters)
        if have[:len(params)] != params:
            raise UnsupportedModelError(
                f"{cls.__name__}: transformers' {name} now takes {have}, padfree's boundary-exact replacement "
                f"expects {params}; refusing rather than guessing"
            )
    scope = dict(module_globals)
    scope.update(family.replace)
    return _rebind(forward, scope)


def _transformers_version() -> str:
    try:
        import transformers

        return transformers.__version__
    except Exception:  # pragma: no cover
        return "?"


# ---- installation ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Mixer:
    """What a patched instance carries: the configured model's state, the packed forward and the choices made."""

    state: Any
    packed: Callable
    kind: str
    family: _Family
    use_conv_kernel: bool
    use_scan_kernel: bool
    formulation: str
    description: str
    on_cuda: bool


_TRIVIAL_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


@torch.compiler.disable
def _layout_of(info: _Mixer, hidden: Any, who: str) -> tuple[bool, PackedLayout | None]:
    """``(hooks live, layout of the forward in flight or None)`` for one mixer call."""
    live = hooks_live(info.state)
    if live and isinstance(hidden, torch.Tensor) and hidden.dim() >= 2:
        return live, current_layout(info.state, hidden, who)
    return live, None


def _mixer_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed as ``module.forward``: transformers' forward for an ordinary batch, the packed one otherwise."""
    info: _Mixer = self._padfree_mixer
    hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_states"))
    live, lay = _layout_of(info, hidden, type(self).__name__)
    if lay is None:
        if live:
            # An ordinary batch (one sequence per row): boundary kwargs a collator sent describe nothing to reset,
            # and transformers' own mixer refuses any of them without its CUDA kernels. Dropping them is exact.
            for key in _TRIVIAL_BOUNDARY_KWARGS:
                kwargs.pop(key, None)
        return type(self).forward(self, *args, **kwargs)
    named = guards.bind(type(self).forward, (self, *args), kwargs)
    cache = None if named is None else guards.find_cache(
        {k: v for k, v in named.items() if v is not self}, type(self).forward)
    if cache is not None:
        raise PackingDisabledError(f"{type(self).__name__} got {cache} with a packed batch; packed training never "
                                   f"uses a cache (pass use_cache=False)")
    token = _CALL.set(_Call(lay, info))
    try:
        return info.packed(self, *args, **kwargs)
    finally:
        _CALL.reset(token)


_REFERENCE = {
    "gated-delta-net": "exact torch chunked delta rule, state reset per segment ({formulation})",
    "mamba2": "exact torch SSD scan, masked per segment",
    "mamba": "exact torch selective scan, decay zeroed at segment starts (mamba_ssm's selective_scan_fn takes no "
             "boundaries)",
}
_KERNEL_DOC = {
    "fla": "flash-linear-attention chunk_gated_delta_rule with cu_seqlens (bf16/fp16 CUDA tensors)",
    "mamba_ssm": "mamba_ssm mamba_chunk_scan_combined with seq_idx (CUDA tensors)",
    "causal_conv1d": "causal-conv1d with seq_idx (CUDA tensors)",
}


def _choice(kernel: str | None, reference: str, on_cuda: bool) -> tuple[bool, str]:
    """``(kernel switched on, description)`` of one primitive."""
    if kernel is None:
        return False, reference
    usable, why = kernel_status(kernel)
    if not usable:
        return False, f"{reference} ({why})"
    if not on_cuda:
        return True, f"{reference} while the model is on the CPU; {_KERNEL_DOC[kernel]} on CUDA tensors"
    return True, _KERNEL_DOC[kernel]


def _describe(key: str, formulation: str, on_cuda: bool) -> tuple[bool, bool, str]:
    """``(conv kernel on, scan kernel on, one-line description)`` of family ``key`` as it would be installed now."""
    family = FAMILIES[key]
    conv_on, conv_doc = _choice(family.conv_kernel, "exact torch conv, taps reset at segment starts", on_cuda)
    reference = _REFERENCE.get(key, "").format(
        formulation=formulation if formulation != "auto" else "masked or per-segment, the cheaper per batch")
    scan_on, scan_doc = _choice(family.scan_kernel, reference, on_cuda) if reference else (False, "")
    parts = ([f"scan: {scan_doc}"] if scan_doc else []) + [f"conv: {conv_doc}"]
    return conv_on, scan_on, f"{family.name}: " + "; ".join(parts)


def install(module: torch.nn.Module, state: Any, *, formulation: str = "auto") -> str:
    """Make one mixer instance boundary-exact for packed batches of the model ``state`` belongs to; returns the
    one-line description of the implementation chosen for its scan and its conv (kernel or exact reference) and why.
    Idempotent: calling it again (a new ``configure_packing``) only rebinds the state.

    Kernels stay switched on when importable even for a model still on the CPU (it may move to CUDA after
    ``configure_packing``); every call checks the tensors' device and dtype again. A kernel that raises at its first
    call is switched off for good: the reference runs, and the description in the model's report says why.
    """
    name = type(module).__name__
    if name not in MIXER_CLASSES:
        raise UnsupportedModelError(f"{name} is not a mixer padfree knows how to make packing-exact")
    key = MIXER_CLASSES[name]
    packed = _packed_forward(type(module))
    on_cuda = any(p.is_cuda for p in module.parameters())
    conv_on, scan_on, description = _describe(key, formulation, on_cuda)
    module._padfree_mixer = _Mixer(state=state, packed=packed, kind=key, family=FAMILIES[key], use_conv_kernel=conv_on,
                                   use_scan_kernel=scan_on, formulation=formulation, description=description,
                                   on_cuda=on_cuda)
    module.forward = types.MethodType(_mixer_forward, module)
    return description


def _fall_back(info: _Mixer, kernel: str) -> None:
    """Switch ``info`` off ``kernel`` (it raised; see :func:`_call_kernel`) and rewrite the configured model's
    report, so that ``packing_state(model).report`` says what runs now and why."""
    if kernel not in _broken:
        return
    info.use_conv_kernel &= info.family.conv_kernel != kernel
    info.use_scan_kernel &= info.family.scan_kernel != kernel
    old = info.description
    *_, info.description = _describe(info.kind, info.formulation, info.on_cuda)
    report = getattr(info.state, "report", None)
    if report is not None:
        for qual, description in report.mixers.items():
            if description == old:
                report.mixers[qual] = info.description


def uninstall(module: torch.nn.Module) -> bool:
    """Undo :func:`install` on ``module`` and every mixer inside it; False if nothing was installed."""
    done = False
    for sub in module.modules():
        if "_padfree_mixer" in sub.__dict__:
            del sub._padfree_mixer
            sub.__dict__.pop("forward", None)
            done = True
    return done
