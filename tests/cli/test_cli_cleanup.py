"""Killed and failing runs clean up: ``padfree pack`` and ``pack_dataset(cache_file_name=...)`` stopped by SIGKILL
leave temporary data that the next run in the same directory removes (a live run's is never touched), SIGTERM
unwinds like Ctrl-C, and a disk that refuses a write ends the command in one line naming the file and the errno.

Runs are stopped mid-write for real: a subprocess runs the real command with one change, the builder of the second
chunk of packed rows waits forever (after the first chunk went to the writer), and says so in a marker file.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from padfree import pack_dataset
from padfree.cli import main
from padfree.data import _arrow_writer

#: a subprocess that runs ``padfree ARGV`` (or, with ``library`` first, pack_dataset) and stops when the second
#: chunk of rows is built, after writing MARKER
STOPPER = r'''
import pathlib, sys, time
from padfree.data import _arrow_writer

marker = pathlib.Path(sys.argv[1])
build = _arrow_writer._Builder.batch
calls = []

def batch(self, a, b, buffers):
    calls.append(a)
    if len(calls) == 2:
        marker.write_text("writing")
        while True:
            time.sleep(0.05)
    return build(self, a, b, buffers)

_arrow_writer._Builder.batch = batch
if sys.argv[2] == "library":
    import pyarrow.parquet as pq
    from padfree import pack_dataset
    pack_dataset(pq.read_table(sys.argv[3]), 1024, cache_file_name=sys.argv[4])
else:
    from padfree.cli import main
    sys.exit(main(sys.argv[2:]))
'''

CAPACITY = "1024"


@pytest.fixture(scope="module")
def ids_parquet(tmp_path_factory) -> Path:
    """4,000 sequences of 50-350 token ids: ~800k row slots at capacity 1024, more than the first chunk's 512k."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("input") / "ids.parquet"
    ids = [rng.integers(0, 1000, n).tolist() for n in rng.integers(50, 350, 4000)]
    pq.write_table(pa.table({"input_ids": ids}), path)
    return path


def stopped(tmp_path: Path, *argv: object) -> subprocess.Popen:
    """Start the stopper on ``argv``; return once it is in the middle of writing."""
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER)
    marker = tmp_path / f"marker-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, str(script), str(marker), *map(str, argv)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a guard against a hang, not a measurement
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the stopped run ended early: {proc.communicate()}")
        time.sleep(0.05)
    marker.unlink()
    return proc


def hidden(directory: Path, pattern: str) -> list[Path]:
    return sorted(directory.glob(pattern))


def settled_size(path: Path) -> int:
    """``path``'s size once the stopped run's writer threads have flushed what they held (the builder stops at its
    second batch; the writer may still be writing the first when the marker appears)."""
    size, deadline = -1, time.monotonic() + 60  # a guard against a hang, not a measurement
    while time.monotonic() < deadline:
        now = path.stat().st_size
        if now == size:
            return size
        size = now
        time.sleep(0.5)
    return size


def test_a_killed_pack_leaves_a_work_directory_the_next_run_removes_and_a_live_one_is_kept(tmp_path, capsys,
                                                                                           ids_parquet):
    out = tmp_path / "outputs"
    out.mkdir()
    live = stopped(tmp_path, "pack", ids_parquet, "-o", out / "b", "-q", "--capacity", CAPACITY)
    try:
        working = hidden(out, ".b.padfree-*")
        partial = list(working[0].glob("cache/*.tmp"))
        assert len(working) == 1 and len(partial) == 1
        killed = stopped(tmp_path, "pack", ids_parquet, "-o", out / "a", "-q", "--capacity", CAPACITY)
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        left = hidden(out, ".a.padfree-*")
        assert len(left) == 1 and list(left[0].glob("cache/*.tmp")), "a killed run leaves its work directory"

        assert main(["pack", str(ids_parquet), "-o", str(out / "c"), "-q", "--capacity", CAPACITY]) == 0
        err = capsys.readouterr().err
        assert hidden(out, ".a.padfree-*") == [], "the killed run's work directory is removed"
        assert f"removed 1 temporary entry left in {str(out)!r} by runs that were killed: {left[0].name}" in err
        assert hidden(out, ".b.padfree-*") == working and partial[0].exists(), "a live run's files are untouched"
        assert sorted(p.name for p in out.iterdir()) == [working[0].name, "c"]

        # SIGTERM unwinds like Ctrl-C: the work directory goes, no output, exit status 128 + 15
        live.send_signal(signal.SIGTERM)
        _, stderr = live.communicate(timeout=300)
        assert live.returncode == 143 and stderr.strip().splitlines()[-1] == "padfree: terminated", stderr
        assert sorted(p.name for p in out.iterdir()) == ["c"]
    finally:
        if live.poll() is None:
            live.kill()
            live.communicate()


def symbolic_links_named_like_stale_entries(tmp_path: Path, directory: Path) -> list[str]:
    """Entries in ``directory`` named as a dead process's scratch entries, that are (or hold) symbolic links to
    ``tmp_path/precious``: a cleanup must neither follow nor remove them."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("keep me")
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process can have this id
    names = [f".x.padfree-{dead}-0123456789ab", f".y.arrow.padfree-{dead}-0123456789ab.tmp",
             f".z.padfree-{dead}-0123456789ab"]
    (directory / names[0]).symlink_to(precious)  # where a stale work directory would be
    (directory / names[1]).symlink_to(precious / "keep.txt")  # where a stale temporary file would be
    (directory / names[2]).mkdir()  # a real directory, whose lock file is a link
    (directory / names[2] / ".lock").symlink_to(precious / "keep.txt")
    return names


def test_a_killed_pack_dataset_leaves_a_temporary_file_the_next_call_removes(tmp_path, ids_parquet):
    cache = tmp_path / "cache"
    cache.mkdir()
    live = stopped(tmp_path, "library", ids_parquet, cache / "b.arrow")
    try:
        writing = hidden(cache, ".b.arrow.*.tmp")
        assert len(writing) == 1
        size = settled_size(writing[0])
        killed = stopped(tmp_path, "library", ids_parquet, cache / "a.arrow")
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        left = hidden(cache, ".a.arrow.*.tmp")
        assert len(left) == 1 and left[0].stat().st_size > 0
        links = symbolic_links_named_like_stale_entries(tmp_path, cache)

        ds = pack_dataset({"input_ids": [[1, 2, 3], [4, 5]]}, 4, cache_file_name=cache / "c.arrow")
        assert ds[:]["input_ids"] == [[1, 2, 3, 0], [4, 5, 0, 0]]
        assert hidden(cache, ".a.arrow.*") == [], "the killed call's temporary file is removed"
        assert hidden(cache, ".b.arrow.*") == writing and writing[0].stat().st_size == size, "a live one is kept"
        assert sorted(p.name for p in cache.iterdir()) == sorted([writing[0].name, "c.arrow", *links])
        assert (tmp_path / "precious" / "keep.txt").read_text() == "keep me", "a link is never followed"
    finally:
        live.kill()
        live.communicate()


def test_a_file_size_limit_ends_pack_in_one_line_naming_the_file(tmp_path, ids_parquet):
    def limit_file_size() -> None:  # a real write error from the real writer: EFBIG past 1 MB
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    out = tmp_path / "packed"
    proc = subprocess.run([sys.executable, "-m", "padfree", "pack", str(ids_parquet), "-o", str(out), "-q",
                           "--capacity", CAPACITY], capture_output=True, text=True, timeout=600,
                          preexec_fn=limit_file_size)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"padfree: error: {tmp_path}/.packed.padfree-")
    assert "/cache/.packed.arrow.padfree-" in proc.stderr
    assert proc.stderr.endswith(f": File too large (EFBIG, errno {errno.EFBIG})\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, no work directory


def test_a_full_disk_ends_pack_in_one_line_naming_the_file(tmp_path, capsys, monkeypatch, ids_parquet):
    # what pyarrow raises when the device is full: an OSError with the errno and no file name
    def full(self, batch):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(_arrow_writer._Stream, "write_batch", full)
    out = tmp_path / "packed"
    assert main(["pack", str(ids_parquet), "-o", str(out), "-q", "--capacity", CAPACITY]) == 1
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"padfree: error: {tmp_path}/.packed.padfree-") and "/.packed.arrow.padfree-" in stderr
    assert stderr.endswith(": No space left on device (ENOSPC, errno 28)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_full_disk_while_saving_names_the_file_being_written(tmp_path, capsys, monkeypatch):
    import datasets

    def full(self, path, *args, **kwargs):
        Path(path).mkdir()
        raise OSError("Error writing bytes to file. Detail: [errno 28] No space left on device")  # no errno set

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]]}), data)
    assert main(["pack", str(data), "-o", str(tmp_path / "packed"), "-q", "--capacity", "8"]) == 1
    stderr = capsys.readouterr().err
    assert stderr.startswith(f"padfree: error: {tmp_path}/.packed.padfree-") and stderr.count("\n") == 1
    assert stderr.endswith("/output: No space left on device (ENOSPC, errno 28)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.parquet"]


def test_files_the_cli_writes_get_the_users_umask(tmp_path, capsys, monkeypatch):
    from padfree.corpus import load_tokenizer

    data = tmp_path / "lengths.parquet"
    pq.write_table(pa.table({"n": list(range(1, 200))}), data)
    monkeypatch.setenv("PADFREE_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        load_tokenizer()  # converted and cached on first use
        assert main(["analyze", str(data), "--lengths-column", "n", "--capacity", "64",
                     "--plot", str(tmp_path / "lengths.png")]) == 0
        pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5]]}), tmp_path / "ids.parquet")
        assert main(["pack", str(tmp_path / "ids.parquet"), "-o", str(tmp_path / "rows.jsonl"), "-q",
                     "--capacity", "8"]) == 0
    finally:
        os.umask(old)
    capsys.readouterr()
    assert oct((tmp_path / "lengths.png").stat().st_mode & 0o777) == oct(0o644)
    assert oct((tmp_path / "rows.jsonl").stat().st_mode & 0o777) == oct(0o644)
    assert oct((tmp_path / "cache" / "tokenizer-mistral-v1").stat().st_mode & 0o777) == oct(0o755)
