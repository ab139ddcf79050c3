"""Every ``padfree`` command without its optional packages: it runs, or it stops before any work with one line that
names the extra to install — never a traceback.

Each case runs the real command line in a subprocess whose Python cannot import the blocked packages: a
``sitecustomize.py`` on ``PYTHONPATH`` takes the path finder's place in ``sys.meta_path`` and reports the blocked
names (and everything under them) as not found, exactly as if they were not installed
(``importlib.util.find_spec`` returns None, ``import`` raises ``ModuleNotFoundError``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from padfree.cli import COMMANDS, DEMO_PNG

HIDE = '''
import os
import sys
from importlib.machinery import PathFinder

_BLOCKED = frozenset(filter(None, os.environ.get("PADFREE_TEST_BLOCK", "").split(",")))


class _Hiding:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in _BLOCKED):
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args, **kwargs):
        return PathFinder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [_Hiding if finder is PathFinder else finder for finder in sys.meta_path]
'''

#: every optional package a command imports (``google``: protobuf)
OPTIONAL = ("torch", "transformers", "datasets", "pyarrow", "matplotlib", "tqdm", "trl", "mistral_common",
            "sentencepiece", "google")


@pytest.fixture(scope="module")
def hide(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hide")
    (folder / "sitecustomize.py").write_text(HIDE)
    return folder


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A padfree cache shared by the cases that may use a converted tokenizer (the first one converts it)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    # 40 short texts (5-32 tokens): rows of 64 hold several, so the demo's exactness check has boundaries to check
    (folder / "texts.json").write_text(json.dumps([{"text": f"x{i} = {i}\n" * (i % 4 + 1)} for i in range(40)]))
    (folder / "texts.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(5)))
    (folder / "ids.json").write_text(json.dumps([{"input_ids": list(range(1, 3 + i % 17))} for i in range(40)]))
    (folder / "lengths.json").write_text(json.dumps([{"n": 3 + i % 17} for i in range(40)]))
    return folder


def padfree(hide: Path, blocked: tuple[str, ...], *argv: object, cwd: Path,
            cache: Path | None = None) -> subprocess.CompletedProcess:
    """``padfree ARGV`` in a fresh Python that cannot import ``blocked``; ``cache``: the padfree cache (a fresh,
    empty one by default, so that the default tokenizer is converted from mistral-common's file)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")])),
           "PADFREE_TEST_BLOCK": ",".join(blocked), "PADFREE_CACHE": str(cache or cwd / "fresh-cache"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "padfree.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``padfree: error:`` line of a run that stopped, after checking how it stopped."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("padfree: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert proc.stdout == ""
    return errors[0]


def test_the_blocker_hides_packages_as_if_they_were_not_installed(hide, tmp_path):
    script = ("import importlib.util\nassert importlib.util.find_spec('torch') is None\n"
              "try:\n    import torch\nexcept ModuleNotFoundError as e:\n    print(e.name)\nimport numpy")
    env = {**os.environ, "PYTHONPATH": str(hide), "PADFREE_TEST_BLOCK": "torch"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == "torch\n", proc.stderr


def test_help_needs_none_of_the_optional_packages(hide, tmp_path):
    # every command line builds the parsers of all the commands, so these two runs cover each one's arguments
    proc = padfree(hide, OPTIONAL, "--help", cwd=tmp_path)
    assert proc.returncode == 0 and all(name in proc.stdout for name in COMMANDS), proc.stderr
    proc = padfree(hide, OPTIONAL, "verify", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "--model-type" in proc.stdout, proc.stderr


@pytest.mark.parametrize(("blocked", "argv", "message", "extra"), [
    (("torch",), ["verify", "--model-type", "llama"], "padfree verify needs torch", "pip install 'padfree[torch]'"),
    (("transformers",), ["verify", "--model-type", "llama"], "padfree verify needs transformers", "padfree[cli]"),
    # transformers cannot be imported without tqdm: the line names what is missing
    (("tqdm",), ["verify", "--model-type", "llama"], "No module named 'tqdm'", "(it brings tqdm)"),
    (("torch",), ["demo", "--quick", "-o", "out"], "padfree demo needs torch", "padfree[torch]"),
    (("torch",), ["bench", "--quick", "-q"], "padfree bench (its training part", "padfree[torch]"),
    (("datasets",), ["pack", "-o", "out.parquet", "--limit", "3"], "padfree pack needs datasets", "padfree[cli]"),
    (("pyarrow",), ["analyze", "{data}/lengths.json", "--lengths-column", "n"], "needs pyarrow", "padfree[cli]"),
    (("matplotlib",), ["analyze", "--limit", "3", "--plot", "lengths.png"], "padfree analyze --plot needs matplotlib",
     "padfree[cli]"),
    (("transformers",), ["analyze", "--limit", "3"], "padfree analyze (it tokenizes the text) needs transformers",
     "padfree[cli]"),
    (("transformers",), ["bench", "--no-training", "--data", "{data}/texts.json"], "needs transformers",
     "padfree[cli]"),
])
def test_a_missing_package_stops_the_command_up_front(hide, data, tmp_path, blocked, argv, message, extra):
    argv = [a.format(data=data) for a in argv]
    line = one_error_line(padfree(hide, blocked, *argv, cwd=tmp_path))
    assert message in line and extra in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a tokenizer cache


@pytest.mark.parametrize(("blocked", "argv", "message"), [
    # past the up-front checks: a submodule missing from an installed package, or a broken padfree install
    (("pyarrow.json",), ["analyze", "{data}/texts.jsonl", "--capacity", "64"],
     "padfree analyze could not import pyarrow.json (No module named 'pyarrow.json'); install it with: pip install "
     "'padfree[cli]' (it brings pyarrow)"),
    (("padfree.proof.backends",), ["verify", "--model-type", "llama"],
     "padfree verify could not import padfree.proof.backends (No module named 'padfree.proof.backends'); this padfree "
     "installation is incomplete: reinstall padfree"),
])
def test_an_import_error_past_the_checks_is_still_one_line(hide, data, tmp_path, blocked, argv, message):
    line = one_error_line(padfree(hide, blocked, *(a.format(data=data) for a in argv), cwd=tmp_path))
    assert line == f"padfree: error: {message}"


@pytest.mark.parametrize(("blocked", "message"), [
    (("mistral_common",), "mistral-common, which is not installed"),
    (("sentencepiece",), "the conversion needs sentencepiece and protobuf"),
    (("google",), "the conversion needs sentencepiece and protobuf"),
])
def test_the_default_tokenizer_without_its_packages_is_one_line(hide, tmp_path, blocked, message):
    # a fresh cache: the default tokenizer must be converted from mistral-common's SentencePiece file
    line = one_error_line(padfree(hide, blocked, "analyze", "--limit", "3", cwd=tmp_path))
    assert message in line and "padfree[tokenizers]" in line, line


@pytest.mark.slow
def test_analyze_and_pack_run_without_torch_trl_and_matplotlib(hide, data, cache, tmp_path):
    blocked = ("torch", "trl", "matplotlib")
    proc = padfree(hide, blocked, "analyze", data / "texts.json", "--capacity", "128", "--json", cwd=tmp_path,
                   cache=cache)
    assert proc.returncode == 0, proc.stderr
    analysis = json.loads(proc.stdout)
    assert analysis["stats"]["count"] == 40 and analysis["recommended"] > 0 and analysis["plot"] is None
    proc = padfree(hide, blocked, "pack", data / "texts.json", "-o", "packed.parquet", "--capacity", "128", "-q",
                   cwd=tmp_path, cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "40 sequences" in proc.stdout and (tmp_path / "packed.parquet").is_file()


def test_packing_needs_only_numpy_numba_and_pyarrow(hide, data, tmp_path):
    blocked = tuple(m for m in OPTIONAL if m != "pyarrow")
    proc = padfree(hide, blocked, "analyze", data / "lengths.json", "--lengths-column", "n", "--capacity", "32",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "40 sequences" in proc.stdout and "Recommendation: capacity" in proc.stdout
    proc = padfree(hide, OPTIONAL, "bench", "--no-training", "--lengths", "1000", "--json", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["packing"]["synthetic"]["sequences"] == 1000


@pytest.mark.slow
def test_demo_without_matplotlib_trains_and_says_the_picture_is_left_out(hide, data, cache, tmp_path):
    proc = padfree(hide, ("matplotlib",), "demo", "--quick", "--data", data / "texts.json", "--capacity", "64",
                   "--rows", "2", "--tokens", "120", "-q", "-o", "out", cwd=tmp_path, cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "OK at atol=1e-05" in proc.stdout and "Packed trains" in proc.stdout
    assert f"no plot ({DEMO_PNG} needs matplotlib)" in proc.stdout
    assert proc.stderr.splitlines() == [
        f"padfree: note: {DEMO_PNG} was not drawn: matplotlib cannot be imported; pip install 'padfree[cli]' "
        "(it brings matplotlib) draws it"]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bench_without_what_trls_mode_needs_measures_the_other_modes_and_says_so(hide, data, cache, tmp_path):
    # TRL's mode needs trl and datasets (its packing works on a datasets.Dataset); without datasets, trl itself still
    # imports, which is how this mode used to fail after the tokenizing and the model were done. A missing trl takes
    # the same path (and the note names trl).
    proc = padfree(hide, ("datasets",), "bench", "--quick", "--data", data / "texts.json", "--capacity", "64", "--rows",
                   "2", "--tokens", "120", "--lengths", "1000", "--repetitions", "1", "--json", "-q", cwd=tmp_path,
                   cache=cache)
    assert proc.returncode == 0, proc.stderr
    modes = json.loads(proc.stdout)["training"]["modes"]
    assert "trl" not in modes and {"padded", "grouped", "packed"} <= set(modes)
    assert proc.stderr.splitlines() == [
        "padfree: note: TRL's packing was not measured: No module named 'datasets'; pip install 'padfree[cli]' "
        "(it brings datasets) adds it"]
