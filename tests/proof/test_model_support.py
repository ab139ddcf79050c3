"""check_support: every backend configured and verified in turn; refusals and mismatches reported, not raised."""

from __future__ import annotations

import pytest

from padfree.errors import InvalidArgumentError
from padfree.proof.backends import BackendCheck, SupportRow, available_backends, check_support
from padfree.proof.check import verify
from padfree.proof.tiny import TINY_CONFIGS, tiny_config, tiny_model
from zoo import with_unknown_mixer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_exact_backends_and_markdown_row():
    model = tiny_model("qwen2")  # sliding window 5 on layer 1: the windows cross packed boundaries
    row = check_support(model, backends=["sdpa", "eager", "auto"])
    assert row.ok and row.model_type == "qwen2" and row.auto_backend == "padfree_sdpa"
    assert [c.backend for c in row.checks] == ["padfree_sdpa", "padfree_eager", "padfree_sdpa"]
    assert [c.auto for c in row.checks] == [True, False, True]
    for c in row.checks:
        assert c.status == "exact" and c.report.max_logit_diff <= 1e-5 and c.report.max_grad_diff <= 1e-5
    assert row.markdown() == "| qwen2 | ✓ `padfree_sdpa` | ✓ `padfree_eager` | ✓ `padfree_sdpa` |"
    assert row.verdict == ("qwen2: exact — configure_packing picks padfree_sdpa here (backend='auto'); proven exact: "
                           "padfree_eager, padfree_sdpa")
    assert str(row).startswith(row.verdict)
    assert getattr(model, "_padfree_state", None) is None or not model.config._attn_implementation.startswith(
        "padfree")  # left unconfigured


def test_cuda_backends_are_reported_not_raised_on_cpu():
    row = check_support(tiny_model("llama"), backends=["sdpa", "varlen"])
    sdpa, varlen = row.checks
    assert sdpa.ok and varlen.report is None and "cuda" in varlen.error.lower() and varlen.cell == "—"
    assert varlen.status == "unavailable" and not varlen.auto
    assert row.ok  # what ran was exact
    assert "varlen" not in available_backends("cpu")


def test_a_model_configure_packing_refuses_is_a_refusal_with_its_reason():
    model = with_unknown_mixer(tiny_model("llama"))
    row = check_support(model, backends=["sdpa"])
    assert not row.ok and row.checks[0].report is None and row.checks[0].status == "refused"
    assert row.auto_backend is None and "ToyRecurrentMixer" in row.auto_error
    assert "ToyRecurrentMixer" in row.checks[0].error and "no backend could run here" in str(row)


def test_a_mismatch_is_a_failed_cell():
    """gpt_oss builds its masks without position_ids: unconfigured, its packed rows leak (a real mismatch)."""
    model = tiny_model("gpt_oss")
    report = verify(model, [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23]])
    check = BackendCheck("eager", "eager", report)
    assert not check.ok and check.cell == "✗ mismatch" and check.status == "not exact"
    row = SupportRow("gpt_oss", [check], {})
    assert not row.ok and "NOT exact" in str(row) and "NOT EXACT" in str(row)


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="backends must be"):
        check_support(tiny_model("llama"), backends=["cuda_magic"])
    with pytest.raises(InvalidArgumentError, match="backends must be"):
        check_support(tiny_model("llama"), backends=[])
    with pytest.raises(InvalidArgumentError, match="model_type='nope' has no tiny config"):
        tiny_config("nope")
    with pytest.raises(InvalidArgumentError, match=r"device must be .*'nonexistent'"):
        available_backends("nonexistent")


def test_every_tiny_config_builds():
    for model_type in TINY_CONFIGS:
        assert tiny_config(model_type).model_type == model_type


# ---- what configure_packing does with each backend here: exact, not exact, refused, unavailable ------------------


def test_flex_is_reported_refused_on_the_cpu_and_the_row_is_exact():
    """The default backends on the CPU: sdpa (auto's choice) and eager proven, flex_attention refused by
    configure_packing with its reason — no mismatch, the row is exact."""
    row = check_support(tiny_model("llama"))
    by_name = {c.requested: c for c in row.checks}
    assert list(by_name) == available_backends("cpu") == ["sdpa", "eager", "flex_attention"]
    flex = by_name["flex_attention"]
    assert flex.status == "refused" and flex.report is None and flex.cell == "refused"
    assert "is refused on the CPU" in flex.error and "backward" in flex.error
    assert by_name["sdpa"].auto and by_name["sdpa"].status == "exact" and not by_name["eager"].auto
    assert row.ok and row.auto_backend == "padfree_sdpa"
    assert row.verdict.startswith("llama: exact — configure_packing picks padfree_sdpa here")
    assert row.markdown() == "| llama | ✓ `padfree_sdpa` | ✓ `padfree_eager` | refused |"


def _report(model_type, atol):
    return verify(tiny_model(model_type), [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21, 22, 23]],
                  atol=atol)


def test_any_backend_configure_accepts_that_is_not_exact_fails_the_row():
    """Refused and unavailable backends never fail a row; a mismatch on a backend configure_packing accepts does,
    whether or not it is auto's choice (control: the same rows without the mismatch are exact)."""
    good, bad = _report("llama", 1e-5), _report("gpt_oss", 1e-5)  # gpt_oss unconfigured: its packed rows leak
    assert good.ok and not bad.ok
    exact = BackendCheck("sdpa", "padfree_sdpa", good, auto=True)
    refused = BackendCheck("flex_attention", None, None, error="refused on the CPU")
    unavailable = BackendCheck("varlen", None, None, error="runs on cuda only", unavailable=True)
    assert SupportRow("m", [exact, refused, unavailable], {}, "padfree_sdpa").ok
    mismatch = BackendCheck("eager", "padfree_eager", bad)
    row = SupportRow("m", [exact, mismatch, refused], {}, "padfree_sdpa")
    assert not row.ok and row.verdict == "m: NOT exact on padfree_eager, which configure_packing accepts here"
    auto_bad = SupportRow("m", [BackendCheck("sdpa", "padfree_sdpa", bad, auto=True)], {}, "padfree_sdpa")
    assert not auto_bad.ok and "NOT exact on padfree_sdpa (the backend configure_packing picks here)" in str(auto_bad)
    unchecked = SupportRow("m", [BackendCheck("eager", "padfree_eager", good)], {}, "padfree_sdpa")
    assert unchecked.ok and unchecked.verdict == ("m: exact on every backend checked (padfree_eager); "
                                                  "configure_packing picks padfree_sdpa here (not checked)")
