"""Online packing of an unbounded stream: ``StreamPacker``, buffered or truly online.

**Online** (``strategy="nf"`` or ``"hk"`` without a ``buffer_size``, as SeqPacker's ``StreamPacker`` works): a bin
leaves the moment next fit or harmonic-k closes it, memory is bounded by the open bins, and ``finish()`` closes the
stream (:mod:`padfree.packing.online`).

**Buffered** (any strategy with a ``buffer_size``, 10,000 by default for the offline ones): items are buffered; each
time the buffer holds ``buffer_size`` pieces it is packed with an offline strategy and the well-filled bins leave.
The few worst-filled bins of a round go back to the buffer once, so that they can meet the items of the next round —
the tail of a best-fit-decreasing plan is where its waste sits. A piece is held back at most once, so every item
leaves within two rounds of arriving, and the buffer never exceeds ``buffer_size``. ``flush()`` packs and emits
whatever is left.

The bins emitted depend only on the sequence of lengths added, not on how the calls to ``add`` were chunked;
when the buffer is large enough to hold the whole stream, the bins are exactly those of ``pack_sequences``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, describe
from padfree.packing.inputs import (
    MAX_PIECES,
    apply_overlong,
    as_fraction,
    as_lengths,
    as_positive_int,
)
from padfree.packing.online import OnlineState
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import STRATEGIES, place

__all__ = ["StreamBin", "StreamPacker"]


@dataclass(frozen=True, eq=False)
class StreamBin:
    """One completed bin of a stream.

    Attributes:
        ids: ``(k,) int64`` — position of each piece's item in the stream (0 for the first item ever added).
        starts: ``(k,) int64`` — first token of each piece within its item (non-zero only for split pieces).
        lengths: ``(k,) int64`` — tokens of each piece.
        items: the payloads passed to ``add(..., items=...)``, aligned with ``ids``; None if none were given.
    """

    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    items: list[Any] | None = None

    @property
    def fill(self) -> int:
        """Real tokens in the bin."""
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __repr__(self) -> str:
        return f"StreamBin(ids={self.ids.tolist()}, lengths={self.lengths.tolist()})"


class StreamPacker:
    """Pack an unbounded stream of sequences into bins of ``capacity`` tokens, online.

    Args:
        capacity: tokens per bin.
        buffer_size: pieces held before a round of packing; larger buffers pack better (10,000 gives > 99.5% on
            long-tailed lengths) and delay the first bin longer. None (the default): 10,000 for the offline
            strategies, and the online mode for ``"nf"`` / ``"hk"`` (no buffer: each bin leaves when it closes).
        strategy: an offline strategy name (see :data:`padfree.packing.STRATEGIES`; case-insensitive, SeqPacker's
            names accepted as aliases) used inside each round.
        seed: seeds randomized strategies (one generator for the whole stream).
        overlong: ``"error" | "truncate" | "split" | "drop"``, as in :func:`padfree.pack_sequences`.
        max_sequences_per_bin: at most this many pieces per bin.
        spec: ``capacity``, ``strategy``, ``seed``, ``overlong`` and ``max_sequences_per_bin`` as one
            :class:`~padfree.PackingSpec`, in place of those keywords. A strategy that cuts sequences at the rows'
            edges (``wrapped``) needs the whole input in order and is refused.
        hold_fill: bins filled below this fraction of ``capacity`` go back to the buffer once (at most half the
            buffer is held back); 0 disables holding.
        k: harmonic-k's number of size classes in the online mode (SeqPacker's ``k``).

    Online, as SeqPacker streams (next fit closes bin 0 when 4 tokens do not fit beside 5):

    >>> online = StreamPacker(capacity=8, strategy="nf")
    >>> [b.ids.tolist() for b in online.add([5, 2, 4])], [b.ids.tolist() for b in online.finish()]
    ([[0, 1]], [[2]])

    Buffered:

    >>> packer = StreamPacker(capacity=8, buffer_size=4)
    >>> [b.ids.tolist() for b in packer.add([5, 3, 4, 2, 6])]  # round 1 packs [5, 3, 4, 2]; [4, 2] is held back
    [[0, 1]]
    >>> [b.ids.tolist() for b in packer.flush()]
    [[4, 3], [2]]
    >>> packer.stats()["efficiency"]
    0.8333333333333334
    """

    def __init__(
        self,
        capacity: int | None = None,
        buffer_size: int | None = None,
        strategy: str = "obfd",
        seed: int | None = None,
        *,
        overlong: str = "error",
        max_sequences_per_bin: int | None = None,
        spec: PackingSpec | None = None,
        hold_fill: float = 0.99,
        k: int = 8,
    ) -> None:
        self.spec = PackingSpec.resolve(spec, {"capacity": capacity, "strategy": strategy, "seed": seed,
                                               "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin})
        if self.spec.cuts_at_row_edges:
            raise InvalidArgumentError(
                f"StreamPacker: strategy={self.spec.strategy!r} cuts the sequences at the rows' edges of one plan "
                f"over the whole input in order; a stream is packed round by round: choose another strategy (e.g. "
                f"'nf' with buffer_size=None, which also keeps the input order) or pack the data as a whole")
        self.capacity = self.spec.capacity
        strategy = self.spec.strategy
        self.online = buffer_size is None and strategy in ("nf", "hk")
        if buffer_size is None:
            buffer_size = 10_000
        self.buffer_size: int = as_positive_int(buffer_size, "buffer_size")  # type: ignore[assignment]
        if self.buffer_size > MAX_PIECES:  # a round places the whole buffer at once
            raise InvalidArgumentError(
                f"buffer_size must be an integer >= 1 and <= {MAX_PIECES} (the pieces one round can place), "
                f"got {self.buffer_size}"
            )
        self.strategy = strategy
        self.k: int = as_positive_int(k, "k")  # type: ignore[assignment]
        self.seed = self.spec.seed
        self.overlong = self.spec.overlong
        self.max_sequences_per_bin = self.spec.max_sequences_per_bin
        self.hold_fill = as_fraction(hold_fill, "hold_fill")
        self._rng = np.random.default_rng(self.seed) if STRATEGIES[self.strategy].randomized else None
        # the buffer, as parallel arrays of pieces (ids, starts, lengths, held-once flags) + payloads
        self._ids = np.zeros(0, np.int64)
        self._starts = np.zeros(0, np.int64)
        self._lengths = np.zeros(0, np.int64)
        self._held = np.zeros(0, bool)
        self._items: list[Any] | None = None
        self._seen = 0
        self._bins = 0
        self._tokens_out = 0
        self._truncated = 0
        self._dropped_items = 0
        self._dropped_tokens = 0
        self._online = OnlineState(self.capacity, strategy, self.k, self.max_sequences_per_bin) if self.online else None
        self._open: dict[int, list[list[Any]]] = {}  # online: bin id -> [ids, starts, lengths, items] of its pieces
        self._finished = False  # finish() ends the stream: nothing is added after it

    # ---- public ----------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Pieces waiting in the buffer (online: in the open bins)."""
        if self.online:
            return sum(len(pieces[0]) for pieces in self._open.values())
        return int(self._lengths.shape[0])

    def add(self, lengths: Any, items: Sequence[Any] | None = None) -> list[StreamBin]:
        """Add items by their lengths (an int or a 1-D array-like); return the bins completed by this call.

        ``items`` (same length as ``lengths``) are payloads carried into :attr:`StreamBin.items`; give them on
        every call or on none. Refused after :meth:`finish`, which ended the stream (:meth:`flush` does not).
        """
        if self._finished:
            raise InvalidArgumentError(
                f"StreamPacker.add({describe(lengths)}) after finish(): finish() ended the stream and emitted its last "
                f"bins; add items before finish(), call flush() to empty the buffer mid-stream, or start a new "
                f"StreamPacker"
            )
        if isinstance(lengths, (int, np.integer)) and not isinstance(lengths, bool):
            lengths = [lengths]
            items = None if items is None else [items]
        lengths = as_lengths(lengths)
        if items is not None:
            accepted = f"items must be a sequence of payloads (one per length) or None, got {describe(items)}"
            # a string or a dict is iterable, but as a list of payloads it is almost surely a mistake
            if isinstance(items, (str, bytes, dict)):
                raise InvalidArgumentError(accepted)
            try:
                payloads = list(items)
            except TypeError:
                raise InvalidArgumentError(accepted) from None
            if len(payloads) != lengths.shape[0]:
                raise InvalidArgumentError(
                    f"items has {len(payloads)} entries but lengths has {lengths.shape[0]}; give one payload per "
                    f"length (got {describe(items)})"
                )
            items = payloads
        if (items is None) != (self._items is None) and self._seen:
            raise InvalidArgumentError("items must be given on every call to add() or on none")
        pieces = apply_overlong(lengths, self.capacity, self.overlong)
        self._truncated += pieces.truncated_tokens
        self._dropped_items += int(pieces.dropped.shape[0])
        self._dropped_tokens += int(lengths[pieces.dropped].sum())
        if items is not None and self._items is None:
            self._items = []
        seq = pieces.sequence_ids()
        starts = pieces.start if pieces.start is not None else np.zeros_like(seq)
        new_ids, new_starts, new_lengths = seq + self._seen, starts, pieces.length
        new_items = [items[i] for i in seq.tolist()] if items is not None else None
        self._seen += lengths.shape[0]
        if self.online:
            return self._place_online(new_ids, new_starts, new_lengths, new_items)

        done: list[StreamBin] = []
        taken = 0
        while taken < new_lengths.shape[0]:
            # fill the buffer exactly to buffer_size so the rounds do not depend on how calls were chunked
            room = self.buffer_size - self.pending
            upto = min(new_lengths.shape[0], taken + room)
            self._append(new_ids[taken:upto], new_starts[taken:upto], new_lengths[taken:upto],
                         new_items[taken:upto] if new_items is not None else None)
            taken = upto
            if self.pending >= self.buffer_size:
                done.extend(self._round(final=False))
        return done

    def flush(self) -> list[StreamBin]:
        """Pack and return everything still buffered (online: close the open bins)."""
        if self.online:
            return self._emit(self._online.close_all())  # type: ignore[union-attr]
        return self._round(final=True) if self.pending else []

    def finish(self) -> list[StreamBin]:
        """End the stream: the last bins (SeqPacker's name). Like :meth:`flush`, and the stream stays ended: a later
        :meth:`add` is refused (its items would never be emitted by a caller that stopped reading)."""
        self._finished = True
        return self.flush()

    def __repr__(self) -> str:
        mode = f"online, k={self.k}" if self.online and self.strategy == "hk" else "online" if self.online else \
            f"buffer_size={self.buffer_size}"
        return (f"StreamPacker(capacity={self.capacity}, strategy={self.strategy!r}, {mode}, items={self._seen}, "
                f"bins={self._bins}, pending={self.pending})")

    def stats(self) -> dict[str, Any]:
        """Counters so far: items seen, bins and tokens emitted, efficiency of emitted bins, truncated/dropped."""
        return {
            "items": self._seen,
            "bins": self._bins,
            "tokens": self._tokens_out,
            "pending": self.pending,
            "efficiency": self._tokens_out / (self._bins * self.capacity) if self._bins else 1.0,
            "truncated_tokens": self._truncated,
            "dropped_items": self._dropped_items,
            "dropped_tokens": self._dropped_tokens,
        }

    # ---- internals -------------------------------------------------------------------------------

    def _place_online(self, ids, starts, lengths, items) -> list[StreamBin]:
        where, closed = self._online.place(lengths)  # type: ignore[union-attr]
        for j, b in enumerate(where):  # per piece (a stream hands items over one by one anyway), never per token
            pieces = self._open.setdefault(b, [[], [], [], []])
            pieces[0].append(ids[j])
            pieces[1].append(starts[j])
            pieces[2].append(lengths[j])
            pieces[3].append(items[j] if items is not None else None)
        return self._emit(closed)

    def _emit(self, closed: list[int]) -> list[StreamBin]:
        out = []
        for b in closed:
            ids, starts, lengths, items = self._open.pop(b)
            out.append(StreamBin(np.array(ids, np.int64), np.array(starts, np.int64), np.array(lengths, np.int64),
                                 items if self._items is not None else None))
            self._tokens_out += int(sum(lengths))
        self._bins += len(out)
        return out

    def _append(self, ids, starts, lengths, items) -> None:
        self._ids = np.concatenate((self._ids, ids))
        self._starts = np.concatenate((self._starts, starts))
        self._lengths = np.concatenate((self._lengths, lengths))
        self._held = np.concatenate((self._held, np.zeros(lengths.shape[0], bool)))
        if items is not None:
            self._items.extend(items)  # type: ignore[union-attr]

    def _round(self, final: bool) -> list[StreamBin]:
        order, offsets = place(self._lengths, self.capacity, self.strategy, self.max_sequences_per_bin, self._rng)
        num_bins = offsets.shape[0] - 1
        emit = np.ones(num_bins, bool)
        if not final and self.hold_fill > 0:
            emit = self._bins_to_emit(order, offsets)
        bins_of_piece = np.repeat(np.arange(num_bins), np.diff(offsets))
        out: list[StreamBin] = []
        for b in np.flatnonzero(emit).tolist():
            sel = order[offsets[b] : offsets[b + 1]]
            out.append(
                StreamBin(
                    self._ids[sel],
                    self._starts[sel],
                    self._lengths[sel],
                    [self._items[i] for i in sel.tolist()] if self._items is not None else None,
                )
            )
        kept = np.sort(order[~emit[bins_of_piece]])  # held pieces keep their arrival order
        self._bins += len(out)
        self._tokens_out += int(self._lengths.sum() - self._lengths[kept].sum())
        self._ids, self._starts, self._lengths = self._ids[kept], self._starts[kept], self._lengths[kept]
        self._held = np.ones(kept.shape[0], bool)
        if self._items is not None:
            self._items = [self._items[i] for i in kept.tolist()]
        return out

    def _bins_to_emit(self, order: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Emit mask over bins: hold the worst-filled bins back once, up to half the buffer."""
        sizes = np.diff(offsets)
        fill = np.add.reduceat(self._lengths[order], offsets[:-1]) if sizes.size else np.zeros(0, np.int64)
        seen_held = np.maximum.reduceat(self._held[order], offsets[:-1]) if sizes.size else np.zeros(0, bool)
        candidate = (fill < self.hold_fill * self.capacity) & ~seen_held
        emit = np.ones(sizes.shape[0], bool)
        if candidate.any():
            worst = np.flatnonzero(candidate)
            worst = worst[np.argsort(fill[worst], kind="stable")]
            within = np.cumsum(sizes[worst]) <= self.buffer_size // 2
            emit[worst[within]] = False
        return emit
