"""What kind of model a ``PreTrainedModel`` is, for the one question packing asks first: is it a causal LM?

Packing puts several sequences into one row of a causal language model. transformers' causal-LM mapping lists the
classes that are one (``*ForCausalLM``, a few ``*LMHeadModel`` and multimodal ``*ForConditionalGeneration`` entries
that generate text), and its image-text-to-text and multimodal-LM mappings the vision-language models around one
(``Qwen2VLForConditionalGeneration``, ``LlavaForConditionalGeneration``, ...); their base ``*Model`` (no head) is
accepted too. Whether packing can be made exact through one is the support table's question, not this one's.
Everything else is refused with a reason that says what the model is: an encoder-decoder (its decoder cross-attends
to a whole source sequence), a bidirectional encoder (every token sees every other token, so a row of several
sequences is one sequence to it), or a head that is not a language model (classification, question answering, ...).

>>> import transformers
>>> cfg = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
...                               intermediate_size=32)
>>> print(not_a_causal_lm(transformers.BertForSequenceClassification(cfg)))  # doctest: +ELLIPSIS
BertForSequenceClassification is a bidirectional encoder with a sequence-classification head: ...
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["not_a_causal_lm"]

_HEADS = {
    "SequenceClassification": "a sequence-classification head",
    "TokenClassification": "a token-classification head",
    "QuestionAnswering": "a question-answering head",
    "MultipleChoice": "a multiple-choice head",
    "MaskedLM": "a masked-language-modelling head",
    "PreTraining": "a pre-training head",
    "NextSentencePrediction": "a next-sentence head",
}


def not_a_causal_lm(model: Any) -> str | None:
    """None when ``model`` is a causal LM packing applies to; else why not, naming what the model is."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    config = model.config
    name, model_type = type(model).__name__, str(getattr(config, "model_type", ""))
    mappings = generating_mappings()
    causal = {cls for mapping in mappings for cls in _names(mapping.values())}
    base = any(model_type in mapping for mapping in mappings) and MODEL_MAPPING_NAMES.get(model_type) == name
    accepted = name in causal or base or _causal_subclass(type(model), causal)
    # a *ForCausalLM of an encoder-decoder family (BartForCausalLM, ...) is decoder-only by construction
    if accepted and (not getattr(config, "is_encoder_decoder", False) or name.endswith("ForCausalLM")):
        return None
    if getattr(config, "is_encoder_decoder", False):
        return (f"{name} is an encoder-decoder model: its decoder cross-attends to a whole encoded source sequence, "
                f"so several (source, target) pairs cannot share a row; padfree packs decoder-only causal LMs "
                f"(train this model unpacked, or its decoder alone as a *ForCausalLM where transformers has one)")
    head = next((what for key, what in _HEADS.items() if key in name), None)
    if head is not None:
        kind = "a bidirectional encoder" if not getattr(config, "is_decoder", True) or re.search(
            r"Bert|Roberta|Electra|Xlm|XLM|Deberta|Albert|Ernie|MPNet|Funnel|Rem", name) else "a model"
        return (f"{name} is {kind} with {head}: packing applies to causal language models that predict the next "
                f"token, not to this head")
    return (f"{name} is not a causal language model of transformers' causal-LM, image-text-to-text or multimodal-LM "
            f"mappings (a *ForCausalLM, a vision-language *ForConditionalGeneration, or its base *Model): packing "
            f"does not apply to it")


def generating_mappings() -> tuple[dict[str, Any], ...]:
    """transformers' mappings of the models that generate text token by token: causal LMs, and the vision-language
    (and other multimodal) models whose language model is one — model type -> class name(s)."""
    from transformers.models.auto import modeling_auto

    names = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
             "MODEL_FOR_VIDEO_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES")
    return tuple(getattr(modeling_auto, n) for n in names if hasattr(modeling_auto, n))


def _names(values: Any) -> list[str]:
    out: list[str] = []
    for value in values:  # a mapping value may be a tuple of class names
        out += [value] if isinstance(value, str) else list(value)
    return out


def _causal_subclass(cls: type, causal: set[str]) -> bool:
    """A user's subclass of a causal-LM class (registered under its own model type, or not registered at all)."""
    return any(base.__name__ in causal and base.__module__.startswith("transformers.") for base in cls.__mro__[1:])

