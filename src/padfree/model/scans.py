"""The exact per-segment references of the sequence mixers, in pure PyTorch: what each sequence computes alone.

- :func:`segment_causal_conv1d`: a short depthwise causal convolution with ``K - 1`` zeros spread before every
  segment (the zero history a lone sequence has), in one ``F.conv1d`` over the flattened batch;
- :func:`segment_gated_delta_rule`: the chunked gated delta rule (GatedDeltaNet), either in one call with
  per-segment masks inside the chunks or per segment (segments with the same number of chunks batched), whichever
  is cheaper for the layout;
- :func:`segment_ssd_scan`: the Mamba-2 SSD scan with its intra-chunk, chunk-state and inter-chunk terms masked to
  the segment;
- :func:`segment_selective_scan`: the Mamba-1 scan with the state's decay set to exactly 0 at every segment start.

They keep the arithmetic precision of transformers' own reference paths (under autocast too) and never build
denormal floats (decay factors below ``exp(DECAY_FLOOR)`` are exact zeros, far below fp32 resolution), so their
speed does not depend on a global flush-denormal mode, which padfree never touches.
:mod:`padfree.model.families.scan_mixers` rebinds a mixer's own forward to them (or to a kernel of
:mod:`padfree.model.cuda_kernels`) for packed batches.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> x = torch.arange(1.0, 6.0).view(1, 1, 5)  # (batch, channels, tokens)
>>> segment_causal_conv1d(x, torch.ones(1, 2), None, None, lay).tolist()  # out[t] = x[t-1] + x[t] within a segment
[[[1.0, 3.0, 5.0, 4.0, 9.0]]]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from padfree.model.packed import PackedLayout

__all__ = [
    "gdr_groups",
    "segment_causal_conv1d",
    "segment_gated_delta_rule",
    "segment_selective_scan",
    "segment_ssd_scan",
]


# ---- the boundaries, in the forms the references want (cached on the layout: built once per batch) ---------------


def _positions(lay: PackedLayout) -> torch.Tensor:
    """``(B, T) int64``: index of every token inside its segment (padding runs count as segments)."""
    def build() -> torch.Tensor:
        lengths = lay.lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        pos = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        return torch.from_numpy(pos).to(lay.device).view(lay.shape)
    return lay.memo(("padfree.mixers", "positions"), build)


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
    return lay.memo(("padfree.mixers", "conv", width), build)


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
    # the tokens written into a zeroed spread stream (backward: one gather), not a zero column concatenated to the
    # row and gathered (a copy of the whole row more, and a backward that adds into a zero tensor of the row)
    flat = flat.new_zeros(channels, gather.shape[0]).index_copy(1, where + (width - 1), flat)
    out = F.conv1d(flat.unsqueeze(0), weight.unsqueeze(1), bias, groups=channels)[0].index_select(1, where)
    out = out.view(channels, batch, seq_len).transpose(0, 1)
    if activation is not None:
        out = _act(activation)(out)
    return out.to(x.dtype)


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
    # the chunks split once (unbind), not indexed per step: the backward of ``x[:, :, i]`` writes its gradient into a
    # zero tensor of all of ``x``, which over n chunks is O(n^2) memory traffic (a row of 8k tokens: 128 chunks, most
    # of a packed DPO step); unbind's backward stacks the n gradients once
    chunks = zip(*(x.unbind(2) for x in (new_values, k_cumdecay, q, intra, k, chunk_decay)), strict=True)
    for values_i, cumdecay_i, q_i, intra_i, k_i, decay_i in chunks:  # the recurrence over chunks: inherent to it
        v_new = values_i - cumdecay_i @ state
        outs.append(q_i @ state + intra_i @ v_new)
        state = state * decay_i[:, :, None, None] + k_i.transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(rows, heads, -1, dv)[:, :, :length]


# Segments no longer than a chunk run as one chunk padded to a multiple of this many tokens (not to a whole chunk):
# the chunked rule is exact for any chunk size, and one chunk of 16-48 tokens costs a fraction of a 64-token one.
SHORT_STEP = 16


def _gdr_padded(lengths: np.ndarray, chunk: int) -> np.ndarray:
    """The padded length of every segment in the per-segment formulation: whole chunks, or for a segment no longer
    than a chunk, one chunk of the next multiple of :data:`SHORT_STEP`."""
    step = min(SHORT_STEP, chunk)
    return np.where(lengths > chunk, -(-lengths // chunk) * chunk, -(-lengths // step) * step)


def gdr_groups(lay: PackedLayout, chunk: int
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
    return lay.memo(("padfree.mixers", "gdr_groups", chunk), build)


# The per-segment formulation runs its segments in work units of at most this many (padded) tokens: a unit's
# temporaries (the chunks' (L, L) systems and decays, the state each chunk hands on: Hv * Dk * Dv floats per segment)
# then have a bounded size whatever the row's length, so a long packed row costs per token what a short one does.
# Unbounded, one group of a packed 8k-token row held ~30 segments at once (a 60 MB state for Qwen3.5's 32 x 128 x 128
# heads), out of cache and above glibc's 32 MiB mmap threshold, so faulted in afresh at every chunk step.
GDR_UNIT_TOKENS = 512


def _gdr_plan(lay: PackedLayout, chunk: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """The per-segment formulation's layout, built once per batch: ``order`` (``(P,)``: the flat ``B*T`` index of
    every padded slot, the segments of each :func:`gdr_groups` group one after another; ``B*T`` for the slots past a
    segment's end), ``inverse`` (``(B*T,)``: where every token sits in ``order``) and the work units ``(rows,
    length, chunk)`` that split ``order`` into consecutive blocks of at most :data:`GDR_UNIT_TOKENS` tokens (a
    segment longer than that is a unit of its own)."""
    def build():
        orders, valids, units = [], [], []
        for size, group_chunk, gather, valid, _ in gdr_groups(lay, chunk):
            orders.append(gather.reshape(-1))
            valids.append(valid)
            members, per = gather.shape[0], max(1, GDR_UNIT_TOKENS // size)
            units += [(min(per, members - i), size, group_chunk) for i in range(0, members, per)]
        order, valid = torch.cat(orders), torch.cat(valids)
        inverse = torch.empty(int(lay.lengths.sum()), dtype=torch.int64, device=lay.device)
        inverse[order[valid]] = valid.nonzero().view(-1)
        return order, inverse, units
    return lay.memo(("padfree.mixers", "gdr_plan", chunk, GDR_UNIT_TOKENS), build)


def _gdr_per_segment(q, k, v, beta, g, lay: PackedLayout, chunk: int) -> torch.Tensor:
    """Every segment as its own row (segments of equal padded length batched, in units of at most
    :data:`GDR_UNIT_TOKENS` tokens): ``(B, T, H, D)`` in (``beta``, ``g``: ``(B, T, H)``), ``(B, T, H, Dv)`` out.

    Each input is written into the padded order once (``index_copy`` into zeros: the slots past a segment's end stay
    zero; its backward is one gather) and the output gathered back once (one ``index_select``): gathering per group
    instead scattered every group's gradient into a zero tensor of the whole row, a cost per token that grew with the
    row's number of groups. The inputs stay in the token-major layout the mixer hands over, so no whole-row
    transpose, zero-row concatenation or scatter of a gradient into a zero row-sized tensor runs around the units:
    each of those is a pass over the row that leaves the caches once the row outgrows them (8k tokens x 32 heads x
    128 floats = 128 MiB), so it cost a long packed row more per token than a short one."""
    batch, seq_len, heads = q.shape[:3]
    total = batch * seq_len
    order, inverse, units = _gdr_plan(lay, chunk)
    sizes = [rows * length for rows, length, _ in units]

    def padded(x):  # (B, T, H, ...) -> the units' (r, H, L, ...) rows
        flat = x.reshape(total, heads, *x.shape[3:])
        x = flat.new_zeros(order.shape[0], *flat.shape[1:]).index_copy(0, inverse, flat)
        return [part.view(rows, length, *part.shape[1:]).movedim(2, 1)
                for part, (rows, length, _) in zip(x.split(sizes), units, strict=True)]

    ins = [padded(x) for x in (q, k, v, beta, g)]
    outs = [_gdr_chunked(*unit, None, unit_chunk).movedim(1, 2).reshape(-1, heads, v.shape[-1])
            for *unit, (_, _, unit_chunk) in zip(*ins, units, strict=True)]
    return torch.cat(outs).index_select(0, inverse).view(batch, seq_len, heads, -1)


def gdr_formulation(lay: PackedLayout, chunk: int) -> str:
    """``"per-segment"`` unless padding the segments (:func:`_gdr_padded`) adds more than half the batch's tokens
    (very many very short segments), then ``"masked"``. Measured in ``benchmarks/bench_mixers.py`` (BENCHMARKS.md):
    per-segment is the faster formulation for 7 and 64 sequences per row at T = 2k and 8k."""
    def build() -> str:
        padded = int(_gdr_padded(lay.lengths, chunk).sum())
        return "per-segment" if padded <= 1.5 * lay.lengths.sum() else "masked"
    return lay.memo(("padfree.mixers", "gdr_form", chunk), build)


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
    if formulation == "auto":
        formulation = gdr_formulation(lay, chunk_size)
    if formulation not in ("masked", "per-segment"):
        raise ValueError(f"formulation must be 'auto', 'masked' or 'per-segment', got {formulation!r}")
    # per-segment: token-major (B, T, H, D), as the mixer hands them; masked: head-major (B, H, T, D) rows
    major = (lambda x: x.to(torch.float32)) if formulation == "per-segment" else (
        lambda x: x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format))
    q, k, v, b, gg = (major(x) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    if formulation == "per-segment":
        return _gdr_per_segment(q, k, v, b, gg, lay, chunk_size).to(dtype)
    out = _gdr_chunked(q, k, v, b, gg, lay.seq_idx.to(torch.int64), chunk_size)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)


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


# ---- Mamba-1 selective scan --------------------------------------------------------------------------------------


def _starts(lay: PackedLayout) -> torch.Tensor:
    return lay.memo(("padfree.mixers", "starts"), lambda: _positions(lay) == 0)


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
