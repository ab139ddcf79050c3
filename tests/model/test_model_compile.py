"""``torch.compile`` over a configured model: packed steps stay exact, and a new batch of boundaries (new lengths,
new row width) does not recompile once the compiled graphs have gone dynamic.

The per-batch boundary work (the layout, the bucketed attention, the mixers' segment scans) runs outside the
compiled graphs on purpose: it reads the boundaries on the host, and traced, every new set of lengths would be a new
guard and a recompile — eight batches later dynamo gives up and the model runs uncompiled.

Most tests compile with ``backend="aot_eager"``: dynamo's capture, guards and graph breaks plus AOTAutograd's
backward — everything padfree's code meets — without inductor's C++ build, which takes about a minute per graph on
this machine. One test runs the default (inductor) backend end to end.
"""

from __future__ import annotations

import pytest
import torch

import padfree
from zoo import VOCAB, grad_diff, max_diff, packed_rows, run_packed, run_separately, tiny_model

ATOL = 1e-5

# Two rows per batch (the batch dimension stays 2: a change there is a recompile of its own), new lengths, new
# sequence counts and a new row width every time; no width of 1 (dynamo specialises sizes 0 and 1).
ROW_SETS = [
    [[9, 8, 3], [7, 6, 5]],
    [[4, 12, 2], [3, 11]],
    [[20, 1], [5, 6, 8, 2]],
    [[3, 3, 3, 3, 3, 5], [10, 10]],
]

CASES = [
    ("llama", "sdpa"),
    ("gemma2", "sdpa"),  # softcapped attention: padfree's eager math per bucket (the padfree_eager formula)
    ("qwen3_5_text", "sdpa"),  # GatedDeltaNet layers around an attention layer
    ("mamba2", None),  # SSD scan and short convolutions only
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _configured(model_type: str, backend: str | None):
    model = tiny_model(model_type)
    padfree.configure_packing(model, **({"backend": backend} if backend else {}))
    return model


def _assert_exact_without_recompiles(model, compiled, row_sets, *, compiles: int = 2) -> None:
    """Every batch of ``row_sets`` through ``compiled`` gives the per-sequence logits and gradients of ``model``, and
    after the first ``compiles`` batches (static shapes, then dynamic ones) no batch recompiles."""
    for i, rows in enumerate(row_sets):
        ids, pos, seqs = packed_rows(rows, seed=i)
        alone, g_alone = run_separately(model, seqs)
        with torch._dynamo.config.patch(error_on_recompile=i >= compiles):
            packed, g_packed = run_packed(compiled, ids, pos, seqs)
        assert max_diff(packed, alone) <= ATOL, (rows, max_diff(packed, alone))
        assert grad_diff(g_packed, g_alone) <= ATOL, (rows, grad_diff(g_packed, g_alone))


@pytest.mark.parametrize(("model_type", "backend"), CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_compiled_packed_steps_are_exact_and_do_not_recompile_per_batch(model_type, backend):
    model = _configured(model_type, backend)
    # the first batch compiles for its shapes, the second makes them dynamic; no later batch may recompile
    _assert_exact_without_recompiles(model, torch.compile(model, backend="aot_eager"), ROW_SETS)


def test_compiled_packed_steps_with_activation_checkpointing_are_exact():
    """Checkpointed layers recompute their forward in the backward, inside the compiled graphs, from the layout of
    the batch in flight."""
    model = _configured("llama", "sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _assert_exact_without_recompiles(model, torch.compile(model, backend="aot_eager"), ROW_SETS[:3])


def test_compiled_model_still_runs_unpacked_padded_batches_exactly():
    """After packed calls, an ordinary right-padded batch takes transformers' own masked path (the mask function
    decides per call, at run time, not once at trace time)."""
    model = _configured("llama", "sdpa")
    compiled = torch.compile(model, backend="aot_eager")
    ids, pos, seqs = packed_rows(ROW_SETS[0])
    run_packed(compiled, ids, pos, seqs, grad=False)
    lengths = [9, 4, 6]
    g = torch.Generator().manual_seed(3)
    padded = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for b, n in enumerate(lengths):
        padded[b, :n], mask[b, :n] = torch.randint(3, VOCAB, (n,), generator=g), 1
    with torch.no_grad():
        out = compiled(input_ids=padded, attention_mask=mask, use_cache=False).logits
        for b, n in enumerate(lengths):
            alone = model(input_ids=padded[b:b + 1, :n], use_cache=False).logits[0]
            assert float((out[b, :n] - alone).abs().max()) <= ATOL
        # and packed again afterwards
        ids, pos, seqs = packed_rows(ROW_SETS[1], seed=1)
        packed, _ = run_packed(compiled, ids, pos, seqs, grad=False)
    alone, _ = run_separately(model, seqs)
    assert max_diff(packed, alone) <= ATOL


def test_fused_loss_through_a_compiled_model_equals_the_reference():
    model = _configured("llama", "sdpa")
    compiled = torch.compile(model, backend="aot_eager")
    for i, rows in enumerate(ROW_SETS[:2]):
        ids, pos, seqs = packed_rows(rows, seed=i)
        _, g_alone = run_separately(model, seqs)
        labels = torch.full_like(ids, -100)  # every next-token target inside a sequence, none across or on filler
        for b, start, s in seqs:
            labels[b, start + 1:start + len(s)] = s[1:]
        model.zero_grad()
        loss = padfree.causal_lm_loss(compiled, {"input_ids": ids, "position_ids": pos, "labels": labels})
        loss.backward()
        g_fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert grad_diff(g_fused, g_alone) <= ATOL


@pytest.mark.slow
def test_inductor_compiled_packed_steps_are_exact():
    """The default backend, C++ code generation included; dynamic shapes from the start, so it compiles once (about
    half a minute here) and no later batch recompiles."""
    model = _configured("llama", "sdpa")
    _assert_exact_without_recompiles(model, torch.compile(model, dynamic=True), ROW_SETS[:3], compiles=1)
