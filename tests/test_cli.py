"""``padfree analyze`` end to end, on real data: in-process through ``main`` and once as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from matplotlib.image import imread

from padfree import STRATEGIES
from padfree.cli import main
from padfree.corpus import load_tokenizer

# the repository is cloned with shared/ beside it: <root>/main/tests/test_cli.py -> <root>/shared/data
DATA = Path(__file__).parents[2] / "shared" / "data"
GSM8K = DATA / "gsm8k_train.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gsm8k_records() -> list[dict[str, str]]:
    assert GSM8K.is_file(), f"{GSM8K} is missing: the tests expect the shared/ data directory beside the repository"
    return json.loads(GSM8K.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_analyze_gsm8k_joins_every_string_column(capsys, gsm8k_records, tokenizer):
    code, out, err = run(capsys, "analyze", GSM8K, "--capacity", "1024")
    assert code == 0, err
    assert "7,473 records" in out
    assert "no 'text' column, so every string column: 'instruction' + 'input' + 'output'" in out
    # the total is the one obtained by tokenizing the joined records directly, record by record
    texts = [f"{r['instruction']}\n{r['input']}\n{r['output']}" for r in gsm8k_records]
    total = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    assert f"7,473 sequences, {total:,} tokens" in out
    table = out.split("Packing strategies")[1].split("Capacity candidates")[0]
    assert [line.split()[0] for line in table.splitlines()[2:] if line.strip()] == list(STRATEGIES)
    assert "Recommendation: capacity" in out
    assert "<- requested" in out


def test_analyze_as_a_subprocess(tmp_path):
    script = Path(sys.executable).with_name("padfree")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "padfree.cli"]
    proc = subprocess.run(
        [*command, "analyze", str(GSM8K), "--field", "output", "--limit", "400", "--strategies", "obfd,ffd",
         "--capacity", "512", "--batch-size", "4"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PADFREE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "(400 records, --limit 400)" in out and "column 'output'" in out
    assert "400 sequences" in out
    table = out.split("Packing strategies")[1].split("Capacity candidates")[0]
    assert [line.split()[0] for line in table.splitlines()[2:] if line.strip()] == ["obfd", "ffd"]
    assert "padded batches of 4" in out
    assert (tmp_path / "cache" / "tokenizer-mistral-v1" / "tokenizer.json").is_file()


def test_analyze_embedded_corpus(capsys):
    # the README command is `padfree analyze` on the whole corpus; a prefix keeps the test fast
    code, out, err = run(capsys, "analyze", "--limit", "120", "--capacity", "4096")
    assert code == 0, err
    assert "embedded corpus: CPython" in out and "first 120 documents" in out
    assert "tokenized by mistral-common tokenizer.model.v1" in out
    assert "Recommendation: capacity" in out


def test_lengths_column_from_parquet(tmp_path, capsys):
    path = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"n_tokens": [5, 0, 12, 3000, 7], "text": ["a", "", "b", "c", "d"]}), path)
    code, out, err = run(capsys, "analyze", path, "--lengths-column", "n_tokens", "--capacity", "16",
                         "--batch-size", "2")
    assert code == 0, err
    assert "precomputed lengths from column 'n_tokens'" in out
    assert "1 empty records" in out
    assert "4 sequences, 3,024 tokens" in out
    assert "1 of 4 sequences (25.0%) are longer than 16" in out
    assert "tokenized" not in out


def test_jsonl_csv_and_saved_dataset_inputs(tmp_path, capsys):
    texts = ["one two three", "a much longer sentence with quite a few more words in it", "x"]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    code, out, err = run(capsys, "analyze", jsonl, "--capacity", "8")
    assert code == 0, err
    assert "column 'text'" in out and "3 sequences" in out

    csv = tmp_path / "data.csv"
    csv.write_text("length,name\n3,a\n9,b\n4,c\n")
    code, out, err = run(capsys, "analyze", csv, "--lengths-column", "length", "--capacity", "8")
    assert code == 0, err
    assert "3 sequences, 16 tokens" in out

    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": texts, "answer": ["yes", "no", "maybe"]}).save_to_disk(str(saved))
    code, out, err = run(capsys, "analyze", saved, "--field", "prompt", "--field", "answer", "--capacity", "16")
    assert code == 0, err
    assert "column 'prompt' + 'answer', joined with newlines" in out


def test_plot_is_a_valid_png(tmp_path, capsys):
    png = tmp_path / "lengths.png"
    code, out, err = run(capsys, "analyze", GSM8K, "--limit", "300", "--plot", png)
    assert code == 0, err
    assert f"plot written to {png}" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500
    assert image.std() > 0.05  # not a blank canvas
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.png"]  # no temporary file left behind


@pytest.fixture
def parquet(tmp_path) -> Path:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"n_tokens": np.array([3, 4], np.int64), "text": ["a b", "c"]}), path)
    return path


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["{tmp}/missing.json"], "missing.json': no such file"),
        ([GSM8K, "--field", "question"], "--field 'question': no such column; available columns: instruction"),
        (["{parquet}", "--lengths-column", "n"], "--lengths-column 'n': no such column; available columns: n_tokens"),
        ([GSM8K, "--tokenizer", "{tmp}/no-tokenizer"], "no-tokenizer' does not exist"),
        ([GSM8K, "--tokenizer", "{tmp}"], "could not be loaded"),
        ([GSM8K, "--capacity", "0"], "--capacity must be an integer >= 1, got 0"),
        ([GSM8K, "--capacity", "-3"], "--capacity must be an integer >= 1, got -3"),
        ([GSM8K, "--strategies", "obfd,best"], "unknown strategy 'best'"),
        (["{tmp}/notes.txt"], "unsupported file type '.txt'"),
        (["{parquet}", "--lengths-column", "text"], "has type string, not numbers"),
        (["{tmp}/empty.json"], "empty.json' holds no records"),
        (["{tmp}/numbers.json"], "record 0 is of type int, not an object"),
        (["--lengths-column", "n_tokens"], "--lengths-column needs DATA"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, parquet, capsys, args, culprit):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "numbers.json").write_text("[1, 2]")
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    png = tmp_path / "out.png"
    argv = [str(a).format(tmp=tmp_path, parquet=parquet) for a in args]
    code, out, err = run(capsys, "analyze", *argv, "--plot", png)
    assert code == 2
    assert out == ""
    assert err.startswith("padfree: error: ") and err.count("\n") == 1, err
    assert culprit in err
    assert not png.exists()


def test_usage_errors_and_help(capsys):
    assert main(["analyze", "--capacity", "many"]) == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err
    assert main([]) == 2
    capsys.readouterr()
    assert main(["analyze", "--help"]) == 0
    assert "--lengths-column" in capsys.readouterr().out
