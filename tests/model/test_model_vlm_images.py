"""Images in packed rows of LLaVA-style vision-language models, exact: causal image tokens (padfree.model.images).

LLaVA, LLaVA-NeXT (anyres tiles and newline tokens), LLaVA-OneVision (its per-sample image counts), Idefics2 (a
perceiver per image), Idefics3 and SmolVLM (``(B, N, ...)`` tiles with ``pixel_attention_mask``), Mistral 3 (Pixtral:
padded images with ``image_sizes``), InternVL, Aya Vision, Cohere2 Vision, GOT-OCR2, DeepSeek-VL and LFM2-VL
(``spatial_shapes``) run their vision tower per image, put the features on the placeholder tokens in order, and give
their language model 1-D positions under a causal mask only. So a packed row — the samples' pixel inputs
concatenated in row order, the tokens side by side, positions restarting — is exact once padfree lets the inputs
through. :func:`padfree.proof.compare_images.prove_images` compares it with each sample alone (an image; text only; two
images, of different sizes where the model takes sizes): logits, the model's own loss, every gradient — the vision
tower's included — relative to its parameter's scale (fp32, 1e-5); its control (each sample's placeholders given
another sample's images) must be caught by the same comparison. Qwen2-VL (rope route) and Gemma3 (blocks route) run
through the same proof. Mllama (cross-attention to the row's images) is refused by name; PaliGemma's bidirectional
prefix is laid out per sample (tests/model/test_model_paligemma.py).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES  # noqa: E402

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError, PackingDisabledError  # noqa: E402
from padfree.model import images  # noqa: E402
from padfree.proof.compare import perturb  # noqa: E402
from padfree.proof.compare_images import prove_images, prove_images_in  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5


def _gemma3(cfg):
    cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id = 90, 91, 92
    cfg.mm_tokens_per_image = 4
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 64, 16


def _qwen2_vl(cfg):
    cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id = 90, 91, 92, 93
    text = cfg.get_text_config()
    half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
    text.rope_parameters = {**(text.rope_parameters or {}), "mrope_section": [half - 2 * (half // 3), half // 3,
                                                                              half // 3]}
    cfg.vision_config.depth, cfg.vision_config.out_hidden_size = 1, text.hidden_size


def _tiles(cfg):  # 4 x 4 patches: the pixel shuffle (scale 2) gives 4 tokens per image
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 64, 16


def _anyres(cfg):  # a resolution of whole tiles of the tower's 32-pixel images (2 x 2 tiles)
    cfg.image_grid_pinpoints = [[64, 64]]


# the tiny config's geometry made consistent where the shrunk defaults are not (the image geometry of the real
# checkpoints, scaled down)
FIXES = {"gemma3": _gemma3, "qwen2_vl": _qwen2_vl, "idefics2": _tiles, "idefics3": _tiles, "smolvlm": _tiles,
         "llava_next": _anyres, "llava_onevision": _anyres}
CAUSAL = ["llava", "llava_next", "llava_onevision", "idefics2", "idefics3", "smolvlm", "mistral3", "internvl",
          "aya_vision", "cohere2_vision", "got_ocr2", "deepseek_vl", "lfm2_vl",
          # a Qwen-style tower (patch rows and image_grid_thw) before a language model of 1-D positions: flat rows
          # (Exaone 4.5), rows convolved as patches (Kimi K2.5); tiles with a mask per tile (Granite Docling)
          "exaone4_5", "kimi_k25", "granite_docling"]


def tiny(model_type: str) -> transformers.PreTrainedModel:
    """The shrunk default config of ``model_type``'s vision-language class, its image geometry made consistent,
    every weight offset a little (no path silenced by a zero initialisation)."""
    cfg = shrink_config(default_config(model_type))
    FIXES.get(model_type, lambda c: None)(cfg)
    torch.manual_seed(0)
    cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
    try:
        model = cls._from_config(cfg, attn_implementation="sdpa")
    except ValueError:  # no sdpa (GOT-OCR2)
        model = cls._from_config(cfg, attn_implementation="eager")
    return perturb(model)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_a_packed_row_of_samples_with_images_is_exact(model_type):
    model = tiny(model_type)
    assert images.image_route(model) == "causal"
    proof = prove_images(model)
    assert proof.refused is None, proof.refused
    assert proof.logits <= ATOL and proof.loss <= ATOL and proof.grads <= ATOL, proof
    assert proof.image_grads > 0  # the tower's (and projector's) gradients compared too
    assert proof.control > 1e-3, proof  # the images in the wrong samples: the same comparison catches it
    assert proof.ok


@pytest.mark.parametrize(("model_type", "route"), [("qwen2_vl", "rope"), ("gemma3", "blocks")])
def test_the_proof_runs_the_other_routes(model_type, route):
    proof = prove_images(tiny(model_type))
    assert proof.route == route
    assert proof.ok, proof
    assert proof.control > 1e-3  # rope: positions that never restart; blocks: the images causal


def test_the_probe_samples_are_what_a_processor_returns():
    model = tiny("mistral3")
    one, text, two = images.probe_samples(model)
    token = model.config.image_token_id
    assert set(text) == {"input_ids"}
    assert one["pixel_values"].shape[0] == 1 and two["pixel_values"].shape[0] == 2
    assert two["image_sizes"][0].tolist() != two["image_sizes"][1].tolist()  # two sizes in one sample
    features = model.model.get_image_features(pixel_values=two["pixel_values"], image_sizes=two["image_sizes"])
    assert int((two["input_ids"] == token).sum()) == sum(f.shape[0] for f in features.pooler_output)
    row = images.pack_samples(model, [one, text, two])
    assert row["position_ids"][0].tolist() == [*range(one["input_ids"].shape[1]), *range(7),
                                               *range(two["input_ids"].shape[1])]
    assert torch.equal(row["pixel_values"], torch.cat([one["pixel_values"], two["pixel_values"]]))


def test_configure_packing_lets_the_images_of_a_causal_model_through():
    """The user's route: configure_packing, then a packed row with its images — each sample's logits as alone."""
    model = tiny("idefics3").eval()
    samples = images.probe_samples(model, seed=3)
    with torch.no_grad():
        want = torch.cat([model(**s, use_cache=False).logits[0] for s in samples])
        padfree.configure_packing(model)
        got = model(**images.pack_samples(model, samples), use_cache=False).logits[0]
    assert float((got - want).abs().max()) <= ATOL


def test_the_patch_grids_of_a_causal_model_go_through_in_row_order():
    """image_grid_thw on the causal route: every sample's grids concatenated as its patch rows are; the grids out of
    order (the first image's rows read with the second's grid) is caught by the same comparison."""
    model = tiny("exaone4_5").eval()
    samples = images.probe_samples(model, seed=1)
    assert [tuple(s["image_grid_thw"].shape) for s in samples if "image_grid_thw" in s] == [(1, 3), (2, 3)]
    with torch.no_grad():
        want = torch.cat([model(**s, use_cache=False).logits[0] for s in samples])
        padfree.configure_packing(model)
        row = images.pack_samples(model, samples)
        got = model(**row, use_cache=False).logits[0]
        assert float((got - want).abs().max()) <= ATOL
        swapped = {**row, "image_grid_thw": row["image_grid_thw"][[0, 2, 1]]}
        wrong = model(**swapped, use_cache=False).logits[0]
    assert float((wrong - want).abs().max()) > 1e-3


def test_an_input_the_causal_route_does_not_lay_out_is_refused():
    model = tiny("llava_onevision")
    padfree.configure_packing(model)
    one, text, two = images.probe_samples(model)
    row = images.pack_samples(model, [one, text, two])
    row["pixel_values_videos"] = torch.zeros(1, 1, 3, 32, 32)
    with pytest.raises(PackingDisabledError, match=r"non-text inputs .*pixel_values_videos"):
        model(**row, use_cache=False)


def _mllama_row():
    return {"input_ids": torch.tensor([[5, 95, 6, 7, 95, 8]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]),
            "pixel_values": torch.zeros(1, 2, 1, 3, 32, 32), "aspect_ratio_ids": torch.ones(1, 2, dtype=torch.long),
            "aspect_ratio_mask": torch.ones(1, 2, 1, dtype=torch.long),
            "cross_attention_mask": torch.ones(1, 6, 2, 1, dtype=torch.long)}


def test_cross_attention_to_the_rows_images_is_refused_by_name():
    model = tiny("mllama")
    assert images.image_route(model) is None and images.image_inputs(model) == frozenset()
    proof = prove_images(model)
    assert not proof.ok and proof.refused.startswith("MllamaTextCrossAttention: cross-attention from each token")
    padfree.configure_packing(model)
    with pytest.raises(PackingDisabledError, match=r"MllamaTextCrossAttention: cross-attention .* another sample's"):
        model(**_mllama_row(), use_cache=False)


def test_a_prefix_mask_built_above_the_language_model_is_laid_out_per_sample():
    model = tiny("paligemma")
    assert images.image_route(model) == "blocks"  # each sample's prefix a block of its own
    assert prove_images(model).ok


def test_images_under_bf16_autocast_are_proven_within_what_rounding_moves_each_sample():
    model = tiny("llava")
    proof = prove_images(model, precision="autocast_bf16")
    assert proof.ok, proof
    # the bound is rounding's own (three times what bf16 moves each sample alone), far above fp32's, and the
    # control — the images in the wrong samples — lands beyond it
    assert proof.tolerance > 10 * ATOL and proof.control > 10 * proof.tolerance
    assert proof.logits <= proof.tolerance and proof.grads <= proof.grad_tolerance
    with pytest.raises(InvalidArgumentError, match="precision must be one of"):
        prove_images(model, precision="fp16")


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
def test_both_precisions_in_one_call_are_the_proofs_of_two(model_type):
    # the sweep proves fp32 and bf16 autocast in one call sharing the fp32 runs alone and the install: each proof is
    # field for field the one its own call gives (the runs are deterministic on the CPU)
    model = tiny(model_type)
    both = prove_images_in(model, ("fp32", "autocast_bf16"))
    assert list(both) == ["fp32", "autocast_bf16"]
    for precision, proof in both.items():
        assert proof == prove_images(model, precision=precision), precision
        assert proof.ok and proof.control > proof.tolerance, proof
    with pytest.raises(InvalidArgumentError, match="precision must be one of"):
        prove_images_in(model, ("fp32", "fp16"))
