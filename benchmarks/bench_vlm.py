"""Vision-language SFT throughput: a tiny Qwen2-VL trained on real text lengths with images of mixed sizes, padded
(TRL-style) vs packed by padfree; writes its section of ``BENCHMARKS.md``.

Every mode trains the same samples — the same token ids, the same images — from the same initial weights, with a
fresh AdamW (lr 1e-3), forward + backward + optimizer step per batch, timed over the whole pass with
:func:`padfree.throughput.compare_training` (the modes interleaved step by step in one process):

- ``padded`` — random order, ``B`` samples per batch, right-padded to the batch's longest, 0/1 ``attention_mask``,
  labels = ids with -100 on padding, ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids`` of the batch's
  samples; the stock model with ``sdpa``;
- ``trl`` — the same samples in the same batches through TRL's ``DataCollatorForVisionLanguageModeling`` (what
  ``SFTTrainer`` uses on a vision dataset: the processor tokenizes the text and processes the images on the fly,
  pads to the batch's longest); its batches are built before the clock starts;
- ``packed`` — padfree: ``pack_sequences`` over the sample's lengths plans rows of ``C``; every ``B`` rows' samples go
  through ``padfree.packed_collate_fn(C, carry=["pixel_values", "image_grid_thw", "mm_token_type_ids"])`` as a
  DataLoader would hand them, ``PackedBatch.model_inputs()``, a ``configure_packing`` copy of the model (its hook
  computes each sample's mRoPE rows in the packed row).

TRL's own padding-free and packing paths are tried too (``SFTTrainer`` with ``padding_free=True`` / ``packing=True``
on the vision dataset); TRL refuses both for vision data, and the section records its message.

Same loss: before timing, every mode's batches run once at the initial weights (no gradient) and the summed per-token
cross-entropy of every sample is compared across modes — the same tokens through the same weights.

Peak memory: the forward + backward of each mode's largest step (most positions) once more after the timed passes,
after ``malloc_trim``, with the kernel's peak-RSS mark reset: the peak RSS above the state before the step.

Data: the Alpaca-layout records of ``../shared/data/*.json`` (instruction, input and output joined by newlines) mixed
with the long-tailed embedded corpus (CPython's standard library sources + ``pydoc_data.topics``), tokenized by the
default offline tokenizer (mistral-common's 32k SentencePiece, with Qwen-VL's four vision tokens added); a seeded
random sample of about ``--tokens`` text tokens. About half the samples (``--image-share``, seeded draw) get one or
two random-pixel images of sizes drawn from :data:`IMAGE_SIZES`, in front of their text (Qwen-VL's
``<|vision_start|><|image_pad|><|vision_end|>``); each sample's text is cut so that it fits ``C`` with its images.
Every sample goes through the same offline ``Qwen2VLProcessor`` (the tokenizer above, ``Qwen2VLImageProcessorPil``
with its defaults: 14-pixel patches, 2x2 merge).

Model (random weights, fp32, CPU): Qwen2-VL from ``padfree.proof.shrink.shrink_config(default_config("qwen2_vl"))``
widened to ``bench_training.py``'s text sizes (vocab 32004, hidden 256, MLP 688, 4 layers, 4 heads, 2 KV heads) and a
2-block vision tower of width 128.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_vlm.py            # 8 min on 2 cores shared with other jobs (load average ~4)
    python benchmarks/bench_vlm.py --quick    # a smoke run: a small sample, one repetition

Only the section between ``<!-- bench_vlm:start -->`` and ``<!-- bench_vlm:end -->`` of the output file is replaced.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, allocator, conditions, emit, generated, load_snapshot, machine, table

START, END = "<!-- bench_vlm:start -->", "<!-- bench_vlm:end -->"
TARGET = 1.5  # packed >= 1.5x padded tokens/s
SIZES = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
VISION = dict(depth=2, embed_dim=128, num_heads=4)
VISION_TOKENS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]
#: image sizes in pixels (height, width), multiples of 28 so that the processor keeps them: 4 to 96 merged tokens
IMAGE_SIZES = ((56, 56), (84, 56), (112, 112), (168, 112), (224, 168), (224, 224), (336, 224))
CARRY = ["pixel_values", "image_grid_thw", "mm_token_type_ids"]
IGNORE = -100


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("PADFREE_DATA", REPO.parent / "shared" / "data"))


# ---- data ---------------------------------------------------------------------------------------------------------


def processor() -> Any:
    """Qwen2-VL's processor, offline: the default tokenizer with Qwen-VL's vision tokens, the PIL image processor."""
    import transformers

    from padfree import corpus

    class ImagesOnly(transformers.Qwen2VLProcessor):
        """Qwen2-VL's processor without its video processor (which needs torchvision)."""

        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = corpus.load_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.pad_token = tok.unk_token  # the SentencePiece model has none; padding is masked out everywhere
    return ImagesOnly(image_processor=transformers.Qwen2VLImageProcessorPil(), tokenizer=tok, video_processor=None)


def load_text(every: int) -> tuple[Any, str]:
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
    ids = corpus.encode(records + docs, corpus.load_tokenizer())["input_ids"]
    files = ", ".join(p.name for p in sorted(data_dir().glob("*.json")))
    what = (f"{len(records):,} Alpaca-layout records ({files}) + {len(docs):,} documents of the embedded corpus "
            f"({corpus.embedded_corpus_description()}), tokenized by {corpus.DEFAULT_TOKENIZER_NAME}, no special "
            "tokens")
    return read_tokens(ids), what


def build_samples(args: argparse.Namespace, proc: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """The samples every mode trains: processor outputs (``input_ids``, ``mm_token_type_ids`` 1-D, ``pixel_values``,
    ``image_grid_thw``) and the same samples in TRL's vision format (``text`` + ``images``)."""
    from PIL import Image

    from padfree.throughput import sample_sequences

    tokens, what = load_text(8 if args.quick else 1)
    sample = sample_sequences(tokens, args.tokens, args.capacity, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    merge = proc.image_processor.merge_size * proc.image_processor.patch_size
    tok = proc.tokenizer
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    samples, trl_rows = [], []
    for i in range(len(sample)):
        ids = sample.values[sample.offsets[i]:sample.offsets[i + 1]]
        count = int(rng.choice([1, 2])) if rng.random() < args.image_share else 0
        sizes = [IMAGE_SIZES[j] for j in rng.integers(0, len(IMAGE_SIZES), count)]
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
        vision = sum(h * w // (merge * merge) + 2 for h, w in sizes)
        keep = args.capacity - vision
        while True:  # decoding and encoding again may move a token or two: cut until the sample fits C
            text = marker * count + tok.decode(ids[:keep].tolist())
            out = proc(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
            if out["input_ids"].shape[1] <= args.capacity:
                break
            keep -= out["input_ids"].shape[1] - args.capacity
        s = {"input_ids": out["input_ids"][0], "mm_token_type_ids": out["mm_token_type_ids"][0]}
        if images:
            s.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        samples.append(s)
        trl_rows.append({"text": text, "images": images})
    lengths = np.array([len(s["input_ids"]) for s in samples])
    n_images = sum(len(r["images"]) for r in trl_rows)
    image_tokens = int(sum(int((s["mm_token_type_ids"] == 1).sum()) for s in samples))
    with_images = sum(1 for r in trl_rows if r["images"])
    patches = int(sum(int(s["image_grid_thw"].prod(-1).sum()) for s in samples if "image_grid_thw" in s))
    what += (f". A seeded random sample of {len(samples):,} sequences ({int(sample.lengths.sum()):,} text tokens "
             f"drawn, each cut to C first); {with_images:,} of them ({with_images / len(samples):.0%}) carry "
             f"{n_images:,} images (one or two each, sizes drawn from {', '.join(f'{h}×{w}' for h, w in IMAGE_SIZES)}"
             f" pixels: {image_tokens:,} image tokens, {patches:,} patches for the tower); "
             f"sample lengths {int(lengths.min())}–{int(lengths.max())} (median {int(np.median(lengths))}), "
             f"{int(lengths.sum()):,} real tokens")
    return samples, trl_rows, what


# ---- plans --------------------------------------------------------------------------------------------------------


def padded_batch(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``samples`` right-padded to the longest: ids (pad 0), 0/1 mask, labels -100 on padding, token types (pad 0),
    the samples' pixels and grids concatenated in batch order."""
    import torch

    w = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), w, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[r, :n], types[r, :n], mask[r, :n] = s["input_ids"], s["mm_token_type_ids"], 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE),
           "mm_token_type_ids": types, "use_cache": False}
    for key in ("pixel_values", "image_grid_thw"):
        parts = [s[key] for s in samples if key in s]
        if parts:
            out[key] = torch.cat(parts)
    return out


def build_plans(args: argparse.Namespace, samples: list[dict[str, Any]], trl_rows: list[dict[str, Any]],
                proc: Any) -> tuple[dict[str, Any], dict[str, list[list[int]]], dict[str, float], list[Any]]:
    """The modes' plans (:class:`padfree.throughput.Plan`), which sample each batch row holds (for the loss check),
    each mode's collate seconds (off the clock) and the packed plan's ``PackedBatch`` per step."""
    import padfree
    from padfree.throughput import Plan, Step

    n = len(samples)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    order = np.random.default_rng(args.seed).permutation(n)
    batches = [order[i:i + args.rows].tolist() for i in range(0, n, args.rows)]
    plans, members, collate, packed_batches = {}, {}, {}, []
    if "padded" in args.modes:
        t0 = time.perf_counter()
        steps = [Step(padded_batch([samples[i] for i in b]), int(lengths[b].sum()), len(b) * int(lengths[b].max()))
                 for b in batches]
        collate["padded"] = time.perf_counter() - t0
        plans["padded"] = Plan("padded", steps, "stock", "padded to each batch's longest", sequences=n)
        members["padded"] = batches
    if "trl" in args.modes:
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

        collator = DataCollatorForVisionLanguageModeling(proc)
        steps, t0 = [], time.perf_counter()
        for b in batches:
            out = dict(collator([dict(trl_rows[i]) for i in b]))
            real = int(out["attention_mask"].sum())
            steps.append(Step({**out, "use_cache": False}, real, out["input_ids"].numel()))
        collate["trl"] = time.perf_counter() - t0
        plans["trl"] = Plan("trl", steps, "stock", "TRL's DataCollatorForVisionLanguageModeling", sequences=n)
        members["trl"] = batches
    if "packed" in args.modes:
        plan = padfree.pack_sequences(lengths, args.capacity)
        bins = np.random.default_rng(args.seed).permutation(plan.num_bins)  # the plan lists bins longest first
        fn = padfree.packed_collate_fn(args.capacity, carry=CARRY)
        steps, rows, t0 = [], [], time.perf_counter()
        for first in range(0, plan.num_bins, args.rows):
            chunk = np.concatenate([plan.bin(int(b)) for b in bins[first:first + args.rows]]).tolist()
            batch = fn([samples[i] for i in chunk])  # what a DataLoader hands its collate_fn
            steps.append(Step(batch.model_inputs(), batch.num_tokens, batch.batch_size * batch.seq_len))
            rows.append([chunk[j] for j in batch.sequence_ids.tolist()])
            packed_batches.append(batch)
        collate["packed"] = time.perf_counter() - t0
        plans["packed"] = Plan("packed", steps, "packed",
                               f"padfree packed_collate_fn ({plan.efficiency:.2%} full)", sequences=n)
        members["packed"] = rows
    return plans, members, collate, packed_batches


# ---- model, loss check, memory, TRL's own refusals ----------------------------------------------------------------


def build_model(vocab: int, special: dict[str, int]) -> Any:
    """Qwen2-VL from the shrunk default config, widened to the text sizes of ``bench_training.py``."""
    import torch
    import transformers

    from padfree.proof.shrink import default_config, shrink_config

    cfg = shrink_config(default_config("qwen2_vl"))
    text = cfg.get_text_config()
    for key, value in {**SIZES, "vocab_size": vocab}.items():
        setattr(text, key, value)
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    text.max_window_layers = text.num_hidden_layers
    for key, value in special.items():
        setattr(cfg, key, value)
    head = text.hidden_size // text.num_attention_heads
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [head // 4, head // 8, head // 8]}
    vision = cfg.vision_config
    for key, value in VISION.items():
        setattr(vision, key, value)
    vision.hidden_size = text.hidden_size  # the merger's output: the text's width
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Qwen2VLForConditionalGeneration(cfg).train()


def describe_model(model: Any) -> str:
    c, t, v = model.config, model.config.get_text_config(), model.config.vision_config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    tower = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}") / 1e6
    return (f"`{type(model).__name__}` ({c.model_type}), {params:.1f}M parameters ({tower:.2f}M in the vision tower): "
            f"vocab {t.vocab_size}, hidden {t.hidden_size}, MLP {t.intermediate_size}, {t.num_hidden_layers} layers, "
            f"{t.num_attention_heads} heads, {t.num_key_value_heads} KV heads, mRoPE sections "
            f"{t.rope_parameters['mrope_section']}; vision tower: {v.depth} blocks of width {v.embed_dim}, patch "
            f"{v.patch_size}, merge {v.spatial_merge_size}×{v.spatial_merge_size}; "
            f"{str(next(model.parameters()).dtype)[6:]} on cpu, `sdpa`")


def _configured(model: Any, kind: str) -> Any:
    import padfree

    m = copy.deepcopy(model)
    if kind == "packed":
        padfree.configure_packing(m)
    return m


def sample_losses(model: Any, plan: Any, members: list[list[int]], batches: list[Any] | None = None
                  ) -> dict[int, tuple[float, int]]:
    """Every sample's summed next-token cross-entropy and its target count, from the plan's batches at the model's
    current weights (no gradient). ``batches``: a packed plan's ``PackedBatch`` per step (its pieces' lengths)."""
    import torch
    import torch.nn.functional as F

    out: dict[int, tuple[float, int]] = {}
    with torch.no_grad():
        for k, (step, rows) in enumerate(zip(plan.steps, members, strict=True)):
            logits = model(**{key: v for key, v in step.inputs.items() if key != "labels"}).logits
            if batches is not None:  # the real tokens row after row, cut at every sample's length
                batch = batches[k]
                flat, ids = batch.unpad(logits), batch.unpad(batch.input_ids)
                cuts = np.cumsum(batch.seq_lens.tolist())[:-1]
                pieces = list(zip(torch.tensor_split(flat, cuts.tolist()), torch.tensor_split(ids, cuts.tolist()),
                                  strict=True))
            else:
                n = step.inputs["attention_mask"].sum(1).tolist()
                pieces = [(logits[r, :w], step.inputs["input_ids"][r, :w]) for r, w in enumerate(n)]
            for index, (lg, tokens) in zip(rows, pieces, strict=True):
                loss = F.cross_entropy(lg[:-1].double(), tokens[1:], reduction="sum")
                out[index] = (float(loss), len(tokens) - 1)
    return out


def loss_check(model: Any, plans: dict[str, Any], members: dict[str, list[list[int]]],
               batches: list[Any]) -> dict[str, dict[int, tuple[float, int]]]:
    """Every mode's per-sample losses at the initial weights."""
    got = {}
    for mode, plan in plans.items():
        m = _configured(model, plan.model)
        got[mode] = sample_losses(m, plan, members[mode], batches if plan.model == "packed" else None)
        del m
    return got


def peak_memory(model: Any, plan: Any) -> tuple[int, int, int]:
    """``(positions, peak RSS above the resident state, peak RSS)`` in bytes of the forward + backward of the plan's
    largest step, in this process after the timed passes (every lazy initialisation done): glibc returns what was
    freed (``malloc_trim``), the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``), the step runs."""
    import gc

    from _common import peak_rss, rss

    step = max(plan.steps, key=lambda s: s.positions)
    m = _configured(model, plan.model)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    m(**step.inputs).loss.backward()
    peak = peak_rss()
    del m
    gc.collect()
    return step.positions, peak - base, peak


def trl_refusals(model: Any, proc: Any, rows: list[dict[str, Any]]) -> dict[str, str]:
    """What TRL's ``SFTTrainer`` says to ``padding_free=True`` and to ``packing=True`` on this vision dataset."""
    import tempfile

    import datasets
    import trl

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_list([{"text": r["text"], "images": r["images"]} for r in rows[:4]])
    out = {}
    for option in ("padding_free", "packing"):
        with tempfile.TemporaryDirectory() as tmp:
            config = trl.SFTConfig(output_dir=tmp, report_to=[], per_device_train_batch_size=2, max_length=None,
                                   use_cpu=True,
                                   **{option: True})
            try:
                trl.SFTTrainer(model=copy.deepcopy(model), args=config, train_dataset=ds, processing_class=proc)
                out[option] = "accepted"
            except (ValueError, NotImplementedError) as exc:
                out[option] = f"refused: `` {type(exc).__name__}: {str(exc).strip().splitlines()[0]} ``"
    return out


# ---- report -------------------------------------------------------------------------------------------------------


def loss_summary(losses: dict[str, dict[int, tuple[float, int]]]) -> tuple[list[list[str]], dict[str, float]]:
    """Rows (mode, samples, targets, per-token loss, vs padded: |Δ| of the per-token loss, max |Δ| of a sample's
    mean loss) and every mode's per-token loss."""
    means, rows = {}, []
    ref = losses.get("padded")
    for mode, got in losses.items():
        total, count = sum(v for v, _ in got.values()), sum(n for _, n in got.values())
        means[mode] = total / count
        if ref is not None and mode != "padded":
            worst = max(abs(got[i][0] / max(got[i][1], 1) - ref[i][0] / max(ref[i][1], 1)) for i in ref)
            same = all(got[i][1] == ref[i][1] for i in ref) and set(got) == set(ref)
            delta = [f"{abs(means[mode] - means['padded']):.1e}", f"{worst:.1e}", "yes" if same else "**no**"]
        else:
            delta = ["–", "–", "–"]
        rows.append([f"`{mode}`", f"{len(got):,}", f"{count:,}", f"{means[mode]:.6f}", *delta])
    return rows, means


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, what: str, model_text: str,
           report: Any, collate: dict[str, float], memory: dict[str, tuple[int, int, int]],
           loss_rows: list[list[str]], refusals: dict[str, str], elapsed: float) -> str:
    res = report.results
    lines = [
        START,
        "## Vision-language SFT throughput (`benchmarks/bench_vlm.py`)",
        "",
        generated("bench_vlm.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, versions=[f"torch threads {info['threads']}", allocator()]),
        "- **A shared machine**: other engineers' tests and benchmarks may run on the same cores, so absolute "
        "tokens/s are low and drift. The modes run their passes together in one process, interleaved step by step "
        "(`padfree.throughput.compare_training`: next is always the mode furthest behind in its own pass; each mode "
        "has its own copy of the model and optimizer), so a change of load hits every mode alike; "
        + (f"the median of {args.repetitions} passes per mode" if args.repetitions > 1 else "one pass per mode")
        + "; the ratio of CPU time beside the wall-time ratio.",
        f"- Model: {model_text}.",
        f"- Data: {what}.",
        f"- Batching: C = {args.capacity:,} tokens per packed row, B = {args.rows}: a padded batch holds B samples "
        "(random order, right-padded to its longest, 0/1 `attention_mask`), a packed step the samples of B rows of "
        "a `pack_sequences` plan (random bin order) through `packed_collate_fn(C, carry=[\"pixel_values\", "
        "\"image_grid_thw\", \"mm_token_type_ids\"])`, so no step of either computes more than B × C = "
        f"{args.rows * args.capacity:,} positions. The vision tower sees the same patches in every mode "
        "(Qwen2-VL's pixels are never padded).",
        "- Step: `model(**inputs).loss` (transformers' own loss: every token's next token is a target, image "
        "tokens included, as TRL's collator labels them; padding and, in packed rows, each sample's first token "
        "masked), `backward()`, `AdamW(lr=1e-3).step()`; each pass starts from the same initial weights and a fresh "
        "optimizer, after one untimed warm-up step per mode (for `packed` it also holds padfree's one-time proof "
        "of the model's images on a tiny twin). Batches are built before the clock starts (collate times below).",
        "- Real tokens/s = the sample's tokens (text + vision markers + image tokens) / the pass's wall time. "
        "*filled* = real tokens / computed positions.",
        "",
        "### Results",
        "",
    ]
    rows = []
    for m, r in res.items():
        pos, above, peak = memory.get(m, (0, 0, 0))
        rows.append([f"`{m}`", f"{r.steps:,}", f"{r.positions:,}", f"{r.efficiency:.1%}",
                     " / ".join(f"{s:.1f}" for s in r.seconds), f"{r.tokens_per_second:,.0f}",
                     f"{report.speedup('packed', m):.2f}×", f"{report.cpu_speedup('packed', m):.2f}×",
                     f"{pos:,}" if pos else "–", f"{above / 2**20:,.0f}" if pos else "–",
                     f"{above / 2**20 / pos * 1000:,.0f}" if pos else "–", f"{peak / 2**20:,.0f}" if pos else "–",
                     f"{collate[m]:.2f}", f"{r.final_loss():.3f}"])
    for option, text in refusals.items():
        rows.append([f"TRL `{option}=True`", *["–"] * 12, text])
    lines += [table(["mode", "steps", "positions", "filled", "pass s (each repetition)", "real tokens/s",
                     "packed / mode", "packed / mode, CPU time", "largest step, positions",
                     "its peak MiB above resident", "per 1k positions", "peak RSS MiB", "collate s", "final loss"],
                    rows, "lrrrrrrrrrrrrl"), ""]
    target_rows = []
    for m in ("padded", "trl"):
        if m in res and "packed" in res:
            got = report.speedup("packed", m)
            verdict = "**met**" if got >= TARGET else "**not met**"
            target_rows.append([f"packed ≥ {TARGET}× `{m}` tokens/s", f"{got:.2f}×",
                                f"{report.cpu_speedup('packed', m):.2f}×", verdict])
    lines += [table(["target", "measured (wall)", "measured (CPU time)", "verdict (wall)"], target_rows, "lrrl"), ""]
    lines += [
        "Same loss — every mode's batches once at the initial weights, no gradient: each sample's summed "
        "next-token cross-entropy (float64 over the model's fp32 logits) from its own tokens in the batch, then "
        "the per-token mean over the whole sample (Δ: the absolute difference from `padded`'s; a sample's mean loss "
        "compared sample by sample; *same targets* = every sample has as many targets in both):",
        "",
        table(["mode", "samples", "targets", "per-token loss", "Δ per-token loss", "largest Δ of a sample's mean",
               "same targets"], loss_rows, "lrrrrrl"),
        "",
        "- *largest step*: the mode's step with the most positions, its forward + backward run once more after the "
        "timed passes on a fresh copy of the model, after `gc.collect()` and `malloc_trim(0)` and with the "
        "kernel's peak-RSS mark reset (`/proc/self/clear_refs`): *peak above resident* = the step's peak RSS minus "
        "the RSS before it (its activations, logits and gradients); *peak RSS* = the whole process's peak during "
        "the step (it also holds the data, the processor and every mode's batches).",
        "- *collate s*: building all the mode's batches once, off the clock: `padded` stacks ready processor "
        "outputs; `trl` runs the processor on text and images (tokenizing, resizing, patching) as "
        "`SFTTrainer` does on every step; `packed` plans and lays out ready processor outputs.",
        "- *final loss* = token-weighted mean training loss of the steps that trained the last quarter of the tokens "
        "of the pass. The modes batch differently (different numbers of optimizer steps and samples per step), so "
        "their training curves are not expected to agree step by step; that the same tokens through the same "
        "weights give the same loss is what the check above shows.",
        "- TRL refuses its padding-free and packed paths for any vision dataset (the rows above, `SFTTrainer`'s own "
        "message). Its text padding-free collator (`DataCollatorForLanguageModeling(padding_free=True)`) writes 1-D "
        "`position_ids` restarting per sample; nothing in TRL 1.16's SFT code computes a sample's mRoPE rows "
        "(`get_rope_index` over its own grids) for a flattened row.",
        "",
        "### What limits the ratio here",
        "",
        "- Everything but attention costs the same per computed position, padding included (the lm_head and the "
        "loss over the vocabulary, the decoder's linear layers): packed vs padded follows the ratio of computed "
        "positions, less what both spend alike — the vision tower runs the same patches in every mode, and "
        "padfree's per-step work (each sample's mRoPE rows, the packed layout) is timed in `packed`.",
        "- The sample is drawn from the mix `bench_training.py` trains (mostly short instruction records, a long tail "
        "of documents cut to C), and images lengthen the samples that carry them; padding follows the spread of "
        "lengths inside each padded batch (the sample's range is under *Data*). A small sample draws few of the "
        "long documents, so the spread here is mostly that of the records and their images.",
        "- Peak memory follows a step's positions: about the same MiB per 1k positions in every mode (the logits "
        "over the vocabulary and their gradient dominate). A packed step of B rows is sized to B × C whatever the "
        "samples; a padded batch to B × its longest sample, which for short samples is well under B × C — so "
        "packed's largest step here holds more positions, and more samples, than padded's largest batch. Choose "
        "the packed rows per step by memory (B × C), not by the padded batch size.",
    ]
    lines.append(END)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small sample, one repetition")
    parser.add_argument("--modes", default="padded,trl,packed", help="comma-separated subset of padded,trl,packed")
    parser.add_argument("--capacity", type=int, default=None, help="row length C (default 1024; --quick 512)")
    parser.add_argument("--rows", type=int, default=8, help="B: samples per padded batch, rows per packed step")
    parser.add_argument("--tokens", type=int, default=None, help="text tokens drawn (default 4000; --quick 1500)")
    parser.add_argument("--image-share", type=float, default=0.5, help="share of samples with images")
    parser.add_argument("--repetitions", type=int, default=None, help="timed passes per mode (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory probes")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-write"]
    args.capacity = args.capacity or (512 if args.quick else 1024)
    args.tokens = args.tokens or (1500 if args.quick else 4000)
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.modes = tuple(args.modes.split(","))
    if "packed" not in args.modes or not set(args.modes) <= {"padded", "trl", "packed"}:
        parser.error("--modes: a subset of padded,trl,packed that includes packed")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    warnings.filterwarnings("ignore")
    import transformers

    from padfree.throughput import compare_training

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    info = machine(("numpy", "torch", "transformers", "trl", "datasets", "pillow", "padfree"))
    info["threads"] = str(torch.get_num_threads())
    before = load_snapshot()
    log("building the samples")
    proc = processor()
    samples, trl_rows, what = build_samples(args, proc)
    tok = proc.tokenizer
    special = dict(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                   video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                   vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                   vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
    model = build_model(len(tok), special)
    model_text = describe_model(model)
    log(f"{len(samples)} samples; {model_text}")
    plans, members, collate, batches = build_plans(args, samples, trl_rows, proc)
    log("steps: " + ", ".join(f"{m} {len(p.steps)} ({p.positions:,} positions)" for m, p in plans.items()))
    refusals = trl_refusals(model, proc, trl_rows) if "trl" in args.modes else {}
    log(f"TRL: {refusals}")
    losses = loss_check(model, plans, members, batches)
    loss_rows, means = loss_summary(losses)
    log("per-token loss at the initial weights: " + ", ".join(f"{m} {v:.6f}" for m, v in means.items()))
    last = [time.perf_counter()]

    def progress(mode: str, rep: int, n: int) -> None:
        if time.perf_counter() - last[0] > 30:
            last[0] = time.perf_counter()
            log(f"  {mode} rep {rep}")

    report = compare_training(model, None, capacity=args.capacity, rows=args.rows, plans=plans,
                              repetitions=args.repetitions, seed=args.seed, check=False, progress=progress)
    for m, r in report.results.items():
        log(f"  {m:8s} {r.tokens_per_second:9.1f} tok/s  runs {' '.join(f'{s:.1f}' for s in r.seconds)} s")
    memory = {}
    if args.memory:
        for m, plan in plans.items():
            memory[m] = peak_memory(model, plan)
            log(f"  {m}: largest step {memory[m][0]:,} positions, peak {memory[m][1] / 2**20:,.0f} MiB above resident")
    after = load_snapshot()
    section = render(args, info, before, after, what, model_text, report, collate, memory, loss_rows, refusals,
                     time.perf_counter() - t0)
    emit(section, args.no_write, args.output, (START, END), log)


if __name__ == "__main__":
    main()
