"""TRL's RewardTrainer with padfree: `padfree.RewardTrainer` is a drop-in subclass.

TRL still tokenizes the preference pairs (prompt + chosen, prompt + rejected) and keeps its Bradley-Terry loss and
metrics; padfree runs the backbone of the sequence-classification reward model over each micro-batch's sequences as
one packed row (no padding, `position_ids` restarting per sequence), and the model's own `score` head pools each
sequence's last token exactly as it does for the padded batch.

    python examples/reward_trainer.py [--steps 5]
"""

import argparse
import tempfile
from pydoc_data.topics import topics

import datasets
import transformers

import padfree
from padfree.corpus import load_tokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

tokenizer = load_tokenizer()
# preference pairs from real text: the answer about the asked topic (chosen) against another topic's text (rejected),
# each cut to a different length so the pairs vary as real ones do
keys = sorted(topics)
dataset = datasets.Dataset.from_list(
    [{"prompt": f"What does the Python reference say about `{key}`?\n",
      "chosen": topics[key][:200 + 40 * (i % 7)],
      "rejected": topics[keys[(i + 1) % len(keys)]][:120 + 60 * (i % 5)]}
     for i, key in enumerate(keys)])
# the score head pools each sequence's last non-pad token, so it must know the pad id (TRL pads with eos if unset)
pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  num_labels=1, pad_token_id=pad_id)
model = transformers.LlamaForSequenceClassification(config)

with tempfile.TemporaryDirectory() as out:
    reward_args = padfree.RewardConfig(
        out, max_length=256, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        activation_checkpointing=False)
    trainer = padfree.RewardTrainer(model=model, args=reward_args, train_dataset=dataset, processing_class=tokenizer)
    print(padfree.packing_status(trainer))  # which mode, why, and the exact attention in use
    trainer.train()
    last = trainer.state.log_history[-2]
    print({k: v for k, v in last.items() if k.startswith("padfree/") or k in ("loss", "accuracy", "margin")})
