"""check_support: every backend configured and verified in turn; refusals and mismatches reported, not raised."""

from __future__ import annotations

import pytest

from padfree.errors import InvalidArgumentError
from padfree.model.support import BackendCheck, SupportRow, available_backends, check_support
from padfree.model.tiny import TINY_CONFIGS, tiny_config, tiny_model
from padfree.model.verify import verify
from zoo import with_unknown_mixer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_exact_backends_and_markdown_row():
    model = tiny_model("qwen2")  # sliding window 5 on layer 1: the windows cross packed boundaries
    row = check_support(model, backends=["sdpa", "eager", "auto"])
    assert row.ok and row.model_type == "qwen2"
    assert [c.backend for c in row.checks] == ["padfree_sdpa", "padfree_eager", "padfree_sdpa"]
    for c in row.checks:
        assert c.report.max_logit_diff <= 1e-5 and c.report.max_grad_diff <= 1e-5 and not c.forward_only
    assert row.markdown() == "| qwen2 | ✓ `padfree_sdpa` | ✓ `padfree_eager` | ✓ `padfree_sdpa` |"
    assert "exact on every backend that ran" in str(row)
    assert getattr(model, "_padfree_state", None) is None or not model.config._attn_implementation.startswith(
        "padfree")  # left unconfigured


def test_cuda_backends_are_reported_not_raised_on_cpu():
    row = check_support(tiny_model("llama"), backends=["sdpa", "varlen"])
    sdpa, varlen = row.checks
    assert sdpa.ok and varlen.report is None and "cuda" in varlen.error.lower() and varlen.cell == "—"
    assert row.ok  # what ran was exact
    assert "varlen" not in available_backends("cpu")


def test_a_model_configure_packing_refuses_is_a_refusal_with_its_reason():
    model = with_unknown_mixer(tiny_model("llama"))
    row = check_support(model, backends=["sdpa"])
    assert not row.ok and row.checks[0].report is None
    assert "ToyRecurrentMixer" in row.checks[0].error and "no backend could run here" in str(row)


def test_a_mismatch_is_a_failed_cell():
    """gpt_oss builds its masks without position_ids: unconfigured, its packed rows leak (a real mismatch)."""
    model = tiny_model("gpt_oss")
    report = verify(model, [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23]])
    check = BackendCheck("eager", "eager", report)
    assert not check.ok and check.cell == "✗ mismatch"
    row = SupportRow("gpt_oss", [check], {})
    assert not row.ok and "NOT exact" in str(row) and "MISMATCH" in str(row)


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="backends must be"):
        check_support(tiny_model("llama"), backends=["cuda_magic"])
    with pytest.raises(InvalidArgumentError, match="backends must be"):
        check_support(tiny_model("llama"), backends=[])
    with pytest.raises(InvalidArgumentError, match="model_type='nope' has no tiny config"):
        tiny_config("nope")


def test_every_tiny_config_builds():
    for model_type in TINY_CONFIGS:
        assert tiny_config(model_type).model_type == model_type
