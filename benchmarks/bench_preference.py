"""DPO training-step throughput: TRL's padded ``DPOTrainer`` against padfree's ``DPOTrainer`` padded, padding-free
and with pairs packed across the train set; writes its section of ``BENCHMARKS.md``.

Four trainers per model, side by side in one process, each with its own copy of the policy and reference model:

- ``trl`` — ``trl.DPOTrainer``: TRL's padded micro-batches (the anchor);
- ``padded`` — ``padfree.DPOTrainer`` with ``DPOConfig(padding_free=False)``: the same padded batches (should match
  the anchor: padfree steps out of the way);
- ``padding_free`` — ``padding_free=True``: each micro-batch (B pairs, chosen + rejected) run as one packed row, the
  reference model's pass too;
- ``packing`` — ``packing=True``: the train set's pairs packed (best fit decreasing) into micro-batches of at most
  ``packing_length`` tokens (default ``2 · max_length · B``, the positions bound of a padded micro-batch, so the
  peak memory bound is the same), each one packed row. A packed micro-batch holds a different number of pairs than
  a padded one, so the modes are compared per pair (pairs/s) and per real token;
- ``padding_free_same`` — ``padding_free=True`` over exactly the pairs ``packing`` times (its timed bins' pairs in
  their packing order, B pairs per micro-batch): the like-for-like per-token anchor of ``packing``. Best fit
  decreasing groups pairs by length, so the few bins a run times hold longer or shorter pairs than the random
  micro-batches of ``padding_free``, and the cost per token grows with a sequence's length (attention is
  quadratic, GatedDeltaNet's chunks are 64 tokens) — only the same pairs compare the two ways to run them.

Data: real-length pairs from ``../shared/data/`` (``gsm8k_train.json`` and ``gpteacher_toolformer.json``): prompt =
instruction (+ input), chosen = the record's output, rejected = another record's output cut to a random fraction
(10%-100%) of its characters, so chosen and rejected differ several-fold in length as real preference pairs do;
tokenized by TRL with the offline Mistral 7B v0.1 SentencePiece tokenizer (mistral-common's ``tokenizer.model.v1``,
32k vocabulary).

Models (random weights, fp32, CPU): a tiny Llama (vocab 32000, hidden 256, MLP 688, 4 layers, 4 heads, 2 KV heads)
and a tiny hybrid ``qwen3_5_text`` (hidden 128, MLP 344, 2 layers: 1 GatedDeltaNet + 1 attention; its GatedDeltaNet
has no CUDA kernel here and runs the PyTorch path, ~50 s per padded step at 4 layers on 2 busy cores, hence smaller
and ``--hybrid-steps`` timed steps); the reference model is a copy of the policy.

Timing: each trainer's ``train()`` runs ``--warmup + --steps`` optimizer steps (gradient accumulation 1, AdamW); a
step is the wall time between consecutive ``on_step_end`` callbacks (data loading and collation, the reference
forward, the policy forward + backward, the optimizer step, logging), the first ``--warmup`` steps of every call
dropped. The modes alternate, one ``train()`` call each per repetition (``--repetitions``), so a change of load on the
shared machine hits every mode alike; medians over the repetitions. Each call starts from the same data order (the
same seed), so ``trl``, ``padded`` and ``padding_free`` time exactly the same micro-batches, and ``packing`` the
same bins in every call; ``padding_free_same`` (which runs after ``packing`` in the first repetition, whose bins it
takes) times those bins' pairs.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_preference.py            # ~25-45 min on 2 cores (five modes, two models)
    python benchmarks/bench_preference.py --quick    # a smoke run (~1 min): llama only, small sizes

Only the section between ``<!-- bench_preference:start -->`` and ``<!-- bench_preference:end -->`` is replaced.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, allocator, conditions, emit, generated, load_snapshot, machine, table

START, END = "<!-- bench_preference:start -->", "<!-- bench_preference:end -->"
MODES = ("trl", "padded", "padding_free", "packing", "padding_free_same")
ANCHOR = "trl"
TARGET = 1.8
PROFILE_ROUNDS = 2  # timed rounds of the per-component profile, after an untimed one
FILES = ("gsm8k_train.json", "gpteacher_toolformer.json")
SIZES = {
    "llama": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3_5_text": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, layer_types=["linear_attention", "full_attention"]),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def data_dir() -> Path:
    return Path(os.environ.get("PADFREE_DATA", REPO.parent / "shared" / "data"))


def pairs(n: int, seed: int) -> tuple[Any, str]:
    """``n`` preference pairs (prompt, chosen, rejected) from the instruct records, and a description."""
    import datasets

    records = []
    for name in FILES:
        records += json.loads((data_dir() / name).read_text(encoding="utf-8"))
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(records), size=n, replace=False)
    others = rng.choice(len(records), size=n, replace=False)
    cuts = rng.uniform(0.1, 1.0, size=n)
    rows = []
    for i, j, cut in zip(picks, others, cuts, strict=True):
        r, other = records[i], records[j]["output"]
        prompt = "\n".join(f for f in (r["instruction"], r.get("input", "")) if f) + "\n"
        rows.append({"prompt": prompt, "chosen": " " + r["output"],
                     "rejected": " " + other[: max(1, round(cut * len(other)))]})
    what = (f"{n:,} pairs drawn (seed {seed}) from {len(records):,} records of {', '.join(FILES)}: prompt = "
            "instruction (+ input), chosen = its output, rejected = another record's output cut to a uniform "
            "10%-100% of its characters")
    return datasets.Dataset.from_list(rows), what


def tokenizer(folder: Path) -> Any:
    """mistral-common's 32k SentencePiece model through transformers, offline (as ``tests/zoo.py`` loads it)."""
    import shutil

    import mistral_common
    import transformers

    shutil.copy(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", folder / "tokenizer.model")
    return transformers.LlamaTokenizer.from_pretrained(str(folder))


def build_model(kind: str, vocab: int, quick: bool) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    sizes = dict(SIZES[kind])
    if quick:
        sizes.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16)
        if kind == "qwen3_5_text":
            sizes["layer_types"] = ["linear_attention", "full_attention"]
    config = transformers.AutoConfig.for_model(kind, vocab_size=vocab, max_position_embeddings=4096, **sizes)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def describe_model(model: Any) -> str:
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    layers = getattr(c, "layer_types", None)
    mix = ""
    if layers and c.model_type == "qwen3_5_text":
        mix = f" ({layers.count('linear_attention')} GatedDeltaNet + {layers.count('full_attention')} attention)"
    return (f"`{type(model).__name__}` ({c.model_type}), {n / 1e6:.1f}M parameters: vocab {c.vocab_size}, hidden "
            f"{c.hidden_size}, MLP {c.intermediate_size}, {c.num_hidden_layers} layers{mix}, "
            f"{c.num_attention_heads} heads, {c.num_key_value_heads} KV heads; float32 on cpu, sdpa")


class Meter:
    """What one mode's ``train()`` calls did: per step the wall and CPU seconds, and per micro-batch its pairs, real
    tokens and computed positions."""

    def __init__(self) -> None:
        self.calls: list[dict[str, list]] = []
        self.active = False  # only micro-batches of a train() call count (not the profile's after the runs)

    def begin(self) -> None:
        self.calls.append({"wall": [], "cpu": [], "pairs": [], "real": [], "positions": [], "loss": []})
        self.active = True
        self._mark = (time.perf_counter(), time.process_time())

    def end(self) -> None:
        self.active = False

    def step_end(self) -> None:
        now = (time.perf_counter(), time.process_time())
        self.calls[-1]["wall"].append(now[0] - self._mark[0])
        self.calls[-1]["cpu"].append(now[1] - self._mark[1])
        self._mark = now

    def batch(self, inputs: dict[str, Any], padfree_row: bool) -> None:
        if not self.active:
            return
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        real = int(mask.sum())
        call = self.calls[-1]
        call["pairs"].append(int(ids.shape[0]) // 2)
        call["real"].append(real)
        call["positions"].append(real if padfree_row else int(ids.numel()))


COMPONENTS = (("attention", "self_attn"), ("GatedDeltaNet", "linear_attn"), ("MLP", "mlp"))


class Components:
    """Wall seconds per component of the forwards and the backward of one DPO micro-batch, read by module hooks
    (the CPU runs each op synchronously on the calling thread, so a hook's clock brackets exactly its module; a
    module called again inside its own call counts once): in the forwards (reference + policy) the decoder layers'
    attention, GatedDeltaNet and MLP modules, and the LM head with the log-probs (the model's call less its
    backbone's); in the backward the LM head's part (from its start to the final norm's backward) and the
    backbone's (the rest: modules called with keyword arguments get no backward hooks, so it is not split)."""

    def __init__(self, models: list[Any]) -> None:
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        self.handles: list[Any] = []
        self.marks: dict[int, list[float]] = {}
        self.head_end: float | None = None
        for model in models:
            inner = model.model
            self._hook(model, "total", nested=True)
            self._hook(inner, "backbone")
            for layer in inner.layers:
                for name, attr in COMPONENTS:
                    sub = getattr(layer, attr, None)
                    if sub is not None:
                        self._hook(sub, name, nested=True)
            self.handles.append(inner.norm.register_full_backward_pre_hook(self._norm_backward))

    def _hook(self, module: Any, name: str, nested: bool = False) -> None:
        key = id(module)

        def pre(mod: Any, *a: Any, **k: Any) -> None:
            self.marks.setdefault(key, []).append(time.perf_counter())

        def post(mod: Any, *a: Any, **k: Any) -> None:
            start = self.marks[key].pop()
            if not nested or not self.marks[key]:  # the outermost call of a nested one (the unpadded re-entry)
                self.fwd[name] = self.fwd.get(name, 0.0) + time.perf_counter() - start

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _norm_backward(self, mod: Any, grad_output: Any) -> None:
        if self.head_end is None:
            self.head_end = time.perf_counter()

    def run(self, trainer: Any, batch: dict[str, Any]) -> dict[str, tuple[float, float]]:
        """One ``compute_loss`` (the reference forward and the policy forward) and its backward: ``{component:
        (forward s, backward s)}``."""
        model = trainer.model
        try:
            loss = trainer.compute_loss(model, batch)
            start = time.perf_counter()
            loss.backward()
            total_bwd = time.perf_counter() - start
        finally:
            for h in self.handles:
                h.remove()
            model.zero_grad(set_to_none=True)
        fwd = self.fwd
        head_bwd = (self.head_end - start) if self.head_end is not None else 0.0
        out = {name: (fwd[name], 0.0) for name, _ in COMPONENTS if name in fwd}
        layers = sum(f for f, _ in out.values())
        backbone = "backbone: forward of embeddings, norms, rotary, layout; backward of all of it"
        out[backbone] = (fwd["backbone"] - layers, total_bwd - head_bwd)
        out["LM head + log-probs, loss, unpadding"] = (fwd["total"] - fwd["backbone"], head_bwd)
        out["total"] = (fwd["total"], total_bwd)
        return out


def callback(meter: Meter) -> Any:
    import transformers

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.begin()

        def on_step_end(self, args, state, control, **kwargs):
            meter.step_end()

        def on_train_end(self, args, state, control, **kwargs):
            meter.end()

    return Clock()


def trainers(policy: Any, ref: Any, tok: Any, train: Any, args: argparse.Namespace, out: Path,
             meters: dict[str, Meter], steps: int, bins: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The trainers of every mode, each with its own copies of the models; ``bins`` collects every packed bin that
    ``packing``'s collator is given, in order."""
    import trl

    from padfree import DPOConfig, DPOTrainer

    base = dict(report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                per_device_train_batch_size=args.batch_size, max_length=args.max_length,
                max_steps=args.warmup + steps, logging_steps=1, learning_rate=1e-6, seed=args.seed,
                dataloader_drop_last=True, gradient_accumulation_steps=1)
    built = {}
    for mode in MODES:
        if mode == "trl":
            cfg, cls = trl.DPOConfig(str(out / mode), **base), trl.DPOTrainer
        else:
            same = {"padding_free": True, "train_sampling_strategy": "sequential", "dataloader_drop_last": False}
            extra = {"padded": {"padding_free": False}, "padding_free": {"padding_free": True},
                     "packing": {"packing": True, "packing_length": args.packing_length},
                     "padding_free_same": same}[mode]
            cfg, cls = DPOConfig(str(out / mode), **{**base, **extra}), DPOTrainer
        trainer = cls(model=copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=cfg, train_dataset=train,
                      processing_class=tok, callbacks=[callback(meters[mode])])
        if mode == "packing":
            collate = trainer.data_collator

            def recording(features, _inner=collate):
                bins.append([dict(f) for f in features])
                return _inner(features)

            trainer.data_collator = recording
        padfree_row = mode not in ("trl", "padded")
        inner = trainer.compute_loss

        def compute_loss(model, inputs, *a, _inner=inner, _meter=meters[mode], _row=padfree_row, **k):
            if model.training:
                _meter.batch(inputs, _row)
            return _inner(model, inputs, *a, **k)

        trainer.compute_loss = compute_loss
        built[mode] = trainer
    return built


def unbin(packed: dict[str, list]) -> list[dict[str, Any]]:
    """The pairs of one packed bin (a dict of per-pair lists), in their packing order."""
    return [{name: values[i] for name, values in packed.items()} for i in range(len(packed["prompt_ids"]))]


def same_pairs(trainer: Any, bins: list[list[dict[str, Any]]], args: argparse.Namespace, steps: int) -> int:
    """Point ``padding_free_same``'s trainer at the pairs of the bins ``packing``'s first call timed: first B pairs
    of its warm-up bins for each warm-up step, then every pair of the timed bins, B per micro-batch in their packing
    order (sequential sampler, the last micro-batch kept whole); returns the pairs timed."""
    import datasets

    calls = bins[: args.warmup + steps]  # one micro-batch = one bin
    warm = [pair for features in calls[: args.warmup] for b in features for pair in unbin(b)]
    timed = [pair for features in calls[args.warmup:] for b in features for pair in unbin(b)]
    need = args.warmup * args.batch_size
    warm = (warm * (need // max(1, len(warm)) + 1))[:need]  # a warm-up bin with fewer than B pairs repeats them
    trainer.train_dataset = datasets.Dataset.from_list(warm + timed)
    trainer.args.max_steps = args.warmup + -(-len(timed) // args.batch_size)
    return len(timed)


def seq_lengths(train: Any, max_length: int) -> dict[str, np.ndarray]:
    """Tokens of each pair's chosen and rejected sequence (prompt + completion, truncated as TRL truncates)."""
    prompt = np.array([len(p) for p in train["prompt_ids"]])
    return {side: np.minimum(prompt + np.array([len(c) for c in train[f"{side}_ids"]]), max_length)
            for side in ("chosen", "rejected")}


def padded_epoch(lengths: dict[str, np.ndarray], batch: int, seed: int) -> tuple[int, int, int]:
    """Real tokens and positions of every padded micro-batch of one epoch of the tokenized train set (random
    order), and the number of pairs: the padding fraction at the scale of a run, not only of the timed steps."""
    n = lengths["chosen"].shape[0]
    order = np.random.default_rng(seed).permutation(n)
    real = positions = 0
    for start in range(0, n - batch + 1, batch):
        idx = order[start:start + batch]
        both = np.concatenate([lengths["chosen"][idx], lengths["rejected"][idx]])
        real += int(both.sum())
        positions += int(both.max()) * both.shape[0]
    return real, positions, n - n % batch


def summarize(meter: Meter, warmup: int) -> dict[str, Any]:
    per_call = []
    for call in meter.calls:
        wall, cpu = sum(call["wall"][warmup:]), sum(call["cpu"][warmup:])
        pairs_, real = sum(call["pairs"][warmup:]), sum(call["real"][warmup:])
        per_call.append({"wall": wall, "cpu": cpu, "pairs": pairs_, "real": real,
                         "positions": sum(call["positions"][warmup:]),
                         "steps": len(call["wall"][warmup:])})
    pps = [c["pairs"] / c["wall"] for c in per_call]
    tps = [c["real"] / c["wall"] for c in per_call]
    cpu_pps = [c["pairs"] / c["cpu"] for c in per_call]
    first = per_call[0]
    return {"pairs_s": statistics.median(pps), "tokens_s": statistics.median(tps),
            "cpu_pairs_s": statistics.median(cpu_pps), "each": pps, "pairs": first["pairs"],
            "real": first["real"], "positions": first["positions"], "steps": first["steps"],
            "step_s": statistics.median(c["wall"] / c["steps"] for c in per_call)}


def run_model(kind: str, tok: Any, train_pairs: Any, args: argparse.Namespace) -> dict[str, Any]:
    import padfree

    t0 = time.perf_counter()
    ref = build_model(kind, len(tok), args.quick)
    policy = copy.deepcopy(ref)
    meters = {m: Meter() for m in MODES}
    bins: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as out:
        log(f"{kind}: building the trainers (TRL tokenizes the pairs; padfree packs them)")
        steps = args.hybrid_steps if kind == "qwen3_5_text" else args.steps
        built = trainers(policy, ref, tok, train_pairs, args, Path(out), meters, steps, bins)
        status = padfree.packing_status(built["packing"])
        for m in ("padded", "padding_free"):
            log(f"{kind}: {m}: {padfree.packing_status(built[m])}")
        log(f"{kind}: packing: {status}")
        logps: dict[str, float] = {}
        for rep in range(args.repetitions):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                if mode == "padding_free_same" and rep == 0:  # packing's first call has run: its bins are known
                    timed = same_pairs(built[mode], bins, args, steps)
                    log(f"{kind}: padding_free_same: the {timed} pairs of packing's {steps} timed bin(s)")
                built[mode].train()
                if rep == 0:
                    logps[mode] = next(h["logps/chosen"] for h in built[mode].state.log_history
                                       if "logps/chosen" in h)
                last = meters[mode].calls[-1]
                log(f"{kind}: rep {rep + 1}/{args.repetitions} {mode}: "
                    f"{sum(last['pairs'][args.warmup:]) / sum(last['wall'][args.warmup:]):.2f} pairs/s "
                    f"(steps {' '.join(f'{w:.1f}' for w in last['wall'])} s)")
        # where the time of one packed micro-batch (packing's first timed bin) goes, per component, and of the same
        # pairs run padding-free in micro-batches of B pairs
        features = bins[args.warmup]
        pairs_ = [pair for b in features for pair in unbin(b)]
        runs = {"packing": [built["packing"].data_collator(features)],
                "padding_free_same": [built["padding_free_same"].data_collator(pairs_[i:i + args.batch_size])
                                      for i in range(0, len(pairs_), args.batch_size)]}
        # one untimed round first (a row's first run grows the heap, and this VM faults fresh memory in slowly), then
        # PROFILE_ROUNDS timed rounds alternating the two modes; the median of each component over the timed rounds
        samples: dict[str, list[dict[str, tuple[float, float]]]] = {mode: [] for mode in runs}
        for rnd in range(PROFILE_ROUNDS + 1):
            for mode in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
                trainer = built[mode]
                trainer.model.train()
                parts: dict[str, tuple[float, float]] = {}
                for batch in runs[mode]:
                    for name, (f, b) in Components([trainer.model, trainer.ref_model]).run(trainer, batch).items():
                        f0, b0 = parts.get(name, (0.0, 0.0))
                        parts[name] = (f0 + f, b0 + b)
                if rnd:
                    samples[mode].append(parts)
        profiles = {}
        for mode, batches in runs.items():
            parts = {name: (statistics.median(p[name][0] for p in samples[mode]),
                            statistics.median(p[name][1] for p in samples[mode])) for name in samples[mode][0]}
            profiles[mode] = {"real": sum(int(b["attention_mask"].sum()) for b in batches),
                              "sequences": sum(int(b["input_ids"].shape[0]) for b in batches),
                              "batches": len(batches), "parts": parts}
            log(f"{kind}: profile {mode}: {profiles[mode]['real']} real tokens, "
                + ", ".join(f"{k} {f:.2f}+{b:.2f} s" for k, (f, b) in parts.items()))
        tokenized = built["trl"].train_dataset
        lengths = seq_lengths(tokenized, args.max_length)
        epoch = padded_epoch(lengths, args.batch_size, args.seed)
        results = {m: summarize(meters[m], args.warmup) for m in MODES}
        del built
    return {"model": describe_model(ref), "results": results, "logps": logps, "epoch": epoch,
            "packing": status, "lengths": lengths, "seconds": time.perf_counter() - t0, "profiles": profiles}


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, what: str,
           results: dict[str, dict[str, Any]], elapsed: float) -> str:
    lines = [
        START,
        "## DPO training-step throughput (`benchmarks/bench_preference.py`)",
        "",
        generated("bench_preference.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, versions=[f"torch threads {info['threads']}", allocator()]),
        "- **A shared machine**: other processes ran on the same cores, so absolute rates drift (±20% between "
        "minutes). The five modes alternate (one `train()` call of each per repetition, the order reversed every "
        f"other repetition); medians over {args.repetitions} repetitions; the CPU-time ratio (process CPU "
        "seconds, both threads) is given beside the wall-time ratio.",
        f"- Data: {what}; tokenized by TRL with mistral-common's `tokenizer.model.v1` (32k SentencePiece, Mistral "
        f"7B v0.1) through `transformers.LlamaTokenizer`; `max_length={args.max_length}` (TRL truncates each "
        "prompt + completion sequence to it).",
        f"- Training: `per_device_train_batch_size={args.batch_size}` pairs (a padded micro-batch is 2·B = "
        f"{2 * args.batch_size} sequences right-padded to the longest), gradient accumulation 1, AdamW (lr 1e-6), "
        "sigmoid DPO loss, a reference model (a copy of the policy) run every step (no precomputed reference "
        "log-probs), fp32 (`bf16=False`), `use_cpu=True`, `logging_steps=1`. `packing`: "
        f"`packing_length={args.packing_length}` tokens per packed micro-batch (= 2 · max_length · B, the "
        "positions bound of a padded micro-batch of full-length pairs, and padfree's default).",
        f"- Timed: {args.steps} optimizer steps (qwen3_5_text: {args.hybrid_steps}) per `train()` call after "
        f"{args.warmup} untimed warm-up "
        "step(s); a step = wall time between consecutive `on_step_end` callbacks (data loading + collation, "
        "reference forward, policy forward + backward, optimizer step, logging). Pairs/s = pairs of the timed "
        "micro-batches / their wall time; real tokens/s = their non-padding tokens (prompt + completion, chosen "
        "and rejected) / wall time. `trl`, `padded` and `padding_free` time the same micro-batches (same seed); "
        "`packing` times its own packed micro-batches, which hold more pairs each — hence per pair; "
        "`padding_free_same` times exactly the pairs of `packing`'s timed micro-batches, padding-free in "
        f"micro-batches of {args.batch_size} pairs (their packing order, the last one short): the like-for-like "
        "anchor of `packing` per real token.",
        "",
    ]
    for kind, res in results.items():
        r = res["results"]
        anchor = r[ANCHOR]
        real, positions, n_epoch = res["epoch"]
        st = res["packing"]
        ch, rj = res["lengths"]["chosen"], res["lengths"]["rejected"]
        ratio = np.maximum(ch, rj) / np.maximum(1, np.minimum(ch, rj))
        lines += [f"### {kind}: {res['model']}", "",
                  f"Sequence lengths (prompt + completion, tokens): chosen median {int(np.median(ch))} "
                  f"(p10 {int(np.percentile(ch, 10))}, p90 {int(np.percentile(ch, 90))}, max {int(ch.max())}), "
                  f"rejected median {int(np.median(rj))} (p10 {int(np.percentile(rj, 10))}, p90 "
                  f"{int(np.percentile(rj, 90))}); longer / shorter of a pair: median {np.median(ratio):.1f}×, "
                  f"p90 {np.percentile(ratio, 90):.1f}×. {res['seconds'] / 60:.1f} min for this model.", ""]
        per_pair = (ch.sum() + rj.sum()) / ch.shape[0]  # real tokens of the train set's mean pair

        norms = {m: r[m]["tokens_s"] / per_pair for m in MODES}  # pairs/s at the mean pair's length
        norm = norms.__getitem__

        rows = []
        for m in MODES:
            x = r[m]
            rows.append([f"`{m}`", f"{x['steps']}", f"{x['pairs'] / x['steps']:.1f}",
                         f"{x['real'] / x['pairs']:.0f}", f"{x['positions']:,}",
                         f"{x['real'] / x['positions']:.1%}", f"{x['step_s']:.2f}",
                         " / ".join(f"{v:.2f}" for v in x["each"]), f"{x['pairs_s']:.2f}",
                         f"{x['tokens_s']:,.0f}", f"{x['pairs_s'] / anchor['pairs_s']:.2f}×",
                         f"{x['cpu_pairs_s'] / anchor['cpu_pairs_s']:.2f}×", f"{norm(m):.2f}",
                         f"**{norm(m) / norm(ANCHOR):.2f}×**", f"{res['logps'][m]:.3f}"])
        lines += [table(["mode", "timed steps", "pairs / step", "real tokens / pair", "positions", "filled",
                         "s / step (median)", "pairs/s (each repetition)", "pairs/s (median)", "real tokens/s",
                         "vs `trl` per pair (wall)", "vs `trl` per pair (CPU time)",
                         "pairs/s at the mean pair length", "vs `trl`, same pair length",
                         "first step `logps/chosen`"], rows, "lrrrrrrrrrrrrrr"), ""]
        best = max(("padding_free", "packing"), key=norm)
        got = norm(best) / norm(ANCHOR)
        lp = res["logps"]
        same = abs(lp["padded"] - lp["trl"]) <= 1e-5 * abs(lp["trl"])
        close = abs(lp["padding_free"] - lp["trl"]) <= 1e-4 * abs(lp["trl"])
        lines += [
            f"- Padding: the timed padded micro-batches are {1 - anchor['real'] / anchor['positions']:.1%} padding; "
            f"over one epoch of all {n_epoch:,} pairs in random padded micro-batches of B = {args.batch_size}: "
            f"{1 - real / positions:.1%} padding ({positions:,} positions for {real:,} real tokens, i.e. "
            f"{positions / real:.2f}× the positions padding-free computes). The train set's mean pair holds "
            f"{per_pair:.0f} real tokens (chosen + rejected).",
            f"- Packing: {st.rows:,} packed micro-batches of ≤ {args.packing_length:,} tokens for "
            f"{st.sequences // 2:,} pairs ({st.sequences // 2 / st.rows:.1f} pairs each), efficiency "
            f"{st.efficiency:.1%}.",
            "- Per pair: `trl`, `padded` and `padding_free` time the same micro-batches, so their pairs/s compare "
            "directly. `packing` times other pairs (best fit decreasing puts the long pairs together, so a few "
            "timed bins can hold longer or shorter pairs than the mean), so its per-pair rate is also given at the "
            "train set's mean pair length (real tokens/s ÷ real tokens of the mean pair); that column is the "
            "like-for-like per-pair comparison for every mode.",
            f"- Same computation: the first step's `logps/chosen` (policy log-probs of the same first micro-batch, "
            f"before any update): `padded` {lp['padded']:.4f} vs `trl` {lp['trl']:.4f} — "
            f"{'equal' if same else '**different**'}; `padding_free` {lp['padding_free']:.4f} — "
            f"{'equal to fp32 rounding' if close else '**different**'}; `packing` and `padding_free_same` score "
            "other pairs.",
            f"- Target (≥ {TARGET}× the padded DPO step per pair): best padfree mode `{best}` measures "
            f"**{got:.2f}× — {'met' if got >= TARGET else 'not met'}** at the same pair length (`padding_free` "
            f"{norm('padding_free') / norm(ANCHOR):.2f}×, `packing` {norm('packing') / norm(ANCHOR):.2f}×; "
            f"measured per pair on the timed micro-batches: `padding_free` "
            f"{r['padding_free']['pairs_s'] / anchor['pairs_s']:.2f}×, `packing` "
            f"{r['packing']['pairs_s'] / anchor['pairs_s']:.2f}×).",
            "",
        ]
        lines += packing_vs_padding_free(r, res["profiles"])
    lines += [
        "### What sets the ratios here",
        "",
        "- A DPO step runs the reference forward and the policy forward + backward over every position of the "
        "micro-batch, then scores the completion tokens against the 32k vocabulary. On the CPU TRL's fused LM head "
        "has no Triton kernel and scores *every* position it is given (it compacts to the completion tokens only "
        "on Triton devices): in `trl` and `padded` every position of the padded batch, padding and prompts "
        "included. In the padfree modes padfree answers that head on the packed row (`DPOConfig."
        "padfree_fused_head`, `padfree.integrations.fused_head`): the same per-token log-probs, entropies, mean "
        "logits and top-1 hits, computed for the completion tokens only, ~1,000 positions at a time in two reused "
        "buffers. On these small models the head is a large share of the step, so `padding_free`'s gain per pair "
        "is the positions padding wastes times the prompt positions the head skips, less padfree's per-batch "
        "layout work; `bench_lm_head` below times the two heads alone.",
        "- `packing` computes the same real tokens per pair as `padding_free` and fills its micro-batches "
        "(~99%), but each of its micro-batches is one row of up to packing_length tokens holding a few dozen "
        "pairs. Whether those larger rows cost more per token than rows of 2·B sequences is read on the same "
        "pairs: `packing` against `padding_free_same`. Against `padding_free`'s own micro-batches the ratio also "
        "carries the pairs' lengths (best fit decreasing bins hold pairs of similar length, and a few timed bins "
        "are not the train set's mix), which move the cost per token on their own.",
        "- The hybrid's GatedDeltaNet runs transformers' pure-PyTorch chunked fallback in the padded modes and "
        "padfree's boundary-resetting PyTorch implementation in the padfree modes, so its ratios include that "
        "difference, not only padding.",
        "- Memory on this machine: glibc maps every allocation above 32 MiB afresh and unmaps it when it is freed, "
        "and this virtual machine faults fresh pages in slowly (sys time near user time under glibc defaults). "
        "TRL's CPU LM head (`trl`, `padded`) scores tiles of up to 4,096 tokens against the whole vocabulary, each "
        "temporary `[tile, 32000]` fp32 (up to 500 MiB), made afresh for every tile; padfree's head works in two "
        "`[1048, 32000]` fp32 buffers (128 MiB each) made once per call whatever the row's length, and a long row's "
        "GatedDeltaNet runs in blocks of whole segments under 12 MiB (`padfree.model.row_blocks`), so a packed "
        "row's cost per token does not grow with its length through memory. The conditions' allocator line says "
        "which setting a run used: `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` (or jemalloc / tcmalloc, as "
        "CPU training guides recommend) keep freed memory in the process.",
        END,
    ]
    return "\n".join(lines)


PACKING_TARGET = 1.0


def packing_vs_padding_free(r: dict[str, Any], profiles: dict[str, Any]) -> list[str]:
    """The per-model verdict on ``packing`` against padding-free per real token on the same pairs
    (``padding_free_same``), and the per-component profile of one packed micro-batch and of its pairs run
    padding-free (ms per 1,000 real tokens) that explains it."""
    same, pk_r = r["padding_free_same"], r["packing"]
    ratio = pk_r["tokens_s"] / same["tokens_s"]
    met = ratio >= PACKING_TARGET
    pf, pk = profiles["padding_free_same"], profiles["packing"]

    def per_k(p: dict[str, Any], name: str, i: int) -> float:
        return 1e6 * p["parts"][name][i] / p["real"]

    names = [n for n in pf["parts"] if n != "total"] + ["total"]

    def cell(p: dict[str, Any], n: str, i: int) -> str:
        return "(in the backbone row)" if i == 1 and n in dict(COMPONENTS) else f"{per_k(p, n, i):,.0f}"

    rows = [[f"{'**' + n + '**' if n == 'total' else n}", *(cell(p, n, i) for p in (pf, pk) for i in (0, 1)),
             f"{(per_k(pk, n, 0) + per_k(pk, n, 1)) / max(1e-9, per_k(pf, n, 0) + per_k(pf, n, 1)):.2f}×"]
            for n in names]
    compute = (per_k(pf, "total", 0) + per_k(pf, "total", 1), per_k(pk, "total", 0) + per_k(pk, "total", 1))
    excess = sorted(((per_k(pk, n, 0) + per_k(pk, n, 1)) - (per_k(pf, n, 0) + per_k(pf, n, 1)), n)
                    for n in names if n != "total")
    same_tokens = "the same" if same["real"] == pk_r["real"] else f"**not the same** ({same['real']:,})"
    lines = [
        f"- **`packing` vs padding-free per real token on the same pairs (`padding_free_same`): {ratio:.2f}× "
        f"({pk_r['tokens_s']:,.0f} vs {same['tokens_s']:,.0f} real tokens/s, {pk_r['real']:,} real tokens timed per "
        f"call, {same_tokens} in both) — target ≥ {PACKING_TARGET:.1f}×: {'met' if met else 'not met'}.** Against "
        f"`padding_free`'s own micro-batches (other pairs, {r['padding_free']['real'] / r['padding_free']['pairs']:.0f}"
        f" real tokens per pair against {pk_r['real'] / pk_r['pairs']:.0f} in the timed bins): "
        f"{pk_r['tokens_s'] / r['padding_free']['tokens_s']:.2f}×.",
        "",
        f"Where one packed micro-batch's time goes (after the timed runs; `packing`'s first timed bin, "
        f"{pk['sequences']} sequences, {pk['real']:,} real tokens in one row, against the same pairs padding-free "
        f"in {pf['batches']} "
        f"micro-batches; one `compute_loss` — the reference forward and the policy forward — and its backward per "
        f"micro-batch, timed per module by hooks, see `Components`, medians of {PROFILE_ROUNDS} rounds alternating "
        f"the two after an untimed one; ms per 1,000 real tokens; the backward of the decoder layers is in the "
        f"backbone's row):",
        "",
        table(["component", "padding-free forward", "padding-free backward", "`packing` forward",
               "`packing` backward", "`packing` / padding-free"], rows, "lrrrrr"),
        "",
    ]
    step_pf = 1e3 / same["tokens_s"] * 1e3  # ms per 1,000 real tokens of a whole optimizer step
    step_pk = 1e3 / pk_r["tokens_s"] * 1e3
    if met:
        lines.append(f"- Per 1,000 real tokens, a `packing` step takes {step_pk:,.0f} ms and a padding-free step over "
                     f"the same pairs {step_pf:,.0f} ms; the forward + backward profiled above {compute[1]:,.0f} vs "
                     f"{compute[0]:,.0f} ms.")
    else:
        worst, name = excess[-1]
        lines.append(
            f"- Why not met: per 1,000 real tokens a `packing` step takes {step_pk:,.0f} ms against "
            f"{step_pf:,.0f} ms padding-free over the same pairs; the profiled forward + backward {compute[1]:,.0f} "
            f"vs {compute[0]:,.0f} ms ({compute[1] / max(1e-9, compute[0]):.2f}×). The largest excess is `{name}`: "
            f"{per_k(pk, name, 0) + per_k(pk, name, 1):,.0f} vs {per_k(pf, name, 0) + per_k(pf, name, 1):,.0f} ms "
            f"(+{worst:,.0f} ms)"
            + (f"; next `{excess[-2][1]}` ({excess[-2][0]:+,.0f} ms)" if len(excess) > 1 else "") + ".")
    lines.append("")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (~1 min): llama only, tiny sizes")
    parser.add_argument("--models", default=None, help="comma-separated: llama,qwen3_5_text (default both)")
    parser.add_argument("--pairs", type=int, default=None, help="pairs in the train set (default 1000)")
    parser.add_argument("--max-length", type=int, default=None, help="TRL's max_length (default 512)")
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size (pairs)")
    parser.add_argument("--packing-length", type=int, default=None, help="default 2 * max_length * batch size")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per call (default 2)")
    parser.add_argument("--hybrid-steps", type=int, default=1, help="timed steps per call for qwen3_5_text")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each call")
    parser.add_argument("--repetitions", type=int, default=None, help="train() calls per mode (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-write"]
    args.models = (args.models or ("llama" if args.quick else "llama,qwen3_5_text")).split(",")
    args.pairs = args.pairs or (100 if args.quick else 1000)
    args.max_length = args.max_length or (128 if args.quick else 512)
    args.steps = args.steps or (1 if args.quick else 2)
    args.repetitions = args.repetitions or (1 if args.quick else 3)
    args.packing_length = args.packing_length or 2 * args.max_length * args.batch_size
    if args.quick and "--no-write" not in (sys.argv[1:] if argv is None else argv):
        args.no_write = True  # a smoke run never replaces the measured section
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    info = machine(("numpy", "torch", "transformers", "trl", "datasets", "padfree"))
    info["threads"] = str(torch.get_num_threads())
    before = load_snapshot()
    train, what = pairs(args.pairs, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        tok = tokenizer(Path(folder))
    results = {kind: run_model(kind, tok, train, args) for kind in args.models}
    after = load_snapshot()
    section = render(args, info, before, after, what, results, time.perf_counter() - t0)
    emit(section, args.no_write, args.output, (START, END), log)


if __name__ == "__main__":
    main()
