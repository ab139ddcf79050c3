"""The boundaries of one packed forward: built once per batch from the model's inputs, shared by every layer.

A :class:`PackedLayout` is what :func:`padfree.configure_packing`'s forward hook derives from ``position_ids``, a
LLaMA-Factory segment mask or flash-style ``cu_seq_lens_q``, and what the attention functions and sequence mixers
read instead of a dense mask. Every token of the ``(B, T)`` batch belongs to exactly one *segment*: a sequence, or a
row's padding run (a segment of its own, which no real token can see). Segments never cross rows.

The derived forms each kernel wants (``cu_seqlens`` over the flattened ``B·T`` stream, Mamba's ``seq_idx``, the
per-length buckets of the SDPA/eager path and of :func:`per_bucket`, flex ``BlockMask`` objects) are computed lazily,
on the batch's device, at most once per batch — layer 0 pays, every later layer reuses.

A layout may also carry *bidirectional blocks* (:meth:`PackedLayout.with_token_types`): groups of tokens inside one
sequence that see each other both ways — a Gemma image, PaliGemma's prefix — under a :class:`BlockRule` that says
how the model's own mask combines them with causal attention and its sliding window (:data:`BLOCK_RULES`).

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

__all__ = ["BLOCK_RULES", "BlockRule", "Buckets", "PackedLayout", "bucket_length", "per_bucket"]

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


@dataclasses.dataclass(frozen=True)
class BlockRule:
    """How a model's bidirectional blocks are found and how its own mask combines them with causal attention.

    Key ``k`` is visible to query ``q`` of the same sequence iff ``k <= q`` or both are in one block, with a
    layer's sliding window ``W`` (transformers' ``k > q - W``: it bounds the past only) applied as the model's mask
    applies it.

    Attributes:
        name: the model type whose mask this is.
        source: the model input the token types come from (``"token_type_ids"``, ``"mm_token_type_ids"``).
        kinds: the token types that form blocks.
        per_sample: False — every maximal run of those types inside a sequence is a block of its own (Gemma's
            images); True — all of a sequence's tokens of those types are one block (PaliGemma's prefix).
        sliding_only: the blocks apply on sliding-window layers only (Gemma 4: its full layers stay causal).
        window_bounds_blocks: True — ``(k <= q or same block) and k > q - W`` (Gemma 3 / 4 build the sliding mask
            so); False — ``(k <= q and k > q - W) or same block`` (transformers' ``block_sequence_ids`` path:
            gemma4_unified, PaliGemma 2's sliding layers).
    """

    name: str
    source: str
    kinds: tuple[int, ...]
    per_sample: bool
    sliding_only: bool
    window_bounds_blocks: bool


def _rules(*rules: BlockRule) -> dict[str, BlockRule]:
    return {rule.name: rule for rule in rules}


BLOCK_RULES: dict[str, BlockRule] = _rules(
    # Gemma3Model: runs of token_type_ids == 1 (images), every layer; sliding layers AND the window after the OR
    BlockRule("gemma3", "token_type_ids", (1,), per_sample=False, sliding_only=False, window_bounds_blocks=True),
    BlockRule("shieldgemma2", "token_type_ids", (1,), per_sample=False, sliding_only=False,
              window_bounds_blocks=True),
    # Gemma4Model (text config use_bidirectional_attention == "vision"): runs of images and videos (1, 2), sliding
    # layers only
    BlockRule("gemma4", "mm_token_type_ids", (1, 2), per_sample=False, sliding_only=True, window_bounds_blocks=True),
    # Gemma4UnifiedModel's forward: block_sequence_ids into create_masks_for_generate, OR-ed after the window
    BlockRule("gemma4_unified", "mm_token_type_ids", (1, 2), per_sample=False, sliding_only=False,
              window_bounds_blocks=False),
    # PaliGemma: the prefix (token_type_ids == 0: image and prompt) is one block per sequence, OR-ed after the window
    BlockRule("paligemma", "token_type_ids", (0,), per_sample=True, sliding_only=False, window_bounds_blocks=False),
)
"""The :class:`BlockRule` of every model type whose mask makes blocks of tokens bidirectional, by model type."""


def _as_rule(rule: Any) -> BlockRule:
    if isinstance(rule, BlockRule):
        return rule
    if isinstance(rule, str) and rule in BLOCK_RULES:
        return BLOCK_RULES[rule]
    raise InvalidArgumentError(f"rule must be a BlockRule or one of {', '.join(BLOCK_RULES)}, got {describe(rule)}")


def blocks_from_token_types(token_types: torch.Tensor, segment_ids: torch.Tensor, rule: BlockRule | str
                            ) -> torch.Tensor:
    """The block ids of a packed batch from its token types, intersected with its sequences.

    Args:
        token_types: ``(B, T)`` integers — the model's ``rule.source`` input over the packed row.
        segment_ids: ``(B, T)`` — the layout's segment ids (:attr:`PackedLayout.segment_ids`; 0: padding).
        rule: a :class:`BlockRule` or a model type of :data:`BLOCK_RULES`.

    Returns:
        ``(B, T) int64``: 0 for a token in no block, ``1, 2, ...`` for the blocks of a row (unique within the row):
        each maximal run of ``rule.kinds`` that stays inside one sequence (a run crossing a boundary is cut there),
        or, with ``rule.per_sample``, the sequence's own segment id for its tokens of those kinds. Padding: 0.

    >>> seg = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]])
    >>> blocks_from_token_types(torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1]]), seg, "gemma3").tolist()  # runs, cut
    [[0, 1, 1, 1, 2, 2, 0, 3]]
    >>> blocks_from_token_types(torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1]]), seg, "paligemma").tolist()
    [[1, 1, 0, 0, 2, 0, 0, 0]]
    """
    rule = _as_rule(rule)
    types = torch.as_tensor(_integers(token_types, rule.source, bool_ok=True))
    seg = torch.as_tensor(segment_ids)
    if types.dim() != 2 or tuple(types.shape) != tuple(seg.shape):
        raise InvalidLayoutError(f"{rule.source} must be (B, T) = {tuple(seg.shape)} like the packed batch, got a "
                                 f"tensor of shape {tuple(types.shape)}")
    types, seg = types.to(device=seg.device, dtype=torch.int64), seg.to(torch.int64)
    member = torch.isin(types, torch.tensor(rule.kinds, device=seg.device)) & (seg > 0)
    if rule.per_sample:
        return torch.where(member, seg, 0)
    start = member.clone()
    start[:, 1:] &= ~member[:, :-1] | (seg[:, 1:] != seg[:, :-1])  # a run restarts at every sequence boundary
    return torch.where(member, start.cumsum(1), 0)


@dataclasses.dataclass(eq=False)
class PackedLayout:
    """Segment boundaries of a ``(B, T)`` packed batch.

    Attributes:
        segment_ids: ``(B, T) int64`` — ``1, 2, 3, ...`` per sequence of a row; ``0`` marks padding from a
            LLaMA-Factory mask (a trailing run, its own segment).
        position_ids: ``(B, T) int64`` — restart at 0 at every sequence (what RoPE must see).
        lengths: ``(S,) int64`` numpy — the length of every segment of the flattened stream, padding runs included.
        source: which input the boundaries came from (``"position_ids"``, ``"attention_mask"``, ``"cu_seq_lens_q"``).
        blocks: ``(B, T) int64`` or None — bidirectional blocks (:meth:`with_blocks`): 0 for an ordinary token,
            ``k > 0`` for the tokens of block ``k`` of the row, every block inside one segment.
        block_rule: the :class:`BlockRule` the blocks follow (None without blocks).
    """

    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    lengths: np.ndarray
    source: str
    blocks: torch.Tensor | None = None
    block_rule: BlockRule | None = None
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

    def with_token_types(self, token_types: torch.Tensor, rule: BlockRule | str) -> PackedLayout:
        """This layout with the bidirectional blocks a model's token types make, intersected with the sequences
        (:func:`blocks_from_token_types`, then :meth:`with_blocks`).

        >>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 2]]))
        >>> lay.with_token_types(torch.tensor([[0, 1, 1, 1, 1, 0]]), "gemma3").blocks.tolist()
        [[0, 1, 1, 2, 2, 0]]
        """
        rule = _as_rule(rule)
        return self.with_blocks(blocks_from_token_types(token_types, self.segment_ids, rule), rule)

    def with_blocks(self, blocks: torch.Tensor, rule: BlockRule | str) -> PackedLayout:
        """This layout with bidirectional blocks, validated; the same layout when ``blocks`` holds none (then
        attention runs exactly the causal code of a layout without blocks).

        Args:
            blocks: ``(B, T)`` integers — 0 for an ordinary token, ``k > 0`` for the tokens of block ``k`` of the
                row. A block lies inside one segment (a block of two sequences would let them see each other);
                under a rule of runs (``rule.per_sample`` False) it is one contiguous run, as the model makes it.
            rule: a :class:`BlockRule` or a model type of :data:`BLOCK_RULES`.

        Returns:
            A layout with the same boundaries (and the derived forms already built) plus :attr:`blocks`.
        """
        rule = _as_rule(rule)
        blk = torch.as_tensor(_integers(blocks, "blocks"))
        if tuple(blk.shape) != self.shape:
            raise InvalidLayoutError(f"blocks must be (B, T) = {self.shape} like the packed batch, got a tensor of "
                                     f"shape {tuple(blk.shape)}")
        blk = blk.to(device=self.device, dtype=torch.int64)
        _check_blocks(blk, self.segment_ids, runs=not rule.per_sample)
        if not bool((blk > 0).any()):
            return self
        # the derived forms of the boundaries carry over; masks of blocks and column layouts do not
        kept = {k: v for k, v in self._cache.items() if not (isinstance(k, tuple) and k[0] in ("blocks", "columns"))}
        return PackedLayout(self.segment_ids, self.position_ids, self.lengths, self.source, blk, rule, kept)

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

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per layout and ``key``: what several modules derive from one forward's
        boundaries (cu_seqlens, buckets, masks, a scan's positions) is derived once per forward. A key of a module
        other than this one starts with that module's name (``("padfree.mixers", ...)``)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``(S + 1,) int32`` offsets of the segments over the flattened ``(B·T)`` stream (flash varlen layout)."""
        return self.memo("cu", lambda: torch.from_numpy(
            np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)).to(self.device))

    @property
    def seq_idx(self) -> torch.Tensor:
        """``(B, T) int32`` Mamba ``seq_idx``: the segment's index in the flattened stream."""
        return self.memo("seq_idx", lambda: torch.from_numpy(
            np.repeat(np.arange(self.num_segments, dtype=np.int32), self.lengths)).to(self.device).view(self.shape))

    def buckets(self, by: str = "bucket") -> Buckets:
        """The segments grouped for one batched call per group (see :class:`Buckets`), longest first, built once.

        ``by``: ``"bucket"`` — padded to :func:`bucket_length`, capped at the row width (what padfree's attention
        runs); ``"length"`` — one group per exact length (no repeated slot: for computations that depend on a
        sequence's length); ``"sequence"`` — one group per segment (for computations that mix the rows of a batch).
        """
        if by not in _GROUPINGS:
            raise InvalidArgumentError(f"by must be one of {', '.join(_GROUPINGS)}, got {describe(by)}")
        return self.memo("buckets" if by == "bucket" else ("buckets", by), lambda: self._make_buckets(by))

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
        return self.memo(("local", length, sliding_window), build)

    def blocks_apply(self, sliding_window: int | None) -> bool:
        """Whether a layer with this ``sliding_window`` (None: a full-attention layer) attends with the blocks."""
        return self.blocks is not None and (sliding_window is not None or not self.block_rule.sliding_only)

    def bucket_masks(self, sliding_window: int | None) -> tuple[torch.Tensor | None, ...]:
        """Per bucket of :meth:`buckets`, the ``(m, 1, L, L) bool`` mask (True = may attend) of its segments with
        their blocks under :attr:`block_rule`, or None for a bucket that holds no block (its mask is then
        :meth:`local_mask`, and SDPA runs it with ``is_causal``); built once per window.

        Slots past a segment's end repeat its last token: they are put in no block, so that a block query never
        sees them (they come after it, and the causal part hides them as it does without blocks).
        """
        if self.blocks is None:
            raise InvalidArgumentError("bucket_masks needs a layout with blocks (PackedLayout.with_blocks)")
        return self.memo(("blocks", "buckets", sliding_window), lambda: self._bucket_masks(sliding_window))

    def _bucket_masks(self, sliding_window: int | None) -> tuple[torch.Tensor | None, ...]:
        plan = self.buckets()
        slots = plan.slots.split(plan.sizes)
        ids = [self.blocks.reshape(-1)[s].view(m, n) for s, m, n in zip(slots, plan.counts, plan.lengths,
                                                                           strict=True)]
        for idx, blk in zip(slots, ids, strict=True):
            idx = idx.view(blk.shape)
            blk[:, 1:].masked_fill_(idx[:, 1:] == idx[:, :-1], 0)  # a repeated slot: in no block
        has = torch.stack([(blk > 0).any() for blk in ids]).tolist() if ids else []  # one host sync
        masks = []
        for blk, length, any_block in zip(ids, plan.lengths, has, strict=True):
            if not any_block:
                masks.append(None)
                continue
            same = (blk[:, :, None] == blk[:, None, :]) & (blk[:, :, None] > 0)  # (m, L, L)
            if sliding_window is not None and self.block_rule.window_bounds_blocks:
                i = torch.arange(length, device=self.device)
                same &= (i[:, None] - i[None, :]) < sliding_window  # the window bounds a block's past too
            masks.append((self.local_mask(length, sliding_window) | same).unsqueeze(1))
        return tuple(masks)

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
        if self.blocks_apply(sliding_window):  # the blocks' pairs join the causal ones (see _segment_block_mask)
            return self.memo(("blocks", "flex", sliding_window, block_size), lambda: _segment_block_mask(
                self.segment_ids, sliding_window, block_size, self.blocks, self.block_rule.window_bounds_blocks))
        return self.memo(("flex", sliding_window, block_size), lambda: _segment_block_mask(
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
            lay = PackedLayout._build(seg, self.position_ids[:, start:stop], self.source)
            # a block cut at ``start`` stays inside the segment that starts there
            return lay if self.blocks is None else lay.with_blocks(self.blocks[:, start:stop], self.block_rule)
        return self.memo(("columns", start, stop), build)

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


def _check_blocks(blk: torch.Tensor, seg: torch.Tensor, *, runs: bool) -> None:
    """InvalidLayoutError for block ids that are negative, hold tokens of two segments of a row, or (``runs``) are
    cut in two; one sort of the ``(row, block, segment)`` triples, no loop over tokens."""
    if bool((blk < 0).any()):
        row, col = (int(x) for x in torch.nonzero(blk < 0)[0])
        raise InvalidLayoutError(f"blocks[{row}, {col}] = {int(blk[row, col])} is negative; a block id is 0 (no "
                                 f"block) or 1, 2, ... (the blocks of a row)")
    inside = blk > 0
    if not bool(inside.any()):
        return
    rows = torch.arange(blk.shape[0], device=blk.device)[:, None].expand_as(blk)
    owners = torch.unique(torch.stack([rows[inside], blk[inside], seg[inside]]), dim=1)  # sorted (row, block, seg)
    split = (owners[0, 1:] == owners[0, :-1]) & (owners[1, 1:] == owners[1, :-1])
    if bool(split.any()):
        i = int(torch.nonzero(split)[0])
        row, block, first, second = (int(x) for x in (owners[0, i], owners[1, i], owners[2, i], owners[2, i + 1]))
        raise InvalidLayoutError(
            f"blocks: block {block} of row {row} holds tokens of segments {first} and {second}, so two packed "
            f"sequences would see each other; a bidirectional block lies inside one sequence (intersect the model's "
            f"blocks with the sequences: blocks_from_token_types)")
    if runs:
        start = inside.clone()
        start[:, 1:] &= blk[:, 1:] != blk[:, :-1]
        if int(start.sum()) != owners.shape[1]:  # a block that starts more than once is cut in two
            starts = torch.stack([rows[start], blk[start]])
            pairs, counts = torch.unique(starts, dim=1, return_counts=True)
            row, block = (int(x) for x in pairs[:, int(torch.nonzero(counts > 1)[0])])
            raise InvalidLayoutError(
                f"blocks: block {block} of row {row} is not one contiguous run of tokens; under this model's rule a "
                f"block is a run (give each run its own id)")


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


def _segment_block_mask(seg: torch.Tensor, sliding_window: int | None, block_size: int,
                        blocks: torch.Tensor | None = None, window_bounds_blocks: bool = True) -> Any:
    """``BlockMask`` of ``(B, T)`` non-decreasing segment ids (0: padding, trailing) from per-block id ranges.

    With ``blocks`` (``(B, T)``, 0: none), a pair of one segment is also allowed when both tokens are in one block
    (``window_bounds_blocks``: and the key is inside the window). Tiles that may hold such a pair — each holds a
    block token of a segment between the other's first and last block-token segment: a superset, which ``mask_mod``
    then decides pair by pair — are partial; a full tile stays full (every pair in it was allowed already)."""
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
    if blocks is not None:
        inside = (blocks > 0) & (seg > 0)
        first = torch.nn.functional.pad(seg.masked_fill(~inside, big), (0, pad), value=big)
        last = torch.nn.functional.pad(seg.masked_fill(~inside, -1), (0, pad), value=-1)
        first, last = first.view(batch, nb, block_size).amin(-1), last.view(batch, nb, block_size).amax(-1)
        pairs = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])  # (B, nq, nk)
        if sliding_window is not None and window_bounds_blocks:
            gap = i[:, None] - i[None, :]
            pairs &= ((gap - 1) * block_size + 1 < sliding_window) | (gap <= 0)
        any_pair = any_pair | pairs
    partial = any_pair & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = dense.unsqueeze(1).to(torch.int32)  # (B, 1, nb_q, nb_kv): one head, broadcast
        return (dense.sum(-1).to(torch.int32),
                torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))

    def mask_mod(b, h, q_idx, kv_idx):
        same = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] > 0) & (q_idx >= kv_idx)
        return same & (q_idx - kv_idx < sliding_window) if sliding_window is not None else same

    def block_mod(b, h, q_idx, kv_idx):
        own = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] > 0)
        joint = (blocks[b, q_idx] == blocks[b, kv_idx]) & (blocks[b, q_idx] > 0)
        if sliding_window is None:
            return own & ((q_idx >= kv_idx) | joint)
        inside = q_idx - kv_idx < sliding_window
        if window_bounds_blocks:
            return own & ((q_idx >= kv_idx) | joint) & inside
        return own & (((q_idx >= kv_idx) & inside) | joint)

    return BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod if blocks is None else block_mod, seq_lengths=(seq_len, seq_len))
