"""TRL's DPOTrainer with padfree: `padfree.DPOTrainer` is a drop-in subclass.

TRL still tokenizes the preference pairs and keeps its loss, reference model and metrics; padfree runs each
micro-batch (every pair's chosen and rejected sequence) as one packed row with no padding (`--mode padding_free`),
or first packs the train set's pairs across the dataset into micro-batches of `packing_length` tokens
(`--mode packing`), weighing the loss so each optimizer step is still the mean over its pairs.

    python examples/dpo_trainer.py [--steps 5] [--mode padding_free|packing]
"""

import argparse
import copy
import tempfile
from pydoc_data.topics import topics

import datasets
import transformers

import padfree
from padfree.corpus import load_tokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--mode", choices=["padding_free", "packing"], default="padding_free")
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
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)
ref_model = copy.deepcopy(model)  # the frozen reference (else TRL would load one from the Hub by name)

with tempfile.TemporaryDirectory() as out:
    mode = {"packing": True, "packing_length": 512} if args.mode == "packing" else {"padding_free": True}
    dpo_args = padfree.DPOConfig(
        out, max_length=256, max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        activation_checkpointing=False, **mode)
    trainer = padfree.DPOTrainer(model=model, ref_model=ref_model, args=dpo_args, train_dataset=dataset,
                                 processing_class=tokenizer)
    print(padfree.packing_status(trainer))  # which mode, why, and the exact attention in use
    trainer.train()
    last = trainer.state.log_history[-2]
    print({k: v for k, v in last.items() if k.startswith(("padfree/", "rewards/")) or k == "loss"})
