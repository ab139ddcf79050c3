"""Images in packed rows of Gemma-style models, exact: each image a bidirectional block of its own sample.

Gemma3's image tokens attend to each other both ways inside their image (``token_type_ids == 1``), on every layer,
the sliding ones under their window. In a packed row padfree's mask functions build no mask, so the multimodal hook
puts the blocks on the forward's layout (each image intersected with its sample, :mod:`padfree.model.packed`) and
the packed attention applies them. Compared with each sample alone through transformers: logits, loss and every
gradient, the vision tower's included (fp32, 1e-5); the control is the same packed row with the blocks left out
(the images then causal), which the same comparison catches.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import padfree  # noqa: E402
from padfree.errors import PackingDisabledError  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402
from zoo import each_alone, packed_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
IMAGE, BOI, EOI = 90, 91, 92


def tiny_gemma3() -> transformers.PreTrainedModel:
    """A tiny Gemma3 vision-language model: 64-pixel images in 16-pixel patches, pooled to 4 tokens per image; a
    sliding layer (window 5, shorter than an image with its markers) and a full one."""
    cfg = shrink_config(default_config("gemma3"))
    cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id = IMAGE, BOI, EOI
    cfg.mm_tokens_per_image = 4
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 64, 16
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg).eval()


def build_sample(model, parts, g: torch.Generator) -> dict[str, torch.Tensor]:
    """``("text", n)`` and ``("image", None)`` parts: the image's tokens between its markers, token type 1."""
    vision = model.config.vision_config
    ids, types, pixels = [], [], []
    for kind, n in parts:
        if kind == "text":
            ids += torch.randint(3, 80, (n,), generator=g).tolist()
            types += [0] * n
        else:
            k = model.config.mm_tokens_per_image
            ids += [BOI, *[IMAGE] * k, EOI]
            types += [0, *[1] * k, 0]
            pixels.append(torch.randn(1, vision.num_channels, vision.image_size, vision.image_size, generator=g))
    out = {"input_ids": torch.tensor([ids]), "token_type_ids": torch.tensor([types])}
    if pixels:
        out["pixel_values"] = torch.cat(pixels)
    return out


SAMPLES = [[("text", 3), ("image", None), ("text", 4)], [("text", 6)],
           [("text", 2), ("image", None), ("text", 1), ("image", None), ("text", 3)]]


def _pack(samples, types=True):
    row = {"input_ids": torch.cat([s["input_ids"] for s in samples], 1),
           "position_ids": torch.cat([torch.arange(s["input_ids"].shape[1]) for s in samples])[None],
           "pixel_values": torch.cat([s["pixel_values"] for s in samples if "pixel_values" in s])}
    tt = torch.cat([s["token_type_ids"] for s in samples], 1)
    row["token_type_ids"] = tt if types else torch.zeros_like(tt)
    return row


def _relative(got, want) -> float:
    """The largest gradient difference relative to its parameter's largest gradient (at least 1): the projector's
    gradients reach thousands here, where fp32 rounds at 1e-4 absolute."""
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max()) / max(1.0, float(want[k].abs().max())) for k in want)


def _packed(model, samples, **kw):
    return packed_step(model, _pack(samples, **kw), samples)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_packed_row_of_gemma3_samples_with_images_is_exact(backend):
    model = tiny_gemma3()
    g = torch.Generator().manual_seed(1)
    samples = [build_sample(model, parts, g) for parts in SAMPLES]
    want, want_grads = each_alone(model, samples)
    padfree.configure_packing(model, backend=backend)
    got, grads = _packed(model, samples)
    assert float((got - want).abs().max()) <= ATOL
    assert _relative(grads, want_grads) <= ATOL
    assert any("vision_tower" in name for name in grads)  # the tower's gradients compared too
    leaky, _ = _packed(model, samples, types=False)  # the control: no blocks, the images causal
    assert float((leaky - want).abs().max()) > 1e-3


def test_images_need_their_token_types():
    model = tiny_gemma3()
    g = torch.Generator().manual_seed(1)
    row = _pack([build_sample(model, parts, g) for parts in SAMPLES])
    del row["token_type_ids"]
    padfree.configure_packing(model)
    with pytest.raises(PackingDisabledError, match="token_type_ids"):
        model(**row, use_cache=False)


def test_images_under_bf16_autocast_are_exact_within_rounding():
    """fp32 weights under bf16 autocast: packed vs each sample alone within three times what rounding moves the
    per-sample run from fp32; the control (no blocks) lands beyond it."""
    model = tiny_gemma3()
    g = torch.Generator().manual_seed(1)
    samples = [build_sample(model, parts, g) for parts in SAMPLES]
    exact, exact_grads = each_alone(model, samples)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = each_alone(model, samples)
        padfree.configure_packing(model)
        got, grads = _packed(model, samples)
        leaky, _ = _packed(model, samples, types=False)
    rounding = float((want.float() - exact).abs().max())
    assert rounding > 0 and float((got.float() - want.float()).abs().max()) <= 3 * rounding
    assert _relative(grads, want_grads) <= 3 * _relative(want_grads, exact_grads)
    assert float((leaky.float() - want.float()).abs().max()) > 3 * rounding


def tiny_gemma4() -> transformers.PreTrainedModel:
    """A tiny Gemma4 with a vision tower, its text config making images bidirectional (the shipped checkpoints'
    setting): images attend both ways within their block on the sliding layers."""
    from padfree.proof.compare import perturb

    d = default_config("gemma4").to_dict()
    d["vision_config"] = transformers.Gemma4VisionConfig().to_dict()
    d["text_config"]["use_bidirectional_attention"] = "vision"
    torch.manual_seed(0)
    return perturb(transformers.Gemma4ForConditionalGeneration(shrink_config(transformers.Gemma4Config.from_dict(d))))


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_a_packed_row_of_gemma4_samples_with_images_is_exact(backend):
    """Patches with their coordinates (each image padded to one patch budget), pooled to soft tokens; the blocks from
    mm_token_type_ids. The proof: logits, the model's own loss and every gradient (the tower's included) against each
    sample alone; its control (the blocks left out) caught."""
    from padfree.proof.compare_images import prove_images

    proof = prove_images(tiny_gemma4(), backend=backend)
    assert proof.route == "blocks" and proof.refused is None, proof
    assert proof.ok and proof.image_grads > 0 and proof.control > 1e-3, proof


def test_gemma4_images_through_configure_packing_are_proven_then_exact():
    """The user's route: configure_packing, then a packed row with images (proven on a tiny twin of this config at
    the first such batch) — each sample's logits as alone."""
    from padfree.model import images

    model = tiny_gemma4().eval()
    samples = images.probe_samples(model, seed=3)
    with torch.no_grad():
        want = torch.cat([model(**s, use_cache=False).logits[0] for s in samples])
        padfree.configure_packing(model)
        got = model(**images.pack_samples(model, samples), use_cache=False).logits[0]
    assert float((got - want).abs().max()) <= ATOL * max(1.0, float(want.abs().max()))
