"""Bidirectional blocks in packed rows (Gemma's images, PaliGemma's prefix): a layout's blocks applied by every
packed attention backend, against each sample run alone.

The reference is built per sample, in plain torch, from that sample's own token types and the model's rule as its
modeling file writes it (gemma3: ``k <= q`` or the same image run, the sliding window AND-ed after; gemma4: the same
on sliding layers only, images and videos; gemma4_unified and PaliGemma: the window AND-ed before the block is
OR-ed; PaliGemma's prefix one block per sample). A first test checks that reference against the masks transformers
itself builds for one sample. Then: outputs and q/k/v gradients of ``padfree_sdpa``, ``padfree_eager`` and
``padfree_varlen`` (which runs such calls as SDPA) at fp32 <= 1e-5; flex's ``BlockMask`` made dense (CPU) and the
flex kernel (CUDA); a row split across two gloo ranks; and a tiny Gemma3 / Gemma4 / Gemma2 (PaliGemma 2's language
model) run packed through padfree's attention against transformers' eager attention with the model's own mask for
one sample alone: logits and every gradient. Negative controls: blocks not intersected with the samples (refused by
validation, and caught by the comparison when forced in), no blocks, and the other window composition.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import masking_utils
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gemma4 import modeling_gemma4
from transformers.models.gemma4_unified import modeling_gemma4_unified

from multiproc import free_port, run_ranks
from padfree.errors import InvalidArgumentError, InvalidLayoutError
from padfree.model.attention import LAYOUT_KWARG, PACKED_FORWARD, packed_forward, register_backends
from padfree.model.packed import BLOCK_RULES, PackedLayout, blocks_from_token_types
from padfree.proof.tiny import build_tiny
from zoo import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
HEADS, KV_HEADS, DIM = 4, 2, 16
WINDOW = 3
MODELS = ("gemma3", "gemma4", "gemma4_unified", "paligemma")
# samples as token types: 1 an image token, 2 a video token (gemma4), 0 text (PaliGemma: 0 is the prefix). Row 0: a
# block at a sample's start, two blocks in one sample, a sample without blocks, a block at a sample's end followed
# by a sample that starts with one (a run across the boundary: the blocks must be cut there); row 1: a block longer
# than the window, a one-token sample, a video run next to an image run, then padding (segment 0)
ROWS = [["11110000", "0001111000111100", "00000", "0001111", "1110"],
        ["0111111111111", "0", "00110", "2221100"]]
WIDTH = 40


def _types(sample: str) -> torch.Tensor:
    return torch.tensor([int(c) for c in sample])


def packed_row(rows=ROWS, width=WIDTH):
    """``(segment_ids, token_types, [(row, start, types)])`` of ``rows`` packed left to right, padding 0 at the end."""
    seg = torch.zeros(len(rows), width, dtype=torch.int64)
    types = torch.zeros(len(rows), width, dtype=torch.int64)
    spans = []
    for b, row in enumerate(rows):
        col = 0
        for k, sample in enumerate(row):
            n = len(sample)
            seg[b, col:col + n] = k + 1
            types[b, col:col + n] = _types(sample)
            spans.append((b, col, sample))
            col += n
    return seg, types, spans


def sample_blocks(sample: str, model: str) -> torch.Tensor:
    """``(n,)`` block ids of one sample alone (0: none): PaliGemma's prefix is one block, Gemma's blocks are the
    maximal runs of image (gemma3) or image and video (gemma4) tokens."""
    t = _types(sample)
    if model == "paligemma":
        return (t == 0).long()
    member = (t == 1) | ((t == 2) & (model != "gemma3"))
    ids, current = torch.zeros(t.numel(), dtype=torch.long), 0
    for j in range(t.numel()):
        if member[j] and (j == 0 or not member[j - 1]):
            current += 1
        if member[j]:
            ids[j] = current
    return ids


def _pairs(ids: torch.Tensor) -> torch.Tensor:
    return (ids[:, None] == ids[None, :]) & (ids[:, None] > 0)


def sample_mask(sample: str, model: str, window: int | None) -> torch.Tensor:
    """``(n, n) bool`` (True = may attend) of one sample alone, as ``model``'s modeling file defines it."""
    n = len(sample)
    i = torch.arange(n)
    causal = i[:, None] >= i[None, :]
    same = _pairs(sample_blocks(sample, model))
    if model == "gemma4" and window is None:
        same = torch.zeros_like(same)  # Gemma 4's full layers: causal only
    if window is None:
        return causal | same
    inside = i[:, None] - i[None, :] < window
    if model in ("gemma3", "gemma4"):
        return (causal | same) & inside
    return (causal & inside) | same


def reference(q, k, v, spans, model, window, *, scaling=DIM ** -0.5, softcap=None):
    """``(B, T, H, D)``: every sample attending to itself alone under :func:`sample_mask` (padding: 0)."""
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    groups = q.shape[1] // k.shape[1]
    for b, start, sample in spans:
        n = len(sample)
        qs, ks, vs = (x[b, :, start:start + n] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        s = qs @ ks.transpose(-1, -2) * scaling
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        o = s.masked_fill(~sample_mask(sample, model, window), float("-inf")).softmax(-1) @ vs
        out[b, start:start + n] = o.transpose(0, 1)
    return out


def worst(got, want, spans) -> float:
    return max(float((got[b, s:s + len(x)] - want[b, s:s + len(x)]).abs().max()) for b, s, x in spans)


def qkv(seed=0, batch=2, width=WIDTH):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, width, DIM, generator=gen)
    k, v = (torch.randn(batch, KV_HEADS, width, DIM, generator=gen) for _ in range(2))
    return q, k, v


def attention_module() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS)
    return transformers.models.llama.modeling_llama.LlamaAttention(config, 0).eval()


def blocks_layout(model: str) -> tuple[PackedLayout, list]:
    seg, types, spans = packed_row()
    return PackedLayout.from_segment_ids(seg).with_token_types(types, model), spans


# ---- the reference is the model's own mask --------------------------------------------------------------------------


def _transformers_masks(model: str, sample: str) -> dict[str, torch.Tensor]:
    """The ``(n, n) bool`` masks transformers builds for one sample alone: full and sliding layers."""
    t = _types(sample)[None]
    n = t.shape[1]
    emb, pos = torch.zeros(1, n, 8), torch.arange(n)[None]
    if model == "gemma3":
        config = transformers.Gemma3TextConfig(sliding_window=WINDOW, num_hidden_layers=2)
        config._attn_implementation = "eager"
        masks = modeling_gemma3.create_masks_for_vision_model(
            config, emb, None, None, pos, modeling_gemma3.get_block_sequence_ids_for_mask(t))
    elif model == "gemma4":
        config = transformers.Gemma4TextConfig(sliding_window=WINDOW, num_hidden_layers=2)
        config._attn_implementation = "eager"
        masks = modeling_gemma4.create_masks_for_vision_model(
            config, emb, None, None, pos, modeling_gemma4.get_block_sequence_ids_for_mask(t, emb.device))
    elif model == "gemma4_unified":  # what Gemma4UnifiedModel.forward builds
        config = transformers.Gemma4UnifiedTextConfig(sliding_window=WINDOW, num_hidden_layers=2)
        config._attn_implementation = "eager"
        masks = masking_utils.create_masks_for_generate(
            config, emb, None, None, pos,
            block_sequence_ids=modeling_gemma4_unified.get_block_sequence_ids_for_mask(t, emb.device))
    else:  # PaliGemmaModel.forward; PaliGemma 2 (a Gemma 2 language model) has sliding layers
        config = transformers.Gemma2Config(sliding_window=WINDOW, num_hidden_layers=2)
        config._attn_implementation = "eager"
        prefix = torch.where(t == 0, 0, -1)
        masks = {"full_attention": masking_utils.create_causal_mask(config, emb, None, None, pos,
                                                                    block_sequence_ids=prefix),
                 "sliding_attention": masking_utils.create_sliding_window_causal_mask(
                     config, emb, None, None, pos, block_sequence_ids=prefix)}
    return {k: (m[0, 0] == 0) if m.dtype != torch.bool else m[0, 0] for k, m in masks.items()}


@pytest.mark.parametrize("model", MODELS)
def test_the_reference_mask_is_the_one_transformers_builds_for_one_sample(model):
    for sample in (s for row in ROWS for s in row):
        masks = _transformers_masks(model, sample)
        assert torch.equal(masks["full_attention"], sample_mask(sample, model, None)), sample
        assert torch.equal(masks["sliding_attention"], sample_mask(sample, model, WINDOW)), sample
    # the two window compositions differ on these samples (the check above can tell them apart)
    assert not torch.equal(sample_mask(ROWS[1][0], "gemma3", WINDOW), sample_mask(ROWS[1][0], "gemma4_unified",
                                                                                   WINDOW))


# ---- blocks from token types ----------------------------------------------------------------------------------------


def test_blocks_are_runs_cut_at_every_boundary_or_one_per_sample():
    seg, types, _ = packed_row()
    runs = blocks_from_token_types(types, seg, "gemma3")
    assert runs[0].tolist() == ([1] * 4 + [0] * 4 + [0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 3, 3, 3, 3, 0, 0] + [0] * 5
                                + [0, 0, 0, 4, 4, 4, 4] + [5, 5, 5, 0])  # the run across samples 4 and 5: cut
    assert runs[1].tolist() == [0] + [1] * 12 + [0] + [0, 0, 2, 2, 0] + [0, 0, 0, 3, 3, 0, 0] + [0] * 14
    videos = blocks_from_token_types(types, seg, "gemma4")[1, 19:26].tolist()
    assert videos == [3, 3, 3, 3, 3, 0, 0]  # images and videos next to each other: one run
    prefix = blocks_from_token_types(types, seg, BLOCK_RULES["paligemma"])
    assert prefix[0].tolist() == [0] * 4 + [1] * 4 + [2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 0, 0, 0, 0, 2, 2] + [3] * 5 + [
        4, 4, 4, 0, 0, 0, 0] + [0, 0, 0, 5]  # one block per sample, not contiguous
    assert int(prefix[1, 26:].abs().sum()) == 0  # padding (segment 0): no block
    for rule in MODELS:  # within a sample, the blocks group its tokens as the sample's own ids do
        blocks = blocks_from_token_types(types, seg, rule)
        for b, start, sample in packed_row()[2]:
            assert torch.equal(_pairs(blocks[b, start:start + len(sample)]), _pairs(sample_blocks(sample, rule)))


# ---- every backend, outputs and gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full layer", "sliding layer"])
@pytest.mark.parametrize("backend", ["padfree_sdpa", "padfree_eager", "padfree_varlen"])
@pytest.mark.parametrize("model", MODELS)
def test_backends_equal_each_sample_alone_with_gradients(model, backend, window):
    lay, spans = blocks_layout(model)
    if backend == "padfree_varlen" and not lay.blocks_apply(window) and not torch.cuda.is_available():
        pytest.skip("a call without blocks runs varlen_attn, CUDA only")
    seg = lay.segment_ids
    grads, outs = [], []
    for run in (lambda q, k, v: packed_forward(backend, attention_module(), q, k, v, lay, sliding_window=window),
                lambda q, k, v: reference(q, k, v, spans, model, window)):
        q, k, v = (x.requires_grad_() for x in qkv(seed=1))
        weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2))
        out = run(q, k, v)
        (out * weight)[seg > 0].sum().backward()  # the loss reads real tokens only
        outs.append(out.detach())
        grads.append((q.grad, k.grad, v.grad))
    assert worst(outs[0], outs[1], spans) <= TOL
    for got, want in zip(*grads, strict=True):
        assert float((got - want).abs().max()) <= TOL


@pytest.mark.parametrize("backend", ["padfree_sdpa", "padfree_eager"])
def test_softcapping_and_a_scale_with_blocks(backend):
    """Softcapping (Gemma 2's language model: the math path on SDPA too) with the blocks."""
    for model in ("gemma3", "paligemma"):
        lay, spans = blocks_layout(model)
        q, k, v = qkv(seed=3)
        got = packed_forward(backend, attention_module(), q, k, v, lay, sliding_window=WINDOW, softcap=2.0,
                             scaling=0.5)
        want = reference(q, k, v, spans, model, WINDOW, scaling=0.5, softcap=2.0)
        assert worst(got, want, spans) <= TOL


def test_negative_controls_are_caught():
    """Blocks not cut at the samples (gemma3's own ids over the whole packed row) are refused by name. Forced into a
    layout they still join no two samples (every backend attends within a segment, blocks or not), so the same
    comparison passes; it fails without blocks, with the other window composition, and with the row's blocks over a
    row whose boundaries are lost (what transformers' unpacked mask computes)."""
    seg, types, spans = packed_row()
    base = PackedLayout.from_segment_ids(seg)
    whole_row = modeling_gemma3.get_block_sequence_ids_for_mask(types) + 1  # -1 (no block) -> 0
    with pytest.raises(InvalidLayoutError, match="block 4 of row 0 holds tokens of segments 4 and 5"):
        base.with_blocks(whole_row, "gemma3")
    forced = PackedLayout(base.segment_ids, base.position_ids, base.lengths, base.source, whole_row,
                          BLOCK_RULES["gemma3"])
    one_row = PackedLayout.from_segment_ids(torch.ones_like(seg)).with_blocks(whole_row, "gemma3")
    other = base.with_token_types(types, "gemma4_unified")  # the same runs, the window AND-ed before the OR
    q, k, v = qkv()
    want = reference(q, k, v, spans, "gemma3", WINDOW)
    for backend in ("padfree_sdpa", "padfree_eager"):
        def run(lay, backend=backend):
            return packed_forward(backend, attention_module(), q, k, v, lay, sliding_window=WINDOW)

        assert worst(run(forced), want, spans) <= TOL
        for control in (base, other, one_row):
            assert worst(run(control), want, spans) > 1000 * TOL


def test_a_layout_without_blocks_runs_the_causal_code(monkeypatch):
    """No cost for text: a layout without blocks (or with all-zero blocks, or a layer the rule leaves causal) calls
    SDPA with ``is_causal`` and no mask; with blocks, only the buckets that hold one get a mask."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[-2], attn_mask, kwargs.get("is_causal")))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    seg, types, spans = packed_row([["0000", "001111111", "0" * 19]], 32)  # buckets of 8, 16, 24 tokens
    base = PackedLayout.from_segment_ids(seg)
    assert base.with_blocks(torch.zeros_like(seg), "gemma3") is base
    q, k, v = qkv(batch=1, width=32)
    gemma4 = base.with_token_types(types, "gemma4")
    for lay, window in ((base, None), (gemma4, None)):
        calls.clear()
        packed_forward("padfree_sdpa", attention_module(), q, k, v, lay, sliding_window=window)
        assert calls and all(mask is None and causal for _, mask, causal in calls)
    lay = base.with_token_types(types, "gemma3")
    calls.clear()
    out = packed_forward("padfree_sdpa", attention_module(), q, k, v, lay)
    assert worst(out, reference(q, k, v, spans, "gemma3", None), spans) <= TOL
    masked = {length: (mask is not None, causal) for length, mask, causal in calls}
    assert masked == {8: (False, True), 16: (True, False), 24: (False, True)}


def test_block_masks_are_built_once_per_layout_and_window():
    lay, _ = blocks_layout("gemma3")
    assert lay.bucket_masks(WINDOW) is lay.bucket_masks(WINDOW)
    assert lay.bucket_masks(None) is not lay.bucket_masks(WINDOW)
    assert lay.block_mask(WINDOW, 16) is lay.block_mask(WINDOW, 16)
    assert lay.buckets() is lay.buckets()
    base = PackedLayout.from_segment_ids(lay.segment_ids)
    plan = base.buckets()
    assert base.with_blocks(lay.blocks, "gemma3").buckets() is plan  # the boundaries' forms carry over
    with pytest.raises(InvalidArgumentError, match="bucket_masks needs a layout with blocks"):
        base.bucket_masks(None)


def test_a_column_window_keeps_its_blocks():
    lay, _ = blocks_layout("gemma3")
    part = lay.columns(10, 30)
    assert torch.equal(part.blocks, lay.blocks[:, 10:30]) and part.block_rule is lay.block_rule
    assert PackedLayout.from_segment_ids(lay.segment_ids).columns(10, 30).blocks is None


# ---- validation -----------------------------------------------------------------------------------------------------

_SEG = torch.tensor([[1, 1, 1, 2, 2, 2]])
BAD = {
    "negative": (lambda lay: lay.with_blocks(torch.tensor([[0, -1, 0, 0, 0, 0]]), "gemma3"), InvalidLayoutError,
                 r"blocks\[0, 1\] = -1 is negative"),
    "across samples": (lambda lay: lay.with_blocks(torch.tensor([[0, 1, 1, 1, 0, 0]]), "gemma3"), InvalidLayoutError,
                       "block 1 of row 0 holds tokens of segments 1 and 2"),
    "cut in two": (lambda lay: lay.with_blocks(torch.tensor([[1, 0, 1, 0, 0, 0]]), "gemma3"), InvalidLayoutError,
                   "block 1 of row 0 is not one contiguous run"),
    "shape": (lambda lay: lay.with_blocks(torch.zeros(1, 5, dtype=torch.long), "gemma3"), InvalidLayoutError,
              r"blocks must be \(B, T\) = \(1, 6\)"),
    "float": (lambda lay: lay.with_blocks(torch.zeros(1, 6), "gemma3"), InvalidLayoutError,
              "blocks must hold integers"),
    "rule": (lambda lay: lay.with_blocks(torch.zeros(1, 6, dtype=torch.long), "llava"), InvalidArgumentError,
             "rule must be a BlockRule or one of gemma3"),
    "token types shape": (lambda lay: lay.with_token_types(torch.zeros(1, 5, dtype=torch.long), "gemma3"),
                          InvalidLayoutError, r"token_type_ids must be \(B, T\) = \(1, 6\)"),
}


@pytest.mark.parametrize(("call", "error", "match"), BAD.values(), ids=BAD.keys())
def test_bad_blocks_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call(PackedLayout.from_segment_ids(_SEG))


def test_a_block_of_a_sample_need_not_be_contiguous_where_the_model_says_so():
    lay = PackedLayout.from_segment_ids(_SEG).with_blocks(torch.tensor([[1, 0, 1, 0, 2, 2]]), "paligemma")
    assert lay.blocks.tolist() == [[1, 0, 1, 0, 2, 2]]


# ---- flex: the BlockMask (CPU), the kernel (CUDA) -------------------------------------------------------------------


def _dense(block_mask, batch: int, width: int) -> torch.Tensor:
    """``(B, T, T) bool`` of a BlockMask: full tiles, and mask_mod inside partial ones."""
    from torch.nn.attention.flex_attention import create_mask

    size = block_mask.BLOCK_SIZE[0]
    nb = -(-width // size)

    def tiles(num, idx):
        keep = torch.arange(nb)[None, None, None, :] < num[..., None]  # (B, 1, nq, nk) of the listed entries
        dense = torch.zeros(batch, nb, nb + 1, dtype=torch.bool)
        dense.scatter_(2, torch.where(keep, idx.long(), nb)[:, 0], True)
        return dense[:, :, :nb].repeat_interleave(size, 1).repeat_interleave(size, 2)[:, :width, :width]

    partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return full | (partial & create_mask(block_mask.mask_mod, batch, 1, width, width)[:, 0])


@pytest.mark.parametrize("window", [None, WINDOW, 9])
@pytest.mark.parametrize("model", MODELS)
def test_the_flex_block_mask_is_each_samples_own_mask(model, window):
    lay, spans = blocks_layout(model)
    want = torch.zeros(2, WIDTH, WIDTH, dtype=torch.bool)
    for b, start, sample in spans:
        n = len(sample)
        want[b, start:start + n, start:start + n] = sample_mask(sample, model, window)
    for size in (4, 16, 128):
        assert torch.equal(_dense(lay.block_mask(window, size), 2, WIDTH), want), size
    control = PackedLayout.from_segment_ids(lay.segment_ids).block_mask(window, 4)
    assert not torch.equal(_dense(control, 2, WIDTH), want) or (model == "gemma4" and window is None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="padfree_flex runs on CUDA only")
@pytest.mark.parametrize("model", MODELS)
def test_flex_equals_each_sample_alone_with_gradients(model):
    seg, types, spans = packed_row()
    lay = PackedLayout.from_segment_ids(seg.cuda()).with_token_types(types.cuda(), model)
    module = attention_module().cuda()
    for window in (None, WINDOW):
        grads, outs = [], []
        for run in (lambda q, k, v, w=window: packed_forward("padfree_flex", module, q, k, v, lay, sliding_window=w),
                    lambda q, k, v, w=window: reference(q.cpu(), k.cpu(), v.cpu(), spans, model, w).cuda()):
            q, k, v = (x.cuda().requires_grad_() for x in qkv(seed=1))
            out = run(q, k, v)
            weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2)).cuda()
            (out * weight)[lay.segment_ids > 0].sum().backward()
            outs.append(out.detach().cpu())
            grads.append((q.grad.cpu(), k.grad.cpu(), v.grad.cpu()))
        assert worst(outs[0], outs[1], spans) <= TOL  # fp32: flex's kernels follow allow_tf32 (off by default)
        for got, want in zip(*grads, strict=True):
            assert float((got - want).abs().max()) <= TOL


# ---- sequence parallelism: a row split across two ranks -------------------------------------------------------------


def _sharded_worker(rank: int, world: int, tmp: str, port: int) -> None:
    import os

    import torch.distributed as dist

    from padfree.model.attention import sharded_forward
    from padfree.model.sharded import ShardedLayout
    from padfree.sequence_parallel.groups import sequence_parallel_group

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lay, _ = blocks_layout("gemma3")
    sharded = ShardedLayout(lay, sequence_parallel_group(world))
    cols = slice(sharded.start, sharded.start + sharded.width)
    q, k, v = (x[:, :, cols].clone().requires_grad_() for x in qkv(seed=1))
    out = sharded_forward("padfree_sdpa", attention_module(), q, k, v, sharded, sliding_window=WINDOW)
    weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2))[:, cols]
    (out * weight).sum().backward()
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump({"out": out.detach(), "grads": (q.grad, k.grad, v.grad)}, f)


def test_a_row_with_blocks_split_across_two_ranks_computes_the_whole_row(tmp_path):
    lay, spans = blocks_layout("gemma3")
    q, k, v = (x.requires_grad_() for x in qkv(seed=1))
    want = packed_forward("padfree_sdpa", attention_module(), q, k, v, lay, sliding_window=WINDOW)
    weight = torch.randn(2, WIDTH, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    (want * weight).sum().backward()
    assert worst(want.detach(), reference(q, k, v, spans, "gemma3", WINDOW).detach(), spans) <= TOL
    ranks = run_ranks(_sharded_worker, tmp_path, free_port(), world=2)
    got = torch.cat([r["out"] for r in ranks], 1)
    assert float((got - want.detach()).abs().max()) <= TOL
    for i, full in enumerate((q.grad, k.grad, v.grad)):
        assert float((torch.cat([r["grads"][i] for r in ranks], 2) - full).abs().max()) <= TOL


# ---- end to end: a tiny Gemma's decoder through padfree's attention -------------------------------------------------


def _own_masks(model_type: str, config, sample: str) -> dict[str, torch.Tensor]:
    """The mask mapping the multimodal model hands its language model for one sample alone (eager)."""
    t = _types(sample)[None]
    n = t.shape[1]
    emb, pos = torch.zeros(1, n, 8), torch.arange(n)[None]
    if model_type == "gemma3_text":
        return modeling_gemma3.create_masks_for_vision_model(
            config, emb, None, None, pos, modeling_gemma3.get_block_sequence_ids_for_mask(t))
    if model_type == "gemma4_text":
        return modeling_gemma4.create_masks_for_vision_model(
            config, emb, None, None, pos, modeling_gemma4.get_block_sequence_ids_for_mask(t, emb.device))
    prefix = torch.where(t == 0, 0, -1)  # PaliGemmaModel.forward, a Gemma 2 language model (PaliGemma 2)
    return {"full_attention": masking_utils.create_causal_mask(config, emb, None, None, pos, block_sequence_ids=prefix),
            "sliding_attention": masking_utils.create_sliding_window_causal_mask(config, emb, None, None, pos,
                                                                                 block_sequence_ids=prefix)}


E2E = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "gemma2": "paligemma"}
# a long image run (longer than every model's sliding window), text after it, a sample with two images, a text one
E2E_ROWS = [["00111111111100", "0110000111"], ["000000", "11111110"]]


def _e2e_model(model_type: str) -> transformers.PreTrainedModel:
    if model_type == "gemma3_text":
        return tiny_model("gemma3_text", attn="eager")
    model = build_tiny(model_type, {"sliding_window": 4} if model_type == "gemma4_text" else {})
    model.config._attn_implementation = "eager"
    return model


def _loss(logits: torch.Tensor, ids: torch.Tensor, total: int) -> torch.Tensor:
    """A sample's share of the token-mean next-token loss over ``total`` targets."""
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum") / total


def _scaled(got: dict, want: dict) -> float:
    """The largest gradient difference, relative to each parameter's largest gradient (absolute below 1)."""
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) / max(1.0, float(want[n].abs().max())) for n in want)


@pytest.mark.parametrize("model_type", E2E)
def test_a_tiny_gemma_packed_with_blocks_equals_each_sample_alone(model_type):
    """Logits and every gradient of a packed row through the decoder (padfree's attention, the layout's blocks)
    equal each sample run alone through transformers' eager attention with the mask the multimodal model builds for
    that sample; without the blocks, or with the other window composition, they do not."""
    rule = E2E[model_type]
    model = _e2e_model(model_type).train()
    model.config.attention_dropout = 0.0
    config = model.config
    seg, types, spans = packed_row(E2E_ROWS, 24)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, seg.shape, generator=gen)
    base = PackedLayout.from_segment_ids(seg)
    assert "sliding_attention" in config.layer_types[:config.num_hidden_layers]
    assert "full_attention" in config.layer_types[:config.num_hidden_layers]
    assert E2E_ROWS[0][0].count("1") > config.sliding_window  # the window cuts the image block

    total = sum(len(x) - 1 for *_, x in spans)
    model.zero_grad()
    alone = []
    for b, start, sample in spans:
        seq = ids[b:b + 1, start:start + len(sample)]
        logits = model(input_ids=seq, attention_mask=_own_masks(model_type, config, sample), use_cache=False).logits
        _loss(logits[0], seq[0], total).backward()
        alone.append(logits[0].detach())
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    register_backends()
    other = dataclasses.replace(BLOCK_RULES[rule], window_bounds_blocks=not BLOCK_RULES[rule].window_bounds_blocks)
    controls = {"no blocks": base, "other window composition": base.with_token_types(types, other)}
    for backend in ("padfree_sdpa", "padfree_eager"):
        config._attn_implementation = backend
        token = PACKED_FORWARD.set(True)
        try:
            for name, lay in {"blocks": base.with_token_types(types, rule), **controls}.items():
                model.zero_grad()
                logits = model(input_ids=ids, position_ids=base.position_ids, use_cache=False,
                               **{LAYOUT_KWARG: lay}).logits
                sum(_loss(logits[b, s:s + len(x)], ids[b, s:s + len(x)], total) for b, s, x in spans).backward()
                diff = max(float((logits[b, s:s + len(x)].detach() - a).abs().max())
                           for (b, s, x), a in zip(spans, alone, strict=True))
                grads = _scaled({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, want)
                if name == "blocks":
                    assert diff <= TOL and grads <= TOL, (backend, diff, grads)
                else:
                    assert diff > 1000 * TOL, (backend, name, diff)
        finally:
            PACKED_FORWARD.reset(token)
            config._attn_implementation = "eager"
