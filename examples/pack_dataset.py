"""Pack a tokenized `datasets.Dataset` into full training rows with `padfree.pack_dataset`.

Real text (Python's own reference topics), a real offline tokenizer, one call: every sequence of the dataset is
packed at once (best fit decreasing), positions restart and labels never cross a boundary.

    python examples/pack_dataset.py [--capacity 1024]
"""

import argparse
from pydoc_data.topics import topics

import datasets

import padfree
from padfree.corpus import load_tokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--capacity", type=int, default=1024)
args = parser.parse_args()

tokenizer = load_tokenizer()  # mistral-common's 32k SentencePiece model, no download
texts = datasets.Dataset.from_dict({"text": list(topics.values())})
tokenized = texts.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

plan = padfree.plan_dataset(tokenized, capacity=args.capacity, overlong="split")
packed = padfree.pack_dataset_from_result(plan, tokenized)

print(packed)
print(f"{len(tokenized)} sequences -> {packed.num_rows} rows of {args.capacity} tokens, "
      f"efficiency {plan.efficiency:.2%} (lower bound {plan.lower_bound} rows)")
print("sequences in the last rows:", [len(lens) for lens in packed[-5:]["seq_lens"]])
