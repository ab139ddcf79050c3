"""No silent path through a multimodal model: what a packed forward cannot see into is refused, and the position
spellings of multi-axis rotary models (mRoPE) are read as packed rows, never run as unpacked ones.

- Rotary rows ``(4, B, T)`` (text row first) and ``(3, B, T)`` (equal rows: text) that restart are packed rows: exact
  against each sequence alone, GatedDeltaNet state included; the stock model leaks on the same input (the control).
  Rotary rows that differ (an image's height and width rows) and go back are refused unless ``cu_seq_lens_q`` says
  where each sample starts, and then exact.
- A language model configured on its own inside a multimodal model that padfree did not configure is refused when a
  packed batch comes through the outer model (image features and positions are made outside padfree's view).
- A configured multimodal model refuses a packed batch carrying anything but text: pixel values, precomputed
  embeddings or encoder outputs, token types that mark image tokens — by any argument name.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import padfree  # noqa: E402
from padfree.errors import PackingDisabledError  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from zoo import grad_diff, packed_case, tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
ROWS = [[3, 9, 5], [6, 11]]


def _loss(logits, ids, spans):
    total = sum(n - 1 for *_, n in spans)
    return sum(torch.nn.functional.cross_entropy(logits[r, s:s + n - 1], ids[r, s + 1:s + n], reduction="sum")
               for r, s, n in spans) / total


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids, spans, **inputs):
    """Logits per span and the gradients of the token-mean loss of one forward."""
    model.zero_grad()
    logits = model(input_ids=ids, use_cache=False, **inputs).logits
    _loss(logits, ids, spans).backward()
    return [logits[r, s:s + n].detach() for r, s, n in spans], _grads(model)


def _alone(model, ids, spans, rows_of=None):
    """Each span run alone (its own rotary rows from ``rows_of(r, s, n)`` when given); logits and the gradients of
    the same token-mean loss."""
    model.zero_grad()
    total = sum(n - 1 for *_, n in spans)
    outs = []
    for r, s, n in spans:
        extra = {} if rows_of is None else {"position_ids": rows_of(r, s, n)}
        logits = model(input_ids=ids[r:r + 1, s:s + n], use_cache=False, **extra).logits
        (_loss(logits, ids[r:r + 1, s:s + n], [(0, 0, n)]) * (n - 1) / total).backward()
        outs.append(logits[0].detach())
    return outs, _grads(model)


def _worst(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("rows", [4, 3])
def test_rotary_rows_that_restart_are_a_packed_row(rows):
    """qwen3_5_text takes its positions as rotary rows too: ``(4, B, T)`` with the text row first, or ``(3, B, T)``
    (equal rows, text positions). Read as a packed row: exact, GatedDeltaNet reset per sequence. The stock model on
    the same input is the control (its state runs across the row)."""
    model = tiny_model("qwen3_5_text")
    ids, pos, spans = packed_case(model.config.vocab_size, ROWS, 1)
    rotary = pos[None].expand(rows, -1, -1)
    stock, _ = _step(model, ids, spans, position_ids=rotary)
    want, want_grads = _alone(model, ids, spans)
    padfree.configure_packing(model)
    got, grads = _step(model, ids, spans, position_ids=rotary)
    assert _worst(got, want) <= ATOL and grad_diff(grads, want_grads) <= ATOL
    assert _worst(stock, want) > 1e-3  # the control: read as one sequence per row, the row leaks


def _image_like_rows(n: int) -> torch.Tensor:
    """``(3, 1, n)`` rotary rows of one sample that differ and jump back inside it, as an image's height and width
    rows do: temporal = position, height = position // 4, width = position % 4."""
    p = torch.arange(n)
    return torch.stack([p, p // 4, p % 4])[:, None]


def test_rotary_rows_that_differ_need_cu_seq_lens_and_are_exact_with_them():
    model = tiny_model("qwen3_5_text")
    ids, _, spans = packed_case(model.config.vocab_size, [[7, 9, 5]], 1)
    rotary = torch.cat([_image_like_rows(n) for *_, n in spans], dim=-1)
    padfree.configure_packing(model)
    with pytest.raises(PackingDisabledError, match=r"rotary rows.*cu_seq_lens_q"):
        model(input_ids=ids, position_ids=rotary, use_cache=False)
    cu = torch.tensor([0, 7, 16, 21], dtype=torch.int32)
    got, grads = _step(model, ids, spans, position_ids=rotary, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=9, max_length_k=9)
    padfree.unconfigure_packing(model)
    want, want_grads = _alone(model, ids, spans, rows_of=lambda r, s, n: _image_like_rows(n))
    assert _worst(got, want) <= ATOL and grad_diff(grads, want_grads) <= ATOL
    # one sample per row whose rows never go back stays an ordinary batch: transformers' own code
    padfree.configure_packing(model)
    one = _image_like_rows(7)
    with torch.no_grad():
        out = model(input_ids=ids[:, :7], position_ids=one, use_cache=False).logits[0]
    assert float((out - want[0]).abs().max()) <= ATOL


def _tiny_qwen3_5_vl(seed: int = 0) -> transformers.PreTrainedModel:
    """A tiny Qwen3.5 vision-language model: GatedDeltaNet and attention layers, a one-block vision tower."""
    cfg = shrink_config(default_config("qwen3_5"))
    vision = cfg.vision_config
    vision.depth, vision.hidden_size, vision.num_heads, vision.intermediate_size = 1, 32, 2, 64
    vision.out_hidden_size, vision.patch_size, vision.num_position_embeddings = cfg.text_config.hidden_size, 4, 64
    for key, value in dict(image_token_id=90, video_token_id=91, vision_start_token_id=92,
                           vision_end_token_id=93).items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    return transformers.Qwen3_5ForConditionalGeneration(cfg).eval()


def _image_sample(model, text: int, grid: tuple[int, int, int], g: torch.Generator) -> dict:
    vision = model.config.vision_config
    t, h, w = grid
    n = t * h * w // vision.spatial_merge_size ** 2
    ids = [*torch.randint(3, 80, (text,), generator=g).tolist(), 92, *[90] * n, 93]
    types = [0] * text + [0] + [1] * n + [0]
    pixels = torch.randn(t * h * w, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2,
                         generator=g)
    return {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types]), "pixel_values": pixels,
            "image_grid_thw": torch.tensor([grid])}


def test_a_language_model_configured_alone_inside_a_multimodal_model_refuses_packed_batches():
    """``configure_packing(vlm.model.language_model)``: a packed batch through the whole (unconfigured) model would
    reach it with image features merged into its embeddings and positions it did not make — refused, with or
    without images; an ordinary batch still runs transformers' own code."""
    vlm = _tiny_qwen3_5_vl()
    g = torch.Generator().manual_seed(1)
    a, b = _image_sample(vlm, 5, (1, 4, 4), g), _image_sample(vlm, 4, (1, 2, 4), g)
    with torch.no_grad():
        plain = vlm(**a, use_cache=False).logits
    padfree.configure_packing(vlm.model.language_model)
    ids = torch.cat([a["input_ids"], b["input_ids"]], 1)
    rows = []
    for s in (a, b):
        rope, _ = vlm.model.get_rope_index(s["input_ids"], mm_token_type_ids=s["mm_token_type_ids"],
                                           image_grid_thw=s["image_grid_thw"])
        rows.append(torch.cat([torch.arange(s["input_ids"].shape[1])[None, None], rope]))
    packed = {"input_ids": ids, "mm_token_type_ids": torch.cat([a["mm_token_type_ids"], b["mm_token_type_ids"]], 1),
              "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]]),
              "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]]),
              "position_ids": torch.cat(rows, -1)}
    with pytest.raises(PackingDisabledError, match="configure the whole model"):
        vlm(**packed, use_cache=False)
    text_only = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    with pytest.raises(PackingDisabledError, match="configure the whole model"):
        vlm(input_ids=ids[:, :7], position_ids=text_only, use_cache=False)
    with torch.no_grad():
        assert torch.equal(vlm(**a, use_cache=False).logits, plain)


@pytest.fixture(scope="module")
def gemma3():
    model = build_tiny("gemma3")
    padfree.configure_packing(model)
    return model


@pytest.mark.parametrize("case", ["inputs_embeds", "mm_encoder_outputs", "an unknown tensor"])
def test_a_configured_multimodal_model_refuses_a_packed_batch_with_anything_but_text(gemma3, case):
    """Precomputed image features (merged embeddings, encoder outputs) and a tensor under a name padfree has never
    seen: each would reach layers that read them without padfree's boundaries."""
    ids = torch.randint(3, 90, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    hidden = gemma3.config.text_config.hidden_size
    inputs = {
        "inputs_embeds": {"inputs_embeds": torch.randn(1, 7, hidden)},
        "mm_encoder_outputs": {"input_ids": ids, "mm_encoder_outputs": torch.randn(1, 2, hidden)},
        "an unknown tensor": {"input_ids": ids, "patch_tokens": torch.randn(1, 2, hidden)},
    }[case]
    named = case.split()[-1] if case != "an unknown tensor" else "patch_tokens"
    with pytest.raises(PackingDisabledError, match=rf"non-text inputs \({named}"):
        gemma3(position_ids=pos, use_cache=False, **inputs)


def test_image_token_types_without_images_make_blocks_within_their_sample(gemma3):
    """Token types marking image tokens (no pixels): the model's own mask makes those tokens one bidirectional
    block; in a packed row each block stays inside its sample — exact against each sample alone."""
    ids = torch.randint(3, 90, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    types = torch.tensor([[0, 1, 1, 0, 1, 1, 0]])
    with torch.no_grad():
        out = gemma3(input_ids=ids, position_ids=pos, token_type_ids=types, use_cache=False).logits
        first = gemma3(input_ids=ids[:, :3], token_type_ids=types[:, :3], use_cache=False).logits
        second = gemma3(input_ids=ids[:, 3:], token_type_ids=types[:, 3:], use_cache=False).logits
        causal = gemma3(input_ids=ids[:, :3], use_cache=False).logits  # control: the same sample without its block
    alone = torch.cat([first, second], 1)
    assert float((out - alone).abs().max()) <= ATOL * max(1.0, float(alone.abs().max()))
    assert float((causal - first).abs().max()) > 1e-3


def test_text_token_types_of_zeros_are_text(gemma3):
    ids = torch.randint(3, 90, (1, 7))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        out = gemma3(input_ids=ids, position_ids=pos, token_type_ids=torch.zeros_like(ids), use_cache=False).logits
        alone = gemma3(input_ids=ids[:, 3:], use_cache=False).logits
    assert float((out[0, 3:] - alone[0]).abs().max()) <= ATOL * max(1.0, float(alone.abs().max()))
