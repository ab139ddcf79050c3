"""The packed paths whose cost must stay linear in the row: a packed DPO micro-batch is one row of up to
``packing_length`` tokens (8k by default), so any per-chunk or per-sequence work that touches the whole row turns
quadratic there while a padding-free micro-batch (2-3k tokens) hides it. Structure is checked, never time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from padfree.model import scans
from padfree.model.packed import PackedLayout
from zoo import graph_nodes


def _row(lengths: list[int], heads: int = 2, dim: int = 8, seed: int = 0):
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
    lay = PackedLayout.from_position_ids(pos)
    t = int(sum(lengths))
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, t, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    decay = (-torch.rand(1, t, heads, generator=g)).requires_grad_()
    beta = torch.rand(1, t, heads, generator=g).requires_grad_()
    return lay, q, k, v, decay, beta


@pytest.mark.parametrize("formulation", ["masked", "per-segment"])
def test_gated_delta_rule_backward_never_selects_one_chunk_of_the_row(formulation):
    """The chunk recurrence reads its chunks through one unbind: indexing chunk ``i`` of a ``(R, H, n, ...)``
    tensor puts a SelectBackward in the graph whose backward writes a zero tensor of the whole row, n times over."""
    counts = []
    for lengths in ([100, 40], [300, 200, 150, 90]):  # 3 and 12 chunks of 64 in the masked formulation
        lay, q, k, v, decay, beta = _row(lengths)
        out = scans.segment_gated_delta_rule(q, k, v, decay, beta, lay, use_qk_l2norm_in_kernel=True,
                                             formulation=formulation)
        names = graph_nodes(out)
        assert "UnbindBackward0" in names
        counts.append(names.count("SelectBackward0"))
    assert max(counts) <= 4  # one per reference call (a chunk's last decay), none per chunk (72 before)


def test_gated_delta_rule_gradients_packed_equal_each_sequence_alone():
    """Every gradient of a many-chunk row, packed (both formulations) vs each sequence alone through the same
    reference; a row whose state is not reset at the boundaries (one segment over the whole row) is caught."""
    lengths = [300, 200, 150, 90]
    lay, q, k, v, decay, beta = _row(lengths)
    inputs = (q, k, v, decay, beta)
    weight = torch.randn((*q.shape[:3], v.shape[-1]), generator=torch.Generator().manual_seed(1))

    def grads(run):
        for x in inputs:
            x.grad = None
        run().mul(weight).sum().backward()
        return [x.grad.clone() for x in inputs]

    def alone():
        outs, start = [], 0
        for n in lengths:
            piece = [x[:, start:start + n] for x in inputs]
            one = PackedLayout.from_position_ids(torch.arange(n)[None])
            outs.append(scans.segment_gated_delta_rule(*piece[:3], piece[3], piece[4], one,
                                                       use_qk_l2norm_in_kernel=True, formulation="per-segment"))
            start += n
        return torch.cat(outs, dim=1)

    want = grads(alone)
    for form in ("masked", "per-segment"):
        got = grads(lambda form=form: scans.segment_gated_delta_rule(q, k, v, decay, beta, lay, formulation=form,
                                                                     use_qk_l2norm_in_kernel=True))
        assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= 1e-5
    leak = PackedLayout.from_position_ids(torch.arange(sum(lengths))[None])  # the state carried across sequences
    leaked = grads(lambda: scans.segment_gated_delta_rule(q, k, v, decay, beta, leak, formulation="masked",
                                                          use_qk_l2norm_in_kernel=True))
    assert max(float((a - b).abs().max()) for a, b in zip(leaked, want, strict=True)) > 1e-3
