"""The support matrix: for every supported model type and backend, a packed step equals the per-sequence steps.

Tiny random-weight models (tests/zoo.py), fp32; two rows of three sequences of different lengths (one row ends
in padding); logits, loss and every parameter gradient within 1e-5 (``padfree.verify``). The README's support
table is generated from these results: ``PADFREE_UPDATE_DOCS=1 pytest tests/test_model_matrix.py`` rewrites it,
and a plain run fails if the README no longer says what the run found.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import padfree
from padfree import configure_packing, verify
from zoo import ATTENTION_TYPES, CAPACITY, LENGTHS, sequences, tiny_model

README = Path(__file__).resolve().parents[1] / "README.md"
BACKENDS = ("sdpa", "eager")
FLEX_TYPES = ("llama", "qwen2", "gemma2")  # flex compiles per shape on CPU: a few types keep the suite fast
RESULTS: dict[tuple[str, str], str] = {}
ATOL = 1e-5


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
    lines = ["| model type | " + " | ".join(f"`{c}`" for c in cols) + " | notes |",
             "|---" * (len(cols) + 2) + "|"]
    for mt in ATTENTION_TYPES:
        cells = []
        for c in cols:
            got = RESULTS.get((mt, c))
            cells.append("—" if got is None else ("✓ fwd" if "forward" in got else f"✓ `{got}`"))
        lines.append(f"| {mt} | " + " | ".join(cells) + f" | {padfree.SUPPORTED_MODEL_TYPES.get(mt, '')} |")
    return "\n".join(lines)


def test_readme_support_table_is_what_the_matrix_found():
    expected = len(ATTENTION_TYPES) * (len(BACKENDS) + 1) + len(FLEX_TYPES)
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
