"""ZAYA's compressed convolutional attention projection: packed equals every sequence alone, and the controls."""

from __future__ import annotations

import pytest
import torch

from padfree import PackingDisabledError, UnsupportedModelError
from padfree.model import configure, install
from padfree.model.configure import install_packing, packing_state, unconfigure_packing
from padfree.model.flight import forward_of
from padfree.model.packed import PackedLayout
from padfree.proof.compare import FP32_TOL, prove, stock_packed_diff
from padfree.proof.tiny import build_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def test_packed_equals_each_sequence_alone_in_every_precision():
    model = build_tiny("zaya")
    proof = prove(model, backends=["sdpa", "eager"], precisions={"sdpa": ("fp32", "autocast_bf16", "bf16")})
    assert proof.ok and not proof.blind, str(proof)
    assert "restarted at every sequence start" in install_packing(model).mixers["model.layers.0.self_attn.qkv_proj"]
    unconfigure_packing(model)


def test_the_same_comparison_sees_stock_transformers_leak():
    assert stock_packed_diff(build_tiny("zaya")) > 100 * FP32_TOL


def test_without_the_family_the_projection_is_refused_by_name(monkeypatch):
    families = configure.families()
    monkeypatch.setattr(install, "families", lambda: {k: v for k, v in families.items() if k != "ZayaCCAProjection"})
    with pytest.raises(UnsupportedModelError, match="ZayaCCAProjection carries state"):
        install_packing(build_tiny("zaya"))


def test_a_cache_reaching_the_projection_is_refused():
    model = build_tiny("zaya")
    install_packing(model)
    ids, pos = torch.randint(3, 90, (1, 6)), torch.tensor([[0, 1, 2, 0, 1, 2]])
    projection = model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        cache = model(input_ids=ids[:, :2], use_cache=True).cache
        hidden = torch.randn(1, 6, model.config.hidden_size)
        with forward_of(packing_state(model), PackedLayout.from_position_ids(pos)), \
                pytest.raises(PackingDisabledError, match="a cache"):
            projection(hidden, cache)
    unconfigure_packing(model)
