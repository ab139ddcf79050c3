"""Per-token log-probabilities without the logits: ``token_log_probs`` against the same fields read off materialised
logits in float64 (chunk sizes, bias, scale, soft-capping, ignored positions, bf16), their gradients through the
log-probs and the entropy, TRL's CPU fused head (what it stands in for), and bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from padfree.errors import InvalidArgumentError  # noqa: E402
from padfree.model.log_probs import OUTPUTS, token_log_probs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(hidden, weight, targets, bias=None, scale=1.0, softcap=None, temperature=1.0):
    """Every field from the full logits, in float64; 0 (False) where there is no target."""
    logits = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double()) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    safe = targets.clamp(min=0)
    fields = {"log_probs": lp.gather(-1, safe[..., None])[..., 0], "entropy": -(lp.exp() * lp).sum(-1),
              "log_sum_sq_probs": torch.logsumexp(2 * lp, dim=-1), "mean_logits": logits.mean(-1),
              "is_top1": logits.argmax(-1) == safe}
    real = targets != -100
    return {k: torch.where(real, v, torch.zeros_like(v)) for k, v in fields.items()}


def _upstream(shape, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _objective(fields, g_lp, g_ent):
    """A loss that weighs every token's log-prob and entropy differently, as DPO's per-sequence coefficients do."""
    return (fields["log_probs"].double() * g_lp).sum() + (fields["entropy"].double() * g_ent).sum()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 50), chunk=st.integers(1, 50), bias=st.booleans(),
       scale=st.sampled_from([1.0, 0.25, 3.0]), softcap=st.sampled_from([None, 2.0, 30.0]),
       temperature=st.sampled_from([1.0, 0.7, 1.5]), ignored=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_every_field_and_gradient_equals_the_full_logits(n, vocab, chunk, bias, scale, softcap, temperature, ignored,
                                                         seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n, 8, generator=g, requires_grad=True)
    w = torch.randn(vocab, 8, generator=g, requires_grad=True)
    b = torch.randn(vocab, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (2, n), generator=g)
    t[torch.rand(2, n, generator=g) < ignored] = -100
    mine = token_log_probs(h, w, t, bias=b, scale=scale, softcap=softcap, temperature=temperature, chunk_size=chunk,
                           outputs=OUTPUTS)
    ref = _reference(h, w, t, b, scale, softcap, temperature)
    assert set(mine) == set(OUTPUTS)
    for name in OUTPUTS:
        assert mine[name].shape == t.shape
        if name == "is_top1":  # a near tie may flip in float32; the reference's margin decides where it cannot
            assert mine[name].dtype == torch.bool
            continue
        assert mine[name].dtype == torch.float32
        torch.testing.assert_close(mine[name].double(), ref[name], atol=2e-5, rtol=1e-5, msg=name)
    assert not bool(mine["log_probs"][t == -100].any())
    params = [x for x in (h, w, b) if x is not None]
    g_lp, g_ent = _upstream(t.shape, seed)
    ours = torch.autograd.grad(_objective(mine, g_lp, g_ent), params)
    theirs = torch.autograd.grad(_objective(ref, g_lp, g_ent), params)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, atol=5e-5, rtol=1e-5)


def test_top1_is_the_first_maximum_and_a_shifted_target_is_caught():
    torch.manual_seed(0)
    h, w = torch.randn(64, 16), torch.randn(300, 16)
    t = torch.randint(0, 300, (64,))
    t[::2] = (h @ w.T).argmax(-1)[::2]  # half the targets are the arg-max
    mine = token_log_probs(h, w, t, outputs=("is_top1",), chunk_size=7)
    assert mine["is_top1"].tolist() == ((h @ w.T).argmax(-1) == t).tolist()
    assert bool(mine["is_top1"][::2].all())
    ref = _reference(h, w, t)
    torch.testing.assert_close(mine["log_probs"].double(), ref["log_probs"], atol=2e-5, rtol=1e-5)
    # the negative control: the targets one position late, as a head that forgot the shift would score them
    late = token_log_probs(h, w, torch.roll(t, 1))["log_probs"].double()
    assert (late - ref["log_probs"]).abs().max() > 1.0


def test_only_the_positions_with_a_target_are_scored_and_none_still_backpropagates():
    h, w = torch.randn(3, 5, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    t = torch.full((3, 5), -100)
    out = token_log_probs(h, w, t, outputs=("entropy", "mean_logits", "is_top1"))
    assert all(not bool(v.any()) for v in out.values())
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert h.grad is not None and not bool(h.grad.any()) and not bool(w.grad.any())


def test_bf16_is_within_the_rounding_of_the_bf16_product():
    torch.manual_seed(1)
    h, w = torch.randn(50, 32, dtype=torch.bfloat16), (torch.randn(500, 32) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, 500, (50,))
    mine = token_log_probs(h, w, t, outputs=("entropy",), chunk_size=16)
    # the stock head: the product in bf16, the log-softmax upcast — the same rounding
    lp = torch.log_softmax((h @ w.T).float(), -1)
    torch.testing.assert_close(mine["log_probs"], lp.gather(1, t[:, None])[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine["entropy"], -(lp.exp() * lp).sum(-1), atol=1e-4, rtol=1e-5)


def test_equals_trls_cpu_fused_head_it_stands_in_for():
    chunked = pytest.importorskip("trl.kernels.chunked_logprob")
    torch.manual_seed(2)
    h = torch.randn(40, 16, requires_grad=True)
    w = torch.randn(1000, 16, requires_grad=True)
    t = torch.randint(0, 1000, (40,))
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    # TRL's arguments: temperature 0.8, vocabulary chunks of 256, soft-cap 2.0, logit scale 0.5
    theirs = chunked.ChunkedLogProbFunction.apply(h, w, None, t, 0.8, 256, 2.0, 0.5, fields)
    mine = token_log_probs(h, w, t, scale=0.5, softcap=2.0, temperature=0.8, outputs=fields, chunk_size=9)
    for name, value in zip(fields, theirs, strict=True):
        if name == "is_top1":
            assert mine[name].tolist() == value.tolist()
        else:
            torch.testing.assert_close(mine[name], value, atol=1e-5, rtol=1e-5, msg=name)
    g_lp, g_ent = _upstream(t.shape, 3)
    ours = torch.autograd.grad(_objective(mine, g_lp, g_ent), [h, w])
    ref = torch.autograd.grad(_objective(dict(zip(fields, theirs, strict=True)), g_lp, g_ent), [h, w])
    for a, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"outputs": ("logits",)}, r"outputs must be a sequence of names among"),
    ({"outputs": "entropy"}, r"outputs must be a sequence"),
    ({"targets": torch.tensor([1, 2, 9])}, r"targets\[2\] = 9 is not a class"),
    ({"targets": torch.tensor([1.0, 2.0, 3.0])}, r"targets must be integer class ids"),
    ({"targets": torch.tensor([1, 2])}, r"targets must have the leading shape of hidden \(3,\)"),
    ({"softcap": 0.0}, r"softcap must be None or > 0"),
    ({"temperature": 0.0}, r"temperature must be a finite number > 0, got 0.0"),
    ({"chunk_size": 0}, r"chunk_size"),
    ({"weight": torch.randn(9, 5)}, r"hidden must be \(\.\.\., H\) and weight \(V, H\)"),
])
def test_bad_input_is_one_error_naming_the_argument(kwargs, match):
    args = {"hidden": torch.randn(3, 4), "weight": torch.randn(9, 4), "targets": torch.tensor([1, 2, 3])}
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=match):
        token_log_probs(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)
