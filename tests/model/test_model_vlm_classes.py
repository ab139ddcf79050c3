"""Vision-language classes through ``configure_packing``: accepted where the language model inside can be made exact
(the support table's ``multimodal`` section, or a certification), the towers left on their own attention.

The sweep (``tests/proof/test_model_sweep.py``) proves every such class on text rows; these tests pin what the sweep
relies on: the class is accepted, padfree's backend reaches the language model and no tower, undoing restores every
sub-config's own implementation, and a text-only packed row through the whole model is exact.
"""

from __future__ import annotations

import pytest
import torch

import padfree
from padfree.errors import InvalidLayoutError, UnsupportedModelError
from padfree.proof.tiny import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def _implementations(model) -> dict[str, str]:
    config = model.config
    return {"top": config._attn_implementation, "text": config.get_text_config()._attn_implementation,
            "vision": config.vision_config._attn_implementation}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava", "idefics3"])
def test_a_vision_language_class_is_configured_on_its_language_model_only(model_type):
    model = build_tiny(model_type, multimodal=True)
    model.set_attn_implementation({"": "sdpa", "text_config": "sdpa", "vision_config": "eager"})
    report = padfree.configure_packing(model)
    assert report.supported and report.proof.startswith("support table"), report.proof
    assert _implementations(model) == {"top": report.backend, "text": report.backend, "vision": "eager"}
    padfree.unconfigure_packing(model)
    assert _implementations(model) == {"top": "sdpa", "text": "sdpa", "vision": "eager"}


def test_a_text_only_packed_row_through_a_qwen2_vl_class_is_exact():
    """Restarting 2-D positions: the model's mRoPE takes them on all three axes, the boundaries come from them."""
    model = build_tiny("qwen2_vl", multimodal=True).train()
    padfree.configure_packing(model)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 80, (1, 6), generator=g), torch.randint(3, 80, (1, 9), generator=g)
    ids, pos = torch.cat([a, b], 1), torch.cat([torch.arange(6), torch.arange(9)])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=pos).logits
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
        leaking = model(input_ids=ids, position_ids=torch.arange(15)[None]).logits  # control: one sequence
    assert float((packed - alone).abs().max()) <= 1e-5
    assert float((leaking - alone).abs().max()) > 1e-3


def test_an_encoder_decoder_vision_class_is_refused_as_one():
    model = build_tiny("florence2", multimodal=True)
    with pytest.raises(UnsupportedModelError, match="Florence2ForConditionalGeneration is an encoder-decoder"):
        padfree.configure_packing(model)


SPELLINGS = {
    "position_ids": lambda: {"position_ids": torch.cat([torch.arange(6), torch.arange(9)])[None]},
    "seq_lens": lambda: {"seq_lens": torch.tensor([6, 9])},
    "cu_seq_lens": lambda: {"cu_seq_lens_q": torch.tensor([0, 6, 15]), "cu_seq_lens_k": torch.tensor([0, 6, 15]),
                            "max_length_q": 9, "max_length_k": 9},
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2_vl", "qwen3_vl", "qwen3_5", "llava"])
def test_every_boundary_spelling_of_a_text_row_is_exact(model_type, spelling):
    """Boundaries as restarting positions, as lengths or as flash offsets: an mRoPE model gets positions that
    restart per sample on every rotary axis (it would count them over the whole row, as one sample, from lengths
    alone), and ``seq_lens`` is read, not passed by unnoticed (it was: 0.74 off through Qwen3-VL, 0.79 through
    llama)."""
    model = build_tiny(model_type, multimodal=model_type != "llama").eval()
    padfree.configure_packing(model)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 80, (1, 6), generator=g), torch.randint(3, 80, (1, 9), generator=g)
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), **SPELLINGS[spelling]()).logits
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
        leaking = model(input_ids=torch.cat([a, b], 1)).logits  # control: the row as one sequence
    assert float((packed - alone).abs().max()) <= 1e-5
    assert float((leaking - alone).abs().max()) > 1e-3


def test_lengths_that_do_not_cover_the_row_are_refused_by_name():
    model = build_tiny("llama")
    padfree.configure_packing(model)
    with pytest.raises(InvalidLayoutError, match=r"seq_lens = \[6, 8\] does not lay out the 1 x 15 tokens"):
        model(input_ids=torch.randint(3, 80, (1, 15)), seq_lens=torch.tensor([6, 8]))


def test_embeddings_as_wide_as_the_row_are_not_a_mask():
    """``inputs_embeds`` of shape (B, T, hidden) with hidden == T looks like a (B, T, T) mask by shape alone: it is
    token data, run exactly (it was refused as "a 3-D mask")."""
    model = build_tiny("llama").eval()
    padfree.configure_packing(model)
    width = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, width, width, generator=g)
    pos = torch.cat([torch.arange(24), torch.arange(width - 24)])[None]
    with torch.no_grad():
        packed = model(inputs_embeds=embeds, position_ids=pos).logits
        alone = torch.cat([model(inputs_embeds=embeds[:, :24]).logits, model(inputs_embeds=embeds[:, 24:]).logits], 1)
    assert float((packed - alone).abs().max()) <= 1e-5


def test_images_are_let_through_only_where_proven():
    """A route read from the model's structure is not a proof: Qwen4-Exp lays its images out like Qwen3.5 (mRoPE),
    but a packed row with images differs from its samples alone (its n-gram embeddings run on across samples), so
    configure_packing's hook refuses its images, naming why; its text rows stay exact. The proof is asked once."""
    from padfree.errors import PackingDisabledError
    from padfree.model import images
    from padfree.model.state import packing_state

    model = build_tiny("qwen4_exp", multimodal=True)
    assert images.image_route(model) == "rope"
    padfree.configure_packing(model)
    row = images.pack_samples(model, images.probe_samples(model))
    for _ in range(2):
        with pytest.raises(PackingDisabledError, match=r"Qwen4ExpForConditionalGeneration, whose images padfree lays "
                                                       r"out per sample but has not proven exact: .*differs"):
            model(**row, use_cache=False)
    assert packing_state(model).images["why"] is not None


@pytest.mark.parametrize("model_type", ["qwen2_vl", "llava"])
def test_a_packed_row_with_images_entering_the_inner_model_is_laid_out_there(model_type):
    """``model.model(...)`` — what a fused LM head's ``base_model`` call or a user runs — with a packed row of images
    bypasses the outer class: the inner multimodal model lays the images out too (Qwen2-VL's images got text
    positions there: 1.87 off through DPO). Hidden states of the packed row vs each sample alone."""
    from padfree.model import images

    model = build_tiny(model_type, multimodal=True).eval()
    samples = images.probe_samples(model, seed=2)
    with torch.no_grad():
        want = torch.cat([model.model(**s, use_cache=False).last_hidden_state[0] for s in samples])
        padfree.configure_packing(model)
        row = images.pack_samples(model, samples)
        got = model.model(**row, use_cache=False).last_hidden_state[0]
        whole = torch.arange(row["input_ids"].shape[1])[None]  # control: the row as one sequence
        leaking = model.model(**{**row, "position_ids": whole}, use_cache=False).last_hidden_state[0]
    assert float((got - want).abs().max()) <= 1e-5
    assert float((leaking - want).abs().max()) > 1e-3


def test_unproven_images_entering_the_inner_model_are_refused():
    from padfree.errors import PackingDisabledError
    from padfree.model import images

    model = build_tiny("qwen4_exp", multimodal=True)
    padfree.configure_packing(model)
    row = images.pack_samples(model, images.probe_samples(model))
    with pytest.raises(PackingDisabledError, match="Qwen4ExpModel, whose images padfree lays out per sample but has "
                                                   "not proven exact"):
        model.model(**row, use_cache=False)
