"""One cache directory, one variable: ``$PADFREE_CACHE_DIR`` for the tokenizer and the certification verdicts alike,
``$PADFREE_CACHE`` read as its deprecated alias."""

from __future__ import annotations

import warnings

import pytest

from padfree import cachedir, corpus


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("PADFREE_CACHE_DIR", "PADFREE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_tokenizer_and_the_certification_read_the_same_variable(clean_env, tmp_path):
    certify = pytest.importorskip("padfree.proof.certify")
    clean_env.setenv("PADFREE_CACHE_DIR", str(tmp_path / "one"))
    assert corpus.cache_dir() == certify.cache_dir() == tmp_path / "one"
    clean_env.setenv("PADFREE_CACHE", str(tmp_path / "old"))  # the new name wins over the alias
    assert corpus.cache_dir() == certify.cache_dir() == tmp_path / "one"


def test_the_former_variable_is_a_deprecated_alias(clean_env, tmp_path):
    certify = pytest.importorskip("padfree.proof.certify")
    clean_env.setenv("PADFREE_CACHE", str(tmp_path / "old"))
    for where in (corpus.cache_dir, certify.cache_dir):
        with pytest.warns(DeprecationWarning, match=r"\$PADFREE_CACHE is deprecated: set \$PADFREE_CACHE_DIR"):
            assert where() == tmp_path / "old"


def test_defaults_expand_the_home_directory(clean_env, tmp_path):
    clean_env.setenv("HOME", str(tmp_path))
    clean_env.setenv("PADFREE_CACHE_DIR", "~/cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cachedir.cache_dir() == tmp_path / "cache"
    clean_env.delenv("PADFREE_CACHE_DIR")
    assert cachedir.cache_dir() == tmp_path / ".cache" / "padfree"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cachedir.cache_dir() == tmp_path / "xdg" / "padfree"
