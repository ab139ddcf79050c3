"""The boundaries of one packed forward: built once per batch from the model's inputs, shared by every layer.

A :class:`PackedLayout` is what :func:`padfree.configure_packing`'s forward hook derives from ``position_ids``, a
LLaMA-Factory segment mask or flash-style ``cu_seq_lens_q``, and what the attention functions and sequence mixers
read instead of a dense mask. Every token of the ``(B, T)`` batch belongs to exactly one *segment*: a sequence, or a
row's padding run (a segment of its own, which no real token can see). Segments never cross rows.

The derived forms each kernel wants (``cu_seqlens`` over the flattened ``B·T`` stream, Mamba's ``seq_idx``, the
per-length buckets of the SDPA/eager path and of :func:`per_bucket`, flex ``BlockMask`` objects) are computed lazily,
on the batch's device, at most once per batch — layer 0 pays, every later layer reuses.

>>> import torch
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]))
>>> lay.cu_seqlens.tolist(), lay.max_seqlen, lay.num_segments
([0, 3, 5, 6, 8, 12], 4, 5)
>>> lay.seq_idx.tolist()
[[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from padfree import layout
from padfree.errors import InvalidArgumentError, InvalidLayoutError, describe
from padfree.packing.inputs import as_int

__all__ = ["Buckets", "PackedLayout", "bucket_length", "per_bucket"]

_GROUPINGS = ("bucket", "length", "sequence")


def bucket_length(n: np.ndarray) -> np.ndarray:
    """Round segment lengths up to a quarter-octave grid (multiples of ``max(8, 2**floor(log2 n) / 4)``).

    Segments of one bucket are padded to a common length and run as one batched attention call, so the grid trades
    wasted score entries (at most ``(1.25)**2 - 1 ≈ 56%`` of a segment's own, usually far less) against the number of
    calls per layer (about ``4 * log2(T / 32)``).

    >>> bucket_length(np.array([1, 8, 9, 100, 1000, 1500])).tolist()
    [8, 8, 16, 112, 1024, 1536]
    """
    n = np.asarray(n, dtype=np.int64)
    octave = np.left_shift(1, np.floor(np.log2(np.maximum(n, 1))).astype(np.int64))
    step = np.maximum(8, octave // 4)
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The segments grouped by padded length, laid out for one batched attention call per group.

    Bucket ``i`` holds ``counts[i]`` segments padded to ``lengths[i]`` tokens; their slots are consecutive in
    ``slots``, bucket after bucket, segment after segment. One gather over ``slots`` feeds every bucket and one
    gather over ``inverse`` puts the outputs back, so the backward is one scatter-add per tensor, not one per bucket.

    Attributes:
        lengths: ``L`` of every bucket, longest first.
        counts: ``m`` of every bucket.
        slots: ``(sum(m * L),) int64`` — flat ``B·T`` token index of every slot; slots past a segment's end repeat
            its last token (never read by a valid query: they come after it, and attention is causal).
        inverse: ``(B·T,) int64`` — the slot that holds each token.
    """

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    slots: torch.Tensor
    inverse: torch.Tensor

    @property
    def sizes(self) -> list[int]:
        """Slots per bucket, ``m * L`` (the split sizes of a gather over :attr:`slots`)."""
        return [m * n for m, n in zip(self.counts, self.lengths, strict=True)]


@dataclasses.dataclass(eq=False)
class PackedLayout:
    """Segment boundaries of a ``(B, T)`` packed batch.

    Attributes:
        segment_ids: ``(B, T) int64`` — ``1, 2, 3, ...`` per sequence of a row; ``0`` marks padding from a
            LLaMA-Factory mask (a trailing run, its own segment).
        position_ids: ``(B, T) int64`` — restart at 0 at every sequence (what RoPE must see).
        lengths: ``(S,) int64`` numpy — the length of every segment of the flattened stream, padding runs included.
        source: which input the boundaries came from (``"position_ids"``, ``"attention_mask"``, ``"cu_seq_lens_q"``).
    """

    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: np.ndarray
    source: str
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    # ---- construction ------------------------------------------------------------------------------------------

    @classmethod
    def from_segment_ids(cls, segment_ids: torch.Tensor, *, source: str = "attention_mask") -> PackedLayout:
        """From LLaMA-Factory segment ids (``[[1, 1, 2, 2, 2, 0]]``: runs of 1, 2, ... then padding 0), validated."""
        segment_ids = torch.as_tensor(_integers(segment_ids, "segment_ids", bool_ok=True))
        layout.segment_ids_to_lengths(segment_ids)  # validates: runs in order, padding only trailing
        seg = segment_ids.to(torch.int64)
        return cls._build(seg, layout.segment_ids_to_position_ids(seg, check=False).to(torch.int64), source)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> PackedLayout:
        """From ``(B, T)`` position ids restarting at 0 at every sequence; anything else is InvalidLayoutError."""
        position_ids = torch.as_tensor(_integers(position_ids, "position_ids"))
        seg = layout.position_ids_to_segment_ids(position_ids)
        return cls._build(seg, position_ids.to(torch.int64), "position_ids")

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> PackedLayout:
        """From flash-style offsets over the flattened ``(B·T)`` stream (``cu_seq_lens_q``); they must cover it
        exactly and start a segment at every row."""
        cu = torch.as_tensor(_integers(cu_seqlens, "cu_seq_lens_q")).reshape(-1).to(torch.int64)
        batch, seq_len = as_int(batch, "batch", minimum=1), as_int(seq_len, "seq_len", minimum=1)
        total = batch * seq_len
        host = cu.cpu().numpy()
        if host.size < 1 or host[0] != 0 or host[-1] != total or (np.diff(host) <= 0).any():
            raise InvalidLayoutError(
                f"cu_seq_lens_q = {host.tolist()[:12]}{'...' if host.size > 12 else ''} does not describe the "
                f"flattened batch of {batch} x {seq_len} = {total} tokens: it must start at 0, increase strictly and "
                f"end at {total}"
            )
        missing = np.setdiff1d(np.arange(0, total, seq_len), host)
        if missing.size:
            raise InvalidLayoutError(
                f"cu_seq_lens_q lets a sequence cross from row {missing[0] // seq_len - 1} into row "
                f"{missing[0] // seq_len} (no offset at flat index {missing[0]}); a packed sequence lives in one row"
            )
        starts = torch.zeros(total, dtype=torch.int64, device=cu.device)
        starts[cu[:-1]] = 1
        seg = starts.view(batch, seq_len).cumsum(1)
        return cls._build(seg, layout.segment_ids_to_position_ids(seg, check=False).to(torch.int64), "cu_seq_lens_q")

    @classmethod
    def _build(cls, seg: torch.Tensor, pos: torch.Tensor, source: str) -> PackedLayout:
        batch, seq_len = seg.shape
        start = torch.ones_like(seg, dtype=torch.bool)
        start[:, 1:] = seg[:, 1:] != seg[:, :-1]
        offsets = torch.nonzero(start.reshape(-1)).reshape(-1).cpu().numpy()  # the one host sync of a batch
        lengths = np.diff(np.append(offsets, batch * seq_len)).astype(np.int64)
        return cls(seg, pos, lengths, source)

    # ---- derived forms -----------------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.segment_ids.shape)

    @property
    def device(self) -> torch.device:
        return self.segment_ids.device

    @property
    def num_segments(self) -> int:
        return int(self.lengths.size)

    @property
    def max_seqlen(self) -> int:
        return int(self.lengths.max()) if self.lengths.size else 0

    @property
    def is_packed(self) -> bool:
        """True when some row holds more than one segment."""
        return self.num_segments > self.shape[0]

    def _cached(self, key: Any, build: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``(S + 1,) int32`` offsets of the segments over the flattened ``(B·T)`` stream (flash varlen layout)."""
        return self._cached("cu", lambda: torch.from_numpy(
            np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)).to(self.device))

    @property
    def seq_idx(self) -> torch.Tensor:
        """``(B, T) int32`` Mamba ``seq_idx``: the segment's index in the flattened stream."""
        return self._cached("seq_idx", lambda: torch.from_numpy(
            np.repeat(np.arange(self.num_segments, dtype=np.int32), self.lengths)).to(self.device).view(self.shape))

    def buckets(self, by: str = "bucket") -> Buckets:
        """The segments grouped for one batched call per group (see :class:`Buckets`), longest first, built once.

        ``by``: ``"bucket"`` — padded to :func:`bucket_length`, capped at the row width (what padfree's attention
        runs); ``"length"`` — one group per exact length (no repeated slot: for computations that depend on a
        sequence's length); ``"sequence"`` — one group per segment (for computations that mix the rows of a batch).
        """
        if by not in _GROUPINGS:
            raise InvalidArgumentError(f"by must be one of {', '.join(_GROUPINGS)}, got {describe(by)}")
        return self._cached("buckets" if by == "bucket" else ("buckets", by), lambda: self._make_buckets(by))

    def _make_buckets(self, by: str) -> Buckets:
        lengths = self.lengths
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        if by == "sequence":  # each segment alone: its own group, longest first (ties: in order)
            keys = np.argsort(-lengths, kind="stable")
            groups = [(int(lengths[i]), np.array([i])) for i in keys]
        else:
            # a bucket never outgrows the row: repeated slots past the row width would be pure waste
            padded = np.minimum(bucket_length(lengths), self.shape[1]) if by == "bucket" else lengths
            groups = [(int(size), np.flatnonzero(padded == size)) for size in np.unique(padded)[::-1]]
        sizes, counts, slots, inverse = [], [], [], np.empty(int(lengths.sum()), dtype=np.int64)
        base = 0
        for size, members in groups:
            col = np.arange(size)
            n = lengths[members, None]
            gather = starts[members, None] + np.minimum(col, n - 1)
            valid = col < n
            inverse[gather[valid]] = base + np.flatnonzero(valid.reshape(-1))
            sizes.append(size)
            counts.append(int(members.size))
            slots.append(gather.reshape(-1))
            base += gather.size
        return Buckets(tuple(sizes), tuple(counts), torch.from_numpy(np.concatenate(slots)).to(self.device),
                       torch.from_numpy(inverse).to(self.device))

    def local_mask(self, length: int, sliding_window: int | None) -> torch.Tensor:
        """``(L, L) bool`` causal mask of one bucket slot (True = may attend), with ``q - k < sliding_window``."""
        def build() -> torch.Tensor:
            i = torch.arange(length, device=self.device)
            diff = i[:, None] - i[None, :]
            allowed = diff >= 0
            return allowed & (diff < sliding_window) if sliding_window is not None else allowed
        return self._cached(("local", length, sliding_window), build)

    def block_mask(self, sliding_window: int | None, block_size: int = 128) -> Any:
        """The flex-attention ``BlockMask`` of the batch (padding runs see nothing), cached per window.

        The same mask as :func:`padfree.layout.block_mask` (``create_block_mask`` over a ``mask_mod`` comparing
        segment ids), built without evaluating ``mask_mod`` on the ``T x T`` grid: segment ids never decrease along a
        row, so block ``(i, j)`` of ``block_size`` queries x keys holds an allowed pair iff it is on the diagonal and
        holds a real token, or ``j < i`` and the last segment of key block ``j`` is the first of query block ``i``
        (and, with a window, its closest pair is inside it); it is *full* iff both blocks lie inside one real segment,
        below the diagonal, complete, and (with a window) its farthest pair is inside it. ``O(B x (T / block)^2)``
        work and memory instead of ``O(B x T^2)`` (640 MiB and up to a second at 8k tokens).
        """
        return self._cached(("flex", sliding_window, block_size), lambda: _segment_block_mask(
            self.segment_ids, sliding_window, block_size))

    def columns(self, start: int, stop: int) -> PackedLayout:
        """The layout of tokens ``[start, stop)`` of every row, built once: the boundaries the rows have there, and
        the window's first token starting a segment (a sequence cut there continues as one inside the window).

        >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
        >>> lay.columns(1, 5).lengths.tolist(), lay.columns(1, 5).position_ids.tolist()
        ([2, 2], [[1, 2, 0, 1]])
        """
        def build() -> PackedLayout:
            seg = self.segment_ids[:, start:stop]
            return PackedLayout._build(seg, self.position_ids[:, start:stop], self.source)
        return self._cached(("columns", start, stop), build)

    def check_tokens(self, hidden: torch.Tensor, who: str) -> None:
        """Refuse a tensor whose ``(B, T)`` is not the layout's: the layout belongs to another forward."""
        if tuple(hidden.shape[:2]) != self.shape:
            raise InvalidLayoutError(
                f"{who} got inputs of shape {tuple(hidden.shape[:2])} but the packed layout of this forward is "
                f"{self.shape}; the boundaries belong to another batch"
            )


def _integers(value: Any, name: str, *, bool_ok: bool = False) -> Any:
    """``value`` as an integer tensor or array (lists and numpy arrays accepted), or one error naming ``name``:
    a float offset or position would be truncated to a different boundary without a word."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError):
            raise InvalidLayoutError(f"{name} must be an integer tensor, got {describe(value)}") from None
    if value.dtype.is_floating_point or value.dtype.is_complex or (value.dtype == torch.bool and not bool_ok):
        accepted = "integers or booleans" if bool_ok else "integers"
        raise InvalidLayoutError(f"{name} must hold {accepted}, got dtype {value.dtype} ({describe(value.tolist())})")
    return value


def per_bucket(run: Callable[..., torch.Tensor], lay: PackedLayout, *tokens: torch.Tensor, by: str = "bucket"
               ) -> torch.Tensor:
    """``run`` once per group of segments (:meth:`PackedLayout.buckets`), its outputs put back in packed order.

    Args:
        run: ``run(length, count, *blocks) -> (count, length, ...)``; block ``i`` is ``tokens[i]`` of the group's
            segments, ``(count, length, ...)``. Slots past a segment's end repeat its last token: ``run`` must let no
            real token see them (causal attention does not).
        lay: the packed layout of the ``(B, T)`` batch.
        tokens: ``(B, T, ...)`` per-token tensors.
        by: the grouping (``"bucket"``, ``"length"`` or ``"sequence"``).

    Returns:
        ``(B, T, ...)``: every token's output from the run of its own segment. One gather per input and one for the
        output, so the backward is one scatter-add per tensor.

    >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    >>> x = torch.arange(6.0).view(1, 6, 1)
    >>> per_bucket(lambda n, m, b: b.cumsum(1), lay, x).view(-1).tolist()  # a running sum per sequence
    [0.0, 1.0, 3.0, 3.0, 7.0, 5.0]
    """
    plan = lay.buckets(by)
    batch, seq_len = lay.shape
    parts = [t.reshape(batch * seq_len, *t.shape[2:]).index_select(0, plan.slots).split(plan.sizes) for t in tokens]
    outs = []
    for i, (length, count) in enumerate(zip(plan.lengths, plan.counts, strict=True)):
        out = run(length, count, *(p[i].view(count, length, *p[i].shape[1:]) for p in parts))
        outs.append(out.reshape(count * length, *out.shape[2:]))
    merged = torch.cat(outs).index_select(0, plan.inverse)
    return merged.view(batch, seq_len, *merged.shape[1:])


def _segment_block_mask(seg: torch.Tensor, sliding_window: int | None, block_size: int) -> Any:
    """``BlockMask`` of ``(B, T)`` non-decreasing segment ids (0: padding, trailing) from per-block id ranges."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, seq_len = seg.shape
    nb = -(-seq_len // block_size)
    pad = nb * block_size - seq_len
    big = torch.iinfo(torch.int64).max
    ids = seg.masked_fill(seg == 0, big)  # padding: after every real id, matching nothing
    ids = torch.nn.functional.pad(ids, (0, pad), value=big).view(batch, nb, block_size)
    lo, hi = ids[..., 0], ids[..., -1]  # (B, nb): first and last id of every block
    real = lo != big  # the block's first token is a real one (ids never decrease: then it holds a real token)
    i = torch.arange(nb, device=seg.device)
    below = i[:, None] > i[None, :]  # (nb_q, nb_kv): strictly below the diagonal
    shared = (hi[:, None, :] == lo[:, :, None]) & real[:, :, None]  # key block j's last id is query block i's first
    any_pair = (below & shared) | (torch.eye(nb, dtype=torch.bool, device=seg.device) & real[:, :, None])
    whole = (lo == hi) & real  # one real segment fills the block
    if pad:
        whole[:, -1] = False  # a block cut by the end of the row is never full (flex pads it with masked slots)
    full = below & shared & whole[:, :, None] & whole[:, None, :]
    if sliding_window is not None:
        gap = i[:, None] - i[None, :]  # blocks apart: closest pair (gap - 1) * bs + 1, farthest (gap + 1) * bs - 1
        any_pair &= ((gap - 1) * block_size + 1 < sliding_window) | (gap == 0)
        full &= (gap + 1) * block_size - 1 < sliding_window
    partial = any_pair & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = dense.unsqueeze(1).to(torch.int32)  # (B, 1, nb_q, nb_kv): one head, broadcast
        return (dense.sum(-1).to(torch.int32),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

    def mask_mod(b, h, q_idx, kv_idx):
        same = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] > 0) & (q_idx >= kv_idx)
        return same & (q_idx - kv_idx < sliding_window) if sliding_window is not None else same

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))
