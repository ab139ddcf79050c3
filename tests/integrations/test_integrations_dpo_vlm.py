"""padfree.DPOTrainer on vision-language preference data: TRL's ``images`` + ``prompt`` / ``chosen`` / ``rejected``
through a processor, every pair's chosen and rejected sequence in one packed row.

Tiny random-weight Qwen2-VL (mRoPE) and Gemma3 (bidirectional image blocks) models with the offline processors of
``test_integrations_vlm``. TRL's vision preference collator pads the batch ``[chosen..., rejected...]`` and hands
the images in that order (each pair's images twice); padfree's forward packs the tokens and their token types
(``mm_token_type_ids`` / ``token_type_ids``) into one row and passes the images on as they are. The reference is
TRL's own ``DPOTrainer`` on its padded batch, with a reference model that differs from the policy (so the reference
forward counts too): one step's gradients must be equal (fp32, 1e-5 relative to each parameter's largest gradient,
the vision tower included), and the same comparison must catch the row with its token types zeroed.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

import padfree  # noqa: E402
from padfree.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from padfree.integrations.dpo import DPOConfig, DPOTrainer  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.unpadded import unpadded_forwards  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from test_integrations_vlm import MODELS, config, qwen_processor, relative, step, zero_token_types  # noqa: E402

datasets.disable_progress_bars()
pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5


def image(g, h, w):
    return Image.fromarray(g.integers(0, 255, (h, w, 3), dtype=np.uint8))


def turn(role, *parts):
    return [{"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                       for p in parts]}]


def preference_dataset() -> datasets.Dataset:
    """Four pairs: one image, none, two images of other sizes, one more (``None``: where a prompt shows an image);
    chosen and rejected of different lengths."""
    g = np.random.default_rng(0)
    rows = [([image(g, 16, 16)], (None, "what is it?"), "noise", "a cat, maybe"),
            ([], ("hello",), "hi, all good here", "go away"),
            ([image(g, 32, 16), image(g, 24, 40)], (None, "and", None), "two of them", "one"),
            ([image(g, 40, 24)], ("see", None), "a picture", "nothing at all here")]
    return datasets.Dataset.from_list([
        {"images": images, "prompt": turn("user", *parts), "chosen": turn("assistant", chosen),
         "rejected": turn("assistant", rejected)}
        for images, parts, chosen, rejected in rows])


def reference_of(model):
    """A reference model that is not the policy: its log-probs weigh every pair's gradient differently."""
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g) * p.abs().mean())
    return ref


def rows_seen(model) -> list[int]:
    """The batch sizes the language model runs (one packed row: 1), recorded from its calls."""
    seen: list[int] = []

    def record(module, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        seen.append(int((embeds if embeds is not None else kwargs["input_ids"]).shape[0]))

    model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
    return seen


@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
def test_padding_free_dpo_with_images_equals_trls_padded_step(model_type, tmp_path):
    make_processor, make_model = MODELS[model_type]
    processor = make_processor()
    base = make_model(len(processor.tokenizer))
    ref = reference_of(base)
    ds = preference_dataset()
    want = step(trl.DPOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(ref),
                               args=config(tmp_path / "trl", trl.DPOConfig), train_dataset=ds,
                               processing_class=processor))
    assert any("vision" in name or "visual" in name for name in want)  # the tower's gradients compared too
    for setting, auto in ((dict(), True), (dict(padding_free=True), False)):
        trainer = DPOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(ref),
                             args=config(tmp_path / "padfree", DPOConfig, **setting), train_dataset=ds,
                             processing_class=processor)
        status = packing_status(trainer)
        assert (status.mode, status.auto) == ("padding-free batching", auto), status
        seen = rows_seen(trainer.model)
        assert relative(step(trainer), want) <= RTOL, setting
        assert seen and set(seen) == {1}  # the 8 sequences ran as one row
    control = DPOTrainer(model=copy.deepcopy(base), ref_model=copy.deepcopy(ref),
                         args=config(tmp_path / "control", DPOConfig, padding_free=True), train_dataset=ds,
                         processing_class=processor)
    control.data_collator = zero_token_types(control.data_collator)
    assert relative(step(control), want) > 1e-3


def test_dpo_images_padfree_cannot_lay_out_are_skipped_or_refused(tmp_path):
    """Mllama's images (cross-attention from every token to its row's images) are not put in packed rows: automatic
    padding-free is skipped naming the module, an explicit setting refused at construction; packing pairs across the
    dataset needs TRL's tokenized pairs, which image data never becomes."""
    processor = qwen_processor()
    mllama = build_tiny("mllama", multimodal=True)
    ds = preference_dataset()
    skipped = DPOTrainer(model=mllama, ref_model=copy.deepcopy(mllama), args=config(tmp_path, DPOConfig),
                         train_dataset=ds, processing_class=processor)
    status = packing_status(skipped)
    assert (status.mode, status.auto) == ("standard batching", True)
    assert "the images of MllamaForConditionalGeneration in packed rows: MllamaTextCrossAttention" in status.reason
    with pytest.raises(UnsupportedModelError, match="padding_free=True with images: padfree does not put the images "
                                                    "of Mllama"):
        DPOTrainer(model=mllama, ref_model=copy.deepcopy(mllama), args=config(tmp_path, DPOConfig, padding_free=True),
                   train_dataset=ds, processing_class=processor)
    qwen = MODELS["qwen2_vl"][1](len(processor.tokenizer))
    with pytest.raises(InvalidArgumentError, match="packing=True with images"):
        DPOTrainer(model=qwen, ref_model=copy.deepcopy(qwen), args=config(tmp_path, DPOConfig, packing=True),
                   train_dataset=ds, processing_class=processor)


def test_token_types_not_laid_out_like_the_tokens_are_refused():
    """A token-type column that is not one value per token cannot be packed like the tokens: refused by name (the
    model would otherwise read image blocks or mRoPE types off the wrong tokens)."""
    model = build_tiny("llama")
    padfree.configure_packing(model)
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    with unpadded_forwards(model), pytest.raises(InvalidArgumentError, match=r"token_type_ids is .* not one value per"):
        model(input_ids=ids, attention_mask=(ids > 0).long(), token_type_ids=torch.zeros(2, 3, dtype=torch.long))
