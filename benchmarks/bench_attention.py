"""Packed attention on the CPU: padfree's exact backends against transformers' own packed path and against padding;
writes its section of ``BENCHMARKS.md``.

What it measures (issue 4): the forward + backward time and the peak memory of one training step over **one packed
row of 8,192 tokens** holding 4, 32 or 128 sequences, for

- padfree, packed: ``configure_packing(model, backend=b)`` for ``b`` in ``sdpa`` and ``eager`` (per-segment
  attention over buckets of equal padded length, no ``T x T`` mask), fed ``PackedBatch.model_inputs()`` of a
  ``PaddingFreeCollator`` batch (``input_ids``, ``position_ids`` restarting at 0, the flash kwargs,
  ``use_cache=False``). ``flex_attention`` has no backward on the CPU in torch (``NotImplementedError: FlexAttention
  does not support backward on CPU``), so its row is a forward under ``torch.no_grad()`` only (compiled by
  transformers' ``torch.compile(flex_attention)``; the first, compiling call is reported apart);
- transformers' own packed path: the same weights, not configured, ``attn_implementation`` ``sdpa`` or ``eager``,
  fed ``input_ids`` + ``position_ids`` restarting at 0, ``use_cache=False``, no ``attention_mask``. In transformers
  5.x this is exact for one row (its mask builder detects the restarts), but it builds a dense ``T x T``
  block-diagonal mask and runs dense attention over it;
- padded: the same sequences as an ordinary padded batch (``B`` = number of sequences, ``T`` = the longest, 0/1
  ``attention_mask``, right padding), ``sdpa``.

Model: a random-weight ``LlamaForCausalLM`` (vocab 32000, hidden 256, MLP 688, 1 decoder layer, 4 heads, 2 KV
heads), fp32. One layer, not more, to keep the run within minutes: transformers' dense paths take several seconds
per layer and step at 8k tokens on two cores; every figure except transformers' once-per-forward mask building
scales with the number of layers. Lengths: the lognormal(0, 0.75) quantiles at ``(i + 1/2) / k`` scaled to sum to
8,192 (``--sigma``).

The step: ``hidden = model.model(**inputs).last_hidden_state`` (embedding, decoder layers, final norm) and
``(hidden * G).sum().backward()`` with one fixed random upstream gradient ``G`` per real token (zero on padding),
so every contender back-propagates the same signal and its parameter gradients can be compared. The ``lm_head`` and
the cross-entropy are left out of the timed step: they cost the same per token for every packed contender and would
hide the attention (at vocab 32k they are most of a small model's step); their cost at 8,192 positions is measured
once and reported beside the table (a padded batch pays it on ``B x T`` positions).

Protocol: one untimed warm-up step per contender (on the first row; flex_attention compiles there), then per
row ``--runs`` timed steps round robin over the contenders (a contender whose first step on the row took more than
``--slow`` seconds takes two), medians reported. The first timed step of each contender and row runs under
``torch.profiler(profile_memory=True)`` (its overhead, a few thousand op events in a multi-second step, is below the
run-to-run noise): the peak of live tensor bytes above the step's start (torch's CPU allocator has no cache, so
this is what the step allocates) and self CPU time per op category. Every timed step also records the peak RSS
growth (a ``psutil`` sampler thread every 0.5 ms, after ``malloc_trim(0)``).

Exactness: the final hidden states, the logits (``lm_head`` applied to them, in chunks) and all parameter gradients
of every contender are compared with transformers' own packed sdpa path; the max abs differences are printed and
written to the table.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_attention.py            # full run: ~5 min on 2 quiet cores, ~3 GB of RAM at the peak
    python benchmarks/bench_attention.py --quick    # one row (32 sequences), two timed steps, no flex / eager

Only the section between ``<!-- bench_attention:start -->`` and ``<!-- bench_attention:end -->`` of the output file
is replaced (appended after the existing sections the first time).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from _common import conditions, emit, generated, load_snapshot, machine, table

REPO = Path(__file__).resolve().parents[1]
START_MARK = "<!-- bench_attention:start -->"
END_MARK = "<!-- bench_attention:end -->"
TOKENS = 8192
MODEL = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=TOKENS, attention_dropout=0.0)
REFERENCE = "transformers sdpa (position_ids)"
HF_EAGER = "transformers eager (position_ids)"
FLEX = "padfree flex_attention"
PADDED = "padded sdpa"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Memory: peak RSS growth during a step
# ------------------------------------------------------------------------------------------------------------------

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: no trimming, the figures may then undercount reused heap pages
    _LIBC = None


def _trim() -> None:
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.growth``: the peak RSS during the block minus the RSS at its start, and
    ``m.sampler_cpu``: the CPU seconds the sampler thread itself used (to subtract from the process's CPU time)."""

    def __init__(self, interval: float = 0.0005) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.base = self.peak = 0
        self.sampler_cpu = 0.0

    def _sample(self) -> None:
        start = time.thread_time()
        while not self._stop.is_set():
            rss = self._proc.memory_info().rss
            if rss > self.peak:
                self.peak = rss
            time.sleep(self._interval)
        self.sampler_cpu = time.thread_time() - start

    def __enter__(self) -> PeakRSS:
        _trim()
        self.base = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.base


# ------------------------------------------------------------------------------------------------------------------
# Data: one row of TOKENS tokens holding k sequences
# ------------------------------------------------------------------------------------------------------------------


def sequence_lengths(k: int, sigma: float, seed: int) -> np.ndarray:
    """``k`` lengths at the lognormal(0, sigma) quantiles ``(i + 1/2) / k`` (a typical sample, no lucky or unlucky
    draw), scaled to sum to exactly TOKENS (floored, at least 1, the remainder to the largest fractional parts) and
    shuffled with ``seed``."""
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf((i + 0.5) / k) for i in range(k)])
    x = np.exp(sigma * z)
    x = x / x.sum() * TOKENS
    n = np.maximum(1, np.floor(x).astype(np.int64))
    rest = TOKENS - int(n.sum())
    if rest > 0:
        n[np.argsort(-(x - np.floor(x)), kind="stable")[:rest]] += 1
    while n.sum() > TOKENS:  # only when flooring to 1 overshot
        n[np.argmax(n)] -= 1
    return np.random.default_rng(seed).permutation(n)


@dataclass
class Row:
    k: int
    lengths: np.ndarray
    ids: list[list[int]]
    packed: dict[str, Any]  # PackedBatch.model_inputs()
    hf: dict[str, Any]  # input_ids, position_ids, use_cache
    padded: dict[str, Any]  # input_ids, attention_mask, use_cache
    valid: Any  # (B*T,) bool: the real tokens of the padded batch, in packed order
    upstream: Any  # (1, TOKENS, hidden) fixed random gradient
    upstream_padded: Any  # (B, T, hidden), zero on padding
    buckets: int
    bucket_area: float  # sum over buckets of m * L^2, / T^2
    exact_area: float  # sum n_i^2 / T^2
    padded_tokens: int


def make_row(k: int, sigma: float, hidden: int) -> Row:
    import torch

    from padfree.data.batch import PaddingFreeCollator
    from padfree.model.packed import PackedLayout

    lengths = sequence_lengths(k, sigma, seed=k)
    rng = np.random.default_rng(1000 + k)
    ids = [rng.integers(3, MODEL["vocab_size"], n).tolist() for n in lengths]
    batch = PaddingFreeCollator()(ids)
    packed = batch.model_inputs(include_labels=False)
    hf = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
    longest = int(lengths.max())
    pad_ids = torch.zeros(k, longest, dtype=torch.int64)
    mask = torch.zeros(k, longest, dtype=torch.int64)
    for i, seq in enumerate(ids):
        pad_ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    valid = mask.reshape(-1).bool()
    gen = torch.Generator().manual_seed(k)
    upstream = torch.randn(1, TOKENS, hidden, generator=gen) / TOKENS
    upstream_padded = torch.zeros(k * longest, hidden)
    upstream_padded[valid] = upstream[0]
    lay = PackedLayout.from_position_ids(batch.position_ids)
    buckets = lay.buckets()
    area = sum(m * n**2 for m, n in zip(buckets.counts, buckets.lengths, strict=True)) / TOKENS**2
    return Row(
        k=k, lengths=lengths, ids=ids, packed=packed, hf=hf,
        padded={"input_ids": pad_ids, "attention_mask": mask, "use_cache": False}, valid=valid,
        upstream=upstream, upstream_padded=upstream_padded.view(k, longest, hidden), buckets=len(buckets.lengths),
        bucket_area=area, exact_area=float((lengths.astype(np.float64) ** 2).sum() / TOKENS**2),
        padded_tokens=k * longest,
    )


# ------------------------------------------------------------------------------------------------------------------
# Contenders
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    model: Any
    kind: str  # "packed" (padfree), "hf" (transformers' packed path), "padded"
    backward: bool = True
    note: str = ""

    def inputs(self, row: Row) -> dict[str, Any]:
        return {"packed": row.packed, "hf": row.hf, "padded": row.padded}[self.kind]

    def upstream(self, row: Row) -> Any:
        return row.upstream_padded if self.kind == "padded" else row.upstream


@dataclass
class Result:
    forward: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # process CPU seconds of the step (all threads but the sampler)
    memory: list[int] = field(default_factory=list)  # RSS growth of the timed steps
    tensor_peak: float = float("nan")  # torch allocator peak of the profiled step
    breakdown: dict[str, float] = field(default_factory=dict)  # category -> self CPU s of the profiled step
    profiled: float = float("nan")  # wall time of the profiled (first timed) step
    hidden: Any = None  # (TOKENS, hidden) of the last step, packed order
    grads: dict[str, Any] | None = None
    d_hidden: float = float("nan")
    d_logits: float = float("nan")
    d_grads: float = float("nan")

    def med(self, what: str) -> float:
        values = getattr(self, what)
        return statistics.median(values) if values else float("nan")


def build_contenders(flex: bool, eager: bool, skipped: list[str] | None = None) -> list[Contender]:
    import torch
    import transformers

    from padfree import configure_packing
    from padfree.errors import UnsupportedModelError

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**MODEL)
    config._attn_implementation = "sdpa"
    base = transformers.LlamaForCausalLM(config)

    def clone(attn: str) -> Any:
        m = copy.deepcopy(base)
        m.set_attn_implementation(attn)
        m.train()
        return m

    out = []
    for backend in ("sdpa", "eager"):
        m = clone("sdpa")
        configure_packing(m, backend=backend)
        out.append(Contender(f"padfree {backend}", m, "packed"))
    if flex:
        m = clone("sdpa")
        try:
            configure_packing(m, backend="flex_attention")
        except UnsupportedModelError as exc:  # refused on the CPU: no backward there, a kernel wrong for some shapes
            (skipped if skipped is not None else []).append(f"padfree flex_attention ({exc})")
        else:
            out.append(Contender(FLEX, m, "packed", backward=False,
                                 note="forward only, under `torch.no_grad()`: torch has no flex_attention backward "
                                      "on the CPU (`NotImplementedError: FlexAttention does not support backward on "
                                      "CPU`)"))
    out.append(Contender(REFERENCE, clone("sdpa"), "hf"))
    if eager:
        out.append(Contender(HF_EAGER, clone("eager"), "hf"))
    out.append(Contender(PADDED, clone("sdpa"), "padded"))
    return out


def run_step(c: Contender, row: Row, res: Result | None = None, keep: bool = False) -> float:
    """One step; records its times and RSS growth into ``res`` (None: not recorded). Returns its wall time."""
    import torch

    inputs = c.inputs(row)
    for p in c.model.parameters():
        p.grad = None
    with PeakRSS() as mem:
        c0 = time.process_time()
        t0 = time.perf_counter()
        if c.backward:
            hidden = c.model.model(**inputs).last_hidden_state
            t1 = time.perf_counter()
            (hidden * c.upstream(row)).sum().backward()
        else:
            with torch.no_grad():
                hidden = c.model.model(**inputs).last_hidden_state
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        c2 = time.process_time()
    if res is not None:
        res.forward.append(t1 - t0)
        res.step.append(t2 - t0)
        res.cpu.append(c2 - c0 - mem.sampler_cpu)
        res.memory.append(mem.growth)
        if keep:
            h = hidden.detach().reshape(-1, hidden.shape[-1])
            res.hidden = h[row.valid] if c.kind == "padded" else h
            res.grads = ({n: p.grad.detach().clone() for n, p in c.model.named_parameters() if p.grad is not None}
                         if c.backward else None)
    del hidden
    return t2 - t0


CATEGORIES = {
    "linear layers": ("aten::mm", "aten::addmm"),
    "attention kernels": ("aten::_scaled_dot_product", "aten::bmm", "aten::_softmax", "aten::masked_fill",
                          "aten::flex_attention", "## Call CompiledFxGraph", "Torch-Compiled Region"),
    "gather / scatter": ("aten::index", "aten::_index_put_impl_", "aten::index_put", "aten::index_copy",
                         "aten::index_select", "aten::index_add_", "aten::cat", "aten::nonzero"),
    "zero-fill + grad accumulation": ("aten::fill_", "aten::zero_", "aten::add_"),
    "mask building": ("aten::where", "aten::eq", "aten::le", "aten::ge", "aten::lt", "aten::gt",
                      "aten::bitwise_and", "aten::bitwise_or", "aten::bitwise_not", "aten::logical_and"),
}


def _category(name: str) -> str:
    for cat, prefixes in CATEGORIES.items():
        if any(name == p or name.startswith(p) for p in prefixes):
            return cat
    return "other"


def profiled_step(c: Contender, row: Row, res: Result) -> None:
    """The first timed step of a contender on a row, under ``torch.profiler`` with memory profiling: also the torch
    allocator's peak above the step's start, and self CPU time per op category."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        res.profiled = run_step(c, row, res, keep=True)
    try:
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:
            live += e.nbytes()
            peak = max(peak, live)
        res.tensor_peak = peak
    except AttributeError:  # a torch without kineto results: the RSS figure remains
        pass
    totals: dict[str, float] = {}
    for avg in prof.key_averages():
        cat = _category(avg.key)
        totals[cat] = totals.get(cat, 0.0) + avg.self_cpu_time_total / 1e6
    res.breakdown = totals


def check_exact(contenders: list[Contender], results: dict[str, Result]) -> None:
    """Max |difference| of hidden states, logits and parameter gradients against transformers' sdpa packed path."""
    import torch

    ref = results[REFERENCE]
    head = next(c for c in contenders if c.name == REFERENCE).model.lm_head
    d_logits = {name: 0.0 for name in results}
    with torch.no_grad():
        for start in range(0, TOKENS, 1024):
            ref_logits = head(ref.hidden[start:start + 1024])
            for name, res in results.items():
                diff = (head(res.hidden[start:start + 1024]) - ref_logits).abs().max().item()
                d_logits[name] = max(d_logits[name], diff)
    for name, res in results.items():
        res.d_hidden = (res.hidden - ref.hidden).abs().max().item()
        res.d_logits = d_logits[name]
        if res.grads is not None:
            res.d_grads = max((res.grads[n] - g).abs().max().item() for n, g in ref.grads.items())


def lm_head_cost(runs: int) -> float:
    """Median fwd+bwd seconds of lm_head + cross-entropy over TOKENS positions (the part left out of the step)."""
    import torch

    torch.manual_seed(0)
    head = torch.nn.Linear(MODEL["hidden_size"], MODEL["vocab_size"], bias=False)
    x = torch.randn(TOKENS, MODEL["hidden_size"], requires_grad=True)
    y = torch.randint(0, MODEL["vocab_size"], (TOKENS,))
    times = []
    for _ in range(runs):
        head.weight.grad = x.grad = None
        _trim()
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(head(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def warm_up(contenders: list[Contender], row: Row) -> dict[str, float]:
    """One untimed step per contender (flex_attention compiles here); returns the seconds each took."""
    first = {}
    for c in contenders:
        first[c.name] = run_step(c, row)
        log(f"  warm-up {c.name}: {first[c.name]:.2f} s")
    return first


def measure_row(contenders: list[Contender], row: Row, args: argparse.Namespace) -> dict[str, Result]:
    """``--runs`` timed steps per contender, round robin (two for a contender slower than ``--slow`` s a step); the
    first one of each contender profiled. Then the exactness check."""
    res = {c.name: Result() for c in contenders}
    for i in range(args.runs):
        for c in contenders:
            r = res[c.name]
            if i == 0:
                profiled_step(c, row, r)
            elif i < 2 or r.step[0] <= args.slow:
                run_step(c, row, r, keep=True)
    check_exact(contenders, res)
    return res


# ------------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------------


def _layers() -> str:
    n = MODEL["num_hidden_layers"]
    return f"{'one' if n == 1 else n} decoder layer{'' if n == 1 else 's'}"


def _mib(b: float) -> str:
    return "–" if b != b else f"{b / 2**20:,.0f}"


def _ratio(a: float, b: float) -> str:
    return "–" if not (a == a and b == b) else f"{a / b:.2f}×"


def render(args: argparse.Namespace, info: dict[str, str], before: str, after: str, rows: list[Row],
           contenders: list[Contender], results: dict[int, dict[str, Result]], first_calls: dict[str, float],
           lm: float | None, elapsed: float) -> str:
    names = [c.name for c in contenders]
    time_headers = ["sequences", "contender", "positions (B×T)", "fwd s", "fwd+bwd s", "fwd+bwd CPU s", "steps",
                    "vs transformers sdpa", "vs transformers eager", "vs padded"]
    mem_headers = ["sequences", "contender", "tensor peak MiB", "RSS growth MiB", "max abs Δ hidden",
                   "max abs Δ logits", "max abs Δ grads"]
    time_rows, mem_rows, break_rows = [], [], []
    cats = [*CATEGORIES, "other"]

    def vs(r: Result, other: str, res: dict[str, Result]) -> str:
        if other not in res or r is res[other]:
            return "1.00×" if other in res else "–"
        o = res[other]
        return f"{_ratio(r.med('step'), o.med('step'))} ({_ratio(r.med('cpu'), o.med('cpu'))})"

    for row in rows:
        res = results[row.k]
        for name in names:
            r = res[name]
            fwd_only = name == FLEX
            label = name + (" ¹" if fwd_only else "")
            time_rows.append([
                str(row.k), label, f"{row.padded_tokens:,}" if name == PADDED else f"{TOKENS:,}",
                f"{r.med('forward'):.2f}", "–" if fwd_only else f"{r.med('step'):.2f}",
                f"{r.med('cpu'):.2f}" + (" (fwd)" if fwd_only else ""), str(len(r.step)),
                *(["–"] * 3 if fwd_only else [vs(r, REFERENCE, res), vs(r, HF_EAGER, res), vs(r, PADDED, res)]),
            ])
            mem_rows.append([str(row.k), label, _mib(r.tensor_peak), _mib(r.med("memory")), f"{r.d_hidden:.1e}",
                             f"{r.d_logits:.1e}", "–" if fwd_only else f"{r.d_grads:.1e}"])
            total = sum(r.breakdown.values())
            break_rows.append([str(row.k), label, f"{r.profiled:.2f}",
                               *[f"{r.breakdown.get(cat, 0.0):.2f}" for cat in cats], f"{total:.2f}"])
    lay_rows = [[str(r.k), f"{int(r.lengths.min())} / {int(np.median(r.lengths))} / {int(r.lengths.max())}",
                 f"{r.padded_tokens:,} ({r.padded_tokens / TOKENS:.2f}×)", str(r.buckets),
                 f"{r.exact_area:.2%}", f"{r.bucket_area:.2%}"] for r in rows]
    cfg = ", ".join(f"{k} {v}" for k, v in MODEL.items() if k != "attention_dropout")
    lm_text = (f"; measured here: lm_head + cross-entropy forward + backward over {TOKENS:,} positions takes "
               f"{lm:.2f} s, which every packed contender adds alike and a padded batch pays on B×T positions"
               if lm is not None else "")
    lines = [
        START_MARK,
        "## Packed attention on the CPU (`benchmarks/bench_attention.py`)",
        "",
        generated("bench_attention.py", args.argv, info["commit"], elapsed),
        "",
        *conditions(info, before, after, versions=[f"torch threads {info['torch_threads']}"]),
        "- A small shared VM: other processes may run at the same time and absolute times drift by ±20% or more "
        "between runs; the ratios, from steps taken round robin in one process on the same inputs, are the "
        "figures to trust.",
        f"- Model: `LlamaForCausalLM` with random weights ({cfg}; head dim 64), fp32, CPU, `model.train()`, "
        f"attention dropout 0. {_layers().capitalize()}, to keep the run within minutes (transformers' dense paths "
        "take seconds per layer and step at 8k tokens on two cores); every figure except transformers' "
        "once-per-forward mask building scales with the number of layers.",
        f"- Rows: one row of {TOKENS:,} tokens holding k sequences; lengths = the lognormal(0, {args.sigma}) "
        f"quantiles at (i + ½)/k (a typical sample, not a random draw), scaled to sum to {TOKENS:,} and shuffled; "
        "random token ids.",
        "- Step: `h = model.model(**inputs).last_hidden_state; (h * G).sum().backward()` — embedding, "
        f"{_layers()} and final norm, forward + backward, with one fixed random "
        "upstream gradient G per real token (zero on padding) so that every contender does the same backward. "
        "The lm_head and the loss are left out of the step: the same per-token cost for every packed contender, "
        f"and at vocab {MODEL['vocab_size']:,} most of a model this small{lm_text}.",
        "- Contenders: **padfree** = `configure_packing(model, backend=b)`, inputs "
        "`PaddingFreeCollator()(seqs).model_inputs(include_labels=False)` (input_ids, position_ids restarting at 0, "
        "flash kwargs, use_cache=False); **transformers** = the same weights, not configured, "
        "`attn_implementation` sdpa / eager, inputs `input_ids` + restarting `position_ids`, `use_cache=False`, no "
        "attention_mask (exact in transformers 5.x for one row: its mask builder turns the restarts into a dense "
        "block-diagonal T×T mask); **padded** = the same sequences as a right-padded batch (B = k, T = longest, "
        "0/1 attention_mask), sdpa.",
        f"- Timing: one untimed warm-up step per contender (first row), then per row {args.runs} timed steps "
        f"round robin over the contenders (`time.perf_counter`, and `time.process_time` for the CPU time; two "
        f"for a contender whose first step on the row "
        f"took more than {args.slow:.0f} s: column *steps*); medians. The first timed step of each contender and "
        "row runs under `torch.profiler` for the memory and the op breakdown (overhead below the noise here).",
        "- Memory, two figures: *tensor peak* = the peak of live tensor bytes above the step's start, from "
        "`torch.profiler(profile_memory=True)` allocation events of the profiled step (what the step itself "
        "allocates: saved activations, masks, scores, gradients); *RSS growth* = the peak process RSS during a "
        "timed step minus the RSS at its start (background `psutil` sampler every 0.5 ms, after `gc.collect()` + "
        "`malloc_trim(0)`), median over the timed steps — what the OS sees, i.e. the tensor peak plus glibc's "
        "heap fragmentation.",
        "- Exactness: hidden states, logits (lm_head applied to them, in chunks) and all parameter gradients of "
        "every contender are compared with transformers' sdpa packed path (padded: its real tokens only); the "
        "max abs differences are in the table.",
        "",
        "Rows (score area = attention score entries computed, as a share of the dense T×T that transformers' "
        "packed path computes; exact = Σ nᵢ², padfree's buckets = Σ m·L² over buckets of m segments padded to L):",
        "",
        table(["sequences", "length min / median / max", "padded positions B×T", "padfree buckets",
               "exact score area", "bucketed score area"], lay_rows),
        "",
        "Time (medians; ratios = this contender's fwd+bwd wall time / the other's on the same row, below 1 = "
        "faster, with the same ratio of CPU time in parentheses):",
        "",
        table(time_headers, time_rows, "llrrrrrrrr"),
        "",
        "CPU time = the process's CPU seconds during the step (both torch threads, the memory sampler's own time "
        "subtracted). Other processes on this VM stretch wall times by up to 2-3× from one step to the next, "
        "but barely change how much CPU a step needs, so where the two ratios differ the CPU ratio is the "
        "steadier estimate of the work.",
        "",
        "Memory and exactness (max abs differences against transformers' sdpa packed path):",
        "",
        table(mem_headers, mem_rows, "llrrrrr"),
        "",
        "Reading it: transformers' packed path hands SDPA (or eager) one dense block-diagonal T×T mask, and the "
        "padded batch a B×1×T×T padding mask; with an explicit mask the CPU SDPA kernel computes every entry of "
        "the grid, the causal upper half included, so both pay the dense score area whatever k is (the padded "
        "batch pays B×T² and, in its linear layers, B×T positions). padfree's buckets call SDPA with "
        "`is_causal=True` on the bucketed area only, and never build a T×T mask. Once the rows hold a few dozen "
        "sequences, attention is a small part of padfree's step (see the breakdown below): the linear layers, the "
        "elementwise ops and padfree's own gather into and out of the buckets are what remain.",
    ]
    if FLEX in names:
        lines += ["", f"¹ {next(c.note for c in contenders if c.name == FLEX)}; compare its forward with the other "
                  f"rows' fwd column (which is taken with autograd recording). Its warm-up call, `torch.compile` "
                  f"of flex_attention included, took {first_calls[FLEX]:.1f} s."]
    elif not args.flex:
        lines += ["", "flex_attention is not in this run (`--quick` or `--no-flex`); torch has no flex_attention "
                  "backward on the CPU, so it could only be timed forward."]
    if not any(c.name == HF_EAGER for c in contenders) and not args.skipped:
        lines += ["", "transformers' eager path is not in this run (`--quick` or `--no-eager`)."]
    if args.skipped:
        lines += ["", "Skipped: " + "; ".join(args.skipped) + "."]
    lines += [
        "",
        "Where the time goes: self CPU seconds per op category in the profiled step (the first timed step of "
        "the contender on the row; *step s* is its wall time). *gather / scatter* = "
        "`index`, `index_put_` (the backward of an index), `index_copy`, `index_select`, `index_add_` (its "
        "backward), `cat`, `nonzero`; *zero-fill + grad "
        "accumulation* = `fill_`, `zero_`, `add_`; *attention kernels* = SDPA forward/backward, `bmm`, softmax, "
        "`masked_fill`, flex's compiled kernel; *mask building* = the elementwise comparisons that build masks "
        "(transformers' dense T×T mask; flex's `create_block_mask`, which evaluates its mask_mod over the T×T "
        "grid); *other* = the remaining elementwise ops (RMSNorm, RoPE, SiLU, the eager formula's scaling and "
        "copies).",
        "",
        table(["sequences", "contender", "step s", *cats, "sum"], break_rows, "ll" + "r" * (len(cats) + 2)),
        END_MARK,
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: one row (32 sequences), two timed steps, no flex, no transformers eager")
    parser.add_argument("--runs", type=int, default=None, help="timed steps per contender and row (default 3)")
    parser.add_argument("--slow", type=float, default=8.0,
                        help="a contender whose first step on a row takes longer gets two timed steps (default 8 s)")
    parser.add_argument("--counts", type=str, default=None, help="sequences per row, comma-separated (4,32,128)")
    parser.add_argument("--sigma", type=float, default=0.75, help="lognormal sigma of the sequence lengths")
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="leave out flex_attention")
    parser.add_argument("--no-eager", dest="eager", action="store_false",
                        help="leave out transformers' eager path (dense H x T x T scores)")
    parser.add_argument("--max-dense-gib", type=float, default=6.0,
                        help="skip transformers' eager path when its dense scores would need more (default 6)")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md", help="markdown file to update")
    parser.add_argument("--no-write", action="store_true", help="print the section instead of writing it")
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--no-write"]
    if args.runs is None:
        args.runs = 2 if args.quick else 3
    if args.counts is None:
        args.counts = "32" if args.quick else "4,32,128"
    args.counts = [int(x) for x in args.counts.split(",")]
    if args.quick:
        args.flex = args.eager = False
    args.skipped = []
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import psutil
    import torch

    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()
    info = machine(("numpy", "torch", "transformers", "psutil", "padfree"))
    info["torch_threads"] = str(torch.get_num_threads())
    before = load_snapshot()
    # transformers' eager path holds about 3 H x T x T fp32 tensors at its peak (scores, masked scores, probs)
    dense = 3 * MODEL["num_attention_heads"] * TOKENS**2 * 4 / 2**30
    avail = psutil.virtual_memory().available / 2**30
    eager = args.eager and dense <= args.max_dense_gib and dense <= 0.8 * avail
    if args.eager and not eager:
        args.skipped.append(f"transformers eager: its dense scores need about {dense:.1f} GiB (limit "
                            f"{args.max_dense_gib} GiB, {avail:.1f} GiB available)")
    contenders = build_contenders(args.flex, eager, args.skipped)
    rows, results = [], {}
    for i, k in enumerate(args.counts):
        row = make_row(k, args.sigma, MODEL["hidden_size"])
        rows.append(row)
        log(f"{k} sequences: lengths {int(row.lengths.min())}..{int(row.lengths.max())}, {row.buckets} buckets, "
            f"padded {k} x {int(row.lengths.max())}")
        if i == 0:
            first_calls = warm_up(contenders, row)
        res = measure_row(contenders, row, args)
        for c in contenders:
            r = res[c.name]
            log(f"  {c.name:34s} fwd {r.med('forward'):6.2f} s  step {r.med('step'):6.2f} s ({len(r.step)})  "
                f"tensor peak {_mib(r.tensor_peak):>6s} MiB  RSS {_mib(r.med('memory')):>6s} MiB  "
                f"max|Δ| hidden {r.d_hidden:.1e} logits {r.d_logits:.1e} grads {r.d_grads:.1e}  "
                f"steps {' '.join(f'{t:.2f}' for t in r.step)}")
            r.hidden = r.grads = None
        results[k] = res
    lm = None if args.quick else lm_head_cost(1)
    after = load_snapshot()
    section = render(args, info, before, after, rows, contenders, results, first_calls, lm,
                     time.perf_counter() - t_start)
    emit(section, args.no_write, args.output, (START_MARK, END_MARK), log)


if __name__ == "__main__":
    main()
