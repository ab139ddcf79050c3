"""Inkling2's block attention residuals, which mix no tokens (``families/depth``), and the refusal of rows past
Inkling2's log-scaling floor. (The three Inkling types are proven exact, every precision, by the support sweep; the
relative position bias and per-query sinks their attention hands the packed path: ``test_model_attention.py``.)"""

from __future__ import annotations

import pytest
import torch
import transformers

from padfree import InvalidLayoutError, PackingDisabledError, UnsupportedModelError
from padfree.model import configure, install
from padfree.model.configure import install_packing, unconfigure_packing
from padfree.model.state import packing_state
from padfree.proof.compare import FP32_TOL
from padfree.proof.tiny import build_tiny
from zoo import max_diff, packed_rows, run_packed, run_separately

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(model_type: str, variant: dict | None = None):
    """The sweep's tiny model, installed on eager; skipped where this transformers has no such type or another
    Inkling2 that padfree refuses for its dynamic convolutions (5.23: they no longer read seq_idx)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = build_tiny(model_type, variant)
    try:
        install_packing(model, backend="eager")
    except UnsupportedModelError as exc:
        if "DynamicShortConvolution" not in str(exc):
            raise
        pytest.skip(f"transformers {transformers.__version__}'s {model_type} is refused: {str(exc)[:120]}")
    return model


def test_the_block_residuals_run_as_transformers_runs_them(monkeypatch):
    """They read no other token; claimed by the depth family they run unpacked inside the packed forward, and
    without it the attention function finds no row in them and the model is refused."""
    model = _tiny("inkling2_text")
    report = packing_state(model).report
    claimed = [q for q, what in report.mixers.items() if what.startswith("attention over each token's own block")]
    assert claimed and not report.unsupported
    ids, pos, seqs = packed_rows([[9, 4, 13], [17, 8]])
    got, _ = run_packed(model, ids, pos, seqs, grad=False)
    unconfigure_packing(model)
    want, _ = run_separately(model, seqs)
    assert max_diff(got, want) <= FP32_TOL
    families = configure.families()
    kept = {k: v for k, v in families.items() if "AttentionResidual" not in k}
    monkeypatch.setattr(install, "families", lambda: kept)
    bare = build_tiny("inkling2_text")
    install_packing(bare, backend="eager")
    with pytest.raises(InvalidLayoutError, match="BlockAttentionResidual attention got inputs of shape"):
        run_packed(bare, ids, pos, seqs, grad=False)


def test_rows_past_the_log_scaling_floor_are_refused():
    """Inkling2's global layers scale queries and bias by log(position / floor) from the row's start: up to the
    floor nothing is scaled (exact), past it a sequence late in a row would be scaled by where it sits."""
    model = _tiny("inkling2_loop_text", {"log_scaling_n_floor": 24})
    short_ids, short_pos, short = packed_rows([[9, 4, 11]])  # 24 tokens: at the floor
    got, _ = run_packed(model, short_ids, short_pos, short, grad=False)
    ids, pos, seqs = packed_rows([[9, 4, 13]])  # 26 tokens
    with pytest.raises(PackingDisabledError, match=r"Inkling2LoopFullAttention scales its queries and position bias "
                                                   r".* log_scaling_n_floor=24: in a packed row of 26 tokens"):
        run_packed(model, ids, pos, seqs, grad=False)
    unconfigure_packing(model)
    want, _ = run_separately(model, short)
    assert max_diff(got, want) <= FP32_TOL


def test_a_block_residual_whose_forward_changed_is_refused_by_name():
    """The family claims only the classes it knows with the forward it was proven with (guards.proven_module)."""
    from padfree.model.families import depth

    name = next(iter(depth.CLASSES))

    class Unknown(torch.nn.Module):
        def forward(self, hidden_states):
            return hidden_states

    changed = type(name, (torch.nn.Module,), {"forward": lambda self, hidden_states, extra=None: hidden_states})
    with pytest.raises(UnsupportedModelError, match="Unknown is not a module padfree's depth family knows"):
        depth.install(Unknown(), None)
    with pytest.raises(UnsupportedModelError, match=rf"{name}\.forward takes \('self', 'hidden_states', 'extra'\), "
                                                    r"not the .* padfree proved"):
        depth.install(changed(), None)
