"""Prove packing is exact on your model: `configure_packing` + `verify` on real text.

A tiny Qwen3.5 (attention + GatedDeltaNet layers, whose recurrent state and short convolutions must restart at every
sequence) is built from a config with random weights; `verify` runs one packed step and one step per sequence on the
same weights and compares logits, loss and every gradient. Without `configure_packing` the same check fails.

    python examples/configure_and_verify.py [--model-type qwen3_5_text]
"""

import argparse
from pydoc_data.topics import topics

import padfree
from padfree.corpus import load_tokenizer
from padfree.proof.tiny import tiny_model

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model-type", default="qwen3_5_text")
args = parser.parse_args()

tokenizer = load_tokenizer()
texts = [topics[k] for k in ("assert", "break", "continue", "pass", "del", "global")]
seqs = [ids[: 12 + 9 * i] for i, ids in enumerate(tokenizer(texts)["input_ids"])]  # 12 ... 57 tokens
model = tiny_model(args.model_type, vocab_size=len(tokenizer))

try:  # stock transformers either leaks state across the boundaries or refuses packed rows on the CPU
    before = padfree.verify(model, seqs, capacity=80)
    print(f"unconfigured: max |logit diff| {before.max_logit_diff:.1e} -> {'exact' if before.ok else 'LEAKS'}")
except ValueError as exc:
    print(f"unconfigured: transformers refuses: {str(exc).splitlines()[0]}")

print(padfree.configure_packing(model))
after = padfree.verify(model, seqs, capacity=80)
print(after)
after.raise_for_mismatch()
