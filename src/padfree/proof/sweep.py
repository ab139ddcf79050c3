"""The support sweep: one tiny model per causal-LM type, proven (or refused with a reason), as a table entry.

The test suite runs :func:`sweep_type` for every entry of the installed transformers' causal-LM mapping and writes
the results to ``padfree/proof/support.json`` (the table :mod:`padfree.proof.registry` reads) and to the README's
support table; ``padfree verify --model-type T`` runs the same function for one type. For each type:

1. the config class's defaults, shrunk (:func:`padfree.proof.shrink.shrink_config`), and — for the families whose
   features the defaults leave off (a sliding window, say) — a second variant with them on
   (:data:`padfree.proof.tiny.TINY_CONFIGS`);
2. what stock transformers does with the packed rows (restarting ``position_ids``, no mask, no cache);
3. :func:`padfree.proof.compare.prove` on ``sdpa`` and ``eager`` in fp32 — a packed training step: the forward with
   ``labels=`` (which a model may hand down to its attention with its ``**kwargs``), the model's own loss from
   them, and its backward; logits, loss, every gradient — and on ``sdpa`` in ``autocast_bf16`` and ``bf16``
   weights, each with its leaking negative control;
4. the verdict: ``exact`` when every check of every variant passed; else ``refused``, with the module that cannot be
   made exact (from ``configure_packing``'s scan) or the first module whose packed output diverges.

>>> entry = sweep_type("llama", precisions={"sdpa": ("fp32",)})
>>> entry["verdict"], entry["class"], sorted(entry["backends"])
('exact', 'LlamaForCausalLM', ['padfree_sdpa'])
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from padfree.errors import InvalidArgumentError, PadfreeError, describe
from padfree.proof.registry import features, module_classes
from padfree.proof.tiny import build_tiny, multimodal_types, quiet

#: the backends every type is proven on (flex_attention has no backward on the CPU: certified on the spot instead)
BACKENDS = ("sdpa", "eager")
#: backend -> precisions of the sweep
PRECISIONS: Mapping[str, Sequence[str]] = {"sdpa": ("fp32", "autocast_bf16", "bf16"), "eager": ("fp32",)}


def _variants(model_type: str) -> list[dict[str, Any]]:
    """The shrunk defaults, and the hand-made tiny config where it switches on features the defaults leave off."""
    from padfree.proof.shrink import default_config, shrink_config
    from padfree.proof.tiny import TINY_CONFIGS, tiny_config

    variants: list[dict[str, Any]] = [{}]
    if model_type in TINY_CONFIGS:

        with quiet():
            try:
                default = features(shrink_config(default_config(model_type)))
                hand = tiny_config(model_type)
                if features(shrink_config(hand)) != default:
                    variants.append({k: v for k, v in hand.to_dict().items()
                                     if k in TINY_CONFIGS[model_type] or k.endswith("layer_types")})
            except Exception:  # the hand-made config is a bonus: the defaults decide
                pass
    return variants


def _stock(model: torch.nn.Module) -> str:
    from padfree.proof.compare import FP32_TOL, stock_packed_diff

    try:
        with quiet():
            diff = stock_packed_diff(model)
    except Exception as exc:
        return f"crashes ({type(exc).__name__})"
    return "exact" if diff <= FP32_TOL else "leaks"


def _refused(entry: dict[str, Any], reason: str, module: str | None, model: torch.nn.Module | None = None
             ) -> dict[str, Any]:
    """Mark ``entry`` refused; with ``model``, record the configuration that failed (a user's config with other
    features is then certified on the spot instead of refused)."""
    entry.update(verdict="refused", reason=reason, module=module)
    if model is not None:
        from padfree.proof.shrink import shrink_config

        try:
            with quiet():
                entry["failed"] = {"features": features(shrink_config(model.config)), "modules": module_classes(model)}
        except Exception:  # refusing the type as such is the safe side
            pass
    entry["variants"] = []
    return entry


def sweep_type(model_type: str, *, precisions: Mapping[str, Sequence[str]] | None = None,
               multimodal: bool = False) -> dict[str, Any]:
    """Prove ``model_type`` (see the module docstring) — with ``multimodal``, its vision-language class of
    :func:`multimodal_types`, on text rows — and return its support-table entry: ``verdict`` (``exact`` /
    ``refused``), ``class``, ``base_class``, ``backends`` (resolved backend -> precisions proven), ``variants`` (per
    proven config: its features and module classes), ``mixers``, ``stock``, ``reason`` and ``module`` when refused,
    ``params`` and ``seconds``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    from padfree.model.install import install_packing, unconfigure_packing
    from padfree.proof import shrink
    from padfree.proof.compare import first_divergence, prove
    from padfree.proof.shrink import shrink_config

    classes = multimodal_types() if multimodal else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not isinstance(model_type, str) or model_type not in classes:
        what = "vision-language" if multimodal else "causal-LM"
        raise InvalidArgumentError(f"model_type must be a {what} type of the installed transformers, got "
                                   f"{describe(model_type)}")
    plan = dict(PRECISIONS if precisions is None else precisions)
    start = time.perf_counter()
    entry: dict[str, Any] = {"class": classes[model_type],
                             "base_class": MODEL_MAPPING_NAMES.get(model_type), "backends": {}, "variants": [],
                             "mixers": [], "stock": "not run"}
    unbuildable = getattr(shrink, "UNBUILDABLE", {})
    if model_type in unbuildable:
        return _refused(entry, unbuildable[model_type], entry["class"])
    backends: dict[str, set[str]] = {}
    for variant in _variants(model_type) if not multimodal else [{}]:
        try:
            model = build_tiny(model_type, variant, multimodal=multimodal)
        except Exception as exc:
            if variant:
                continue  # the hand-made variant is a bonus
            return _refused(entry, f"a tiny model of this type could not be built from its config class's defaults "
                                   f"({type(exc).__name__}: {str(exc)[:200]})", entry["class"])
        entry["class"] = type(model).__name__
        entry["params"] = sum(p.numel() for p in model.parameters())
        why = _not_text_alone(model)
        if why is not None:
            return _refused(entry, why, type(model).__name__)
        if not variant:
            entry["stock"] = _stock(model)
        try:  # refusals by name (a module no family handles, a table of another shape) before any proof runs
            with quiet():
                install_packing(model)
        except PadfreeError as exc:
            msg = str(exc).splitlines()[0].removeprefix(f"cannot make {type(model).__name__} packing-exact: ")
            module = _module_in(f": {msg}")
            return _refused(entry, msg.removeprefix(f"{module}: ") if module else msg, module or type(model).__name__)
        finally:
            unconfigure_packing(model)
        try:
            with quiet():
                proof = prove(model, backends=list(plan), precisions=plan)
        except PadfreeError as exc:
            return _refused(entry, str(exc).splitlines()[0], type(model).__name__)
        except Exception as exc:
            return _refused(entry, f"the packed training step raised {type(exc).__name__}: {str(exc)[:200]}",
                            type(model).__name__, model)
        if proof.refused and not proof.checks:
            why = next(iter(proof.refused.values()))
            return _refused(entry, why.removeprefix(f"cannot make {type(model).__name__} packing-exact: "),
                            _module_in(why))
        bad = [c for c in proof.checks if not c.ok]
        if proof.blind and not bad:
            return _refused(entry, f"the leaking control stays within rounding on {', '.join(proof.blind)}: the "
                                   f"proof cannot tell a leak from rounding for this model", type(model).__name__,
                            model)
        if bad or not proof.unpacked_unchanged:
            with quiet():
                module = first_divergence(model, next(iter(plan))) or type(model).__name__
            if bad:
                c = bad[0]
                parts = [name for name, off in (("logits", c.logits > c.tolerance), ("loss", c.loss > c.loss_tolerance),
                                                ("gradients", c.grads is not None and c.grads > c.grads_tolerance))
                         if off]
                what = f"packed differs from per-sequence on {c.backend} in {c.precision} ({', '.join(parts)})"
                entry["measured"] = str(c)
            else:
                what = "configuring it changed the logits of an ordinary padded batch"
            return _refused(entry, what, module, model)
        for c in proof.checks:
            backends.setdefault(c.backend, set()).add(c.precision)
            if not c.sees_leaks:  # within tolerance, but this precision's rounding hides a leak of this model
                entry.setdefault("blind", set()).add(f"{c.backend}/{c.precision}")
        entry["mixers"] = sorted(set(entry["mixers"]) | set(proof.mixers.values()))
        if proof.unrunnable:  # the model's own code fails there: not proven, and said so
            entry.setdefault("unrunnable", {}).update(proof.unrunnable)
        with quiet():
            proven = features(shrink_config(model.config))  # what registry.lookup compares a user's config with
        entry["variants"].append({"features": proven, "modules": module_classes(model)})
        if not variant and getattr(model.config, "vision_config", None) is not None:
            with quiet():
                entry["images"] = _images(model)
    order = ("fp32", "autocast_bf16", "bf16", "autocast_fp16", "fp16")
    entry["backends"] = {b: [p for p in order if p in ps] for b, ps in sorted(backends.items())}
    if "blind" in entry:
        entry["blind"] = sorted(entry["blind"])
    entry.update(verdict="exact", seconds=round(time.perf_counter() - start, 2))
    return entry


def _images(model: torch.nn.Module) -> dict[str, Any]:
    """The images verdict of a vision-language model (:func:`padfree.proof.compare_images.prove_images`): ``exact``,
    ``refused`` (padfree refuses its images, naming the module, or the packed row differs) or ``not proven`` (no
    probe samples could be built for the swept config: configure_packing proves a user's own config on the spot);
    with the route padfree lays its images out by."""
    from padfree.model import images
    from padfree.proof.compare_images import prove_images_in

    route = images.image_route(model)
    if route is None:
        return {"verdict": "refused", "route": None, "reason": images.image_refusal(model) or "no image route"}
    proofs = prove_images_in(model, ("fp32", "autocast_bf16"))  # one fp32 reference for both
    proof, low = proofs["fp32"], proofs["autocast_bf16"]
    if proof.ok:
        # and under bf16 autocast, within what rounding moves each sample alone; a precision whose control rounding
        # hides, or that differs beyond it, is left out of the proven ones (with the measure)
        entry: dict[str, Any] = {"verdict": "exact", "route": route, "precisions": ["fp32"]}
        if low.ok:
            entry["precisions"].append(low.precision)
        else:
            entry["unproven"] = {low.precision: low.refused or (
                f"logits {low.logits:.1e} (bound {low.tolerance:.1e}), loss {low.loss:.1e} (bound "
                f"{low.loss_tolerance:.1e}), gradients {low.grads:.1e} (bound {low.grad_tolerance:.1e}), control "
                f"{low.control:.1e}")}
        return entry
    if proof.logits is None:
        return {"verdict": "not proven", "route": route, "reason": proof.refused}
    return {"verdict": "refused", "route": route, "reason": (
        f"a packed row with images differs from its samples alone (logits {proof.logits:.1e}, loss {proof.loss:.1e}, "
        f"gradients {proof.grads:.1e}; tolerance {proof.tolerance:.0e})")}


def _not_text_alone(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be proven on text rows at all: not a causal LM (:mod:`padfree.model.kinds`), or a
    vision-language forward that requires its images in every call (a BLIP-style image prefix)."""
    import inspect

    from padfree.model.kinds import not_a_causal_lm

    why = not_a_causal_lm(model)
    if why is not None:
        return why
    params = inspect.signature(type(model).forward).parameters.values()
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in ("self", "input_ids")
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        return (f"its forward requires {', '.join(required)} in every call (every text follows its image's "
                f"features): text-only rows cannot run through it, and packed rows with images are not made exact")
    return None


def _module_in(message: str) -> str | None:
    """The module a configure_packing refusal names first (``...: <qualified name>: why``)."""
    parts = message.split(": ")
    return parts[1] if len(parts) > 2 else None
