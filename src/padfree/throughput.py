"""Train the same real tokens several ways and measure real tokens per second.

One concept: a fixed sample of real sequences is laid out as optimizer steps in several *modes* — the ways people
batch causal-LM training data — and each mode trains its own copy of the same model, from the same initial weights,
with the same optimizer, on exactly those tokens. What differs is only the layout, so the ratio of real (non-padding)
tokens per second is what the layout costs or saves. ``padfree demo``, ``padfree bench`` and
``benchmarks/bench_training.py`` are built on it.

Modes (:data:`MODES`), for ``rows`` = the batch size ``B`` and ``capacity`` = the row length ``C``:

- ``padded`` — Hugging Face's default: the sequences in random order, ``B`` per batch, each batch right-padded to
  its longest sequence with a 0/1 ``attention_mask`` (``DataCollatorWithPadding``); the stock model.
- ``grouped`` — ``TrainingArguments(group_by_length=True)``: ``LengthGroupedSampler``'s order (random megabatches
  of ``50 * B`` sequences, each sorted longest first), then the same padded batches.
- ``trl`` — TRL's packing as ``SFTTrainer(packing=True)`` runs it: ``trl.data_utils.pack_dataset(..., "bfd")`` rows
  of ``C``, ``B`` rows per step flattened by ``DataCollatorForLanguageModeling(padding_free=True)`` into one row with
  restarting ``position_ids``, ``use_cache=False``, the stock model (transformers detects the restarts), and the
  loss as SFTTrainer computes it: through TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, in TRL
  versions that have it; no logits tensor, the logits recomputed in tiles in the backward).
- ``packed`` — padfree: :func:`padfree.pack_sequences` rows of ``C``, ``B`` rows per step,
  :meth:`~padfree.PackedBatch.model_inputs`, a :func:`padfree.configure_packing` copy of the model.
- ``ideal`` — no padding and no boundaries: the same tokens concatenated and cut into full rows of ``C`` (one
  "sequence" per row, the stock model, no mask). The upper bound any packing approaches.

In every padded or packed mode a batch holds at most ``B x C`` positions, so the peak memory of a step is the same
bound; what differs is how many of those positions hold real tokens, and how many steps the sample takes.

>>> import numpy as np, torch, transformers
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> torch.manual_seed(0) and None
>>> model = transformers.LlamaForCausalLM(cfg)
>>> rng = np.random.default_rng(0)
>>> seqs = [rng.integers(1, 64, n) for n in rng.integers(2, 40, 60)]
>>> report = compare_training(model, seqs, capacity=64, rows=2, budget=1000, repetitions=1,
...                           modes=("padded", "packed"))
>>> report["packed"].real_tokens == report["padded"].real_tokens >= 1000
True
>>> report["packed"].positions < report["padded"].positions
True
>>> report.exactness.ok
True
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from padfree.errors import BackendUnavailableError, InvalidArgumentError
from padfree.layout import IGNORE_INDEX
from padfree.packing import pack_sequences
from padfree.packing.inputs import as_capacity, as_choice, as_positive_int, as_seed
from padfree.samples import TokenBuffers, read_tokens

__all__ = [
    "MODES",
    "Plan",
    "Step",
    "build_plans",
    "compare_training",
    "plans_to",
    "sample_sequences",
]

logger = logging.getLogger("padfree")

MODES: dict[str, str] = {
    "padded": "random order, B sequences per batch padded to the longest (HF default collator)",
    "grouped": "HF group_by_length order (megabatches of 50·B sorted by length), B per batch, padded to the longest",
    "trl": "TRL pack_dataset(bfd) rows of C, B rows flattened by its padding-free collator, stock model, "
           "SFTTrainer's loss (TRL's fused LM head where TRL has one)",
    "packed": "padfree pack_sequences rows of C, B rows per step, configure_packing model",
    "ideal": "no padding, no boundaries: the same tokens concatenated and cut into rows of C, stock model",
}
#: ``LengthGroupedSampler``'s megabatch: this many batches' worth of sequences sorted together.
MEGABATCH_MULT = 50

#: Called after every training step: ``(mode, repetition, real_tokens_of_the_step)``; repetition -1 is a warm-up.
ProgressFn = Callable[[str, int, int], None]


# --------------------------------------------------------------------------------------------------
# The sample
# --------------------------------------------------------------------------------------------------


def sample_sequences(token_ids: Any, budget: int | None, capacity: int, *, overlong: str = "truncate",
                     seed: int | None = 0) -> TokenBuffers:
    """The sequences every mode trains on: a seeded random sample of about ``budget`` real tokens.

    Args:
        token_ids: the candidate sequences (anything :func:`padfree.samples.read_tokens` reads).
        budget: real tokens to take: sequences are taken in a seeded random order until their tokens (after the
            overlong policy) reach ``budget``; None takes them all.
        capacity: the row length; a longer sequence is cut to it first.
        overlong: ``"truncate"`` (keep the first ``capacity`` tokens, like ``padfree analyze``) or ``"split"``
            (cut it into pieces of ``capacity``, each a sequence of its own — no token is lost).
        seed: seed of the random order.

    Returns:
        ``TokenBuffers`` of the chosen sequences, in the random order, each ``1 <= len <= capacity``. Empty
        sequences are skipped.

    >>> buf = sample_sequences([[1, 2, 3, 4, 5], [6, 7], [8]], None, 2, overlong="split", seed=None)
    >>> buf.values.tolist(), buf.lengths.tolist()
    ([1, 2, 3, 4, 5, 6, 7, 8], [2, 2, 1, 2, 1])
    """
    buf = read_tokens(token_ids)
    capacity = as_capacity(capacity, "capacity")
    overlong = as_choice(overlong, "overlong", ("truncate", "split"))
    lengths = buf.lengths
    keep = np.flatnonzero(lengths > 0)
    if keep.size == 0:
        raise InvalidArgumentError("token_ids holds no non-empty sequence: there is nothing to train on")
    if seed is not None:
        keep = keep[np.random.default_rng(as_seed(seed)).permutation(keep.size)]
    starts, lens = buf.offsets[keep], lengths[keep]
    if overlong == "truncate":
        lens = np.minimum(lens, capacity)
    else:  # one piece per capacity tokens, in order
        pieces = -(-lens // capacity)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        k = np.arange(int(pieces.sum())) - first
        starts = np.repeat(starts, pieces) + k * capacity
        lens = np.minimum(np.repeat(lens, pieces) - k * capacity, capacity)
    if budget is not None:
        budget = as_positive_int(budget, "budget")
        n = int(np.searchsorted(np.cumsum(lens), budget)) + 1
        starts, lens = starts[:n], lens[:n]
    return _gather(buf.values, starts, lens)


def _gather(values: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> TokenBuffers:
    """Spans ``[starts[i], starts[i] + lens[i])`` of ``values`` as one new contiguous ``TokenBuffers``."""
    offsets = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    src = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(starts - offsets[:-1], lens)
    return TokenBuffers(np.asarray(values)[src].astype(np.int64), offsets)


# --------------------------------------------------------------------------------------------------
# Plans: the sample laid out as optimizer steps
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Step:
    """One optimizer step: ``model(**inputs)``; ``real_tokens`` of ``positions`` hold sample tokens."""

    inputs: dict[str, Any]
    real_tokens: int
    positions: int


@dataclasses.dataclass
class Plan:
    """The sample laid out for one mode: its steps and which model runs them (``"stock"`` or ``"packed"``)."""

    mode: str
    steps: list[Step]
    model: str
    description: str
    sequences: int = 0
    first_row: Any = None  # packed: the row holding the most sequences, as a PackedBatch, for padfree.verify
    # "stock": model(**inputs).loss; "fused": padfree.causal_lm_loss (no logits); "trl": TRL's fused LM head
    loss: str = "stock"

    @property
    def real_tokens(self) -> int:
        return sum(s.real_tokens for s in self.steps)

    @property
    def positions(self) -> int:
        """Token positions the model computes, padding included."""
        return sum(s.positions for s in self.steps)

    @property
    def efficiency(self) -> float:
        """``real_tokens / positions``: the share of the computed positions that are real tokens."""
        return self.real_tokens / max(self.positions, 1)


def _padded_step(buf: TokenBuffers, idx: np.ndarray) -> Step:
    """Sequences ``idx`` of ``buf`` right-padded to the longest: ``(b, w)`` ids, 0/1 mask, labels -100 on padding."""
    import torch

    lens = buf.lengths[idx]
    b, w = idx.size, int(lens.max())
    rows = np.repeat(np.arange(b), lens)
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    ids = np.zeros((b, w), np.int64)
    ids[rows, cols] = buf.values[np.repeat(buf.offsets[idx], lens) + cols]
    mask = np.zeros((b, w), np.int64)
    mask[rows, cols] = 1
    labels = np.where(mask == 1, ids, IGNORE_INDEX)
    inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
              "labels": torch.from_numpy(labels), "use_cache": False}
    return Step(inputs, int(lens.sum()), b * w)


def length_grouped_order(lengths: np.ndarray, batch_size: int, seed: int | None = 0) -> np.ndarray:
    """The order of ``transformers``' ``LengthGroupedSampler``: a random permutation cut into megabatches of
    ``50 * batch_size`` indices, each sorted by length (longest first); the batch holding the longest sequence
    goes first. ``(n,) int64``.

    >>> length_grouped_order(np.array([3, 9, 1, 7]), batch_size=1, seed=None).tolist()
    [1, 3, 0, 2]
    """
    n = lengths.shape[0]
    perm = np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n)
    size = MEGABATCH_MULT * batch_size
    mega = np.arange(n) // size
    # sort by (megabatch, -length), stable: one lexsort instead of a loop over megabatches
    order = perm[np.lexsort((-lengths[perm], mega))]
    # HF swaps the first megabatch's longest element to the front so that an out-of-memory error shows up at once
    longest = int(np.argmax(lengths[order]))
    order[[0, longest]] = order[[longest, 0]]
    return order


def _plan_padded(buf: TokenBuffers, rows: int, seed: int | None, grouped: bool) -> Plan:
    n = len(buf)
    order = length_grouped_order(buf.lengths, rows, seed) if grouped else (
        np.random.default_rng(seed).permutation(n) if seed is not None else np.arange(n))
    steps = [_padded_step(buf, order[i:i + rows]) for i in range(0, n, rows)]
    mode = "grouped" if grouped else "padded"
    return Plan(mode, steps, "stock", MODES[mode])


def _plan_packed(buf: TokenBuffers, capacity: int, rows: int, seed: int | None, strategy: str) -> Plan:
    from padfree.data.batch import pack_result_to_tensors

    plan = pack_sequences(buf.lengths, capacity, strategy, seed)
    # the plan lists bins longest first: train on them in a random order
    order = np.random.default_rng(seed).permutation(plan.num_bins) if seed is not None else np.arange(plan.num_bins)
    steps = []
    for first in range(0, plan.num_bins, rows):
        batch = pack_result_to_tensors(plan.take_bins(order[first:first + rows]), buf)
        steps.append(Step(batch.model_inputs(), batch.num_tokens, batch.batch_size * batch.seq_len))
    # the row with the most sequences is the one with the most boundaries to get wrong: it is the one verified
    busiest = np.argmax(np.diff(plan.bin_offsets))[None]
    return Plan("packed", steps, "packed", MODES["packed"] + f" ({strategy}: {plan.efficiency:.2%} full)",
                first_row=pack_result_to_tensors(plan.take_bins(busiest), buf))


def _plan_ideal(buf: TokenBuffers, capacity: int, rows: int) -> Plan:
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(buf.values, dtype=np.int64))
    total = flat.numel()
    full = total // capacity
    grid = flat[: full * capacity].view(full, capacity)
    steps = [Step({"input_ids": grid[i:i + rows], "labels": grid[i:i + rows], "use_cache": False},
                  grid[i:i + rows].numel(), grid[i:i + rows].numel()) for i in range(0, full, rows)]
    if total > full * capacity:  # the remainder: one shorter row, still no padding
        rest = flat[full * capacity:][None]
        steps.append(Step({"input_ids": rest, "labels": rest, "use_cache": False}, rest.numel(), rest.numel()))
    return Plan("ideal", steps, "stock", MODES["ideal"])


def _plan_trl(buf: TokenBuffers, capacity: int, rows: int, seed: int | None) -> Plan:
    try:
        import datasets
        import pyarrow as pa
        from datasets.table import InMemoryTable
        from trl.data_utils import pack_dataset
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError as exc:
        raise BackendUnavailableError(f"mode 'trl' needs trl and datasets, which could not be imported ({exc}); "
                                      "install them with: pip install 'padfree[trl]'") from exc
    column = pa.ListArray.from_arrays(pa.array(buf.offsets - buf.offsets[0], pa.int32()),
                                      pa.array(buf.values, pa.int32()))
    ds = datasets.Dataset(InMemoryTable(pa.table({"input_ids": column})), fingerprint=f"padfree-{id(column):x}")
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        packed = pack_dataset(ds, capacity, "bfd")
    finally:
        if was:
            datasets.enable_progress_bars()
    order = np.random.default_rng(seed).permutation(len(packed)) if seed is not None else np.arange(len(packed))
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    steps = []
    for first in range(0, len(packed), rows):
        examples = packed.select(order[first:first + rows]).to_list()
        inputs = dict(collate(examples))
        inputs["use_cache"] = False  # what SFTTrainer.compute_loss sets
        n = int(inputs["input_ids"].numel())
        steps.append(Step(inputs, n, n))
    return Plan("trl", steps, "stock", MODES["trl"], loss="trl" if _trl_fused_head() is not None else "stock")


def _trl_fused_head() -> Callable | None:
    """TRL's ``add_fused_lm_head`` (what ``SFTTrainer`` computes its loss through), or None in TRL versions
    without it."""
    try:
        from trl.trainer.utils import add_fused_lm_head
    except ImportError:
        return None
    return add_fused_lm_head


def build_plans(sample: TokenBuffers, capacity: int, rows: int, modes: Sequence[str] = tuple(MODES), *,
                seed: int | None = 0, strategy: str = "obfd") -> dict[str, Plan]:
    """Lay ``sample`` out as the optimizer steps of every mode in ``modes`` (see the module docstring).

    Args:
        sample: the sequences, each ``1 <= len <= capacity`` (see :func:`sample_sequences`).
        capacity: row length ``C`` (packed, ideal, trl) and the longest a padded row can be.
        rows: ``B``, sequences per padded batch and rows per packed step.
        modes: names from :data:`MODES`.
        seed: seed of every random order (the batches of ``padded``, the megabatches of ``grouped``, the order of
            packed rows); None keeps the sample's order.
        strategy: the padfree packing strategy.

    Every plan holds exactly the tokens of ``sample`` (``plan.real_tokens`` is the same for all).
    """
    capacity = as_capacity(capacity, "capacity")
    rows = as_positive_int(rows, "rows")
    if len(sample) == 0:
        raise InvalidArgumentError("the sample holds no sequence")
    longest = int(sample.lengths.max())
    if longest > capacity:
        raise InvalidArgumentError(f"the sample holds a sequence of {longest} tokens, longer than capacity="
                                   f"{capacity}; cut it with sample_sequences(..., capacity)")
    plans = {}
    for mode in dict.fromkeys(modes):
        as_choice(mode, "modes[]", tuple(MODES))
        if mode in ("padded", "grouped"):
            plans[mode] = _plan_padded(sample, rows, seed, grouped=mode == "grouped")
        elif mode == "packed":
            plans[mode] = _plan_packed(sample, capacity, rows, seed, strategy)
        elif mode == "ideal":
            plans[mode] = _plan_ideal(sample, capacity, rows)
        else:
            plans[mode] = _plan_trl(sample, capacity, rows, seed)
        plans[mode].sequences = len(sample)
    return plans


def plans_to(plans: dict[str, Plan], device: Any) -> dict[str, Plan]:
    """Every plan's tensors moved to ``device`` once, before timing (the copies are not what is measured)."""
    import torch

    def move(inputs: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    return {m: dataclasses.replace(p, steps=[dataclasses.replace(s, inputs=move(s.inputs)) for s in p.steps],
                                   first_row=None if p.first_row is None else p.first_row.to(device))
            for m, p in plans.items()}


# --------------------------------------------------------------------------------------------------
# Training and timing
# --------------------------------------------------------------------------------------------------


class _Runner:
    """One mode's model and optimizer: ``reset`` to the initial weights and a fresh AdamW, then ``step`` by step."""

    def __init__(self, plan: Plan, model: Any, state: dict[str, Any], lr: float) -> None:
        self.plan, self.model, self.state, self.lr = plan, model, state, lr
        self.reset()

    def reset(self) -> None:
        import torch

        self.model.load_state_dict(self.state)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.done = 0
        self.wall = self.cpu = 0.0
        self.losses: list[float] = []

    @property
    def finished(self) -> bool:
        return self.done == len(self.plan.steps)

    def step(self) -> int:
        """Train the next step (forward, backward, AdamW); time it; return its real tokens."""
        step = self.plan.steps[self.done]
        c0, t0 = time.process_time(), time.perf_counter()
        if self.plan.loss == "fused":
            from padfree.model.loss import causal_lm_loss

            loss = causal_lm_loss(self.model, step.inputs)
        elif self.plan.loss == "trl":
            loss = self.model(**step.inputs, fused_lm_head=True).loss
        else:
            loss = self.model(**step.inputs).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())  # also waits for an accelerator to finish the step
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        self.losses.append(value)
        self.done += 1
        return step.real_tokens


def _interleaved_pass(runners: list[_Runner], repetition: int, progress: ProgressFn | None) -> None:
    """One pass of every mode, step by step: next is always the mode that has done the smallest share of its pass,
    so that the modes advance together and a change of load on the machine hits them alike."""
    for r in runners:
        r.reset()
    while True:
        left = [r for r in runners if not r.finished]
        if not left:
            return
        r = min(left, key=lambda r: r.done / len(r.plan.steps))
        n = r.step()
        if progress is not None:
            progress(r.plan.mode, repetition, n)


@dataclasses.dataclass
class ModeResult:
    """One mode's measurements: every repetition's wall time and the loss of every step (from the first run; the
    runs are deterministic on the CPU)."""

    mode: str
    description: str
    steps: int
    real_tokens: int
    positions: int
    seconds: list[float]
    losses: list[float]
    step_tokens: list[int]
    cpu_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_second(self) -> float:
        """Real tokens per second, over the median run."""
        return self.real_tokens / self.median_seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        """Real tokens per second of process CPU time (all threads), over the median run: steadier than wall time
        when other processes share the cores."""
        return self.real_tokens / statistics.median(self.cpu_seconds) if self.cpu_seconds else float("nan")

    @property
    def efficiency(self) -> float:
        return self.real_tokens / max(self.positions, 1)

    def final_loss(self, fraction: float = 0.25) -> float:
        """Token-weighted mean loss of the steps that trained the last ``fraction`` of the tokens."""
        tokens = np.asarray(self.step_tokens, np.float64)
        seen = np.cumsum(tokens)
        last = seen > (1 - fraction) * seen[-1] - 1e-9
        last[-1] = True
        return float(np.average(np.asarray(self.losses)[last], weights=tokens[last]))


@dataclasses.dataclass
class ThroughputReport:
    """What :func:`compare_training` measured; ``report[mode]`` is a :class:`ModeResult`.

    Attributes:
        capacity, rows: ``C`` and ``B``.
        sequences: sequences in the sample.
        exactness: :func:`padfree.verify` of the packed model on the packed row holding the most sequences (None
            if not checked).
        leaks: mode -> largest ``|logit difference|`` between a sequence in that mode's first step and the same
            sequence alone (checked for ``trl``; 0 within float noise means exact).
        cross_targets: mode -> next-token targets per pass that cross from one sequence into the next (``trl``'s
            collator labels them; padfree masks them).
        inrun_proof: ``(seconds, report)`` of the in-run proof padfree's trainers run before their first optimizer
            step (``padfree_verify="first_step"``), run on the packed mode's first micro-batch, so that its cost can
            be set against the training time (None if not checked).
        inrun_proof_cpu_seconds: the process's CPU time during that proof.
    """

    results: dict[str, ModeResult]
    capacity: int
    rows: int
    sequences: int
    repetitions: int
    exactness: Any = None
    leaks: dict[str, float] = dataclasses.field(default_factory=dict)
    cross_targets: dict[str, int] = dataclasses.field(default_factory=dict)
    inrun_proof: tuple[float, Any] | None = None
    inrun_proof_cpu_seconds: float | None = None

    def __getitem__(self, mode: str) -> ModeResult:
        return self.results[mode]

    @property
    def inrun_proof_share(self) -> float | None:
        """The in-run proof's seconds over the packed mode's timed training seconds (every pass together): what the
        proof adds to a run of this length (None: no proof, or no packed mode timed)."""
        if self.inrun_proof is None or "packed" not in self.results:
            return None
        return self.inrun_proof[0] / max(sum(self.results["packed"].seconds), 1e-12)

    @property
    def inrun_proof_cpu_share(self) -> float | None:
        """The same share in CPU time: steadier than wall time on a machine other work shares, where a burst of load
        during the proof's second or so moves the wall-clock share far more than it moves the training's."""
        if self.inrun_proof_cpu_seconds is None or "packed" not in self.results:
            return None
        return self.inrun_proof_cpu_seconds / max(sum(self.results["packed"].cpu_seconds), 1e-12)

    def __contains__(self, mode: object) -> bool:
        return mode in self.results

    def speedup(self, mode: str, over: str) -> float:
        """Real tokens/s of ``mode`` divided by those of ``over`` (medians of the same run)."""
        return self[mode].tokens_per_second / self[over].tokens_per_second

    def cpu_speedup(self, mode: str, over: str) -> float:
        """The same ratio in real tokens per CPU second."""
        return self[mode].tokens_per_cpu_second / self[over].tokens_per_cpu_second

    def ratios(self, mode: str = "packed") -> dict[str, float]:
        """``mode``'s speedup over every other mode."""
        return {m: self.speedup(mode, m) for m in self.results if m != mode}

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        out: dict[str, Any] = {"capacity": self.capacity, "rows": self.rows, "sequences": self.sequences,
                               "repetitions": self.repetitions, "modes": {}}
        for m, r in self.results.items():
            out["modes"][m] = {"steps": r.steps, "real_tokens": r.real_tokens, "positions": r.positions,
                               "efficiency": r.efficiency, "seconds": r.seconds, "cpu_seconds": r.cpu_seconds,
                               "tokens_per_second": r.tokens_per_second, "final_loss": r.final_loss()}
        if "packed" in self.results:
            out["packed_speedup"] = self.ratios("packed")
        if self.exactness is not None:
            out["exactness"] = {"ok": self.exactness.ok, "max_logit_diff": self.exactness.max_logit_diff,
                                "loss_diff": self.exactness.loss_diff, "max_grad_diff": self.exactness.max_grad_diff}
        if self.inrun_proof is not None:
            seconds, proof = self.inrun_proof
            out["inrun_proof"] = {"seconds": seconds, "share_of_packed_training": self.inrun_proof_share,
                                  "cpu_seconds": self.inrun_proof_cpu_seconds,
                                  "cpu_share_of_packed_training": self.inrun_proof_cpu_share,
                                  "ok": proof.ok, "sequences": proof.num_sequences,
                                  "max_logit_diff": proof.max_logit_diff, "atol": proof.atol, "control": proof.control}
        out["leaks"] = dict(self.leaks)
        out["cross_targets"] = dict(self.cross_targets)
        return out

    def __str__(self) -> str:
        head = (f"{'mode':<8} {'steps':>6} {'real tokens':>12} {'positions':>10} {'filled':>7} {'median s':>9} "
                f"{'tokens/s':>9} {'packed is':>10} {'(CPU time)':>10} {'final loss':>10}")
        lines = [f"training throughput: {self.sequences} sequences, rows of {self.capacity} tokens, batch {self.rows}, "
                 f"{self.repetitions} repetition(s)", head]
        for m, r in self.results.items():
            ratio = f"{self.speedup('packed', m):.2f}x" if "packed" in self.results else "-"
            cpu = f"{self.cpu_speedup('packed', m):.2f}x" if "packed" in self.results else "-"
            lines.append(f"{m:<8} {r.steps:>6} {r.real_tokens:>12,} {r.positions:>10,} {r.efficiency:>7.1%} "
                         f"{r.median_seconds:>9.2f} {r.tokens_per_second:>9,.0f} {ratio:>10} {cpu:>10} "
                         f"{r.final_loss():>10.4f}")
        return "\n".join(lines)


def boundary_leak(model: Any, inputs: dict[str, Any], seq_lens: Sequence[int], *, max_sequences: int = 8) -> float:
    """Largest ``|logit difference|`` between the sequences of a one-row packed batch and each of them alone.

    Args:
        model: the model the inputs are fed to, as they are.
        inputs: one step's keyword arguments with ``input_ids`` of shape ``(1, T)``; ``labels`` are dropped.
        seq_lens: the lengths of the sequences laid end to end in the row.
        max_sequences: compare at most this many sequences (the later ones, where a leak has most to see).

    0 within float noise (about 1e-5 in fp32) means the model kept every sequence to itself.
    """
    import torch

    lens = [int(n) for n in seq_lens]
    starts = np.cumsum([0, *lens])[:-1]
    pick = list(range(len(lens)))[-max_sequences:]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            feed = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
            logits = model(**feed).logits[0]
            worst = 0.0
            for i in pick:
                a, n = int(starts[i]), lens[i]
                seq = inputs["input_ids"][:, a:a + n]
                pos = torch.arange(n, device=seq.device)[None]
                alone = model(input_ids=seq, position_ids=pos, use_cache=False).logits[0]
                worst = max(worst, float((logits[a:a + n] - alone).abs().max()))
    finally:
        model.train(was)
    return worst


def _trl_lengths(step: Step) -> list[int]:
    pos = step.inputs["position_ids"][0]
    starts = np.append(np.flatnonzero(pos.cpu().numpy() == 0), pos.numel())
    return np.diff(starts).tolist()


def _inrun_proof(model: Any, inputs: dict[str, Any]) -> Any:
    """The in-run proof of padfree's trainers on one packed micro-batch, timed by the proof itself (its
    ``InRunProof``: ``seconds``, ``cpu_seconds``, ``last``), or None when the micro-batch holds fewer than two
    sequences to compare."""
    from padfree.integrations.inrun import InRunProof

    proof = InRunProof.from_option("first_step")
    proof.prove(model, inputs, step=0)
    return None if proof.last is None else proof


def compare_training(
    model: Any,
    token_ids: Any,
    *,
    capacity: int,
    rows: int,
    budget: int | None = None,
    modes: Sequence[str] = ("padded", "grouped", "packed", "ideal"),
    repetitions: int = 3,
    seed: int | None = 0,
    lr: float = 1e-3,
    overlong: str = "truncate",
    check: bool = True,
    progress: ProgressFn | None = None,
    plans: dict[str, Plan] | None = None,
    fused: Sequence[str] = (),
) -> ThroughputReport:
    """Train the same real tokens in every mode and measure real tokens per second.

    Args:
        model: a Hugging Face causal LM, *not* configured for packing (the stock modes run it as it is; ``packed``
            runs a :func:`padfree.configure_packing` deep copy). Its current weights are every run's start.
        token_ids: candidate sequences; :func:`sample_sequences` draws about ``budget`` tokens from them.
        capacity, rows: ``C`` and ``B`` (see the module docstring).
        budget: real tokens per pass (None: all of ``token_ids``).
        modes: names from :data:`MODES`; ``packed`` is what the ratios are taken against.
        repetitions: timed passes per mode. The modes run their passes together, interleaved step by step (next
            is always the mode furthest behind in its own pass), so that a change of load on the machine hits every
            mode alike; the median pass is reported.
        seed: seed of the sample and of every order.
        lr: AdamW learning rate.
        overlong: what :func:`sample_sequences` does with sequences longer than ``capacity``.
        check: run :func:`padfree.verify` on the packed row with the most sequences, and :func:`boundary_leak` on
            the first ``trl`` step, before timing.
        progress: called after every step (:data:`ProgressFn`).
        plans: plans already built by :func:`build_plans` (then ``token_ids``, ``budget`` and ``overlong`` are
            not used).
        fused: modes to run a second time with padfree's fused loss (:func:`padfree.causal_lm_loss`: the LM head
            and cross-entropy in chunks, over target positions only) instead of ``model(**inputs).loss``, as modes
            named ``"<mode>+fused"`` — so that what the loss saves is measured apart from what the layout saves.

    Every mode trains its own deep copy of ``model`` (``packed``'s configured), reset to the initial weights and a
    fresh AdamW at the start of every pass, after one untimed warm-up step per mode; only the steps are timed
    (``time.perf_counter`` and, for :meth:`ModeResult.tokens_per_cpu_second`, ``time.process_time``).
    ``torch.set_num_threads`` is left to the caller: set it once, before, so that every mode runs with the same
    threads. ``model`` itself is not modified.
    """
    import torch

    from padfree.model.configure import configure_packing
    from padfree.proof.check import verify

    repetitions = as_positive_int(repetitions, "repetitions")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise InvalidArgumentError(f"lr must be a finite number > 0, got {lr!r}")
    if plans is None:
        sample = sample_sequences(token_ids, budget, capacity, overlong=overlong, seed=seed)
        plans = build_plans(sample, capacity, rows, modes, seed=seed)
    for m in fused:
        if m not in plans:
            raise InvalidArgumentError(f"fused names mode {m!r}, which is not among the modes {sorted(plans)}")
    plans = {**plans, **{f"{m}+fused": dataclasses.replace(plans[m], mode=f"{m}+fused", loss="fused",
                                                            description=plans[m].description + "; fused loss")
                         for m in fused}}
    num_sequences = next(iter(plans.values())).sequences
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # every mode trains its own copy (its weights and optimizer state evolve between its steps); packed's is configured
    models: dict[str, Any] = {}
    for m, plan in plans.items():
        models[m] = copy.deepcopy(model)
        if plan.model == "packed":
            configure_packing(models[m])
        if plan.loss == "trl":
            _trl_fused_head()(models[m])
    report = ThroughputReport({}, capacity, rows, num_sequences, repetitions)
    if check and "packed" in plans and plans["packed"].first_row.num_sequences >= 2:  # else: no boundary to check
        # fp32: exact to float noise; a half-precision model rounds differently in the packed and the per-sequence
        # kernels, so its tolerance is that of bf16 logits
        half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        report.exactness = verify(models["packed"], plans["packed"].first_row, atol=5e-2 if half else 1e-5)
        proof = _inrun_proof(models["packed"], plans["packed"].steps[0].inputs)
        if proof is not None:
            report.inrun_proof, report.inrun_proof_cpu_seconds = (proof.seconds, proof.last), proof.cpu_seconds
    if check and "trl" in plans:
        step = plans["trl"].steps[0]
        report.leaks["trl"] = boundary_leak(models["trl"], step.inputs, _trl_lengths(step))
        report.cross_targets["trl"] = sum(len(_trl_lengths(s)) - 1 for s in plans["trl"].steps)
    if "packed" in plans:
        report.cross_targets["packed"] = 0
    runners = [_Runner(plan, models[m], state, lr) for m, plan in plans.items()]
    for r in runners:  # warm-up: first-call costs (allocator, kernels, lazy imports) off the clock
        n = r.step()
        if progress is not None:
            progress(r.plan.mode, -1, n)
    wall: dict[str, list[float]] = {m: [] for m in plans}
    cpu: dict[str, list[float]] = {m: [] for m in plans}
    losses: dict[str, list[float]] = {}
    for rep in range(repetitions):
        _interleaved_pass(runners, rep, progress)
        for r in runners:
            wall[r.plan.mode].append(r.wall)
            cpu[r.plan.mode].append(r.cpu)
            losses.setdefault(r.plan.mode, r.losses)
            logger.debug("%s repetition %d: %.2f s (%.2f CPU s)", r.plan.mode, rep, r.wall, r.cpu)
    del runners, models
    for m, plan in plans.items():
        report.results[m] = ModeResult(m, plan.description, len(plan.steps), plan.real_tokens, plan.positions,
                                       wall[m], losses[m], [s.real_tokens for s in plan.steps], cpu[m])
    return report
