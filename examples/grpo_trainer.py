"""TRL's GRPOTrainer with padfree: `padfree.GRPOTrainer` is a drop-in subclass.

Generation, rewards, advantages and the loss stay TRL's; padfree changes the forward that scores the completions:
TRL pads each batch of prompt + completion (prompts on the left, completions on the right), while padfree runs the
real tokens of each micro-batch as one packed row, positions restarting at 0 per sequence as in generation, and hands
the per-token log-probs back in TRL's layout.

    python examples/grpo_trainer.py [--steps 5]
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
# prompts of real text, cut to varied lengths so TRL's padded batches would carry padding
dataset = datasets.Dataset.from_list(
    [{"prompt": f"Summarize the Python reference on `{key}`:\n{text[:80 + 50 * (i % 6)]}\nSummary:"}
     for i, (key, text) in enumerate(sorted(topics.items()))])


def reward_letter_e(completions, **kwargs):
    """A toy reward: how often the completion uses the letter "e"."""
    return [float(c.count("e")) for c in completions]


config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)

with tempfile.TemporaryDirectory() as out:
    grpo_args = padfree.GRPOConfig(  # a micro-batch: 2 prompts x 2 completions of at most 16 tokens
        out, max_completion_length=16, num_generations=2, per_device_train_batch_size=4, max_steps=args.steps,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        activation_checkpointing=False)
    trainer = padfree.GRPOTrainer(model=model, reward_funcs=reward_letter_e, args=grpo_args, train_dataset=dataset,
                                  processing_class=tokenizer)
    print(padfree.packing_status(trainer))  # which mode, why, and the exact attention in use
    trainer.train()
    last = trainer.state.log_history[-2]
    print({k: v for k, v in last.items() if k in ("loss", "reward", "completions/mean_length")})
    print("padfree forwards:", trainer.padfree_forwards)  # packed rows, real tokens, padded positions avoided
