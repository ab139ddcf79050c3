"""A packed mixer forward (GatedDeltaNet, Mamba-2, Mamba-1, short convolutions) over blocks of whole segments
(padfree.model.row_blocks): the same numbers as every sequence alone, on the routes a long row takes (plain, gradient
checkpointing in both modes, a segment mask), with a leaking control the same comparison catches; the cut itself
loses, duplicates and splits nothing (hypothesis).

The blocks are made small here (a few tokens of budget) so that the tiny rows of the tests cut into several blocks;
a real row cuts at :data:`padfree.model.row_blocks.BLOCK_BYTES` of its widest tensor (hundreds of tokens).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree import configure_packing  # noqa: E402
from padfree.model import rebind, row_blocks  # noqa: E402
from padfree.model.packed import PackedLayout  # noqa: E402
from padfree.proof.compare import prove  # noqa: E402
from zoo import (  # noqa: E402
    MIXER_ROWS,
    cut_inside_segments,
    grad_diff,
    max_diff,
    packed_rows,
    run_packed,
    run_separately,
    tiny_model,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# MIXER_ROWS: rows of 83 and 83 tokens; 40-token blocks cut each into two or three, one block of each row holds the
# 70- or 40-token sequence alone, another holds short ones together, and one block crosses from row 0 into row 1
BLOCK = 40


@pytest.fixture
def small_blocks(monkeypatch):
    """Every GatedDeltaNet of a model configured while it is active runs rows in blocks of about :data:`BLOCK`
    tokens; returns the list of block lengths each packed mixer call ran (to check the rows were cut)."""
    monkeypatch.setattr(row_blocks, "block_tokens", lambda module: BLOCK)
    calls: list[list[int]] = []
    run = row_blocks.run_in_blocks

    def counting(forward, hidden, lay, tokens):
        calls.append([b - a for a, b, _ in row_blocks.segment_blocks(lay, tokens)])
        return run(forward, hidden, lay, tokens)

    monkeypatch.setattr(row_blocks, "run_in_blocks", counting)
    return calls


def _compare(model, **kwargs):
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    alone, alone_grads = run_separately(model, seqs)
    configure_packing(model)
    out, grads = run_packed(model, ids, pos, seqs, **kwargs)
    return max_diff(out, alone), grad_diff(grads, alone_grads)


# one model of every mixer family that runs in blocks: GatedDeltaNet, Mamba-2 (SSD), Mamba-1 in a hybrid and alone,
# short convolutions
BLOCKED = ["qwen3_5_text", "granitemoehybrid", "jamba", "mamba", "lfm2"]


@pytest.mark.parametrize("model_type", BLOCKED)
def test_blocks_of_whole_segments_equal_every_sequence_alone(small_blocks, model_type):
    logits, grads = _compare(tiny_model(model_type))
    assert small_blocks and all(len(cut) >= 4 for cut in small_blocks), small_blocks  # the rows were cut
    assert logits <= 1e-5 and grads <= 1e-5, (logits, grads)


@pytest.mark.parametrize("model_type", BLOCKED)
def test_a_cut_inside_the_sequences_is_caught(small_blocks, monkeypatch, model_type):
    """The leaking control: the same comparison, blocks cut every 40 tokens whatever the boundaries."""
    monkeypatch.setattr(row_blocks, "segment_blocks", cut_inside_segments)
    logits, grads = _compare(tiny_model(model_type))
    assert logits > 1e-3 and grads > 1e-5, (logits, grads)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_blocks_under_bf16_autocast_are_proven_like_a_whole_row(small_blocks, model_type):
    """padfree's own proof (packed vs every sequence alone: logits, loss, gradients; fp32 and bf16 autocast, each
    with its leaking control) passes with the rows cut into blocks."""
    proof = prove(tiny_model(model_type), precisions=["fp32", "autocast_bf16"])
    assert small_blocks and all(len(cut) >= 3 for cut in small_blocks), small_blocks
    assert [c.precision for c in proof.checks] == ["fp32", "autocast_bf16"]
    assert all(c.ok for c in proof.checks), [str(c) for c in proof.checks]
    assert any(c.sees_leaks for c in proof.checks), [str(c) for c in proof.checks]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_same_blocks(small_blocks, reentrant):
    model = tiny_model("qwen3_5_text")
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    logits, grads = _compare(model)
    assert len(small_blocks) >= 4  # forward and recompute of both GatedDeltaNet layers
    assert logits <= 1e-5 and grads <= 1e-5, (logits, grads)


@pytest.mark.parametrize("adapter", ["lora", "modules_to_save"])
@pytest.mark.parametrize("leak", [False, True], ids=["blocks", "cut_inside_segments"])
def test_a_peft_wrapped_gated_delta_net_runs_its_adapters_per_block(small_blocks, monkeypatch, adapter, leak):
    """A LoRA on every projection of the GatedDeltaNet (``in_proj_qkv``, ``in_proj_z``, ``out_proj``, ...), or
    ``modules_to_save``'s trained copy of the whole mixer: a block runs the wrapped module's own forward, so the
    adapters apply per block exactly as on the whole row — and the leaking cut is caught through the wrapper too."""
    peft = pytest.importorskip("peft")
    if leak:
        monkeypatch.setattr(row_blocks, "segment_blocks", cut_inside_segments)
    config = (peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False) if adapter == "lora" else
              peft.LoraConfig(r=4, target_modules=["gate_proj"], modules_to_save=["linear_attn"],
                              init_lora_weights=False))
    wrapped = peft.get_peft_model(tiny_model("qwen3_5_text"), config)
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    alone, alone_grads = run_separately(wrapped, seqs)
    configure_packing(wrapped)
    out, grads = run_packed(wrapped, ids, pos, seqs)
    assert small_blocks and all(len(cut) >= 4 for cut in small_blocks), small_blocks
    trained = [n for n in grads if "lora_" in n or "modules_to_save" in n]
    assert trained and set(grads) == set(alone_grads)
    if adapter == "lora":
        assert any("linear_attn.in_proj_qkv.lora_" in n for n in trained)
    logits, grad = max_diff(out, alone), grad_diff(grads, alone_grads)
    if leak:
        assert logits > 1e-3 and grad > 1e-5, (logits, grad)
    else:
        assert logits <= 1e-5 and grad <= 1e-5, (logits, grad)


def test_a_segment_mask_runs_in_blocks_too(small_blocks):
    """A LLaMA-Factory mask (with a trailing padding run) is consumed by padfree's hook: the mixer sees no mask."""
    model = tiny_model("qwen3_5_text")
    ids, _, seqs = packed_rows(MIXER_ROWS)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(MIXER_ROWS):
        starts = np.cumsum([0, *row])
        for i in range(len(row) - (b == 1)):  # row 1's last run is padding (0)
            mask[b, starts[i]:starts[i + 1]] = i + 1
    kept = [s for s in seqs if not (s[0] == 1 and s[1] == sum(MIXER_ROWS[1][:-1]))]
    alone, alone_grads = run_separately(model, kept)
    configure_packing(model)
    out, grads = run_packed(model, ids, None, kept, attention_mask=mask)
    assert small_blocks
    assert max_diff(out, alone) <= 1e-5 and grad_diff(grads, alone_grads) <= 1e-5


def test_a_row_runs_whole_where_blocks_do_not_apply(monkeypatch):
    """One block, a mixer call carrying a per-token argument, or a family without blocks: the row runs whole."""
    lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
    ran = []
    assert row_blocks.run_in_blocks(lambda sub, x: ran.append(x) or x, torch.ones(1, 5, 2), lay, 8) is None
    assert ran == []
    hidden = torch.ones(2, 5, 3)
    assert not row_blocks.blockable_call(None, (), {})
    assert not row_blocks.blockable_call(hidden, (hidden,), {"attention_mask": torch.ones(2, 5)})
    assert not row_blocks.blockable_call(hidden, (hidden, None, torch.ones(2, 5)), {})
    assert not row_blocks.blockable_call(hidden, (), {"hidden_states": hidden, "seq_idx": torch.zeros(1, 10)})
    assert row_blocks.blockable_call(hidden, (hidden,), {"attention_mask": None, "cu_seq_lens_q": torch.zeros(4)})
    assert not rebind.Primitives("a mixer", {}, {}, ()).row_blocks  # a family runs in blocks only when declared
    qwen = tiny_model("qwen3_5_text")
    configure_packing(qwen)
    assert qwen.model.layers[0].linear_attn._padfree_mixer.block_tokens == row_blocks.block_tokens(
        qwen.model.layers[0].linear_attn) > 0


def test_block_size_follows_the_widest_projection():
    """Qwen3.5's GatedDeltaNet writes 2 * 16 * 128 + 32 * 128 = 8,192 floats per token: 384 tokens per 12 MiB."""
    config = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"])
    mixer = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].linear_attn
    assert mixer.in_proj_qkv.out_features == 8192
    assert row_blocks.block_tokens(mixer) == row_blocks.BLOCK_BYTES // (4 * 8192)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=8), min_size=1, max_size=4),
       tokens=st.integers(1, 100))
def test_blocks_hold_every_token_once_and_every_segment_whole(rows, tokens):
    width = max(sum(r) for r in rows)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        pos[b, :sum(row)] = torch.cat([torch.arange(n) for n in row])
        pos[b, sum(row):] = torch.arange(width - sum(row))  # a filler run: a segment of its own
    lay = PackedLayout.from_position_ids(pos)
    blocks = row_blocks.segment_blocks(lay, tokens)
    assert blocks[0][0] == 0 and blocks[-1][1] == lay.shape[0] * width
    assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(blocks))  # no gap, no overlap
    assert np.concatenate([sub.lengths for *_, sub in blocks]).tolist() == lay.lengths.tolist()  # whole segments
    for a, b, sub in blocks:
        assert sub.shape == (1, b - a) and int(sub.lengths.sum()) == b - a
        assert torch.equal(sub.position_ids[0], lay.position_ids.reshape(-1)[a:b])
        assert sub.lengths.size == 1 or int(sub.lengths[:-1].sum()) < tokens  # only the last segment overruns
