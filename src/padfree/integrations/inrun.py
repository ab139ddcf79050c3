"""The proof a training run carries itself: a packed micro-batch checked against its sequences alone, on the real
model, device, dtype, backend and kernels of the run, before the optimizer steps.

padfree's support table and certification prove tiny fp32 twins. What the user trains — a large checkpoint in bf16
under autocast on a GPU, with flash-attn or fla kernels — is checked here, in the run: on the first packed
micro-batch (``padfree_verify="first_step"``, the default; ``"every:N"`` every N optimizer steps; ``False`` never)
a few of the batch's own sequences — the shortest, within a token budget — run packed and each alone through
:func:`padfree.verify` (``atol="auto"``: the tolerance is what rounding moves each sequence in this precision, and a
leaking control must land beyond it). The result goes to the log and the telemetry (``padfree/verify_max_logit_diff``,
``padfree/verify_control_ratio``); a mismatch raises :class:`~padfree.errors.PackingDisabledError` naming the first
module whose outputs diverge, before any optimizer step.

>>> InRunProof.from_option("every:50").due(0), InRunProof.from_option("every:50").due(49)
(True, False)
>>> InRunProof.from_option(False).due(0)
False
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from padfree.errors import InvalidArgumentError, InvalidLayoutError, PackingDisabledError, PadfreeError, describe
from padfree.samples import row_boundaries

__all__ = ["InRunProofMixin"]

logger = logging.getLogger("padfree")

# the tokens the proof runs (its two shortest sequences cut to half of it each, more within it): it runs them about
# four times (packed, each alone, the leaking control, and right- and left-padded in one batch to calibrate the
# tolerance; logits only where they are compared), so its cost is a few forwards of a few hundred tokens, once:
# measured by padfree demo (1.5% of its 10 packed steps of a 4M-parameter model with a 32k vocabulary on 2 cores,
# 0.19 s of 12.5 s; 3% with the two shortest whole, 14% before the proof computed logits only where it compares
# them; a share that shrinks with the length of the run)
_BUDGET = 256
_MAX_SEQUENCES = 4


def batch_sequences(inputs: Mapping[str, Any], budget: int = _BUDGET, most: int = _MAX_SEQUENCES
                    ) -> list[list[int]]:
    """The sequences of a packed micro-batch to prove it on: its rows' sequences (read from ``position_ids``, or from
    ``cu_seq_lens_q`` / ``cu_seqlens`` over the flattened rows), the shortest first, at least 2 tokens each and at
    least one trained label: the two shortest, their first ``budget // 2`` tokens, and more of them (``most`` in all)
    while they fit in ``budget`` tokens; fewer than two: none.

    >>> import torch
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 0]]),
    ...          "position_ids": torch.tensor([[0, 1, 0, 1, 2, 3, 0]]),
    ...          "labels": torch.tensor([[-100, 6, -100, 8, 9, 10, -100]])}
    >>> batch_sequences(batch)
    [[5, 6], [7, 8, 9, 10]]
    """
    if not hasattr(inputs.get("input_ids"), "dim"):
        return _choose(_joined(inputs), budget, most)  # prompts and completions (DPO, GRPO), or nothing
    ids = inputs["input_ids"].detach().cpu().reshape(-1).numpy()
    spelling = next(((k, inputs[k]) for k in ("position_ids", "cu_seq_lens_q", "cu_seqlens")
                     if hasattr(inputs.get(k), "dim")), None)
    if spelling is None:  # an ordinary padded batch (TRL's DPO: chosen and rejected rows): each row's real tokens
        mask = inputs.get("attention_mask")
        if not hasattr(mask, "dim") or mask.dim() != 2 or bool((mask > 1).any()):
            return []
        rows = inputs["input_ids"].detach().cpu()
        return _choose([row[m.bool()].tolist() for row, m in zip(rows, mask.detach().cpu(), strict=True)],
                       budget, most)
    key, value = spelling
    value = value.detach().cpu()
    if key == "position_ids":
        value = value[-1] if value.dim() == 3 else value  # (R, B, T) rotary rows: the last is the text row
    try:
        lengths = row_boundaries({key: value.reshape(-1).numpy()}, ids.size, "the packed micro-batch")
    except InvalidLayoutError:  # boundaries this reader cannot follow: the batch is not proven here
        return []
    if lengths is None:
        return []
    labels = inputs.get("labels")
    real = None if labels is None else labels.detach().cpu().reshape(-1).numpy() != -100
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    found = [ids[s:s + n].tolist() for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
             # a run that trains nothing (its labels all ignored) is padding, not a sequence
             if n >= 2 and (real is None or real[s + 1:s + n].any())]
    return _choose(found, budget, most)


def _choose(found: list[list[int]], budget: int, most: int) -> list[list[int]]:
    """The two shortest of ``found``, each cut to its first ``budget // 2`` tokens (a run of long sequences is proven
    too), then more while they fit in ``budget`` tokens, at most ``most``; fewer than two: none.

    A causal model's outputs at a sequence's first tokens are those of the whole sequence there, so a prefix is a
    sequence of the run's own kind, and the packed row of prefixes still puts every boundary the proof checks (a
    state or a position carried from the sequence before) in front of a sequence of more than one chunk of a
    chunked scan (64 tokens)."""
    chosen, used = [], 0
    for seq in sorted(found, key=len):
        seq = seq[:max(budget // 2, 2)]
        if len(chosen) == most or (len(chosen) >= 2 and used + len(seq) > budget):
            break
        chosen.append(seq)
        used += len(seq)
    return chosen if len(chosen) >= 2 else []


# batches of prompts and completions, each padded with its mask: (prompt, its mask, (completion, its mask), ...) —
# TRL's DPO (chosen and rejected) and GRPO; each sequence is a prompt's real tokens and a completion's
_JOINED = (("prompt_input_ids", "prompt_attention_mask", ("chosen_input_ids", "chosen_attention_mask"),
            ("rejected_input_ids", "rejected_attention_mask")),
           ("prompt_ids", "prompt_mask", ("completion_ids", "completion_mask")))


def _joined(inputs: Mapping[str, Any]) -> list[list[int]]:
    for prompt_key, prompt_mask, *completions in _JOINED:
        if not all(hasattr(inputs.get(k), "dim") for k in (prompt_key, prompt_mask)):
            continue
        prompts = [row[mask.bool()].tolist() for row, mask in zip(inputs[prompt_key].cpu(),
                                                                   inputs[prompt_mask].cpu(), strict=True)]
        found = []
        for key, mask_key in completions:
            if hasattr(inputs.get(key), "dim") and hasattr(inputs.get(mask_key), "dim"):
                for prompt, row, mask in zip(prompts, inputs[key].cpu(), inputs[mask_key].cpu(), strict=True):
                    seq = prompt + row[mask.bool()].tolist()
                    if len(seq) >= 2:
                        found.append(seq)
        return found
    return []


@dataclasses.dataclass
class InRunProof:
    """When a trainer proves its packed micro-batches, and what the last proof found.

    Attributes:
        every: prove every ``every`` optimizer steps (0: the first step only; None: never).
        last: the last :class:`~padfree.proof.check.VerifyReport`, or None.
        seconds: the time the proofs took, all together (wall clock).
        cpu_seconds: the process's CPU time during them (what they cost on a machine other work shares).
    """

    every: int | None
    last: Any = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    _done: bool = False

    @classmethod
    def from_option(cls, option: Any) -> InRunProof:
        """``padfree_verify``: ``"first_step"``, ``"every:N"`` (N >= 1) or ``False``."""
        if option is False or option is None:
            return cls(None)
        if option is True or option == "first_step":
            return cls(0)
        match = re.fullmatch(r"every:(\d+)", option) if isinstance(option, str) else None
        if match is None or int(match.group(1)) < 1:
            raise InvalidArgumentError(f"padfree_verify must be 'first_step', 'every:N' (N >= 1) or False, got "
                                       f"{describe(option)}")
        return cls(int(match.group(1)))

    def due(self, step: int) -> bool:
        """Whether the micro-batch of optimizer step ``step`` (0-based) is to be proven."""
        if self.every is None:
            return False
        if self.every == 0:
            return not self._done
        return step % self.every == 0

    def prove(self, model: Any, inputs: Mapping[str, Any], step: int, compute_dtype: Any = None,
              check: Any = None) -> dict[str, float] | None:
        """Prove ``inputs`` on ``model`` (see the module docstring); the telemetry to log, or None when the batch
        holds fewer than two sequences to compare (nothing is proven then, and the next batch is tried).
        ``compute_dtype``: the dtype of a mixed-precision run whose forward applies autocast itself. ``check``:
        ``check(model, sequences, compute_dtype)`` for a model whose outputs :func:`padfree.verify` does not compare
        (a reward model's scores); it returns a report with the same ``ok``, ``conclusive``, ``control``, ``atol``,
        ``max_logit_diff`` and ``num_sequences``."""
        from padfree.proof.check import verify

        seqs = batch_sequences(inputs)
        if not seqs:
            return None
        start, cpu = time.perf_counter(), time.process_time()
        if check is None:
            report = verify(model, seqs, atol="auto", check_grads=False, compute_dtype=compute_dtype)
        else:
            report = check(model, seqs, compute_dtype)
            if report is None:  # the check cannot run on this model (said by the check): nothing proven
                return None
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        self.last, self._done = report, True
        ratio = float("nan") if not report.control else report.control / max(report.atol, 1e-12)
        logger.info("padfree: in-run proof at step %d: %d sequences, max |Δlogit| %.2e within %.2e, control %.2e "
                    "(%.0fx the tolerance), %.2f s", step, report.num_sequences, report.max_logit_diff, report.atol,
                    report.control or 0.0, ratio, time.perf_counter() - start)
        if not report.ok:
            raise PackingDisabledError(
                f"the in-run proof at step {step} failed before any optimizer step it covers: a packed micro-batch "
                f"differs from its sequences alone on this model, device and precision (first diverging module: "
                f"{_first_divergence(model)}):\n{report}")
        if report.conclusive is False:
            logger.warning("padfree: the in-run proof at step %d cannot tell a leak from rounding in this precision "
                           "(control %.2e within the tolerance %.2e): the packed step is unproven here, not wrong",
                           step, report.control, report.atol)
        return {"padfree/verify_max_logit_diff": report.max_logit_diff,
                "padfree/verify_control_ratio": ratio}


def _first_divergence(model: Any) -> str:
    """The first module whose outputs diverge on a packed probe (:func:`padfree.proof.compare.first_divergence`),
    run in fp32 where the weights are; the model is left unconfigured (the run stops)."""
    import torch

    from padfree.model.wrappers import packable_model
    from padfree.proof.compare import first_divergence

    inner = packable_model(model, "the in-run proof")
    device = next(inner.parameters()).device
    if any(p.dtype != torch.float32 for p in inner.parameters() if p.is_floating_point()):
        return "not located (the weights are not fp32; run padfree verify --model on an fp32 copy)"
    try:
        with torch.autocast(device.type, enabled=False):
            name = first_divergence(inner, configure=lambda m, backend: None)
    except Exception as exc:  # locating is a courtesy: the mismatch itself is what is raised
        return f"not located ({type(exc).__name__}: {exc})"
    return name or "none found on the probe"


def _multimodal(inputs: Mapping[str, Any]) -> bool:
    """A batch with images, videos or audio: its sequences alone are not the run's computation without them (the
    support table and the image proofs cover those models; the proof runs again on a text-only batch)."""
    return any(str(k).startswith(("pixel_values", "image_", "video_", "input_features", "audio")) for k in inputs)


def _provable(model: Any) -> bool:
    """Whether the in-run proof runs on ``model`` (bare or wrapped): a causal LM whose logits verify compares (a
    reward model's scores are not), not split across a sequence-parallel group (every forward of such a model is one
    rank's slice of a row, which the proof's own forwards are not). The others are proven by the support table and
    certification only."""
    from padfree.model.kinds import not_a_causal_lm
    from padfree.model.state import packing_state
    from padfree.model.wrappers import packable_model

    try:
        inner = packable_model(model, "the in-run proof")
    except PadfreeError:
        return False
    state = packing_state(inner)
    return not_a_causal_lm(inner) is None and getattr(state, "sp", None) is None


class InRunProofMixin:
    """For a ``transformers.Trainer`` subclass (before it in the bases): :class:`InRunProof` run in
    ``training_step`` on the micro-batches it is due for — before their forward, so before the optimizer step they
    feed — and its telemetry merged into the training log."""

    _padfree_proof: InRunProof | None = None
    _padfree_proof_logs: dict[str, float] | None = None

    def _padfree_attach_proof(self, option: Any) -> None:
        self._padfree_proof = InRunProof.from_option(option)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, Mapping):  # GRPO's are prompts, to be generated from: it proves its scoring batch
            self._padfree_prove(model, inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def _padfree_prove(self, model: Any, inputs: Mapping[str, Any], check: Any = None) -> None:
        """Prove ``inputs`` (a packed micro-batch, or padded rows whose real tokens the proof packs itself) if a
        proof is due at this optimizer step; called before the forward whose gradients the step applies. ``check``:
        see :meth:`InRunProof.prove` (a model it is given for is provable by it)."""
        proof = self._padfree_proof
        if proof is None or _multimodal(inputs) or not proof.due(self.state.global_step):
            return
        if check is None and not _provable(model):
            return
        import torch

        dtype = torch.bfloat16 if getattr(self.args, "bf16", False) else \
            torch.float16 if getattr(self.args, "fp16", False) else None
        with self.compute_loss_context_manager():
            logs = proof.prove(model, inputs, self.state.global_step, compute_dtype=dtype, check=check)
        if logs:
            self._padfree_proof_logs = {**logs, "padfree/verify_seconds": proof.seconds}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self._padfree_proof_logs and "loss" in logs:
            logs.update(self._padfree_proof_logs)
            self._padfree_proof_logs = None
        super().log(logs, *args, **kwargs)
