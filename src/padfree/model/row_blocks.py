"""A packed mixer forward run over blocks of whole segments: the same numbers, a long row's working set kept small.

A sequence mixer computes every segment of a packed row on its own (the state restarts at every boundary), so running
its forward on consecutive blocks of whole segments, each with its own layout, and concatenating the outputs along
the tokens computes exactly what one forward over the row computes. On the CPU that is much faster for long rows:
a GatedDeltaNet's per-token tensors are wide (Qwen3.5: its ``in_proj_qkv`` writes 8,192 floats per token, 256 MiB
for a row of 8k tokens), and glibc maps every allocation above 32 MiB afresh from the kernel and unmaps it when it is
freed, so a long row faults each of its tensors in again at every layer, forward and backward. Blocks whose widest
tensor stays under :data:`BLOCK_BYTES` are served from the heap and stay in the caches, so a long packed row costs per
token what a short one does. On CUDA (a caching allocator, kernels that take ``cu_seqlens``) a row runs whole.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
>>> [(start, stop, block.lengths.tolist()) for start, stop, block in segment_blocks(lay, 4)]
[(0, 5, [3, 2]), (5, 9, [4])]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from padfree.model.packed import PackedLayout

__all__ = ["block_tokens", "blockable_call", "run_in_blocks"]

#: the widest per-token tensor of a mixer's forward on one block stays under this many bytes: below glibc's largest
#: mmap threshold (32 MiB), so a block's tensors come from the heap instead of fresh pages from the kernel
BLOCK_BYTES = 12 * 2**20


def block_tokens(module: torch.nn.Module) -> int:
    """Tokens per block for ``module``: :data:`BLOCK_BYTES` over its widest linear projection's fp32 output per
    token (the widest per-token tensor of a mixer's forward)."""
    widest = max((m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear)), default=1)
    return max(1, BLOCK_BYTES // (4 * widest))


def segment_blocks(lay: PackedLayout, tokens: int) -> list[tuple[int, int, PackedLayout]]:
    """The flattened ``B·T`` stream of ``lay`` cut into blocks of whole segments: ``(start, stop, layout of the
    block as a (1, stop - start) row)``. A segment belongs to the block of ``tokens`` tokens its first token falls
    in, so a block holds about ``tokens`` tokens (fewer at the end, more by the rest of its last segment; a segment
    longer than ``tokens`` is a block of its own or ends one). Built once per layout and ``tokens``."""
    def build() -> list[tuple[int, int, PackedLayout]]:
        lengths = lay.lengths
        ends = np.cumsum(lengths)
        starts = ends - lengths
        first = np.flatnonzero(np.diff(starts // tokens, prepend=-1))  # the first segment of every block
        last = np.append(first[1:], lengths.size)
        seg, pos = lay.segment_ids.reshape(1, -1), lay.position_ids.reshape(1, -1)
        out = []
        for i, j in zip(first.tolist(), last.tolist(), strict=True):  # one step per block, not per token
            a, b = int(starts[i]), int(ends[j - 1])
            out.append((a, b, PackedLayout(seg[:, a:b], pos[:, a:b], lengths[i:j].copy(), lay.source)))
        return out
    return lay.memo(("padfree.row_blocks", tokens), build)


def run_in_blocks(forward: Callable[[PackedLayout, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  lay: PackedLayout, tokens: int) -> torch.Tensor | None:
    """``forward(block layout, block of hidden)`` over the blocks of :func:`segment_blocks`, outputs concatenated:
    ``(B, T, ...)`` in, ``(B, T, ...)`` out, for a call :func:`blockable_call` accepts. None (the caller runs the row
    whole) when the row is one block, or when ``forward`` returns anything but a ``(1, block tokens, ...)``
    tensor."""
    blocks = segment_blocks(lay, tokens)
    if len(blocks) < 2:
        return None
    batch, seq_len = hidden.shape[:2]
    flat = hidden.reshape(1, batch * seq_len, *hidden.shape[2:])
    outs = []
    for a, b, block in blocks:
        out = forward(block, flat[:, a:b])
        if not (isinstance(out, torch.Tensor) and out.shape[:2] == (1, b - a)):
            return None  # a forward that does not return its tokens' outputs (a tuple, a cache): the row runs whole
        outs.append(out)
    return torch.cat(outs, dim=1).view(batch, seq_len, *outs[0].shape[2:])


def blockable_call(hidden: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a mixer call may run in blocks: not under ``torch.compile`` (checked first, so that a graph guards
    on nothing the blocks read, and never recompiles for a new cut), hidden states on the CPU, and no other argument
    a tensor with a dimension of the row's tokens (an attention mask, ``seq_idx``, a ``cache_position`` would have to
    be cut with the row; the row then runs whole). Whole-row boundary arguments of another size (``cu_seq_lens_q``)
    only reach the replaced primitives, which read the block's own layout instead."""
    if torch.compiler.is_compiling() or not isinstance(hidden, torch.Tensor) or hidden.device.type != "cpu":
        return False
    batch, seq_len = hidden.shape[:2]
    tokens = {seq_len, batch * seq_len}
    return not any(isinstance(x, torch.Tensor) and x is not hidden and tokens & set(x.shape)
                   for x in (*args, *kwargs.values()))
