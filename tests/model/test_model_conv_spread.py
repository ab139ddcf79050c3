"""The exact short convolution (padfree.model.scans.segment_causal_conv1d) writes the row's tokens into its spread
stream (``K - 1`` zeros before every segment) by one ``index_copy``, whose backward is one gather: no zero column
concatenated to the whole row. Still exact: every segment equals the convolution of it alone (output and the
gradients of input, taps and bias, fp32 <= 1e-5); the row convolved as one sequence (the leaking control) is caught."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402

from padfree.model import scans  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from zoo import graph_nodes  # noqa: E402

LENGTHS = [5, 1, 9, 3]


def _reference(x, weight, bias, spans):
    """transformers' lone-sequence convolution (``padding=K - 1``, cut to the sequence) on every span."""
    outs = [F.silu(F.conv1d(x[:, :, s:e], weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                            groups=x.shape[1])[..., : e - s]) for s, e in spans]
    return torch.cat(outs, dim=-1)


def test_conv_spread_is_one_index_copy_and_exact_per_segment():
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    lay = PackedLayout.from_position_ids(pos)
    x = torch.randn(1, 6, pos.shape[1], generator=g, requires_grad=True)
    weight = torch.randn(6, 4, generator=g, requires_grad=True)
    bias = torch.randn(6, generator=g, requires_grad=True)
    upstream = torch.randn(1, 6, pos.shape[1], generator=g)
    out = scans.segment_causal_conv1d(x, weight, bias, "silu", lay)
    ops = graph_nodes(out)
    assert "IndexCopyBackward0" in ops and "CatBackward0" not in ops

    def grads(y):
        return [y.detach(), *torch.autograd.grad((y * upstream).sum(), (x, weight, bias))]

    ends = torch.tensor(LENGTHS).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    got, want = grads(out), grads(_reference(x, weight, bias, spans))
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True)) <= 1e-5
    leaky = grads(_reference(x, weight, bias, [(0, pos.shape[1])]))
    assert max(float((a - b).abs().max()) for a, b in zip(got, leaky, strict=True)) > 1e-2
