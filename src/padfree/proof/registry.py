"""The support table: what the test suite's sweep proved, per model type, and the decision ``configure_packing`` takes.

``support.json`` (in this package) is written by ``tests/proof/test_model_sweep.py`` (``PADFREE_UPDATE_DOCS=1``), never
by hand: for every causal-LM type of the transformers it ran on, the class it built, the verdict (``exact`` on every
backend and precision it ran, or ``refused`` with the module and the reason), the module classes and config
features of the tiny model it proved, and what stock transformers does with the same packed rows.

:func:`decide` accepts a model from the table when everything the proof depended on matches — the transformers
version, the model type and class, no module class the swept model did not have, the same config features
(:func:`features`), a backend the sweep ran — and otherwise certifies it on the spot (:mod:`padfree.proof.certify`):
a tiny twin of the model's own class and config, packed against per-sequence, cached on disk.

>>> table = load()
>>> table["transformers"] is None or isinstance(table["types"], dict)
True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from padfree.model.guards import installed

__all__ = ["Verdict", "features", "load", "module_classes", "supported_types"]

log = logging.getLogger("padfree")

# config keys that say nothing about what a packed forward computes
_IGNORED = frozenset({
    "model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "dtype", "torch_dtype",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "output_hidden_states",
    "output_attentions", "return_dict", "use_cache", "chunk_size_feed_forward", "finetuning_task",
    "task_specific_params", "_attn_implementation_autoset", "_commit_hash", "use_return_dict", "num_labels",
    "output_router_logits", "router_aux_loss_coef", "initializer_range", "pretraining_tp", "use_mamba_kernels",
    "use_kernels", "tie_encoder_decoder",
})


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The support decision for one configured model.

    Attributes:
        ok: the model is proven packing-exact.
        how: what proved it (or what was tried), for :attr:`PackingReport.proof` and the log.
        reason: why not (empty when ok).
        module: the module (qualified name or class) the refusal names, when one is known.
    """

    ok: bool
    how: str
    reason: str = ""
    module: str | None = None


@functools.cache
def load() -> dict[str, Any]:
    """The shipped support table (``{"transformers": version or None, "types": {...}}``; empty before a sweep)."""
    try:
        text = resources.files("padfree.proof").joinpath("support.json").read_text()
    except FileNotFoundError:
        return {"transformers": None, "types": {}}
    return json.loads(text)


def supported_types() -> Mapping[str, str]:
    """Model type -> what the sweep proved, for every type whose verdict is ``exact``."""
    return {t: e.get("note", "") for t, e in load()["types"].items() if e.get("verdict") == "exact"}


def module_classes(model: Any) -> list[str]:
    """The sorted class names of every module of ``model``."""
    return sorted({type(m).__name__ for m in model.modules()})


def features(config: Any) -> dict[str, Any]:
    """What a config switches on, without its sizes: for every key, ``None`` / a bool / a string as it is, a
    number as ``"set"``, a list of strings as its sorted distinct values (layer kinds), a rope dict as its type;
    sub-configs by the same rules. Two configs with equal features build the same kinds of modules wired the
    same way; only widths, depths and constants differ."""
    return _features(config.to_dict())


def _features(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in _IGNORED or key.endswith(("token_id", "token_ids", "token_index")):
            continue
        if value is None or isinstance(value, (bool, str)):
            out[key] = value
        elif isinstance(value, (int, float)):
            out[key] = "set"
        elif isinstance(value, (list, tuple)):
            strings = [v for v in value if isinstance(v, str)]
            out[key] = sorted(set(strings)) if strings and len(strings) == len(value) else "set"
        elif isinstance(value, dict):
            if "model_type" in value:
                out[key] = _features(value)
            elif "rope_type" in value or "type" in value:
                out[key] = {"rope_type": value.get("rope_type", value.get("type"))}
            elif all(isinstance(v, dict) for v in value.values()):  # rope parameters per layer type, ...
                out[key] = {k: _features(v) for k, v in sorted(value.items()) if k}
            else:
                out[key] = "set"
    return out


def lookup(model: Any, backend: str) -> tuple[str, dict[str, Any] | None]:
    """``("covered" | "refused" | "uncovered: why", entry)``: what the table says of ``model`` on ``backend``."""
    from padfree.proof.shrink import shrink_config

    table = load()
    model_type = str(getattr(model.config, "model_type", ""))
    entry = _entry(table, model_type, type(model).__name__)
    if table["transformers"] is None:
        return "uncovered: padfree ships no support table", None
    if table["transformers"] != installed():
        return (f"uncovered: the support table was proven on transformers {table['transformers']}, "
                f"{installed()} is installed"), None
    if entry is None:
        return f"uncovered: model type {model_type!r} is not in the support table", None
    if type(model).__name__ not in (entry["class"], entry.get("base_class")):
        return f"uncovered: the table proved {entry['class']}, not {type(model).__name__}", None
    try:
        mine = features(shrink_config(model.config))
    except Exception as exc:  # a config its own class cannot rebuild: certification will say more
        return f"uncovered: the config could not be shrunk ({type(exc).__name__}: {exc})", None
    classes = set(module_classes(model))
    if entry.get("verdict") == "refused":
        failed = entry.get("failed")
        if failed is None or (failed["features"] == mine and classes <= set(failed["modules"])):
            return "refused", entry  # refused as a type, or exactly this kind of config failed the proof
        return "uncovered: the sweep refused another configuration of this type", None
    variants = entry.get("variants") or []
    match = [v for v in variants if v["features"] == mine and classes <= set(v["modules"])]
    if not match:
        closest = min(variants, key=lambda v: len(_differences(v["features"], mine)), default=None)
        if closest is None:
            return f"uncovered: the sweep proved no variant of {model_type!r}", None
        extra = sorted(classes - set(closest["modules"]))
        if extra:
            return f"uncovered: module classes the swept model did not have: {', '.join(extra[:5])}", None
        diff = _differences(closest["features"], mine)
        return f"uncovered: config features the sweep did not cover: {', '.join(diff[:6])}", None
    if backend not in entry.get("backends", {}) and backend != "none":
        return f"uncovered: the sweep did not run backend {backend}", None
    return "covered", entry


def _entry(table: dict[str, Any], model_type: str, name: str) -> dict[str, Any] | None:
    """The entry that proved class ``name`` of ``model_type``: the causal-LM section's, or the ``multimodal``
    section's where the type's vision-language class is another class (Qwen3.5's ForConditionalGeneration beside
    its ForCausalLM)."""
    causal, multimodal = table["types"].get(model_type), table.get("multimodal", {}).get(model_type)
    if multimodal is not None and name == multimodal["class"]:
        return multimodal
    if (causal is not None and name in (causal["class"], causal.get("base_class"))) or multimodal is None:
        return causal
    return multimodal if name == multimodal.get("base_class") else causal


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _cell(entry: dict[str, Any], backend: str) -> str:
    proven = entry.get("backends", {}).get(backend)
    if entry.get("verdict") != "exact":
        return "—"
    if proven is None and "none" in entry.get("backends", {}):
        return "n/a"  # no attention layers
    return "✓" if proven else "—"


def _low(entry: dict[str, Any], precision: str) -> str:
    """``✓`` proven; ``✓*`` proven, but the leaking control stayed within this precision's rounding (the fp32 check
    is the one that can see a leak); ``n/a``: transformers' own per-sequence forward fails in this precision."""
    if any(key.endswith("/" + precision) for key in entry.get("unrunnable", {})):
        return "n/a"
    if not any(precision in ps for ps in entry.get("backends", {}).values()):
        return "—"
    return "✓*" if any(b.endswith("/" + precision) for b in entry.get("blind", [])) else "✓"


def _images(entry: dict[str, Any]) -> str:
    """``✓ rope`` / ``✓ blocks`` / ``✓ causal``: a packed row with images proven exact, by the route padfree lays them
    out; ``refused`` (why: in the last column); ``not proven``: no
    probe could be built for the swept config (a user's config is proven on the spot); ``—``: no images."""
    images = entry.get("images")
    if not images:
        return "—"
    if images.get("verdict") == "exact":
        return f"✓ {images.get('route')}"
    return str(images.get("verdict"))


def _short(text: str) -> str:
    """A cell's label for a long description: up to its first ``:``, `` (``, ``,`` or ``;``."""
    return re.split(r":| \(|,|;", text, maxsplit=1)[0].strip()


def _flat(text: Any) -> str:
    return str(text).replace("|", "/").replace("\n", " ").strip()


def markdown_table(table: dict[str, Any] | None = None, section: str = "types") -> str:
    """The support table of ``docs/support.md``, rendered from the support table: every type of the sweep, one row
    each (``section="multimodal"``: the vision-language classes, on text rows), with short cells; each long
    description — a mixer's, a refusal's reason — is a footnote below the table, one per distinct text, so that a
    family's types share theirs.

    >>> table = {"types": {"a": {"verdict": "refused", "class": "A", "module": "A.attn", "reason": "no | way"}}}
    >>> print(markdown_table(table))  # doctest: +NORMALIZE_WHITESPACE
    | model type | class | padfree | `sdpa` | `eager` | bf16 · autocast | images | stock transformers | notes |
    |---|---|---|---|---|---|---|---|---|
    | a | `A` | refused | — | — | — | — | ? | `A.attn`[^t1] |
    <BLANKLINE>
    [^t1]: no / way
    """
    table = load() if table is None else table
    prefix = "t" if section == "types" else section[:1]
    notes: dict[str, str] = {}  # full text -> footnote label, in order of first use

    def note(label: str, text: str) -> str:
        text = _flat(text)
        if text == label:
            return label
        key = notes.setdefault(text, f"{prefix}{len(notes) + 1}")
        return f"{label}[^{key}]"

    rows = ["| model type | class | padfree | `sdpa` | `eager` | bf16 · autocast | images | stock transformers "
            "| notes |", "|---|---|---|---|---|---|---|---|---|"]
    for model_type, e in sorted(table.get(section, {}).items()):
        exact = e.get("verdict") == "exact"
        lows = " · ".join(_low(e, p) for p in ("bf16", "autocast_bf16")) if exact else "—"
        if exact:
            mixers = {}  # short label -> full text, one per label (the first)
            for m in sorted(e.get("mixers", [])):
                mixers.setdefault(_short(m), m)
            detail = "; ".join(note(short, full) for short, full in sorted(mixers.items()))
        else:
            module = f"`{e['module']}`" if e.get("module") else "refused"
            detail = note(module, e.get("reason", ""))
        images = _images(e)
        reason = (e.get("images") or {}).get("reason")
        if exact and images in ("refused", "not proven") and reason:
            images = note(images, reason)
        rows.append(f"| {model_type} | `{e.get('class', '?')}` | {'exact' if exact else 'refused'} | "
                    f"{_cell(e, 'padfree_sdpa')} | {_cell(e, 'padfree_eager')} | {lows} | {images} | "
                    f"{e.get('stock', '?')} | {detail} |")
    footnotes = [f"[^{key}]: {text}" for text, key in notes.items()]
    return "\n".join(rows + (["", *footnotes] if footnotes else []))


def support_summary(table: dict[str, Any] | None = None) -> str:
    """Five lines of counts for the README, from the support table: causal-LM types exact / refused (named),
    vision-language classes exact on text rows / refused (named), images in packed rows by route, what stock
    transformers does with the same packed rows, and where the full table is.

    >>> table = {"transformers": "5.0", "types": {"a": {"verdict": "exact", "stock": "leaks"},
    ...          "b": {"verdict": "refused"}}, "multimodal": {"v": {"verdict": "exact",
    ...          "images": {"verdict": "exact", "route": "rope"}}}}
    >>> print(support_summary(table))
    - **Causal LMs**: 2 model types of transformers 5.0 — **1 exact**, 1 refused (b).
    - **Vision-language models**: 1 model type — **1 exact** on text rows, 0 refused.
    - **Images in packed rows**: **1 type exact with images** (rope 1); 0 refused.
    - **Stock transformers** on the same packed rows leaks across sequence boundaries in 1 of the 2 causal-LM types.
    - Every type, backend and precision, with the reason for each refusal: [docs/support.md](docs/support.md).
    """
    table = load() if table is None else table
    causal, vision = table.get("types", {}), table.get("multimodal", {})

    def counts(entries: dict[str, Any]) -> tuple[int, list[str]]:
        refused = sorted(t for t, e in entries.items() if e.get("verdict") != "exact")
        return len(entries) - len(refused), refused

    def plural(n: int, word: str) -> str:
        return f"{n} {word}" if n == 1 else f"{n} {word}s"

    exact, refused = counts(causal)
    v_exact, v_refused = counts(vision)
    images = [e.get("images") or {} for s in (causal, vision) for e in s.values() if e.get("verdict") == "exact"]
    routes: dict[str, int] = {}
    for i in images:
        if i.get("verdict") == "exact":
            routes[str(i.get("route"))] = routes.get(str(i.get("route")), 0) + 1
    with_images = sum(routes.values())
    image_refused = sum(i.get("verdict") == "refused" for i in images)
    unproven = sum(i.get("verdict") == "not proven" for i in images)
    leaks = sum(e.get("stock") == "leaks" for e in causal.values())
    named = lambda names: f" ({', '.join(names)})" if names else ""  # noqa: E731
    lines = [
        f"- **Causal LMs**: {plural(len(causal), 'model type')} of transformers {table.get('transformers')} — "
        f"**{exact} exact**, {len(refused)} refused{named(refused)}.",
        f"- **Vision-language models**: {plural(len(vision), 'model type')} — **{v_exact} exact** on text rows, "
        f"{len(v_refused)} refused{named(v_refused)}.",
        f"- **Images in packed rows**: **{plural(with_images, 'type')} exact with images** "
        f"({', '.join(f'{r} {n}' for r, n in sorted(routes.items()))}); {image_refused} refused"
        + (f", {unproven} not proven" if unproven else "") + ".",
        f"- **Stock transformers** on the same packed rows leaks across sequence boundaries in {leaks} of the "
        f"{len(causal)} causal-LM types.",
        "- Every type, backend and precision, with the reason for each refusal: [docs/support.md](docs/support.md).",
    ]
    return "\n".join(lines)
