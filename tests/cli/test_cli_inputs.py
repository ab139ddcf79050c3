"""Bad DATA files: ``padfree analyze`` and ``padfree pack`` stop with one line that names the file, where in it the
fault is and what is accepted — never a traceback, never an output.

Every file is real, written to ``tmp_path`` the way a user's tool would write it (or break it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from padfree.cli import main


def text(content: str) -> Callable[[Path], None]:
    return lambda path: path.write_text(content, encoding="utf-8")


def records(value: object) -> Callable[[Path], None]:
    return text(json.dumps(value))


def latin1(content: str) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(content.encode("latin-1"))


def parquet(**columns: object) -> Callable[[Path], None]:
    return lambda path: pq.write_table(pa.table(columns), path)


def damaged_parquet(how: str) -> Callable[[Path], None]:
    """A real Parquet file of 1,000 rows, cut in half or with every page zeroed (footer intact)."""

    def write(path: Path) -> None:
        pq.write_table(pa.table({"text": [f"record {i}" for i in range(1000)]}), path)
        raw = bytearray(path.read_bytes())
        if how == "truncated":
            raw = raw[: len(raw) // 2]
        else:  # the footer's length sits just before the closing PAR1: zero everything between the two magics
            footer = int.from_bytes(raw[-8:-4], "little")
            raw[4 : len(raw) - 8 - footer] = bytes(len(raw) - 12 - footer)
        path.write_bytes(bytes(raw))

    return write


BOTH, PACK = ("analyze", "pack"), ("pack",)

#: (file name, how to write it, commands, what the one line must say)
CASES = [
    ("empty.json", text(""), BOTH, ["empty.json' is an empty file (0 bytes)", "a JSON list of records"]),
    ("blank.json", text("  \n\n"), BOTH, ["blank.json' holds only whitespace", "a JSON list of records"]),
    ("empty.jsonl", text(""), BOTH, ["empty.jsonl' is an empty file (0 bytes)", "JSON Lines: one record"]),
    ("blank.jsonl", text("\n \n"), BOTH, ["blank.jsonl' holds no records"]),
    ("broken.jsonl", text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n{"text": "d"}\n'), BOTH,
     ["broken.jsonl', line 3 is not valid JSON (Expecting value at column 10)", "one record such as"]),
    ("broken.json", text('[{"text": "a"}, {"text": ]'), BOTH,
     ["broken.json' is not valid JSON: Expecting value at line 1, column 26", "a JSON list of records"]),
    ("number.json", text("42"), BOTH, ["number.json' holds a JSON number (42), not a list of records"]),
    ("scalars.json", records({"a": 1, "b": 2}), BOTH,
     ["scalars.json' holds one JSON object (keys 'a', 'b'), not a list of records", "name a one-line JSON Lines"]),
    ("strings.json", records(["a", "b"]), BOTH, ["strings.json': record 0 is a JSON string (\"a\"), not a record"]),
    ("arrays.jsonl", text('{"text": "a"}\n[1, 2]\n'), BOTH,
     ["arrays.jsonl': line 2 is a JSON array of numbers ([1, 2]), not a record"]),
    ("mixed.json", records([{"text": "a"}, {"text": 5}]), BOTH,
     ["mixed.json': record 1 has 'text' = 5 (a number), but record 0 has a string there"]),
    ("mixed.jsonl", text('{"text": "a"}\n{"text": ["b"]}\n'), BOTH,
     ["mixed.jsonl': line 2 has 'text' = [\"b\"] (an array of strings), but line 1 has a string there"]),
    ("numbers.json", records([{"n": 1, "m": 2.5}]), BOTH,
     ["numbers.json' has no text column to tokenize (no column named 'text', and no column of strings)",
      "available columns: n (int64), m (double)"]),
    ("wrong-text.json", records([{"text": 5}]), BOTH,
     ["wrong-text.json' has no text column to tokenize (its column 'text' has type int64, not string"]),
    ("id-strings.json", records([{"input_ids": ["1", "2"]}]), PACK,
     ["column 'input_ids' holds lists of strings (Arrow type list<item: string>; record 0: [\"1\", \"2\"])",
      "expected one list of integer token ids >= 0 per record"]),
    ("id-floats.json", records([{"input_ids": [1.5, 2.0]}, {"input_ids": [3.0]}]), PACK,
     ["column 'input_ids' holds lists of floating-point numbers (Arrow type list<item: double>"]),
    ("id-nested.json", records([{"input_ids": [[1, 2], [3]]}]), PACK,
     ["column 'input_ids' holds lists of lists, one level too deep,"]),
    ("id-scalars.json", records([{"input_ids": 5}, {"input_ids": 6}]), PACK,
     ["column 'input_ids' holds one int64 per record, not a list"]),
    ("id-negative.parquet", parquet(input_ids=[[4, 5], [], [1, 2, -3]]), PACK,  # records count the empty one
     ["id-negative.parquet': input_ids[2][2] = -3 is negative; token ids are integers >= 0"]),
    ("zero.parquet", text(""), BOTH, ["zero.parquet' is an empty file (0 bytes); expected a Parquet file"]),
    ("garbage.parquet", text("id,text\n1,hello\n"), BOTH,
     ["garbage.parquet' is not a Parquet file (it does not start with the Parquet magic bytes PAR1)"]),
    ("truncated.parquet", damaged_parquet("truncated"), BOTH,
     ["truncated.parquet' is a truncated Parquet file", "without the Parquet footer"]),
    ("corrupt.parquet", damaged_parquet("zeroed"), BOTH, ["corrupt.parquet' is a corrupt Parquet file ("]),
    ("no-rows.parquet", parquet(text=pa.array([], pa.string())), BOTH,
     ["no-rows.parquet' holds no records (its columns: text (string))"]),
    ("latin1.json", latin1('[{"text": "café"}]'), BOTH,
     ["latin1.json' is not UTF-8 text: byte 0xe9 at line 1, column 15", "save the file as UTF-8"]),
    ("latin1.jsonl", latin1('{"text": "tea"}\n{"text": "café"}\n'), BOTH,
     ["latin1.jsonl' is not UTF-8 text: byte 0xe9 at line 2, column 14"]),
    ("latin1.csv", latin1("text\ntea\ncafé\n"), BOTH, ["latin1.csv' is not UTF-8 text: column 'text', row 1"]),
    ("folder.json", lambda path: path.mkdir(), BOTH,
     ["folder.json' is a directory but not one written by datasets' save_to_disk; expected .json"]),
    ("missing.jsonl", lambda path: None, BOTH, ["missing.jsonl': no such file or directory"]),
]


def argv(command: str, data: Path, out: Path) -> list[str]:
    return [command, str(data)] + (["-o", str(out), "--quiet"] if command == "pack" else [])


@pytest.mark.parametrize(("command", "name", "write", "says"),
                         [(c, name, write, says) for name, write, commands, says in CASES for c in commands],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_bad_data_is_one_line_naming_the_file_the_place_and_what_is_accepted(tmp_path, capsys, command, name,
                                                                             write, says):
    data = tmp_path / name
    write(data)
    out = tmp_path / "packed"
    code = main(argv(command, data, out))
    stdout, stderr = capsys.readouterr()
    assert code == 2 and stdout == ""
    assert stderr.startswith("padfree: error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    for words in says:
        assert words in stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if data.exists() else [])  # no work directory


def test_demo_and_bench_name_their_data_argument(tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    assert main(["bench", "--no-training", "--quick", "--lengths", "100", "--data", str(data), "-q"]) == 2
    assert capsys.readouterr().err == (f"padfree: error: --data {str(data)!r} is an empty file (0 bytes); expected "
                                       "JSON Lines: one record such as {\"text\": ...} per line\n")


def test_as_a_subprocess_a_file_that_is_not_utf8_is_one_line_too(tmp_path):
    # before, pyarrow read the bytes unchecked and the tokenizer's str conversion ended in a UnicodeDecodeError
    data = tmp_path / "notes.jsonl"
    data.write_bytes('{"text": "na\u00efve"}\n'.encode("latin-1"))
    proc = subprocess.run([sys.executable, "-m", "padfree", "analyze", str(data)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PADFREE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"padfree: error: DATA {str(data)!r} is not UTF-8 text: byte 0xef at line 1, column 13 "
                           "cannot be decoded; save the file as UTF-8\n")


def test_a_key_that_first_appears_in_a_later_record_is_kept(tmp_path, shared_data):
    from padfree.cli._inputs import read_table

    data = tmp_path / "late.json"
    data.write_text(json.dumps([{"text": "a"}, {"text": "b"}, {"text": "c", "note": "only here"}]))
    table = read_table(str(data))
    assert table.column_names == ["text", "note"]
    assert table["note"].to_pylist() == [None, None, "only here"]
    # the real case: one GPTeacher record of 7,673 has an 'example_input'
    teacher = read_table(str(shared_data / "gpteacher_toolformer.json"))
    assert teacher.num_rows == 7673 and teacher["example_input"].null_count == 7672
