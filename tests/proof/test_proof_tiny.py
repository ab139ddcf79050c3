"""The one builder of tiny models (padfree.proof.tiny.build): every tiny model — the sweep's, certification's, the
hand-made ones, the test suite's — is drawn by it, with the same weights for the same seed whatever attention path
the class turned out to have."""

from __future__ import annotations

import pytest
import torch
import transformers

from padfree.errors import InvalidArgumentError
from padfree.proof import tiny
from zoo import vocab_llama


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_class_without_sdpa_falls_back_to_eager_with_the_weights_of_its_seed():
    config = tiny.tiny_config("gemma2")  # softcapping: transformers refuses sdpa for it
    fallen_back = tiny.build(config, seed=5)
    asked = tiny.build(config, seed=5, attn_implementation="eager")
    assert fallen_back.config._attn_implementation == "eager" and fallen_back.dtype == torch.float32
    assert _same_weights(fallen_back, asked)
    assert not _same_weights(fallen_back, tiny.build(config, seed=6))  # the seed draws the weights


def test_an_attention_path_the_class_lacks_is_refused_naming_the_argument():
    with pytest.raises(InvalidArgumentError, match=r"attn_implementation='sdpa' cannot build .*Gemma2"):
        tiny.build(tiny.tiny_config("gemma2"), attn_implementation="sdpa")


def test_the_hand_made_and_the_shrunk_tiny_models_are_the_builders_models():
    hand = tiny.tiny_model("mamba", seed=2)  # no attention at all
    assert type(hand).__name__ == "MambaForCausalLM" and hand.training
    assert _same_weights(hand, tiny.build(tiny.tiny_config("mamba"), seed=2))
    twin = tiny.build_tiny("llama", seed=1)
    assert not twin.training and twin.dtype == torch.float32
    from padfree.proof.compare import perturb
    from padfree.proof.shrink import default_config, shrink_config

    with tiny.quiet():
        config = shrink_config(default_config("llama"))
    assert _same_weights(twin, perturb(tiny.build(config, seed=1).eval(), seed=1))


def test_a_vision_language_class_is_built_by_the_same_builder():
    vlm = next(t for t in ("qwen2_vl", "gemma3", "llava") if t in tiny.multimodal_types())
    model = tiny.build_tiny(vlm, multimodal=True)
    assert type(model).__name__ == tiny.multimodal_types()[vlm]
    assert getattr(model.config, "vision_config", None) is not None


def test_the_trainer_tests_llama_comes_from_the_builder():
    model = vocab_llama(50)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    assert isinstance(model, transformers.LlamaForCausalLM) and model.config.vocab_size == 50
    assert _same_weights(model, tiny.build(config, seed=0))
