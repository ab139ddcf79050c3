"""Multi-axis rotary positions (mRoPE) for a packed row of vision-language samples.

Qwen-VL-style models place every token on three rotary axes — temporal, height, width — computed per sequence by
their ``get_rope_index`` from the token types (text, image, video) and each image's or video's grid: text runs count
on all three axes, an image's tokens take their grid coordinates, and the count after an image continues from the
image's extent. A packed row of several samples is exact only if every sample gets the positions it gets alone: its
own index, restarting at 0, from its own grids. :func:`packed_rope_rows` computes exactly that with one call of the
model's own ``get_rope_index`` over the samples laid out as a padded batch (grids are consumed in sample order, as the
samples' images were concatenated), and returns the four-row form transformers reads — the text row first (where
padfree and the model's masks find the boundaries), then the three rotary rows.

>>> segment_rows(torch.tensor([[1, 1, 1, 2, 2]]))  # (samples, longest): each token's flat index, and a mask
(tensor([[0, 1, 2],
        [3, 4, 4]]), tensor([[ True,  True,  True],
        [ True,  True, False]]))
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from padfree.errors import PackingDisabledError

__all__ = ["ROPE_INPUTS", "packed_rope_rows", "rope_index"]

# what the common rope-index function (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, glm4v, ... in transformers 5.24)
# reads besides the token ids: per token (laid out per sample here) and per image / video (concatenated in order)
_PER_TOKEN = ("mm_token_type_ids",)
_PER_VISUAL = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")
#: the vision arguments of a packed forward that :func:`packed_rope_rows` lays out per sample
ROPE_INPUTS = frozenset({*_PER_TOKEN, *_PER_VISUAL, "pixel_values", "pixel_values_videos"})
_COMMON = {"self", "input_ids", "attention_mask", "kwargs", *_PER_TOKEN, *_PER_VISUAL}


def rope_index(model: torch.nn.Module) -> Any:
    """The model's own rope-index function when it has the common signature padfree lays samples out for (the
    token ids, their types, the image and video grids, a padding mask); None otherwise (another scheme: MiniCPM-V's
    canvases, the omni thinkers' audio, Hunyuan-VL's image index — not handled)."""
    inner = getattr(model, "model", None)
    function = getattr(inner, "get_rope_index", None) or getattr(model, "get_rope_index", None)
    if function is None:
        return None
    params = set(inspect.signature(function).parameters)
    if not {"input_ids", "mm_token_type_ids", "attention_mask"} <= params or not params <= _COMMON:
        return None
    return function


def segment_rows(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment of a ``(B, T)`` row layout as a row of a padded batch: ``(index, real)``, both ``(S, L)`` for
    ``S`` segments of at most ``L`` tokens — ``index`` the flat ``B·T`` position of each token (a segment's last one
    repeated past its end), ``real`` False there.

    Args:
        segment_ids: ``(B, T)`` — 1, 2, ... per segment of a row (a padding run counts as a segment of its own);
            what a change of value (or a new row) starts is a new segment.
    """
    flat = segment_ids.reshape(-1)
    width = segment_ids.shape[1]
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = (flat[1:] != flat[:-1]) | (torch.arange(1, flat.numel(), device=flat.device) % width == 0)
    first = starts.nonzero().flatten()
    lengths = torch.diff(torch.cat([first, first.new_tensor([flat.numel()])]))
    longest = int(lengths.max())
    offsets = torch.arange(longest, device=flat.device)
    real = offsets[None] < lengths[:, None]
    index = first[:, None] + torch.minimum(offsets[None], lengths[:, None] - 1)
    return index, real


def packed_rope_rows(model: torch.nn.Module, named: dict[str, Any], layout: Any) -> torch.Tensor:
    """The ``(4, B, T)`` positions of a packed row of vision-language samples: the text row (``layout``'s positions,
    restarting per sample) and the model's three rotary rows computed for each sample alone.

    Args:
        model: the vision-language model (its ``get_rope_index``: :func:`rope_index`).
        named: the forward's arguments by name: ``input_ids`` ``(B, T)``, ``mm_token_type_ids`` ``(B, T)``, and the
            grids of the row's images and videos in row order (``image_grid_thw`` ``(n_images, 3)``, ...).
        layout: the forward's :class:`~padfree.model.packed.PackedLayout` (where each sample starts).

    Raises:
        PackingDisabledError: the model has another rope scheme, or the call lacks what the index needs.
    """
    function = rope_index(model)
    if function is None:
        raise PackingDisabledError(
            f"{type(model).__name__} computes its rotary positions with a scheme padfree does not lay out per sample "
            f"(its get_rope_index takes other arguments); pass batches with images or videos unpacked")
    ids, types = named.get("input_ids"), named.get("mm_token_type_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(types, torch.Tensor) or types.shape != ids.shape:
        raise PackingDisabledError(
            f"a packed batch with images or videos through {type(model).__name__} needs input_ids and "
            f"mm_token_type_ids of the same (B, T) shape (the processor returns both): the rotary positions of each "
            f"sample are computed from its token types")
    index, real = segment_rows(layout.segment_ids)
    flat_ids, flat_types = ids.reshape(-1), types.reshape(-1)
    extra = {key: named[key] for key in _PER_VISUAL if named.get(key) is not None}
    rows, _ = function(flat_ids[index], mm_token_type_ids=flat_types[index] * real, attention_mask=real.long(),
                       **extra)
    out = torch.empty((3, flat_ids.numel()), dtype=rows.dtype, device=rows.device)
    out[:, index[real]] = rows[:, real]
    text = layout.position_ids.to(out.dtype)
    return torch.cat([text[None], out.view(3, *ids.shape)])
