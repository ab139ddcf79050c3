"""PaliGemma and PaliGemma 2 in packed rows, exact: each sample's prefix a bidirectional block of its own.

PaliGemma is a prefix-LM: its language model's attention is built with ``is_causal=False`` (the text config's
``use_bidirectional_attention``) and made causal only by the mask ``PaliGemmaModel.forward`` builds from
``token_type_ids`` (0: the prefix of images and prompt, attending both ways; 1: the suffix, causal; PaliGemma 2's
sliding layers OR the prefix after the window). padfree lays the prefix out per sample on the forward's layout
(``BLOCK_RULES["paligemma"]``) and its packed attention accepts ``is_causal=False`` exactly when those blocks are
laid out. Positions: the model numbers a sample alone from 1 (``arange + 1``); a packed row restarts at 0 — the
rotary attention sees only their differences.

Without ``token_type_ids`` transformers itself computes a different attention for a sequence alone per backend (SDPA
drops the mask and attends both ways over the whole sequence; eager masks causally): such a packed row is refused
by name.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from padfree.errors import PackingDisabledError  # noqa: E402
from padfree.model import images  # noqa: E402
from padfree.model.install import install_packing, unconfigure_packing  # noqa: E402
from padfree.proof.compare import perturb  # noqa: E402
from padfree.proof.compare_images import prove_images  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5
# the backends each version runs on: transformers runs Gemma 2 (softcapping) on eager alone, no SDPA to wrap
BACKENDS = {1: ("sdpa", "eager"), 2: ("eager",)}


def tiny(version: int = 1) -> transformers.PaliGemmaForConditionalGeneration:
    """A tiny PaliGemma (Gemma language model, on SDPA) or PaliGemma 2 (Gemma 2: softcapping, sliding layers of a
    window of 4 tokens, shorter than every prefix below; eager, as transformers runs Gemma 2), its images 2 x 2
    patches of 14 pixels (4 image tokens)."""
    cfg = shrink_config(default_config("paligemma"))
    if version == 2:
        text = shrink_config(default_config("gemma2"))
        text.hidden_size, text.vocab_size, text.sliding_window = cfg.text_config.hidden_size, 96, 4
        text.use_bidirectional_attention = None  # PaliGemma 2's checkpoints leave it unset: the config sets True
        cfg = transformers.PaliGemmaConfig(text_config=text.to_dict(), vision_config=cfg.vision_config.to_dict(),
                                           image_token_id=cfg.image_token_id, projection_dim=cfg.projection_dim)
    cfg.vision_config.image_size = 28  # a whole number of patches (the shrunk 32 leaves 4 pixels unseen)
    cfg.text_config.num_image_tokens = (28 // cfg.vision_config.patch_size) ** 2
    torch.manual_seed(0)
    attn = "sdpa" if version == 1 else "eager"
    model = transformers.PaliGemmaForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    assert model.config.text_config.use_bidirectional_attention is True  # its attention: is_causal=False
    return perturb(model)


def _alone(model, samples):
    with torch.no_grad():
        return torch.cat([model(**s, use_cache=False).logits[0] for s in samples])


def _packed(model, row, backend):
    install_packing(model, backend=backend)
    try:
        with torch.no_grad():
            return model(**row, use_cache=False).logits[0]
    finally:
        unconfigure_packing(model)


def _off(got, want):
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.mark.parametrize(("version", "backend"), [(v, b) for v, bs in BACKENDS.items() for b in bs])
def test_a_packed_row_of_prefix_samples_is_exact(version, backend):
    """Three samples (an image, prefix and suffix; text alone; two images) as one row against each alone: logits,
    the loss, every gradient — the vision tower's included — within 1e-5 (fp32); the proof's control (every token
    in a prefix) caught."""
    model = tiny(version)
    assert images.image_route(model) == "blocks" and images.image_refusal(model) is None
    assert images.image_inputs(model) == {"pixel_values", "token_type_ids"}
    proof = prove_images(model, backend)
    assert proof.refused is None, proof.refused
    assert proof.logits <= ATOL and proof.loss <= ATOL and proof.grads <= ATOL, proof
    assert proof.image_grads > 0  # the SigLIP tower's and the projector's gradients compared
    assert proof.control > 1e-3, proof
    assert proof.ok


@pytest.mark.parametrize("version", [1, 2])
def test_the_prefix_left_out_or_crossing_samples_is_caught(version):
    """The controls: the prefixes made causal (no blocks), and the row run as one sequence (the prefixes of the
    samples one block, the samples attending to each other) — both far from each sample alone."""
    model = tiny(version).eval()
    samples = images.probe_samples(model, seed=1)
    want = _alone(model, samples)
    row = images.pack_samples(model, samples)
    backend = BACKENDS[version][0]
    assert _off(_packed(model, row, backend), want) <= ATOL
    causal = {**row, "token_type_ids": torch.ones_like(row["token_type_ids"])}
    assert _off(_packed(model, causal, backend), want) > 1e-3
    crossing = {**row, "position_ids": torch.arange(row["input_ids"].shape[1])[None]}
    with torch.no_grad():  # one sequence: no packed layout, transformers' own prefix mask over the whole row
        assert _off(model(**crossing, use_cache=False).logits[0], want) > 1e-3


@pytest.mark.parametrize("types", [0, 1], ids=["all prefix", "all suffix"])
@pytest.mark.parametrize("version", [1, 2])
def test_text_rows_whose_types_make_no_suffix_or_no_prefix_are_exact(version, types):
    """Text rows with token types of one kind: all prefix (no input padfree sees as non-text — the prefix is laid out
    all the same) and all suffix (no block at all — plain causal attention, which the types define)."""
    model = tiny(version).eval()
    samples = [{"input_ids": s["input_ids"], "token_type_ids": torch.full_like(s["input_ids"], types)}
               for s in images.probe_samples(model, seed=2)]
    want = _alone(model, samples)
    for backend in BACKENDS[version]:
        assert _off(_packed(model, images.pack_samples(model, samples), backend), want) <= ATOL


def test_a_text_row_without_token_types_is_refused_by_name():
    """Without token_type_ids transformers' own result for a sequence alone depends on the backend (SDPA: the mask
    dropped, both ways; eager: causal), so no packed row can be exact for the model as such: refused by name."""
    model = tiny(1).eval()
    text = [{"input_ids": s["input_ids"]} for s in images.probe_samples(model, seed=3)]
    sdpa = _alone(model, text)
    model.set_attn_implementation("eager")
    assert _off(_alone(model, text), sdpa) > 1e-3  # transformers' two answers
    for backend in ("sdpa", "eager"):
        install_packing(model, backend=backend)
        try:
            with pytest.raises(PackingDisabledError, match=r"GemmaAttention runs with is_causal=False "
                                                           r"\(bidirectional attention\).*pass token_type_ids"):
                model(**images.pack_samples(model, text), use_cache=False)
        finally:
            unconfigure_packing(model)


def test_configure_packing_accepts_paligemma_and_its_images_run_exact():
    """The user's route: the support table proves PaliGemma's text rows (with their token types) and its images;
    configure_packing accepts it, and a packed row with images equals each sample alone."""
    import padfree
    from padfree.model import images

    model = tiny(1).eval()
    samples = images.probe_samples(model, seed=4)
    with torch.no_grad():
        want = torch.cat([model(**s, use_cache=False).logits[0] for s in samples])
        report = padfree.configure_packing(model)
        got = model(**images.pack_samples(model, samples), use_cache=False).logits[0]
    assert report.supported
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
