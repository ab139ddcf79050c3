"""Mixed precision end to end: ``bf16=True`` (fp32 weights under CPU bf16 autocast, as the Trainer and TRL's
SFTConfig set it up) with padfree's Trainer and SFTTrainer, on a dense (llama) and a hybrid GatedDeltaNet model
(qwen3_5_text), real GSM8K text through the offline Mistral tokenizer.

One SGD step (lr 1) over 4 accumulated micro-batches must move the weights by minus the gradient of the unpacked
loss computed under the same autocast — within twice what bf16 rounding moves that reference from its fp32 value —
and a leaking control (the same rows with positions that never restart) must land beyond that tolerance.
"""

from __future__ import annotations

import copy
import itertools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

import padfree.integrations.sft as psft  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.trainer import Trainer  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator, pack_for_trainer  # noqa: E402
from padfree.step_loss import token_losses  # noqa: E402
from realdata import gsm8k_records  # noqa: E402

datasets.disable_progress_bars()
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def records():
    return gsm8k_records(64)


def build(model_type, vocab, seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, max_position_embeddings=1024, num_hidden_layers=2)
    if model_type == "qwen3_5_text":
        common.update(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                      linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"])
    config = transformers.AutoConfig.for_model(model_type, **common)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def segments(batch):
    """``[(row, start, end)]`` of every sequence of a batch, cut where ``position_ids`` restart."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        starts = [*torch.nonzero(batch["position_ids"][r] == 0).flatten().tolist(), batch["input_ids"].shape[1]]
        out += [(r, a, b) for a, b in itertools.pairwise(starts)]
    return out


def grads(model, batches, *, autocast, leak=False):
    """The gradient of Σ token losses / Σ targets over every sequence of ``batches``, each sequence run alone —
    or, ``leak``, each row run whole with positions that never restart."""
    model.zero_grad()
    total, count = 0.0, 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for batch in batches:
            if leak:
                ids = batch["input_ids"]
                pos = torch.arange(ids.shape[1]).expand_as(ids)
                loss, mask = token_losses(model(input_ids=ids, position_ids=pos).logits, batch)
                total, count = total + loss.sum(), count + int(mask.sum())
                continue
            for r, a, b in segments(batch):
                labels = batch["labels"][r:r + 1, a:b]
                loss, mask = token_losses(model(input_ids=batch["input_ids"][r:r + 1, a:b]).logits,
                                          {"labels": labels})
                total, count = total + loss.sum(), count + int(mask.sum())
    (total / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def flat(d, names):
    return torch.cat([d[n].float().reshape(-1) for n in names])


def check_update(model, before, reference, batches):
    """The trained update against minus the autocast reference gradient, with the rounding tolerance and the leak."""
    names = sorted(before)
    update = flat({n: before[n] - p.detach() for n, p in model.named_parameters()}, names)
    fp32 = flat(grads(copy.deepcopy(reference), batches, autocast=False), names)
    bf16 = flat(grads(copy.deepcopy(reference), batches, autocast=True), names)
    leaky = flat(grads(copy.deepcopy(reference), batches, autocast=True, leak=True), names)
    scale = fp32.norm()
    noise = float((bf16 - fp32).norm() / scale)
    tol = 2 * noise
    got = float((update - bf16).norm() / scale)
    leak = float((leaky - bf16).norm() / scale)
    assert 0 < noise < 0.05, noise  # autocast really ran in bf16, and rounding is rounding
    assert got <= tol, (got, tol)
    assert leak > tol, (leak, tol)  # the comparison can see a leak


def record_dtypes(model):
    """The dtypes the model's linear layers produce during training (bf16 under autocast)."""
    seen = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, a, out: seen.add(out.dtype))
    return seen


def sgd(**kwargs):
    return dict(max_steps=1, gradient_accumulation_steps=4, learning_rate=1.0, lr_scheduler_type="constant",
                optim="sgd", max_grad_norm=0.0, weight_decay=0.0, report_to="none", use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0, bf16=True, **kwargs)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_trainer_bf16_packed_rows_update_equals_unpacked_autocast(tok, records, tmp_path, model_type):
    samples = []
    for r in records[:40]:
        prompt = tok(r["instruction"])["input_ids"][:40]
        answer = [*tok(r["output"], add_special_tokens=False)["input_ids"][:40], tok.eos_token_id]
        samples.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    rows = pack_for_trainer(datasets.Dataset.from_list(samples[:24]), max_length=160)
    model = build(model_type, len(tok))
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=-(-len(rows) // 4),
                                          **sgd())
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PackedRowsCollator())
    assert trainer.args.bf16 and not trainer.args.fp16
    dtypes = record_dtypes(model)
    trainer.train()
    assert dtypes == {torch.bfloat16}  # the step really ran under bf16 autocast
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights: autocast did the bf16
    batches = list(trainer.get_train_dataloader())
    assert sum(len(segments(b)) for b in batches) > len(batches)  # really packed
    check_update(model, before, reference, batches)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_sft_trainer_bf16_padding_free_update_equals_unpacked_autocast(tok, records, tmp_path, model_type):
    ds = datasets.Dataset.from_list([{"prompt": r["instruction"] + "\n", "completion": r["output"]}
                                     for r in records[:12]])
    model = build(model_type, len(tok))
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = psft.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, max_length=96,
                          activation_checkpointing=False, logging_steps=1, **sgd())
    trainer = psft.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    assert packing_status(trainer).mode == "padding-free batching"
    dtypes = record_dtypes(model)
    trainer.train()
    assert dtypes == {torch.bfloat16}  # the step really ran under bf16 autocast
    batches = list(trainer.get_train_dataloader())
    assert all(len(segments(b)) > 1 for b in batches)
    check_update(model, before, reference, batches)
