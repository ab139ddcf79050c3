"""``padfree verify``: what configure_packing does with a model on this machine, backend by backend, and whether
each backend it accepts is exact on packed rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from padfree.cli._optional import require
from padfree.cli._output import one_line
from padfree.errors import BackendUnavailableError, InvalidArgumentError, UnsupportedModelError, describe


def add_parser(subparsers: Any) -> None:
    """Declare ``padfree verify`` and its arguments."""
    p = subparsers.add_parser(
        "verify",
        help="prove a model exact on packed rows, on every attention backend available here",
        description=(
            "Say whether configure_packing accepts the model, and on what proof (the support table of the sweep, or "
            "an on-the-spot certification); then configure it for each attention backend in turn "
            "(padfree.configure_packing) and compare one packed step with one step per sequence (padfree.verify: a "
            "few short sequences of different lengths in two rows): logits, loss and every parameter gradient. Each "
            "backend is reported as configure_packing treats it on this machine: exact (configured and proven), NOT "
            "EXACT (configured, and the proof failed), refused (with the reason: not for this model, or not on this "
            "device) or unavailable (a package or device it needs is missing); '(auto)' marks the backend "
            "configure_packing(backend='auto') picks here. Then the model's row of the README support table. Exit "
            "status 0: every backend configure_packing accepts here is exact (refused and unavailable ones are never "
            "run); 1: configure_packing refuses the model, a backend it accepts is not exact, or no backend could "
            "run; 2: bad arguments. --json prints one object: model_type, ok (the exit status's verdict), verdict "
            "(one line: exact or not, on which backends; or why configure_packing refuses the model), support {ok, "
            "how, reason, module}, auto_backend (what backend='auto' picks here, null when refused), checks "
            "[{requested, status (exact, not exact, refused, unavailable), backend, auto, ok, error, max_logit_diff, "
            "loss_diff, max_grad_diff}], mixers, markdown. Needs torch and transformers."
        ),
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model-type", metavar="TYPE",
                       help="the tiny random-weight model the support sweep proves for this transformers model type "
                            "(any causal-LM type, e.g. llama, qwen3_5_text, bloom)")
    which.add_argument("--model", metavar="DIR", help=f"{_CHECKPOINT}, loaded in fp32")
    p.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                   help="check only this backend (repeatable): sdpa, eager, flex_attention, varlen, flash_attention_2, "
                        "auto (default: sdpa, eager and flex_attention; varlen and flash_attention_2 too on CUDA)")
    p.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    p.add_argument("--atol", default=None, metavar="X|auto",
                   help="tolerance on logits, loss and gradients: a number, or auto (fp32: 1e-5; a lower precision: "
                        "three times what rounding alone moves each sequence, with a leaking control that must land "
                        "beyond it); default 1e-5 for the backend check, auto with --data")
    p.add_argument("--data", metavar="FILE",
                   help="instead of the backend check: verify the model as configure_packing sets it up on sequences "
                        "of FILE (its text columns tokenized, or its chat), in --dtype, on --device — your model and "
                        "data where you train")
    p.add_argument("--tokenizer", metavar="NAME_OR_DIR",
                   help="with --data: the tokenizer (default: the --model directory's, else padfree's offline one)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "autocast-bf16", "fp16", "autocast-fp16"), default="fp32",
                   help="with --data: the precision to check in: weights cast (bf16, fp16) or fp32 weights under "
                        "autocast (default: fp32)")
    p.add_argument("--sequences", type=int, default=8, metavar="N",
                   help="with --data: how many sequences (the shortest of the first 256 records, at least 2 tokens "
                        "each) to pack into one row and check (default: 8)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object on stdout (see above)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, say whether configure_packing accepts it, check every backend; 0 only when every backend
    configure_packing accepts here is exact."""
    atol = _atol(args.atol, "auto" if args.data is not None else 1e-5)
    if args.data is not None:
        from padfree.cli._inputs import check_data_path

        if args.sequences < 2:
            raise InvalidArgumentError(f"--sequences must be at least 2 (a packed row of one sequence proves "
                                       f"nothing), got {args.sequences}")
        check_data_path(args.data, "--data")  # a missing file is said before anything heavy is imported
    elif args.tokenizer is not None or args.dtype != "fp32":
        raise InvalidArgumentError("--tokenizer and --dtype apply with --data only")
    require("padfree verify", "torch", "transformers")
    device = _torch_device(args.device)
    if args.data is not None:
        return _verify_data(args, device, atol)
    from padfree.model.configure import check_packing_support
    from padfree.proof.backends import check_support

    model = _load_model(args).to(device)
    support = check_packing_support(model)  # what configure_packing decides: the support table, or certification
    name = str(getattr(model.config, "model_type", type(model).__name__))
    verdict = (f"{name}: configure_packing accepts it — {support.how}" if support.ok else
               f"{name}: configure_packing refuses it — {support.reason}" + (f" ({support.how})" if support.how
                                                                              else ""))
    if not support.ok:
        if args.json:
            print(json.dumps({"model_type": name, "ok": False, "verdict": verdict, "support": {
                "ok": False, "how": support.how, "reason": support.reason, "module": support.module},
                "auto_backend": None, "checks": [], "mixers": {}, "markdown": None}, indent=2))
        else:
            print(verdict)
        return 1
    if atol == "auto":
        raise InvalidArgumentError("--atol auto applies with --data; the backend check runs in fp32 (a number)")
    row = check_support(model, args.backends, atol=atol)
    if args.json:
        checks = [{
            "requested": c.requested, "status": c.status, "backend": c.backend, "auto": c.auto, "ok": c.ok,
            "error": c.error,
            **({} if c.report is None else {"max_logit_diff": c.report.max_logit_diff,
                                             "loss_diff": c.report.loss_diff,
                                             "max_grad_diff": c.report.max_grad_diff}),
        } for c in row.checks]
        print(json.dumps({"model_type": row.model_type, "ok": row.ok, "verdict": row.verdict,
                          "support": {"ok": True, "how": support.how, "reason": None, "module": None},
                          "auto_backend": row.auto_backend, "checks": checks, "mixers": row.mixers,
                          "markdown": row.markdown()}, indent=2))
    else:
        print(verdict)
        print(row)
        print()
        print("| model type | " + " | ".join(f"`{c.requested}`" for c in row.checks) + " |")
        print("|---" * (len(row.checks) + 1) + "|")
        print(row.markdown())
    return 0 if row.ok else 1


def _atol(given: str | None, default: float | str) -> float | str:
    """``--atol``: ``auto`` or a number >= 0 (None: ``default``)."""
    if given is None:
        return default
    if given == "auto":
        return given
    try:
        value = float(given)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise InvalidArgumentError(f"--atol must be auto or a number >= 0, got {given!r}")
    return value


_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _verify_data(args: argparse.Namespace, device: Any, atol: float | str) -> int:
    """``--data``: the model configured as configure_packing sets it up, verified on the file's shortest sequences
    in the precision asked for; 0 when exact and the check could tell (its control beyond the tolerance)."""
    import contextlib

    import torch

    import padfree
    from padfree.cli._columns import texts_from_columns
    from padfree.cli._inputs import read_table
    from padfree.cli._tokens import load_tokenizer, token_ids

    table = read_table(args.data, "--data")
    texts, note = texts_from_columns(table.slice(0, 256), None, source="--data")
    tokenizer_path = args.tokenizer
    if tokenizer_path is None and args.model is not None and any(
            (Path(args.model) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer_path = args.model
    tokenizer, tokenizer_name = load_tokenizer(tokenizer_path)
    ids = [seq for seq in token_ids(texts, tokenizer) if len(seq) >= 2]
    if len(ids) < 2:
        raise InvalidArgumentError(f"--data {args.data!r}: fewer than 2 of its first 256 records have 2 tokens or "
                                   f"more ({note}); nothing to pack")
    seqs = sorted(ids, key=len)[:args.sequences]
    model = _load_model(args)
    weights = _DTYPES.get(args.dtype)
    if weights is not None:
        model = model.to(getattr(torch, weights))
    model = model.to(device)
    padfree.configure_packing(model)
    cast = args.dtype.startswith("autocast-")
    context = torch.autocast(device.type, dtype=getattr(torch, _DTYPES[args.dtype.split("-")[1]])) if cast else \
        contextlib.nullcontext()
    with context:
        report = padfree.verify(model, seqs, atol=atol)
    ok = report.ok and report.conclusive is not False
    if args.json:
        print(json.dumps({"model_type": str(getattr(model.config, "model_type", "?")), "ok": ok,
                          "dtype": args.dtype, "tokenizer": tokenizer_name, "sequences": report.num_sequences,
                          "max_logit_diff": report.max_logit_diff, "loss_diff": report.loss_diff,
                          "max_grad_diff": report.max_grad_diff, "atol": report.atol, "rounding": report.rounding,
                          "control": report.control, "conclusive": report.conclusive}, indent=2))
    else:
        print(f"{report.num_sequences} sequences of {args.data} ({note}; tokenizer {tokenizer_name}), {args.dtype} "
              f"on {device}")
        print(report)
    return 0 if ok else 1


_CHECKPOINT = "a local checkpoint directory of a causal LM (written by save_pretrained: config.json and its weights)"


def _load_model(args: argparse.Namespace) -> Any:
    if args.model_type is not None:  # the tiny model the support sweep proves for that type
        from padfree.proof.shrink import UNBUILDABLE
        from padfree.proof.tiny import build_tiny

        if args.model_type in UNBUILDABLE:
            raise UnsupportedModelError(f"--model-type {args.model_type!r}: {UNBUILDABLE[args.model_type]}")
        return build_tiny(args.model_type)
    path = Path(args.model)
    model_type = _checkpoint_type(args.model, path)
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        what = ("is not a model type of" if model_type not in CONFIG_MAPPING else
                "has no causal-LM class (AutoModelForCausalLM) in")
        raise InvalidArgumentError(f"--model {args.model!r}: its config.json's model_type {model_type!r} {what} "
                                   f"transformers {transformers.__version__}; expected {_CHECKPOINT}")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 local_files_only=True)
    except Exception as exc:  # whatever transformers raises for a bad checkpoint becomes one clear line
        why = one_line(exc)
        why = why if len(why) <= 300 else why[:297] + "..."
        raise InvalidArgumentError(f"--model {args.model!r}: transformers cannot load a causal LM from it "
                                   f"({type(exc).__name__}: {why}); expected {_CHECKPOINT}") from exc


def _checkpoint_type(given: str, path: Path) -> str:
    """The ``model_type`` of the checkpoint directory ``path``'s config.json, or one line saying what is wrong."""
    if not path.exists():
        raise InvalidArgumentError(f"--model {given!r} does not exist; expected {_CHECKPOINT}")
    if not path.is_dir():
        raise InvalidArgumentError(f"--model {given!r} is a file, not a directory; expected {_CHECKPOINT}")
    config = path / "config.json"
    if not config.is_file():
        raise InvalidArgumentError(f"--model {given!r} is not a checkpoint directory (no config.json); expected "
                                   f"{_CHECKPOINT}")
    try:
        fields = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise InvalidArgumentError(f"--model {given!r}: config.json cannot be read as JSON ({one_line(exc)}); "
                                   f"expected {_CHECKPOINT}") from exc
    if not isinstance(fields, dict):
        raise InvalidArgumentError(f"--model {given!r}: config.json holds a JSON {type(fields).__name__}, not an "
                                   f"object; expected {_CHECKPOINT}")
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        got = "has no model_type" if "model_type" not in fields else f"has model_type {describe(model_type)}"
        raise InvalidArgumentError(f"--model {given!r}: config.json {got}; expected {_CHECKPOINT}")
    return model_type


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
