"""``padfree analyze`` and ``padfree pack`` on chat data: a ``messages`` column and prompt-completion columns through
the tokenizer's chat template, labels only on the assistant turns; the errors in the command's own flags."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")
pytest.importorskip("mistral_common")

from padfree import corpus  # noqa: E402
from padfree.cli import main  # noqa: E402
from realdata import gsm8k_records  # noqa: E402


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tok():
    return corpus.load_tokenizer()


@pytest.fixture(scope="module")
def records():
    return [{"prompt": f"{r['instruction']}\n{r['input']}".strip(), "completion": r["output"]}
            for r in gsm8k_records(12)]


def conversation(r):
    return [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]


def write(path, rows):
    path.write_text(json.dumps(rows))
    return path


def sequences(out):
    """``[(input_ids, labels)]`` of every sequence of a packed arrow output, in record order."""
    found = {}
    for row in datasets.load_from_disk(str(out)):
        start = 0
        for record, n in zip(row["sequence_ids"], row["seq_lens"], strict=True):
            found[record] = (row["input_ids"][start:start + n], row["labels"][start:start + n])
            start += n
    return [found[i] for i in sorted(found)]


@pytest.mark.parametrize("layout", ["messages", "prompt-completion --chat", "conversational prompt-completion"])
def test_pack_chat_labels_only_the_assistant_turns(tmp_path, capsys, tok, records, layout):
    if layout == "messages":
        rows, flags = [{"messages": conversation(r)} for r in records], []
    elif layout == "prompt-completion --chat":
        rows, flags = records, ["--chat"]
    else:
        rows, flags = [{"prompt": conversation(r)[:1], "completion": conversation(r)[1:]} for r in records], []
    data, out = write(tmp_path / "chat.json", rows), tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", 1024, "--quiet", *flags,
                            "--columns", "input_ids,labels,seq_lens,sequence_ids")
    assert code == 0, err
    assert "through the tokenizer's chat template" in " ".join(stdout.split())
    got = sequences(out)
    assert len(got) == len(records)
    for r, (ids, labels) in zip(records, got, strict=True):
        assert ids == tok.apply_chat_template(conversation(r), tokenize=True, return_dict=True)["input_ids"]
        assert tok.decode([t for t in labels if t != -100]).strip() == r["completion"].strip() + "</s>"
        assert labels[0] == -100 and labels.count(-100) > 10  # the prompt is masked


def test_pack_text_prompt_completion_trains_on_the_completion(tmp_path, capsys, tok, records):
    code, stdout, err = run(capsys, "pack", write(tmp_path / "pc.json", records), "-o", tmp_path / "packed",
                            "--capacity", 1024, "--quiet", "--columns", "input_ids,labels,seq_lens,sequence_ids")
    assert code == 0, err
    assert "prompt 'prompt', then completion 'completion' (the only targets)" in " ".join(stdout.split())
    _ids, labels = sequences(tmp_path / "packed")[0]
    assert tok.decode([t for t in labels if t != -100]).strip() == records[0]["completion"].strip()


def test_analyze_measures_conversations_through_the_template(tmp_path, capsys, tok, records):
    data = write(tmp_path / "chat.json", [{"messages": conversation(r)} for r in records])
    code, stdout, err = run(capsys, "analyze", data, "--capacity", 1024, "--strategies", "obfd", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    want = [len(tok.apply_chat_template(conversation(r), tokenize=True, return_dict=True)["input_ids"])
            for r in records]
    assert report["stats"]["total_tokens"] == sum(want) and report["stats"]["max"] == max(want)
    assert "conversations of column 'messages'" in report["lengths"]


def test_chat_errors_name_the_flags_and_stop_early(tmp_path, capsys, records):
    text = write(tmp_path / "text.json", [{"text": "hello"}])
    chat = write(tmp_path / "chat.json", [{"messages": conversation(r)} for r in records * 100])
    out = tmp_path / "out"
    cases = [
        (["pack", text, "-o", out, "--chat"], "--chat: DATA '" + str(text) + "' holds no chat data; expected a "
                                              "'messages' column"),
        (["pack", chat, "-o", out, "--chat", "--append-eos"], "--chat and --append-eos exclude each other"),
        (["pack", "-o", out, "--chat"], "--chat needs DATA"),
        (["pack", chat, "-o", out, "--chat", "--field", "x"], "--chat and --field exclude each other"),
        (["analyze", "--chat"], "--chat needs DATA"),
        # the first batch holding an overlong conversation stops the tokenizing: the last 200 records are not read
        (["pack", chat, "-o", out, "--capacity", 100], "record 2 has 141 tokens, more than --capacity 100 (found "
                                                      "while tokenizing, which stopped there: 749 of the 1,000 "
                                                      "records 0..999 are longer); raise --capacity or pass "
                                                      "--overlong truncate"),
    ]
    for argv, message in cases:
        code, _, err = run(capsys, *argv, *(["--quiet"] if argv[0] == "pack" else []))
        assert code == 2 and message in err, (argv, err)
        assert err.count("\n") == 1 and not out.exists()
    bad = write(tmp_path / "bad.json", [{"messages": conversation(records[0])},
                                        {"messages": [{"role": "tool", "content": "x"}]}])
    code, _stdout, err = run(capsys, "pack", bad, "-o", out, "--quiet")
    assert code == 2 and "record 1 cannot be rendered by the chat template" in err
