"""The default tokenizer's chat template (:data:`padfree.corpus.CHAT_TEMPLATE`) and :func:`padfree.corpus.encode_chat`:
the assistant turns are the targets, prompts are not, and what cannot be rendered or masked is refused by name."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mistral_common")

from padfree import corpus
from padfree.errors import InvalidSampleError, TokenizerLoadError

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "6, of course."}]


@pytest.fixture(scope="module")
def tok():
    return corpus.load_tokenizer()


def targets(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask, strict=True) if m])


def test_the_default_tokenizer_carries_the_template(tok):
    assert tok.chat_template == corpus.CHAT_TEMPLATE
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == (
        "<s>[INST] Be brief.\n\nWhat is 2+2? [/INST] 4</s>[INST] And 3+3? [/INST] 6, of course.</s>")


def test_the_assistant_turns_are_the_only_targets(tok):
    out = corpus.encode_chat([CONVERSATION, CONVERSATION[1:3]], tok)
    assert out["input_ids"][0] == tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert targets(tok, out["input_ids"][0], out["assistant_masks"][0]) == "4</s> 6, of course.</s>"
    assert targets(tok, out["input_ids"][1], out["assistant_masks"][1]) == "4</s>"
    # a conversational prompt's own assistant turns (a few-shot example) are not targets; the completion's are
    out = corpus.encode_chat([CONVERSATION], tok, prompts=[CONVERSATION[:4]])
    assert targets(tok, out["input_ids"][0], out["assistant_masks"][0]) == "6, of course.</s>"


def test_what_cannot_be_rendered_or_masked_is_refused(tok):
    with pytest.raises(InvalidSampleError, match=r"conversation 1 cannot be rendered by the chat template \(.*"
                                                 r"accepts the roles system, user and assistant, got tool"):
        corpus.encode_chat([CONVERSATION, [{"role": "tool", "content": "x"}]], tok)
    plain = corpus.load_tokenizer()
    plain.chat_template = None
    with pytest.raises(TokenizerLoadError, match="has no chat template"):
        corpus.encode_chat([CONVERSATION], plain)
    plain.chat_template = corpus.CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    with pytest.raises(TokenizerLoadError, match="no {% generation %} markers".replace("{", r"\{")):
        corpus.encode_chat([CONVERSATION], plain)
