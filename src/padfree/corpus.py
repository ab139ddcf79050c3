r"""Real text that ships with every Python, and a real tokenizer that works offline.

``padfree analyze`` without arguments (the README's first command) and, later, ``padfree demo`` need a corpus
and a tokenizer on a machine with no network. Both already sit on disk:

- the **embedded corpus** is CPython's own standard library — its ``.py`` sources, a long-tailed mix of a few
  dozen to ~100k tokens per file — plus the English reference documents of ``pydoc_data.topics`` (the text
  ``help("with")`` shows). Nobody here wrote it, it is identical on every install of the same Python version,
  and it needs no download;
- the **default tokenizer** is the 32k SentencePiece model that ``mistral-common`` ships
  (``mistral_common/data/tokenizer.model.v1``, the vocabulary of Mistral 7B v0.1), converted once by
  ``transformers`` into a fast tokenizer and cached on disk. It carries :data:`CHAT_TEMPLATE`, padfree's own
  Jinja chat template in Mistral v0.1's ``[INST] ... [/INST]`` format, so that chat data (a ``messages`` column,
  conversational prompt-completion) works offline too: ``tokenizer.apply_chat_template``, TRL's
  ``assistant_only_loss=True`` and :func:`encode_chat`.

>>> docs = embedded_corpus()
>>> len(docs) > 500, all(isinstance(d, str) for d in docs)
(True, True)
>>> tokenizer = load_tokenizer()
>>> len(tokenizer)
32000
>>> token_lengths(["def f(x):\n    return x", "hello world"], tokenizer).tolist()
[9, 3]
>>> tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
...                               tokenize=False)
'<s>[INST] 2+2? [/INST] 4</s>'
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import re
import shutil
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from padfree import cachedir
from padfree.data._scratch import umask
from padfree.errors import InvalidArgumentError, InvalidSampleError, TokenizerLoadError

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_TOKENIZER_NAME",
    "EXCLUDED_STDLIB_DIRS",
    "cache_dir",
    "embedded_corpus",
    "embedded_corpus_description",
    "encode",
    "encode_chat",
    "load_tokenizer",
    "stdlib_source_paths",
    "token_lengths",
]

logger = logging.getLogger("padfree")

#: Directory names skipped anywhere under the standard library. ``site-packages``/``dist-packages`` hold
#: third-party code (whatever happens to be installed), not CPython's; the test suites (``test``, ``tests``,
#: ``idle_test``) are ~1,000 files of mostly generated fixtures that would triple the tokenizing time and skew
#: the length distribution towards test boilerplate.
EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

#: ``pydoc_data/topics.py`` *is* the pydoc topics, as one 750 kB Python literal; they are included one
#: document per topic instead, so the file itself is skipped rather than counted twice.
_EXCLUDED_STDLIB_FILES = frozenset({"pydoc_data/topics.py"})

DEFAULT_TOKENIZER_NAME = "mistral-common tokenizer.model.v1 (32k SentencePiece, Mistral 7B v0.1)"
_DEFAULT_TOKENIZER_CACHE = "tokenizer-mistral-v1"

#: The chat template the default tokenizer carries: a Jinja string written for padfree (the SentencePiece model has
#: none), in Mistral 7B v0.1's format — ``<s>[INST] user [/INST] assistant</s>[INST] user [/INST] assistant</s>``,
#: a system message prepended to the next user message, roles other than system / user / assistant refused. Each
#: assistant turn (its leading space, its text and its ``</s>``) sits inside ``{% generation %}`` markers, which is
#: how ``apply_chat_template(..., return_assistant_tokens_mask=True)`` — and so TRL's ``assistant_only_loss=True``
#: and :func:`encode_chat` — finds the tokens to train on. ``[INST]`` is plain text in this 32k vocabulary (a few
#: tokens), as it was for Mistral 7B v0.1. The generation prompt is empty: an assistant turn starts right after
#: ``[/INST]``.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}"
    "{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- ' ' + message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- raise_exception('this chat template accepts the roles system, user and assistant, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


# --------------------------------------------------------------------------------------------------
# The embedded corpus
# --------------------------------------------------------------------------------------------------


def stdlib_source_paths() -> list[Path]:
    """The standard library's ``.py`` files that :func:`embedded_corpus` reads, sorted by relative path.

    Everything under ``sysconfig.get_paths()["stdlib"]``, recursively, except the directories named in
    :data:`EXCLUDED_STDLIB_DIRS` and ``pydoc_data/topics.py``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_STDLIB_DIRS.isdisjoint(rel.parts[:-1]) and rel.as_posix() not in _EXCLUDED_STDLIB_FILES:
            found.append((rel.as_posix(), path))
    # sort on the relative POSIX path so that the order does not depend on the filesystem or the install prefix
    return [path for _, path in sorted(found)]


def _pydoc_topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def embedded_corpus() -> list[str]:
    """Every document of the embedded corpus, in a fixed order.

    The standard library's sources (see :func:`stdlib_source_paths`), each file one document read as UTF-8
    with undecodable bytes replaced, followed by every document of ``pydoc_data.topics.topics`` sorted by
    topic name. Empty files (several ``__init__.py``) are kept: callers that need positive lengths skip them.

    Returns:
        ``list[str]`` — about 800 documents (734 files + 79 topics on CPython 3.11), ~12 MB of text.
    """
    texts = [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_source_paths()]
    topics = _pydoc_topics()
    texts.extend(topics[name] for name in sorted(topics))
    return texts


def embedded_corpus_description() -> str:
    """One line saying what :func:`embedded_corpus` holds on this Python."""
    version = sysconfig.get_python_version()
    return (
        f"CPython {version} standard library ({len(stdlib_source_paths())} .py files) "
        f"+ pydoc topics ({len(_pydoc_topics())} documents)"
    )


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where padfree caches derived files (:func:`padfree.cachedir.cache_dir`: ``$PADFREE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/padfree``, else ``~/.cache/padfree``). Nothing is created here."""
    return cachedir.cache_dir()


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TokenizerLoadError(
            f"loading a tokenizer needs transformers, which could not be imported ({exc}); "
            "install it with: pip install 'padfree[tokenizers]'"
        ) from exc
    return transformers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """A Hugging Face tokenizer, loaded without any network access.

    Args:
        path: a directory written by ``tokenizer.save_pretrained`` (loaded with
            ``transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)``). ``None`` loads the
            default tokenizer, :data:`DEFAULT_TOKENIZER_NAME`: the first call converts mistral-common's
            SentencePiece model and caches the result in ``cache_dir() / "tokenizer-mistral-v1"`` (written
            atomically, so a concurrent or interrupted run never leaves a half-written cache); later calls load
            the cache. An unwritable cache directory only costs the conversion again next time.

    Returns:
        A ``transformers`` tokenizer.

    Raises:
        TokenizerLoadError: the directory does not exist, is not a directory, or transformers cannot load it;
            or a needed package (transformers, sentencepiece, mistral-common) is missing.
    """
    if path is not None:
        return _load_directory(path)
    target = cache_dir() / _DEFAULT_TOKENIZER_CACHE
    transformers = _import_transformers()
    tokenizer = _load_cached(transformers, target)
    if tokenizer is None:
        converted = _build_default_tokenizer(transformers, target)
        tokenizer = _load_cached(transformers, target) or converted
    # set on every load, not only in the cache: a cache written before the template existed has none
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _load_cached(transformers: Any, target: Path) -> Any:
    """The converted default tokenizer cached in ``target``, or ``None`` (no cache, or an unreadable one).

    Loaded as the fast tokenizer of its ``tokenizer.json`` rather than the ``LlamaTokenizer`` that converted it: the
    same ids and special tokens, but the converting class also keeps the 32k vocabulary and merges as Python
    objects, which makes it slower to load and about 20 times slower for ``datasets`` to fingerprint (every
    ``Dataset.map`` given the tokenizer hashes it: 0.6 s against 0.03 s, several times per TRL trainer built)."""
    if not (target / "tokenizer.json").is_file():
        return None
    try:
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(target), local_files_only=True)
    except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError, JSON errors)
        logger.warning("the cached tokenizer in %s is unreadable (%s); converting it again", target, _first_line(exc))
        return None


def _load_directory(path: str | os.PathLike[str]) -> Any:
    directory = Path(path).expanduser()
    accepted = "a directory written by tokenizer.save_pretrained (tokenizer.json and/or tokenizer.model)"
    if not directory.exists():
        raise TokenizerLoadError(f"tokenizer directory {str(path)!r} does not exist; expected {accepted}")
    if not directory.is_dir():
        raise TokenizerLoadError(f"tokenizer path {str(path)!r} is a file, not a directory; expected {accepted}")
    if not any(directory.iterdir()):
        raise TokenizerLoadError(f"tokenizer directory {str(path)!r} is empty; expected {accepted}")
    transformers = _import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # see load_tokenizer: any failure here means "this directory is not a tokenizer"
        raise TokenizerLoadError(
            f"tokenizer directory {str(path)!r} could not be loaded ({_first_line(exc)}); expected {accepted}"
        ) from exc


def _mistral_model_file() -> Path:
    try:
        data = importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    except ModuleNotFoundError as exc:
        raise TokenizerLoadError(
            "the default tokenizer comes from mistral-common, which is not installed; install it with "
            "pip install 'padfree[tokenizers]', or pass a tokenizer directory"
        ) from exc
    model = Path(str(data))
    if not model.is_file():
        raise TokenizerLoadError(f"mistral-common is installed but {model} is missing; reinstall mistral-common")
    return model


def _build_default_tokenizer(transformers: Any, target: Path) -> Any:
    model = _mistral_model_file()
    with tempfile.TemporaryDirectory(prefix="padfree-spm-") as tmp:
        # LlamaTokenizer looks for exactly "tokenizer.model"; a symlink avoids copying 490 kB
        link = Path(tmp) / "tokenizer.model"
        try:
            link.symlink_to(model)
        except OSError:
            shutil.copyfile(model, link)
        try:
            tokenizer = transformers.LlamaTokenizer.from_pretrained(tmp, local_files_only=True)
        except Exception as exc:
            raise TokenizerLoadError(
                f"converting {model} with transformers.LlamaTokenizer failed ({_first_line(exc)}); "
                "the conversion needs sentencepiece and protobuf: pip install 'padfree[tokenizers]'"
            ) from exc
    try:
        _save_atomically(tokenizer, target)
    except OSError as exc:
        logger.warning("could not cache the tokenizer in %s (%s); it will be converted again next time", target, exc)
    return tokenizer


def _save_atomically(tokenizer: Any, target: Path) -> None:
    """Write ``tokenizer`` to ``target`` so that readers see either no directory or a complete one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # a sibling temporary directory: same filesystem, so the final rename is atomic
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes it 0700; the cache gets the mode any new directory gets
        tokenizer.save_pretrained(str(tmp))
        if target.exists():
            # an unreadable old cache: move it out of the way with one rename before deleting it,
            # so that the name never points at a half-deleted directory
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished first (rename onto a non-empty directory fails): its cache is complete
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def encode(texts: Sequence[str], tokenizer: Any, *, add_special_tokens: bool = False, offsets: bool = False) -> Any:
    """Token ids of every text in one tokenizer call (what :func:`token_lengths` counts and ``padfree pack`` packs).

    Args:
        texts: ``(n,)`` strings.
        tokenizer: a Hugging Face tokenizer.
        add_special_tokens: let the tokenizer add its own special tokens (e.g. a BOS token); off by default, so
            that a text's tokens are the text and nothing else.
        offsets: also return ``offset_mapping`` — per token, the ``(start, end)`` character span it covers in its
            text (fast tokenizers only).

    Returns:
        The tokenizer's ``BatchEncoding``: ``input_ids`` (``n`` lists of ints) and, with ``offsets=True``,
        ``offset_mapping`` (``n`` lists of ``(start, end)`` pairs). No attention mask, no token type ids.

    >>> encoded = encode(["Hello world", "x"], load_tokenizer(), offsets=True)
    >>> encoded["input_ids"], encoded["offset_mapping"]
    ([[22557, 1526], [1318]], [[(0, 5), (5, 11)], [(0, 1)]])
    """
    # verbose=False: a text longer than the model's maximum is fine here; packing decides what to do with it
    return tokenizer(
        list(texts),
        add_special_tokens=add_special_tokens,
        return_attention_mask=False,
        return_token_type_ids=False,
        return_offsets_mapping=offsets,
        verbose=False,
    )


def encode_chat(conversations: Sequence[Any], tokenizer: Any, *, prompts: Sequence[Any] | None = None) -> dict:
    """Token ids and assistant masks of every conversation, through the tokenizer's own chat template.

    Args:
        conversations: ``(n,)`` conversations, each a list of messages ``{"role": ..., "content": ...}`` (TRL's
            ``messages`` column).
        tokenizer: a fast Hugging Face tokenizer whose ``chat_template`` marks the assistant turns with
            ``{% generation %}`` (the default tokenizer's :data:`CHAT_TEMPLATE` does).
        prompts: ``(n,)`` the first messages of each conversation that are a prompt (TRL's conversational
            prompt-completion): the tokens they render to are not targets even where an assistant turn is among
            them. The template must render a prompt as a prefix of its whole conversation.

    Returns:
        ``{"input_ids": n lists of ints, "assistant_masks": n lists of 0/1}`` — 1 on the tokens of the assistant
        turns (outside ``prompts``), the tokens a model trains on; the template's special tokens are in the ids.

    Raises:
        TokenizerLoadError: the tokenizer has no chat template, one without ``{% generation %}`` markers, or is
            not a fast tokenizer.
        InvalidSampleError: the template refuses a conversation (it names which), or a prompt does not render as
            a prefix of its conversation.

    >>> out = encode_chat([[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]],
    ...                   load_tokenizer())
    >>> out["input_ids"], out["assistant_masks"]
    ([[1, 28792, 16289, 28793, 15359, 733, 28748, 16289, 28793, 22557, 2]], [[0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1]])
    """
    template = getattr(tokenizer, "chat_template", None)
    name = type(tokenizer).__name__
    if not template:
        raise TokenizerLoadError(f"the tokenizer ({name}) has no chat template, so chat data cannot be turned into "
                                 "tokens; give a tokenizer that has one (padfree's default tokenizer carries "
                                 "padfree.corpus.CHAT_TEMPLATE)")
    if not isinstance(template, str) or not _GENERATION.search(template):
        raise TokenizerLoadError(f"the tokenizer's ({name}) chat template has no {{% generation %}} markers, so the "
                                 "assistant turns (the tokens to train on) cannot be found; add them around each "
                                 "assistant turn, as padfree.corpus.CHAT_TEMPLATE does")
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerLoadError(f"finding the assistant turns needs a fast tokenizer (character offsets); {name} is "
                                 "not one")
    conversations = list(conversations)
    out = _apply_template(tokenizer, conversations, mask=True)
    ids, masks = out["input_ids"], out["assistant_masks"]
    if prompts is not None:
        prompt_ids = _apply_template(tokenizer, list(prompts), mask=False)["input_ids"]
        for i, (head, row) in enumerate(zip(prompt_ids, ids, strict=True)):
            if row[:len(head)] != head:
                raise InvalidSampleError(f"conversation {i}: its prompt does not render as the start of the whole "
                                         "conversation under this chat template, so the prompt's tokens cannot be "
                                         "told apart from the completion's")
            masks[i][:len(head)] = [0] * len(head)
    return {"input_ids": ids, "assistant_masks": masks}


def _apply_template(tokenizer: Any, conversations: list[Any], *, mask: bool) -> Any:
    try:
        return tokenizer.apply_chat_template(conversations, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=mask)
    except Exception as exc:  # jinja's TemplateError (raise_exception), a KeyError for a message without 'role', ...
        if len(conversations) > 1:  # find the conversation the template refuses
            for i, conversation in enumerate(conversations):
                try:
                    tokenizer.apply_chat_template(conversation, tokenize=False)
                except Exception as one:
                    raise InvalidSampleError(f"conversation {i} cannot be rendered by the chat template "
                                             f"({_first_line(one)}); expected a list of messages "
                                             "{'role': ..., 'content': ...}") from one
        raise InvalidSampleError(f"the chat template cannot render the conversation ({_first_line(exc)}); expected "
                                 "a list of messages {'role': ..., 'content': ...}") from exc


def token_lengths(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    batch_size: int = 256,
    progress: bool | None = False,
) -> np.ndarray:
    """The number of tokens of every text, without special tokens.

    Args:
        texts: ``(n,)`` strings.
        tokenizer: a Hugging Face tokenizer (fast ones encode each batch on all cores).
        batch_size: texts per tokenizer call; larger batches amortize the call overhead.
        progress: show a tqdm progress bar on stderr; ``None`` shows it only when stderr is a terminal.

    Returns:
        ``(n,) int64`` — ``len(tokenizer(text, add_special_tokens=False)["input_ids"])`` for every text.
        An empty text has length 0.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    n = len(texts)
    lengths = np.zeros(n, np.int64)
    bar = None
    if progress is not False:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, unit="doc", desc="tokenizing", disable=None if progress is None else False)
    try:
        for start in range(0, n, batch_size):
            batch = [str(text) for text in texts[start : start + batch_size]]
            ids = encode(batch, tokenizer)["input_ids"]
            lengths[start : start + len(batch)] = np.fromiter(map(len, ids), np.int64, count=len(batch))
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    return lengths
