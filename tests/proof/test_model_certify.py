"""On-the-spot certification: models the support table does not cover are proven on a tiny twin, or refused.

Real transformers classes throughout: a LlamaForCausalLM subclass registered under a model type of its own (not in
the table, exact: accepted), the same with an attention module that computes its own causal mask over the whole row
(leaks: refused, naming the module), and the cache that makes a certified class free the second time.
"""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

import padfree
from padfree import UnsupportedModelError, configure_packing
from padfree.proof import certify, registry, versions
from padfree.proof.shrink import shrink_config

pytestmark = pytest.mark.usefixtures("one_thread")


class CertLlamaConfig(transformers.LlamaConfig):
    model_type = "padfree_cert_llama"


class CertLlamaForCausalLM(transformers.LlamaForCausalLM):
    config_class = CertLlamaConfig


class RowCausalAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Attention that ignores transformers' attention interface and masks causally over the whole row: in a packed
    row every sequence sees the ones before it."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        b, t, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = position_embeddings
        q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), None


class RowMaskConfig(transformers.LlamaConfig):
    model_type = "padfree_cert_rowmask"


class RowMaskForCausalLM(transformers.LlamaForCausalLM):
    config_class = RowMaskConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = RowCausalAttention(config, i)


@pytest.fixture(scope="module", autouse=True)
def registered():
    for cfg, cls in ((CertLlamaConfig, CertLlamaForCausalLM), (RowMaskConfig, RowMaskForCausalLM)):
        transformers.AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
        transformers.AutoModelForCausalLM.register(cfg, cls, exist_ok=True)


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PADFREE_CACHE_DIR", str(tmp_path / "cache"))
    certify._MEMORY.clear()


def _model(cls, cfg_cls, seed=0):
    torch.manual_seed(seed)
    base = transformers.LlamaConfig()  # a 7B-class config: the twin is shrunk from it
    return cls(shrink_config(cfg_cls(**{k: v for k, v in base.to_dict().items() if k != "model_type"})))


def test_a_registered_llama_subclass_is_certified_and_accepted(caplog):
    caplog.set_level(logging.INFO, logger="padfree")
    model = _model(CertLlamaForCausalLM, CertLlamaConfig)
    assert model.config.model_type not in registry.load()["types"]
    report = configure_packing(model)
    # why the table does not cover it: the type is unknown to it, or (on another transformers) the whole table
    assert report.supported and re.match(r"certified on the spot \((model type 'padfree_cert_llama' is not in the "
                                         r"support table|the support table was proven on transformers )", report.proof)
    assert "packed vs per-sequence on padfree_sdpa/fp32" in report.proof and "guards hold" in report.proof
    assert "certifying it on the spot" in caplog.text and "certified on the spot" in caplog.text
    verdict = padfree.verify(model, [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]])  # and it is exact
    assert verdict.ok


def test_configuring_inside_autocast_certifies_in_fp32():
    """A user who configures inside ``torch.autocast`` (a training loop's context): the twin's fp32 reference and
    fp32 check run in fp32, not in the caller's bf16 (which refused exact models: 1.9e-03 off in "fp32")."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        verdict = certify.certify(_model(CertLlamaForCausalLM, CertLlamaConfig), "padfree_sdpa", cache=False)
    assert verdict.ok, verdict.reason


def test_a_certified_class_is_not_checked_again(monkeypatch):
    model = _model(CertLlamaForCausalLM, CertLlamaConfig)
    configure_packing(model)
    certify._MEMORY.clear()  # a new process: only the disk cache remains
    calls = []
    monkeypatch.setattr("padfree.proof.compare.prove", lambda *a, **k: calls.append(1))
    report = configure_packing(_model(CertLlamaForCausalLM, CertLlamaConfig, seed=1))
    assert report.supported and "(cached in" in report.proof and not calls


def test_attention_with_its_own_row_causal_mask_is_refused_naming_the_module():
    model = _model(RowMaskForCausalLM, RowMaskConfig)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.self_attn: a tiny twin of its class and "
                                                    r"config is not packing-exact: packed differs"):
        configure_packing(model)
    assert padfree.model.configure.packing_state(model) is None  # strict: nothing left installed
    with warnings.catch_warnings(record=True) as caught:  # strict=False keeps its meaning: warn, configure anyway
        warnings.simplefilter("always")
        report = configure_packing(model, strict=False)
    assert not report.supported and "model.layers.0.self_attn" in report.unsupported
    assert any("strict=False: configured anyway" in str(w.message) for w in caught)
    assert padfree.model.configure.packing_state(model) is not None


def test_a_transformers_version_outside_the_tested_range_certifies_and_warns(monkeypatch, caplog):
    """The table is trusted only on the transformers it was proven on; outside the tested range a warning, once."""
    caplog.set_level(logging.INFO, logger="padfree")
    versions.warn_if_untested.cache_clear()
    monkeypatch.setattr(versions, "version_span", lambda package="transformers": ((99, 0), (99, 1)))
    monkeypatch.setattr(registry, "installed", lambda package="transformers": "99.0.0")
    model = transformers.LlamaForCausalLM(shrink_config(transformers.LlamaConfig()))
    report = configure_packing(model)
    assert report.supported and "the support table was proven on transformers" in report.proof
    configure_packing(model)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "outside the range" in r.message]
    assert len(warned) == 1
    versions.warn_if_untested.cache_clear()


@pytest.mark.skipif(registry.load()["transformers"] != transformers.__version__,
                    reason="the shipped table is proven on another transformers (there, everything is certified)")
def test_the_table_covers_llama_without_certifying(monkeypatch):
    monkeypatch.setattr(certify, "certify", lambda *a, **k: pytest.fail("certified a covered model"))
    model = transformers.LlamaForCausalLM(shrink_config(transformers.LlamaConfig()))
    report = configure_packing(model)
    assert report.supported and report.proof.startswith("support table: LlamaForCausalLM proven exact by the sweep")


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_a_base_model_is_certified_through_the_causal_lm_around_it(model_type):
    """A backbone without a head (what a reward model's score head sits on) has no logits to compare: its twin is the
    causal LM of the same config, which runs exactly that backbone; a certification then says so by the base's name."""
    from padfree.proof.tiny import build_tiny

    base = build_tiny(model_type).base_model
    verdict = certify.certify(base, "padfree_sdpa", cache=False)
    assert verdict.ok, verdict
    assert f"a tiny twin of {type(base).__name__}" in verdict.how
