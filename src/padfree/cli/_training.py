"""What ``demo`` and ``bench`` share: their training arguments, the tokenized sample, the model, the timed runs.

Both train the same real tokens several ways (:mod:`padfree.throughput`): the embedded corpus or ``--data``,
tokenized in memory; a small Llama from a config or ``--model``; every mode from the same initial weights.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from padfree.cli._columns import texts_from_columns
from padfree.cli._inputs import DATA_FORMATS, check_data_path, optional_positive, read_table
from padfree.cli._output import Progress, bar
from padfree.cli._tokens import load_tokenizer, token_ids
from padfree.errors import DataLoadError, InvalidArgumentError

if TYPE_CHECKING:  # numpy is imported where it is used: a usage error costs no import
    import numpy as np

#: The demo's model when no ``--model`` is given: a small Llama with random weights (vocab = the tokenizer's).
DEMO_MODEL = {"full": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
              "quick": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2)}
#: (capacity, rows, tokens, repetitions) of a full and a --quick run.
_DEFAULTS = {"demo": {"full": (1024, 8, 16384, 3), "quick": (256, 4, 1536, 1)},
             "bench": {"full": (512, 8, 8192, 3), "quick": (256, 4, 1536, 1)}}


def add_training_args(p: Any, command: str) -> None:
    """The ``data`` and ``training`` arguments of ``command`` (``demo`` or ``bench``), and ``--quick``."""
    full, quick = _DEFAULTS[command]["full"], _DEFAULTS[command]["quick"]
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="FILE",
                   help=f"train on this dataset instead of the embedded corpus: {DATA_FORMATS}")
    g.add_argument("--field", action="append", dest="fields", metavar="F",
                   help="text column of --data (repeat for several, joined with newlines); default: 'text' if "
                        "present, else every string column")
    g.add_argument("--tokenizer", metavar="DIR",
                   help="a tokenizer directory (save_pretrained); default: mistral-common's 32k SentencePiece")
    g.add_argument("--limit", type=int, metavar="N", help="use only the first N records (or documents)")
    g = p.add_argument_group("training")
    g.add_argument("--model", metavar="DIR",
                   help="a local causal-LM checkpoint (save_pretrained); default: a small Llama from a config with "
                        "random weights")
    g.add_argument("--capacity", type=int, help=f"tokens per packed row, the longest padded row (default: {full[0]}; "
                                                 f"--quick: {quick[0]})")
    g.add_argument("--rows", type=int, help=f"batch size: sequences per padded batch, rows per packed step "
                                             f"(default: {full[1]}; --quick: {quick[1]})")
    g.add_argument("--tokens", type=int, help=f"real tokens every mode trains per pass (default: {full[2]:,}; "
                                               f"--quick: {quick[2]:,})")
    g.add_argument("--repetitions", type=int,
                   help=f"timed passes per mode, interleaved; the median is reported (default: {full[3]}; "
                        f"--quick: {quick[3]})")
    g.add_argument("--seed", type=int, default=0, help="seed of the sample, the orders and the weights (default: 0)")
    g.add_argument("--threads", type=int, help="torch threads for every mode (default: torch's own choice)")
    p.add_argument("--quick", action="store_true", help="a small run: a slice of the corpus, a tiny model, few tokens")


@dataclass(frozen=True)
class TrainingOptions:
    """The checked training arguments of ``demo`` / ``bench``, defaults filled in."""

    capacity: int
    rows: int
    tokens: int
    repetitions: int
    seed: int
    threads: int | None
    limit: int | None
    quick: bool


def training_options(args: argparse.Namespace, command: str) -> TrainingOptions:
    """The ``demo`` / ``bench`` training arguments checked (every cheap check first) with their defaults filled."""
    if args.data is not None:  # a missing file first of all, before the packing engine (numba) is imported
        check_data_path(args.data, "--data")
    from padfree.packing.inputs import as_positive_int, as_seed

    defaults = _DEFAULTS[command]["quick" if args.quick else "full"]
    values = []
    for flag, value, default in zip(("--capacity", "--rows", "--tokens", "--repetitions"),
                                    (args.capacity, args.rows, args.tokens, args.repetitions), defaults, strict=True):
        values.append(default if value is None else as_positive_int(value, flag))
    if args.data is None and args.fields:
        raise InvalidArgumentError("--field needs --data: the embedded corpus has no columns")
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise InvalidArgumentError(f"--model {args.model!r} is not a directory; expected a checkpoint written by "
                                   "save_pretrained (config.json and the weights)")
    return TrainingOptions(*values, seed=as_seed(args.seed, "--seed"),
                           threads=optional_positive(args.threads, "--threads"),
                           limit=optional_positive(args.limit, "--limit"), quick=args.quick)


@dataclass
class Prepared:
    """What ``demo`` and ``bench`` train on: the token ids, where they came from, the tokenizer's vocabulary."""

    ids: Any  # TokenBuffers of the non-empty sequences
    lengths: np.ndarray
    source: str
    tokenizer_name: str
    vocab: int
    skipped: int


def prepare(args: argparse.Namespace, opts: TrainingOptions, say: Progress) -> Prepared:
    """Read the texts (``--data`` or the embedded corpus), tokenize them, keep the non-empty ones."""
    from padfree.samples import read_tokens

    texts, source = _texts(args, opts)  # a bad --data or --field fails here, before the tokenizer loads
    say("loading the tokenizer")
    tokenizer, name = load_tokenizer(args.tokenizer)
    say(f"tokenizing {len(texts):,} texts")
    ids = [x for x in token_ids(texts, tokenizer) if x]
    if not ids:
        raise DataLoadError(f"every one of the {len(texts):,} texts is empty: nothing to train on")
    buf = read_tokens(ids)
    return Prepared(buf, buf.lengths, source, name, len(tokenizer), len(texts) - len(ids))


def _texts(args: argparse.Namespace, opts: TrainingOptions) -> tuple[list[str], str]:
    from padfree import corpus

    if args.data is None:
        texts = _top_level_blocks(corpus.embedded_corpus())
        source = (f"embedded corpus: {corpus.embedded_corpus_description()}, one sample per top-level block "
                  f"(split at two blank lines, PEP 8's separation of top-level definitions): {len(texts):,}")
        if opts.quick:  # every 8th document: the same kinds of text, an eighth of the tokenizing
            texts = texts[::8]
            source += f", every 8th document (--quick): {len(texts)}"
        if opts.limit is not None:
            texts = texts[:opts.limit]
            source += f", first {len(texts)} documents"
        return texts, source
    data = read_table(args.data, "--data")
    if opts.limit is not None:
        data = data.slice(0, opts.limit)
    texts, note = texts_from_columns(data, args.fields, source=f"--data {args.data!r}")
    return texts, f"{args.data} ({data.num_rows:,} records; {note})"


def _top_level_blocks(documents: list[str]) -> list[str]:
    """Every document cut at two blank lines in a row — in Python sources, the gaps PEP 8 puts between top-level
    functions and classes — so that a sample is one function, class or block of statements (a long-tailed mix,
    like fine-tuning data) rather than a whole module. Blank-only pieces are dropped."""
    gap = re.compile(r"\n\n\n+")
    return [block for doc in documents for block in gap.split(doc) if block.strip()]


def build_model(args: argparse.Namespace, opts: TrainingOptions, vocab: int, ids: Any) -> tuple[Any, str]:
    """The model every mode trains (from the same initial weights), and a line describing it."""
    import torch
    import transformers

    torch.manual_seed(opts.seed)
    if args.model is None:
        sizes = DEMO_MODEL["quick" if opts.quick else "full"]
        config = transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=opts.capacity, **sizes)
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
        where = "a Llama from a config, random weights"
    else:
        bars = transformers.utils.logging.is_progress_bar_enabled()
        if getattr(args, "quiet", False):
            transformers.utils.logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True,
                                                                       attn_implementation="sdpa")
        except Exception as exc:  # transformers raises many types for an unreadable checkpoint
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InvalidArgumentError(f"--model {args.model!r} could not be loaded ({type(exc).__name__}: "
                                       f"{first}); expected a causal-LM checkpoint written by save_pretrained") from exc
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
        where = f"{args.model}"
        top = int(ids.values.max())
        size = model.get_input_embeddings().num_embeddings
        if top >= size:
            raise InvalidArgumentError(f"--model {args.model!r} has {size:,} embeddings but the tokenizer produced "
                                       f"token id {top:,}; pass the model's own tokenizer with --tokenizer")
    model.float()
    c = model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    layers = f"{c.num_hidden_layers} layer{'s' if c.num_hidden_layers != 1 else ''}"
    text = (f"{type(model).__name__} ({where}): {params:.1f}M parameters, hidden {c.hidden_size}, {layers}, "
            f"vocab {model.get_input_embeddings().num_embeddings:,}, fp32, CPU")
    return model, text


def train(model: Any, sample: Any, opts: TrainingOptions, modes: Sequence[str], say: Progress,
          fused: Sequence[str] = ()) -> tuple[Any, Any]:
    """Build the plans, verify, warm up and time every mode, and the ``fused`` ones again with padfree's fused loss
    (a tqdm bar over all the tokens trained)."""
    import torch

    from padfree.throughput import build_plans, compare_training

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    plans = build_plans(sample, opts.capacity, opts.rows, modes, seed=opts.seed)
    per_pass = sum(p.real_tokens * (1 + (m in fused)) for m, p in plans.items())
    warm = sum(p.steps[0].real_tokens * (1 + (m in fused)) for m, p in plans.items())
    names = [*plans, *(f"{m}+fused" for m in fused)]
    say(f"training {', '.join(names)}: {opts.repetitions} timed pass(es) each over the same "
        f"{plans['packed'].real_tokens:,} real tokens (checking exactness first)")
    progress = bar(per_pass * opts.repetitions + warm, "training", "tok")
    try:
        report = compare_training(model, None, capacity=opts.capacity, rows=opts.rows, plans=plans,
                                  repetitions=opts.repetitions, seed=opts.seed, fused=fused,
                                  progress=lambda mode, rep, n: (progress.set_postfix_str(mode, refresh=False),
                                                                 progress.update(n)))
    finally:
        progress.close()
    return report, plans
