"""A rank's slice of a batch for sequence parallelism: its tokens, the row's positions, labels shifted once.

Every rank of a sequence-parallel group receives the same batch and keeps slice ``rank`` of every row: tokens
``[rank·S, (rank+1)·S)`` with ``S = T' / P``, where ``T'`` is the row length rounded up to a multiple of the group
size ``P`` (the added tail is padding, a segment of its own, labelled ``-100``). The boundaries stay the row's: the
slice's ``position_ids`` are the row's own (a slice may start in the middle of a sequence), and the configured model
gathers them from every rank to rebuild the whole row's layout.

Labels are shifted *before* slicing, exactly as the model would shift the whole row: ``shift_labels[t] =
labels[t + 1]``, so the target of a slice's last token is the next slice's first token, the row's last position has
none, and neither has the last token of a sequence followed by another (its next token is not its own). The slice
carries ``shift_labels`` instead of ``labels`` (transformers' causal-LM loss, TRL's fused head and padfree's loss
rule all read them), so nothing shifts again inside a slice. A per-sequence loss needs what a slice cannot see, the
targets its sequences have on the other ranks: the slice carries them as ``target_weights``.

>>> import torch
>>> batch = {"input_ids": torch.tensor([[11, 12, 13, 21, 22]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
...          "labels": torch.tensor([[-100, 12, 13, -100, 22]])}
>>> parts = [split_rows(batch, size=2, rank=r) for r in range(2)]   # what ranks 0 and 1 of a group of 2 keep
>>> [p["input_ids"].tolist() for p in parts], [p["position_ids"].tolist() for p in parts]
([[[11, 12, 13]], [[21, 22, 0]]], [[[0, 1, 2]], [[0, 1, 0]]])
>>> [p["shift_labels"].tolist() for p in parts]   # 13 -> -100 (a boundary), 21 -> 22, the padding -> nothing
[[[12, 13, -100]], [[22, -100, -100]]]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from padfree import layout
from padfree.errors import InvalidArgumentError, InvalidLayoutError, describe
from padfree.layout import IGNORE_INDEX
from padfree.sequence_parallel.groups import sequence_parallel_group
from padfree.step_loss import LossRule

__all__ = ["SequenceParallelSlice", "split_for_sequence_parallel"]

# boundary spellings the slice replaces with the row's position_ids (the model rebuilds every other form from them)
_BOUNDARIES = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
_LABELS = ("labels", "shift_labels")


class SequenceParallelSlice(dict):
    """A rank's slice of a batch (the model inputs, a ``dict``), as :func:`split_for_sequence_parallel` returns it:
    being this type, it is never split again (a trainer may hand the same inputs on twice).

    Attributes:
        rank, size: the slice this is and how many the row was cut into.
        length: the row length before padding, ``T``.
        padding: tokens added at the end of every row so that ``P`` divides it.
        target_weights: ``(B, S)`` float32 (None without labels): for every target of ``shift_labels``,
            ``1 / (targets of its sequence in the whole row)``, 0 elsewhere — what the per-sequence loss weighs a
            token loss by; summed over a slice, the share of the row's sequences it holds.
    """

    rank: int = 0
    size: int = 1
    length: int = 0
    padding: int = 0
    target_weights: torch.Tensor | None = None


def split_for_sequence_parallel(inputs: Mapping[str, Any], group: Any, *, pad_token_id: int = 0
                                ) -> SequenceParallelSlice:
    """This rank's slice of ``inputs`` for a model configured with ``configure_packing(model,
    sequence_parallel=group)``.

    Args:
        inputs: the batch's model inputs, torch tensors: ``input_ids`` ``(B, T)`` (or ``inputs_embeds``
            ``(B, T, E)``), the boundaries (``position_ids`` restarting at 0, a segment-id or right-padding
            ``attention_mask``, ``cu_seq_lens_q``, ``seq_idx``: all that are given must agree; none means one
            sequence per row), ``labels`` (aligned, the model shifts) or ``shift_labels``, and anything else.
        group: the sequence-parallel group, as ``configure_packing`` takes it (an int, a process group, a 1-D
            ``DeviceMesh``).
        pad_token_id: the token that pads the rows to a multiple of the group size.

    Returns:
        A :class:`SequenceParallelSlice`: ``input_ids`` / ``inputs_embeds``, ``position_ids`` (the row's, sliced)
        and ``shift_labels`` ``(B, S)``; every other tensor shaped ``(B, T, ...)`` sliced the same way (padded with
        0); anything else as given. The boundary spellings other than ``position_ids`` and the aligned ``labels``
        are left out: the model rebuilds the row's layout from every rank's ``position_ids``.
    """
    sp = sequence_parallel_group(group, "group")
    return split_rows(inputs, size=1 if sp is None else sp.size, rank=0 if sp is None else sp.rank,
                      pad_token_id=pad_token_id)


def split_rows(inputs: Mapping[str, Any], *, size: int, rank: int, pad_token_id: int = 0) -> SequenceParallelSlice:
    """:func:`split_for_sequence_parallel` for slice ``rank`` of ``size``, without a process group."""
    if isinstance(inputs, SequenceParallelSlice):
        return inputs
    if not isinstance(inputs, Mapping):
        raise InvalidArgumentError(f"inputs must be a mapping of model inputs (input_ids, position_ids, labels, "
                                   f"...), got {describe(inputs)}")
    ref_key = "input_ids" if inputs.get("input_ids") is not None else "inputs_embeds"
    ref = inputs.get(ref_key)
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2 or (ref_key == "inputs_embeds" and ref.dim() != 3):
        raise InvalidArgumentError(f"inputs needs input_ids (B, T) or inputs_embeds (B, T, E) as a tensor, got "
                                   f"{describe(ref)}")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise InvalidArgumentError(f"pad_token_id must be an int, got {describe(pad_token_id)}")
    batch, seq_len = ref.shape[:2]
    padded = -(-seq_len // size) * size
    pad = padded - seq_len
    width = padded // size
    start = rank * width

    seg = _segments(inputs, batch, seq_len, ref.device)
    padded_seg = torch.nn.functional.pad(seg, (0, pad))  # the added tail: padding, a segment of its own
    positions = layout.segment_ids_to_position_ids(padded_seg, check=False)
    out = SequenceParallelSlice()
    out.rank, out.size, out.length, out.padding = rank, size, seq_len, pad
    for key, value in inputs.items():
        if key in _BOUNDARIES or key in _LABELS or key == "position_ids":
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (batch, seq_len):
            fill = pad_token_id if key == "input_ids" else 0
            value = _pad(value, pad, fill).narrow(1, start, width)
        out[key] = value
    out["position_ids"] = positions.narrow(1, start, width)
    shifted = _shift_labels(inputs, batch, seq_len)
    if shifted is not None:
        if "shift_labels" not in inputs:  # a sequence's last token: its next token starts another sequence
            # (right padding, segment 0, is left as the model would score it unpacked)
            starts = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] != 0)
            shifted = shifted.masked_fill(torch.nn.functional.pad(starts, (0, 1)), IGNORE_INDEX)
        shifted = _pad(shifted, pad, IGNORE_INDEX)
        out["shift_labels"] = shifted.narrow(1, start, width)
        out.target_weights = _target_weights(shifted, padded_seg).narrow(1, start, width)
    return out


def _target_weights(shift_labels: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T')`` float32: ``1 / (targets of its sequence)`` at every target of the whole rows, 0 elsewhere; the
    target at ``t`` belongs to the sequence of token ``t``."""
    seq = layout.segment_ids_to_batch_seq_idx(segment_ids, check=False)  # sequence ids over the batch, < B·T'
    return LossRule.target_weights(shift_labels != IGNORE_INDEX, seq)  # the sequence rule's weights, whole rows


def _rows(value: Any, key: str, batch: int, seq_len: int) -> torch.Tensor:
    """``value`` as a ``(B, T)`` integer tensor (a ``(T,)`` or ``(1, T)`` one broadcast over the rows)."""
    if not isinstance(value, torch.Tensor):
        raise InvalidLayoutError(f"inputs[{key!r}] must be a tensor, got {describe(value)}")
    if value.dim() == 1:
        value = value.unsqueeze(0)
    if value.dim() != 2 or value.shape[1] != seq_len or value.shape[0] not in (1, batch):
        raise InvalidLayoutError(f"inputs[{key!r}] has shape {tuple(value.shape)}; the batch is {batch} x {seq_len} "
                                 f"tokens")
    if value.dtype.is_floating_point or value.dtype.is_complex:
        raise InvalidLayoutError(f"inputs[{key!r}] must hold integers, got dtype {value.dtype}")
    return value.expand(batch, seq_len)


def _segments(inputs: Mapping[str, Any], batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """``(B, T) int64`` segment ids of the rows (0: right padding) from every boundary spelling given; they must
    agree."""
    mask = inputs.get("attention_mask")
    if mask is not None:
        mask = _rows(mask, "attention_mask", batch, seq_len)
    found: list[tuple[str, torch.Tensor]] = []
    if inputs.get("position_ids") is not None:
        pos = _rows(inputs["position_ids"], "position_ids", batch, seq_len)
        found.append(("position_ids", layout.position_ids_to_segment_ids(pos, attention_mask=mask)))
    if inputs.get("seq_idx") is not None:
        idx = _rows(inputs["seq_idx"], "seq_idx", batch, seq_len)
        found.append(("seq_idx", layout.seq_idx_to_segment_ids(idx, attention_mask=mask)))
    if inputs.get("cu_seq_lens_q") is not None:
        found.append(("cu_seq_lens_q", _cu_segments(inputs["cu_seq_lens_q"], batch, seq_len, device)))
    if mask is not None and not found:
        if bool(mask.max() > 1):
            layout.segment_ids_to_lengths(mask)  # validates: runs 1, 2, ... in order, padding 0 trailing
            found.append(("attention_mask", mask.to(torch.int64)))
        else:  # a 0/1 mask: one sequence per row, right padding
            arange = torch.arange(seq_len, device=device).expand(batch, seq_len)
            found.append(("attention_mask", layout.position_ids_to_segment_ids(arange, attention_mask=mask)))
    if not found:
        return torch.ones(batch, seq_len, dtype=torch.int64, device=device)
    (key, seg), *rest = found
    for other, theirs in rest:
        if not torch.equal(seg, theirs.to(seg.dtype)):
            raise InvalidLayoutError(f"inputs[{key!r}] and inputs[{other!r}] disagree on where the sequences start")
    return seg.to(torch.int64)


def _cu_segments(value: Any, batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Segment ids from flash-style offsets over the flattened ``(B·T)`` stream."""
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
        raise InvalidLayoutError(f"inputs['cu_seq_lens_q'] must be an integer tensor, got {describe(value)}")
    cu = value.reshape(-1).to(torch.int64).cpu()
    total = batch * seq_len
    if cu.numel() < 2 or cu[0] != 0 or cu[-1] != total or bool((cu[1:] <= cu[:-1]).any()):
        raise InvalidLayoutError(f"inputs['cu_seq_lens_q'] = {cu.tolist()[:12]} must rise strictly from 0 to the "
                                 f"{total} tokens of the batch")
    starts = torch.zeros(total, dtype=torch.int64)
    starts[cu[:-1]] = 1
    starts = starts.view(batch, seq_len)
    if not bool(starts[:, 0].all()):
        raise InvalidLayoutError("inputs['cu_seq_lens_q'] lets a sequence cross from one row into the next")
    return starts.cumsum(1).to(device)


def _shift_labels(inputs: Mapping[str, Any], batch: int, seq_len: int) -> torch.Tensor | None:
    """``(B, T)``: ``shift_labels`` as given, or ``labels`` shifted left by one (the row's last position: none)."""
    for key in ("shift_labels", "labels"):
        value = inputs.get(key)
        if value is None:
            continue
        value = _rows(value, key, batch, seq_len)
        if key == "shift_labels":
            return value
        return torch.nn.functional.pad(value[:, 1:], (0, 1), value=IGNORE_INDEX)
    return None


def _pad(value: torch.Tensor, pad: int, fill: float) -> torch.Tensor:
    """``value`` with ``pad`` entries of ``fill`` appended along dim 1."""
    if not pad:
        return value
    tail = value.new_full((value.shape[0], pad, *value.shape[2:]), fill)
    return torch.cat([value, tail], dim=1)
