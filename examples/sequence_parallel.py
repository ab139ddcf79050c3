"""One packed row split across ranks, exactly: `configure_packing(model, sequence_parallel=P)` on real text.

A tiny Qwen3.5 hybrid (attention + GatedDeltaNet layers) trains on one packed row of real text split across P gloo
processes on this machine: each rank holds a slice of the row (`split_for_sequence_parallel`), attention and the
GatedDeltaNet scans run over the whole row for 1/P of their heads, the short convolutions read the taps before each
slice. The gathered logits, the loss and the summed gradients are compared with one process running the whole row.
On a cluster, launch one process per GPU with torchrun instead of spawning them here.

    python examples/sequence_parallel.py [--ranks 2] [--model-type qwen3_5_text]
"""

import argparse
import os
import socket
import sys
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import padfree
from padfree.corpus import load_tokenizer
from padfree.proof.tiny import tiny_model
from padfree.step_loss import token_losses


def packed_row(tokenizer) -> dict:
    """Six Python reference entries, tokenized and packed back to back into one row (with -100 at each start)."""
    texts = [topics[k] for k in ("assert", "break", "continue", "pass", "del", "global")]
    seqs = [ids[: 20 + 11 * i] for i, ids in enumerate(tokenizer(texts)["input_ids"])]  # 20 ... 75 tokens
    batch = padfree.packed_collate_fn(capacity=sum(map(len, seqs)))(seqs)
    return {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "labels": batch.labels}


def step(model, batch, group=None):
    """Logits, loss and gradients of the token-mean loss: the whole row, or this rank's slice of it (group)."""
    if group is not None:
        batch = padfree.split_for_sequence_parallel(batch, group)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss, mask = token_losses(logits, batch)
    count = mask.sum().float()
    total = loss.sum()
    if group is not None:
        dist.all_reduce(count)  # the row's targets, counted over the group
    (total / count).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if group is not None:
        for g in grads.values():
            dist.all_reduce(g)  # each rank holds its slice's share of every gradient
        pieces = [torch.empty_like(logits) for _ in range(group)]
        dist.all_gather(pieces, logits.detach().contiguous())
        logits = torch.cat(pieces, dim=1)
        dist.all_reduce(total)
    return logits.detach(), float(total.detach() / count), grads


def rank_main(rank: int, ranks: int, port: int, model_type: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    tokenizer = load_tokenizer()
    batch = packed_row(tokenizer)
    model = tiny_model(model_type, vocab_size=len(tokenizer))  # the same seed: the same weights on every rank
    report = padfree.configure_packing(model, sequence_parallel=ranks)
    logits, loss, grads = step(model, batch, ranks)
    if rank == 0:
        print(report)
        whole = tiny_model(model_type, vocab_size=len(tokenizer))
        padfree.configure_packing(whole)
        want_logits, want_loss, want_grads = step(whole, batch)
        width = batch["input_ids"].shape[1]
        logit_diff = float((logits[:, :width] - want_logits).abs().max())
        grad_diff = max(float((grads[n] - want_grads[n]).abs().max()) for n in grads)
        print(f"one row of {width} tokens, {int((batch['position_ids'] == 0).sum())} sequences, split across "
              f"{ranks} ranks ({-(-width // ranks)} tokens each)")
        print(f"max |logit diff| {logit_diff:.1e}, loss {loss:.6f} vs {want_loss:.6f}, max |grad diff| "
              f"{grad_diff:.1e} -> {'exact' if max(logit_diff, grad_diff) <= 1e-5 else 'NOT EXACT'}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model-type", default="qwen3_5_text")
    args = parser.parse_args()
    # forked on Linux (the children start with torch imported), fresh interpreters elsewhere
    mp.start_processes(rank_main, args=(args.ranks, free_port(), args.model_type), nprocs=args.ranks,
                       start_method="fork" if sys.platform == "linux" else "spawn")
