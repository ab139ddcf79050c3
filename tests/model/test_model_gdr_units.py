"""The per-segment gated delta rule in bounded work units (padfree.model.scans.GDR_UNIT_TOKENS): a group of
segments of one padded length larger than a unit runs as several calls, and every segment still computes exactly
what it computes alone — output and the gradients of all five inputs, fp32 <= 1e-5 against transformers'
``torch_chunk_gated_delta_rule`` on each segment alone; the same row run as one sequence (the leaking control) is
caught by the same comparison."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from padfree.model import scans  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from zoo import graph_nodes, packed_rows  # noqa: E402

# two rows: four 40-token segments (one padded-length group of 48), segments longer than a chunk, a 3-token one and
# the second row's trailing filler run (a segment of its own)
ROWS = [[40, 40, 100, 40, 130, 40, 20], [70, 3, 40, 40]]


def _inputs(hk=2, hv=4, dk=8, dv=8):
    _, pos, _ = packed_rows(ROWS)
    lay = PackedLayout.from_position_ids(pos)
    batch, length = lay.shape
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(batch, length, hv, dv, generator=g)
    decay = -torch.rand(batch, length, hv, generator=g) * torch.tensor([0.01, 0.5, 3.0, 30.0])
    beta = torch.rand(batch, length, hv, generator=g)
    weight = torch.randn(batch, length, hv, dv, generator=g)  # the upstream gradient
    return lay, [t.requires_grad_() for t in (q, k, v, decay, beta)], weight


def _segments(lay):
    for b in range(lay.shape[0]):
        starts = torch.nonzero(lay.segment_ids[b, 1:] != lay.segment_ids[b, :-1]).reshape(-1) + 1
        yield from ((b, s, e) for s, e in itertools.pairwise([0, *starts.tolist(), lay.shape[1]]))


def _alone(inputs, spans):
    """transformers' chunked rule on every span of the rows alone, put back in place."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    rows = {}
    for b, s, e in spans:
        q, k, v, decay, beta = (t[b:b + 1, s:e] for t in inputs)
        out = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0]
        rows.setdefault(b, []).append(out)
    return torch.cat([torch.cat(rows[b], dim=1) for b in sorted(rows)])


def _with_grads(out, inputs, weight):
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), inputs)]


def _worst(got, want):
    return max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))


def test_per_segment_in_units_equals_every_segment_alone(monkeypatch):
    lay, inputs, weight = _inputs()
    monkeypatch.setattr(scans, "GDR_UNIT_TOKENS", 64)  # one segment per unit: the 48-token group splits in four
    calls = []
    real = torch.linalg.solve_triangular

    def counting(*a, **k):
        calls.append(a[0].shape[0])  # the unit's rows
        return real(*a, **k)

    monkeypatch.setattr(torch.linalg, "solve_triangular", counting)
    out = scans.segment_gated_delta_rule(*inputs, lay, use_qk_l2norm_in_kernel=True, formulation="per-segment")
    monkeypatch.setattr(torch.linalg, "solve_triangular", real)
    segments = list(_segments(lay))
    assert len(calls) == 2 * len(segments) and set(calls) == {1}  # every segment its own unit, two solves each
    got = _with_grads(out, inputs, weight)
    assert _worst(got, _with_grads(_alone(inputs, segments), inputs, weight)) <= 1e-5

    # the same comparison catches a row run as one sequence (the state leaking across every boundary)
    leaky = _alone(inputs, [(b, 0, lay.shape[1]) for b in range(lay.shape[0])])
    assert _worst(got, _with_grads(leaky, inputs, weight)) > 1e-2


def test_unit_size_does_not_change_the_result(monkeypatch):
    """Units of one segment, of a whole group and the default: the same output and gradients to fp32 rounding."""
    lay, inputs, weight = _inputs()
    results = []
    for tokens in (64, 10_000, scans.GDR_UNIT_TOKENS):
        monkeypatch.setattr(scans, "GDR_UNIT_TOKENS", tokens)
        out = scans.segment_gated_delta_rule(*inputs, lay, use_qk_l2norm_in_kernel=True, formulation="per-segment")
        results.append(_with_grads(out, inputs, weight))
    assert _worst(results[0], results[1]) <= 1e-5 and _worst(results[2], results[1]) <= 1e-5


def test_per_segment_moves_the_row_once_each_way_in_token_order():
    """The row goes into the units' padded order by one write (``index_copy``, whose backward is a gather) and comes
    back by one gather (``index_select``): no advanced indexing, whose backward scatters into a zero tensor of the
    whole row. Still exact: every segment's output and gradients equal it alone; the leaking control is caught."""
    lay, inputs, weight = _inputs()
    out = scans.segment_gated_delta_rule(*inputs, lay, use_qk_l2norm_in_kernel=True, formulation="per-segment")
    ops = set(graph_nodes(out))
    assert {"IndexCopyBackward0", "IndexSelectBackward0"} <= ops
    assert "IndexBackward0" not in ops
    segments = list(_segments(lay))
    got = _with_grads(out, inputs, weight)
    assert _worst(got, _with_grads(_alone(inputs, segments), inputs, weight)) <= 1e-5
    leaky = _alone(inputs, [(b, 0, lay.shape[1]) for b in range(lay.shape[0])])
    assert _worst(got, _with_grads(leaky, inputs, weight)) > 1e-2
