"""padfree.SFTTrainer on vision-language data: TRL's vision formats through a processor, padding-free and packed.

Tiny random-weight Qwen2-VL (mRoPE) and Gemma3 (bidirectional image blocks) models with real transformers processors
built offline (a character-level tokenizer with the models' image tokens and a chat template, the models' own image
processors) on images of several sizes, a sample without any and a sample with two. The reference is TRL's own
``SFTTrainer``: its vision collator's padded batch with its attention mask. padfree's step — one packed row per loader
batch, ``padding_free=True`` or ``packing=True`` — must give the same gradients before the optimizer step (fp32,
1e-5 relative to each parameter's largest gradient, the vision tower included), and the same comparison must catch a
row whose images are laid out wrong (token types zeroed: mRoPE positions or image blocks lost).
"""

from __future__ import annotations

import copy
import string

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
tokenizers = pytest.importorskip("tokenizers")

import padfree.integrations.sft as psft  # noqa: E402
from padfree.errors import UnsupportedModelError  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator, PackedVisionCollator  # noqa: E402
from padfree.proof.shrink import default_config, shrink_config  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402

datasets.disable_progress_bars()
pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5

# ---- tiny processors, offline ------------------------------------------------------------------------------------

QWEN_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
GEMMA_TOKENS = ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]


def template(image: str) -> str:
    """A chat template that writes ``image`` where a message holds an image."""
    return ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image +
            "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<eos>{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def char_tokenizer(special: list[str], chat_template: str, **named: str) -> transformers.PreTrainedTokenizerFast:
    """A character-level tokenizer (every printable character a token) with ``special`` tokens after ``<pad>``,
    ``<eos>`` and ``<unk>``: ids 3, 4, ..."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *special, *string.printable])}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="<eos>",
                                               extra_special_tokens=named or None)
    tok.add_special_tokens({"additional_special_tokens": special})
    tok.chat_template = chat_template
    return tok


class _Qwen2VLImagesProcessor(transformers.Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def qwen_processor() -> transformers.ProcessorMixin:
    chat = template("<|vision_start|><|image_pad|><|vision_end|>")
    tok = char_tokenizer(QWEN_TOKENS, chat)
    images = transformers.Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4,
                                                   merge_size=2, temporal_patch_size=2)
    return _Qwen2VLImagesProcessor(image_processor=images, tokenizer=tok, video_processor=None, chat_template=chat)


def gemma_processor() -> transformers.ProcessorMixin:
    chat = template("<start_of_image>")
    tok = char_tokenizer(GEMMA_TOKENS, chat, image_token=GEMMA_TOKENS[0], boi_token=GEMMA_TOKENS[1],
                         eoi_token=GEMMA_TOKENS[2])
    images = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return transformers.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=chat, image_seq_length=4)


# ---- tiny models matching them ------------------------------------------------------------------------------------


def tiny_qwen2_vl(vocab: int) -> transformers.PreTrainedModel:
    """Qwen2-VL: 4-pixel patches merged 2 x 2, a one-block tower, rotary sections over every axis."""
    cfg = shrink_config(default_config("qwen2_vl"))
    cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id = 3, 4, 5, 6
    text = cfg.get_text_config()
    text.vocab_size = vocab
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    half = head // 2
    text.rope_parameters = {**(text.rope_parameters or {}),
                            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    vision = cfg.vision_config
    vision.depth, vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size = 1, 4, 2, 2
    vision.in_channels, vision.out_hidden_size = 3, text.hidden_size
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def tiny_gemma3(vocab: int) -> transformers.PreTrainedModel:
    """Gemma3: 32-pixel images in 8-pixel patches pooled to 4 tokens; a sliding layer (window 5, shorter than an
    image with its markers) and a full one."""
    cfg = shrink_config(default_config("gemma3"))
    cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id = 3, 4, 5
    cfg.mm_tokens_per_image = 4
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 32, 8
    cfg.get_text_config().vocab_size = vocab
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(cfg)


MODELS = {"qwen2_vl": (qwen_processor, tiny_qwen2_vl), "gemma3": (gemma_processor, tiny_gemma3)}

# ---- TRL's vision formats -----------------------------------------------------------------------------------------


def _image(g, h, w):
    return Image.fromarray(g.integers(0, 255, (h, w, 3), dtype=np.uint8))


def _user(*parts):
    return [{"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                         for p in parts]}]


def _assistant(text):
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def vision_dataset(fmt: str) -> datasets.Dataset:
    """Four samples: one image, none, two images of other sizes, one more; ``messages`` or conversational
    ``prompt`` + ``completion``."""
    g = np.random.default_rng(0)
    rows = [([_image(g, 16, 16)], _user(None, "what is it?"), _assistant("noise")),
            ([], _user("hello"), _assistant("hi, all good here")),
            ([_image(g, 32, 16), _image(g, 24, 40)], _user(None, "and", None), _assistant("two of them")),
            ([_image(g, 40, 24)], _user("see", None), _assistant("a picture"))]
    if fmt == "messages":
        return datasets.Dataset.from_list([{"images": i, "messages": u + a} for i, u, a in rows])
    return datasets.Dataset.from_list([{"images": i, "prompt": u, "completion": a} for i, u, a in rows])


# ---- one training step, its gradients -----------------------------------------------------------------------------


class _Gradients(transformers.TrainerCallback):
    """The gradients the optimizer is about to apply."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def config(out, cls=psft.SFTConfig, **kwargs):
    # SGD without clipping: the update is -lr times these gradients
    base = dict(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, bf16=False, report_to="none",
                save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, optim="sgd", learning_rate=1e-2,
                max_grad_norm=0.0, activation_checkpointing=False, max_length=None)
    return cls(**{**base, **kwargs})


def step(trainer) -> dict[str, torch.Tensor]:
    grab = _Gradients(trainer.model)
    trainer.add_callback(grab)
    trainer.train()
    return grab.grads


def relative(got, want) -> float:
    """The largest gradient difference relative to its parameter's largest gradient."""
    assert got.keys() == want.keys()
    return max(float((got[k] - want[k]).abs().max()) / max(float(want[k].abs().max()), 1e-30) for k in want)


def zero_token_types(collator):
    """The control: the same packed rows with their token types zeroed — image tokens then take text positions
    (mRoPE) or causal attention (Gemma3's blocks)."""
    def collate(samples):
        batch = collator(samples)
        for key in ("mm_token_type_ids", "token_type_ids"):
            if key in batch:
                batch[key] = torch.zeros_like(batch[key])
        return batch
    return collate


@pytest.mark.parametrize("fmt", ["messages", "prompt_completion"])
@pytest.mark.parametrize("model_type", ["qwen2_vl", "gemma3"])
def test_padding_free_and_packing_equal_trls_padded_step(model_type, fmt, tmp_path):
    make_processor, make_model = MODELS[model_type]
    processor = make_processor()
    base = make_model(len(processor.tokenizer))
    ds = vision_dataset(fmt)
    want = step(trl.SFTTrainer(model=copy.deepcopy(base), args=config(tmp_path / "trl", trl.SFTConfig),
                               train_dataset=ds, processing_class=processor))
    assert any("vision" in name or "visual" in name for name in want)  # the tower's gradients compared too
    for setting in (dict(padding_free=True), dict(packing=True, max_length=512)):
        trainer = psft.SFTTrainer(model=copy.deepcopy(base), args=config(tmp_path / "padfree", **setting),
                                  train_dataset=ds, processing_class=processor)
        status = packing_status(trainer)
        assert status.enabled and not status.auto, status
        assert isinstance(trainer.data_collator, PackedVisionCollator)
        batch = next(iter(trainer.get_train_dataloader()))
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        assert int((batch["position_ids"][0] == 0).sum()) == len(ds)  # every sample in the one row
        assert relative(step(trainer), want) <= RTOL, setting
    control = psft.SFTTrainer(model=copy.deepcopy(base), args=config(tmp_path / "control", padding_free=True),
                              train_dataset=ds, processing_class=processor)
    control.data_collator = zero_token_types(control.data_collator)
    assert relative(step(control), want) > 1e-3


def test_automatic_padding_free_turns_on_for_images_padfree_lays_out(tmp_path):
    processor = qwen_processor()
    trainer = psft.SFTTrainer(model=tiny_qwen2_vl(len(processor.tokenizer)), args=config(tmp_path),
                              train_dataset=vision_dataset("messages"), processing_class=processor)
    status = packing_status(trainer)
    assert (status.mode, status.auto) == ("padding-free batching", True), status
    assert isinstance(trainer.data_collator, PackedVisionCollator)


def test_images_padfree_cannot_lay_out_are_skipped_or_refused(tmp_path):
    """Mllama's images (cross-attention from every token to its row's images): not put in packed rows by padfree —
    automatic padding-free is skipped naming the module, an explicit setting refused at construction (not at the
    first step)."""
    processor = qwen_processor()
    mllama = build_tiny("mllama", multimodal=True)
    ds = vision_dataset("messages")
    skipped = psft.SFTTrainer(model=mllama, args=config(tmp_path), train_dataset=ds, processing_class=processor)
    status = packing_status(skipped)
    assert (status.mode, status.auto) == ("standard batching", True)
    assert "the images of MllamaForConditionalGeneration in packed rows: MllamaTextCrossAttention" in status.reason
    assert not isinstance(skipped.data_collator, PackedVisionCollator)
    for setting in (dict(padding_free=True), dict(packing=True, max_length=512)):
        with pytest.raises(UnsupportedModelError, match="with images: padfree does not put the images of Mllama"):
            psft.SFTTrainer(model=mllama, args=config(tmp_path, **setting), train_dataset=ds,
                            processing_class=processor)
    # a model TRL loads by name is judged once loaded
    mllama.save_pretrained(tmp_path / "mllama")
    by_name = psft.SFTTrainer(model=str(tmp_path / "mllama"), args=config(tmp_path), train_dataset=ds,
                              processing_class=processor)
    assert "MllamaTextCrossAttention" in packing_status(by_name).reason
    assert not packing_status(by_name).enabled and not isinstance(by_name.data_collator, PackedVisionCollator)
    with pytest.raises(UnsupportedModelError, match="padding_free=True with images: padfree does not put"):
        psft.SFTTrainer(model=str(tmp_path / "mllama"), args=config(tmp_path, padding_free=True), train_dataset=ds,
                        processing_class=processor)


def test_a_vision_language_model_on_text_trains_padding_free(tmp_path):
    """A VLM with a processor on text-only data: automatic padding-free, TRL's tokenized rows packed by padfree's
    collator, the step TRL's padded step."""
    processor = gemma_processor()
    base = tiny_gemma3(len(processor.tokenizer))
    ds = datasets.Dataset.from_list([{"prompt": p, "completion": c} for p, c in
                                     [("2 + 2 =", " 4"), ("the sky is", " blue, mostly"), ("hi", " there, friend")]])
    want = step(trl.SFTTrainer(model=copy.deepcopy(base), args=config(tmp_path / "trl", trl.SFTConfig),
                               train_dataset=ds, processing_class=processor))
    trainer = psft.SFTTrainer(model=copy.deepcopy(base), args=config(tmp_path / "padfree"), train_dataset=ds,
                              processing_class=processor)
    status = packing_status(trainer)
    assert (status.mode, status.auto) == ("padding-free batching", True), status
    assert isinstance(trainer.data_collator, PackedRowsCollator)
    assert relative(step(trainer), want) <= RTOL
