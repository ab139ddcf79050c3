"""A plain PyTorch training loop on packed batches: `packed_collate_fn` + `configure_packing`.

Every loader batch of samples is packed into rows of `--capacity` tokens; the model is told where each sequence
starts (`position_ids` restart at 0) and computes exactly what it would compute for each sequence alone.

With `--fused` the loss is `padfree.causal_lm_loss`: the same number as `model(**inputs).loss`, computed without the
logits (the LM head and the cross-entropy fused, in chunks, over the positions that have a target).

    python examples/dataloader_training.py [--steps 5] [--capacity 512] [--fused]
"""

import argparse
from pydoc_data.topics import topics

import torch
import transformers
from torch.utils.data import DataLoader

import padfree
from padfree.corpus import load_tokenizer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--capacity", type=int, default=512)
parser.add_argument("--fused", action="store_true", help="padfree.causal_lm_loss instead of model(**inputs).loss")
args = parser.parse_args()

tokenizer = load_tokenizer()
texts = [t for t in topics.values() if t.strip()]
samples = [{"input_ids": ids[: args.capacity]} for ids in tokenizer(texts)["input_ids"]]

torch.manual_seed(0)  # the same weights and batch order every run
config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM(config)
print(padfree.configure_packing(model))  # exact packed attention, or a clear refusal

loader = DataLoader(samples, batch_size=16, shuffle=True,
                    collate_fn=padfree.packed_collate_fn(capacity=args.capacity))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
for step, batch in zip(range(args.steps), loader, strict=False):
    inputs = batch.model_inputs()  # input_ids, labels, position_ids (+ flash kwargs); no mask
    loss = padfree.causal_lm_loss(model, inputs) if args.fused else model(**inputs).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    real = int(batch.seq_lens.sum())
    print(f"step {step}: loss {loss.item():.3f}  {batch.input_ids.shape[0]} rows, {len(batch.seq_lens)} sequences, "
          f"{real / batch.input_ids.numel():.0%} real tokens")
