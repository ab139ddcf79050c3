"""Boundary-exact sequence mixers: GatedDeltaNet, Mamba-2 (SSD), Mamba-1 selective scan and short convolutions.

Linear-attention and state-space layers carry a recurrent state and a short causal convolution from token to token.
In a packed row both run straight across the boundary between two sequences unless every layer is told where the
sequences start. This family patches every instance of :data:`CLASSES` (never its class, never transformers' module
globals; :mod:`padfree.model.rebind`) so that

- an ordinary batch runs transformers' own forward, unchanged;
- a packed batch runs the *same forward code* with its sequence primitives (``causal_conv1d_fn``,
  ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``, ``mamba_selective_scan``) swapped for boundary-exact ones:
  a kernel of :mod:`padfree.model.cuda_kernels` when one is usable, the exact reference of :mod:`padfree.model.scans`
  otherwise; the fused conv+scan paths report "unavailable" (the model then runs conv and scan separately), and the
  one-token cached-decode functions refuse: a packed batch never has a cache.

Only the token-mixing primitives are replaced: projections, gates, norms and every model-specific multiplier stay
transformers' code, so a packed forward computes, per sequence, what the model computes for that sequence alone.
The other linear-attention families (:mod:`padfree.model.families.kda`) build on :func:`packed_conv1d` and the
:data:`PRIMITIVES` here.

>>> sorted(MIXER_CLASSES)[:3]
['BambaMixer', 'FalconH1Mixer', 'FalconMambaMixer']
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import cuda_kernels, rebind
from padfree.model.cuda_kernels import kernel_status
from padfree.model.rebind import Mixer, Primitives, current_call, no_decode, no_fused_path
from padfree.model.scans import (
    segment_causal_conv1d,
    segment_gated_delta_rule,
    segment_selective_scan,
    segment_ssd_scan,
)
from padfree.model.sharded import ShardedLayout, conv_window, selective_scan_channels

__all__ = ["packed_conv1d"]

log = logging.getLogger("padfree")

# ---- the packed primitives (transformers' signatures), reading the layout of the call in flight ------------------


# The primitives run outside torch.compile's graphs (torch.compiler.disable): they read the boundaries on the host,
# and traced, every new set of lengths would be a recompile. The projections around them still compile.


@torch.compiler.disable
def packed_conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
    call = current_call("causal_conv1d_fn")
    # a slice of a row split across ranks: its first outputs read the taps before it
    x, lay, cut = conv_window(call.lay, hidden_states, weight.shape[-1])
    out = None
    if call.mixer.use_conv_kernel:
        out = cuda_kernels.causal_conv1d_kernel(x, weight, bias, activation, lay)
        if out is None:
            _fall_back(call.mixer, "causal_conv1d")
    if out is None:
        out = segment_causal_conv1d(x, weight, bias, activation, lay)
    return out[..., cut:] if cut else out


@torch.compiler.disable
def _packed_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                             use_qk_l2norm_in_kernel=False, **kwargs):
    call = current_call("chunk_gated_delta_rule")
    if initial_state is not None:
        raise PackingDisabledError("a packed batch reached a GatedDeltaNet with a recurrent state from a cache; "
                                   "packed training never uses a cache (pass use_cache=False)")
    lay = call.lay
    sharded = isinstance(lay, ShardedLayout)
    if sharded:  # this rank's value heads over the whole row (a key head goes with the value heads that read it)
        lay.heads_of(value.shape[2], call.mixer.owner, "value heads")
        if key.shape[2] % lay.sp.size:
            query, key = (x.repeat_interleave(value.shape[2] // key.shape[2], dim=2) for x in (query, key))
        query, key, value, g, beta = (lay.to_heads(x) for x in (query, key, value, g, beta))
        lay = lay.full
    out = None
    if call.mixer.use_scan_kernel:
        out = cuda_kernels.gated_delta_rule_kernel(query, key, value, g, beta, lay, use_qk_l2norm_in_kernel)
        if out is None:
            _fall_back(call.mixer, "fla")
    if out is None:
        out = segment_gated_delta_rule(query, key, value, g, beta, lay, chunk_size=chunk_size,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                       formulation=call.mixer.formulation)
    return (call.lay.to_tokens(out) if sharded else out), None


@torch.compiler.disable
def _packed_ssd(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None, dt_softplus=False,
                dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
    call = current_call("mamba2_chunk_scan")
    if initial_states is not None or return_final_states:
        raise PackingDisabledError("a packed batch reached a Mamba-2 mixer with a cache; packed training never uses "
                                   "a cache (pass use_cache=False)")
    lay = call.lay
    sharded = isinstance(lay, ShardedLayout)
    if sharded:  # this rank's SSM heads over the whole row, with the B/C groups they read
        heads, groups = hidden_states.shape[2], B.shape[2]
        lay.heads_of(heads, call.mixer.owner, "SSM heads")
        hidden_states, dt = lay.to_heads(hidden_states), lay.to_heads(dt)
        A, D, dt_bias = (None if t is None else lay.head_slice(t) for t in (A, D, dt_bias))
        if groups % lay.sp.size == 0:
            B, C = lay.to_heads(B), lay.to_heads(C)
        else:  # the groups do not split with the heads: the whole row of B/C, one group per head of this rank
            B, C = (lay.head_slice(lay.whole_row(t).repeat_interleave(heads // groups, dim=2), dim=2) for t in (B, C))
        lay = lay.full
    out = None
    if call.mixer.use_scan_kernel:
        out = cuda_kernels.ssd_kernel(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, lay)
        if out is None:
            _fall_back(call.mixer, "mamba_ssm")
    if out is None:
        out = segment_ssd_scan(hidden_states, dt, A, B, C, chunk_size, lay, D=D, dt_bias=dt_bias,
                               dt_softplus=dt_softplus, dt_limit=dt_limit)
    return call.lay.to_tokens(out) if sharded else out


@torch.compiler.disable
def _packed_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                           return_last_state=False, use_mambapy=False, use_associative_scan=False, **kwargs):
    call = current_call("mamba_selective_scan")
    if return_last_state:
        raise PackingDisabledError("a packed batch reached a Mamba mixer with a cache; packed training never uses a "
                                   "cache (pass use_cache=False)")
    lay = call.lay
    sharded = isinstance(lay, ShardedLayout)
    if sharded:  # this rank's channels over the whole row; B and C are shared by every channel
        hidden_states, dt, A, B, C, D, z, delta_bias = selective_scan_channels(
            lay, call.mixer.owner, hidden_states, dt, A, B, C, D, z, delta_bias)
        lay = lay.full
    out = segment_selective_scan(hidden_states, dt, A, B, C, lay, D=D, z=z, delta_bias=delta_bias,
                                 delta_softplus=delta_softplus)
    return call.lay.to_tokens(out, seq_dim=2, head_dim=1) if sharded else out


# ---- families: which primitives a mixer's forward calls, and their packed replacements -------------------------


_CONV = ("hidden_states", "weight", "bias", "activation")
_CONV_REPLACE = {"causal_conv1d_fn": packed_conv1d, "causal_conv1d_update": no_decode}

PRIMITIVES = {
    "gated-delta-net": Primitives(
        "GatedDeltaNet",
        {**_CONV_REPLACE, "torch_chunk_gated_delta_rule": _packed_gated_delta_rule,
         "torch_recurrent_gated_delta_rule": no_decode},
        {"causal_conv1d_fn": _CONV, "torch_chunk_gated_delta_rule": (
            "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
            "use_qk_l2norm_in_kernel")},
        ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"), "causal_conv1d", "fla", row_blocks=True),
    "mamba2": Primitives(
        "Mamba-2 (SSD)",
        {**_CONV_REPLACE, "mamba2_chunk_scan": _packed_ssd, "mamba2_selective_state_update": no_decode,
         "mamba2_split_conv1d_scan_combined": no_fused_path},
        {"causal_conv1d_fn": _CONV, "mamba2_chunk_scan": (
            "hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus",
            "dt_limit", "return_final_states")},
        ("causal_conv1d_fn", "mamba2_chunk_scan"), "causal_conv1d", "mamba_ssm", row_blocks=True),
    "mamba": Primitives(
        "Mamba-1 (selective scan)",
        {**_CONV_REPLACE, "mamba_selective_scan": _packed_selective_scan, "mamba_selective_state_update": no_decode,
         "mamba_inner_fn": no_fused_path},
        {"causal_conv1d_fn": _CONV, "mamba_selective_scan": (
            "hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state")},
        ("causal_conv1d_fn", "mamba_selective_scan"), "causal_conv1d", None, row_blocks=True),
    "short-conv": Primitives(
        "short convolution", dict(_CONV_REPLACE), {"causal_conv1d_fn": _CONV}, ("causal_conv1d_fn",),
        "causal_conv1d", None, row_blocks=True),
}

MIXER_CLASSES: dict[str, str] = {
    # class name -> family; each one proven packed == per-sequence by the support sweep and
    # tests/model/test_model_mixers.py
    "Qwen3NextGatedDeltaNet": "gated-delta-net",
    "Qwen3_5GatedDeltaNet": "gated-delta-net",
    "Qwen3_5MoeGatedDeltaNet": "gated-delta-net",
    "OlmoHybridGatedDeltaNet": "gated-delta-net",
    "LaraMiniGatedDeltaNet": "gated-delta-net",  # Qwen3.5's under another name
    "Qwen4ExpTextGatedDeltaNet": "gated-delta-net",
    "BambaMixer": "mamba2",
    "FalconH1Mixer": "mamba2",
    "GraniteMoeHybridMambaLayer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2",
    "Mamba2Mixer": "mamba2",
    "Zamba2MambaMixer": "mamba2",
    "JambaMambaMixer": "mamba",
    "MambaMixer": "mamba",
    "FalconMambaMixer": "mamba",
    "ZambaMambaMixer": "mamba",  # a short convolution, then Mamba-1 selective scans per head
    "Lfm2ShortConv": "short-conv",
    "Lfm2MoeShortConv": "short-conv",
    "Lfm3ShortConv": "short-conv",
    "InklingShortConvolution": "short-conv",
    "Inkling2ShortConvolution": "short-conv",  # on keys, values and after every attention and MLP block
    "Inkling2LoopShortConvolution": "short-conv",
}
#: the classes this module makes boundary-exact (read by :func:`padfree.configure_packing`)
CLASSES = MIXER_CLASSES
#: the classes that also run split across a sequence-parallel group: all of them, since their token mixing is the
#: primitives above, each of which exchanges a slice of tokens for heads (or reads a convolution's history)
SEQUENCE_PARALLEL = frozenset(MIXER_CLASSES)

# family, or class -> (the module attribute holding what the scan splits across ranks, what it is): Zamba runs one
# selective scan per Mamba head, each over that head's channels
_SHARDED_BY = {"gated-delta-net": ("num_v_heads", "value heads"), "mamba2": ("num_heads", "SSM heads"),
               "mamba": ("intermediate_size", "channels"),
               "ZambaMambaMixer": ("mamba_head_dim", "channels per Mamba head")}


def sharding_problem(module: torch.nn.Module, size: int) -> str | None:
    """Why ``module`` cannot run split across ``size`` ranks (None: it can): the heads its scan splits are not a
    multiple of ``size``. Read from the module where it says (the scan checks again on every call)."""
    name = type(module).__name__
    attr, what = _SHARDED_BY.get(name, _SHARDED_BY.get(MIXER_CLASSES[name], (None, None)))
    count = getattr(module, attr, None) if attr else None
    if isinstance(count, int) and count % size:
        return (f"{type(module).__name__} has {count} {what}, which sequence parallelism over {size} ranks cannot "
                f"split evenly; use a group size that divides {count}")
    return None


@functools.cache
def _packed_forward(cls: type) -> Any:
    """The packed forward of mixer class ``cls``: its own forward, its family's primitives replaced."""
    family = PRIMITIVES[MIXER_CLASSES[cls.__name__]]
    return rebind.packed_forward(cls, family.replace, family.signatures, family.required)


_REFERENCE = {
    "gated-delta-net": "exact torch chunked delta rule, state reset per segment ({formulation})",
    "mamba2": "exact torch SSD scan, masked per segment",
    "mamba": "exact torch selective scan, decay zeroed at segment starts (mamba_ssm's selective_scan_fn takes no "
             "boundaries)",
}
KERNEL_DOC = {
    "fla": "flash-linear-attention chunk_gated_delta_rule with cu_seqlens (bf16/fp16 CUDA tensors)",
    "mamba_ssm": "mamba_ssm mamba_chunk_scan_combined with seq_idx (CUDA tensors)",
    "causal_conv1d": "causal-conv1d with seq_idx (CUDA tensors)",
}


def _choice(kernel: str | None, reference: str, on_cuda: bool) -> tuple[bool, str]:
    """``(kernel switched on, description)`` of one primitive."""
    if kernel is None:
        return False, reference
    usable, why = kernel_status(kernel)
    if not usable:
        return False, f"{reference} ({why})"
    if not on_cuda:
        return True, f"{reference} while the model is on the CPU; {KERNEL_DOC[kernel]} on CUDA tensors"
    return True, KERNEL_DOC[kernel]


def describe_mixer(key: str, formulation: str, on_cuda: bool) -> tuple[bool, bool, str]:
    """``(conv kernel on, scan kernel on, one-line description)`` of family ``key`` as it would be installed now."""
    family = PRIMITIVES[key]
    conv_on, conv_doc = _choice(family.conv_kernel, "exact torch conv, taps reset at segment starts", on_cuda)
    reference = _REFERENCE.get(key, "").format(
        formulation=formulation if formulation != "auto" else "masked or per-segment, the cheaper per batch")
    scan_on, scan_doc = _choice(family.scan_kernel, reference, on_cuda) if reference else (False, "")
    parts = ([f"scan: {scan_doc}"] if scan_doc else []) + [f"conv: {conv_doc}"]
    return conv_on, scan_on, f"{family.name}: " + "; ".join(parts)


def install(module: torch.nn.Module, state: Any, *, formulation: str = "auto") -> str:
    """Make one mixer instance boundary-exact for packed batches of the model ``state`` belongs to; returns the
    one-line description of the implementation chosen for its scan and its conv (kernel or exact reference) and why.
    Idempotent: calling it again (a new ``configure_packing``) only rebinds the state.

    Kernels stay switched on when importable even for a model still on the CPU (it may move to CUDA after
    ``configure_packing``); every call checks the tensors' device and dtype again. A kernel that raises at its first
    call is switched off for good: the reference runs, and the description in the model's report says why.
    """
    name = type(module).__name__
    if name not in MIXER_CLASSES:
        raise UnsupportedModelError(f"{name} is not a mixer padfree knows how to make packing-exact")
    key = MIXER_CLASSES[name]
    on_cuda = any(p.is_cuda for p in module.parameters())
    conv_on, scan_on, description = describe_mixer(key, formulation, on_cuda)
    return rebind.install_mixer(module, state, kind=key, packed=_packed_forward(type(module)), description=description,
                                family=PRIMITIVES[key], conv_kernel=conv_on, scan_kernel=scan_on,
                                formulation=formulation)


def _fall_back(info: Mixer, kernel: str) -> None:
    """Switch ``info`` off ``kernel`` (it raised; see :mod:`padfree.model.cuda_kernels`) and rewrite the configured
    model's report, so that ``packing_state(model).report`` says what runs now and why."""
    if cuda_kernels.broken_reason(kernel) is None:
        return
    info.use_conv_kernel &= info.family.conv_kernel != kernel
    info.use_scan_kernel &= info.family.scan_kernel != kernel
    old = info.description
    *_, info.description = describe_mixer(info.kind, info.formulation, info.on_cuda)
    report = getattr(info.state, "report", None)
    if report is not None:
        for qual, description in report.mixers.items():
            if description == old:
                report.mixers[qual] = info.description


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on ``model`` and every mixer inside it; False if nothing was installed."""
    return rebind.uninstall(model)
