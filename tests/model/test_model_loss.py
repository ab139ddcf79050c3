"""The fused LM-head cross-entropy: the loss and the gradients of the full-logits loss, without the logits.

``linear_cross_entropy`` against ``F.cross_entropy`` on materialised logits (chunk sizes, bias, scale, soft-capping,
ignored positions, bf16); ``causal_lm_loss`` on every tiny model type, packed and configured, against the
per-sequence reference — the same standard as every other model-side feature (fp32, ≤ 1e-5).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import padfree  # noqa: E402
from padfree.model.loss import causal_lm_loss, head_transform, linear_cross_entropy  # noqa: E402
from zoo import CAPACITY, LENGTHS, MIXER_ROWS, MIXER_TYPES, grad_diff, packed_rows, run_separately  # noqa: E402
from zoo import tiny_model as zoo_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TINY_TYPES = sorted(padfree.proof.tiny.TINY_CONFIGS)


def _reference(hidden, weight, targets, bias=None, scale=1.0, softcap=None):
    logits = F.linear(hidden, weight, bias).float() * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.reshape(-1, weight.shape[0]), targets.reshape(-1), reduction="sum")


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), vocab=st.integers(2, 50), chunk=st.integers(1, 50), bias=st.booleans(),
       scale=st.sampled_from([1.0, 0.25, 3.0]), softcap=st.sampled_from([None, 2.0, 30.0]),
       ignored=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_matches_full_logits_loss_and_gradients(n, vocab, chunk, bias, scale, softcap, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 8, generator=g, requires_grad=True)
    w = torch.randn(vocab, 8, generator=g, requires_grad=True)
    b = torch.randn(vocab, generator=g, requires_grad=True) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < ignored] = -100
    loss, count = linear_cross_entropy(h, w, t, bias=b, scale=scale, softcap=softcap, chunk_size=chunk)
    assert int(count) == int((t != -100).sum())
    ref = _reference(h, w, t, b, scale, softcap)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(_grads(loss, h, w, b), _grads(ref, h, w, b), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), vocab=st.integers(2, 40), chunk=st.integers(1, 30),
       softcap=st.sampled_from([None, 2.0]), seed=st.integers(0, 99))
def test_stats_are_the_entropy_and_accuracy_of_the_full_logits(n, vocab, chunk, softcap, seed):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, 6, generator=g), torch.randn(vocab, 6, generator=g)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.3] = -100
    loss, count, entropy, correct = linear_cross_entropy(h, w, t, softcap=softcap, chunk_size=chunk,
                                                         with_stats=True)
    logits = h @ w.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    keep = t != -100
    logp = torch.log_softmax(logits[keep], dim=-1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(), atol=1e-4, rtol=1e-5)
    assert int(correct) == int((logits[keep].argmax(-1) == t[keep]).sum())
    assert int(count) == int(keep.sum())
    torch.testing.assert_close(loss, _reference(h, w, t, softcap=softcap), atol=1e-5, rtol=1e-5)


def test_weights_scale_each_position_and_its_gradient():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 7, 6, generator=g, requires_grad=True)
    w = torch.randn(13, 6, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (3, 7), generator=g)
    t[0, :2] = -100
    weights = torch.rand(3, 7, generator=g)
    loss, _ = linear_cross_entropy(h, w, t, chunk_size=4, weights=weights)
    per = F.cross_entropy((h @ w.T).reshape(-1, 13), t.reshape(-1), reduction="none", ignore_index=-100)
    ref = (per * weights.reshape(-1)).sum()
    torch.testing.assert_close(loss, ref)
    for mine, theirs in zip(_grads(loss, h, w), _grads(ref, h, w), strict=True):
        torch.testing.assert_close(mine, theirs)
    with pytest.raises(padfree.InvalidArgumentError, match="weights must be floats of the targets' shape"):
        linear_cross_entropy(h, w, t, weights=torch.ones(3, 6))


def test_no_grad_and_detached_inputs_compute_only_the_loss():
    h, w = torch.randn(3, 7, 4), torch.randn(9, 4)
    t = torch.randint(0, 9, (3, 7))
    with torch.no_grad():
        loss, _ = linear_cross_entropy(h, w, t, chunk_size=5)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _reference(h, w, t))


def test_bfloat16_follows_the_stock_head_precision():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(500, 32, generator=g) * 0.2).bfloat16().requires_grad_()
    t = torch.randint(0, 500, (64,), generator=g)
    loss, _ = linear_cross_entropy(h, w, t, chunk_size=24)
    ref = _reference(h, w, t)  # bf16 head, float32 loss: what transformers does
    torch.testing.assert_close(loss, ref, atol=2e-3 * 64, rtol=1e-3)
    gh, gw = _grads(loss, h, w)
    rh, rw = _grads(ref, h, w)
    assert gh.dtype == gw.dtype == torch.bfloat16
    for mine, theirs in ((gh, rh), (gw, rw)):
        assert float((mine.float() - theirs.float()).abs().max()) <= 0.02 * float(theirs.float().abs().max())


def test_no_target_at_all_is_a_zero_that_keeps_the_graph():
    h, w = torch.randn(2, 3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    loss, count = linear_cross_entropy(h, w, torch.full((2, 3), -100))
    assert float(loss) == 0.0 and int(count) == 0
    loss.backward()
    assert float(h.grad.abs().sum()) == 0.0 and w.grad is not None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"targets": torch.zeros(2, 2, dtype=torch.long)}, "targets must have the leading shape"),
    ({"targets": torch.zeros(2, 3)}, "targets must be integer class ids"),
    ({"targets": torch.full((2, 3), 5)}, r"targets must be in \[0, 5\)"),
    ({"softcap": 0.0}, "softcap must be None or > 0"),
    ({"chunk_size": 0}, "chunk_size must be an integer >= 1 or None, got 0"),
    ({"weight": torch.randn(5, 3)}, "same H"),
])
def test_bad_arguments(kwargs, match):
    args = {"hidden": torch.randn(2, 3, 4), "weight": torch.randn(5, 4), "targets": torch.zeros(2, 3,
                                                                                              dtype=torch.long)}
    args.update(kwargs)
    with pytest.raises(padfree.InvalidArgumentError, match=match):
        linear_cross_entropy(args.pop("hidden"), args.pop("weight"), args.pop("targets"), **args)


# ---- causal_lm_loss on real transformers models ---------------------------------------------------------------------


def _packed_batch(model_type: str):
    """Packed rows (sequences of the zoo's lengths) with HF labels: each sequence's first token and the filler
    masked; and the sequences, for the per-sequence reference."""
    if model_type in MIXER_TYPES:
        rows = MIXER_ROWS
    else:
        plan = padfree.pack_sequences(LENGTHS, CAPACITY)
        rows = [[LENGTHS[i] for i in b] for b in plan.bins]
    ids, pos, seqs = packed_rows(rows)
    labels = torch.full_like(ids, -100)
    for b, start, s in seqs:
        labels[b, start + 1:start + len(s)] = s[1:]
    return {"input_ids": ids, "position_ids": pos, "labels": labels}, seqs


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_packed_fused_loss_equals_the_per_sequence_reference(model_type):
    overrides = {"final_logit_softcapping": 3.0} if model_type in ("gemma2", "gemma3_text") else {}
    model = zoo_model(model_type, **overrides)
    padfree.configure_packing(model)
    inputs, seqs = _packed_batch(model_type)
    _, ref_grads = run_separately(model, seqs)
    total = sum(len(s) - 1 for _, _, s in seqs)
    model.zero_grad()
    with torch.no_grad():  # the per-sequence loss, for the value
        ref = sum(F.cross_entropy(model(input_ids=s[None], use_cache=False).logits[0, :-1].float(), s[1:],
                                  reduction="sum") for _, _, s in seqs if len(s) > 1) / total
    loss = causal_lm_loss(model, inputs, chunk_size=7)
    assert abs(float(loss) - float(ref)) <= 1e-5
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grad_diff(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize(("model_type", "overrides", "transform"), [
    ("cohere", {}, (0.0625, None)),
    ("granite", {"logits_scaling": 4.0}, (0.25, None)),
    ("gemma2", {"final_logit_softcapping": 3.0}, (1.0, 3.0)),
    ("llama", {}, (1.0, None)),
])
def test_head_transforms_match_the_models_own_loss(model_type, overrides, transform):
    model = zoo_model(model_type, **overrides)
    assert head_transform(model) == transform
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    stock = model(input_ids=ids, labels=labels, use_cache=False).loss
    stock_grads = _grads(stock, *model.parameters())
    fused = causal_lm_loss(model, {"input_ids": ids, "labels": labels})
    torch.testing.assert_close(fused, stock, atol=1e-6, rtol=1e-6)
    for mine, theirs in zip(_grads(fused, *model.parameters()), stock_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)


def test_moe_router_loss_is_added_as_the_model_adds_it():
    model = zoo_model("mixtral", output_router_logits=True, router_aux_loss_coef=0.5)
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    stock = model(input_ids=ids, labels=ids, use_cache=False)
    assert stock.aux_loss is not None and float(stock.aux_loss) > 0
    torch.testing.assert_close(causal_lm_loss(model, {"input_ids": ids, "labels": ids}), stock.loss)


def test_shift_labels_sum_and_num_items():
    model = zoo_model("qwen3")
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    mean = causal_lm_loss(model, {"input_ids": ids, "labels": labels})
    summed = causal_lm_loss(model, {"input_ids": ids, "shift_labels": shifted}, reduction="sum")
    torch.testing.assert_close(summed / 16, mean)
    torch.testing.assert_close(causal_lm_loss(model, {"input_ids": ids, "labels": labels}, num_items_in_batch=32),
                               mean / 2)


class _DoubledLogits(transformers.LlamaForCausalLM):
    """A real model whose logits are not its head's output (post-processing padfree does not know)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


def test_a_model_whose_logits_it_cannot_reproduce_is_refused():
    config = padfree.proof.tiny.tiny_config("llama")
    model = _DoubledLogits(config)
    ids = torch.randint(3, 96, (1, 5))
    with pytest.raises(padfree.UnsupportedModelError, match="cannot reproduce the logits of _DoubledLogits"):
        causal_lm_loss(model, {"input_ids": ids, "labels": ids})


def test_a_head_whose_weight_exists_only_inside_its_forward_is_refused():
    """What DeepSpeed ZeRO-3 does to every module: gather the weight before its forward, release it after."""
    model = zoo_model("llama")
    head = model.lm_head
    full = head.weight.data

    def gather(module, args):
        module.weight.data = full

    def release(module, args, out):
        module.weight.data = torch.empty(0)

    head.register_forward_pre_hook(gather)
    head.register_forward_hook(release)
    ids = torch.randint(3, 96, (1, 6))
    assert model(input_ids=ids, labels=ids).loss.isfinite()  # the model itself works
    with pytest.raises(padfree.UnsupportedModelError, match="not materialised there"):
        causal_lm_loss(model, {"input_ids": ids, "labels": ids})


@pytest.mark.parametrize(("inputs", "kwargs", "match"), [
    ({"input_ids": torch.ones(1, 3, dtype=torch.long)}, {}, "exactly one of labels"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long),
      "shift_labels": torch.ones(1, 3, dtype=torch.long)}, {}, "exactly one of labels"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)},
     {"reduction": "none"}, "reduction must be 'mean' or 'sum'"),
    ({"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)}, {},
     "does not match the model's positions"),
])
def test_causal_lm_loss_bad_input(inputs, kwargs, match):
    with pytest.raises(padfree.InvalidArgumentError, match=match):
        causal_lm_loss(zoo_model("llama"), inputs, **kwargs)


def test_a_batch_without_targets_gives_the_models_own_loss_and_gradients():
    """transformers' mean over no target is NaN (0 / 0), with zero gradients; over a step count it is 0."""
    model = zoo_model("llama")
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(5))
    labels = torch.full_like(ids, -100)
    labels[1, 0] = 7  # a row's first label is never a target: still no target at all
    nan = []
    for num_items in (None, 0, 5, torch.tensor(0), torch.tensor(2.5)):
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        stock = model(input_ids=ids, labels=labels, use_cache=False, **kwargs).loss
        stock_grads = torch.autograd.grad(stock, list(model.parameters()), allow_unused=True)
        mine = causal_lm_loss(model, {"input_ids": ids, "labels": labels}, num_items_in_batch=num_items)
        torch.testing.assert_close(mine, stock.float(), equal_nan=True, msg=f"num_items_in_batch={num_items}")
        grads = torch.autograd.grad(mine, list(model.parameters()), allow_unused=True)
        for g, h in zip(grads, stock_grads, strict=True):
            for t in (g, h):
                assert t is None or (t.isfinite().all() and not t.any())
        nan.append(bool(mine.isnan()))
    assert nan == [True, True, False, True, False]
    # negative control: a batch with targets is a number, divided by the count it is given
    labels[0, 3] = 9
    assert causal_lm_loss(model, {"input_ids": ids, "labels": labels}).isfinite()


def test_ids_and_labels_outside_the_vocabulary_are_named_before_the_forward():
    model = zoo_model("llama")  # 96 ids
    ids = torch.tensor([[5, 6, 7, 8]])
    cases = [
        ({"input_ids": torch.tensor([[5, 6, 96, 8]]), "labels": ids},
         r"input_ids\[0, 2\] = 96 is not a token of the model: its vocabulary has 96 ids, \[0, 96\)"),
        ({"input_ids": ids, "labels": torch.tensor([[-100, 6, 7, 1000]])},
         r"labels\[0, 3\] = 1000 is not a target of the model: a label is a token id in \[0, 96\) .* or -100"),
        ({"input_ids": ids, "labels": torch.tensor([[-5, -7, 2, 3]])}, r"labels\[0, 1\] = -7 is not a target"),
        ({"input_ids": ids, "shift_labels": torch.tensor([[6, -100, -3, -100]])},
         r"shift_labels\[0, 2\] = -3 is not a target"),
        ({"input_ids": ids, "labels": [[5, 6, 7, 8]]}, r"inputs\['labels'\] must be an integer tensor .* got \[\[5,"),
    ]
    for inputs, match in cases:
        with pytest.raises(padfree.InvalidArgumentError, match=match):
            causal_lm_loss(model, inputs)
    # a row's first label is shifted out, never a target: transformers ignores it, so does the check
    labels = torch.tensor([[-5, 6, 7, 8]])
    torch.testing.assert_close(causal_lm_loss(model, {"input_ids": ids, "labels": labels}),
                               model(input_ids=ids, labels=labels, use_cache=False).loss)
    with pytest.raises(padfree.InvalidArgumentError, match=r"targets\[1\] = 11 is not a class: targets must be in "
                                                          r"\[0, 5\)"):
        linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([1, 11, -100]))
