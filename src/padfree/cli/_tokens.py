"""Tokenizers and tokenizing for the commands: ``--tokenizer`` loaded and named, texts turned into token ids.

``pack`` tokenizes a whole dataset with ``datasets.map`` (in processes, into an Arrow file, with prompt-masked labels
for ``--completion-field``); ``demo`` and ``bench`` tokenize a list of texts in memory.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from padfree.cli._columns import Chat, join_text
from padfree.cli._output import bar
from padfree.data._scratch import with_path
from padfree.errors import OverlongSequenceError

#: how the commands say what ``--overlong`` offers instead of refusing
OVERLONG_CHOICES = ("--overlong truncate (keep the first CAPACITY tokens), split (cut into pieces of CAPACITY) or "
                    "drop (leave it out)")


def overlong_error(source: str, record: int, tokens: int, capacity: int, counted: str) -> OverlongSequenceError:
    """The one refusal of a record longer than ``--capacity`` under ``--overlong error``, in the command's terms.

    ``counted``: how many are longer (``"3 of 100 records are longer, the longest has 9,000"``), or where the search
    stopped.
    """
    return OverlongSequenceError(f"{source}: record {record} has {tokens:,} tokens, more than --capacity {capacity:,} "
                                 f"({counted}); raise --capacity or pass {OVERLONG_CHOICES}")


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """The tokenizer of ``--tokenizer`` (None: the default one) and the name the reports give it."""
    from padfree import corpus

    tokenizer = corpus.load_tokenizer(path)
    name = corpus.DEFAULT_TOKENIZER_NAME if path is None else f"{path} ({type(tokenizer).__name__})"
    return tokenizer, name


def token_ids(texts: list[str], tokenizer: Any, batch_size: int = 64,
              say: Callable[[str], None] | None = None) -> list[list[int]]:
    """The token ids of every text (no special tokens), with a progress bar over the texts. ``say``: told, after the
    first batch, about how long the rest will take (from its characters per second)."""
    import time

    from padfree import corpus

    ids: list[list[int]] = []
    progress = bar(len(texts), "tokenizing", "doc")
    started = time.perf_counter()
    try:
        for start in range(0, len(texts), batch_size):
            batch = [str(t) for t in texts[start:start + batch_size]]
            ids.extend(corpus.encode(batch, tokenizer)["input_ids"])
            progress.update(len(batch))
            if say is not None and start == 0 and len(texts) > batch_size:
                rate = sum(map(len, batch)) / max(time.perf_counter() - started, 1e-6)
                rest = sum(len(str(t)) for t in texts[batch_size:]) / rate
                say(f"tokenizing: about {max(1, round(rest))} s for the remaining {len(texts) - batch_size:,} texts")
    finally:
        progress.close()
    return ids


def chat_lengths(table: Any, chat: Chat, tokenizer: Any, batch_size: int = 256) -> list[int]:
    """The number of tokens of every conversation of ``table`` through the tokenizer's chat template, with a progress
    bar over the records (``analyze --chat``)."""
    from padfree import corpus

    lengths: list[int] = []
    progress = bar(table.num_rows, "tokenizing", "rec")
    try:
        for start in range(0, table.num_rows, batch_size):
            conversations, prompts = chat.conversations(table.slice(start, batch_size))
            ids = _encode_chat(corpus, conversations, tokenizer, prompts, start)["input_ids"]
            lengths.extend(map(len, ids))
            progress.update(len(ids))
    finally:
        progress.close()
    return lengths


def _encode_chat(corpus: Any, conversations: list[Any], tokenizer: Any, prompts: list[Any] | None,
                 first: int) -> dict:
    """:func:`padfree.corpus.encode_chat`, its refusal of one conversation naming the record (``first``: the record of
    ``conversations[0]``)."""
    from padfree.errors import InvalidSampleError

    try:
        return corpus.encode_chat(conversations, tokenizer, prompts=prompts)
    except InvalidSampleError as exc:
        text = str(exc)
        if text.startswith("conversation "):
            index, _, rest = text[len("conversation "):].partition(" ")
            if index.isdigit():
                raise InvalidSampleError(f"record {first + int(index)} {rest}") from exc
        raise


def tokenize_dataset(ds: Any, tokenizer: Any, *, prompt: list[str], completion: str | None, add_special_tokens: bool,
                     eos: int | None, num_proc: int, cache: Path, refuse_over: tuple[int, str] | None = None,
                     chat: Chat | None = None) -> Any:
    """``ds`` tokenized into a dataset of ``input_ids`` (and ``labels`` with a ``completion`` column, or chat data).

    ``prompt``: the text columns joined with newlines (then the completion, when there is one: only its tokens are
    targets). ``chat``: instead, conversations through the tokenizer's chat template, the assistant turns the only
    targets. ``eos``: a token appended to every row (a target). The rows are written to ``cache/tokenized.arrow``.
    ``refuse_over``: ``(capacity, source)`` — stop at the first batch holding a record longer than ``capacity``
    (:func:`overlong_error`, naming the record of ``source``) instead of tokenizing the rest first.
    """
    function = functools.partial(_tokenize_batch, tokenizer=tokenizer, prompt=prompt, completion=completion,
                                 add_special_tokens=add_special_tokens, eos=eos, refuse_over=refuse_over, chat=chat)
    try:
        return ds.with_format("arrow").map(
            function, batched=True, batch_size=1000, num_proc=num_proc if num_proc > 1 else None, with_indices=True,
            remove_columns=ds.column_names, cache_file_name=str(cache / "tokenized.arrow"), load_from_cache_file=False,
            new_fingerprint=uuid.uuid4().hex, desc="tokenizing",
        ).with_format(None)
    except OSError as exc:  # a full disk while writing the tokenized rows: name the file (padfree.cli.main)
        raise with_path(exc, cache / "tokenized.arrow") from exc


def _tokenize_batch(batch: Any, indices: list[int], *, tokenizer: Any, prompt: list[str], completion: str | None,
                    add_special_tokens: bool, eos: int | None, refuse_over: tuple[int, str] | None = None,
                    chat: Chat | None = None) -> Any:
    """One ``datasets.map`` batch (a ``pyarrow.Table``; ``indices``: its records) -> ``input_ids`` (and ``labels``
    with a completion or chat data)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from padfree import corpus
    from padfree.layout import IGNORE_INDEX

    if chat is not None:
        conversations, prompts = chat.conversations(batch)
        encoded = _encode_chat(corpus, conversations, tokenizer, prompts, int(indices[0]) if indices else 0)
        ids_array = pa.array(encoded["input_ids"], pa.list_(pa.int32()))
        _refuse_over(ids_array, indices, refuse_over)
        masks = pa.array(encoded["assistant_masks"], pa.list_(pa.int8())).values.to_numpy(zero_copy_only=False)
        labels = np.where(masks.astype(bool), ids_array.values.to_numpy(), IGNORE_INDEX).astype(np.int32)
        return pa.table({"input_ids": ids_array, "labels": pa.ListArray.from_arrays(ids_array.offsets, labels)})

    boundary = None  # (rows,) — the character where the completion starts; tokens before it are not targets
    if completion is None:
        texts = join_text(batch, prompt)
    else:
        answer = pc.fill_null(batch[completion], "")
        if prompt:
            question = join_text(batch, prompt)
            texts = pc.binary_join_element_wise(question, answer, "\n")
            boundary = pc.utf8_length(question).to_numpy(zero_copy_only=False).astype(np.int64) + 1
        else:
            texts = answer
            boundary = np.zeros(batch.num_rows, np.int64)
    encoded = corpus.encode(texts.to_pylist(), tokenizer, add_special_tokens=add_special_tokens,
                            offsets=boundary is not None)
    ids = encoded["input_ids"]
    if eos is not None:
        for row in ids:
            row.append(eos)
    ids_array = pa.array(ids, pa.list_(pa.int32()))
    _refuse_over(ids_array, indices, refuse_over)
    if boundary is None:
        return pa.table({"input_ids": ids_array})
    spans = encoded["offset_mapping"]
    if eos is not None:  # the EOS sits after the text: a target
        ends = pc.utf8_length(texts).to_pylist()
        for row, end in zip(spans, ends, strict=True):
            row.append((end, end))
    starts = pa.array(spans, pa.list_(pa.list_(pa.int64(), 2))).flatten().flatten().to_numpy()[::2]
    counts = pc.list_value_length(ids_array).to_numpy(zero_copy_only=False)
    targets = starts >= np.repeat(boundary, counts)
    labels = np.where(targets, ids_array.values.to_numpy(), IGNORE_INDEX).astype(np.int32)
    return pa.table({"input_ids": ids_array, "labels": pa.ListArray.from_arrays(ids_array.offsets, labels)})


def _refuse_over(ids: Any, indices: list[int], refuse_over: tuple[int, str] | None) -> None:
    """Stop at the first record of this batch longer than the capacity (:func:`overlong_error`)."""
    if refuse_over is None:
        return
    import numpy as np
    import pyarrow.compute as pc

    capacity, source = refuse_over
    lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
    if lengths.size and lengths.max() > capacity:
        i = int(np.argmax(lengths > capacity))
        raise overlong_error(source, int(indices[i]), int(lengths[i]), capacity,
                             f"found while tokenizing, which stopped there: {int((lengths > capacity).sum())} of "
                             f"the {len(indices):,} records {indices[0]}..{indices[-1]} are longer")
