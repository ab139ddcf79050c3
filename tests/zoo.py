"""Tiny random-weight causal LMs built from configs, one per model type, for the packed-vs-separate tests.

Every model has hidden size 64, 2 layers, 4 query heads over 2 key/value heads (GQA) and a vocabulary of 96; sliding
windows are 5 tokens so that sequences of 6+ tokens exercise them; MoE models get 4 experts, 2 per token.
Models with sequence mixers (:data:`MIXER_TYPES`) have 2-3 layers, mixer layers around an attention layer where the
model is hybrid: conv kernels of 4 taps, GatedDeltaNet chunks of 64 tokens, SSD chunks of 8.

The helpers at the end pack sequences of *any* length (1 included, which :func:`padfree.verify` does not take) into
rows and compare one packed forward/backward with every sequence run alone.
"""

from __future__ import annotations

import torch
import transformers

from padfree.proof import tiny as library
from padfree.proof.tiny import TINY_CONFIGS, VOCAB, build

# hybrids: attention layers (sdpa / eager) and sequence mixers; SSM_TYPES: sequence mixers only, no attention
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lfm2", "lfm2_moe", "bamba",
                "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2", "jamba")
SSM_TYPES = ("mamba", "mamba2", "falcon_mamba")
MIXER_TYPES = HYBRID_TYPES + SSM_TYPES
ATTENTION_TYPES = tuple(t for t in TINY_CONFIGS if t not in MIXER_TYPES)
# granitemoehybrid is a hybrid (HYBRID_TYPES): its tiny model has attention and Mamba-2 layers


def tiny_model(model_type: str, *, seed: int = 0, attn: str | None = None, **overrides
               ) -> transformers.PreTrainedModel:
    """:func:`padfree.proof.tiny.tiny_model` (the configs and the builder live in the library: ``padfree verify``
    builds the same models), with attention ``attn`` (default: sdpa, eager where transformers has no SDPA path, none for
    :data:`SSM_TYPES`)."""
    return library.tiny_model(model_type, seed=seed, attn_implementation=attn, **overrides)


def vocab_llama(vocab: int) -> transformers.LlamaForCausalLM:
    """A tiny llama (hidden 32, 2 layers, 4 heads over 2 key/value heads) over a real tokenizer's ``vocab``, seed 0:
    the trainer tests' model."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return build(config, seed=0)


class ToyRecurrentMixer(torch.nn.Module):
    """A stateful token mixer no padfree family knows: a running sum over the row, which would carry across the
    sequences of a packed row. Put into a real model, it makes that model one padfree must refuse."""

    def forward(self, x):
        return x.cumsum(dim=1)


def with_unknown_mixer(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``model`` (a llama-style causal LM) with its first MLP replaced by a :class:`ToyRecurrentMixer`."""
    model.model.layers[0].mlp = ToyRecurrentMixer()
    return model


def mistral_tokenizer(folder) -> transformers.PreTrainedTokenizerBase:
    """mistral-common's 32k SentencePiece model (Mistral 7B v0.1) through ``transformers``, offline: converted once per
    process by ``LlamaTokenizer`` into a ``tokenizer.json`` in ``folder`` (a test's own directory, so no user cache is
    written), and loaded from that file as the fast tokenizer (:func:`mistral_tokenizer_from`)."""
    import shutil
    from pathlib import Path

    import mistral_common

    converted = _CONVERTED.get("folder")
    if converted is None or not (converted / "tokenizer.json").is_file():
        converted = Path(folder)
        shutil.copy(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", converted / "tokenizer.model")
        transformers.LlamaTokenizer.from_pretrained(str(converted)).save_pretrained(str(converted))
        _CONVERTED["folder"] = converted
    return mistral_tokenizer_from(converted)


def mistral_tokenizer_from(folder) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer :func:`mistral_tokenizer` converted into ``folder`` (its ``name_or_path``), loaded again (in a
    rank's process, say).

    The same tokenizer as the converting ``LlamaTokenizer`` (the same ids and special tokens), in the class that holds
    it in the ``tokenizers`` backend only: ``datasets`` fingerprints every ``map`` by pickling its arguments, TRL's
    trainers pass the tokenizer to several maps each, and the converting class keeps the 32k vocabulary and its
    merges as Python objects too, which dill's pure-Python pickler takes 0.6 s to hash each time (about 5 s per TRL
    trainer built) against 0.03 s here."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


_CONVERTED: dict = {}  # "folder": where this process converted the SentencePiece model


def sequences(lengths: list[int], seed: int = 1) -> list[list[int]]:
    """Random token ids (never 0, the padding id) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


# 3 sequences of different lengths per row, 2 rows, most longer than the window of 5
LENGTHS = [9, 8, 7, 6, 5, 3]  # packs (obfd, capacity 20) into rows [9, 8, 3] and [7, 6, 5] + 2 padding
CAPACITY = 20


# ---- packed rows of sequences of any length, and the per-sequence reference ---------------------------------------

# per row: a length-1 sequence, sequences shorter than the conv kernel (4), one crossing the 64-token GatedDeltaNet
# chunk and many 8-token SSD chunks; the second row ends in a filler run (a segment of its own)
MIXER_ROWS = [[1, 3, 70, 9], [2, 40, 30, 11]]


def packed_rows(rows: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(input_ids, position_ids, [(row, start, ids)])``: random sequences of these lengths packed into rows."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos = torch.zeros_like(ids)
    seqs = []
    for b, row in enumerate(rows):
        col = 0
        for n in row:
            s = torch.randint(3, VOCAB, (n,), generator=g)
            ids[b, col:col + n], pos[b, col:col + n] = s, torch.arange(n)
            seqs.append((b, col, s))
            col += n
        pos[b, col:] = torch.arange(width - col)  # a trailing filler run is a segment of its own
    return ids, pos, seqs


def packed_case(vocab: int, rows: list[list[int]], seed: int = 0, *, filler: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """``(ids, position_ids, [(row, start, length)])``: random sequences of these lengths (ids in ``[3, vocab)``)
    packed into rows; a row shorter than the widest, plus ``filler`` more tokens, ends in a filler run (a segment of
    its own, never compared)."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in rows) + filler
    ids = torch.randint(3, vocab, (len(rows), width), generator=g)
    pos = torch.zeros_like(ids)
    spans = []
    for r, lengths in enumerate(rows):
        col = 0
        for n in lengths:
            pos[r, col:col + n] = torch.arange(n)
            spans.append((r, col, n))
            col += n
        pos[r, col:] = torch.arange(width - col)
    return ids, pos, spans


def alone_logits(model, ids, spans, **kwargs) -> list[torch.Tensor]:
    """The logits of every span of ``ids`` run alone (no grad)."""
    with torch.no_grad():
        return [model(input_ids=ids[r:r + 1, s:s + n], use_cache=False, **kwargs).logits[0] for r, s, n in spans]


def worst_diff(packed, spans, alone) -> float:
    """The largest ``|packed - alone|`` over the spans of a packed ``(B, T, V)`` output."""
    return max(float((packed[r, s:s + n] - a).abs().max()) for (r, s, n), a in zip(spans, alone, strict=True))


def loss_of(logits_of_seq, seqs, total):
    """Token-mean next-token cross-entropy over every sequence (the same normaliser packed and alone)."""
    loss = 0.0
    for (_, _, s), logits in zip(seqs, logits_of_seq, strict=True):
        if len(s) > 1:
            loss = loss + torch.nn.functional.cross_entropy(logits[:-1], s[1:], reduction="sum")
    return loss / total


def run_separately(model, seqs):
    """Logits of every sequence run alone and the parameter gradients of the summed loss."""
    model.zero_grad()
    total = sum(len(s) - 1 for _, _, s in seqs)
    outs = []
    for _, _, s in seqs:
        logits = model(input_ids=s[None], use_cache=False).logits[0]
        if len(s) > 1:
            loss_of([logits], [(0, 0, s)], total).backward()
        outs.append(logits.detach())
    return outs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_packed(model, ids, pos, seqs, *, grad=True, **kwargs):
    """Per-sequence logits of one packed forward and the parameter gradients of its loss (none without ``grad``)."""
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    per_seq = [logits[b, start:start + len(s)] for b, start, s in seqs]
    grads = {}
    if grad:
        loss_of(per_seq, seqs, sum(len(s) - 1 for _, _, s in seqs)).backward()
        inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper prefixes every parameter name
        grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    return [x.detach() for x in per_seq], grads


def grads_of(model, loss) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of ``loss`` (the model's gradients zeroed first)."""
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def grad_diff(ga, gb) -> float:
    assert ga.keys() == gb.keys()
    return max(float((ga[k] - gb[k]).abs().max()) for k in ga)


# ---- one training step on samples of a multimodal model, alone and as one packed row ------------------------------


def span_loss(logits, ids, spans) -> torch.Tensor:
    """The token mean of next-token cross-entropy over ``spans`` (``(start, length)`` of each sample in row 0)."""
    total = sum(n - 1 for _, n in spans)
    return sum(torch.nn.functional.cross_entropy(logits[0, s:s + n - 1], ids[0, s + 1:s + n], reduction="sum")
               for s, n in spans) / total


def param_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def each_alone(model, samples):
    """Logits of every sample (a batch of one) run alone, concatenated, and the gradients of the token-mean loss of
    them all."""
    model.zero_grad()
    total = sum(s["input_ids"].shape[1] - 1 for s in samples)
    logits = []
    for s in samples:
        out = model(**s, use_cache=False).logits
        n = s["input_ids"].shape[1]
        (span_loss(out, s["input_ids"], [(0, n)]) * (n - 1) / total).backward()
        logits.append(out[0].detach())
    return torch.cat(logits), param_grads(model)


def packed_step(model, row, samples):
    """Logits of ``row`` (``samples`` packed side by side) and the gradients of its token-mean loss per sample."""
    spans, start = [], 0
    for s in samples:
        spans.append((start, s["input_ids"].shape[1]))
        start += s["input_ids"].shape[1]
    model.zero_grad()
    out = model(**row, use_cache=False).logits
    span_loss(out, row["input_ids"], spans).backward()
    return out[0].detach(), param_grads(model)


# two padded rows of segments whose lengths cover the edge cases of a chunked or convolutional scan: a 1-token
# segment, one longer than a 64-token chunk, and a padding run at each row's end (the second row's 11 tokens)
SCAN_ROWS = ((1, 3, 70, 9), (2, 40, 30))
SCAN_WIDTH = 83


def cut_inside_segments(lay, tokens):
    """A leaking stand-in for :func:`padfree.model.row_blocks.segment_blocks`: blocks every ``tokens`` tokens,
    wherever a sequence is, each then one sequence — a block's recurrent state runs across the boundaries inside
    it, and a sequence cut in two restarts mid-way."""
    import numpy as np

    from padfree.model.packed import PackedLayout

    total = int(lay.lengths.sum())
    seg, pos = lay.segment_ids.reshape(1, -1), lay.position_ids.reshape(1, -1)
    return [(a, min(a + tokens, total), PackedLayout(seg[:, a:a + tokens], pos[:, a:a + tokens],
                                                     np.array([min(tokens, total - a)]), lay.source))
            for a in range(0, total, tokens)]


def scan_layout():
    """The :class:`~padfree.model.packed.PackedLayout` of :data:`SCAN_ROWS`: positions restarting at every segment
    and at each row's padding run."""
    from padfree.model.packed import PackedLayout

    pos = torch.zeros(len(SCAN_ROWS), SCAN_WIDTH, dtype=torch.long)
    for row, lengths in enumerate(SCAN_ROWS):
        col = 0
        for n in (*lengths, SCAN_WIDTH - sum(lengths)):
            pos[row, col:col + n] = torch.arange(n)
            col += n
    return PackedLayout.from_position_ids(pos)


def scan_segments(lay) -> list[tuple[int, int, int]]:
    """``(row, start, length)`` of every segment of :func:`scan_layout`, the padding runs included."""
    out, flat = [], 0
    for n in lay.lengths.tolist():
        out.append((flat // SCAN_WIDTH, flat % SCAN_WIDTH, n))
        flat += n
    return out


def graph_nodes(tensor: torch.Tensor) -> list[str]:
    """The class names of every autograd node behind ``tensor`` (each node once, a name once per node that has it):
    what a structural test reads, e.g. that a path moves the row by ``IndexCopyBackward0`` and never
    ``IndexBackward0``, or how many ``SelectBackward0`` it holds."""
    seen, names, todo = set(), [], [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names
