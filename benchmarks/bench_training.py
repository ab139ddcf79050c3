"""Training throughput: the same real tokens trained padded, length-grouped, through TRL's packing, packed by
padfree, and as the no-padding ideal; writes its section of ``BENCHMARKS.md``.

What it measures (issue 7, part 5), with :func:`padfree.throughput.compare_training` — every mode trains the same
sample of real tokens, from the same initial weights, with a fresh AdamW (lr 1e-3), forward + backward + optimizer
step per batch, and is timed over the whole pass:

- ``padded`` — random order, ``B`` sequences per batch, right-padded to the longest, 0/1 ``attention_mask``
  (transformers' ``DataCollatorWithPadding``), the stock model with ``sdpa``;
- ``grouped`` — ``group_by_length=True``: ``LengthGroupedSampler``'s megabatches of ``50·B`` sequences sorted by
  length, then the same padded batches;
- ``trl`` — ``trl.data_utils.pack_dataset(ds, C, "bfd")`` rows, ``B`` rows per step through
  ``DataCollatorForLanguageModeling(padding_free=True)`` (one flattened row with restarting ``position_ids``),
  ``use_cache=False`` as ``SFTTrainer.compute_loss`` sets it, the stock model, and the loss through TRL's fused LM
  head as ``SFTTrainer.compute_loss`` computes it (``add_fused_lm_head``, ``fused_lm_head=True``; the stock loss in
  TRL versions without one) — what ``SFTTrainer(packing=True)`` runs on a model without flash-attention;
- ``packed`` — padfree: ``pack_sequences`` rows of ``C``, ``B`` rows per step, ``PackedBatch.model_inputs()``, a
  ``configure_packing`` copy of the model;
- ``ideal`` — the same tokens concatenated and cut into ``B`` full rows of ``C`` per step, no mask, no boundaries.

Data: the Alpaca-layout records of ``../shared/data/*.json`` (instruction, input and output joined by newlines) mixed
with the long-tailed embedded corpus (CPython's standard library sources + ``pydoc_data.topics``), tokenized by the
default offline tokenizer (mistral-common's 32k SentencePiece); sequences longer than ``C`` are truncated to ``C``
(``padfree analyze``'s convention); a seeded random sample of about ``--tokens`` real tokens is what every mode trains.

Models (random weights, fp32, CPU): a tiny Llama (vocab 32000, hidden 256, MLP 688, 4 layers, 4 heads, 2 KV heads)
and a tiny hybrid ``qwen3_5_text`` (the same sizes; 3 GatedDeltaNet layers + 1 attention layer).

``--device cuda`` is the GPU variant: bf16, a ~0.5B-parameter Qwen2-style Llama config (hidden 896, 24 layers, 14
heads, 2 KV heads, MLP 4864, vocab 32000), ``configure_packing``'s ``auto`` backend (torch ``varlen_attn`` when it
runs), longer rows and a larger sample; its section names the GPU.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_training.py            # CPU: ~30-40 min on 2 busy cores
    python benchmarks/bench_training.py --quick    # a smoke test: a small sample, one repetition, llama only
    python benchmarks/bench_training.py --device cuda

Only the section between ``<!-- bench_training:start -->`` and ``<!-- bench_training:end -->`` (or the ``_gpu``
markers for ``--device cuda``) of the output file is replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from _common import allocator, conditions, emit, generated, load_snapshot, machine, table

REPO = Path(__file__).resolve().parents[1]
MODES = ("padded", "grouped", "trl", "packed", "ideal")
TARGETS = {"padded": 4.0, "grouped": 1.8}
IDEAL_TARGET = 0.95
SIZES = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
GPU_SIZES = dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("PADFREE_DATA", REPO.parent / "shared" / "data"))


def load_tokens(every: int) -> tuple[Any, str, dict[str, int]]:
    """Token ids of the instruct records and the embedded corpus (every ``every``-th of each), and a description."""
    from padfree import corpus
    from padfree.samples import read_tokens

    records = []
    for path in sorted(data_dir().glob("*.json")):
        for r in json.loads(path.read_text(encoding="utf-8")):
            records.append("\n".join(f for f in (r.get("instruction", ""), r.get("input", ""), r.get("output", ""))
                                     if f))
    docs = corpus.embedded_corpus()
    records, docs = records[::every], docs[::every]
    tokenizer = corpus.load_tokenizer()
    ids = corpus.encode(records + docs, tokenizer)["input_ids"]
    files = ", ".join(p.name for p in sorted(data_dir().glob("*.json")))
    what = (f"{len(records):,} Alpaca-layout records ({files}) + {len(docs):,} documents of the embedded corpus "
            f"({corpus.embedded_corpus_description()}), tokenized by {corpus.DEFAULT_TOKENIZER_NAME}, no special "
            "tokens")
    lengths = np.array([len(x) for x in ids])
    counts = {"records": len(records), "documents": len(docs), "tokens": int(lengths.sum())}
    return read_tokens(ids), what, counts


def build_model(kind: str, capacity: int, gpu: bool) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = GPU_SIZES if gpu else SIZES
    if kind == "llama":
        config = transformers.LlamaConfig(**sizes, max_position_embeddings=capacity, attention_dropout=0.0)
    else:
        config = transformers.AutoConfig.for_model(
            "qwen3_5_text", **sizes, head_dim=sizes["hidden_size"] // sizes["num_attention_heads"],
            linear_num_key_heads=sizes["num_attention_heads"], linear_num_value_heads=sizes["num_attention_heads"],
            linear_key_head_dim=32 if not gpu else 64, linear_value_head_dim=32 if not gpu else 64,
            max_position_embeddings=capacity)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if gpu:
        model = model.to("cuda", torch.bfloat16)
    return model


def describe_model(model: Any) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    extra = ""
    if getattr(c, "layer_types", None):
        kinds = {t: c.layer_types.count(t) for t in dict.fromkeys(c.layer_types)}
        extra = "; layers: " + ", ".join(f"{n} {t}" for t, n in kinds.items())
    return (f"`{type(model).__name__}` ({c.model_type}), {params:.1f}M parameters: vocab {c.vocab_size}, hidden "
            f"{c.hidden_size}, MLP {c.intermediate_size}, {c.num_hidden_layers} layers, {c.num_attention_heads} "
            f"heads, {c.num_key_value_heads} KV heads{extra}; {str(next(model.parameters()).dtype)[6:]} on "
            f"{next(model.parameters()).device.type}")


def run_model(kind: str, tokens: Any, args: argparse.Namespace) -> tuple[Any, str, float]:
    import torch

    from padfree.throughput import build_plans, compare_training, plans_to, sample_sequences

    model = build_model(kind, args.capacity, args.device == "cuda")
    sample = sample_sequences(tokens, args.tokens, args.capacity, seed=args.seed)
    plans = build_plans(sample, args.capacity, args.rows, args.modes, seed=args.seed)
    if args.device == "cuda":
        plans = plans_to(plans, "cuda")
    if "trl" in plans:  # transformers refuses packed rows in some models (hybrids without their kernels): say so
        try:
            with torch.no_grad():
                model(**plans["trl"].steps[0].inputs)
        except ValueError as exc:
            del plans["trl"]
            args.skipped.append(f"TRL's path on {kind}: transformers refuses its packed batch "
                                f"(`ValueError: {str(exc).strip().splitlines()[0]}`)")
            log(f"  {kind}: {args.skipped[-1]}")
    done = {"tokens": 0}
    total = sum(p.real_tokens * (1 + (m in args.fused)) for m, p in plans.items()) * args.repetitions
    last = [time.perf_counter()]

    def progress(mode: str, rep: int, n: int) -> None:
        if rep >= 0:
            done["tokens"] += n
        if time.perf_counter() - last[0] > 30:
            last[0] = time.perf_counter()
            log(f"  {kind}: {mode} rep {rep}: {done['tokens'] / total:.0%} of the timed tokens done")

    log(f"{kind}: {describe_model(model)}; {len(sample):,} sequences, {int(sample.lengths.sum()):,} tokens; steps "
        + ", ".join(f"{m} {len(p.steps)}" for m, p in plans.items()))
    start = time.perf_counter()
    report = compare_training(model, None, capacity=args.capacity, rows=args.rows, plans=plans,
                              repetitions=args.repetitions, seed=args.seed, progress=progress,
                              fused=[m for m in args.fused if m in plans])
    elapsed = time.perf_counter() - start
    if args.profile:
        import copy

        from padfree import configure_packing

        packed_model = copy.deepcopy(model)
        configure_packing(packed_model)
        report.breakdown = {}
        for m in report.results:  # the fullest step of each mode: the one closest to B x C positions
            base = m.removesuffix("+fused")
            step = max(plans[base].steps, key=lambda s: s.positions)
            report.breakdown[m] = (step.positions, breakdown(packed_model if base == "packed" else model, step,
                                                             model.config.vocab_size, m.endswith("+fused")))
        log(f"  {kind}: profiled one step per mode")
    for m, r in report.results.items():
        log(f"  {kind} {m:8s} {r.tokens_per_second:9.1f} tok/s  runs {' '.join(f'{s:.1f}' for s in r.seconds)} s")
    return report, describe_model(model), elapsed


ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::bmm", "aten::_softmax",
                 "aten::baddbmm", "aten::masked_fill")
GATHER_OPS = ("aten::index", "aten::_index_put_impl_", "aten::index_put", "aten::index_copy", "aten::index_select",
              "aten::index_add_", "aten::cat", "aten::nonzero", "aten::repeat_interleave", "aten::cumsum")
CATEGORIES = ("lm_head + loss", "decoder linear layers", "attention", "gather / scatter / layout",
              "elementwise + other", "optimizer step")


def _category(key: str, shapes: Any, vocab: int) -> str:
    if any(vocab in (s or []) for s in (shapes or [])):
        return "lm_head + loss"
    if key in ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"):
        return "decoder linear layers"
    if any(key.startswith(p) for p in ATTENTION_OPS):
        return "attention"
    if any(key == p or key.startswith(p + "_") for p in GATHER_OPS):
        return "gather / scatter / layout"
    return "elementwise + other"


def breakdown(model: Any, step: Any, vocab: int, fused: bool = False) -> dict[str, float]:
    """One step of ``step`` under ``torch.profiler``: self CPU seconds per category of the forward + backward (ops
    with a vocabulary-sized input are the lm_head and the loss), and the wall seconds of the optimizer step."""
    import torch

    from padfree.model.loss import causal_lm_loss

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        (causal_lm_loss(model, step.inputs) if fused else model(**step.inputs).loss).backward()
    start = time.perf_counter()
    optimizer.step()
    opt = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for e in prof.key_averages(group_by_input_shape=True):
        if not e.key.startswith("aten::"):  # autograd nodes and annotations: their ops are counted themselves
            continue
        out[_category(e.key, e.input_shapes, vocab)] += e.self_cpu_time_total / 1e6
    out["optimizer step"] = opt
    return out


def projection(lengths: np.ndarray, capacity: int, rows: int, seed: int) -> list[list[str]]:
    """Positions each layout computes for the *whole* data set (lengths only, no training): the scale at which a
    training run batches. Rows: layout, batches, positions, filled, positions / packed's."""
    from padfree import pack_sequences
    from padfree.throughput import length_grouped_order

    lengths = np.minimum(lengths[lengths > 0], capacity)
    total = int(lengths.sum())
    out = []
    packed = pack_sequences(lengths, capacity)
    packed_positions = packed.num_bins * capacity
    for name, order in (("padded", np.random.default_rng(seed).permutation(lengths.shape[0])),
                        ("grouped", length_grouped_order(lengths, rows, seed))):
        ordered = lengths[order]
        starts = np.arange(0, ordered.shape[0], rows)
        positions = int((np.maximum.reduceat(ordered, starts) * np.diff(np.append(starts, ordered.shape[0]))).sum())
        out.append([f"`{name}`", f"{starts.shape[0]:,}", f"{positions:,}", f"{total / positions:.1%}",
                    f"{positions / packed_positions:.2f}×"])
    out.append(["`packed`", f"{-(-packed.num_bins // rows):,}", f"{packed_positions:,}",
                f"{total / packed_positions:.1%}", "1.00×"])
    out.append(["`ideal`", f"{-(-total // (rows * capacity)):,}", f"{total:,}", "100.0%",
                f"{total / packed_positions:.2f}×"])
    return out


def reading(report: Any) -> str:
    """One sentence comparing the measured speedups (wall time) with the ratios of computed positions."""
    res = report.results
    packed = res["packed"]
    parts = [f"packed fills {packed.efficiency:.1%} of its positions"]
    for m in ("padded", "grouped", "trl", "ideal"):
        if m in res:
            parts.append(f"`{m}` computes {res[m].positions / packed.positions:.2f}× packed's positions "
                         f"({res[m].efficiency:.1%} filled) and packed measures {report.speedup('packed', m):.2f}× "
                         "its tokens/s")
    fused = [f"`{m}+fused` runs {report.speedup(m + '+fused', m):.2f}× `{m}`'s tokens/s" for m in res
             if m + "+fused" in res]
    if fused:
        parts.append("the fused loss alone: " + ", ".join(fused))
    return "; ".join(parts) + "."


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}×"


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, what: str,
           counts: dict[str, int], results: dict[str, tuple[Any, str, float]], elapsed: float) -> str:
    gpu = args.device == "cuda"
    start_mark, end_mark = marks(gpu)
    lines = [
        start_mark,
        f"## Training throughput{' on a GPU' if gpu else ''} (`benchmarks/bench_training.py`)",
        "",
        generated("bench_training.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, [f"torch threads {info['threads']}", allocator()],
                    host="Device: " + info["gpu"] + "; host " if gpu else ""),
        "- **A shared machine**: other engineers' tests and benchmarks ran on the same cores during this run, so "
        "absolute tokens/s are low and drift. The modes run their passes together in one process, interleaved "
        "step by step (next is always the mode furthest behind in its own pass; each mode has its own copy of the "
        "model and optimizer), so a change of load hits every mode alike; medians of "
        f"{args.repetitions} passes per mode. The ratio of CPU time (process CPU seconds of each mode's steps, "
        "both threads) is given beside the wall-time ratio: other processes stretch wall time more than the "
        "CPU time a step needs.",
        f"- Data: {what}. A seeded random sample of at least {args.tokens:,} real tokens (sequences longer than "
        f"C = {args.capacity:,} truncated to it first) is what every mode trains, in full, every pass.",
        f"- Batching: C = {args.capacity:,} tokens per row, B = {args.rows} (HF's default "
        "`per_device_train_batch_size`): a padded batch holds B sequences, a packed step B rows, so no step of any "
        f"mode computes more than B × C = {args.rows * args.capacity:,} positions (the same peak memory bound).",
        "- Step: `model(**inputs).loss` (transformers' own causal-LM loss over all positions it is given; `trl`: "
        "TRL's fused LM head, `model(**inputs, fused_lm_head=True).loss`, as SFTTrainer computes its loss), "
        "`backward()`, `AdamW(lr=1e-3).step()`; each pass starts from the same initial weights and a fresh "
        "optimizer, after one untimed warm-up step per mode. Batches are built before the clock starts (data "
        "loading is not timed for any mode); padfree's per-batch layout work inside the forward is timed.",
        "- Real tokens/s = the sample's tokens / the pass's wall time. *filled* = real tokens / computed positions.",
        *([f"- `<mode>+fused` ({', '.join(args.fused)}): the same batches, the loss by padfree's "
           "`causal_lm_loss` instead of `model(**inputs).loss` — the LM head and the cross-entropy fused, in "
           "chunks of positions, over the positions that have a target only (no logits tensor; padding and each "
           "sequence's first position never reach the head). Listed apart so that what the loss saves is not "
           "credited to the layout: compare `packed` with the stock modes for packing alone, `<mode>+fused` with "
           "`<mode>` for the loss alone."] if args.fused else []),
        "",
    ]
    for kind, (report, model_text, seconds) in results.items():
        res = report.results
        lines += [f"### {kind}: {model_text}", "",
                  f"{report.sequences:,} sequences, {res['packed'].real_tokens:,} real tokens per pass; "
                  f"{seconds / 60:.1f} min for this model.", ""]
        rows = []
        for m, r in res.items():
            rows.append([f"`{m}`", f"{r.steps:,}", f"{r.positions:,}", f"{r.efficiency:.1%}",
                         " / ".join(f"{s:.1f}" for s in r.seconds), f"{r.tokens_per_second:,.0f}",
                         fmt_ratio(report.speedup("packed", m)), fmt_ratio(report.cpu_speedup("packed", m)),
                         f"{r.final_loss():.3f}"])
        lines += [table(["mode", "steps", "positions", "filled", "pass s (each repetition)", "real tokens/s",
                         "packed / mode", "packed / mode, CPU time", "final loss"], rows, "lrrrrrrrr"), ""]
        target_rows = []
        for cand in ("packed", "packed+fused"):
            if cand not in res:
                continue
            for m, goal in TARGETS.items():
                if m in res:
                    got = report.speedup(cand, m)
                    target_rows.append([f"{cand} ≥ {goal}× `{m}`", fmt_ratio(got),
                                        fmt_ratio(report.cpu_speedup(cand, m)),
                                        "**met**" if got >= goal else "**not met**"])
            ideal = "ideal+fused" if cand == "packed+fused" and "ideal+fused" in res else "ideal"
            if ideal in res:  # the ideal with the same loss: what the layout alone costs
                got = report.speedup(cand, ideal)
                target_rows.append([f"{cand} ≥ {IDEAL_TARGET}× `{ideal}`", fmt_ratio(got),
                                    fmt_ratio(report.cpu_speedup(cand, ideal)),
                                    "**met**" if got >= IDEAL_TARGET else "**not met**"])
        lines += [table(["target", "measured (wall)", "measured (CPU time)", "verdict (wall)"], target_rows,
                        "lrrl"), ""]
        ex = report.exactness
        notes = []
        if ex is not None:
            notes.append(f"padfree exactness (`verify` on the packed row holding the most sequences, "
                         f"{ex.num_sequences} sequences): "
                         f"max |Δlogit| {ex.max_logit_diff:.1e}, |Δloss| {ex.loss_diff:.1e}, max |Δgrad| "
                         f"{ex.max_grad_diff:.1e} — **{'exact' if ex.ok else 'MISMATCH'}** at atol {ex.atol:g}")
        if ex is None and "packed" in res:
            notes.append("padfree exactness: no packed row of this sample holds two sequences, so there was no "
                         "boundary to verify")
        if "trl" in report.leaks:
            leak = report.leaks["trl"]
            notes.append(f"TRL's path, same check on its first step (logits of its last sequences vs the same "
                         f"sequences alone): max |Δlogit| {leak:.1e} — "
                         + ("exact attention (transformers turns the restarting position_ids into a dense "
                            "block-diagonal mask for its one flattened row)" if leak < (5e-2 if gpu else 1e-4) else
                            "**not exact: sequences see each other**")
                         + f"; its collator also keeps {report.cross_targets.get('trl', 0):,} next-token targets "
                         "that cross from one sequence into the next (padfree masks them)")
        final = {m: r.final_loss() for m, r in res.items()}
        notes.append("loss: *final loss* = token-weighted mean loss of the steps that trained the last quarter of "
                     "the tokens of the pass. The modes batch differently (different numbers of optimizer steps and "
                     "different sequences per step), so their curves are not expected to agree step by step; "
                     "agreement means the same tokens lead to a similar loss: packed "
                     f"{final['packed']:.3f} vs "
                     + ", ".join(f"{m} {v:.3f}" for m, v in final.items() if m != "packed")
                     + ". Step-by-step equality is what the exactness check proves.")
        lines += [f"- {n}" for n in notes] + [""]
        if getattr(report, "breakdown", None):
            brows = []
            for m, (positions, cats) in report.breakdown.items():
                total = sum(v for k, v in cats.items() if k != "optimizer step")
                brows.append([f"`{m}`", f"{positions:,}", *[f"{cats[c]:.2f}" for c in CATEGORIES],
                              f"{1e3 * total / positions:.1f}"])
            lines += ["Where the time goes — the fullest step of each mode under `torch.profiler`: self CPU seconds "
                      "of the forward + backward per category (both threads; an op with a vocabulary-sized input "
                      "is *lm_head + loss*; *gather / scatter / layout* = index/index_select/index_add_/cat/"
                      "nonzero/cumsum, which includes padfree's per-bucket gathers and its layout building; "
                      "*elementwise + other* = RMSNorm, RoPE, SiLU, residual adds, copies), then "
                      "the wall seconds of the AdamW step:", "",
                      table(["mode", "positions", *CATEGORIES, "fwd+bwd CPU ms per 1k positions"], brows,
                            "l" + "r" * (len(CATEGORIES) + 2)), ""]
        lines += [f"Reading it ({kind}): " + reading(report), ""]
    lines += [
        "### The same layouts over the whole data set",
        "",
        f"The timed sample is small ({results[next(iter(results))][0].sequences:,} sequences: what 2 cores train "
        "in minutes), and length grouping depends on scale: `LengthGroupedSampler` sorts megabatches of 50·B = "
        f"{50 * args.rows} sequences, and a sample smaller than one megabatch has a sparse long tail, so even "
        "sorted batches mix lengths. The positions each layout computes for all "
        f"{counts['sequences']:,} sequences (lengths only, no training; C = {args.capacity:,}, B = {args.rows}, "
        "same seed), since a step's time follows its positions closely (above):",
        "",
        table(["layout", "batches", "positions", "filled", "positions / packed's"], args.projection, "lrrrr"),
        "",
        "### What limits the ratios here",
        "",
        "- Everything but attention costs the same per computed position, padding included — the lm_head and the "
        "loss over 32,000 logits, the decoder's linear layers, the elementwise ops (see the breakdown) — so a "
        "step's time is close to proportional to the positions it computes: packed vs padded is about the ratio "
        "of computed positions, plus what a padded batch spends on attention over its padding and on the "
        "optimizer steps of its extra, smaller batches.",
        "- Length grouping removes most of the padding by itself once it sorts full megabatches (the whole-data "
        "table), so at equal B and at scale packing gains only its last few percent of positions over it in "
        "tokens/s on this model; what grouping costs instead is batches whose size swings from B short sequences "
        "to B full rows (memory must be sized for the largest), many more optimizer steps for the same tokens, "
        "and length-correlated batches.",
        "- TRL's path computes the same positions as packed, but transformers hands SDPA a dense (B·C)² "
        "block-diagonal mask for its one flattened row: every attention layer pays the full square; and its "
        "loss goes through TRL's fused LM head, whose CPU fallback (no Triton) is slower than the stock loss "
        "here (`bench_loss.py`; `trl+fused` swaps in padfree's loss on TRL's batches). On the hybrid, "
        "transformers refuses TRL's packed batch outright unless the CUDA kernels are installed.",
        "- The hybrid's modes also differ in their GatedDeltaNet code: the stock modes run transformers' "
        "pure-PyTorch fallback (`torch_chunk_gated_delta_rule`, `torch_causal_conv1d_update`), `packed` runs "
        "padfree's boundary-resetting torch implementation (`padfree.model.families.scan_mixers`), so its ratios "
        "include that difference, not only padding.",
        "- `<mode>+fused` computes the same positions with the same decoder; what it drops is the logits: the head "
        "and the loss run in chunks of about a thousand positions, in place, and only over positions that have a "
        "target. That helps padded batches most (their padding never reaches the head, so only the decoder still "
        "pays for it) — which is why `packed+fused` over `padded+fused` is smaller than `packed` over `padded`: "
        "on a model whose head dominates, most of the padding's cost was the head's. On models whose decoder "
        "dominates (wider, deeper, smaller vocabulary) the layout's share grows back.",
        "- `ideal` has no boundaries at all and no padding; the gap between it and packed is padfree's boundary "
        "handling (per-segment attention buckets, the layout built from `position_ids` per batch) plus packed's "
        "few padding positions.",
    ]
    if args.skipped:
        lines += ["", "Skipped: " + "; ".join(args.skipped) + "."]
    lines.append(end_mark)
    return "\n".join(lines)


def marks(gpu: bool) -> tuple[str, str]:
    name = "bench_training_gpu" if gpu else "bench_training"
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small sample, one repetition, llama only")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default=None, help="comma-separated: llama,hybrid (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--capacity", type=int, default=None, help="row length C (CPU 1024, GPU 4096)")
    parser.add_argument("--rows", type=int, default=8, help="B: sequences per padded batch, rows per packed step")
    parser.add_argument("--tokens", type=int, default=None, help="real tokens per pass (CPU 16384, GPU 262144)")
    parser.add_argument("--repetitions", type=int, default=None, help="timed passes per mode (default 3)")
    parser.add_argument("--fused", default="",
                        help="comma-separated modes to run a second time with padfree's fused loss "
                             "(padfree.causal_lm_loss), as '<mode>+fused'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the per-category profile of one step per mode")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-write"]
    gpu = args.device == "cuda"
    if gpu:
        args.profile = False  # the breakdown reads CPU op times: meaningless for CUDA kernels
    args.capacity = args.capacity or (4096 if gpu else (256 if args.quick else 1024))
    args.tokens = args.tokens or (262144 if gpu else (2048 if args.quick else 16384))
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.models = (args.models or ("llama" if args.quick else "llama,hybrid")).split(",")
    args.modes = tuple(args.modes.split(","))
    args.fused = tuple(m for m in args.fused.split(",") if m)
    args.skipped = []
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available here")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    info = machine(("numpy", "torch", "transformers", "trl", "datasets", "padfree"))
    info["threads"] = str(torch.get_num_threads())
    if gpu:
        info["gpu"] = torch.cuda.get_device_name(0)
    before = load_snapshot()
    if "trl" in args.modes:
        try:
            import trl  # noqa: F401
        except ImportError:
            args.modes = tuple(m for m in args.modes if m != "trl")
            args.skipped.append("TRL's path: trl is not installed")
    log("tokenizing the data")
    tokens, what, counts = load_tokens(every=8 if args.quick else 1)
    args.projection = projection(tokens.lengths, args.capacity, args.rows, args.seed)
    counts["sequences"] = int((tokens.lengths > 0).sum())
    log(f"{counts['records']:,} records + {counts['documents']:,} documents, {counts['tokens']:,} tokens")
    results = {kind: run_model(kind, tokens, args) for kind in args.models}
    after = load_snapshot()
    section = render(args, info, before, after, what, counts, results, time.perf_counter() - t0)
    emit(section, args.no_write, args.output, marks(gpu), log)


if __name__ == "__main__":
    main()
