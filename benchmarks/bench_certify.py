"""The cost of on-the-spot certification: what ``configure_packing`` pays for a model the support table does not cover;
writes its section of ``BENCHMARKS.md``.

For each config below — the default (7B-class) config of a dense, an MoE, an MLA, a hybrid GatedDeltaNet and a
Mamba-2 model — a subclass of the model's class (so the support table cannot cover it) is built on the meta device
(no weights: the user's model is never run), and ``padfree.proof.certify.certify`` is timed three ways:

- *cold*: a fresh process state and an empty disk cache — shrink the config, build the tiny fp32 twin, run the proof
  (every sequence alone, forward and backward; the packed forward and backward; the leaking control; the unpacked
  check) and the guards, write the verdict;
- *disk*: the in-process cache cleared — read the verdict from the disk cache (a new training run of the same class);
- *memory*: the same process again.

Anchor: the same proof on the same tiny twin is what the support sweep runs per model type (its ``seconds`` in
``support.json``), so the cold figure is also the per-type cost of the sweep's fp32 step. Target (coverage issue):
at most 2 s cold on this CPU for a shrunk 7B-class config. One thread (``torch.set_num_threads(1)``), median of
``--runs`` cold runs per config, each in a fresh cache directory.

Run it (from the repository root, in the project's virtual environment)::

    python benchmarks/bench_certify.py             # ~1 min
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from _common import REPO, load_snapshot, machine, table, write_section

CONFIGS = {
    "llama (7B defaults)": ("LlamaForCausalLM", transformers.LlamaConfig),
    "mixtral (MoE, 8x7B defaults)": ("MixtralForCausalLM", transformers.MixtralConfig),
    "deepseek_v3 (MLA + MoE defaults)": ("DeepseekV3ForCausalLM", transformers.DeepseekV3Config),
    "qwen3_next (GatedDeltaNet hybrid defaults)": ("Qwen3NextForCausalLM", transformers.Qwen3NextConfig),
    "mamba2 (Mamba-2 defaults)": ("Mamba2ForCausalLM", transformers.Mamba2Config),
}


def _model(class_name: str, config_cls: type) -> torch.nn.Module:
    base = getattr(transformers, class_name)
    cls = type(f"Uncovered{class_name}", (base,), {})  # a user's subclass: never in the support table
    with torch.device("meta"):
        model = cls(config_cls())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()

    from padfree.proof import certify

    rows = []
    for label, (class_name, config_cls) in CONFIGS.items():
        model = _model(class_name, config_cls)
        backend = "none" if class_name.startswith("Mamba") else "padfree_sdpa"
        cold, disk, memory, verdict = [], [], [], None
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as folder:
                os.environ["PADFREE_CACHE_DIR"] = folder
                certify._MEMORY.clear()
                start = time.perf_counter()
                verdict = certify.certify(model, backend)
                cold.append(time.perf_counter() - start)
                certify._MEMORY.clear()
                start = time.perf_counter()
                certify.certify(model, backend)
                disk.append(time.perf_counter() - start)
                start = time.perf_counter()
                certify.certify(model, backend)
                memory.append(time.perf_counter() - start)
        params = sum(p.numel() for p in model.parameters())
        rows.append([label, f"{params / 1e9:.1f}B", "exact" if verdict.ok else "refused",
                     f"{statistics.median(cold):.2f} s", f"{statistics.median(disk) * 1e3:.1f} ms",
                     f"{statistics.median(memory) * 1e6:.0f} µs"])
        print(rows[-1], flush=True)
    info = machine(["torch", "transformers"])
    section = "\n".join([
        "<!-- bench_certify:start -->",
        "## On-the-spot certification (`benchmarks/bench_certify.py`)",
        "",
        f"Run {dt.date.today().isoformat()} on {info['cpu']} ({info['cores']}, {info['memory']}), {info['os']}; "
        f"{info['versions']}; commit {info['commit']}; {load_snapshot()}. One thread; median of {args.runs} cold "
        f"runs per config, each with an empty cache directory.",
        "",
        "What `configure_packing` pays for a model the support table does not cover (a subclass of the class, so "
        "the table cannot vouch for it): *cold* shrinks the config, builds the tiny fp32 twin, proves packed against "
        "per-sequence (logits, loss, every gradient, the leaking control, the unpacked check), checks the guards "
        "and writes the verdict; *disk* reads that verdict back (a new run of the same class); *memory* is the same "
        "process again. The user's model itself (built here on the meta device, no weights) is never run.",
        "",
        table(["config (class defaults)", "user's model", "verdict", "cold", "disk cache", "memory cache"], rows,
              "lrlrrr"),
        "",
        "Target of the coverage issue: at most 2 s cold for a shrunk 7B-class config.",
        "<!-- bench_certify:end -->",
    ])
    write_section(args.out, section, "<!-- bench_certify:start -->", "<!-- bench_certify:end -->")


if __name__ == "__main__":
    main()
