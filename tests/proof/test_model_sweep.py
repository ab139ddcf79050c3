"""The support sweep: every causal-LM type of the installed transformers, proven packing-exact or refused.

For each entry of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny model is built from its config class's defaults
(shrunk) and :func:`padfree.proof.sweep.sweep_type` proves it: a packed training step — the forward with ``labels=``,
the model's own loss from them, its backward — against every sequence alone on ``sdpa`` and ``eager`` in fp32
(logits, loss, every gradient within 1e-5), on ``sdpa`` under ``autocast_bf16`` and with ``bf16``
weights (within three times what rounding moves the per-sequence run), each with a leaking negative control that must
exceed the tolerance; an ordinary padded batch must be unchanged by configuring. A type padfree cannot make exact is
refused with the module and the reason.

The table padfree ships (``src/padfree/proof/support.json``, read by ``configure_packing``) and the support tables of
``docs/support.md`` are what this sweep found: a plain run fails when they are stale; ``PADFREE_UPDATE_DOCS=1 pytest
tests/proof/test_model_sweep.py -p no:xdist`` rewrites both (with ``-k``, only the entries of the types that ran).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from padfree.proof import registry
from padfree.proof.sweep import sweep_type
from padfree.proof.tiny import multimodal_types

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "src" / "padfree" / "proof" / "support.json"
SUPPORT_DOC = ROOT / "docs" / "support.md"
TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
MULTIMODAL = sorted(multimodal_types())
UPDATE = os.environ.get("PADFREE_UPDATE_DOCS") == "1"
RESULTS: dict[str, dict] = {}
MULTIMODAL_RESULTS: dict[str, dict] = {}

pytestmark = pytest.mark.usefixtures("one_thread")


def _comparable(entry: dict | None) -> dict | None:
    """What must not change between the shipped table and a rerun (timings and measured numbers may)."""
    if entry is None:
        return None
    keep = ("verdict", "class", "base_class", "backends", "variants", "mixers", "stock", "reason", "module", "failed",
            "blind")
    return {**{k: entry.get(k) for k in keep}, "images": _images_comparable(entry.get("images"))}


def _images_comparable(images: dict | None) -> dict | None:
    """The images' proof without what the CPU's bf16 kernels decide: the route, the verdict and fp32 exactly, and
    which reduced precisions were tried — not whether each met its rounding bound, nor the measured numbers. With
    images a bf16 autocast run lands within a hair of its bound on some types (a loss 9.4e-05 against 9.3e-05), and
    CPUs with native bf16 instructions (avx512_bf16) round differently from those that emulate them, so the same code
    proves it on one machine and misses by a hair on another."""
    if not isinstance(images, dict):
        return images
    precisions, unproven = images.get("precisions", []), images.get("unproven", {})
    out = {k: v for k, v in images.items() if k not in ("precisions", "unproven")}
    return {**out, "fp32": "fp32" in precisions, "tried": sorted(set(precisions) | set(unproven))}


@pytest.mark.parametrize("model_type", TYPES)
def test_every_causal_lm_type_is_exact_or_refused_with_a_reason(model_type):
    entry = sweep_type(model_type)
    RESULTS[model_type] = entry
    assert entry["verdict"] in ("exact", "refused")
    if entry["verdict"] == "exact":
        assert entry["backends"] and entry["variants"], entry
        precisions = {p for ps in entry["backends"].values() for p in ps}
        missing = {"fp32", "autocast_bf16", "bf16"} - precisions
        unrunnable = {key.split("/")[-1] for key in entry.get("unrunnable", {})}
        assert "fp32" in precisions and missing <= unrunnable, (entry["backends"], entry.get("unrunnable"))
    else:
        assert entry["reason"] and entry["module"], entry
    if not UPDATE and registry.load()["transformers"] == transformers.__version__:  # (make test-floor: no table)
        shipped = registry.load()["types"].get(model_type)
        assert _comparable(shipped) == _comparable(entry), (
            f"src/padfree/proof/support.json is stale for {model_type}: rerun with PADFREE_UPDATE_DOCS=1")


@pytest.mark.parametrize("model_type", MULTIMODAL)
def test_every_vision_language_class_is_exact_on_text_rows_or_refused_with_a_reason(model_type):
    """The image-text-to-text classes outside the causal-LM mapping (Qwen2-VL, LLaVA, Idefics3, ...; Qwen3.5's
    ForConditionalGeneration beside its ForCausalLM): the same proof on text-only packed rows, the vision and audio
    towers left on their own attention implementation."""
    entry = sweep_type(model_type, multimodal=True)
    MULTIMODAL_RESULTS[model_type] = entry
    assert entry["verdict"] in ("exact", "refused")
    if entry["verdict"] == "exact":
        assert entry["backends"] and entry["variants"], entry
        assert "fp32" in {p for ps in entry["backends"].values() for p in ps}, entry["backends"]
    else:
        assert entry["reason"] and entry["module"], entry
    if not UPDATE and registry.load()["transformers"] == transformers.__version__:
        shipped = registry.load().get("multimodal", {}).get(model_type)
        assert _comparable(shipped) == _comparable(entry), (
            f"src/padfree/proof/support.json is stale for {model_type} (multimodal): rerun with PADFREE_UPDATE_DOCS=1")


SECTIONS = {"types": ("support-table", TYPES, RESULTS), "multimodal": ("multimodal-table", MULTIMODAL,
                                                                       MULTIMODAL_RESULTS)}


def test_support_doc_tables_are_rendered_from_the_table():
    text = SUPPORT_DOC.read_text()
    if not UPDATE and registry.load()["transformers"] != transformers.__version__:
        pytest.skip("docs/support.md's table is the shipped one, proven on another transformers")
    if UPDATE and (RESULTS or MULTIMODAL_RESULTS):  # the types that ran replace their entries; gone types dropped
        shipped = registry.load()
        same = shipped["transformers"] == transformers.__version__
        table = {"transformers": transformers.__version__, "generated_by": "tests/proof/test_model_sweep.py"}
        for section, (_, types, results) in SECTIONS.items():
            kept = shipped.get(section, {}) if same else {}
            table[section] = {t: results.get(t, kept.get(t)) for t in types if t in results or t in kept}
        TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        registry.load.cache_clear()
    for section, (marker, _, _) in SECTIONS.items():
        begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
        block = f"{begin}\n{registry.markdown_table(section=section)}\n{end}"
        if UPDATE:
            text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _, b=block: b, text, flags=re.S)
        else:
            assert block in text, f"docs/support.md {marker} is stale: rerun with PADFREE_UPDATE_DOCS=1"
    if UPDATE:
        SUPPORT_DOC.write_text(text)


def test_the_table_covers_exactly_the_installed_types():
    table = registry.load()
    if table["transformers"] != transformers.__version__:
        pytest.skip(f"the shipped table is proven on transformers {table['transformers']}; on "
                    f"{transformers.__version__} configure_packing certifies every model on the spot")
    assert table["transformers"] == transformers.__version__
    assert sorted(table["types"]) == TYPES
    assert sorted(table.get("multimodal", {})) == MULTIMODAL
