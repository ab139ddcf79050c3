"""padfree.SFTTrainer evaluation: ``eval_packing`` and the eval loss, with the real ``trl.SFTTrainer`` on real GSM8K
records tokenized offline with the Mistral 7B SentencePiece vocabulary, and a tiny random-weight llama on the CPU.

``eval_packing`` (TRL's option) decides whether the eval set is packed: None follows ``packing``, False never packs,
True packs even in padding-free mode. Whatever it says, ``trainer.evaluate()`` must report the loss of every eval
sequence run alone through the same weights: Σ token losses / Σ targets over the whole eval set (with
``padfree_loss="sequence"``, the mean of the per-sequence means) — not the Trainer's mean of per-batch means,
which changes with packing and the eval batch size.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
mistral_common = pytest.importorskip("mistral_common")

import padfree.integrations.sft as psft  # noqa: E402
from padfree.errors import InvalidArgumentError  # noqa: E402
from padfree.step_loss import token_losses  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import tiny_model  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_LENGTH = 128
EVAL_BATCH = 3  # several eval batches of unequal target counts: a mean of batch means would be off
# the 22 shortest of the first 1000 records (about 50-75 tokens: rows of 128 hold two) and 2 long ones (200+
# tokens, cut to max_length before packing: TRL's "bfd" truncation)
SHORT, LONG = 22, (9, 17)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (psft.ENV_DISABLE_AUTO, *psft.ENV_RETURN_LOGITS):
        monkeypatch.delenv(name, raising=False)


def prompt_completion(records):
    return datasets.Dataset.from_list([{"prompt": f"{r['instruction']}\n{r['input']}".rstrip() + "\n",
                                        "completion": r["output"]} for r in records])


@pytest.fixture(scope="module")
def data():
    records = gsm8k_records(1000)
    short = sorted(range(len(records)), key=lambda i: len(records[i]["instruction"] + records[i]["output"]))[:SHORT]
    keep = sorted({*short, *LONG})
    return prompt_completion(records[:8]), prompt_completion([records[i] for i in keep])


def model_for(tok):
    # a wider initialisation than the default makes per-sequence losses differ, so a wrong weighting shows
    return tiny_model("llama", seed=0, vocab_size=len(tok), initializer_range=0.2)


@pytest.fixture(scope="module")
def reference(tok, data, tmp_path_factory):
    """``[(Σ token losses, targets, tokens)]`` of every eval sequence as TRL tokenizes it (prompt masked, cut to
    max_length), each run alone through an unconfigured model with the trainers' weights."""
    model = model_for(tok)
    args = trl.SFTConfig(output_dir=str(tmp_path_factory.mktemp("plain")), report_to="none", use_cpu=True,
                         bf16=False, activation_checkpointing=False, max_length=MAX_LENGTH)
    tokenized = trl.SFTTrainer(model=model_for(tok), args=args, train_dataset=data[1],
                               processing_class=tok).train_dataset
    out = []
    with torch.no_grad():
        for row in tokenized:
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
            loss, mask = token_losses(model(input_ids=ids).logits, {"labels": labels})
            out.append((float(loss.sum()), int(mask.sum()), ids.shape[1]))
    assert len(out) == len(data[1]) and max(n for _, _, n in out) == MAX_LENGTH  # the long ones were cut
    return out


def token_mean(reference):
    return sum(s for s, _, _ in reference) / sum(c for _, c, _ in reference)


def sequence_mean(reference):
    return sum(s / c for s, c, _ in reference) / len(reference)


def build(tok, data, out, mode, eval_dataset=True, compute_metrics=None, **kwargs):
    """A trainer in ``mode``: ``"packing"``, ``"padding_free"`` or ``"standard"`` (``padding_free=False``)."""
    base = dict(output_dir=str(out), report_to="none", use_cpu=True, bf16=False, activation_checkpointing=False,
                save_strategy="no", disable_tqdm=True, max_length=MAX_LENGTH, per_device_eval_batch_size=EVAL_BATCH,
                seed=0)
    setting = {"padding_free": False} if mode == "standard" else {mode: True}
    args = psft.SFTConfig(**{**base, **setting, **kwargs})
    return psft.SFTTrainer(model=model_for(tok), args=args, train_dataset=data[0],
                           eval_dataset=data[1] if eval_dataset else None, processing_class=tok,
                           compute_metrics=compute_metrics)


def rel(a, b):
    return abs(a - b) / abs(b)


def test_a_mean_of_batch_means_would_be_wrong(reference):
    """The negative control: the Trainer's own number (the mean of per-batch token means, unpacked batches of
    ``EVAL_BATCH`` sequences) is far from the token mean, so the tests below can tell the two apart."""
    batches = [reference[i:i + EVAL_BATCH] for i in range(0, len(reference), EVAL_BATCH)]
    naive = sum(token_mean(b) for b in batches) / len(batches)
    assert rel(naive, token_mean(reference)) > 1e-3
    assert rel(sequence_mean(reference), token_mean(reference)) > 1e-3


@pytest.mark.parametrize("eval_packing", [None, True, False])
@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_eval_loss_is_the_token_mean_of_the_eval_set(tok, data, reference, tmp_path, mode, eval_packing):
    trainer = build(tok, data, tmp_path, mode, eval_packing=eval_packing)
    packed = eval_packing is True or (eval_packing is None and mode == "packing")
    rows = trainer.eval_dataset
    assert ("seq_lens" in rows.column_names) is packed
    if packed:  # every eval sequence, cut to max_length, packed two to a row
        assert len(rows) < len(reference)
        assert sorted(n for lens in rows["seq_lens"] for n in lens) == sorted(n for _, _, n in reference)
    else:
        assert len(rows) == len(reference) and "position_ids" not in rows.column_names
    loss = trainer.evaluate()["eval_loss"]
    assert rel(loss, token_mean(reference)) <= 1e-5, (mode, eval_packing, loss, token_mean(reference))


def test_standard_batching_eval_loss_is_the_token_mean_too(tok, data, reference, tmp_path):
    """padfree's loss rule holds for TRL's own padded batches as well (``padding_free=False``)."""
    trainer = build(tok, data, tmp_path, "standard")
    assert trainer.eval_dataset.column_names[-2:] == ["input_ids", "labels"] and len(trainer.eval_dataset) == 24
    loss = trainer.evaluate()["eval_loss"]
    assert rel(loss, token_mean(reference)) <= 1e-5, (loss, token_mean(reference))


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_sequence_loss_eval_is_the_mean_of_sequence_means(tok, data, reference, tmp_path, mode):
    """``padfree_loss="sequence"``: the mean over the eval set of every sequence's mean token loss — also when
    ``compute_metrics`` makes the Trainer ask ``compute_loss`` for the outputs (``return_outputs=True``)."""
    seen = []

    def metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {}

    trainer = build(tok, data, tmp_path, mode, padfree_loss="sequence", compute_metrics=metrics)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    result = trainer.evaluate()
    loss = result["eval_loss"]
    assert seen and seen[0][-1] == len(tok)  # the logits reached compute_metrics
    assert rel(loss, sequence_mean(reference)) <= 1e-5, (mode, loss, sequence_mean(reference))
    batches = len(trainer.get_eval_dataloader())
    assert len(forwards) == batches  # one forward per eval batch: the logits it made also gave the loss
    # the metrics TRL logs agree with those of its fused head (the path without compute_metrics)
    fused = build(tok, data, tmp_path / "fused", mode, padfree_loss="sequence").evaluate()
    assert fused["eval_loss"] == pytest.approx(loss, rel=1e-5)
    for key in ("eval_entropy", "eval_mean_token_accuracy"):
        assert result[key] == pytest.approx(fused[key], rel=1e-4, abs=1e-6), key


def test_evaluate_prepares_and_packs_a_dataset_passed_to_it(tok, data, reference, tmp_path):
    """``evaluate(eval_dataset=...)`` tokenizes and packs a raw dataset the way ``__init__`` does, and a second
    call on the already packed dataset gives the same loss."""
    trainer = build(tok, data, tmp_path, "packing", eval_dataset=False)
    first = trainer.evaluate(eval_dataset=data[1])["eval_loss"]
    assert rel(first, token_mean(reference)) <= 1e-5
    packed = trainer._prepare_dataset(data[1], tok, trainer.args, True, None, "eval")
    assert "seq_lens" in packed.column_names and len(packed) < len(reference)
    assert trainer.evaluate(eval_dataset=packed)["eval_loss"] == pytest.approx(first, rel=1e-9)


def test_an_eval_set_named_train_is_not_the_train_set(tok, data, reference, tmp_path):
    """TRL names each eval set of a dict by its key: a key "train" must neither be packed by the train rule nor
    replace the train set's plan."""
    from padfree import packing_status

    plain = build(tok, data, tmp_path / "plain", "packing", eval_dataset=False)
    base = dict(output_dir=str(tmp_path / "dict"), report_to="none", use_cpu=True, bf16=False,
                activation_checkpointing=False, save_strategy="no", disable_tqdm=True, max_length=MAX_LENGTH,
                per_device_eval_batch_size=EVAL_BATCH, seed=0, packing=True, eval_packing=False)
    trainer = psft.SFTTrainer(model=model_for(tok), args=psft.SFTConfig(**base), train_dataset=data[0],
                              eval_dataset={"train": data[1], "other": data[1]}, processing_class=tok)
    assert packing_status(trainer).rows == packing_status(plain).rows  # the train plan, not the eval set's
    assert "seq_lens" in trainer.train_dataset.column_names
    for name in ("train", "other"):
        assert "seq_lens" not in trainer.eval_dataset[name].column_names  # eval_packing=False holds for both
        assert len(trainer.eval_dataset[name]) == len(reference)
    loss = trainer.evaluate()
    assert rel(loss["eval_train_loss"], token_mean(reference)) <= 1e-5


def test_eval_packing_in_padding_free_mode_reads_packing_strategy_and_max_length(tok, data, reference, tmp_path):
    """Padding-free training never read ``packing_strategy`` nor needed ``max_length``; packing the eval set does."""
    split = build(tok, data, tmp_path / "split", "padding_free", eval_packing=True, packing_strategy="bfd_split")
    lens = [n for row in split.eval_dataset["seq_lens"] for n in row]
    assert max(lens) == MAX_LENGTH and len(lens) > len(reference)  # the long sequences became pieces, not cut
    with pytest.raises(InvalidArgumentError, match=r"eval_packing=True packs the eval dataset into rows of "
                                                   r"max_length tokens.*got max_length=None"):
        build(tok, data, tmp_path / "none", "padding_free", eval_packing=True, max_length=None)
    with pytest.raises(InvalidArgumentError, match=r"packing_strategy='tightest' .* is not one padfree packs exactly"):
        build(tok, data, tmp_path / "unknown", "padding_free", eval_packing=True, packing_strategy="tightest")
    # TRL's wrapped rows, exact: every row of the eval set full but the last, every cut piece a sequence of its own
    wrapped = build(tok, data, tmp_path / "wrapped", "padding_free", eval_packing=True, packing_strategy="wrapped")
    widths = [sum(row) for row in wrapped.eval_dataset["seq_lens"]]
    assert all(w == MAX_LENGTH for w in widths[:-1]) and sum(widths) == sum(lens)  # every token, as bfd_split


@pytest.mark.parametrize("loss_rule", ["token", "sequence"])
@pytest.mark.parametrize("packed", [True, False])
def test_padfree_trainer_eval_loss_follows_the_loss_rule(tok, data, reference, tmp_path, loss_rule, packed):
    """``padfree.Trainer`` (the plain HF Trainer with padfree's collator) reports the same eval loss as the
    per-sequence reference, on packed rows and on unpacked samples flattened padding-free."""
    from padfree.integrations.trainer import Trainer
    from padfree.integrations.trainer_data import PackedRowsCollator, pack_for_trainer

    rows = datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in _tokenized(tok, data, tmp_path)],
                                       "labels": [r["labels"] for r in _tokenized(tok, data, tmp_path)]})
    if packed:
        rows = pack_for_trainer(rows, MAX_LENGTH)
        assert len(rows) < len(reference)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True,
                                          per_device_eval_batch_size=EVAL_BATCH, disable_tqdm=True,
                                          remove_unused_columns=False)
    trainer = Trainer(model=model_for(tok), args=args, eval_dataset=rows, data_collator=PackedRowsCollator(),
                      padfree_loss=loss_rule)
    loss = trainer.evaluate()["eval_loss"]
    expected = token_mean(reference) if loss_rule == "token" else sequence_mean(reference)
    assert rel(loss, expected) <= 1e-5, (loss_rule, packed, loss, expected)


_TOKENIZED: dict = {}


def _tokenized(tok, data, tmp_path):
    """The eval records as TRL tokenizes them (prompt masked, cut to max_length), as the reference saw them."""
    if "rows" not in _TOKENIZED:
        args = trl.SFTConfig(output_dir=str(tmp_path / "tok"), report_to="none", use_cpu=True, bf16=False,
                             activation_checkpointing=False, max_length=MAX_LENGTH)
        _TOKENIZED["rows"] = list(trl.SFTTrainer(model=model_for(tok), args=args, train_dataset=data[1],
                                                 processing_class=tok).train_dataset)
    return _TOKENIZED["rows"]


# --------------------------------------------------------------------------------------------------
# Two data-parallel ranks (gloo)
# --------------------------------------------------------------------------------------------------


def _ddp_worker(rank, world, tmp, port, tok, data):
    """One rank: ``packing=True``, the eval set packed; evaluate a whole number of rounds of ``world`` x
    ``EVAL_BATCH`` rows, then one row fewer (accelerate repeats rows to even the ranks' last batches)."""
    import logging
    import pickle
    import warnings

    from multiproc import as_launched_rank

    warnings.filterwarnings("ignore")
    as_launched_rank(rank, world, port)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("padfree").addHandler(handler)
    logging.getLogger("padfree").setLevel(logging.INFO)
    trainer = build(tok, data, f"{tmp}/out", "packing")
    rows = trainer.eval_dataset
    rounds = len(rows) - len(rows) % (world * EVAL_BATCH)
    exact, uneven = rows.select(range(rounds)), rows.select(range(rounds - 1))
    out = {"rows": exact[:], "exact": trainer.evaluate(eval_dataset=exact)["eval_loss"],
           "uneven": trainer.evaluate(eval_dataset=uneven)["eval_loss"], "world": trainer.accelerator.num_processes,
           "messages": messages}
    with open(f"{tmp}/rank{rank}.pkl", "wb") as f:
        pickle.dump(out, f)


@pytest.mark.slow
def test_two_ranks_add_up_the_eval_loss(tok, data, tmp_path):
    """Under data parallelism the ranks' sums are added up: the eval loss is the token mean of every eval sequence
    (each run alone here); when accelerate has to repeat rows, the Trainer's number is kept and the reason logged."""
    from multiproc import free_port, run_ranks

    model_for(tok)  # warm-up that both forked children inherit
    ranks = run_ranks(_ddp_worker, tmp_path, free_port(), tok, data, deadline=150)
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["exact"] == ranks[1]["exact"]
    rows = ranks[0]["rows"]
    model = model_for(tok)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, lens in zip(rows["input_ids"], rows["labels"], rows["seq_lens"], strict=True):
            start = 0
            for n in lens:
                loss, mask = token_losses(model(input_ids=torch.tensor([ids[start:start + n]])).logits,
                                          {"labels": torch.tensor([labels[start:start + n]])})
                total, count, start = total + float(loss.sum()), count + int(mask.sum()), start + n
    assert len(rows["input_ids"]) % (2 * EVAL_BATCH) == 0
    assert rel(ranks[0]["exact"], total / count) <= 1e-5, (ranks[0]["exact"], total / count)
    assert all(any("eval_loss is the Trainer's mean of per-batch means" in m and "accelerate repeats some rows" in m
                   for m in r["messages"]) for r in ranks)
