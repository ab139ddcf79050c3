"""The causal-LM loss with and without logits: time and peak memory of one packed training step.

``model(**inputs).loss`` (transformers' head + cross-entropy over materialised logits) and TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, what ``SFTTrainer`` computes its loss through) against padfree's
``causal_lm_loss`` (the head and the cross-entropy fused, in chunks, over target positions only), on the same
packed row, the same weights. Every configuration runs in a fresh subprocess: build the model and the row, read the
RSS, run one forward + backward, read the peak RSS (``VmHWM``) — the step's memory is the difference — then time
three more steps. Writes its section of ``BENCHMARKS.md``.

    python benchmarks/bench_loss.py [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import allocator, load_snapshot, machine, peak_rss, rss, table, write_section

REPO = Path(__file__).resolve().parents[1]
START, END = "<!-- bench_loss:start -->", "<!-- bench_loss:end -->"
CONFIGS = [(32000, 2048), (32000, 8192), (32000, 16384), (151936, 2048), (151936, 4096)]
QUICK = [(32000, 1024), (151936, 512)]
MODES = ("stock", "trl", "fused")


def child(vocab: int, positions: int, mode: str, threads: int) -> dict:
    import numpy as np
    import torch
    import transformers

    import padfree
    from padfree.model.loss import verified_head_transform

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max(positions, 2048))
    model = transformers.LlamaForCausalLM(config)
    padfree.configure_packing(model)
    rng = np.random.default_rng(0)
    lengths, left = [], positions
    while left > 0:  # real-looking lengths (lognormal, median 300) filling one row exactly
        n = int(min(left, max(2, rng.lognormal(np.log(300), 1.0))))
        lengths.append(n)
        left -= n
    seqs = [rng.integers(3, vocab, n).tolist() for n in lengths]
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences(lengths, positions, strategy="nf"), seqs)
    inputs = batch.model_inputs()

    if mode == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)

    def loss_of_step() -> torch.Tensor:
        if mode == "fused":
            return padfree.causal_lm_loss(model, inputs)
        if mode == "trl":
            return model(**inputs, fused_lm_head=True).loss
        return model(**inputs).loss

    def step() -> None:
        loss_of_step().backward()
        model.zero_grad(set_to_none=True)

    if mode == "fused":  # the one-time check of the model's head (a few tokens) off the memory reading
        verified_head_transform(model)
    before = rss()
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    peak = peak_rss() - before
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with torch.no_grad():  # after the readings: this mode's loss against the stock one, same weights
        loss_diff = abs(float(loss_of_step()) - float(model(**inputs).loss))
    return {"vocab": vocab, "positions": positions, "mode": mode, "sequences": len(lengths), "loss_diff": loss_diff,
            "peak_bytes": peak, "first_s": first, "median_s": statistics.median(times), "times": times}


def run(vocab: int, positions: int, mode: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{vocab},{positions},{mode},{threads}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        vocab, positions, mode, threads = args.child.split(",")
        print(json.dumps(child(int(vocab), int(positions), mode, int(threads))))
        return
    t0 = time.perf_counter()
    info = machine(("torch", "transformers", "trl", "padfree"))
    before = load_snapshot()
    results = []
    for vocab, positions in QUICK if args.quick else CONFIGS:
        pair = {}
        for mode in MODES:  # the modes back to back, so that they share the machine's conditions
            pair[mode] = run(vocab, positions, mode, args.threads)
            r = pair[mode]
            print(f"[{time.strftime('%H:%M:%S')}] V={vocab} T={positions} {mode}: peak {r['peak_bytes'] / 2**20:.0f} "
                  f"MiB, {r['median_s']:.2f} s", file=sys.stderr, flush=True)
        results.append(pair)
    after = load_snapshot()
    rows = []
    for pair in results:
        s, t, f = pair["stock"], pair["trl"], pair["fused"]
        logits = s["positions"] * s["vocab"] * 4
        mib = [f"{r['peak_bytes'] / 2**20:,.0f}" for r in (s, t, f)]
        rows.append([f"{s['vocab']:,}", f"{s['positions']:,}", f"{s['sequences']}", f"{logits / 2**20:,.0f}", *mib,
                     f"{s['peak_bytes'] / max(f['peak_bytes'], 1):.1f}×",
                     f"{t['peak_bytes'] / max(f['peak_bytes'], 1):.1f}×",
                     *(f"{r['median_s']:.2f}" for r in (s, t, f)),
                     f"{s['median_s'] / f['median_s']:.2f}×", f"{t['median_s'] / f['median_s']:.2f}×",
                     f"{max(t['loss_diff'], f['loss_diff']):.0e}"])
    cmd = "python benchmarks/bench_loss.py" + (" --quick" if args.quick else "")
    section = "\n".join([
        START,
        "## The loss without logits (`benchmarks/bench_loss.py`)",
        "",
        f"_Generated by `{cmd}` on {dt.datetime.now():%Y-%m-%d %H:%M} (commit {info['commit']}); the run took "
        f"{(time.perf_counter() - t0) / 60:.1f} min. Regenerating replaces only this section._",
        "",
        f"- CPU: {info['cpu']}, {info['cores']}, {info['memory']} RAM; {info['os']}; {info['versions']}; torch "
        f"threads {args.threads}; {allocator()}",
        f"- Load at start: {before}. At end: {after}. A shared machine: times drift ±20%; the modes of a row ran back "
        "to back.",
        "- Step: one packed row of the given positions (random sequences, lognormal lengths, median 300, labels on "
        "every position but each sequence's first), a Llama-style model (hidden 256, 4 layers, MLP 688) configured "
        "by `configure_packing`, fp32 on the CPU; forward + backward, gradients dropped after each step (no "
        "optimizer). *stock* = `model(**inputs).loss`; *TRL head* = `trl.trainer.utils.add_fused_lm_head(model)`, "
        "then `model(**inputs, fused_lm_head=True).loss` (SFTTrainer's loss: tiles of 32k vocabulary entries, the "
        "logits recomputed in the backward; off Triton devices such as this CPU it scores every position, masked "
        "ones included); *fused* = `padfree.causal_lm_loss(model, inputs)` (chunks of about 128 MiB of logits, "
        "gradients computed in the forward, target positions only). Equal losses and gradients: "
        "`tests/model/test_model_loss.py`; *max |Δloss|* is each contender's loss against the stock one in this run.",
        "- Peak step memory = peak RSS during the first step (`VmHWM`) − RSS before it, in a fresh process per "
        "configuration: the step's activations, logits and gradients. Time = median of 3 further steps.",
        "",
        table(["vocab", "positions", "sequences", "fp32 logits MiB", "stock peak MiB", "TRL head peak MiB",
               "fused peak MiB", "memory stock / fused", "memory TRL / fused", "stock s", "TRL head s", "fused s",
               "time stock / fused", "time TRL / fused", "max abs Δloss"], rows, "r" * 15),
        "",
        "The stock step holds the logits, their log-softmax and both gradients at once (a few times `positions × "
        "vocab` floats); the fused step holds one chunk of them, reused, plus the head's gradient — so its memory "
        "stops growing with the vocabulary times the row length, and the time saved is the memory traffic (and, on "
        "this VM, the page faults of fresh memory) of those tensors. TRL's head, off Triton devices, folds each "
        "tile of logits with torch operations that allocate tile-sized temporaries, scores the masked positions "
        "too, and recomputes the logits in the backward (four vocabulary-sized matrix products per position "
        "where padfree does three, keeping the gradients from the forward): on this CPU it can take more memory "
        "than the stock loss and is the slowest of the three. On CUDA it folds the tiles in a Triton kernel over "
        "target positions only; that comparison has not been run here (no GPU).",
        END,
    ])
    if args.no_write:
        print(section)
    else:
        write_section(REPO / "BENCHMARKS.md", section, START, END)
        print(f"wrote the {START} section of BENCHMARKS.md", file=sys.stderr)


if __name__ == "__main__":
    main()
