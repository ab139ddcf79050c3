"""Images and videos in packed rows of Qwen-VL-style models (mRoPE), exact (:mod:`padfree.model.mrope`).

A packed row holds several samples — images of different sizes, two images in one sample, a sample without any, a
video — with their pixel patches and grids concatenated in row order and ``position_ids`` restarting at 0 per
sample. padfree gives every sample the rotary positions it gets alone (its own ``get_rope_index``, its own grids) and
the row's boundaries to attention and GatedDeltaNet. Compared with each sample run alone through transformers: logits,
loss and every gradient, the vision tower's included (fp32, 1e-5). The control is what transformers does with the
same packed row by itself (rotary positions over the whole row, state and attention across samples).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: E402

import padfree  # noqa: E402
from padfree.errors import InvalidLayoutError, PackingDisabledError  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402
from zoo import each_alone, grad_diff, packed_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
IMAGE, VIDEO, START, END = 90, 91, 92, 93


def tiny_vlm(model_type: str) -> transformers.PreTrainedModel:
    """A tiny random Qwen-VL-style model: the shrunk default config, a one-block vision tower, rotary sections that
    give every axis a share of the head."""
    cfg = shrink_config(default_config(model_type))
    text = cfg.get_text_config()
    for key, value in dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                           vision_end_token_id=END).items():
        setattr(cfg, key, value)
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = dict(text.rope_parameters or {})
    rope["partial_rotary_factor"] = 1.0
    half = head // 2
    rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
    text.rope_parameters = rope
    if hasattr(text, "partial_rotary_factor"):
        text.partial_rotary_factor = 1.0
    vision = cfg.vision_config
    vision.depth = 1
    vision.out_hidden_size = text.hidden_size
    if model_type == "qwen2_5_vl":  # a window smaller than the larger images: the windowed tower path runs
        vision.window_size = vision.patch_size * vision.spatial_merge_size * 2
    torch.manual_seed(0)
    model = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])(cfg)
    return model.train()


def build_sample(model, parts, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One sample's processor-like outputs from ``parts``: ``("text", n)``, ``("image", (t, h, w))`` (a grid of
    patches) and ``("video", (t, h, w))`` (qwen3-style models: one run per frame, a start token between)."""
    vision = model.config.vision_config
    merge, patch = vision.spatial_merge_size, vision.patch_size
    width = vision.in_channels * vision.temporal_patch_size * patch * patch
    per_frame_runs = model.config.model_type not in ("qwen2_vl", "qwen2_5_vl")
    ids, types, pixels, grids, video, video_grids = [], [], [], [], [], []
    for kind, shape in parts:
        if kind == "text":
            ids += torch.randint(3, 80, (shape,), generator=g).tolist()
            types += [0] * shape
            continue
        t, h, w = shape
        frames = t if kind == "video" and per_frame_runs else 1
        per_run = t * h * w // (merge * merge) // frames
        code, token = (2, VIDEO) if kind == "video" else (1, IMAGE)
        for _ in range(frames):
            ids += [START, *[token] * per_run, END]
            types += [0, *[code] * per_run, 0]
        (video if kind == "video" else pixels).append(torch.randn(t * h * w, width, generator=g))
        (video_grids if kind == "video" else grids).append([t, h, w])
    out = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types])}
    if pixels:
        out.update(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids))
    if video:
        out.update(pixel_values_videos=torch.cat(video), video_grid_thw=torch.tensor(video_grids))
    return out


def pack(samples) -> dict[str, torch.Tensor]:
    """The samples as one packed row: tokens and token types side by side, position_ids restarting at 0, every
    vision tensor concatenated in sample order."""
    row = {"input_ids": torch.cat([s["input_ids"] for s in samples], 1),
           "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples], 1),
           "position_ids": torch.cat([torch.arange(s["input_ids"].shape[1]) for s in samples])[None]}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            row[key] = torch.cat(parts)
    return row


def packed(model, samples, **overrides):
    return packed_step(model, {**pack(samples), **overrides}, samples)


SAMPLES = {
    # two images of other sizes in one sample, a sample without images, one image
    "images": [[("text", 5), ("image", (1, 4, 4)), ("text", 6)], [("text", 7)],
               [("text", 4), ("image", (1, 2, 4)), ("text", 3), ("image", (1, 4, 2)), ("text", 2)]],
    # a video (two frames) beside an image
    "video": [[("text", 3), ("video", (2, 4, 4)), ("text", 4)], [("text", 2), ("image", (1, 4, 4)), ("text", 3)]],
}
CASES = [("qwen2_vl", "images"), ("qwen2_vl", "video"), ("qwen2_5_vl", "images"), ("qwen3_vl", "images"),
         ("qwen3_vl", "video"), ("qwen3_5", "images")]


@pytest.mark.parametrize(("model_type", "what"), CASES, ids=[f"{m}-{w}" for m, w in CASES])
def test_a_packed_row_of_samples_with_images_is_exact(model_type, what):
    model = tiny_vlm(model_type)
    g = torch.Generator().manual_seed(1)
    samples = [build_sample(model, parts, g) for parts in SAMPLES[what]]
    want, want_grads = each_alone(model, samples)
    stock, _ = packed(model, samples, position_ids=None)  # transformers on its own: one sequence per row
    padfree.configure_packing(model)
    got, grads = packed(model, samples)
    assert float((got - want).abs().max()) <= ATOL
    assert grad_diff(grads, want_grads) <= ATOL
    assert any(name.startswith(("model.visual", "visual")) for name in grads)  # the tower's gradients compared
    assert float((stock - want).abs().max()) > 1e-3  # the control: the row as one sequence leaks


def test_rotary_rows_passed_by_the_caller_must_be_each_samples_own():
    model = tiny_vlm("qwen2_vl")
    g = torch.Generator().manual_seed(1)
    samples = [build_sample(model, parts, g) for parts in SAMPLES["images"]]
    row = pack(samples)
    padfree.configure_packing(model)
    own = [model.model.get_rope_index(s["input_ids"], mm_token_type_ids=s["mm_token_type_ids"],
                                      image_grid_thw=s.get("image_grid_thw"))[0] for s in samples]
    rows = torch.cat([row["position_ids"][None], torch.cat(own, -1)])
    with torch.no_grad():
        given = model(**{**row, "position_ids": rows}, use_cache=False).logits
        computed = model(**row, use_cache=False).logits
    assert torch.equal(given, computed)
    whole, _ = model.model.get_rope_index(row["input_ids"], mm_token_type_ids=row["mm_token_type_ids"],
                                          image_grid_thw=row["image_grid_thw"])  # over the row: runs on
    with pytest.raises(InvalidLayoutError, match="not the rotary positions of the packed samples"):
        model(**{**row, "position_ids": torch.cat([row["position_ids"][None], whole])}, use_cache=False)


def test_images_without_their_token_types_are_refused():
    model = tiny_vlm("qwen2_vl")
    g = torch.Generator().manual_seed(1)
    row = pack([build_sample(model, parts, g) for parts in SAMPLES["images"]])
    padfree.configure_packing(model)
    del row["mm_token_type_ids"]
    with pytest.raises(PackingDisabledError, match="mm_token_type_ids"):
        model(**row, use_cache=False)


def test_a_data_loader_of_processor_outputs_packs_exact_rows():
    """The data path: processor-like samples through ``packed_collate_fn(carry=...)`` — rows of packed samples in the
    packer's order, token types laid out like the tokens, pixels and grids in row order — then the model: every
    sample's logits as alone."""
    model = tiny_vlm("qwen3_5")
    g = torch.Generator().manual_seed(2)
    parts = [*SAMPLES["images"], [("text", 3), ("image", (1, 2, 2)), ("text", 9)], [("text", 11)]]
    samples = [{k: v[0] if k in ("input_ids", "mm_token_type_ids") else v for k, v in build_sample(model, p, g).items()}
               for p in parts]
    lengths = [len(s["input_ids"]) for s in samples]
    collate = padfree.packed_collate_fn(max(lengths) + 12, carry=["mm_token_type_ids", "pixel_values",
                                                                  "image_grid_thw"])
    loader = torch.utils.data.DataLoader(samples, batch_size=len(samples), collate_fn=collate)
    batch = next(iter(loader))
    assert batch.batch_size > 1 and batch.sequence_ids.tolist() != list(range(len(samples)))  # reordered rows
    model.eval()
    with torch.no_grad():
        want = [model(**{k: (v[None] if k in ("input_ids", "mm_token_type_ids") else v) for k, v in s.items()},
                      use_cache=False).logits[0] for s in samples]
        padfree.configure_packing(model)
        out = model(**batch.model_inputs(include_labels=False)).logits
    starts = torch.cat([batch.seq_lens.new_zeros(1), batch.seq_lens.cumsum(0)])
    flat = batch.unpad(out)
    for piece, index in enumerate(batch.sequence_ids.tolist()):
        got = flat[starts[piece]:starts[piece + 1]]
        assert float((got - want[index]).abs().max()) <= ATOL


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_5"])
def test_images_under_bf16_autocast_are_exact_within_rounding(model_type):
    """fp32 weights under bf16 autocast: packed vs each sample alone within three times what rounding moves the
    per-sample run from fp32 (logits and gradients); the control — the row as one sequence — lands beyond it."""
    model = tiny_vlm(model_type)
    g = torch.Generator().manual_seed(1)
    samples = [build_sample(model, parts, g) for parts in SAMPLES["images"]]
    exact, exact_grads = each_alone(model, samples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = each_alone(model, samples)
        stock, _ = packed(model, samples, position_ids=None)
        padfree.configure_packing(model)
        got, grads = packed(model, samples)
    rounding = float((want.float() - exact).abs().max())
    grad_rounding = grad_diff(want_grads, exact_grads)
    assert rounding > 0 and float((got.float() - want.float()).abs().max()) <= 3 * rounding
    assert grad_diff(grads, want_grads) <= 3 * grad_rounding
    assert float((stock.float() - want.float()).abs().max()) > 3 * rounding
