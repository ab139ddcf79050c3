"""``configure_packing(model)``: make one Hugging Face causal LM packing-exact, or refuse.

The call identifies the model type and every sequence-mixing module — attention layers, and the recurrent /
convolutional mixers of hybrid and state-space models (:mod:`padfree.model.families`) — switches attention to a padfree
backend (:mod:`padfree.model.attention`, registered through transformers' own interfaces), turns the cache off for
training and installs a forward hook on the model's decoder (on the model itself for state-space models, whose
forwards take no ``position_ids``) that, for every call,

1. reads the batch's boundaries — ``position_ids`` that restart, a LLaMA-Factory segment ``attention_mask``
   (``[1, 1, 2, 2, 2, 0]``) or flash-style ``cu_seq_lens_q`` — into a :class:`~padfree.model.packed.PackedLayout`;
2. fails closed (:class:`PackingDisabledError`) when a packed batch comes with something that would let sequences
   see each other in transformers: an active cache, a 0/1 ``attention_mask`` or a prepared 4-D mask;
3. hands the layout to every attention layer (and every boundary-aware mixer), or — for an ordinary padded batch —
   lets transformers run exactly its own code.

Support is proven, never listed: a model is accepted when the support table that the test suite's sweep writes
(:mod:`padfree.proof.registry`, one tiny model per causal-LM type of transformers, packed against per-sequence in
every backend and precision) covers it — its type, class, module classes, config features and transformers
version — or else when an on-the-spot certification of a tiny twin of its own class and config proves it exact
(:mod:`padfree.proof.certify`, cached on disk). Anything else is refused with :class:`UnsupportedModelError`
naming the module and the reason, unless ``strict=False``. Only the configured model is touched.

>>> import torch, transformers
>>> from padfree import configure_packing
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(cfg)
>>> report = configure_packing(model)
>>> report.backend, report.supported, len(report.attention_modules)
('padfree_sdpa', True, 1)
>>> out = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
>>> alone = model(input_ids=torch.tensor([[8, 9]]))
>>> bool(torch.allclose(out.logits[0, 3:], alone.logits[0], atol=1e-5))
True
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from padfree.errors import UnsupportedModelError
from padfree.model.install import (
    PackingReport,
    install_packing,
    unconfigure_packing,
)
from padfree.model.install import families as families
from padfree.model.state import packing_state
from padfree.model.wrappers import (
    adapter_problems,
    chain_names,
    follow_copied_configs,
    packable_model,
    prompt_learning_adapter,
    transformers_model,
)
from padfree.proof import certify, registry, versions

__all__ = [
    "PackingReport",
    "check_packing_support",
    "configure_packing",
    "packing_state",
    "refresh_packing",
    "unconfigure_packing",
]

log = logging.getLogger("padfree")

# configured model -> (its modules when configure_packing returned, the arguments it was called with): what
# refresh_packing compares and calls again with. Weak: a model that is gone takes its entry with it.
_CONFIGURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _supported_types() -> Mapping[str, str]:
    return registry.supported_types()


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODEL_TYPES":  # read from the support table on first use
        return _supported_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configure_packing(model: Any, *, backend: str = "auto", strict: bool = True, sequence_parallel: Any = None
                      ) -> PackingReport:
    """Make ``model`` compute exactly, for a packed batch, what it computes for each sequence alone.

    Args:
        model: a transformers decoder-only causal LM (``*ForCausalLM``, or its base ``*Model``), bare or wrapped:
            PEFT's ``PeftModel`` (LoRA, DoRA, ``modules_to_save``, ...), DDP / FSDP / DeepSpeed, ``torch.compile``,
            nested in any order; the transformers model inside is configured (:mod:`padfree.model.wrappers`). A
            prompt-learning adapter (prefix / prompt tuning, P-tuning) is refused whatever ``strict`` says, and
            an adapter on a convolution over the sequence as any other module padfree cannot make exact.
        backend: ``"auto"`` (the fastest exact backend here: flash-attn or torch varlen on CUDA, per-segment SDPA
            otherwise), ``"sdpa"``, ``"eager"``, ``"flex_attention"``, ``"varlen"`` (CUDA), ``"flash_attention_2"``
            (CUDA + flash-attn), or a ``padfree_*`` name.
        strict: refuse (:class:`UnsupportedModelError`) a model that is not proven packing-exact — by the support
            table, or by certifying a tiny twin of its class on the spot — or that holds a sequence mixer padfree
            cannot make exact; with False, warn and configure what can be configured.
        sequence_parallel: split every forward across a group of ranks (Ulysses): an int ``P`` (the world cut into
            groups of ``P`` consecutive ranks; a collective call), a ``torch.distributed`` process group, or a 1-D
            ``DeviceMesh``. Each rank then passes its slice of the rows (:func:`padfree.split_for_sequence_parallel`)
            and gets its slice's outputs; attention and every boundary-aware mixer run over the whole row, exactly.
            Refused with the module named: query / value / SSM heads the group size does not divide, a
            boundary-aware module with no sharded path, a MoE router loss, ``backend="flash_attention_2"``.
            None or 1: no sequence parallelism. See ``docs/sequence_parallel.md``.

    Returns:
        A :class:`PackingReport`; ``report.proof`` says what proved the model exact. Calling again replaces the
        previous configuration (e.g. another backend).

    After the call, pass boundaries as ``position_ids`` restarting at 0 (``PackedBatch.model_inputs()`` does), a
    LLaMA-Factory segment mask as ``attention_mask``, or ``cu_seq_lens_q``; never together with a cache or a 0/1
    mask (:class:`PackingDisabledError`). Unpacked batches, and generation, run transformers' own code under the
    base backend (``sdpa`` for ``padfree_sdpa``, ...).
    """
    inner = packable_model(model, "configure_packing")
    _CONFIGURED.pop(inner, None)
    report = _configure(inner, backend, strict, sequence_parallel)
    _CONFIGURED[inner] = (_modules(inner), {"backend": backend, "strict": strict,
                                            "sequence_parallel": sequence_parallel})
    return report


def refresh_packing(model: Any) -> PackingReport | None:
    """Configure ``model`` again, with the arguments :func:`configure_packing` last had, if modules were added to
    it, replaced or copied since; its report either way (None: not configured).

    A trainer configures its model, then PEFT may wrap it: LoRA layers replace its projections and
    ``modules_to_save`` deep-copies whole modules — copies of an attention layer or a GatedDeltaNet that carry a
    copy of padfree's per-instance state, not the live one, so they would run packed rows with boundaries
    that no forward updates. Configuring again scans the model as it is now (and refuses what an adapter made
    inexact).
    """
    inner = transformers_model(model, "model")
    state = packing_state(inner)
    if state is None:
        return None
    seen = _CONFIGURED.get(inner)
    if seen is None or seen[0] == _modules(inner):  # unchanged, or set up by install_packing alone (not ours)
        return state.report
    log.info("padfree: %s changed since configure_packing (PEFT adapters or copied modules): configuring it again",
             type(inner).__name__)
    return configure_packing(model, **seen[1])


def _modules(model: Any) -> tuple[int, ...]:
    """Which module objects ``model`` holds, in order (their ids: a replaced or added module changes it)."""
    return tuple(id(m) for m in model.modules())


def _configure(inner: Any, backend: str, strict: bool, sequence_parallel: Any) -> PackingReport:
    problems = adapter_problems(inner)
    if problems and strict:
        raise UnsupportedModelError(f"cannot make {type(inner).__name__} packing-exact: {_joined(problems)}")
    report = install_packing(inner, backend=backend, strict=strict, sequence_parallel=sequence_parallel)
    problems.update(follow_copied_configs(inner, report.attention_modules))
    if problems and strict:
        unconfigure_packing(inner)
        raise UnsupportedModelError(f"cannot make {type(inner).__name__} packing-exact: {_joined(problems)}")
    if problems:  # strict=False: configured anyway, these modules named as not exact
        report.unsupported.update(problems)
        report.supported = False
        warnings.warn(f"padfree: {type(inner).__name__} is only partly packing-exact: {_joined(problems)}",
                      stacklevel=3)
    if report.unsupported:  # strict=False: some modules stay as they are; nothing to prove
        report.proof = "none: some modules could not be made exact"
        return report
    verdict = decide(inner, report)
    report.proof = verdict.how
    if not verdict.ok:
        report.supported = False
        report.unsupported[verdict.module or type(inner).__name__] = verdict.reason
        message = f"cannot make {type(inner).__name__} packing-exact: {verdict.module or 'the model'}: " \
                  f"{verdict.reason}"
        if strict:
            unconfigure_packing(inner)
            raise UnsupportedModelError(message)
        warnings.warn(f"padfree: {message} (strict=False: configured anyway)", stacklevel=3)
    state = packing_state(inner)
    if state is not None:  # images are proven when the first packed batch with images comes (text-only: never)
        state.image_check = functools.partial(certify.certify_images, backend=report.backend)
    log.info("configure_packing(%s): %s", type(inner).__name__, report)
    return report



def _joined(problems: Mapping[str, str]) -> str:
    """``"a, b: why; c: why"``: the modules refused for one reason named together, the reason said once."""
    by_reason: dict[str, list[str]] = {}
    for name, why in problems.items():
        by_reason.setdefault(why, []).append(name)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def check_packing_support(model: Any, *, backend: str = "auto") -> Any:
    """Whether :func:`configure_packing` would accept ``model`` on ``backend``, without configuring it: a
    :class:`~padfree.proof.registry.Verdict` (``ok``, ``how``, ``reason``, ``module``) from the scan, the support
    table, or an on-the-spot certification (cached). Trainers ask this before choosing a padding-free mode.

    ``model`` is what :func:`configure_packing` takes, wrapped or not; anything with no transformers model inside
    raises :class:`UnsupportedModelError` (a question about no model has no verdict)."""
    inner = transformers_model(model, "model")
    prompt = prompt_learning_adapter(model)
    if prompt is not None:
        return registry.Verdict(False, "configure_packing's scan", f"a prompt-learning PEFT adapter ({prompt}) "
                                f"prepends virtual tokens to every sequence, which a packed row cannot hold",
                                chain_names(model))
    problems = adapter_problems(inner)
    if problems:
        return registry.Verdict(False, "configure_packing's scan", _joined(problems), next(iter(problems)))
    state = packing_state(inner)
    if state is not None:  # already configured: its report says
        report = state.report
        return registry.Verdict(report.supported, report.proof, "; ".join(report.unsupported.values()))
    try:
        report = install_packing(inner, backend=backend, strict=True)
    except UnsupportedModelError as exc:
        return registry.Verdict(False, "configure_packing's scan", str(exc))
    try:
        return decide(inner, report)
    finally:
        unconfigure_packing(inner)


def decide(model: Any, report: PackingReport) -> registry.Verdict:
    """Accept ``model`` (installed with ``report.backend``) from the support table, or certify it on the spot."""
    versions.warn_if_untested()
    status, entry = registry.lookup(model, report.backend)
    table = registry.load()
    if status == "covered":
        runs = ", ".join(f"{b} ({'/'.join(p)})" for b, p in entry["backends"].items())
        return registry.Verdict(True, f"support table: {entry['class']} proven exact by the sweep on transformers "
                                      f"{table['transformers']}: {runs}")
    if status == "refused":
        return registry.Verdict(False, f"support table: refused by the sweep on transformers {table['transformers']}",
                                entry.get("reason", ""), entry.get("module"))
    log.info("padfree: %s is not covered by the support table (%s); certifying it on the spot",
             type(model).__name__, status.removeprefix("uncovered: "))
    return certify.certify(model, report.backend, why=status.removeprefix("uncovered: "))
