"""The embedded corpus and the offline tokenizer, on the real files of this Python and mistral-common."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest

from padfree.corpus import (
    EXCLUDED_STDLIB_DIRS,
    cache_dir,
    embedded_corpus,
    load_tokenizer,
    stdlib_source_paths,
    token_lengths,
)
from padfree.errors import InvalidArgumentError, TokenizerLoadError


def test_embedded_corpus_is_the_stdlib_sources_then_the_pydoc_topics():
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = stdlib_source_paths()
    rel = [p.relative_to(root).as_posix() for p in paths]
    assert rel == sorted(rel)
    assert "argparse.py" in rel and "json/decoder.py" in rel
    assert not any(EXCLUDED_STDLIB_DIRS & set(r.split("/")[:-1]) for r in rel)
    assert "pydoc_data/topics.py" not in rel  # its documents come one by one instead
    docs = embedded_corpus()
    assert len(docs) == len(paths) + len(topics)
    assert docs[rel.index("argparse.py")] == (root / "argparse.py").read_text(encoding="utf-8")
    assert docs[len(paths) :] == [topics[k] for k in sorted(topics)]


def test_default_tokenizer_is_cached_atomically_and_reloaded(tmp_path, monkeypatch):
    monkeypatch.setenv("PADFREE_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    first = load_tokenizer()
    target = tmp_path / "cache" / "tokenizer-mistral-v1"
    assert (target / "tokenizer.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["tokenizer-mistral-v1"]  # no temporary left over
    second = load_tokenizer()
    texts = ["def f(x):\n    return x", "Natalia sold clips to 48 of her friends in April.", ""]
    assert len(first) == len(second) == 32000
    assert token_lengths(texts, first).tolist() == token_lengths(texts, second).tolist()
    # loaded as the fast tokenizer of the cached tokenizer.json: the ids of the LlamaTokenizer that converted it
    import transformers

    converting = transformers.LlamaTokenizer.from_pretrained(str(target))
    assert first(texts)["input_ids"] == converting(texts)["input_ids"]
    assert (first.bos_token_id, first.eos_token_id, first.unk_token_id) == (
        converting.bos_token_id, converting.eos_token_id, converting.unk_token_id)

    # a corrupt cache is converted again and replaced, not trusted
    (target / "tokenizer.json").write_text("{not json")
    third = load_tokenizer()
    assert token_lengths(texts, third).tolist() == token_lengths(texts, first).tolist()
    assert (target / "tokenizer.json").read_text().startswith("{")
    assert sorted(p.name for p in target.parent.iterdir()) == ["tokenizer-mistral-v1"]


def test_xdg_cache_home_is_honoured(tmp_path, monkeypatch):
    monkeypatch.delenv("PADFREE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "padfree"


def test_token_lengths_count_tokens_without_special_tokens():
    tokenizer = load_tokenizer()
    texts = [f"word {i} " * (i + 1) for i in range(37)]
    expected = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    got = token_lengths(texts, tokenizer, batch_size=8)
    assert got.dtype == np.int64
    assert got.tolist() == expected
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        token_lengths(texts, tokenizer, batch_size=0)


def test_tokenizer_directory_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerLoadError, match=f"{missing}.*does not exist"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerLoadError, match=f"{empty}.*is empty"):
        load_tokenizer(empty)
    (empty / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(TokenizerLoadError, match=f"{empty}.*could not be loaded"):
        load_tokenizer(empty)
    a_file = tmp_path / "tok.json"
    a_file.write_text("{}")
    with pytest.raises(TokenizerLoadError, match="not a directory"):
        load_tokenizer(a_file)


def test_a_saved_tokenizer_directory_loads(tmp_path):
    load_tokenizer().save_pretrained(str(tmp_path / "tok"))
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert token_lengths(["hello world"], tokenizer).tolist() == [3]
