"""padfree's Hugging Face ``Trainer`` pieces: the loss rule (one optimizer step over 4 accumulated micro-batches of
packed rows moves every parameter exactly as the unpacked loss does), the telemetry, the collator and the dataset
helper, ``packing_status`` and ``enable`` — with the real ``transformers.Trainer``, real GSM8K records tokenized
offline with the Mistral 7B SentencePiece vocabulary, and a tiny random-weight llama on the CPU."""

from __future__ import annotations

import copy
import itertools
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
mistral_common = pytest.importorskip("mistral_common")

from padfree.errors import InvalidArgumentError, InvalidLayoutError, UnsupportedModelError  # noqa: E402
from padfree.integrations.enable import enable  # noqa: E402
from padfree.integrations.status import packing_status  # noqa: E402
from padfree.integrations.telemetry import PackingTelemetryCallback  # noqa: E402
from padfree.integrations.trainer import Trainer  # noqa: E402
from padfree.integrations.trainer_data import PackedRowsCollator, pack_for_trainer  # noqa: E402
from padfree.step_loss import count_loss_items, sequence_ids, token_losses  # noqa: E402
from realdata import gsm8k_records  # noqa: E402
from zoo import mistral_tokenizer, with_unknown_mixer  # noqa: E402

datasets.disable_progress_bars()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """GSM8K records as prompt (masked) + answer, at most 96 tokens each."""
    tok = mistral_tokenizer(tmp_path_factory.mktemp("spm"))
    out = []
    for r in gsm8k_records(64):
        prompt = tok(r["instruction"])["input_ids"][:60]
        answer = [*tok(r["output"], add_special_tokens=False)["input_ids"][: 96 - len(prompt) - 1], tok.eos_token_id]
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config)


def sgd_args(out, batch, **kwargs):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=4, max_steps=1,
        learning_rate=1.0, lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0, weight_decay=0.0,
        report_to="none", use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, **kwargs)


def reference_grads(model, seqs, mode):
    """The gradient of the unpacked loss: every sequence alone, Σ token losses / Σ targets (or the mean of the
    per-sequence means)."""
    model.zero_grad()
    total, count, means = 0.0, 0, []
    for s in seqs:
        loss, mask = token_losses(model(input_ids=torch.tensor([s["input_ids"]])).logits,
                                  {"labels": torch.tensor([s["labels"]])})
        total, count = total + loss.sum(), count + int(mask.sum())
        means.append(loss.sum() / mask.sum())
    (total / count if mode == "token" else torch.stack(means).mean()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def micro_batch_mean_grads(model, batches):
    """What a trainer that averages each micro-batch's own token mean over the accumulation steps would use."""
    model.zero_grad()
    losses = []
    for b in batches:
        loss, mask = token_losses(model(input_ids=b["input_ids"], position_ids=b["position_ids"]).logits, b)
        losses.append(loss.sum() / mask.sum())
    torch.stack(losses).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def update_diff(model, before, grads):
    return max(float((p.detach() - before[n] + grads[n]).abs().max()) for n, p in model.named_parameters())


def test_count_loss_items():
    unpacked = {"labels": torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])}  # right padding, no positions
    assert count_loss_items(unpacked) == (3, 2)  # the first token of a row is a label but never a target
    packed = {"labels": torch.tensor([[-100, 6, 7, -100, 9, -100]]),
              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]])}
    assert count_loss_items(packed) == (3, 2)
    prompt_only = {"labels": torch.tensor([[-100, -100, -100, -100, 9]]),
                   "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert count_loss_items(prompt_only) == (1, 1)  # a sequence without a target does not count
    shifted = {"shift_labels": torch.tensor([[6, 7, -100, 9, -100]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    assert count_loss_items(shifted) == (3, 2)


def test_a_step_count_below_one_per_rank_divides_as_it_is():
    """The loss rule divides by the step's count over the ranks, which is a fraction when the step has fewer
    sequences (or targets) than ranks: 1 sequence over 2 ranks is 0.5, not 1 (only an empty count is replaced)."""
    from padfree.step_loss import reduce_loss

    batch = {"labels": torch.tensor([[-100, 6, 7]]), "position_ids": torch.tensor([[0, 1, 2]])}
    loss, mask = torch.tensor([[0.5, 1.5]]), torch.tensor([[True, True]])
    assert float(reduce_loss(loss, mask, batch, "sequence", 0.5)) == pytest.approx(2.0)  # its mean 1.0, / 0.5
    assert float(reduce_loss(loss, mask, batch, "token", 0.5)) == pytest.approx(4.0)
    assert float(reduce_loss(loss * 0, mask & False, batch, "token", None)) == 0.0


def test_sequence_ids_split_at_row_starts_and_restarts_whatever_the_positions():
    """The loss rule reads positions unchecked (a check would sync every micro-batch): a sequence starts at every
    row start and every 0, also in positions that are no packing (left padding 1, 1, 0, 1, 2; a jump)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows, width = (int(v) for v in rng.integers(1, 6, size=2))
        pos = rng.integers(-1, 3, size=(rows, width))
        expected, seq = np.zeros((rows, width), np.int64), -1
        for r in range(rows):  # the rule, one token at a time
            for t in range(width):
                seq += t == 0 or pos[r, t] == 0
                expected[r, t] = seq
        assert sequence_ids(torch.from_numpy(pos)).tolist() == expected.tolist()
    assert sequence_ids(torch.tensor([1, 1, 0, 1, 2])).tolist() == [[0, 0, 1, 1, 1]]
    assert sequence_ids(None, torch.ones(2, 3)).tolist() == [[0, 0, 0], [1, 1, 1]]  # no positions: a row each


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_gradient_accumulation_4_packed_rows_equal_unpacked(samples, tmp_path, mode, caplog):
    """The issue's test: one optimizer step with gradient accumulation 4 over globally packed rows gives the
    parameter update of the unpacked loss (SGD, lr 1: the update is minus the gradient)."""
    caplog.set_level(logging.INFO, logger="padfree")
    seqs = samples[:24]
    for n in range(24, 40):  # a set of sequences that packs into a multiple of 4 rows: 4 full micro-batches
        rows = pack_for_trainer(datasets.Dataset.from_list(samples[:n]), max_length=160)
        if len(rows) % 4 == 0:
            seqs = samples[:n]
            break
    assert len(rows) % 4 == 0 and len(rows) < len(seqs)
    model = llama()
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=sgd_args(tmp_path, len(rows) // 4), train_dataset=rows,
                      data_collator=PackedRowsCollator(), padfree_loss=mode)
    status = packing_status(trainer)
    assert status.mode == "sample packing" and status.attention == "padfree_sdpa" and status.loss == mode
    assert "padfree: sample packing" in caplog.text
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == 4 and all(int((b["position_ids"] == 0).sum()) > 1 for b in batches)
    trainer.train()
    assert trainer.state.global_step == 1
    diff = update_diff(model, before, reference_grads(copy.deepcopy(reference), seqs, mode))
    assert diff <= 1e-5, diff
    if mode == "token":  # the test can tell: averaging each micro-batch's own mean moves the weights elsewhere
        wrong = update_diff(model, before, micro_batch_mean_grads(copy.deepcopy(reference), batches))
        assert wrong > 100 * max(diff, 1e-7), (wrong, diff)
    log = trainer.state.log_history[0]
    assert log["padfree/real_token_fraction"] == 1.0 and log["padfree/attention"] == "padfree_sdpa"
    assert log["padfree/sequences_per_row"] > 2 and 0 < log["padfree/attention_flops_saved"] < 1


def test_gradient_accumulation_4_padding_free_equal_unpacked(samples, tmp_path):
    """The same rule for padding-free batches of unpacked samples (each micro-batch flattened into one row)."""
    model = llama()
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=sgd_args(tmp_path, 3), train_dataset=datasets.Dataset.from_list(samples[:12]),
                      data_collator=PackedRowsCollator())
    assert packing_status(trainer).mode == "padding-free batching"
    trainer.train()
    assert update_diff(model, before, reference_grads(reference, samples[:12], "token")) <= 1e-5


@pytest.mark.parametrize(("packed", "mode"), [(True, "token"), (False, "token"), (True, "sequence")])
def test_fused_loss_gives_the_update_of_the_unpacked_loss(samples, tmp_path, packed, mode):
    """``padfree_fused_loss=True``: the LM head and the cross-entropy fused (no logits), the same SGD update as the
    unpacked reference over 4 accumulated micro-batches — packed rows or padding-free batches."""
    data = datasets.Dataset.from_list(samples[:16])
    rows = pack_for_trainer(data, max_length=160) if packed else data
    model = llama()
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=sgd_args(tmp_path, -(-len(rows) // 4)), train_dataset=rows,
                      data_collator=PackedRowsCollator(), padfree_fused_loss=True, padfree_loss=mode)
    seen = [list(map(int, b["position_ids"].flatten().eq(0).nonzero().flatten())) for b in
            trainer.get_train_dataloader()]
    assert len(seen) == 4
    trainer.train()
    assert update_diff(model, before, reference_grads(reference, samples[:16], mode)) <= 1e-5


def test_telemetry_on_padded_and_packed_batches():
    cb = PackingTelemetryCallback(pad_token_ids=(0,))
    padded = {"input_ids": torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1],
                                                                                                      [1, 1, 0, 0]]),
              "labels": torch.tensor([[5, 6, 7, 8], [5, 6, -100, -100]])}
    cb.observe(padded)
    m = cb.pop_metrics()
    assert m["padfree/real_token_fraction"] == 0.75 and m["padfree/sequences_per_row"] == 1.0
    assert m["padfree/attention_flops_saved"] == 0.0  # padded batching saves nothing against itself
    assert cb.pop_metrics() == {}  # counts start afresh after every log
    packed = packed_collate_rows()
    cb.observe(packed)
    cb.observe(packed)
    m = cb.pop_metrics()
    # rows [4, 2 | pad 2] and [3 | pad 5]: 9 real of 16 positions, 3 sequences in 2 rows; Σ len² = 29 vs 3 · 4²
    assert m["padfree/real_token_fraction"] == 9 / 16 and m["padfree/sequences_per_row"] == 1.5
    assert m["padfree/attention_flops_saved"] == pytest.approx(1 - 29 / 48)


def test_telemetry_reads_llama_factory_segment_masks():
    """A LLaMA-Factory integer mask (1, 2, 3 per sequence, 0 for padding) counts as the same packed rows written
    with restarting ``position_ids``: the same sequences, real tokens and Σ len², not one padded sequence per row."""
    rows = [[5, 9, 2], [16], [3, 3, 3, 1]]  # 16 positions a row; the last row ends in 6 padding tokens
    width = 16
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    pos, seg = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for b, lens in enumerate(rows):
        col = 0
        for k, n in enumerate(lens):
            ids[b, col:col + n] = torch.arange(n) + 10 * (k + 1)
            labels[b, col + 1:col + n] = ids[b, col + 1:col + n]
            pos[b, col:col + n], seg[b, col:col + n] = torch.arange(n), k + 1
            col += n
        pos[b, col:] = torch.arange(width - col)  # the padding tail, as padfree's collators count it
    by_positions, by_mask = PackingTelemetryCallback(), PackingTelemetryCallback()
    by_positions.observe({"input_ids": ids, "labels": labels, "position_ids": pos})
    by_mask.observe({"input_ids": ids, "labels": labels, "attention_mask": seg})
    by_mask.observe({"input_ids": ids, "labels": labels, "attention_mask": seg.to(torch.int32)})
    by_positions.observe({"input_ids": ids, "labels": labels, "position_ids": pos})
    want, got = by_positions.pop_metrics(), by_mask.pop_metrics()
    lens = [n for r in rows for n in r]
    squares = sum(n * n for n in lens)
    assert want["padfree/real_token_fraction"] == got["padfree/real_token_fraction"] == sum(lens) / (3 * width)
    assert want["padfree/sequences_per_row"] == got["padfree/sequences_per_row"] == len(lens) / 3
    saved = 1 - squares / (len(lens) * max(lens) ** 2)
    assert want["padfree/attention_flops_saved"] == pytest.approx(saved, rel=1e-12)
    assert got["padfree/attention_flops_saved"] == pytest.approx(saved, rel=1e-12)
    # ids need not count 1, 2, 3: only where they change matters; a 0/1 integer mask stays an ordinary batch
    by_mask.observe({"input_ids": ids, "attention_mask": torch.where(seg > 0, seg * 7 + 1, 0)})
    assert by_mask.pop_metrics()["padfree/attention_flops_saved"] == pytest.approx(saved, rel=1e-12)
    by_mask.observe({"input_ids": ids, "attention_mask": (seg > 0).long()})
    padded = by_mask.pop_metrics()
    assert padded["padfree/sequences_per_row"] == 1.0 and padded["padfree/attention_flops_saved"] == 0.0


def packed_collate_rows():
    from padfree.data.batch import packed_collate_fn

    return packed_collate_fn(8, return_dict=True)([[11, 12, 13, 14], [21, 22], [31, 32, 33]])


def test_collator_and_dataset_helper():
    rows = pack_for_trainer({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[-100, 2, 3], [4, 5],
                                                                                          [6, 7, 8, 9]]}, max_length=6)
    collate = PackedRowsCollator()
    full = collate([rows[0], rows[1]])
    # the Trainer drops seq_lens (not a forward argument): the boundaries come back from position_ids
    dropped = collate([{k: v for k, v in r.items() if k != "seq_lens"} for r in (rows[0], rows[1])])
    assert all(torch.equal(full[k], dropped[k]) for k in ("input_ids", "labels", "position_ids"))
    assert full["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert full["labels"].tolist() == [[-100, 7, 8, 9, -100, 5, -100, 2, 3]]
    for bad in (0, None, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="max_length must be an int >= 1"):
            pack_for_trainer({"input_ids": [[1, 2]]}, max_length=bad)


ACCEPTED_POSITIONS = r"; accepted: one position per input_ids token, restarting at 0 at every sequence"


@pytest.mark.parametrize(("position_ids", "why"), [
    ([0, 1, 5, 0], r"is not a packed row \(position_ids\[0, 2\] = 5 follows 1\)"),  # no count 0, 1, 2 inside
    (torch.tensor([0, 1, 5, 0]), r"is not a packed row \(position_ids\[0, 2\] = 5 follows 1\)"),
    ([0, 1, -1, 0], r"is not a packed row \(position_ids\[0, 2\] = -1 is negative\)"),
    ([1, 2, 3, 4], r"is not a packed row \(position_ids\[0, 0\] = 1, but a row starts a sequence at position 0\)"),
    ([0, 1, 2], r"has 3 entries but the sample has 4 tokens"),
    ([0, 1, 2, 3, 4], r"has 5 entries but the sample has 4 tokens"),
    ([[0, 1], [0, 1]], r"must be a 1-D sequence of integers, got shape \(2, 2\)"),
    ([0, 1, [2], 3], r"must be a 1-D sequence of integers, got a ragged nesting"),
    ([0.0, 1.0, 0.0, 1.0], r"must be a 1-D sequence of integers, got dtype float64"),
    ("0101", r"must be a 1-D sequence of integers, got type str"),
])
def test_collator_refuses_position_ids_that_are_not_a_packing(position_ids, why):
    """Positions are the boundaries of a row the Trainer stripped of seq_lens: read wrong, sequences would be
    glued together or cut apart, so anything that is not a packing is refused, naming the sample and the field."""
    collate = PackedRowsCollator()
    good = {"input_ids": [7, 8, 9], "position_ids": [0, 1, 0]}
    with pytest.raises(InvalidLayoutError, match=r"^samples\[1\]\['position_ids'\] = .*" + why + ACCEPTED_POSITIONS):
        collate([good, {"input_ids": [1, 2, 3, 4], "position_ids": position_ids}])
    # with seq_lens beside them the positions are still read, and must agree
    with pytest.raises(InvalidLayoutError, match=r"^samples\[1\]\['position_ids'\] = .*" + why):
        collate([{**good, "seq_lens": [2, 1]}, {"input_ids": [1, 2, 3, 4], "position_ids": position_ids,
                                                "seq_lens": [4]}])


def test_collator_position_ids_must_agree_with_seq_lens():
    collate = PackedRowsCollator()
    row = {"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 0, 1]}
    both, alone = collate([{**row, "seq_lens": torch.tensor([2, 2])}]), collate([row])
    assert all(torch.equal(both[k], alone[k]) for k in ("input_ids", "labels", "position_ids"))
    assert alone["labels"].tolist() == [[-100, 2, -100, 4]]
    with pytest.raises(InvalidLayoutError, match=r"samples\[0\]\['seq_lens'\] and samples\[0\]\['position_ids'\] "
                                                 r"disagree on where the sequences of the row start \(\[3, 1\] vs "
                                                 r"\[2, 2\]\)"):
        collate([{**row, "seq_lens": [3, 1]}])


@pytest.mark.parametrize("spelling", [
    {"seq_lens": [3, 2]}, {"seq_lengths": [3, 2]}, {"cu_seq_lens": [0, 3, 5]}, {"cu_seqlens": torch.tensor([0, 3, 5])},
    {"position_ids": [0, 1, 2, 0, 1]}, {"attention_mask": [1, 1, 1, 2, 2]},
], ids=lambda spelling: next(iter(spelling)))
def test_collator_reads_every_boundary_spelling_by_the_rule_of_every_collator(spelling):
    """PackedRowsCollator reads a row's boundaries as padfree.samples does (one rule for every collator): any
    spelling cuts the row; without one the row is one sequence (the negative control the checks catch)."""
    row = {"input_ids": [5, 6, 7, 8, 9], **spelling}
    batch = PackedRowsCollator()([row, {"input_ids": [3, 4]}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 4]]
    glued = PackedRowsCollator()([{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [3, 4]}])
    assert glued["position_ids"].tolist() != batch["position_ids"].tolist()
    with pytest.raises(InvalidLayoutError, match=r"samples\[0\]\['attention_mask'\]\[4\] = 0 marks padding"):
        PackedRowsCollator()([{**row, "attention_mask": [1, 1, 1, 1, 0]}])


def _spans(out, units, lengths):
    """``[(piece, start)]`` in the real-token stream of a collator's output. ``units[u]`` lists the pieces the
    collator was given as its ``u``-th sequence: one piece when it kept the boundaries, a whole row when not."""
    from padfree.data.batch import PackedBatch

    if isinstance(out, PackedBatch):
        order, starts = out.sequence_ids.tolist(), out.cu_seqlens[:-1].tolist()
    else:  # PackedRowsCollator: one row, the units in order
        order = list(range(len(units)))
        starts = np.cumsum([0] + [sum(lengths[k] for k in u) for u in units])[:-1].tolist()
    spans = []
    for u, start in zip(order, starts, strict=True):
        for k in units[u]:
            spans.append((k, start))
            start += lengths[k]
    return spans


def test_a_trl_packed_row_trains_exactly_through_every_collator():
    """Rows packed by TRL's own pack_dataset (bfd: boundaries in ``seq_lengths`` only) through the three collators:
    positions restart at every sequence, no first token is a target, and a configured tiny llama gives every
    sequence the logits it has alone; the rows collated without ``seq_lengths`` do not (negative control)."""
    trl_data_utils = pytest.importorskip("trl.data_utils")
    from padfree import configure_packing
    from padfree.data.batch import PackedBatch, PaddingFreeCollator, packed_collate_fn
    from zoo import sequences, tiny_model

    seqs = sequences([9, 8, 7, 6, 5, 3])
    packed = trl_data_utils.pack_dataset(datasets.Dataset.from_dict({"input_ids": seqs}), seq_length=20,
                                         strategy="bfd")
    rows = [packed[i] for i in range(len(packed))]
    assert set(packed.column_names) == {"input_ids", "seq_lengths"} and all(len(r["seq_lengths"]) > 1 for r in rows)
    pieces, units = [], []
    for r in rows:
        cut = np.cumsum([0, *r["seq_lengths"]])
        units.append(list(range(len(pieces), len(pieces) + len(cut) - 1)))
        pieces += [r["input_ids"][a:b] for a, b in itertools.pairwise(cut.tolist())]
    assert sorted(pieces) == sorted(seqs)
    lengths = [len(p) for p in pieces]
    model = tiny_model("llama").eval()
    configure_packing(model)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([p]), use_cache=False).logits[0] for p in pieces]

    def run(collate, batch_rows):
        out = collate(batch_rows)
        inputs = out.model_inputs() if isinstance(out, PackedBatch) else out
        with torch.no_grad():
            logits = model(**inputs).logits
        real = (lambda x: out.unpad(x)) if isinstance(out, PackedBatch) else (lambda x: x[0])
        return out, {"ids": real(inputs["input_ids"]), "pos": real(inputs["position_ids"]),
                     "labels": real(inputs["labels"]), "logits": real(logits)}

    for collate in (PaddingFreeCollator(), packed_collate_fn(20), PackedRowsCollator()):
        out, flat = run(collate, rows)
        spans = _spans(out, [[k] for k in range(len(pieces))], lengths)
        assert sorted(k for k, _ in spans) == list(range(len(pieces)))
        for k, a in spans:
            b = a + lengths[k]
            assert flat["ids"][a:b].tolist() == pieces[k], collate
            assert flat["pos"][a:b].tolist() == list(range(lengths[k])), collate
            assert flat["labels"][a].item() == -100 and flat["labels"][a + 1:b].tolist() == pieces[k][1:]
            torch.testing.assert_close(flat["logits"][a:b], alone[k], rtol=0, atol=1e-5)
        # negative control: the same rows without seq_lengths are one sequence each, and the logits show it
        out, flat = run(collate, [{"input_ids": r["input_ids"]} for r in rows])
        worst = max(float((flat["logits"][a:a + lengths[k]] - alone[k]).abs().max())
                    for k, a in _spans(out, units, lengths))
        assert worst > 1e-3, collate


def test_status_enable_and_refusals(samples, tmp_path):
    ds = datasets.Dataset.from_list(samples[:4])
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    stock = transformers.Trainer(model=llama(), args=args, train_dataset=ds)
    status = packing_status(stock)
    assert status.mode == "standard batching" and "not built by padfree" in status.reason
    plain = Trainer(model=llama(), args=args, train_dataset=ds)
    assert packing_status(plain).mode == "standard batching" and packing_status(plain).loss == "token"

    class Mine(transformers.Trainer):
        marker = True

    assert enable(transformers.Trainer) is Trainer
    mine = enable(Mine)
    assert issubclass(mine, Mine) and mine.marker and enable(mine) is mine
    built = mine(model=llama(), args=args, train_dataset=ds, data_collator=PackedRowsCollator())
    assert packing_status(built).mode == "padding-free batching"
    with pytest.raises(InvalidArgumentError, match=r"enable takes a subclass of transformers\.Trainer"):
        enable(dict)
    with pytest.raises(InvalidArgumentError, match="padfree_loss must be one of"):
        Trainer(model=llama(), args=args, train_dataset=ds, padfree_loss="mean")
    smoothing = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                               label_smoothing_factor=0.1)
    with pytest.raises(InvalidArgumentError, match=r"padfree_fused_loss=True computes.*label_smoothing_factor=0.1"):
        Trainer(model=llama(), args=smoothing, train_dataset=ds, padfree_fused_loss=True)
    with pytest.raises(InvalidArgumentError, match=r"padfree_fused_loss=True computes.*a compute_loss_func"):
        Trainer(model=llama(), args=args, train_dataset=ds, padfree_fused_loss=True,
                compute_loss_func=lambda outputs, labels, **kw: outputs.loss)
    with pytest.raises(UnsupportedModelError, match="ToyRecurrentMixer"):
        Trainer(model=with_unknown_mixer(llama()), args=args, train_dataset=ds, data_collator=PackedRowsCollator())
    with pytest.raises(InvalidArgumentError, match=r"trainer must be a transformers\.Trainer"):
        packing_status(object())


def test_torch_compile_gives_the_update_of_the_unpacked_loss(samples, tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the configured model; 4 accumulated
    padding-free micro-batches (a new row width and new boundaries each) still give the unpacked update. Compiled
    with ``aot_eager`` (dynamo + AOTAutograd, what padfree's code meets; inductor's C++ build is slow here and is
    tested once in test_model_compile.py), with the fused loss, whose head hook must reach through the
    compile wrapper."""
    torch._dynamo.reset()
    model = llama()
    reference = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(model=model, args=sgd_args(tmp_path, 3, torch_compile=True, torch_compile_backend="aot_eager"),
                      train_dataset=datasets.Dataset.from_list(samples[:12]), data_collator=PackedRowsCollator(),
                      padfree_fused_loss=True)
    trainer.train()
    torch._dynamo.reset()
    assert update_diff(model, before, reference_grads(reference, samples[:12], "token")) <= 1e-5
