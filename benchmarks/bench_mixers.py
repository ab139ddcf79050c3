"""Boundary-exact GatedDeltaNet on the CPU: padfree's exact reference against the leaky single call and against
padding; writes its section of ``BENCHMARKS.md``.

What it measures (issue 5): the forward + backward time of the token-mixing core of one GatedDeltaNet layer over
**one packed row** of ``T`` = 2,048 or 8,192 tokens holding 7 or 64 sequences (and 256 at 2,048: the
many-tiny-sequences case where the other exact formulation wins):

- the causal depthwise conv (4 taps, SiLU) over the concatenated q/k/v channels, then the chunked gated delta rule
  (chunks of 64, q/k L2-normalised in the kernel, grouped value heads) — what ``Qwen3_5GatedDeltaNet`` /
  ``Qwen3NextGatedDeltaNet`` run between their projections on a machine without flash-linear-attention;
- *leaky single call (transformers)*: transformers' own ``causal_conv1d_fn`` fallback and
  ``torch_chunk_gated_delta_rule`` over the whole row, as one sequence — what an unconfigured model computes for a
  packed row (wrong: the state and the conv taps run across every boundary; the table reports by how much);
- *leaky single call (padfree's code)*: padfree's chunked delta rule over the whole row with no boundaries — the
  same arithmetic as the exact paths minus the boundary handling, so that the ratio to it is the cost of exactness
  alone (transformers' function is slower on the CPU: its chunk loop writes into a slice of one output tensor, which
  autograd turns into a full-size copy per chunk in the backward, and its decays can reach denormal floats);
- *exact, per-segment*: ``padfree.model.families.scan_mixers`` with every segment its own row (segments of the same
  padded length batched: whole 64-token chunks, or one chunk rounded up to 16 tokens for a segment no longer than 64);
- *exact, decay-reset*: one call over the row with per-segment masks inside the chunks (the decay between two tokens
  of different segments is exactly 0, the carried state is read and written only by its own segment);
- *exact, auto*: the formulation ``configure_packing`` picks per batch (per-segment unless padding every segment to
  whole chunks adds more than half the row's tokens);
- *padded*: the same sequences as a padded batch (``B`` = number of sequences, ``T`` = the longest, right padding)
  through transformers' functions — exact for the real tokens, paying for every padding position.

Sizes: a tiny ``qwen3_5_text`` / ``qwen3_next`` layer — 2 key heads and 4 value heads of dimension 64 (grouped value
heads), conv kernel 4, chunk 64, fp32; projections, gates and norms are left out: they are per-token and the same
for every packed contender. Lengths: the lognormal(0, 0.75) quantiles at ``(i + 1/2) / k``, scaled to sum to ``T``
and shuffled (the sampling of ``benchmarks/bench_attention.py``).

Protocol: one thread (``torch.set_num_threads(1)``: the machine this ran on is shared, and one thread keeps the
medians comparable), one untimed warm-up step per contender and row, then ``--runs`` (T = 8k; three times as many
at T = 2k) timed fwd+bwd steps per contender round robin; medians of the process CPU time (the ratios) and of the
wall time reported; the upstream gradient is one fixed random tensor per row. Exactness: every
exact contender's output and input gradients are compared with the padded batch (transformers' code on every
sequence alone); the leaky call's distance to it is reported too.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_mixers.py            # full run: ~4 min on one shared core
    python benchmarks/bench_mixers.py --quick    # T = 2k only, 3 timed steps

Only the section between ``<!-- bench_mixers:start -->`` and ``<!-- bench_mixers:end -->`` of the output file is
replaced (appended after the existing sections the first time).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from _common import load_snapshot, machine, table, write_section

REPO = Path(__file__).resolve().parents[1]
START_MARK = "<!-- bench_mixers:start -->"
END_MARK = "<!-- bench_mixers:end -->"
HK, HV, DK, DV, KERNEL, CHUNK = 2, 4, 64, 64, 4, 64
CHANNELS = 2 * HK * DK + HV * DV
LEAKY = "leaky single call (transformers)"
LEAKY_SAME = "leaky single call (padfree's code)"
PER_SEGMENT = "exact, per-segment"
MASKED = "exact, decay-reset"
AUTO = "exact, auto"
PADDED = "padded (transformers)"
CONTENDERS = (LEAKY, LEAKY_SAME, PER_SEGMENT, MASKED, AUTO, PADDED)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sequence_lengths(tokens: int, k: int, sigma: float, seed: int) -> np.ndarray:
    """``k`` lengths at the lognormal(0, sigma) quantiles ``(i + 1/2) / k``, scaled to sum to ``tokens`` (floored,
    at least 1, the remainder to the largest fractional parts) and shuffled with ``seed``."""
    from statistics import NormalDist

    z = np.array([NormalDist().inv_cdf((i + 0.5) / k) for i in range(k)])
    x = np.exp(sigma * z)
    x = x / x.sum() * tokens
    n = np.maximum(1, np.floor(x).astype(np.int64))
    rest = tokens - int(n.sum())
    if rest > 0:
        n[np.argsort(-(x - np.floor(x)), kind="stable")[:rest]] += 1
    while n.sum() > tokens:
        n[np.argmax(n)] -= 1
    return np.random.default_rng(seed).permutation(n)


@dataclass
class Row:
    tokens: int
    k: int
    lengths: np.ndarray
    layout: Any  # PackedLayout of the (1, T) row
    inputs: dict[str, Any]  # x (1, C, T), g (1, T, HV), beta (1, T, HV), conv weight (C, K)
    upstream: Any  # (1, T, HV, DV)
    padded_tokens: int
    chunk_padding: float  # tokens of the per-segment formulation (segments padded), / T


def make_row(tokens: int, k: int, sigma: float) -> Row:
    import torch

    from padfree.model import scans
    from padfree.model.packed import PackedLayout

    lengths = sequence_lengths(tokens, k, sigma, seed=k)
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).view(1, -1)
    gen = torch.Generator().manual_seed(tokens + k)
    inputs = {
        "x": torch.randn(1, CHANNELS, tokens, generator=gen),
        "g": -torch.rand(1, tokens, HV, generator=gen) * 2,  # log-decays of the usual -softplus(...) * exp(A) range
        "beta": torch.rand(1, tokens, HV, generator=gen),
        "weight": torch.randn(CHANNELS, KERNEL, generator=gen) / KERNEL,
    }
    padded_chunks = int(scans._gdr_padded(lengths, CHUNK).sum())
    return Row(tokens, k, lengths, PackedLayout.from_position_ids(pos), inputs,
               torch.randn(1, tokens, HV, DV, generator=gen) / tokens, int(k * lengths.max()),
               padded_chunks / tokens)


def _split(mixed: Any) -> tuple[Any, Any, Any]:
    """``(B, C, L)`` conv output -> q, k ``(B, L, HK, DK)`` and v ``(B, L, HV, DV)``, as the layer splits it."""
    mixed = mixed.transpose(1, 2)
    q, k, v = mixed.split([HK * DK, HK * DK, HV * DV], dim=-1)
    b, n = mixed.shape[:2]
    return q.reshape(b, n, HK, DK), k.reshape(b, n, HK, DK), v.reshape(b, n, HV, DV)


def contender(name: str, row: Row) -> Callable[[dict[str, Any]], Any]:
    """``fn(inputs) -> (1, T, HV, DV)`` output in packed order for contender ``name``."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, torch_chunk_gated_delta_rule

    from padfree.model import scans

    lay = row.layout
    if name == LEAKY:
        def leaky(t):
            q, k, v = _split(causal_conv1d_fn(t["x"], t["weight"], None, activation="silu"))
            return torch_chunk_gated_delta_rule(q, k, v, g=t["g"], beta=t["beta"], chunk_size=CHUNK,
                                                use_qk_l2norm_in_kernel=True)[0]
        return leaky
    if name == LEAKY_SAME:
        def same_code_leaky(t):  # segment_gated_delta_rule's steps, then its chunked rule with no boundaries at all
            q, k, v = _split(causal_conv1d_fn(t["x"], t["weight"], None, activation="silu"))
            q, k = (x.repeat_interleave(HV // HK, dim=2) for x in (q, k))
            q, k, v, b, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                             for x in (q, k, v, t["beta"], t["g"]))
            q, k = scans._l2norm(q), scans._l2norm(k)
            out = scans._gdr_chunked(q * DK ** -0.5, k, v, b, g, None, CHUNK)
            return out.transpose(1, 2).contiguous()
        return same_code_leaky
    if name == PADDED:
        lengths = row.lengths
        longest = int(lengths.max())
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        col = np.arange(longest)
        valid_np = col < lengths[:, None]
        gather = torch.from_numpy(np.where(valid_np, starts[:, None] + col, 0))
        valid = torch.from_numpy(valid_np)
        dest = torch.from_numpy((starts[:, None] + col)[valid_np])

        def padded(t):
            x = t["x"][0][:, gather].permute(1, 0, 2) * valid[:, None, :]  # (k, C, longest), zero padding
            g = t["g"][0][gather] * valid[..., None]
            beta = t["beta"][0][gather] * valid[..., None]
            q, k, v = _split(causal_conv1d_fn(x, t["weight"], None, activation="silu"))
            out = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=CHUNK,
                                               use_qk_l2norm_in_kernel=True)[0]
            return out[valid].new_zeros(row.tokens, HV, DV).index_copy(0, dest, out[valid]).unsqueeze(0)
        return padded
    formulation = {PER_SEGMENT: "per-segment", MASKED: "masked", AUTO: "auto"}[name]

    def exact(t):
        q, k, v = _split(scans.segment_causal_conv1d(t["x"], t["weight"], None, "silu", lay))
        return scans.segment_gated_delta_rule(q, k, v, t["g"], t["beta"], lay, chunk_size=CHUNK,
                                               use_qk_l2norm_in_kernel=True, formulation=formulation)
    return exact


@dataclass
class Result:
    times: list[float] = field(default_factory=list)  # wall seconds
    cpu: list[float] = field(default_factory=list)  # process CPU seconds (one thread: this step's own compute)
    out: Any = None
    grads: dict[str, Any] | None = None
    d_out: float = float("nan")
    d_grad: float = float("nan")

    @property
    def median(self) -> float:
        """Median CPU seconds: on a shared machine the wall clock also counts the other jobs' time slices."""
        return statistics.median(self.cpu) if self.cpu else float("nan")

    @property
    def wall(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def step(fn: Callable, row: Row, res: Result | None, keep: bool = False) -> None:
    inputs = {name: t.detach().clone().requires_grad_() for name, t in row.inputs.items()}
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(inputs)
    (out * row.upstream).sum().backward()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    if res is not None:
        res.times.append(elapsed)
        res.cpu.append(cpu)
        if keep:
            res.out = out.detach()
            res.grads = {name: t.grad for name, t in inputs.items()}


def run_row(row: Row, runs: int) -> dict[str, Result]:
    fns = {name: contender(name, row) for name in CONTENDERS}
    results = {name: Result() for name in CONTENDERS}
    for name, fn in fns.items():
        step(fn, row, None)  # warm-up: layout caches (built once per batch in a model), allocator
        step(fn, row, results[name], keep=True)
    for _ in range(runs - 1):
        for name, fn in fns.items():
            step(fn, row, results[name])
    ref = results[PADDED]
    for res in results.values():
        res.d_out = float((res.out - ref.out).abs().max())
        res.d_grad = max(float((res.grads[n] - g).abs().max()) for n, g in ref.grads.items())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed steps per contender and row")
    parser.add_argument("--sigma", type=float, default=0.75, help="lognormal sigma of the sequence lengths")
    parser.add_argument("--quick", action="store_true", help="T = 2k only, 3 timed steps")
    parser.add_argument("--output", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()

    import torch

    from padfree.model import scans

    torch.set_num_threads(1)
    shapes = [(2048, 7), (2048, 64)] + ([] if args.quick else [(8192, 7), (8192, 64), (2048, 256)])
    runs = 3 if args.quick else args.runs
    short_runs = 3 if args.quick else 3 * args.runs  # 2k rows are cheap: more steps, steadier medians
    info = machine(["torch", "transformers", "numpy"])
    before = load_snapshot()
    started = time.perf_counter()
    rows_out, exact_rows = [], []
    ratios: dict[str, list[float]] = {PER_SEGMENT: [], MASKED: [], AUTO: []}
    same: dict[str, list[float]] = {PER_SEGMENT: [], MASKED: [], AUTO: []}
    for tokens, k in shapes:
        row = make_row(tokens, k, args.sigma)
        log(f"T={tokens} k={k}: lengths {sorted(row.lengths.tolist())[:3]}..{int(row.lengths.max())}")
        results = run_row(row, short_runs if tokens <= 2048 else runs)
        leaky, leaky_same = results[LEAKY].median, results[LEAKY_SAME].median
        chosen = {"per-segment": "per-segment", "masked": "decay-reset"}[
            scans.gdr_formulation(row.layout, CHUNK)]
        for name in (PER_SEGMENT, MASKED, AUTO):
            ratios[name].append(results[name].median / leaky)
            same[name].append(results[name].median / leaky_same)
        for name in CONTENDERS:
            res = results[name]
            note = f"picks {chosen}" if name == AUTO else ""
            rows_out.append([f"{tokens:,}", str(k), name, f"{res.median * 1e3:.0f}", f"{res.wall * 1e3:.0f}",
                             f"{res.median / leaky:.2f}x",
                             f"{res.median / leaky_same:.2f}x", f"{results[PADDED].median / res.median:.2f}x", note])
            log(f"  {name:<34} {res.median * 1e3:8.1f} ms CPU {res.wall * 1e3:8.1f} ms wall "
                f"{res.median / leaky:5.2f}x leaky  "
                f"d_out {res.d_out:.1e}  d_grad {res.d_grad:.1e}")
        diffs = [f"{results[n].d_out:.1e} / {results[n].d_grad:.1e}" for n in (PER_SEGMENT, MASKED, LEAKY)]
        exact_rows.append([f"{tokens:,}", str(k), f"{row.chunk_padding:.2f}", f"{row.padded_tokens / tokens:.2f}",
                           *diffs])
    after = load_snapshot()
    total = time.perf_counter() - started

    labels = [f"{t // 1024}k/{k}" for t, k in shapes]
    target = [r for (t, k), r in zip(shapes, ratios[AUTO], strict=True) if k in (7, 64)]

    def listed(values: list[float]) -> str:
        return ", ".join(f"{label} {v:.2f}x" for label, v in zip(labels, values, strict=True))
    section = "\n".join([
        START_MARK,
        "## Boundary-exact GatedDeltaNet on the CPU (`benchmarks/bench_mixers.py`)",
        "",
        f"Generated {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} in {total:.0f} s. Machine: {info['cpu']}, "
        f"{info['cores']}, {info['memory']}; {info['os']}; {info['versions']}; commit {info['commit']}. "
        f"**Shared machine**: other jobs ran beside this one (before: {before}; after: {after}); one torch thread, "
        f"medians of {short_runs} (T = 2k) or {runs} (T = 8k) fwd+bwd steps per contender, round robin. Ratios are "
        f"of median CPU time (the process's own compute; on a shared machine the wall clock also counts other jobs' "
        f"time slices, which moved wall medians by up to 1.5x between runs); wall medians are shown beside them.",
        "",
        f"Fwd+bwd of the token-mixing core of one GatedDeltaNet layer (causal conv over q/k/v, then the chunked gated "
        f"delta rule; {HK} key heads and {HV} value heads of dimension {DK}, chunk {CHUNK}, fp32) over one packed row. "
        f"*Leaky (transformers)*: transformers' functions over the whole row as one sequence (what an unconfigured "
        f"model runs; wrong across boundaries). *Leaky (padfree's code)*: the exact paths' arithmetic with no "
        f"boundaries (the ratio to it is the cost of exactness alone). *Padded*: the sequences as a padded batch "
        f"through transformers' functions. *vs leaky*: CPU time / the transformers leaky call's (target: exact "
        f"≤ 1.2x); *vs same code*: CPU time / padfree's leaky call's; *vs padded*: the padded batch's CPU time / this "
        f"one.",
        "",
        table(["T", "sequences", "contender", "CPU ms", "wall ms", "vs leaky", "vs same code", "speed-up vs padded",
               "note"], rows_out, "rrlrrrrrl"),
        "",
        f"**Exact path (auto) against the 1.2x target** (T = 2k and 8k, 7 and 64 sequences): worst "
        f"{max(target):.2f}x the transformers leaky call. All rows (T/sequences), auto: {listed(ratios[AUTO])}; "
        f"per-segment alone: {listed(ratios[PER_SEGMENT])}; decay-reset alone: {listed(ratios[MASKED])}. "
        f"The cost of exactness alone (exact / padfree's own leaky call), auto: {listed(same[AUTO])}; per-segment: "
        f"{listed(same[PER_SEGMENT])}; decay-reset: {listed(same[MASKED])}. Long rows run *faster* exact than leaky: "
        f"the chunk recurrence is serial, and per segment it runs as many steps as the longest segment has chunks, "
        f"all segments batched, instead of T / 64 steps.",
        "",
        "Why two formulations: per-segment pads every segment (to whole 64-token chunks, or a short one to one chunk "
        "of a multiple of 16 tokens): cheap for a few long or a few dozen short sequences, up to 16x the work for "
        "very many tiny ones; decay-reset runs the row's chunks once but adds the segment masks to every chunk; "
        "*auto* takes per-segment while that padding stays below 1.5x the row's tokens. "
        "Max |difference| against the padded batch (transformers on every sequence alone), output / input gradients "
        "(x, g, beta, conv weight):",
        "",
        table(["T", "sequences", "per-segment padding", "padded batch tokens", "per-segment", "decay-reset",
               "leaky (the leak)"], exact_rows, "rrrrrrr"),
        END_MARK,
    ])
    write_section(args.output, section, START_MARK, END_MARK, after_mark="<!-- bench_attention:end -->")
    log(f"wrote {args.output} in {total:.0f} s")


if __name__ == "__main__":
    main()
