"""The support matrix: for every supported model type and backend, a packed step equals the per-sequence steps.

Tiny random-weight models (tests/zoo.py), fp32. Attention-only types: two rows of three sequences of different
lengths (one row ends in padding); logits, loss and every parameter gradient within 1e-5 (``padfree.verify``).
Types with sequence mixers (hybrids and pure state-space models): two rows holding a length-1 sequence, sequences
shorter than the conv kernel, one crossing the GatedDeltaNet chunk and many SSD chunks, and a filler run; logits and
gradients within 1e-5 of every sequence run alone, and the same packed call without ``configure_packing`` leaks.
The README's support table is generated from these results: ``PADFREE_UPDATE_DOCS=1 pytest
tests/test_model_matrix.py`` rewrites it, and a plain run fails if the README no longer says what the run found.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import padfree
from padfree import configure_packing, verify
from padfree.model import mixers
from zoo import (
    ATTENTION_TYPES,
    CAPACITY,
    HYBRID_TYPES,
    LENGTHS,
    MIXER_ROWS,
    MIXER_TYPES,
    SSM_TYPES,
    grad_diff,
    max_diff,
    packed_rows,
    run_packed,
    run_separately,
    sequences,
    tiny_model,
)

README = Path(__file__).resolve().parents[1] / "README.md"
BACKENDS = ("sdpa", "eager")
FLEX_TYPES = ("llama", "qwen2", "gemma2")  # flex compiles per shape on CPU: a few types keep the suite fast
RESULTS: dict[tuple[str, str], str] = {}
MIXER_CELLS: dict[str, str] = {}
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", ATTENTION_TYPES)
def test_packed_equals_separate(model_type, backend):
    model = tiny_model(model_type)
    report = configure_packing(model, backend=backend)
    assert report.supported and report.model_type == model_type
    result = verify(model, sequences(LENGTHS), capacity=CAPACITY, atol=ATOL)
    assert result.rows == 2 and all(n == 3 for n in torch.bincount(torch.tensor([s.row for s in result.sequences])))
    result.raise_for_mismatch()
    assert result.max_grad_diff is not None and result.max_grad_diff <= ATOL
    RESULTS[model_type, backend] = report.backend
    if backend == "sdpa":  # "auto" resolves to a backend this matrix runs (on the CPU: the one "sdpa" gave)
        auto = configure_packing(model, backend="auto").backend
        assert auto == report.backend
        RESULTS[model_type, "auto"] = auto


@pytest.mark.parametrize("model_type", FLEX_TYPES)
def test_flex_packed_equals_separate_forward(model_type):
    """flex_attention has no backward on the CPU (torch): its packed forward is checked against the SDPA runs."""
    model = tiny_model(model_type)
    seqs = sequences(LENGTHS)
    configure_packing(model, backend="sdpa")
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s])).logits[0] for s in seqs]
        configure_packing(model, backend="flex_attention")
        packed = model(**batch.model_inputs(include_labels=False)).logits
    starts = batch.cu_seqlens[:-1].tolist()
    rows = torch.repeat_interleave(torch.arange(batch.input_ids.shape[0]), batch.seqs_per_row).tolist()
    row_start = {r: starts[rows.index(r)] for r in set(rows)}
    for i, sid in enumerate(batch.sequence_ids.tolist()):
        r, c, n = rows[i], starts[i] - row_start[rows[i]], len(seqs[sid])
        assert (packed[r, c:c + n] - alone[sid]).abs().max() <= ATOL
    RESULTS[model_type, "flex_attention"] = "padfree_flex (forward)"


def _mixer_cell(model, report) -> str:
    """The table cell of a model's sequence mixers: each kind, the implementation this run proved (the exact torch
    reference: no kernel runs on CPU tensors) and the kernels that serve it on CUDA."""
    families = {}
    for module in model.modules():
        info = module.__dict__.get("_padfree_mixer")
        if info is not None:
            families[info.family.name] = info.family
    assert families and len(report.mixers) == sum(
        1 for m in model.modules() if "_padfree_mixer" in m.__dict__)
    for description in report.mixers.values():  # what configure_packing says it selected, and why
        assert "exact torch" in description
        if not torch.cuda.is_available():
            assert "need a CUDA GPU, none here" in description
    cells = []
    for name, fam in sorted(families.items()):
        cuda = [] if fam.conv_kernel is None else [f"conv {mixers.kernel_name(fam.conv_kernel)}"]
        if fam.required != ("causal_conv1d_fn",):  # a scan besides the conv (short convolutions have none)
            scan = "reference (no kernel takes boundaries)" if fam.scan_kernel is None else mixers.kernel_name(
                fam.scan_kernel)
            cuda.insert(0, f"scan {scan}")
        cells.append(f"{name}: torch reference ✓ (CUDA: {', '.join(cuda)})")
    return "; ".join(cells)


MIXER_CASES = [(t, b) for t in HYBRID_TYPES for b in BACKENDS] + [(t, "auto") for t in SSM_TYPES]


@pytest.mark.parametrize(("model_type", "backend"), MIXER_CASES)
def test_mixer_models_packed_equals_separate(model_type, backend):
    """Hybrid and state-space types: packed == every sequence alone (a length-1 sequence and sequences shorter than
    the conv kernel included), in logits and every gradient; and the unconfigured packed call leaks (negative
    control: this test can fail)."""
    model = tiny_model(model_type, attn=None if model_type in SSM_TYPES else backend)
    ids, pos, seqs = packed_rows(MIXER_ROWS)
    alone, alone_grads = run_separately(model, seqs)
    if backend != "eager":
        leaky, _ = run_packed(model, ids, pos, seqs, grad=False)
        assert max_diff(leaky, alone) > 1e-4
    report = configure_packing(model, backend=backend)
    assert report.supported and not report.unsupported and report.mixers and report.model_type == model_type
    assert bool(report.attention_modules) == (model_type not in SSM_TYPES)
    out, grads = run_packed(model, ids, pos, seqs)
    assert max_diff(out, alone) <= ATOL
    assert grad_diff(grads, alone_grads) <= ATOL
    MIXER_CELLS[model_type] = _mixer_cell(model, report)
    RESULTS[model_type, backend] = report.backend
    if backend == "sdpa":
        auto = configure_packing(model, backend="auto").backend
        assert auto == report.backend
        RESULTS[model_type, "auto"] = auto


def test_negative_control_unconfigured_model_with_cache_leaks():
    """The same comparison without configure_packing, with the config's default use_cache=True, fails: the test
    above can see a leak."""
    model = tiny_model("llama")
    assert model.config.use_cache
    seqs = sequences(LENGTHS)
    batch = padfree.pack_result_to_tensors(padfree.pack_sequences([len(s) for s in seqs], CAPACITY), seqs)
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        second = seqs[batch.sequence_ids[1]]
        c = int(batch.seq_lens[0])
        alone = model(input_ids=torch.tensor([second])).logits[0]
    assert (packed[0, c:c + len(second)] - alone).abs().max() > 1e-2
    with pytest.raises(padfree.PackingMismatchError):
        verify(tiny_model("gpt_oss"), seqs, capacity=CAPACITY).raise_for_mismatch()  # builds masks without positions


def _table() -> str:
    cols = [*BACKENDS, "auto", "flex_attention"]
    lines = ["| model type | " + " | ".join(f"`{c}`" for c in cols) + " | sequence mixers | notes |",
             "|---" * (len(cols) + 3) + "|"]
    for mt in (*ATTENTION_TYPES, *MIXER_TYPES):
        cells = []
        for c in cols:
            got = RESULTS.get((mt, c))
            if mt in SSM_TYPES and c != "auto":
                cells.append("n/a")
            elif got == "none":
                cells.append("✓ (no attention)")
            else:
                cells.append("—" if got is None else ("✓ fwd" if "forward" in got else f"✓ `{got}`"))
        mix = MIXER_CELLS.get(mt, "—")
        lines.append(f"| {mt} | " + " | ".join(cells) + f" | {mix} | {padfree.SUPPORTED_MODEL_TYPES.get(mt, '')} |")
    legend = (
        "Hybrid and state-space rows: two rows holding a length-1 sequence, sequences shorter than the conv kernel, "
        "one crossing a 64-token GatedDeltaNet chunk and many 8-token SSD chunks; the backend columns are the "
        "attention layers' backend (`n/a`: the model has no attention); *sequence mixers* names the implementation "
        "this CPU run proved (the exact torch reference, boundaries reset per sequence) and the kernels "
        "`configure_packing` selects instead on CUDA when they import and run (any kernel failure falls back to the "
        "reference, and the report says so)."
    )
    return legend + "\n\n" + "\n".join(lines)


def test_readme_support_table_is_what_the_matrix_found():
    expected = (len(ATTENTION_TYPES) * (len(BACKENDS) + 1) + len(FLEX_TYPES)
                + len(HYBRID_TYPES) * (len(BACKENDS) + 1) + len(SSM_TYPES))
    if len(RESULTS) < expected:
        pytest.skip("the whole matrix must run first (this test reads its results)")
    table = _table()
    text = README.read_text()
    begin, end = "<!-- support-matrix:begin -->", "<!-- support-matrix:end -->"
    block = f"{begin}\n{table}\n{end}"
    if os.environ.get("PADFREE_UPDATE_DOCS") == "1":
        README.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S))
        return
    assert block in text, "README support table is stale: rerun with PADFREE_UPDATE_DOCS=1"
