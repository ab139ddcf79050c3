"""padfree.SFTTrainer on chat data: a real ``messages`` dataset (GSM8K turned into user / assistant turns) through the
default tokenizer's own chat template (:data:`padfree.corpus.CHAT_TEMPLATE`), with TRL's ``assistant_only_loss=True``
and ``padding_free=True``: the packed step's loss and every parameter's update equal TRL's own padded step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from padfree import corpus  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from realdata import gsm8k_records  # noqa: E402

datasets.disable_progress_bars()
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """The default tokenizer exactly as users get it (load_tokenizer), converted into a test's own cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PADFREE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return corpus.load_tokenizer()


def messages(n):
    return datasets.Dataset.from_list([
        {"messages": [{"role": "system", "content": "Solve the problem step by step."},
                      {"role": "user", "content": f"{r['instruction']}\n{r['input']}".strip()},
                      {"role": "assistant", "content": r["output"]}]}
        for r in gsm8k_records(n)])


def llama(tok):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config)


def one_sgd_step(cls, config_cls, tok, out, **kwargs):
    """One SGD step (lr 1, so the update is the gradient) over the first 4 conversations; the update of every
    parameter, the logged loss and the batch trained on."""
    model = llama(tok)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = config_cls(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, bf16=False, report_to="none",
                      save_strategy="no", max_length=512, use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
                      assistant_only_loss=True, learning_rate=1.0, lr_scheduler_type="constant", optim="sgd",
                      max_grad_norm=0.0, weight_decay=0.0, **kwargs)
    trainer = cls(model=model, args=args, train_dataset=messages(8), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    update = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return trainer, update, trainer.state.log_history[0]["loss"], batch


def test_assistant_only_loss_padding_free_step_equals_trls_padded_step(chat_tok, tmp_path):
    _ref, ref_update, ref_loss, padded = one_sgd_step(trl.SFTTrainer, trl.SFTConfig, chat_tok, tmp_path / "trl",
                                                     padding_free=False)
    trainer, update, loss, packed = one_sgd_step(padfree.SFTTrainer, padfree.SFTConfig, chat_tok, tmp_path / "pf",
                                                 padding_free=True)
    assert packing_status(trainer).mode == "padding-free batching"
    assert packed["input_ids"].shape[0] == 1 and padded["input_ids"].shape[0] == 4  # one row of 4 vs 4 padded rows
    # the same targets: the assistant turns only (each a GSM8K answer and its </s>), nothing of the prompts
    targets = packed["labels"][packed["labels"] != -100]
    assert torch.equal(targets, padded["labels"][padded["labels"] != -100])
    answers = {r["output"].strip() for r in gsm8k_records(8)}
    pieces = chat_tok.decode(targets).split("</s>")
    assert pieces[-1] == "" and len(pieces) == 5 and all(p.strip() in answers for p in pieces[:-1])
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    worst = max(float((update[n] - ref_update[n]).norm() / ref_update[n].norm()) for n in ref_update)
    assert worst <= 1e-5, worst

    # negative control: the same packed row through a model not configured for packing (stock sdpa: every token
    # attends across the sequence boundaries) is caught at this tolerance
    stock = llama(chat_tok)
    stock(input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=packed["labels"]).loss.backward()
    leak = max(float((p.grad - ref_update[n]).norm() / ref_update[n].norm()) for n, p in stock.named_parameters())
    assert leak > 1e-3, leak
