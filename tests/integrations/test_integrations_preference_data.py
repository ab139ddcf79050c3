"""The datasets of padfree's DPO, reward and GRPO trainers, read through the front door
(:mod:`padfree.integrations.preference_data`): each fault is one error naming the trainer, the column, the row and
what is accepted; the rows a trainer drops are counted, warned about once and refused when they would be all.

Real ``datasets.Dataset`` objects (GSM8K text), mistral-common's SentencePiece tokenizer, tiny random-weight llama
models; every trainer is the real one (TRL's underneath). The rows TRL itself keeps are the reference for the drop
rule: padfree's trainer must keep exactly those.
"""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
pytest.importorskip("mistral_common")

import padfree  # noqa: E402
from padfree.errors import (  # noqa: E402
    InvalidArgumentError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
)
from padfree.integrations.decide import ENV_DISABLE_AUTO, ENV_RETURN_LOGITS  # noqa: E402
from padfree.integrations.dpo import DPOConfig, DPOTrainer, pack_pairs  # noqa: E402
from padfree.integrations.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from padfree.integrations.preference_data import DPO_DATA, GRPO_DATA, REWARD_DATA, check_dataset  # noqa: E402
from padfree.integrations.reward import RewardConfig, RewardTrainer  # noqa: E402
from padfree.proof.tiny import build_tiny  # noqa: E402
from realdata import gsm8k_records  # noqa: E402

datasets.disable_progress_bars()

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_DISABLE_AUTO, *ENV_RETURN_LOGITS):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def chat_tok(tok):
    """The Mistral tokenizer with a small chat template, for conversational rows."""
    tok = copy.deepcopy(tok)
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def records():
    return gsm8k_records(24)


def _pairs(records, n=4):
    return [{"prompt": r["instruction"][:80] + "\n", "chosen": " " + r["output"][:60],
             "rejected": " " + records[-1 - i]["output"][:40]} for i, r in enumerate(records[:n])]


def _messages(rows):
    return [{k: [{"role": "user" if k == "prompt" else "assistant", "content": v}] for k, v in r.items()}
            for r in rows]


def _lm(tok, seed=0):
    return build_tiny("llama", {"vocab_size": len(tok)}, seed=seed)


def _scorer(tok):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   num_labels=1)
    return transformers.LlamaForSequenceClassification(cfg)


BASE = dict(report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, bf16=False, max_steps=1,
            per_device_train_batch_size=1, logging_steps=1, seed=0, activation_checkpointing=False)


def _dpo(tok, out, train, eval_=None, model=None, **kw):
    """A DPOTrainer on fresh (policy, reference) models, or on ``model``: a shared (policy, reference) pair."""
    policy, ref = model or (_lm(tok), _lm(tok, seed=1))
    return DPOTrainer(model=policy, ref_model=ref,
                      args=DPOConfig(str(out), **{**BASE, **kw}), train_dataset=train, eval_dataset=eval_,
                      processing_class=tok)


def _reward(tok, out, train, eval_=None, model=None, **kw):
    return RewardTrainer(model=model or _scorer(tok), args=RewardConfig(str(out), **{**BASE, **kw}),
                         train_dataset=train, eval_dataset=eval_, processing_class=tok)


def _reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _grpo(tok, out, train, model=None, **kw):
    args = GRPOConfig(str(out), **{**BASE, "per_device_train_batch_size": 2, "num_generations": 2,
                                   "max_completion_length": 4, **kw})
    return GRPOTrainer(model=model or _lm(tok), reward_funcs=_reward_len, args=args, train_dataset=train,
                       processing_class=tok)


@pytest.fixture(scope="module")
def untouched(tok):
    """Models for the trainers that refuse their data: the refusal comes before anything touches the model."""
    return {"lm": _lm(tok), "pair": (_lm(tok), _lm(tok, seed=1)), "scorer": _scorer(tok)}


def _ds(rows):
    return datasets.Dataset.from_list(rows)


def _nothing():
    yield from ()


def _without(rows, column):
    return [{k: v for k, v in r.items() if k != column} for r in rows]


def _with(rows, i, **values):
    return [({**r, **values} if j == i else r) for j, r in enumerate(rows)]


# --------------------------------------------------------------------------------------------------
# 1. Each fault: one error naming the column, the row and what is accepted
# --------------------------------------------------------------------------------------------------

# (case, rows of the train set from the good pairs, error, what the message must say)
DPO_FAULTS = [
    ("missing chosen", lambda p: _ds(_without(p, "chosen")), InvalidSampleError,
     ["DPOTrainer: train_dataset has no 'chosen' column", "its columns: ['prompt', 'rejected']",
      "reads 'chosen' and 'rejected' as text"]),
    ("missing rejected, implicit prompt", lambda p: _ds(_without(_without(p, "rejected"), "prompt")),
     InvalidSampleError, ["no 'rejected' column", "optional 'prompt'"]),
    ("None chosen", lambda p: _ds(_with(p, 2, chosen=None)), InvalidSampleError,
     ["train_dataset[2]['chosen'] is None (1 of 4 rows are)", "text (str) or a list of {'role', 'content'}"]),
    ("None prompt", lambda p: _ds(_with(p, 3, prompt=None)), InvalidSampleError,
     ["train_dataset[3]['prompt'] is None"]),
    ("int prompt", lambda p: datasets.Dataset.from_dict({"prompt": [1, 2], "chosen": ["a", "b"],
                                                         "rejected": ["c", "d"]}), InvalidSampleError,
     ["train_dataset[0]['prompt'] = 1", "Arrow type int64", "text (str) or a list of"]),
    ("empty chosen text", lambda p: _ds(_with(p, 1, chosen="")), InvalidSampleError,
     ["train_dataset[1]['chosen'] is an empty string (1 of 4 rows are)", "filter those rows out"]),
    ("empty rejected messages", lambda p: _ds(_with(_messages(p), 2, rejected=[])), InvalidSampleError,
     ["train_dataset[2]['rejected'] is an empty list of messages"]),
    ("a None message", lambda p: _ds(_with(_messages(p), 1, chosen=[None])), InvalidSampleError,
     ["train_dataset[1]['chosen'] holds a None message"]),
    ("from/value messages", lambda p: _ds([{k: [{"from": "gpt", "value": v}] for k, v in r.items()} for r in p]),
     InvalidSampleError, ["have the keys ['from', 'value']", "{'role', 'content'}"]),
    ("text prompt, message completions", lambda p: _ds([{**m, "prompt": r["prompt"]}
                                                        for r, m in zip(p, _messages(p), strict=True)]),
     InvalidSampleError, ["text in ['prompt'] but lists of messages in ['chosen', 'rejected']"]),
    ("tokenized only", lambda p: _ds([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4]}] * 2),
     InvalidSampleError, ["no 'chosen' column but tokenized ones", "cannot train"]),
    ("no rows", lambda p: _ds(p).select([]), InvalidSampleError,
     ["DPOTrainer: train_dataset has no rows (columns ['prompt', 'chosen', 'rejected'])", "preference pair"]),
    ("a stream without rows", lambda p: datasets.IterableDataset.from_generator(_nothing), InvalidSampleError,
     ["train_dataset (a streamed IterableDataset) has no rows"]),
    ("a stream's first row", lambda p: _ds(_with(p, 0, chosen=None)).to_iterable_dataset(), InvalidSampleError,
     ["train_dataset[0]['chosen'] is None"]),
    ("not a dataset", lambda p: p, InvalidArgumentError,
     ["train_dataset must be a datasets.Dataset or datasets.IterableDataset, got"]),
]


@pytest.mark.parametrize(("case", "build", "error", "says"), DPO_FAULTS, ids=[c[0] for c in DPO_FAULTS])
def test_dpo_data_fault_is_one_error_naming_column_row_and_accepted(case, build, error, says, chat_tok, records,
                                                                   untouched, tmp_path):
    with pytest.raises(error) as info:
        _dpo(chat_tok, tmp_path, build(_pairs(records)), model=untouched["pair"])
    for text in says:
        assert text in str(info.value), str(info.value)
    assert "KeyError" not in str(info.value) and "capacity=" not in str(info.value)


def test_dpo_eval_dataset_faults_name_the_eval_split(tok, records, untouched, tmp_path):
    good = _ds(_pairs(records))
    with pytest.raises(InvalidSampleError, match=r"eval_dataset\[1\]\['rejected'\] is None"):
        _dpo(tok, tmp_path, good, eval_=_ds(_with(_pairs(records), 1, rejected=None)), model=untouched["pair"])
    with pytest.raises(InvalidSampleError, match=r"eval_dataset\['gsm8k'\] has no 'chosen' column"):
        _dpo(tok, tmp_path, good, eval_={"gsm8k": _ds(_without(_pairs(records), "chosen"))}, model=untouched["pair"])


REWARD_FAULTS = [
    ("missing rejected", lambda p: _ds(_without(p, "rejected")), InvalidSampleError,
     ["RewardTrainer: train_dataset has no 'rejected' column", "or tokenized 'chosen_ids' and 'rejected_ids'"]),
    ("None rejected", lambda p: _ds(_with(p, 1, rejected=None)), InvalidSampleError,
     ["train_dataset[1]['rejected'] is None (1 of 4 rows are)"]),
    ("empty chosen_ids", lambda p: _ds([{"chosen_ids": [5, 6], "rejected_ids": [7]},
                                        {"chosen_ids": [], "rejected_ids": [7]}]), InvalidSampleError,
     ["train_dataset[1]['chosen_ids'] is empty (1 of 2 rows are)", "non-empty list of integer token ids"]),
    ("None chosen_ids", lambda p: _ds([{"chosen_ids": [5, 6], "rejected_ids": [7]},
                                       {"chosen_ids": None, "rejected_ids": [7]}]), InvalidSampleError,
     ["train_dataset[1]['chosen_ids'] is None"]),
    ("text in rejected_ids", lambda p: _ds([{"chosen_ids": [5], "rejected_ids": ["a"]}] * 2), InvalidTokensError,
     ["RewardTrainer: train_dataset['rejected_ids'] must hold integer token ids", "list<item: string>"]),
    ("negative id", lambda p: _ds([{"chosen_ids": [5], "rejected_ids": [7]}, {"chosen_ids": [5, -3],
                                                                               "rejected_ids": [7]}]),
     InvalidTokensError, ["train_dataset[1]['chosen_ids'][1] = -3 is negative"]),
    ("id beyond the vocabulary", lambda p: _ds([{"chosen_ids": [5, 10**6], "rejected_ids": [7]}]),
     InvalidTokensError, ["train_dataset[0]['chosen_ids'][1] = 1000000 is not below the vocabulary size 32000"]),
    ("half a tokenized pair", lambda p: _ds([{"chosen_ids": [5, 6]}] * 2), InvalidSampleError,
     ["has ['chosen_ids'] but no 'rejected_ids' column", "need both of ['chosen_ids', 'rejected_ids']"]),
    ("None margin", lambda p: _ds([{**r, "margin": None if i == 2 else 0.5} for i, r in enumerate(p)]),
     InvalidSampleError, ["train_dataset[2]['margin'] is None", "a number"]),
    ("no rows", lambda p: datasets.Dataset.from_dict({"chosen": [], "rejected": []}), InvalidSampleError,
     ["RewardTrainer: train_dataset has no rows"]),
]


@pytest.mark.parametrize(("case", "build", "error", "says"), REWARD_FAULTS, ids=[c[0] for c in REWARD_FAULTS])
def test_reward_data_fault_is_one_error_naming_column_row_and_accepted(case, build, error, says, tok, records,
                                                                      untouched, tmp_path):
    with pytest.raises(error) as info:
        _reward(tok, tmp_path, build(_pairs(records)), model=untouched["scorer"])
    for text in says:
        assert text in str(info.value), str(info.value)


GRPO_FAULTS = [
    ("missing prompt", lambda p: _ds([{"question": r["prompt"]} for r in p]), InvalidSampleError,
     ["GRPOTrainer: train_dataset has no 'prompt' column (its columns: ['question'])",
      "'prompt' as text (str) or as a list of {'role', 'content'} messages"]),
    ("None prompt", lambda p: _ds([{"prompt": None if i == 1 else r["prompt"]} for i, r in enumerate(p)]),
     InvalidSampleError, ["train_dataset[1]['prompt'] is None (1 of 4 rows are)"]),
    ("int prompt", lambda p: datasets.Dataset.from_dict({"prompt": [1, 2, 3, 4]}), InvalidSampleError,
     ["train_dataset[0]['prompt'] = 1", "Arrow type int64"]),
    ("empty prompt", lambda p: _ds([{"prompt": "" if i == 3 else r["prompt"]} for i, r in enumerate(p)]),
     InvalidSampleError, ["train_dataset[3]['prompt'] is an empty string"]),
    ("empty messages", lambda p: _ds([{"prompt": [] if i == 0 else m["prompt"]} for i, m in enumerate(_messages(p))]),
     InvalidSampleError, ["train_dataset[0]['prompt'] is an empty list of messages"]),
    ("no rows", lambda p: datasets.Dataset.from_dict({"prompt": []}), InvalidSampleError,
     ["GRPOTrainer: train_dataset has no rows", "at least one prompt"]),
]


@pytest.mark.parametrize(("case", "build", "error", "says"), GRPO_FAULTS, ids=[c[0] for c in GRPO_FAULTS])
def test_grpo_data_fault_is_one_error_naming_column_row_and_accepted(case, build, error, says, chat_tok, records,
                                                                    untouched, tmp_path):
    with pytest.raises(error) as info:
        _grpo(chat_tok, tmp_path, build(_pairs(records)), model=untouched["lm"])
    for text in says:
        assert text in str(info.value), str(info.value)


def test_every_format_trl_trains_is_accepted(chat_tok, records, untouched, tmp_path):
    """Refuse only what TRL cannot train: explicit and implicit prompts, text and messages, an empty text prompt,
    tokenized (and legacy tokenized) reward pairs with a margin, streamed rows — each builds the real trainer (TRL's
    padded batches: the models stay untouched), and no row is counted as dropped."""
    pairs = _pairs(records)
    implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in pairs]
    lm, pair, scorer, off = untouched["lm"], untouched["pair"], untouched["scorer"], {"padding_free": False}
    built = [
        _dpo(chat_tok, tmp_path / "a", _ds(implicit), model=pair, **off),
        _dpo(chat_tok, tmp_path / "z", _ds(_with(pairs, 0, prompt="")), model=pair, **off),
        _dpo(chat_tok, tmp_path / "b", _ds(_messages(pairs)), model=pair, **off),
        _reward(chat_tok, tmp_path / "c", _ds([{"chosen_ids": [5, 6, 7], "rejected_ids": [8], "margin": 1}] * 2),
                model=scorer, **off),
        _reward(chat_tok, tmp_path / "d", _ds([{"chosen_input_ids": [5, 6], "rejected_input_ids": [8]}] * 2),
                model=scorer, **off),
        _reward(chat_tok, tmp_path / "e", _ds(_messages(pairs)).to_iterable_dataset(), model=scorer, **off),
        _grpo(chat_tok, tmp_path / "f", _ds([{"prompt": m["prompt"]} for m in _messages(pairs)]), model=lm, **off),
    ]
    assert [len(t.train_dataset) if isinstance(t.train_dataset, datasets.Dataset) else None for t in built] == [
        4, 4, 4, 2, 2, None, 4]
    assert all(padfree.packing_status(t).dropped == {} for t in built)
    formats = [check_dataset(_ds(implicit), DPO_DATA), check_dataset(_ds(_messages(pairs)), REWARD_DATA),
               check_dataset(_ds([{"prompt": m["prompt"]} for m in _messages(pairs)]), GRPO_DATA)]
    assert formats == ["text", "messages", "messages"]


# --------------------------------------------------------------------------------------------------
# 2. A pair longer than packing_length, in DPO's own terms
# --------------------------------------------------------------------------------------------------


def test_pair_longer_than_packing_length_is_named_in_dpo_terms(tok, records, tmp_path):
    pairs = _pairs(records)
    # rows 0 and 1: prompts that fill max_length=48 (TRL drops them); row 3: a pair longer than packing_length
    long_prompt = " ".join(r["instruction"] for r in records[5:9])
    rows = _with(_with(pairs, 0, prompt=long_prompt), 1, prompt=long_prompt)
    rows = _with(rows, 3, prompt="Q:", chosen=" " + records[3]["output"], rejected=" " + records[4]["output"])
    with pytest.raises(OverlongSequenceError) as info:
        _dpo(tok, tmp_path, _ds(rows), packing=True, packing_length=90, max_length=48)
    message = str(info.value)
    assert "DPOTrainer: train_dataset[3] is a pair of" in message  # the user's row, though rows 0 and 1 went
    assert "more than packing_length=90" in message and "each cut to max_length=48" in message
    assert "(1 of 2 pairs are longer)" in message and "raise packing_length to at least 96" in message
    assert "capacity" not in message and "overlong" not in message
    tokenized = datasets.Dataset.from_dict({"prompt_ids": [[1, 2], [3]], "chosen_ids": [[4], [5] * 30],
                                            "rejected_ids": [[6], [7]]})
    with pytest.raises(OverlongSequenceError, match=r"pack_pairs: dataset\[1\] is a pair of 33 tokens .* more than "
                                                    r"capacity=20") as info:
        pack_pairs(tokenized, capacity=20)
    assert "overlong" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# 3. Rows a trainer drops: counted, warned once, all-dropped refused
# --------------------------------------------------------------------------------------------------


def _long_pairs(records):
    """8 pairs: the first short (a few words each), the other 7 whole GSM8K answers (over 64 tokens)."""
    rows = [{"prompt": r["instruction"][:60] + "\n", "chosen": " " + r["output"], "rejected": " " + records[-1 - i][
        "output"]} for i, r in enumerate(records[:8])]
    rows[0] = {**rows[0], "chosen": " 42.", "rejected": " 41."}
    return rows


def _drop_warnings(caplog):
    return [r for r in caplog.records if r.name == "padfree" and r.levelno == logging.WARNING and "drops" in
            r.getMessage()]


def test_reward_pairs_over_max_length_are_counted_warned_once_and_training_runs_on_the_rest(tok, records, tmp_path,
                                                                                           caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    train = _ds(_long_pairs(records))
    reference = trl.RewardTrainer(model=_scorer(tok), args=trl.RewardConfig(str(tmp_path / "trl"), max_length=64,
                                                                            **BASE),
                                  train_dataset=train, processing_class=tok)
    ours = _reward(tok, tmp_path / "pf", train, max_length=64)
    status = padfree.packing_status(ours)
    assert status.dropped == {"train: longer than max_length": 7}
    assert "dropped 7 rows (train: longer than max_length)" in str(status)
    assert ours.train_dataset["chosen_ids"] == reference.train_dataset["chosen_ids"]  # TRL's rule, exactly
    assert len(ours.train_dataset) == 1
    warned = _drop_warnings(caplog)
    assert len(warned) == 1
    text = warned[0].getMessage()
    assert "RewardTrainer drops 7 of 8 rows of train_dataset (rows 1, 2, 3, 4, 5, 6, 7)" in text
    assert "longer than max_length=64" in text and "raise max_length to" in text and "filter the data" in text
    out = ours.train()
    assert out.global_step == 1 and torch.isfinite(torch.tensor(out.training_loss))
    assert len(_drop_warnings(caplog)) == 1  # not again while training


def test_dpo_pairs_whose_prompt_fills_max_length_are_counted_like_trl_drops_them(tok, records, untouched, tmp_path,
                                                                                 caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    long_prompt = " ".join(r["instruction"] for r in records[5:9])
    pairs = _pairs(records)
    rows = [{**r, "prompt": long_prompt} if i in (1, 2) else r for i, r in enumerate(pairs)]
    policy, ref = untouched["pair"]  # TRL's padded batches in both trainers: the models stay untouched
    reference = trl.DPOTrainer(model=policy, ref_model=ref, args=trl.DPOConfig(str(tmp_path / "trl"), max_length=48,
                                                                               **BASE),
                               train_dataset=_ds(rows), processing_class=tok)
    evals = _ds([{**r, "prompt": long_prompt} if i == 0 else r for i, r in enumerate(pairs)])
    ours = _dpo(tok, tmp_path / "pf", _ds(rows), eval_=evals, model=untouched["pair"], max_length=48,
                padding_free=False)
    assert padfree.packing_status(ours).dropped == {"train: prompt fills max_length": 2,
                                                    "eval: prompt fills max_length": 1}
    assert ours.train_dataset["prompt_ids"] == reference.train_dataset["prompt_ids"]
    warned = [r.getMessage() for r in _drop_warnings(caplog)]
    assert len(warned) == 2 and "DPOTrainer drops 2 of 4 rows of train_dataset (rows 1, 2)" in warned[0]
    assert "raise max_length to" in warned[0] and "eval_dataset (rows 0)" in warned[1]
    kept = _dpo(tok, tmp_path / "end", _ds(rows), model=untouched["pair"], max_length=48, truncation_mode="keep_end",
                padding_free=False)
    assert padfree.packing_status(kept).dropped == {} and len(kept.train_dataset) == 4


def test_all_rows_dropped_is_one_error_before_training(tok, records, untouched, tmp_path):
    long_rows = _long_pairs(records)[1:]
    with pytest.raises(InvalidArgumentError) as info:
        _reward(tok, tmp_path / "rw", _ds(long_rows), model=untouched["scorer"], max_length=64, padding_free=False)
    message = str(info.value)
    assert "RewardTrainer: max_length=64 drops every one of the 7 rows of train_dataset" in message
    assert "to keep one" in message and "to keep them all" in message and "num_samples" not in message
    long_prompt = " ".join(r["instruction"] for r in records[5:9])
    with pytest.raises(InvalidArgumentError, match=r"DPOTrainer: max_length=48 drops every one of the 4 rows of "
                                                   r"train_dataset: prompt alone fills max_length=48"):
        _dpo(tok, tmp_path / "dpo", _ds([{**r, "prompt": long_prompt} for r in _pairs(records)]),
             model=untouched["pair"], max_length=48, padding_free=False)


def test_a_streamed_dataset_counts_its_drops_as_it_is_read(tok, records, untouched, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    rows = _long_pairs(records)
    rows = rows[1:] + rows[:1]  # the one kept pair last
    ours = _reward(tok, tmp_path, _ds(rows).to_iterable_dataset(), model=untouched["scorer"], max_length=64,
                   padding_free=False)
    assert padfree.packing_status(ours).dropped == {}  # nothing read yet
    kept = list(ours.train_dataset)
    assert len(kept) == 1 and padfree.packing_status(ours).dropped == {"train: longer than max_length": 7}
    assert len(_drop_warnings(caplog)) == 1
