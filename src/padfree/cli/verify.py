"""``padfree verify``: prove a model exact on packed rows, on every attention backend available here."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from padfree.cli._optional import require
from padfree.cli._output import one_line
from padfree.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedModelError


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree verify`` and its arguments."""
    p = subparsers.add_parser(
        "verify",
        help="prove a model exact on packed rows, on every attention backend available here",
        description=(
            "Configure the model for each attention backend in turn (padfree.configure_packing) and compare one packed "
            "step with one step per sequence (padfree.verify: a few short sequences of different lengths in two "
            "rows): logits, loss and every parameter gradient. Prints the result per backend and the model's row of "
            "the README support table. First it says whether configure_packing accepts the model, and on what "
            "proof (the support table of the sweep, or an on-the-spot certification). Exit status 0: exact on every "
            "backend that ran; 1: refused by configure_packing, a mismatch, or no backend could run here. Needs "
            "torch and transformers."
        ),
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-type", metavar="TYPE",
                       help="the tiny random-weight model the support sweep proves for this transformers model type "
                            "(any causal-LM type, e.g. llama, qwen3_5_text, bloom)")
    which.add_argument("--model", metavar="DIR", help="a local checkpoint directory (save_pretrained), loaded in fp32")
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="check only this backend (repeatable): sdpa, eager, flex_attention, varlen, flash_attention_2, "
                        "auto (default: every backend available on the device)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    p.add_argument("--atol", type=float, default=1e-5, help="tolerance on logits, loss and gradients (default: 1e-5)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, say whether configure_packing accepts it, check every backend; 0 only when all are exact."""
    if not args.atol >= 0:
        raise InvalidArgumentError(f"--atol must be a number >= 0, got {args.atol}")
    require("padfree verify", "torch", "transformers")
    device = _torch_device(args.device)
    from padfree.model.configure import check_packing_support
    from padfree.model.support import check_support

    model = _load_model(args).to(device)
    support = check_packing_support(model)  # what configure_packing decides: the support table, or certification
    name = str(getattr(model.config, "model_type", type(model).__name__))
    verdict = (f"{name}: configure_packing accepts it — {support.how}" if support.ok else
               f"{name}: configure_packing refuses it — {support.reason}" + (f" ({support.how})" if support.how
                                                                              else ""))
    if not support.ok:
        if args.json:
            print(json.dumps({"model_type": name, "ok": False, "support": {
                "ok": False, "how": support.how, "reason": support.reason, "module": support.module}}, indent=2))
        else:
            print(verdict)
        return 1
    row = check_support(model, args.backends, atol=args.atol)
    if args.json:
        checks = [{
            "requested": c.requested, "backend": c.backend, "ok": c.ok, "forward_only": c.forward_only,
            "error": c.error,
            **({} if c.report is None else {"max_logit_diff": c.report.max_logit_diff,
                                             "loss_diff": c.report.loss_diff,
                                             "max_grad_diff": c.report.max_grad_diff}),
        } for c in row.checks]
        print(json.dumps({"model_type": row.model_type, "ok": row.ok, "checks": checks, "mixers": row.mixers,
                          "markdown": row.markdown(), "support": {"ok": True, "how": support.how}}, indent=2))
    else:
        print(verdict)
        print(row)
        print()
        print("| model type | " + " | ".join(f"`{c.requested}`" for c in row.checks) + " |")
        print("|---" * (len(row.checks) + 1) + "|")
        print(row.markdown())
    return 0 if row.ok else 1


def _load_model(args: argparse.Namespace) -> Any:
    if args.model_type is not None:  # the tiny model the support sweep proves for that type
        from padfree.model.shrink import UNBUILDABLE
        from padfree.model.sweep import build_tiny

        if args.model_type in UNBUILDABLE:
            raise UnsupportedModelError(f"--model-type {args.model_type!r}: {UNBUILDABLE[args.model_type]}")
        return build_tiny(args.model_type)
    path = Path(args.model)
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"--model {args.model!r} is not a checkpoint directory (no config.json); expected a local directory "
            f"written by save_pretrained")
    import torch
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 local_files_only=True)
    except Exception as exc:  # whatever transformers raises for a bad checkpoint becomes one clear line
        raise InvalidArgumentError(f"--model {args.model!r}: transformers cannot load a causal LM from it: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc


def _torch_device(name: str) -> Any:
    """``--device`` as a ``torch.device`` this machine can allocate on, or one line saying why not."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidArgumentError(f"--device {name!r} is not a torch device: {one_line(exc)}") from exc
    try:
        torch.empty(0, device=device)  # torch.device() only parses: "cuda" on a CPU-only build fails here
    except (AssertionError, RuntimeError) as exc:  # torch asserts for a backend it was built without
        build = f"torch {torch.__version__}" + (", built without CUDA" if device.type == "cuda" and not
                                                torch.version.cuda else "")
        why = one_line(exc).split(". ")[0]  # torch may append a list of every backend it was built with
        raise BackendUnavailableError(f"--device {name!r} is not available here ({why}; {build}); use --device "
                                      "cpu, or a torch built for that device") from exc
    return device
