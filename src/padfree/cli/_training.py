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

#: The model when no ``--model`` is given, per size of run: a small Llama with random weights (vocab = the
#: tokenizer's, whose 32k-row head and embedding are most of its parameters).
DEMO_MODEL = {"full": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
              "default": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2),
              "quick": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2)}
#: (capacity, rows, tokens, repetitions) per size of run
_DEFAULTS = {"demo": {"default": (512, 4, 8192, 2), "quick": (256, 4, 1536, 1), "full": (1024, 8, 16384, 3)},
             "bench": {"full": (512, 8, 8192, 3), "quick": (256, 4, 1536, 1)}}
#: the size of a run without --quick or --full: ``bench`` measures, so its default is its full run
_DEFAULT_SIZE = {"demo": "default", "bench": "full"}
#: the embedded corpus's share each size of run tokenizes: every n-th top-level block
_CORPUS_STRIDE = {"full": 1, "default": 4, "quick": 8}
#: torch threads of the built-in model when --threads is not given: a model this small gains little from intra-op
#: threads, and on a shared machine their OpenMP barriers stall for seconds whenever another process holds a core
SMALL_MODEL_THREADS = 1


def add_training_args(p: Any, command: str) -> None:
    """The ``data`` and ``training`` arguments of ``command`` (``demo`` or ``bench``), ``--quick`` and (``demo``)
    ``--full``."""
    sizes = _DEFAULTS[command]

    def default(i: int) -> str:
        return "; ".join(f"{'default' if k == _DEFAULT_SIZE[command] else '--' + k}: {v[i]:,}"
                         for k, v in sizes.items())
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
    g.add_argument("--capacity", type=int, help=f"tokens per packed row, the longest padded row ({default(0)})")
    g.add_argument("--rows", type=int, help=f"batch size: sequences per padded batch, rows per packed step "
                                             f"({default(1)})")
    g.add_argument("--tokens", type=int, help=f"real tokens every mode trains per pass ({default(2)})")
    g.add_argument("--repetitions", type=int,
                   help=f"timed passes per mode, interleaved; the median is reported ({default(3)})")
    g.add_argument("--seed", type=int, default=0, help="seed of the sample, the orders and the weights (default: 0)")
    g.add_argument("--threads", type=int,
                   help=f"torch threads for every mode (default: {SMALL_MODEL_THREADS} for the built-in small model, "
                        "torch's own choice for --model)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="a smaller run: an eighth of the corpus, a one-layer model, few tokens")
    if _DEFAULT_SIZE[command] != "full":
        size.add_argument("--full", action="store_true",
                          help="the full run: the whole corpus, a larger model, more tokens and passes (several "
                               "times longer)")


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
    size: str  # "quick", "default" or "full"

    @property
    def quick(self) -> bool:
        return self.size == "quick"


def training_options(args: argparse.Namespace, command: str) -> TrainingOptions:
    """The ``demo`` / ``bench`` training arguments checked (every cheap check first) with their defaults filled."""
    if args.data is not None:  # a missing file first of all, before the packing engine (numba) is imported
        check_data_path(args.data, "--data")
    from padfree.packing.inputs import as_capacity, as_positive_int, as_seed

    size = "quick" if args.quick else "full" if getattr(args, "full", False) else _DEFAULT_SIZE[command]
    defaults = _DEFAULTS[command][size]
    values = []
    for flag, value, default in zip(("--capacity", "--rows", "--tokens", "--repetitions"),
                                    (args.capacity, args.rows, args.tokens, args.repetitions), defaults, strict=True):
        check = as_capacity if flag == "--capacity" else as_positive_int
        values.append(default if value is None else check(value, flag))
    if args.data is None and args.fields:
        raise InvalidArgumentError("--field needs --data: the embedded corpus has no columns")
    if args.model is not None and not Path(args.model).expanduser().is_dir():
        raise InvalidArgumentError(f"--model {args.model!r} is not a directory; expected a checkpoint written by "
                                   "save_pretrained (config.json and the weights)")
    threads = optional_positive(args.threads, "--threads")
    if threads is None and args.model is None:
        threads = SMALL_MODEL_THREADS
    return TrainingOptions(*values, seed=as_seed(args.seed, "--seed"), threads=threads,
                           limit=optional_positive(args.limit, "--limit"), size=size)


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
    ids = [x for x in token_ids(texts, tokenizer, say=say) if x]
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
        stride = _CORPUS_STRIDE[opts.size]
        if stride > 1:  # every n-th block: the same kinds of text, a fraction of the tokenizing
            texts = texts[::stride]
            flag = " (--quick)" if opts.quick else " (--full takes them all)"
            source += f", every {stride}th of them{flag}: {len(texts):,}"
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
        sizes = DEMO_MODEL[opts.size]
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
    """Build the plans, verify, warm up and time every mode, and the ``fused`` ones again with padfree's fused loss.

    Shows a tqdm bar per mode (its tokens over every pass), says how long the timed passes will take once every mode
    has made its first timed step, and a line after every pass (progress that reaches a log file too, where tqdm
    draws nothing).
    """
    import time

    import torch

    from padfree.throughput import build_plans, compare_training

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    plans = build_plans(sample, opts.capacity, opts.rows, modes, seed=opts.seed)
    names = [*plans, *(f"{m}+fused" for m in fused)]
    tokens = {m: plans[m.removesuffix("+fused")].real_tokens for m in names}
    warm = {m: plans[m.removesuffix("+fused")].steps[0].real_tokens for m in names}
    say(f"training {', '.join(names)}: {opts.repetitions} timed pass(es) each over the same "
        f"{plans['packed'].real_tokens:,} real tokens (checking exactness first)")
    width = max(map(len, names))
    bars = {m: bar(tokens[m] * opts.repetitions + warm[m], m.ljust(width), "tok", position=i)
            for i, m in enumerate(names)}
    clock = {"last": time.perf_counter(), "start": 0.0}
    timed: dict[str, list[float]] = {}  # mode -> [seconds, tokens] of its timed steps so far
    passes: set[int] = set()

    def progress(mode: str, rep: int, n: int) -> None:
        # called after every step; the modes take their steps in turn, so the time since the last call is this step's
        now = time.perf_counter()
        elapsed, clock["last"] = now - clock["last"], now
        bars[mode].update(n)
        if rep < 0:  # a warm-up step (first-call costs: not a measure of the others)
            clock["start"] = now
            return
        seconds, count = timed.setdefault(mode, [0.0, 0])
        timed[mode] = [seconds + elapsed, count + n]
        if len(timed) == len(names) and -1 not in passes:  # every mode has made a timed step: say how long
            passes.add(-1)
            left = sum(timed[m][0] / timed[m][1] * (tokens[m] * opts.repetitions - timed[m][1]) for m in names)
            say(f"training: about {_duration(left)} left for {opts.repetitions} timed pass(es) of {len(names)} "
                "modes (from each mode's first timed step)")
        if rep not in passes and all(timed.get(m, (0, 0))[1] >= tokens[m] * (rep + 1) for m in names):
            passes.add(rep)
            spent = now - clock["start"]
            left = spent / (rep + 1) * (opts.repetitions - rep - 1)
            say(f"training: pass {rep + 1} of {opts.repetitions} done ({_duration(spent)} so far"
                + (f", about {_duration(left)} left)" if left else ")"))

    try:
        report = compare_training(model, None, capacity=opts.capacity, rows=opts.rows, plans=plans,
                                  repetitions=opts.repetitions, seed=opts.seed, fused=fused, progress=progress)
    finally:
        for b in bars.values():
            b.close()
    return report, plans


def _duration(seconds: float) -> str:
    """``"40 s"``, ``"3 min 20 s"``."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60:02d} s"
