"""``padfree demo`` and ``padfree bench`` end to end, on small real inputs, and their errors on bad ones."""

from __future__ import annotations

import json
import re

import pytest
import transformers
from matplotlib.image import imread

from padfree.cli import DEMO_PNG, main
from realdata import (
    GSM8K,
)


def run(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_quick_on_the_embedded_corpus(capsys, tmp_path):
    out_dir = tmp_path / "demo"
    code, out, err = run(capsys, "demo", "--quick", "-o", out_dir)
    assert code == 0, err
    assert "padfree demo" in out and "embedded corpus" in out
    assert "OK at atol=1e-05" in out  # verify() on a packed row
    # the in-run proof's cost, measured against the training it precedes
    assert "in-run proof, what padfree's trainers run before their first optimizer step" in out
    assert re.search(r"\n    \d+ sequences of the first packed micro-batch: max \|Δlogit\| .* within .*, leaking "
                     r"control \d", out)
    assert re.search(r"\n    \d+\.\d\d s, \d+\.\d% of the packed mode's \d+\.\d s of training here \(\d+\.\d% in "
                     r"CPU time;", out)
    for mode in ("padded", "grouped", "packed"):
        assert f"\n  {mode} " in out
    assert "Packed trains" in out
    assert "\n  packed+fused " in out and "With padfree's fused loss as well" in out
    # the numbers explained where they are shown: the steps, each ratio, the loss; no ratio the other way round
    assert "optimizer steps" in out and "vs padded" in out and "packed is" not in out
    assert "  How to read it:" in out and "real tokens per second divided by those of random padded batches" in out
    assert "is the number of updates, not what a step computes" in " ".join(out.split())
    png = out_dir / DEMO_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape[1] > 1000  # three panels side by side
    # progress on stderr, with estimates before the long parts (lines that reach a log file, where tqdm draws none)
    assert "padfree: tokenizing: about " in err and "s for the remaining" in err
    assert "padfree: training: about " in err and "padfree: training: pass 1 of 1 done" in err


def test_demo_with_data_a_local_model_and_json(capsys, tmp_path):
    model_dir = tmp_path / "model"
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    capsys.readouterr()  # save_pretrained's own progress bar
    code, out, err = run(capsys, "demo", "--quick", "--data", GSM8K, "--field", "output", "--limit", "300",
                         "--model", model_dir, "--tokens", "600", "--json", "-q", "-o", tmp_path)
    assert code == 0, err
    assert err == ""  # -q: no progress
    summary = json.loads(out)
    assert "gsm8k_train.json (300 records; column 'output')" in summary["data"]
    assert str(model_dir) in summary["model"]
    training = summary["training"]
    assert set(training["modes"]) == {"padded", "grouped", "packed", "packed+fused"}
    assert training["exactness"]["ok"]
    proof = training["inrun_proof"]
    assert proof["ok"] and proof["sequences"] >= 2 and proof["control"] > proof["atol"] and proof["seconds"] > 0
    # its cost as a share of the packed training it precedes (every timed pass), as the text report says it
    packed_seconds = sum(training["modes"]["packed"]["seconds"])
    assert proof["share_of_packed_training"] == pytest.approx(proof["seconds"] / packed_seconds)
    packed_cpu = sum(training["modes"]["packed"]["cpu_seconds"])
    assert proof["cpu_share_of_packed_training"] == pytest.approx(proof["cpu_seconds"] / packed_cpu)
    real = {m["real_tokens"] for m in training["modes"].values()}
    assert len(real) == 1 and real.pop() >= 600  # the same tokens in every mode
    assert training["packed_speedup"]["padded"] > 0
    assert (tmp_path / DEMO_PNG).is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "missing.json"], "no such file or directory"),
        (["--data", GSM8K, "--field", "answer"], "--field 'answer': no such column"),
        (["--capacity", "0"], "--capacity"),
        (["--rows", "-1"], "--rows"),
        (["--field", "text"], "--field needs --data"),
        (["--model", "nowhere"], "--model 'nowhere' is not a directory"),
    ],
)
def test_demo_bad_input_is_one_error_and_writes_nothing(capsys, tmp_path, argv, message):
    out_dir = tmp_path / "out"
    code, out, err = run(capsys, "demo", "--quick", "-o", out_dir, *argv)
    assert code == 2
    assert out == ""
    lines = [line for line in err.splitlines() if line.startswith("padfree: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not out_dir.exists()


def test_demo_unreadable_tokenizer_dir(capsys, tmp_path):
    bad = tmp_path / "tok"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{ not json", encoding="utf-8")
    out_dir = tmp_path / "out"
    code, _, err = run(capsys, "demo", "--quick", "--tokenizer", bad, "-o", out_dir)
    assert code == 2
    assert "padfree: error: tokenizer directory" in err and "could not be loaded" in err
    assert not out_dir.exists()


def test_demo_model_whose_vocabulary_is_too_small(capsys, tmp_path):
    model_dir = tmp_path / "small"
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    code, _, err = run(capsys, "demo", "--quick", "--limit", "20", "--model", model_dir, "-o", tmp_path / "out")
    assert code == 2
    assert "has 100 embeddings but the tokenizer produced token id" in err
    assert not (tmp_path / "out").exists()


def test_demo_output_that_is_a_file(capsys, tmp_path):
    target = tmp_path / "file.png"
    target.write_bytes(b"x")
    code, _, err = run(capsys, "demo", "--quick", "-o", target)
    assert code == 2 and "is a file" in err
    assert target.read_bytes() == b"x"


def test_bench_packing_only(capsys):
    code, out, err = run(capsys, "bench", "--no-training", "--lengths", "5000", "--capacity", "1024", "--json")
    assert code == 0, err
    summary = json.loads(out)
    packing = summary["packing"]["synthetic"]
    assert packing["sequences"] == 5000
    assert packing["strategies"]["obfd"]["bins"] >= packing["strategies"]["obfd"]["lower_bound"]
    assert "training" not in summary


def test_bench_quick_with_training(capsys):
    code, out, err = run(capsys, "bench", "--quick", "--lengths", "2000", "--limit", "200", "--tokens", "600",
                         "--data", GSM8K, "-q")
    assert code == 0, err
    assert "Packing 2,000 synthetic lognormal lengths" in out
    assert "gsm8k_train.json" in out
    for mode in ("padded", "grouped", "packed", "ideal"):
        assert f"\n  {mode} " in out
    assert "padfree exact: True" in out


def test_bench_bad_input(capsys):
    code, out, err = run(capsys, "bench", "--capacity", "0", "--no-training")
    assert code == 2 and out == "" and "--capacity" in err
    code, _, err = run(capsys, "bench", "--lengths", "0")
    assert code == 2 and "--lengths" in err
