"""The Hugging Face Trainer with padfree: pack a tokenized dataset globally, train with `padfree.Trainer`.

`pack_for_trainer` packs every sequence at once (best fit decreasing) into unpadded rows; `PackedRowsCollator` lays
each batch out as one row with restarting `position_ids` and no attention mask; `padfree.Trainer` makes the model
exact on those rows and normalises the loss over every target token of the optimizer step.

    python examples/hf_trainer.py [--steps 5]
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
texts = datasets.Dataset.from_dict({"text": list(topics.values())})
tokenized = texts.map(lambda b: tokenizer(b["text"], truncation=True, max_length=1024), batched=True,
                      remove_columns=["text"])
rows = padfree.pack_for_trainer(tokenized, max_length=1024)

config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)

with tempfile.TemporaryDirectory() as out:
    train_args = transformers.TrainingArguments(
        out, max_steps=args.steps, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True)
    trainer = padfree.Trainer(model=model, args=train_args, train_dataset=rows,
                              data_collator=padfree.PackedRowsCollator())
    print(padfree.packing_status(trainer))
    trainer.train()
    print({k: round(v, 4) for k, v in trainer.state.log_history[-2].items() if isinstance(v, float)})
