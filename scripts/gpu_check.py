"""What no CPU run can show, on one CUDA GPU in about 8 minutes, as one dated section of BENCHMARKS.md.

Three steps, each in its own process with its own time budget, so that a step that fails, hangs or takes the CUDA
context down records its error (and whatever it measured before) in the section while the others still run:

1. ``matrix`` — packed against each sequence alone (logits, loss, every gradient, with the leaking control) by
   :func:`padfree.proof.compare.prove`, for tiny random-weight models of :data:`MODELS` on every backend of
   :data:`BACKENDS` that ``configure_packing`` accepts there, in every precision of :data:`PRECISIONS`; the hybrids
   once with the mixers' CUDA kernels (flash-linear-attention, causal-conv1d, mamba_ssm) as installed, and once more
   with them hidden from the process (``sys.modules[name] = None``: transformers and padfree both see them as not
   installed and run their PyTorch paths) when any of them is installed.
2. ``verify`` — :func:`padfree.verify` on a ~0.5B Llama config (``bench_training.GPU_SIZES``) in fp32, bf16 autocast
   and bf16 weights, each beside the rounding that precision alone causes and a leaking control (the same row with
   positions that never restart); then ``padfree verify --model DIR --device cuda`` on that model saved.
3. ``bench`` — ``benchmarks/bench_training.py --device cuda --fused packed`` (its defaults otherwise; the hybrid on a
   smaller sample, :data:`HYBRID_BENCH`), one model per process, its section captured.

Without a CUDA GPU (or with ``--dry-run``) every step runs its setup on the CPU at the smallest sizes and the section
goes to a temporary copy of BENCHMARKS.md, never to the file itself. Run it through ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata as md
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import table, write_section  # noqa: E402

MARKS = ("<!-- gpu_check:start -->", "<!-- gpu_check:end -->")
STEPS = ("matrix", "verify", "bench")
#: seconds per step on the GPU (together 8 minutes), and the cap of a dry run's steps
BUDGETS = {"matrix": 130, "verify": 80, "bench": 270}
DRY_BUDGETS = {"matrix": 120, "verify": 90, "bench": 150}
MODELS = ("llama", "gemma3_text", "qwen3_5_text", "mamba2", "nemotron_h")
#: the models with sequence mixers that the optional CUDA kernels run
HYBRIDS = ("qwen3_5_text", "mamba2", "nemotron_h")
#: in the order they run: a step whose budget ends early has the backends users run most
BACKENDS = ("varlen", "sdpa", "flash_attention_2", "flex_attention", "eager")
PRECISIONS = ("fp32", "autocast_bf16", "autocast_fp16", "bf16")
#: module -> distribution of the mixers' optional kernels (padfree.model.cuda_kernels)
KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}
VERIFY_LENGTHS = (2, 9, 33, 150, 333, 700)
#: the hybrid's benchmark in the time the Llama's leaves: a quarter of the default sample, one pass (its
#: GatedDeltaNets run PyTorch code in the stock modes unless flash-linear-attention is installed)
HYBRID_BENCH = ("--tokens", "65536", "--repetitions", "1")
DRY = {
    "matrix": [{"variant": "", "block": False, "models": ["llama"],
                "backends": ["varlen", "sdpa", "flash_attention_2", "flex_attention"], "precisions": ["fp32"]},
               {"variant": "kernels hidden", "block": True, "models": ["mamba2"], "backends": ["sdpa"],
                "precisions": ["fp32"]}],
    "verify_sizes": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2),
    "verify_lengths": (2, 9, 33, 70),
    "bench": ["--device", "cpu", "--quick", "--no-profile", "--threads", "1", "--tokens", "128", "--capacity", "64",
              "--rows", "2", "--repetitions", "1", "--modes", "padded,packed", "--fused", "packed"],
}
VERSIONS = ("torch", "transformers", "trl", "numpy", "numba", "triton", "flash-attn", "flash-linear-attention",
            "causal-conv1d", "mamba-ssm", "padfree")


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _dump(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically: a worker killed mid-write leaves its last complete result."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
    os.replace(tmp, path)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _quiet() -> None:
    import warnings

    import transformers

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()  # tiny configs and missing kernels trip harmless warnings


# ---- the workers: one step in its own process -------------------------------------------------------------------


def worker_matrix(spec: dict[str, Any], result: Path) -> None:
    """Prove each model on each backend in each precision (backend after backend, so a spent budget cuts the least
    used backends); the result file is rewritten after every proof."""
    if spec["block"]:
        for name in KERNELS:  # before anything imports them: find_spec answers None, an import raises ImportError
            sys.modules[name] = None  # type: ignore[assignment]
    start = time.perf_counter()
    import torch

    _quiet()
    from padfree.model import cuda_kernels
    from padfree.proof.compare import prove
    from padfree.proof.tiny import build_tiny

    out: dict[str, Any] = {"variant": spec["variant"], "block": spec["block"], "rows": [], "refused": [],
                           "unrunnable": [], "errors": [], "skipped": [], "notes": [], "mixers": {}, "kernels": {}}
    device = torch.device(spec["device"])
    models = {}
    for model_type in spec["models"]:
        try:
            models[model_type] = build_tiny(model_type).to(device)
        except Exception as exc:
            out["errors"].append({"model": model_type, "backend": "-", "error": f"build: {_line(exc)}"})
    _dump(result, out)
    no_attention: set[str] = set()
    for backend in spec["backends"]:
        for model_type, model in models.items():
            if model_type in no_attention:
                continue
            if time.perf_counter() - start > spec["budget"]:
                out["skipped"].append(f"{model_type} on {backend}")
                continue
            t0 = time.perf_counter()
            try:
                proof = prove(model, backends=[backend], precisions=spec["precisions"])
            except Exception as exc:  # a CUDA error, a kernel that raises: recorded, the next proof still runs
                out["errors"].append({"model": model_type, "backend": backend, "error": _line(exc)})
                _dump(result, out)
                continue
            seconds = time.perf_counter() - t0
            for c in proof.checks:
                out["rows"].append({
                    "model": model_type, "requested": backend, "backend": c.backend, "precision": c.precision,
                    "logits": c.logits, "loss": c.loss, "grads": c.grads, "tolerance": c.tolerance,
                    "grads_tolerance": c.grads_tolerance, "loss_tolerance": c.loss_tolerance, "leak": c.leak,
                    "ok": c.ok, "sees_leaks": c.sees_leaks, "worst": c.worst, "seconds": seconds})
            out["refused"] += [{"model": model_type, "backend": b, "why": why} for b, why in proof.refused.items()]
            out["unrunnable"] += [{"model": model_type, "what": k, "why": why} for k, why in proof.unrunnable.items()]
            if proof.checks and not proof.unpacked_unchanged:
                out["errors"].append({"model": model_type, "backend": backend,
                                      "error": "an ordinary padded batch CHANGED by configuring"})
            if proof.mixers:
                out["mixers"][model_type] = sorted(set(proof.mixers.values()))
            if proof.checks and all(c.backend == "none" for c in proof.checks):
                no_attention.add(model_type)
                out["notes"].append(f"{model_type} has no attention layer: its mixers are proven once (backend "
                                    f"`none`), whatever backend is asked for")
            _dump(result, out)
    for name in KERNELS:
        usable, why = cuda_kernels.kernel_status(name)
        out["kernels"][KERNELS[name]] = {"usable": usable, "why": why, "broken": cuda_kernels.broken_reason(name)}
    out["seconds"] = time.perf_counter() - start
    _dump(result, out)


def worker_verify(spec: dict[str, Any], result: Path) -> None:
    """``padfree.verify`` on a ~0.5B Llama config in three precisions, each calibrated by its own rounding and a
    leaking control; then the ``padfree verify`` command on the same model saved as a checkpoint."""
    start = time.perf_counter()
    import copy

    import torch
    import transformers

    _quiet()
    from padfree import configure_packing, verify
    from padfree.proof.compare import FP32_TOL, ROUNDING_FACTOR

    device = torch.device(spec["device"])
    out: dict[str, Any] = {"runs": [], "errors": []}
    lengths = spec["lengths"]
    config = transformers.LlamaConfig(**spec["sizes"], max_position_embeddings=max(4096, sum(lengths)),
                                      attention_dropout=0.0)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device).eval()
    out["model"] = (f"`{type(base).__name__}`, {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters "
                    f"(hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} "
                    f"heads, {config.num_key_value_heads} KV heads, MLP {config.intermediate_size}, vocab "
                    f"{config.vocab_size}), random weights, on {device.type}")
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(3, config.vocab_size, (n,), generator=g) for n in lengths]
    out["data"] = f"{len(data)} random-token sequences of {', '.join(map(str, lengths))} tokens, packed in one row"
    _dump(result, out)

    def alone(model: Any) -> list[Any]:
        with torch.no_grad():
            return [model(input_ids=x[None].to(device), use_cache=False).logits[0].float() for x in data]

    def control(model: Any, ref: list[Any]) -> float:
        """The largest ``|packed - alone|`` of the same sequences in one row whose positions never restart."""
        row = torch.cat(data)[None].to(device)
        with torch.no_grad():
            logits = model(input_ids=row, position_ids=torch.arange(row.shape[1], device=device)[None],
                           use_cache=False).logits[0].float()
        worst, col = 0.0, 0
        for r in ref:
            worst = max(worst, float((logits[col:col + r.shape[0]] - r).abs().max()))
            col += r.shape[0]
        return worst

    reference = alone(base)  # fp32, unconfigured: what transformers computes for each sequence
    fp32 = copy.deepcopy(base)
    configure_packing(fp32)
    runs = [("fp32 weights", fp32, False), ("fp32 weights, bf16 autocast", fp32, True), ("bf16 weights", None, False)]
    for name, model, autocast in runs:
        t0 = time.perf_counter()
        try:
            if model is None:
                model = copy.deepcopy(base).to(torch.bfloat16)
                configure_packing(model)
            ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
            with ctx:
                report = verify(model, [x.tolist() for x in data])
                t_verify = time.perf_counter() - t0
                mine = alone(model)
                leak = control(model, mine)
            rounding = max(float((a - r).abs().max()) for a, r in zip(mine, reference, strict=True))
            tol = max(ROUNDING_FACTOR * rounding, FP32_TOL)
            out["runs"].append({
                "run": name, "backend": report.backend, "sequences": report.num_sequences,
                "max_logit_diff": report.max_logit_diff, "loss_diff": report.loss_diff,
                "max_grad_diff": report.max_grad_diff, "worst": report.worst_parameter, "atol": report.atol,
                "verify_ok": report.ok, "rounding": rounding, "tolerance": tol, "leak": leak,
                "within": report.max_logit_diff <= tol, "sees_leaks": leak > tol,
                "grads_checked": report.max_grad_diff is not None,
                "seconds": t_verify, "text": str(report)})
        except Exception as exc:
            out["errors"].append(f"{name}: {_line(exc)}")
        _dump(result, out)
    del fp32, model, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if time.perf_counter() - start > spec["budget"]:
        out["errors"].append("`padfree verify --model DIR`: not run, the step's budget was spent")
    else:
        try:
            out["cli"] = _cli_verify(base, spec["device"])
        except Exception as exc:  # saving or loading the checkpoint: recorded with the runs above kept
            out["errors"].append(f"`padfree verify --model DIR`: {_line(exc)}")
    out["seconds"] = time.perf_counter() - start
    _dump(result, out)


def _cli_verify(model: Any, device: str) -> dict[str, Any]:
    """``padfree verify --model DIR --device DEVICE --json`` on ``model`` saved (bf16 safetensors, loaded in fp32)."""
    import torch

    from padfree.cli import main as padfree_main

    with tempfile.TemporaryDirectory(prefix="gpu_check_model_") as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        model.to("meta")  # the command loads its own copy; this one is no longer needed
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        argv = ["verify", "--model", tmp, "--device", device, "--json"]
        stdout, stderr = io.StringIO(), io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = padfree_main(argv)
    cmd = "padfree " + " ".join(argv).replace(tmp, "DIR")
    try:
        found = json.loads(stdout.getvalue())
    except ValueError:
        return {"cmd": cmd, "rc": rc, "seconds": time.perf_counter() - t0,
                "error": (stderr.getvalue() or stdout.getvalue()).strip()[-600:]}
    return {"cmd": cmd, "rc": rc, "seconds": time.perf_counter() - t0, "verdict": found.get("verdict"),
            "auto": found.get("auto_backend"), "checks": found.get("checks", [])}


WORKERS = {"matrix": worker_matrix, "verify": worker_verify}


# ---- the orchestrator ---------------------------------------------------------------------------------------------


def _environment(dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    if dry:  # its steps run side by side on the CPU: one thread each rather than all of them fighting over all cores
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], timeout: float, dry: bool) -> dict[str, Any]:
    """Run ``cmd`` in its own process group; past ``timeout`` the whole group is killed. Its exit status, stdout,
    the tail of its stderr, seconds, and whether it timed out."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_environment(dry), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    tail = "\n".join(line for line in stderr.splitlines() if line.strip())[-1500:]
    return {"rc": proc.returncode, "stdout": stdout, "stderr": tail, "seconds": time.perf_counter() - t0,
            "timed_out": timed_out}


def _status(run: dict[str, Any], limit: float) -> str:
    if run["timed_out"]:
        return f"timed out after {limit:.0f} s (what it measured before is kept)"
    return "ok" if run["rc"] == 0 else f"failed (exit status {run['rc']})"


def _worker(step: str, spec: dict[str, Any], budget: float, work: Path, tag: str) -> dict[str, Any]:
    """One worker process: ``spec`` in, its (possibly partial) result JSON out, with how the process ended."""
    spec = {**spec, "budget": max(budget - 20, 1)}  # the process's start and the last proof inside its limit
    spec_path, result = work / f"{tag}.spec.json", work / f"{tag}.result.json"
    _dump(spec_path, spec)
    run = _run([sys.executable, str(Path(__file__).resolve()), "--worker", step, "--spec", str(spec_path),
                "--result", str(result)], budget, spec["device"] == "cpu")
    data = json.loads(result.read_text(encoding="utf-8")) if result.exists() else {}
    data["status"], data["stderr"], data["wall"] = _status(run, budget), run["stderr"], run["seconds"]
    return data


def step_matrix(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    installed = [dist for dist, found in ctx["kernels"].items() if found]
    label = "with " + ", ".join(installed) if installed else "no kernel installed"
    if ctx["dry"]:
        variants = [dict(v) for v in DRY["matrix"]]
    else:
        variants = [{"variant": label, "block": False, "models": list(MODELS), "backends": list(BACKENDS),
                     "precisions": list(PRECISIONS)}]
        if installed:
            variants.append({"variant": "kernels hidden", "block": True, "models": list(HYBRIDS),
                             "backends": list(BACKENDS), "precisions": list(PRECISIONS)})
    variants[0]["variant"] = label
    start, parts = time.perf_counter(), []
    for i, variant in enumerate(variants):
        left = budget - (time.perf_counter() - start)
        share = left if i == len(variants) - 1 else left * 0.65
        log(f"matrix ({variant['variant']}): {', '.join(variant['models'])} on {', '.join(variant['backends'])} in "
            f"{', '.join(variant['precisions'])}; {share:.0f} s")
        parts.append(_worker("matrix", {**variant, "device": ctx["device"]}, share, ctx["work"], f"matrix{i}"))
    notes = [] if ctx["dry"] or len(variants) > 1 else [
        "none of flash-linear-attention, causal-conv1d, mamba-ssm is installed: the hybrids ran their PyTorch paths "
        "only"]
    return {"variants": parts, "notes": notes}


def step_verify(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    if ctx["dry"]:
        spec = {"sizes": DRY["verify_sizes"], "lengths": list(DRY["verify_lengths"])}
    else:
        import bench_training  # the ~0.5B config the GPU benchmark trains: one definition

        spec = {"sizes": dict(bench_training.GPU_SIZES), "lengths": list(VERIFY_LENGTHS)}
    log(f"verify: {spec['sizes']['hidden_size']} hidden, {spec['sizes']['num_hidden_layers']} layers; {budget:.0f} s")
    return _worker("verify", {**spec, "device": ctx["device"]}, budget, ctx["work"], "verify")


def step_bench(ctx: dict[str, Any], budget: float) -> dict[str, Any]:
    base = DRY["bench"] if ctx["dry"] else ["--device", "cuda", "--fused", "packed"]
    extra = ctx["bench_args"].split()
    kinds = {"llama": []} if ctx["dry"] else {"llama": [], "hybrid": list(HYBRID_BENCH)}
    start, runs = time.perf_counter(), []
    for i, (kind, own) in enumerate(kinds.items()):
        left = budget - (time.perf_counter() - start)
        limit = left if i == len(kinds) - 1 else left * 0.6
        if limit < 10:
            runs.append({"kind": kind, "status": "not run: the step's budget was spent", "section": None})
            continue
        args = [*base, "--models", kind, *own, *extra, "--no-write"]  # argparse: the last of a repeated option wins
        log(f"bench: bench_training.py {' '.join(args)}; {limit:.0f} s")
        run = _run([sys.executable, str(REPO / "benchmarks" / "bench_training.py"), *args], limit, ctx["dry"])
        text = run["stdout"]
        begin, end = text.find("<!-- bench_training"), text.rfind(":end -->")
        section = text[begin:end + len(":end -->")] if begin != -1 and end > begin else None
        runs.append({"kind": kind, "cmd": "python benchmarks/bench_training.py " + " ".join(args),
                     "status": _status(run, limit), "section": section, "stderr": run["stderr"],
                     "seconds": run["seconds"]})
    return {"runs": runs}


STEP_FUNCTIONS = {"matrix": step_matrix, "verify": step_verify, "bench": step_bench}


def probe(dry_run: bool) -> dict[str, Any]:
    """CUDA, the device, the versions and which optional kernels are importable (without importing them); an
    explicit dry run does not look for CUDA (nor import torch: its workers do)."""
    versions = {}
    for dist in VERSIONS:
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = "not installed"
    cuda, device = False, "none"
    if not dry_run:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        p = torch.cuda.get_device_properties(0)
        device = (f"{p.name} ({p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}), CUDA "
                  f"{torch.version.cuda}")
    kernels = {dist: importlib.util.find_spec(mod) is not None for mod, dist in KERNELS.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {"cuda": cuda, "gpu": device, "versions": versions, "kernels": kernels,
            "flash_attn": importlib.util.find_spec("flash_attn") is not None,
            "commit": commit.stdout.strip() or "unknown", "python": sys.version.split()[0]}


# ---- the section ---------------------------------------------------------------------------------------------------


def _e(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def _verdict(row: dict[str, Any]) -> str:
    if not row["ok"]:
        return "**MISMATCH**"
    return "exact" if row["sees_leaks"] else "exact, control within rounding"


def render_matrix(result: dict[str, Any], info: dict[str, Any]) -> list[str]:
    lines = ["### 1. Exactness: packed vs each sequence alone (`padfree.proof.compare.prove`)", "",
             f"Tiny random-weight models (`padfree.proof.tiny.build_tiny`, about 50-150k parameters) on "
             f"{'the CPU (dry run)' if info['dry'] else 'CUDA'}: the fixed packed case of `proof.ROWS`, a training "
             "step (forward with `labels=`, the model's own loss, backward) against every sequence alone. *logits* "
             "and *grads*: fp32 the largest scaled `|packed - alone|`, low precisions the largest per-sequence "
             "relative distance; *tol* = 1e-5 in fp32, else 3× what the precision's rounding alone moves the "
             "per-sequence run from fp32; *control* = the same measure on the same rows with positions that never "
             "restart (a leak the check must see: above tol). *kernels*: the hybrids' mixer kernels as installed "
             "here, or hidden from the process (their PyTorch paths).", ""]
    rows, refused, errors, skipped, notes, mixers, kernels = [], [], [], [], [], [], []
    for part in result.get("variants", []):
        label = part.get("variant", "?")
        for r in part.get("rows", []):
            k = label if r["model"] in HYBRIDS else "—"
            rows.append([f"`{r['model']}`", k, f"`{r['backend']}`", r["precision"], _e(r["logits"]), _e(r["loss"]),
                         _e(r["grads"]), f"{_e(r['tolerance'])} / {_e(r['grads_tolerance'])}", _e(r["leak"]),
                         _verdict(r)])
        why: dict[tuple[str, str], list[str]] = {}  # one line per backend and reason, naming every model refused
        for x in part.get("refused", []):
            why.setdefault((x["backend"], x["why"]), []).append(f"`{x['model']}`")
        refused += [f"`{b}` for {', '.join(ms)} ({label}): {w}" for (b, w), ms in why.items()]
        refused += [f"`{x['model']}` {x['what']} ({label}): {x['why']}" for x in part.get("unrunnable", [])]
        errors += [f"`{x['model']}` `{x['backend']}` ({label}): {x['error']}" for x in part.get("errors", [])]
        if part.get("skipped"):
            skipped.append(f"{label}: " + ", ".join(part["skipped"]))
        if part.get("status") != "ok":
            errors.append(f"the {label} process {part.get('status')}"
                          + (f"; its last output: `{part['stderr'][-300:]}`" if part.get("stderr") else ""))
        notes += part.get("notes", [])
        mixers += [f"`{m}` ({label}): " + "; ".join(d) for m, d in part.get("mixers", {}).items()]
        if part.get("kernels"):
            kernels.append(f"{label}: " + ", ".join(
                f"{d} {'usable' if s['usable'] else 'unusable'} ({s['broken'] or s['why']})"
                for d, s in part["kernels"].items()))
    if rows:
        lines += [table(["model", "kernels", "backend", "precision", "logits", "loss", "grads",
                         "tol (logits / grads)", "control", "verdict"], rows, "llllrrrrrl"), ""]
    n_ok = sum(r[-1] == "exact" for r in rows)
    lines.append(f"{len(rows)} checks: {n_ok} exact, {sum(r[-1].startswith('exact,') for r in rows)} exact with the "
                 f"control within rounding, {sum('MISMATCH' in r[-1] for r in rows)} mismatches.")
    lines.append("")
    for title, items in (("Refused or not run", refused), ("Errors", errors), ("Not reached in the budget", skipped),
                         ("Notes", notes + result.get("notes", [])), ("Mixer implementations", mixers),
                         ("Kernel status after the proofs", kernels)):
        if items:
            lines += [f"{title}:", "", *[f"- {x}" for x in dict.fromkeys(items)], ""]
    return lines


def render_verify(result: dict[str, Any], info: dict[str, Any]) -> list[str]:
    lines = ["### 2. A packed step on a ~0.5B model (`padfree.verify`, `padfree verify`)", "",
             f"{result.get('model', 'The model was not built')}; {result.get('data', 'no data')}. `configure_packing` "
             "(backend `auto`), then `verify(model, sequences)` — one packed forward + backward against one per "
             "sequence, at its default atol 1e-5. Beside it, calibrated in the run's own precision: *rounding* = "
             "the largest `|alone - alone in fp32|` of the sequences' logits, *tol* = 3× that (at least 1e-5), "
             "*control* = the largest `|packed - alone|` with positions that never restart; *calibrated* compares the "
             "logits with tol.", ""]
    rows = []
    for r in result.get("runs", []):
        calibrated = ("exact within rounding" if r["within"] else "**beyond rounding**") + (
            "" if r["sees_leaks"] else ", control within rounding: no proof")
        rows.append([r["run"], f"`{r['backend']}`", str(r["sequences"]), _e(r["max_logit_diff"]), _e(r["loss_diff"]),
                     f"{_e(r['max_grad_diff'])} (`{r['worst']}`)", "OK" if r["verify_ok"] else "MISMATCH",
                     _e(r["rounding"]), _e(r["tolerance"]), _e(r["leak"]), calibrated, f"{r['seconds']:.1f}"])
    if rows:
        lines += [table(["run", "backend", "sequences", "max \\|Δlogit\\|", "\\|Δloss\\|", "max \\|Δgrad\\|",
                         "verify at 1e-5", "rounding", "tol", "control", "calibrated", "verify s"], rows,
                        "llrrrrlrrrlr"), ""]
    cli = result.get("cli")
    if cli:
        lines.append(f"`{cli['cmd']}` (exit status {cli['rc']}, {cli['seconds']:.0f} s): "
                     + (cli.get("verdict") or f"no JSON: `{cli.get('error', '')}`"))
        lines.append("")
        checks = [[f"`{c.get('requested')}`", str(c.get("status")), f"`{c.get('backend')}`",
                   _e(c.get("max_logit_diff")), _e(c.get("loss_diff")), _e(c.get("max_grad_diff")),
                   (c.get("error") or "")[:160]] for c in cli.get("checks", [])]
        if checks:
            lines += [table(["requested", "status", "backend", "max \\|Δlogit\\|", "\\|Δloss\\|", "max \\|Δgrad\\|",
                             "error"], checks, "lllrrrl"), ""]
    errors = list(result.get("errors", []))
    if result.get("status") != "ok":
        errors.append(f"the process {result.get('status')}"
                      + (f"; its last output: `{result['stderr'][-300:]}`" if result.get("stderr") else ""))
    if errors:
        lines += ["Errors:", "", *[f"- {e}" for e in errors], ""]
    return lines


def _demote(section: str) -> list[str]:
    """A bench section inside this one: its markers dropped, its headings two levels down."""
    out = []
    for line in section.splitlines():
        if line.startswith("<!-- ") or line.startswith("## "):  # its markers, and a title this one's heading gives
            continue
        out.append("##" + line if line.startswith("##") else line)
    return out


def render_bench(result: dict[str, Any], info: dict[str, Any]) -> list[str]:
    lines = ["### 3. Training throughput (`benchmarks/bench_training.py`)", ""]
    full = False
    for run in result.get("runs", []):
        lines.append(f"`{run.get('cmd', run['kind'])}`: {run['status']}"
                     + (f" in {run['seconds']:.0f} s" if "seconds" in run else "") + ".")
        lines.append("")
        if run.get("section"):
            body = _demote(run["section"])
            if full:  # the machine, data and reading were given with the first model: only this model's tables
                first = next((i for i, x in enumerate(body) if x.startswith(f"##### {run['kind']}")), None)
                if first is not None:
                    stop = next((i for i in range(first + 1, len(body)) if body[i].startswith("##### ")), len(body))
                    body = body[first:stop]
            lines += [*body, ""]
            full = True
        elif run.get("stderr"):
            lines += [f"Its last output: `{run['stderr'][-400:]}`", ""]
    return lines


RENDERERS = {"matrix": render_matrix, "verify": render_verify, "bench": render_bench}


def render(info: dict[str, Any], results: dict[str, dict[str, Any]], elapsed: float, argv: list[str]) -> str:
    now = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    where = ("**a dry run on the CPU at the smallest sizes: no GPU figure**" if info["dry"]
             else f"device: {info['gpu']}")
    cmd = "scripts/gpu_check.sh" + (" " + " ".join(argv) if argv else "")
    lines = [MARKS[0], "## On a GPU: exactness, a ~0.5B packed step, training throughput (`scripts/gpu_check.sh`)", "",
             f"_Generated by `{cmd}` on {now} (commit {info['commit']}); {where}; the run took {elapsed / 60:.1f} min. "
             "Regenerating replaces only this section._", "",
             f"- Versions: python {info['python']}, " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
             "- Steps (each in its own process, with its own time budget): " + "; ".join(
                 f"{s} — {info['steps'][s]['status']} ({info['steps'][s]['seconds']:.0f} s of "
                 f"{info['steps'][s]['budget']:.0f})" for s in info["steps"]), ""]
    for step in (s for s in STEPS if s in results):
        result = results[step]
        try:
            lines += RENDERERS[step](result, info)
        except Exception as exc:  # a result this page cannot read must not lose the others
            lines += [f"Step {step}: its result could not be rendered ({_line(exc)})", ""]
    lines.append(MARKS[1])
    return "\n".join(lines)


def check_section(section: str, steps: list[str]) -> list[str]:
    """What is wrong with the rendered section (nothing: an empty list)."""
    problems = []
    if not (section.startswith(MARKS[0]) and section.endswith(MARKS[1])):
        problems.append("the section does not sit between its markers")
    if section.count(MARKS[0]) != 1 or section.count(MARKS[1]) != 1:
        problems.append("a marker appears more than once")
    if "<!-- bench_training" in section:
        problems.append("a bench_training marker leaked into the section")
    for step, title in (("matrix", "### 1. "), ("verify", "### 2. "), ("bench", "### 3. ")):
        if step in steps and title not in section:
            problems.append(f"no heading for step {step}")
    return problems


def summary(info: dict[str, Any], results: dict[str, dict[str, Any]]) -> tuple[list[str], bool]:
    lines, ok = [], True
    for step, st in info["steps"].items():
        ok &= st["status"] == "ok"
        lines.append(f"{step:7s} {st['status']} ({st['seconds']:.0f} s)")
    rows = [r for p in results.get("matrix", {}).get("variants", []) for r in p.get("rows", [])]
    if "matrix" in results:
        bad = [f"{r['model']}/{r['backend']}/{r['precision']}" for r in rows if not r["ok"]]
        errs = sum(len(p.get("errors", [])) for p in results["matrix"]["variants"])
        ok &= not bad and not errs
        lines.append(f"matrix: {len(rows)} checks, {len(bad)} mismatches{': ' + ', '.join(bad) if bad else ''}; "
                     f"{sum(not r['sees_leaks'] for r in rows)} with the control within rounding; {errs} errors")
    for r in results.get("verify", {}).get("runs", []):
        lines.append(f"verify {r['run']}: max |dlogit| {r['max_logit_diff']:.1e} (rounding {r['rounding']:.1e}, "
                     f"control {r['leak']:.1e}) -> {'within' if r['within'] else 'BEYOND'} rounding")
    if results.get("verify", {}).get("errors"):
        ok = False
        lines += [f"verify error: {e}" for e in results["verify"]["errors"]]
    for run in results.get("bench", {}).get("runs", []):
        lines.append(f"bench {run['kind']}: {run['status']}")
    return lines, ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="every step's setup on the CPU at the smallest sizes, the section into a temporary file")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS",
                   help="a step's time limit (defaults: " + ", ".join(f"{k}={v}" for k, v in BUDGETS.items()) + ")")
    p.add_argument("--bench-args", default="", help="more arguments for bench_training.py (e.g. '--tokens 65536')")
    p.add_argument("--output", type=Path, default=None,
                   help="the file whose section is written (default BENCHMARKS.md; a dry run: a temporary copy)")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def run_step(step: str, ctx: dict[str, Any], budget: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """One step: its status (``ok``, or how it failed) with its seconds and budget, and its result."""
    s0 = time.perf_counter()
    try:
        result = STEP_FUNCTIONS[step](ctx, budget)
        parts = result.get("variants", result.get("runs", [result]))
        status = next((p["status"] for p in parts if p.get("status", "ok") != "ok"), "ok")
    except Exception as exc:  # the orchestrator's own failure in one step: recorded, the other steps run
        result = {"errors": [_line(exc)], "status": "failed"}
        status = f"failed ({_line(exc)})"
        traceback.print_exc()
    seconds = time.perf_counter() - s0
    log(f"{step}: {status} in {seconds:.0f} s")
    return {"status": status, "seconds": seconds, "budget": budget}, result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](json.loads(args.spec.read_text(encoding="utf-8")), args.result)
        return 0
    t0 = time.perf_counter()
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        print(f"gpu_check: --steps takes a comma-separated subset of {','.join(STEPS)}, got {args.steps!r}",
              file=sys.stderr)
        return 2
    info = probe(args.dry_run)
    info["dry"] = args.dry_run or not info["cuda"]
    if not args.dry_run and not info["cuda"]:
        log("no CUDA GPU here: running the CPU dry run instead (the section goes to a temporary file)")
    budgets = dict(DRY_BUDGETS if info["dry"] else BUDGETS)
    for item in args.budget:
        step, _, seconds = item.partition("=")
        if step not in budgets or not seconds.replace(".", "", 1).isdigit():
            print(f"gpu_check: --budget takes STEP=SECONDS with STEP in {','.join(STEPS)}, got {item!r}",
                  file=sys.stderr)
            return 2
        budgets[step] = float(seconds)
    original = REPO / "BENCHMARKS.md"
    output = args.output
    if output is None and info["dry"]:
        output = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "BENCHMARKS.md"
        shutil.copyfile(original, output)
    output = output or original
    before = output.read_text(encoding="utf-8") if output.exists() else None
    ctx = {"dry": info["dry"], "device": "cpu" if info["dry"] else "cuda", "kernels": info["kernels"],
           "bench_args": args.bench_args, "work": Path(tempfile.mkdtemp(prefix="gpu_check_work_"))}
    log(f"{'dry run on the CPU' if info['dry'] else info['gpu']}; steps {', '.join(steps)}; output {output}")
    # on the GPU one step after another (one device, and the benchmark's timings undisturbed); a dry run measures
    # nothing, so its steps, mostly process start-ups, run side by side
    with ThreadPoolExecutor(max_workers=len(steps) if info["dry"] else 1) as pool:
        done = dict(zip(steps, pool.map(lambda step: run_step(step, ctx, budgets[step]), steps), strict=True))
    info["steps"] = {step: status for step, (status, _) in done.items()}
    results = {step: result for step, (_, result) in done.items()}
    section = render(info, results, time.perf_counter() - t0, args.argv)
    problems = check_section(section, steps)
    write_section(output, section, *MARKS)
    after = output.read_text(encoding="utf-8")
    if section not in after:
        problems.append(f"the section was not found in {output} after writing it")
    elif before is not None and MARKS[0] not in before and after.replace("\n\n" + section, "", 1).rstrip() != \
            before.rstrip():
        problems.append(f"writing the section changed other parts of {output}")
    shutil.rmtree(ctx["work"], ignore_errors=True)
    lines, ok = summary(info, results)
    print("\n".join(["", "gpu_check summary" + (" (DRY RUN on the CPU)" if info["dry"] else f" ({info['gpu']})"),
                     *lines, *[f"section problem: {p}" for p in problems],
                     f"section written to {output} in {(time.perf_counter() - t0) / 60:.1f} min"]))
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
