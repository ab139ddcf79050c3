"""TRL's SFTTrainer with padfree: `padfree.SFTTrainer` is a drop-in subclass.

TRL still tokenizes (here a prompt-completion dataset, so only the completions are trained on); padfree packs the
whole tokenized dataset at once into rows of `max_length` tokens, makes the model exact on packed rows
(`configure_packing`), keeps the loss the token mean of every optimizer step, and logs packing telemetry.

    python examples/sft_trainer.py [--steps 5] [--mode packing|padding_free] [--max-length 1024]
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
parser.add_argument("--mode", choices=["packing", "padding_free"], default="packing")
parser.add_argument("--max-length", type=int, default=1024, help="tokens per packed row")
args = parser.parse_args()

tokenizer = load_tokenizer()
dataset = datasets.Dataset.from_list(
    [{"prompt": f"What does the Python reference say about `{key}`?\n", "completion": text[:3000]}
     for key, text in topics.items()])
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)

with tempfile.TemporaryDirectory() as out:
    sft_args = padfree.SFTConfig(
        out, max_length=args.max_length, max_steps=args.steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, activation_checkpointing=False, **{args.mode: True})
    trainer = padfree.SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer)
    print(padfree.packing_status(trainer))  # which mode, why, and the exact attention in use
    trainer.train()
    last = trainer.state.log_history[-2]
    print({k: v for k, v in last.items() if k.startswith("padfree/") or k == "loss"})
