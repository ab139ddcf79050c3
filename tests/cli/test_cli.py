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

from padfree.cli import main
from padfree.corpus import load_tokenizer
from padfree.packing import STRATEGIES
from realdata import GSM8K

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def gsm8k_records(gsm8k) -> list[dict[str, str]]:
    return gsm8k


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


def test_analyze_json_is_the_analysis_as_data(tmp_path, capsys):
    png = tmp_path / "lengths.png"
    path = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"n": [5, 0, 12, 3000, 7]}), path)
    code, out, err = run(capsys, "analyze", path, "--lengths-column", "n", "--capacity", "16", "--batch-size", "2",
                         "--strategies", "obfd,nf", "--plot", png, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["stats"]["count"] == 4 and result["stats"]["total_tokens"] == 3024 and result["skipped_empty"] == 1
    assert [s["name"] for s in result["strategies"]] == ["obfd", "nf"]
    assert result["padded"]["truncated_sequences"] == 1 and 0 < result["padded"]["waste_longest"] < 1
    assert result["recommended"] in [c["capacity"] for c in result["candidates"]]
    assert result["plot"] == str(png) and png.read_bytes()[:8] == PNG_MAGIC


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
        (["{tmp}/numbers.json"], "record 0 is a JSON number (1), not a record"),
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


# ==================================================================================================
# padfree pack
# ==================================================================================================

PROMPT_AND_ANSWER = ("instruction", "input", "output")


def joined(record: dict[str, str], columns=PROMPT_AND_ANSWER) -> str:
    """What analyze and pack tokenize by default for the Alpaca layout: every string column joined with newlines."""
    return "\n".join(record[c] for c in columns)


def reference_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pieces(row: dict) -> list[dict]:
    """The sequences of one packed row, cut at ``seq_lens``, with the padding tail as a last entry."""
    out, start = [], 0
    for i, n in enumerate(row["seq_lens"]):
        piece = {k: row[k][start : start + n] for k in ("input_ids", "labels", "position_ids", "attention_mask")
                 if k in row}
        if "sequence_ids" in row:
            piece["sequence_id"] = row["sequence_ids"][i]
        out.append(piece)
        start += n
    tail = {k: row[k][start:] for k in ("input_ids", "labels", "position_ids", "attention_mask") if k in row}
    return [*out, tail]


def check_boundaries(rows: list[dict], padding_value: int = 0, label_padding_value: int = -100) -> list[dict]:
    """Positions restart, the first label of every sequence is masked, padding is padding; return the sequences."""
    sequences = []
    for row in rows:
        *seqs, tail = pieces(row)
        for seq in seqs:
            n = len(seq["input_ids"])
            assert n >= 1
            if "position_ids" in seq:
                assert seq["position_ids"] == list(range(n))
            if "attention_mask" in seq:
                assert seq["attention_mask"] == [1] * n
            assert seq["labels"][0] == label_padding_value
        n = len(tail["input_ids"])
        assert tail["input_ids"] == [padding_value] * n
        assert tail["labels"] == [label_padding_value] * n
        if "position_ids" in tail:
            assert tail["position_ids"] == list(range(n))
        if "attention_mask" in tail:
            assert tail["attention_mask"] == [0] * n
        sequences += seqs
    return sequences


def leftovers(directory: Path, *expected: str) -> list[str]:
    """Everything in ``directory`` but ``expected`` (hidden work directories included)."""
    return sorted(p.name for p in directory.iterdir() if p.name not in expected)


ALL_COLUMNS = "input_ids,attention_mask,labels,position_ids,seq_lens,sequence_ids"


def test_pack_gsm8k_arrow_holds_every_token_exactly_once(tmp_path, capsys, gsm8k_records, tokenizer):
    import datasets

    out = tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", GSM8K, "--output", out, "--limit", "300", "--capacity", "512",
                            "--columns", ALL_COLUMNS, "--json")
    assert code == 0, err
    summary = json.loads(stdout)  # --json: stdout is the summary and nothing else
    assert "padfree: tokenizing 300 records" in err and "padfree: writing" in err  # progress goes to stderr

    packed = datasets.load_from_disk(str(out))
    rows = packed[:]
    rows = [dict(zip(rows, values, strict=True)) for values in zip(*rows.values(), strict=True)]
    assert all(len(row["input_ids"]) == 512 for row in rows)
    sequences = check_boundaries(rows)

    expected = reference_ids(tokenizer, [joined(r) for r in gsm8k_records[:300]])
    # every record once, whole (nothing overlong at 512), with exactly its own tokens; labels are the tokens
    assert sorted(s["sequence_id"] for s in sequences) == list(range(300))
    for seq in sequences:
        assert seq["input_ids"] == expected[seq["sequence_id"]]
        assert seq["labels"][1:] == seq["input_ids"][1:]

    tokens = sum(map(len, expected))
    assert summary["records"] == summary["sequences"] == 300 and summary["skipped_empty"] == 0
    assert summary["input_tokens"] == summary["packed_tokens"] == tokens
    assert summary["bins"] == packed.num_rows
    assert summary["padding_tokens"] == packed.num_rows * 512 - tokens
    assert summary["efficiency"] == pytest.approx(tokens / (packed.num_rows * 512))
    assert summary["lower_bound"] == -(-tokens // 512) <= summary["bins"]
    assert summary["truncated_tokens"] == summary["dropped_tokens"] == summary["split_sequences"] == 0
    assert summary["format"] == "arrow" and summary["columns"] == ALL_COLUMNS.split(",")
    assert summary["bytes"] == sum(p.stat().st_size for p in out.iterdir())
    assert leftovers(tmp_path, "packed") == []  # the work directory is gone


def test_pack_parquet_split_in_two_processes(tmp_path, capsys, gsm8k_records, tokenizer):
    out = tmp_path / "packed.parquet"  # the suffix picks --format parquet
    code, stdout, err = run(capsys, "pack", GSM8K, "-o", out, "--field", "output", "--limit", "200",
                            "--capacity", "96", "--overlong", "split", "--num-proc", "2", "--strategy", "ffd",
                            "--columns", "input_ids,labels,position_ids,seq_lens,sequence_ids",
                            "--padding-value", "2", "--label-padding-value", "-1")
    assert code == 0, err
    table = pq.read_table(out)
    assert table.column_names == ["input_ids", "labels", "position_ids", "seq_lens", "sequence_ids"]
    assert str(table.schema.field("input_ids").type) == "list<element: int32>"
    sequences = check_boundaries(table.to_pylist(), padding_value=2, label_padding_value=-1)

    # a split sequence is several sequences of at most 96 tokens: per record, the multiset of its pieces is
    # exactly its tokens cut every 96, so no token is lost, duplicated or moved to another record
    expected = reference_ids(tokenizer, [r["output"] for r in gsm8k_records[:200]])
    got: dict[int, list] = {}
    for seq in sequences:
        got.setdefault(seq["sequence_id"], []).append(tuple(seq["input_ids"]))
    assert sorted(got) == list(range(200))
    for i, ids in enumerate(expected):
        assert sorted(got[i]) == sorted(tuple(ids[k : k + 96]) for k in range(0, len(ids), 96))

    split = sum(len(ids) > 96 for ids in expected)
    num_pieces = sum(-(-len(ids) // 96) for ids in expected)
    tokens = sum(map(len, expected))
    assert split > 0
    assert f"{split} sequences longer than 96 split: {num_pieces:,} pieces in all, no token lost" in stdout
    assert f"200 sequences, {tokens:,} tokens -> {table.num_rows:,} rows of 96 tokens (strategy ffd" in stdout
    assert f"efficiency  {tokens / (96 * table.num_rows):.2%} ({96 * table.num_rows - tokens:,} padding" in stdout
    assert "one Parquet file" in " ".join(stdout.split())  # the line wraps where a long temporary path pushes it
    assert leftovers(tmp_path, "packed.parquet") == []


@pytest.fixture
def token_dataset(tmp_path, gsm8k_records, tokenizer) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A saved dataset of real token ids with prompt-masked labels, an empty record and a null one among them."""
    import datasets

    ids, labels = [], []
    for r in gsm8k_records[:120]:
        prompt = tokenizer(r["instruction"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["output"], add_special_tokens=False)["input_ids"]
        ids.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    ids[10] = labels[10] = []
    ids[50] = labels[50] = None
    path = tmp_path / "tokens"
    datasets.Dataset.from_dict({"input_ids": ids, "labels": labels, "id": list(range(120))}).save_to_disk(str(path))
    return path, ids, labels


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_pack_token_ids_counts_what_is_cut(tmp_path, capsys, token_dataset, overlong):
    import datasets

    data, ids, labels = token_dataset
    before = sorted(p.name for p in data.iterdir())
    capsys.readouterr()  # what the fixture printed
    capacity = 200
    out = tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", capacity, "--overlong", overlong,
                            "--padding", "none", "--columns", "input_ids,labels,seq_lens,sequence_ids", "--json",
                            "--quiet")
    assert code == 0, err
    assert err == ""  # --quiet
    summary = json.loads(stdout)
    assert summary["records"] == 120 and summary["skipped_empty"] == 2 and summary["sequences"] == 118
    assert sorted(p.name for p in data.iterdir()) == before  # nothing written next to the input

    rows = datasets.load_from_disk(str(out)).to_list()
    assert summary["padding_tokens"] == 0 and all(len(r["input_ids"]) == sum(r["seq_lens"]) for r in rows)
    sequences = check_boundaries(rows)
    lengths = {i: len(x) for i, x in enumerate(ids) if x}
    over = {i for i, n in lengths.items() if n > capacity}
    assert over  # the fixture has sequences longer than the capacity
    placed = {s["sequence_id"]: s for s in sequences}
    assert len(placed) == len(sequences)
    if overlong == "truncate":
        assert sorted(placed) == sorted(lengths)  # sequence ids are records of DATA, empty ones left out
        lost = sum(lengths[i] - capacity for i in over)
        assert (summary["truncated_sequences"], summary["truncated_tokens"]) == (len(over), lost)
    else:
        assert sorted(placed) == sorted(set(lengths) - over)
        lost = sum(lengths[i] for i in over)
        assert (summary["dropped_sequences"], summary["dropped_tokens"]) == (len(over), lost)
    for i, seq in placed.items():
        assert seq["input_ids"] == ids[i][:capacity]
        assert seq["labels"][1:] == labels[i][1:capacity]  # the input's labels (prompt masked) survive
    assert summary["packed_tokens"] == sum(lengths.values()) - lost == summary["input_tokens"] - lost


def test_pack_wrapped_counts_the_sequences_it_cuts(tmp_path, capsys, token_dataset):
    """wrapped cuts sequences at the rows' edges, overlong or not: the summary counts every sequence placed as more
    than one piece (the rows' own sequence_ids say which), and no token is lost."""
    import datasets

    data, ids, _ = token_dataset
    capsys.readouterr()
    out = tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", 200, "--strategy", "wrapped",
                            "--overlong", "split", "--columns", "input_ids,seq_lens,sequence_ids", "--json", "--quiet")
    assert code == 0, err
    summary = json.loads(stdout)
    rows = datasets.load_from_disk(str(out)).to_list()
    pieces = [i for r in rows for i in r["sequence_ids"]]
    cut = {i for i in set(pieces) if pieces.count(i) > 1}
    assert summary["split_sequences"] == len(cut) > sum(len(x) > 200 for x in ids if x)  # more than the overlong
    assert summary["pieces"] == len(pieces) and summary["packed_tokens"] == sum(len(x) for x in ids if x)


@pytest.mark.parametrize("fields", [[], ["instruction", "output"]])
def test_pack_completion_field_trains_on_the_answer_only(tmp_path, capsys, gsm8k_records, tokenizer, fields):
    import datasets

    out = tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", GSM8K, "-o", out, "--limit", "25", "--capacity", "1024",
                            "--completion-field", "output", "--append-eos", "--columns", ALL_COLUMNS,
                            *[a for f in fields for a in ("--field", f)], "--quiet")
    assert code == 0, err
    columns = tuple(fields) or PROMPT_AND_ANSWER
    prompt = " + ".join(map(repr, columns[:-1]))
    assert f"prompt {prompt}, then completion 'output' (the only targets)" in stdout
    sequences = check_boundaries(datasets.load_from_disk(str(out)).to_list())
    assert len(sequences) == 25
    eos = tokenizer.eos_token_id
    for seq in sequences:
        record = gsm8k_records[seq["sequence_id"]]
        # the tokens are those of the whole record (prompt and completion joined), then EOS
        assert seq["input_ids"] == reference_ids(tokenizer, [joined(record, columns)])[0] + [eos]
        targets = [t for t in seq["labels"] if t != -100]
        assert targets[-1] == eos
        assert tokenizer.decode(targets[:-1]) == record["output"]


def test_pack_embedded_corpus(tmp_path, capsys):
    code, stdout, err = run(capsys, "pack", "-o", tmp_path / "corpus", "--limit", "30", "--capacity", "4096",
                            "--overlong", "split", "--quiet")
    assert code == 0, err
    assert "embedded corpus: CPython" in stdout and "first 30 documents" in stdout
    assert (tmp_path / "corpus" / "state.json").is_file()


def test_pack_refuses_an_existing_output_unless_overwrite(tmp_path, capsys):
    import datasets

    out = tmp_path / "packed"
    common = ["pack", GSM8K, "-o", out, "--limit", "50", "--overlong", "truncate", "--quiet"]
    assert run(capsys, *common, "--capacity", "1024")[0] == 0
    first = datasets.load_from_disk(str(out)).num_rows

    code, stdout, err = run(capsys, *common, "--capacity", "256")
    assert code == 2 and stdout == ""
    assert err == f"padfree: error: --output {str(out)!r} already exists; pass --overwrite to replace it (the old " \
                  "one is replaced only once the new one is complete)\n"
    assert datasets.load_from_disk(str(out)).num_rows == first

    code, _, err = run(capsys, *common, "--capacity", "256", "--overwrite")
    assert code == 0, err
    assert datasets.load_from_disk(str(out)).num_rows > first
    assert leftovers(tmp_path, "packed") == []

    # --overwrite never deletes a directory that is not a dataset
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    code, _, err = run(capsys, "pack", GSM8K, "-o", precious, "--overwrite", "--limit", "5", "--quiet")
    assert code == 2 and "refusing to replace it" in err
    assert (precious / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("exception", [RuntimeError("disk on fire"), KeyboardInterrupt()])
@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_crash_while_writing_leaves_no_output(tmp_path, capsys, monkeypatch, exception, fmt):
    import datasets

    def write_half_then_fail(self, path, *args, **kwargs):
        path = Path(path)
        if fmt == "arrow":
            path.mkdir()
            (path / "data-00000-of-00002.arrow").write_bytes(b"half a dataset")
        else:
            path.write_bytes(b"PAR1 half a file")
        raise exception

    monkeypatch.setattr(datasets.Dataset, "save_to_disk" if fmt == "arrow" else "to_parquet", write_half_then_fail)
    out = tmp_path / "packed"
    argv = ["pack", GSM8K, "-o", out, "--format", fmt, "--limit", "20", "--quiet"]
    if isinstance(exception, KeyboardInterrupt):
        assert run(capsys, *argv)[0] == 130
    else:
        with pytest.raises(RuntimeError, match="disk on fire"):
            main([str(a) for a in argv])
    assert not out.exists()
    assert leftovers(tmp_path) == []

    # an output that already exists survives a failed --overwrite untouched
    out.mkdir()
    (out / "state.json").write_text("{}")
    if isinstance(exception, KeyboardInterrupt):
        assert run(capsys, *argv, "--overwrite")[0] == 130
    else:
        with pytest.raises(RuntimeError):
            main([str(a) for a in [*argv, "--overwrite"]])
    assert sorted(p.name for p in out.iterdir()) == ["state.json"]
    assert leftovers(tmp_path, "packed") == []


def test_bad_data_found_while_packing_leaves_no_output(tmp_path, capsys, tokenizer, gsm8k_records):
    ids = reference_ids(tokenizer, [r["output"] for r in gsm8k_records[:300]])
    labels = [list(x) for x in ids]
    labels[150] = labels[150][:-1]  # one record, half way through, has labels that do not match its tokens
    data = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"input_ids": ids, "labels": labels}), data)
    out = tmp_path / "packed"

    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", "512", "--quiet")
    assert code == 2 and stdout == ""
    assert err.startswith("padfree: error: ") and err.count("\n") == 1 and "150" in err, err
    assert leftovers(tmp_path, "tokens.parquet") == []

    code, _, err = run(capsys, "pack", GSM8K, "-o", out, "--limit", "100", "--capacity", "64", "--quiet")
    assert code == 2 and "more than --capacity 64" in err and "pass --overlong truncate" in err
    assert leftovers(tmp_path, "tokens.parquet") == []


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--capacity", "0"], "--capacity must be an integer >= 1, got 0"),
        (["--strategy", "best"], "--strategy must be one of 'nf', 'ff'"),
        (["--overlong", "cut"], "--overlong must be one of 'error', 'truncate', 'split', 'drop'; got 'cut'"),
        (["--format", "csv"], "--format must be one of arrow, parquet, jsonl, got 'csv'"),
        (["-o", "{tmp}/rows.csv"], "rows.csv': padfree pack writes arrow (a directory: a name without an extension"),
        (["-o", "{tmp}/rows.json"], "the extension '.json' asks for none of them"),
        (["--padding", "lots"], "--padding must be one of capacity, longest, none or a number of tokens"),
        (["--attention-mask", "dense"], "--attention-mask must be one of 'binary', 'segments', 'none'"),
        (["--columns", "input_ids,tokens"], "unknown column 'tokens'"),
        (["--columns", "attention_mask", "--attention-mask", "none"], "--attention-mask is none"),
        (["--num-proc", "0"], "--num-proc must be an integer >= 1, got 0"),
        (["--limit", "-1"], "--limit must be an integer >= 1, got -1"),
        (["--padding-value", "3000000000"], "--padding-value must fit int32"),
        (["-o", "{tmp}/no/such/dir"], "the directory"),
        (["--data", "{tmp}/in.parquet", "-o", "{tmp}/in.parquet"], "is (or contains) DATA"),
        (["--field", "question"], "--field 'question': no such column; available columns: instruction"),
        (["--completion-field", "answer"], "--completion-field 'answer': no such column"),
        (["--input-ids-column", "input_ids", "--tokenizer", "{tmp}"], "--input-ids-column and --tokenizer exclude"),
        (["--labels-column", "labels"], "--labels-column needs token ids"),
        (["--tokenizer", "{tmp}/no-tokenizer"], "no-tokenizer' does not exist"),
        (["--data", "{tmp}/missing.json"], "missing.json': no such file"),
        (["--data", "{tmp}/in.parquet", "--append-eos"], "--append-eos does not apply"),
        (["--data", "{tmp}/in.parquet", "--input-ids-column", "text"], "'text' holds one string per record, not a"),
        (["--data", "{tmp}/in.parquet", "--labels-column", "text"], "--labels-column 'text' holds one string per"),
    ],
)
def test_pack_bad_arguments_are_one_error_line_and_no_output(tmp_path, capsys, args, culprit):
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]], "text": ["a b", "c"]}), tmp_path / "in.parquet")
    args = [str(a).format(tmp=tmp_path) for a in args]
    data = str(GSM8K)
    if "--data" in args:
        i = args.index("--data")
        data = args.pop(i + 1)
        args.pop(i)
    out = tmp_path / "packed"
    argv = ["pack", data, *([] if "-o" in args else ["-o", out]), "--limit", "30", "--quiet", *args]
    code, stdout, err = run(capsys, *argv)
    assert code == 2
    assert stdout == ""
    assert err.startswith("padfree: error: ") and err.count("\n") == 1, err
    assert culprit in err
    assert leftovers(tmp_path, "in.parquet") == []


def test_pack_usage_and_help(capsys):
    assert main(["pack", str(GSM8K)]) == 2  # --output is required
    assert "the following arguments are required: -o/--output" in capsys.readouterr().err
    assert main(["pack", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--capacity", "--strategy", "--overlong", "--format", "--num-proc", "--input-ids-column",
                 "--field", "--tokenizer", "--padding-value", "--label-padding-value", "--overwrite", "--json"):
        assert flag in text


def test_pack_writes_json_lines_when_the_output_asks_for_them(tmp_path, capsys):
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5], [6]]}), data)
    out = tmp_path / "rows.jsonl"
    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", "4", "--json", "--quiet")
    assert code == 0, err
    assert json.loads(stdout)["format"] == "jsonl" and out.is_file()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_ids"] for r in rows] == [[1, 2, 3, 6], [4, 5, 0, 0]]
    assert [r["seq_lens"] for r in rows] == [[3, 1], [2]]
    assert leftovers(tmp_path, "ids.parquet", "rows.jsonl") == []


def test_pack_names_its_own_flags_for_a_sequence_longer_than_the_capacity(tmp_path, capsys):
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2], [], [1] * 9, [3] * 4, [2] * 12]}), data)
    code, stdout, err = run(capsys, "pack", data, "-o", tmp_path / "packed", "--capacity", "8", "--quiet")
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err == (f"padfree: error: DATA {str(data)!r}: record 2 has 9 tokens, more than --capacity 8 (2 of 4 "
                   "sequences are longer, the longest has 12); raise --capacity or pass --overlong truncate (keep the "
                   "first CAPACITY tokens), split (cut into pieces of CAPACITY) or drop (leave it out)\n")
    assert leftovers(tmp_path, "ids.parquet") == []


def test_pack_stops_tokenizing_at_the_first_batch_with_a_sequence_longer_than_the_capacity(tmp_path, capsys):
    code, _, err = run(capsys, "pack", GSM8K, "-o", tmp_path / "packed", "--limit", "3000", "--capacity", "100",
                       "--quiet")
    assert code == 2 and err.count("\n") == 1
    assert "more than --capacity 100 (found while tokenizing, which stopped there:" in err
    assert "of the 1,000 records 0..999 are longer); raise --capacity or pass --overlong truncate" in err
    assert leftovers(tmp_path) == []


def test_pack_carries_the_per_token_columns_of_token_ids(tmp_path, capsys):
    import datasets

    data = tmp_path / "trl.parquet"
    pq.write_table(pa.table({
        "input_ids": [[5, 6, 7], [8, 9]], "completion_mask": [[0, 1, 1], [0, 1]], "token_type_ids": [[1, 1, 1], [2, 2]],
        "weights": [[0.5, 1.0, 1.0], [1.0, 0.5]], "prompt": ["a", "b"],
    }), data)
    out = tmp_path / "packed"
    code, stdout, err = run(capsys, "pack", data, "-o", out, "--capacity", "6", "--quiet")
    assert code == 0, err
    assert err == ("padfree: note: column 'weights' holds one double value per token; packed rows carry only integer "
                   "or boolean per-token columns, so it is not written\n")
    assert "carried per token: 'completion_mask', 'token_type_ids'" in " ".join(stdout.split())
    rows = datasets.load_from_disk(str(out)).to_list()
    assert [r["input_ids"] for r in rows] == [[5, 6, 7, 8, 9, 0]]
    assert rows[0]["labels"] == [-100, 6, 7, -100, 9, -100]  # the mask builds the labels ...
    assert rows[0]["completion_mask"] == [0, 1, 1, 0, 1, 0]  # ... and is carried, like the token types
    assert rows[0]["token_type_ids"] == [1, 1, 1, 2, 2, 0]


@pytest.mark.parametrize("command", [["analyze"], ["pack", "-o", "out"], ["demo", "--data"], ["bench", "--data"]])
def test_a_missing_file_is_said_before_any_heavy_import(tmp_path, command):
    """A missing DATA is the first check: no numpy, numba (the packing engine), datasets or transformers imported."""
    heavy = ("numpy", "numba", "pyarrow", "datasets", "transformers", "torch")
    script = ("import sys; from padfree.cli import main; code = main(sys.argv[1:]); "
              f"print(code, sorted(m for m in {heavy!r} if m in sys.modules))")
    missing = str(tmp_path / "missing.json")
    proc = subprocess.run([sys.executable, "-c", script, *command, missing], capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout == "2 []\n", proc.stderr
    flag = "--data" if command[-1] == "--data" else "DATA"
    assert proc.stderr == f"padfree: error: {flag} {missing!r}: no such file or directory\n"


def test_refusals_made_after_planning_name_the_flags(tmp_path, capsys):
    """What the library refuses in its own argument names (``padding=``, ``capacity``) is said in the command's flags,
    and the refused pack writes nothing."""
    data = tmp_path / "texts.json"
    data.write_text(json.dumps([{"text": "one two three four five six seven eight nine ten " * 3}] * 20))
    out = tmp_path / "packed"
    code, _, err = run(capsys, "pack", data, "-o", out, "--capacity", "64", "--padding", "8", "--quiet")
    assert code == 2 and not out.exists()
    assert err.startswith("padfree: error: --padding 8 is shorter than the longest packed row (")
    assert "pass --padding" in err and "padding=" not in err
    for command in (["analyze", data], ["demo", "--quick", "-o", tmp_path / "demo"], ["bench", "--no-training"]):
        code, _, err = run(capsys, *command, "--capacity", str(2**27))
        assert code == 2 and err == f"padfree: error: --capacity must be an integer >= 1 and <= {2**26}, got {2**27}\n"
