"""The machinery of :func:`padfree.configure_packing`, without the decision: scan a model, install the padfree
attention backend, the boundary-aware families and the forward hooks, or take them out again.

:func:`install_packing` finds every attention layer, every module a family claims (:mod:`padfree.model.families`)
and every sequence mixer padfree does not know (refused by name); switches attention to a padfree backend
(:mod:`padfree.model.attention`); turns the cache off for training; and hooks the decoder so that, for every call,
it reads the boundaries into a :class:`~padfree.model.packed.PackedLayout`, refuses what would let packed sequences
see each other (a cache, a 0/1 or prepared mask: :mod:`padfree.model.guards`) and hands the layout on. Unpacked
batches run transformers' own code. Whether the result is *proven* exact is :mod:`padfree.model.configure`'s
question (the support table, or certification on the spot), which is why the proof and certification code use this
module and never that one.

>>> import transformers
>>> cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(cfg)
>>> install_packing(model).attention_modules
['model.layers.0.self_attn']
>>> unconfigure_packing(model)
True
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import logging
import re
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from padfree.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidLayoutError,
    PackingDisabledError,
    UnsupportedModelError,
    describe,
)
from padfree.layout import position_ids_to_segment_ids
from padfree.model import flight, guards, images, mrope
from padfree.model.attention import (
    BACKENDS,
    LAYOUT_KWARG,
    OWNER_ATTR,
    PACKED_FORWARD,
    SHARDED_CALLS,
    register_backends,
)
from padfree.model.families import discover
from padfree.model.packed import BlockRule, PackedLayout
from padfree.model.sharded import ShardedLayout, gather_boundaries, refuse_together
from padfree.model.state import PackingState, packing_state
from padfree.packing.inputs import as_flag
from padfree.sequence_parallel.groups import sequence_parallel_group

__all__ = [
    "PackingReport",
    "install_packing",
    "unconfigure_packing",
]

log = logging.getLogger("padfree")


# Class-name fragments of sequence mixers other than attention: recurrent state, a short causal convolution or a
# token shift that runs across packed boundaries unless it is told where sequences start. Linear-attention classes
# named *Attention (DeltaAttention, LightningAttention, RWKV's SelfAttention) are mixers, not softmax attention;
# top-k key indexers of sparse attention score every key of the row, so they refuse too until a family claims them.
_MIXER_PATTERN = re.compile(
    r"Mamba|GatedDeltaNet|DeltaNet|DeltaAttention|LightningAttention|ShortConv|SSM|LinearAttention|(?i:rwkv)|"
    r"Retention|Hyena|LSTM|Lstm|Recurrent|RgLru|Mixer$|Conv1d|NGram|CCAProjection|TokenShift|TimeMix|Indexer$"
)
# Classes the scan never takes for a mixer although their names match: per-token norms (MambaRMSNormGated) and
# rotary tables. Models (PreTrainedModel) and decoder layers (GradientCheckpointingLayer) are containers: the scan
# looks inside them instead (MambaForCausalLM, JambaMambaDecoderLayer) unless a family claims the class itself.
_NOT_A_MIXER = re.compile(r"Norm(Gated)?$|RotaryEmbedding$")

BACKEND_CHOICES = ("auto", "sdpa", "eager", "flex_attention", "varlen", "flash_attention_2", *BACKENDS)
_ALIASES = {"sdpa": "padfree_sdpa", "eager": "padfree_eager", "flex_attention": "padfree_flex",
            "varlen": "padfree_varlen"}


@functools.cache
def families() -> Mapping[str, types.ModuleType]:
    """Module class name -> the family module that makes it boundary-exact (:func:`padfree.model.families.discover`);
    a class two families claim is an error of the package, caught here."""
    found: dict[str, types.ModuleType] = {}
    for module in discover().values():
        for cls in module.CLASSES:
            if cls in found:
                raise RuntimeError(f"{cls} is claimed by both {found[cls].__name__} and {module.__name__}")
            found[cls] = module
    return types.MappingProxyType(found)


@dataclasses.dataclass
class PackingReport:
    """What :func:`configure_packing` found and did.

    Attributes:
        model_type: ``config.model_type``.
        backend: the attention implementation padfree configured (``padfree_sdpa``, ..., or
            ``flash_attention_2``), under which the model is proven.
        reason: why that backend (``auto``'s choice, or the request), and, for a model whose attention
            implementation cannot be switched (its modeling code computes attention itself), what runs instead.
        kernels: optional kernels importable here and whether they can run (name -> bool).
        attention_modules: qualified names of the attention modules, now boundary-exact.
        mixers: qualified name -> implementation, for every other boundary-aware module: for a scan and a
            conv, the kernel selected or the exact torch reference, and why (a kernel that is not installed, cannot
            run here, failed to import, or failed at its first call — the entry is rewritten then).
        unsupported: qualified name -> what is missing, for every module padfree could not make exact.
        supported: the model is proven packing-exact (see ``proof``) and nothing is unsupported.
        cache_disabled: ``config.use_cache`` was switched off (packed training never uses a cache).
        proof: what proved the model exact (the support table of a sweep, or an on-the-spot certification, and
            where it is cached), or why nothing could.
        sequence_parallel: the group every forward is split across, described ("" without sequence parallelism).
    """

    model_type: str
    backend: str
    reason: str
    kernels: dict[str, bool]
    attention_modules: list[str]
    mixers: dict[str, str]
    unsupported: dict[str, str]
    supported: bool
    cache_disabled: bool
    proof: str = ""
    sequence_parallel: str = ""

    @property
    def mixer_kinds(self) -> dict[str, list[str]]:
        """Implementation -> the mixers running it (one entry per kind of mixer, however many layers)."""
        kinds: dict[str, list[str]] = {}
        for qual, impl in self.mixers.items():
            kinds.setdefault(impl, []).append(qual)
        return kinds

    def __str__(self) -> str:
        lines = [
            f"model type      {self.model_type} ({'supported' if self.supported else 'NOT supported'})",
            f"attention       {self.backend}: {self.reason}",
            f"attention layers {len(self.attention_modules)} boundary-exact",
            "kernels         " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.kernels.items()),
            f"cache           {'switched off for training' if self.cache_disabled else 'already off'}",
        ]
        for impl, quals in self.mixer_kinds.items():  # one line per kind of mixer, not per layer
            where = quals[0] if len(quals) == 1 else f"{len(quals)} layers ({quals[0]}, ...)"
            lines.append(f"mixers          {where}: {impl}")
        if self.sequence_parallel:
            lines.append(f"sequence par.   {self.sequence_parallel}")
        if self.proof:
            lines.append(f"proof           {self.proof}")
        lines += [f"UNSUPPORTED     {name}: {why}" for name, why in self.unsupported.items()]
        return "\n".join(lines)


def _kernels() -> dict[str, bool]:
    cuda = torch.cuda.is_available()
    have = {name: importlib.util.find_spec(name) is not None
            for name in ("flash_attn", "fla", "mamba_ssm", "causal_conv1d")}
    varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return {
        "flash_attn": have["flash_attn"] and cuda,
        "torch varlen_attn": varlen and cuda,
        "flex_attention": importlib.util.find_spec("torch.nn.attention.flex_attention") is not None,
        "flash-linear-attention": have["fla"] and cuda,
        "mamba_ssm": have["mamba_ssm"] and cuda,
        "causal_conv1d": have["causal_conv1d"] and cuda,
    }


def _check_model(model: Any) -> tuple[Any, str]:
    from padfree.model.wrappers import transformers_model

    if transformers_model(model) is not model:  # the machinery installs on the model it is given, never a wrapper
        raise UnsupportedModelError(
            f"install_packing takes the transformers model itself, got the wrapper {type(model).__name__}; "
            f"configure_packing (or padfree.model.wrappers.unwrap_model) finds the model inside")
    from padfree.model import kinds

    why = kinds.not_a_causal_lm(model)
    if why is not None:
        raise UnsupportedModelError(why)
    return model.config, str(model.config.model_type)


def scan_model(model: torch.nn.Module) -> tuple[list[tuple[str, torch.nn.Module]], list[tuple[str, torch.nn.Module]],
                                           list[tuple[str, torch.nn.Module]]]:
    """``(attention modules, modules a family handles, other sequence mixers)`` by qualified name; the submodules
    of a handled module or of a mixer are not listed."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    handlers = families()
    # the model's own name prefixes its module classes: "RecurrentGemmaAttention" is RecurrentGemma's attention,
    # not a recurrent mixer, so the mixer pattern reads the class name without that prefix
    prefix = re.match(r"(.*?)(For[A-Z]|LMHead|Model$|$)", type(model).__name__).group(1)
    attention, handled, mixers = [], [], []
    for name, module in model.named_modules():
        cls = type(module).__name__
        own = cls[len(prefix):] if prefix and cls.startswith(prefix) and len(cls) > len(prefix) else cls
        if any(name.startswith(m + ".") for m, _ in (*handled, *mixers)):
            continue
        if _MODALITY.search(name):
            continue  # a vision / audio tower: text-only packed batches never reach it (refused otherwise)
        if cls in handlers:
            handled.append((name, module))
            continue
        if isinstance(module, (PreTrainedModel, GradientCheckpointingLayer)) or _NOT_A_MIXER.search(cls):
            continue
        softmax = (cls.endswith("Attention") and hasattr(module, "config")) or _dispatches_attention(type(module))
        if softmax and not _MIXER_PATTERN.search(own):
            attention.append((name, module))
        elif _MIXER_PATTERN.search(own) or isinstance(module, torch.nn.Conv1d):
            mixers.append((name, module))
    return attention, handled, mixers


@functools.cache
def _dispatches_attention(cls: type) -> bool:
    """Whether ``cls.forward`` calls transformers' attention interface (an attention module whatever its name:
    LongcatFlashMLA, ...)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "eager_attention_forward" in source


def _route(decoder: torch.nn.Module, has_attention: bool) -> tuple[bool, bool]:
    """``(hand the boundaries on, pass position_ids)`` for a hook on ``decoder``.

    The boundaries (the layout for attention, and ``position_ids`` where the forward has that parameter) travel
    down through the decoder's keyword arguments, as transformers passes attention kwargs to every layer; a decoder
    whose forward takes neither ``position_ids`` nor ``**kwargs``, or a model without attention (mamba, mamba2,
    falcon_mamba: its mixers read the layout of the forward in flight), is hooked at the top instead, where the caller's
    boundary arguments are consumed."""
    params = inspect.signature(type(decoder).forward).parameters
    positions = "position_ids" in params
    var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return has_attention and (positions or var_kwargs), positions


def _features(model: torch.nn.Module, attention: list[tuple[str, torch.nn.Module]], config: Any) -> dict[str, bool]:
    softcap = getattr(config, "attn_logit_softcapping", None) is not None
    sinks = any(getattr(m, "sinks", None) is not None for _, m in attention)
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
    # transformers' SDPA path refuses softcapping and has no sinks; such models run unpacked batches under eager
    no_sdpa = softcap or sinks or not getattr(model, "_supports_sdpa", True)
    return {"softcap": softcap, "sinks": sinks, "dropout": dropout, "no_sdpa": no_sdpa}


def _choose_backend(requested: str, device: torch.device, feats: dict[str, bool], kernels: dict[str, bool]
                    ) -> tuple[str, str]:
    """``(backend name, reason)`` for ``requested`` on a model living on ``device``."""
    needs = [k for k in ("softcap", "sinks", "dropout") if feats[k]]
    if requested in ("auto", "sdpa", "padfree_sdpa") and feats["no_sdpa"]:
        if device.type == "cuda" and requested == "auto" and kernels["flash_attn"] and not feats["sinks"]:
            return "flash_attention_2", "auto: CUDA with flash-attn installed (varlen kernel, exact with cu_seqlens)"
        what = ", ".join(k for k in ("softcap", "sinks") if feats[k]) or "its modeling code"
        return "padfree_eager", (
            f"{requested}: this model's attention ({what}) has no SDPA path in transformers, so per-segment eager "
            f"math runs packed batches and transformers' eager runs unpacked ones")
    if requested == "auto":
        if device.type == "cuda" and kernels["flash_attn"] and not feats["sinks"]:
            return "flash_attention_2", "auto: CUDA with flash-attn installed (varlen kernel, exact with cu_seqlens)"
        if device.type == "cuda" and kernels["torch varlen_attn"] and not needs:
            return "padfree_varlen", "auto: CUDA with torch varlen_attn (flash varlen kernel over cu_seqlens)"
        why = f" ({', '.join(needs)} need the math path of some layers)" if needs else ""
        return "padfree_sdpa", f"auto: per-segment SDPA on {device.type}{why}"
    if requested == "flash_attention_2":
        if not kernels["flash_attn"] or device.type != "cuda":
            raise BackendUnavailableError(
                "backend='flash_attention_2' needs the flash-attn package and a model on a CUDA device; "
                f"flash-attn importable: {importlib.util.find_spec('flash_attn') is not None}, model on {device}; "
                f"use backend='auto' or 'sdpa'"
            )
        if feats["sinks"]:
            raise UnsupportedModelError("flash_attention_2 has no attention sinks; use backend='sdpa'")
        return requested, "requested: flash-attn varlen with cu_seqlens from the layout"
    name = _ALIASES.get(requested, requested)
    backend = BACKENDS[name]
    if backend.device is not None and device.type != backend.device:
        raise BackendUnavailableError(
            f"backend={requested!r} runs on {backend.device} only, but the model is on {device}; use 'sdpa' or 'auto'"
        )
    if name == "padfree_varlen" and not kernels["torch varlen_attn"]:
        raise BackendUnavailableError("backend='varlen' needs torch.nn.attention.varlen (torch >= 2.10) and CUDA")
    missing = [k for k in ("softcap", "sinks", "dropout") if feats[k] and not getattr(backend, k)]
    if name == "padfree_flex" and feats["sinks"] and device.type == "cpu":
        missing.append("sinks on the CPU")
    if missing:
        raise UnsupportedModelError(
            f"backend={requested!r} cannot apply {', '.join(missing)}, which this model's attention uses; "
            f"use backend='sdpa' or 'eager'"
        )
    if name == "padfree_flex" and device.type == "cpu":
        # torch's CPU flex kernel (inductor's C++ template) scores a key block of 8 mod 16 tokens with its 16-wide
        # micro-kernel when head_dim is 8 or 16 and vectors hold 8 floats (AVX2): it reads keys past the block and
        # writes past the scores into the softmax maxima, so rows of 8, 24, ... 120 tokens come out off by 0.1-2 or
        # NaN, differently each run — in padfree's packed rows and in the unpacked forwards transformers runs under
        # flex alike (padfree's BlockMask is exact under torch's uncompiled flex). With no CPU backward either, no
        # training step could use it: refused until a proof on the CPU passes.
        raise UnsupportedModelError(
            f"backend={requested!r} is refused on the CPU: torch {torch.__version__} has no flex_attention backward "
            f"there, and its compiled CPU kernel computes wrong attention for some shapes (head_dim 8 or 16 with "
            f"8-wide float vectors, key blocks of 8 mod 16 tokens: off by up to 2, or NaN), packed or not; use "
            f"backend='sdpa' or 'auto' (exact on the CPU), or flex_attention on a CUDA device"
        )
    return name, f"requested: {backend.doc}"


def install_packing(model: Any, *, backend: str = "auto", strict: bool = True, sequence_parallel: Any = None
                    ) -> PackingReport:
    """:func:`configure_packing`'s machinery without its support decision: backend, boundary-aware modules, cache
    off, forward hooks. Refuses (``strict``) only what it cannot install: a sequence mixer no family handles, and
    under ``sequence_parallel`` (see :func:`configure_packing`) what has no sharded path. This is what the support
    sweep and certification measure; users call :func:`configure_packing`."""
    config, model_type = _check_model(model)
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise InvalidArgumentError(f"backend must be one of {', '.join(BACKEND_CHOICES)}; got {describe(backend)}")
    strict = as_flag(strict, "strict")
    sp = sequence_parallel_group(sequence_parallel)
    if sp is not None and backend == "flash_attention_2":
        raise InvalidArgumentError(
            "backend='flash_attention_2' with sequence_parallel: transformers' flash-attn function cannot be split "
            "across ranks by padfree; use backend='varlen' (torch's flash varlen kernel, CUDA) or 'sdpa'")
    unconfigure_packing(model)

    attention, handled, mixers = scan_model(model)
    kernels = _kernels()
    device = next(model.parameters()).device
    if attention:
        # under sequence parallelism padfree's own functions run attention (they split it); never flash_attention_2
        choice_kernels = kernels if sp is None else {**kernels, "flash_attn": False}
        name, reason = _choose_backend(backend, device, _features(model, attention, config), choice_kernels)
    else:  # no softmax attention through padfree's backends: the families' modules do all the token mixing
        name, reason = "none", ("no attention layer runs through padfree's backends (the boundary-aware modules "
                                "make every sequence mixer exact)")
    state = PackingState(name, report=None)

    unsupported: dict[str, str] = {}
    if not attention and not handled and not mixers:
        unsupported[type(model).__name__] = ("no sequence-mixing module found (expected classes named *Attention, "
                                             "or a known state-space / linear-attention mixer)")
    for qual, module in mixers:
        unsupported[qual] = (
            f"{type(module).__name__} carries state, a causal convolution or a token shift across tokens and "
            f"padfree has no boundary-resetting implementation for it (needs a reset at every sequence start)"
        )
    if sp is not None:
        unsupported.update(_unsharded(model, config, attention, handled, sp))
    impls: dict[str, str] = {}
    if not unsupported or not strict:
        handlers = families()
        for qual, module in handled:
            try:
                impls[qual] = handlers[type(module).__name__].install(module, state)
            except UnsupportedModelError as exc:  # e.g. a forward that is not the shape padfree proved
                unsupported[qual] = str(exc)

    report = PackingReport(
        model_type=model_type, backend=name, reason=reason, kernels=kernels,
        attention_modules=[qual for qual, _ in attention], mixers=impls, unsupported=unsupported,
        supported=not unsupported, cache_disabled=bool(getattr(config, "use_cache", False)),
        sequence_parallel="" if sp is None else str(sp),
    )
    if unsupported:
        what = "; ".join(f"{k}: {v}" for k, v in unsupported.items())
        if strict:
            _uninstall_families(model)
            raise UnsupportedModelError(f"cannot make {type(model).__name__} packing-exact: {what}")
        warnings.warn(f"padfree: {type(model).__name__} is only partly packing-exact: {what}", stacklevel=2)

    register_backends()
    state.previous = (_implementations(config) if attention else None, getattr(config, "use_cache", None))
    if attention:
        model.set_attn_implementation(_language_only(config, name))
        if sp is not None and config._attn_implementation != name:  # checked before any hook is installed
            _uninstall_families(model)
            raise UnsupportedModelError(
                f"cannot split {type(model).__name__} across ranks: its attention implementation cannot be switched "
                f"to padfree's (it stays {config._attn_implementation!r}), so attention would run over each rank's "
                f"slice alone")
        if config._attn_implementation != name:
            report.reason += (
                f"; but {type(model).__name__} cannot switch its attention implementation (it stays "
                f"{config._attn_implementation!r}): its own attention code runs every batch, packed rows with the "
                f"masks transformers builds from their position_ids")
    for _, module in attention:  # the layout of the forward in flight, for layers that drop their kwargs
        setattr(module, OWNER_ATTR, state)
        if sp is not None:  # a slice's attention must go through padfree's split function, or it sees the slice only
            state.handles += _sharded_attention_guard(module)
    state.report = report
    state.sp = sp
    config.use_cache = False
    # A forward's layout travels with it (padfree.model.flight): the layers' checkpoint functions and hooks carry it
    # into an activation-checkpointing recompute, which may run after other forwards of this model.
    state.checkpointed = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    for layer in _layers(model):
        state.handles += flight.layer_hooks(layer, state, LAYOUT_KWARG)
    # The hook goes on the decoder, which receives position_ids from every registered *ForCausalLM and hands its
    # keyword arguments down to the attention layers (see _route for the models hooked at the top instead).
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    forward, positions = _route(decoder, bool(attention))
    target = decoder if forward else model
    # The hooks find what they need on the module they fire on, never in a closure: a deep copy of the configured
    # model (a reference model, an EMA copy) then runs its own hooks with its own state.
    target.__dict__[_HOOKED] = _Hooked(state, config, forward, positions)
    if _multimodal(model):
        # A multimodal model builds its masks (and merges image / audio features) above the language model: the
        # packed forward must be marked before that, and a packed batch with non-text inputs laid out or refused
        # there — also when the model itself is the hooked module (its multimodal hook runs first).
        model.__dict__[_HOOKED] = _Hooked(state, config, forward, positions)
        state.handles += [
            model.register_forward_pre_hook(_multimodal_pre_hook, with_kwargs=True),
            model.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
        ]
        # the inner multimodal model merges the images too, and is called on its own (a fused LM head's
        # base_model, a user's model.model(...)): a packed row with images entering there is laid out (again, to
        # the same result) or refused there as well
        from transformers import PreTrainedModel

        inner = getattr(model, "model", None)
        if isinstance(inner, PreTrainedModel) and inner is not target and "pixel_values" in guards.parameters(
                type(inner).forward):
            inner.__dict__[_HOOKED] = _Hooked(state, config, forward, positions, owner=model)
            state.handles += [
                inner.register_forward_pre_hook(_multimodal_pre_hook, with_kwargs=True),
                inner.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
            ]
    state.handles += [
        target.register_forward_pre_hook(_decoder_pre_hook, with_kwargs=True),
        target.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
    ]
    model._padfree_state = state
    return report


_HOOKED = "_padfree_hooked"


@dataclasses.dataclass(eq=False)
class _Hooked:
    """What the forward hooks of a configured model read from the module they are on."""

    state: PackingState
    config: Any
    forward: bool  # hand the boundaries on as keyword arguments (see _route)
    positions: bool  # the hooked forward takes position_ids
    owner: Any = None  # the vision-language model whose images verdict a hooked inner model answers to


# Under torch.compile the hooks (like the packed attention and the mixers' segment primitives) run outside the graphs:
# they read the boundaries on the host, and traced, each new set of lengths would fail a guard and recompile — after
# eight, dynamo gives up on the model. Outside, the graphs see only (dynamic) tensor shapes.
@torch.compiler.disable
def _decoder_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    hooked: _Hooked = module.__dict__[_HOOKED]
    return _before(hooked.state, hooked.config, module, args, kwargs, forward=hooked.forward,
                   positions=hooked.positions)


@torch.compiler.disable
def _multimodal_pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
                         ) -> tuple[tuple, dict[str, Any]] | None:
    hooked: _Hooked = module.__dict__[_HOOKED]
    return _before_multimodal(hooked.state, module, args, kwargs, owner=hooked.owner)


@torch.compiler.disable
def _post_hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    _after(module.__dict__[_HOOKED].state)


def _implementations(config: Any) -> dict[str, Any]:
    """The attention implementation of ``config`` and of every sub-config under it, in the nested form
    ``set_attn_implementation`` takes (what :func:`unconfigure_packing` restores)."""
    return _tree(config, lambda c: c._attn_implementation)


def _language_only(config: Any, name: str) -> dict[str, Any]:
    """``set_attn_implementation``'s nested form that gives ``name`` to the language model's configs (the text
    config, the configs under it and the configs above it) and leaves every other sub-config — a vision or audio
    tower's, a projector's — on its own implementation: a tower runs each image apart, under the masks its model
    builds (bidirectional within an image), which padfree's packed functions, reading the text's boundaries, must
    not replace. A language model's own config (its own text config) gives ``name`` to everything."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    below = _under(text)

    def language(c: Any) -> bool:
        return c is text or any(b is c for b in below) or any(u is text for u in _under(c))

    return _tree(config, lambda c: name if language(c) else c._attn_implementation)


def _tree(config: Any, value: Callable[[Any], Any]) -> dict[str, Any]:
    """``{"": value(config), key: the same for each sub-config that has an attention implementation, ...}``."""
    tree: dict[str, Any] = {"": value(config)}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            tree[key] = _tree(sub, value)
    return tree


def _under(config: Any) -> list[Any]:
    """Every sub-config under ``config``, at any depth."""
    found = []
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            found += [sub, *_under(sub)]
    return found


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units activation checkpointing wraps: transformers' checkpointable layers, else the members of the
    model's layer lists."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        layers = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
    return layers


def _sharded_attention_guard(module: torch.nn.Module) -> list:
    """Hooks that make ``module`` refuse a sequence-parallel forward in which it never called padfree's split
    attention (it computed attention itself, over its slice alone). Every rank runs the same modules, so every rank
    raises at the same point."""
    def before(mod: torch.nn.Module, args: tuple) -> None:
        mod.__dict__["_padfree_calls_before"] = mod.__dict__.get(SHARDED_CALLS, 0)

    def after(mod: torch.nn.Module, args: tuple, output: Any) -> None:
        state = mod.__dict__.get(OWNER_ATTR)
        if state is None or not isinstance(flight.layout_in_flight(state), ShardedLayout):
            return
        if mod.__dict__.get(SHARDED_CALLS, 0) == mod.__dict__.get("_padfree_calls_before", 0):
            raise UnsupportedModelError(
                f"{type(mod).__name__} ran its attention without padfree's split attention function (it computes "
                f"attention itself, not through transformers' attention interface), so under sequence parallelism "
                f"it attended over this rank's slice alone; this model cannot be split across ranks")

    return [module.register_forward_pre_hook(torch.compiler.disable(before)),
            module.register_forward_hook(torch.compiler.disable(after))]


def _unsharded(model: Any, config: Any, attention: list[tuple[str, torch.nn.Module]],
               handled: list[tuple[str, torch.nn.Module]], sp: Any) -> dict[str, str]:
    """Qualified name -> why it cannot run split across the ``sp.size`` ranks of a sequence-parallel group: a
    module whose family has no sharded path, query / value heads the group size does not divide, a MoE router loss
    (a mean over the tokens of the forward: each rank would see its slice only)."""
    problems: dict[str, str] = {}
    for qual, module in handled:
        family = families()[type(module).__name__]
        if type(module).__name__ not in getattr(family, "SEQUENCE_PARALLEL", ()):
            problems[qual] = (f"{type(module).__name__} ({family.CLASSES[type(module).__name__]}) has no "
                              f"sequence-parallel path: padfree cannot split it across ranks")
        else:
            check = getattr(family, "sharding_problem", None)
            why = None if check is None else check(module, sp.size)
            if why is not None:
                problems[qual] = why
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for qual, module in attention:
        heads = getattr(module, "num_heads", None) or getattr(text, "num_attention_heads", None)
        if not _dispatches_attention(type(module)):
            problems[qual] = (f"{type(module).__name__} computes attention itself, not through transformers' "
                              f"attention interface, so padfree cannot split it across ranks")
        elif isinstance(heads, int) and heads % sp.size:
            problems[qual] = (f"{type(module).__name__} has {heads} query heads, which sequence parallelism over "
                              f"{sp.size} ranks cannot split evenly; use a group size that divides {heads}")
    if getattr(text, "output_router_logits", False):
        problems[type(model).__name__] = (
            "output_router_logits=True: the MoE router's load-balancing loss is a mean over the tokens of a forward, "
            "and split across ranks each would see its slice only; set output_router_logits=False to train with "
            "sequence parallelism")
    return problems


def _uninstall_families(model: torch.nn.Module) -> None:
    for module in {id(m): m for m in families().values()}.values():
        module.uninstall(model)


def unconfigure_packing(model: Any) -> bool:
    """Undo :func:`configure_packing` (hooks, attention implementation, ``use_cache``) on ``model`` or the
    transformers model inside its wrappers (PEFT, DDP / FSDP, ``torch.compile``); False if not configured."""
    from padfree.model.wrappers import restore_copied_configs, transformers_model

    model = transformers_model(model)
    state = packing_state(model)
    if state is None:
        return False
    for handle in state.handles:
        handle.remove()
    flight.unbind_checkpoints(model)
    for module in model.modules():
        for attr in (OWNER_ATTR, SHARDED_CALLS, "_padfree_calls_before", _HOOKED, flight.LAYER_ATTR):
            module.__dict__.pop(attr, None)
    _uninstall_families(model)
    attn, use_cache = state.previous
    if attn is not None:
        model.set_attn_implementation(attn)
    restore_copied_configs(model)  # after the model's own: copies follow it
    if use_cache is not None:
        model.config.use_cache = use_cache
    del model._padfree_state
    return True


# ---- the forward hook ------------------------------------------------------------------------------------------------


def _restarts(pos: torch.Tensor, real: torch.Tensor | None) -> bool:
    """Whether consecutive real tokens of some row have positions that are not ``p, p + 1`` (a packed row)."""
    jump = pos[:, 1:] != pos[:, :-1] + 1
    if real is not None:
        jump &= real[:, 1:] & real[:, :-1]
    return bool(jump.any())


def _fix(what: str) -> str:
    return (f"{what} would let the packed sequences of a row attend to each other; pass the boundaries alone "
            f"(position_ids restarting at 0, a segment-id attention_mask or cu_seq_lens_q) — "
            f"PackedBatch.model_inputs() builds exactly that")


def _tokens(named: dict[str, Any]) -> tuple[int, int] | None:
    """``(B, T)`` of the call's tokens (``input_ids`` or ``inputs_embeds``), None without them."""
    ids = named.get("input_ids")
    ref = ids if isinstance(ids, torch.Tensor) else named.get("inputs_embeds")
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        return None
    return tuple(ref.shape[:2])


def _layout(named: dict[str, Any], shape: tuple[int, int] | None = None) -> PackedLayout | None:
    """The packed layout of a call (None: an ordinary batch), read from its boundary arguments; ``shape``: the
    tokens' ``(B, T)`` when they are not in ``named`` (a sequence-parallel row, gathered from its slices)."""
    shape = shape or _tokens(named)
    if shape is None:
        return None
    batch, seq_len = shape
    mask, pos, cu = named.get("attention_mask"), named.get("position_ids"), named.get("cu_seq_lens_q")
    if isinstance(mask, dict) and all(v is None for v in mask.values()):
        mask = None  # a multimodal model's per-layer-type mapping, built empty for a packed forward
    if pos is not None:
        if pos.dim() == 1:
            pos = pos.unsqueeze(0)
        if pos.dim() == 3:  # multi-row rotary positions (mRoPE): the row that tells where the samples start
            pos = _boundary_row(pos, cu is not None)
        elif pos.dim() != 2:
            raise InvalidLayoutError(f"position_ids must be (B, T), or (R, B, T) rotary rows; got a tensor of shape "
                                     f"{tuple(pos.shape)}")
        if pos is not None and pos.shape[0] == 1 and batch > 1:
            pos = pos.expand(batch, -1)
    segments = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() > 0 and bool(mask.max() > 1)
    lens = named.get("seq_lens")
    if segments:
        lay = PackedLayout.from_segment_ids(mask)
    elif cu is not None:
        lay = PackedLayout.from_cu_seqlens(cu, batch, seq_len)
    elif isinstance(lens, torch.Tensor):
        lay = _from_seq_lens(lens, batch, seq_len)
    elif pos is not None and _restarts(pos, mask[:, -pos.shape[1]:].bool()  # decoding: the mask covers the cache
                                          if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None):
        if mask is not None:
            what = (guards.find_dense_mask({"attention_mask": mask}, (batch, seq_len))
                    or (f"a {mask.dim()}-D {'0/1 ' if mask.dim() == 2 else ''}attention_mask"
                        if isinstance(mask, torch.Tensor) else f"an attention_mask ({type(mask).__name__})"))
            raise PackingDisabledError(_fix(f"{what} next to position_ids that restart inside a row"))
        lay = PackedLayout.from_position_ids(pos)
    else:
        return None
    if pos is not None and lay.source != "position_ids":
        agree = position_ids_to_segment_ids(pos, attention_mask=mask if segments else None)
        if not torch.equal(agree, lay.segment_ids.to(agree.dtype)):
            raise InvalidLayoutError(f"position_ids and {lay.source} disagree on where the sequences start")
    return lay


def _from_seq_lens(lens: torch.Tensor, batch: int, seq_len: int) -> PackedLayout:
    """The layout of ``seq_lens``: ``(n,)`` the tokens of every sequence, row after row, covering the ``B x T``
    tokens (a padding run counts as a sequence of its own), none crossing into the next row."""
    flat = lens.reshape(-1).to(torch.int64)
    try:
        return PackedLayout.from_cu_seqlens(torch.cat([flat.new_zeros(1), flat.cumsum(0)]), batch, seq_len)
    except InvalidLayoutError:
        raise InvalidLayoutError(
            f"seq_lens = {flat.tolist()[:12]}{'...' if flat.numel() > 12 else ''} does not lay out the {batch} x "
            f"{seq_len} tokens: the lengths of every sequence row after row must cover each row exactly (a padding "
            f"run as a sequence of its own); or pass position_ids restarting at 0 per sequence "
            f"(PackedBatch.model_inputs())") from None


def _boundary_row(pos: torch.Tensor, other_spelling: bool) -> torch.Tensor | None:
    """The ``(B, T)`` row of multi-row rotary positions ``(R, B, T)`` that marks where packed samples start.

    ``(4, B, T)`` is mRoPE with its text row first (text, temporal, height, width): the text row restarts at 0 for
    every sample and steps by 1. Rows that are all equal are text positions written out per rotary axis. Otherwise
    (rotary rows only, which an image makes differ) a first row that never goes back is one sample per row; one that
    goes back packs several, and needs ``other_spelling`` (``cu_seq_lens_q``) beside it to say where each starts,
    else it is refused: an image's rows also jump inside one sample, so guessing would be silently wrong. None: the
    rows mark no boundary (one sample per row, or the other spelling says where the samples start)."""
    if pos.shape[0] == 4:
        return pos[0]
    if bool((pos == pos[:1]).all()):
        return pos[0]
    if other_spelling or not bool((pos[0, :, 1:] < pos[0, :, :-1]).any()):
        return None
    raise PackingDisabledError(
        f"position_ids of shape {tuple(pos.shape)} (rotary rows) go back inside a row, so the row packs several "
        f"samples, but rotary rows alone do not say where each starts (an image's rows jump back inside one sample); "
        f"pass the 4-row form with the text row first ((4, B, T): text, temporal, height, width) or cu_seq_lens_q "
        f"beside them")


_BOUNDARY_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_lens")


def _before(state: PackingState, config: Any, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], *,
            forward: bool = True, positions: bool = True) -> tuple[tuple, dict[str, Any]]:
    """The pre-hook: the layout of this call, guards, and the arguments the hooked module runs with. ``forward``:
    hand the boundaries on (the layout for attention, and ``position_ids`` when ``positions``); False for a module
    that takes none, whose mixers read the layout of the forward in flight — its boundary arguments are dropped
    rather than left to ``**kwargs``. Either way the call enters its layout (:mod:`padfree.model.flight`) for the
    modules that read it there, until the call returns.

    Arguments are read by name after binding the call to the module's forward signature, so positional arguments count
    too, and caches and dense masks are recognised by type and shape (:mod:`padfree.model.guards`) rather than by
    the keyword a transformers release happens to use."""
    forward_fn = type(module).forward
    named = guards.bind(forward_fn, (module, *args), kwargs)
    if named is not None:
        named.pop(next(iter(guards.parameters(forward_fn))), None)  # self
    flight.bind_checkpoints(state.checkpointed)
    if state.sp is not None:
        lay = _sharded_layout(state, config, named, forward_fn)
    else:
        handed = None if named is None else named.pop(LAYOUT_KWARG, None)
        lay = None if named is None else _layout(named)
        if isinstance(handed, PackedLayout):  # the outer hook's layout, with what only it could see (image blocks)
            if lay is None or not torch.equal(lay.segment_ids, handed.segment_ids.to(lay.segment_ids.device)):
                raise InvalidLayoutError(f"{type(module).__name__} was handed a packed layout whose sequences are not "
                                         f"those of its own position_ids")
            if handed.blocks is not None and state.backend == "flash_attention_2":
                raise PackingDisabledError(
                    "image blocks that attend bidirectionally with flash_attention_2: transformers' flash function "
                    "reads no layout and would drop them; use backend='sdpa' or 'varlen'")
            lay = handed
        if lay is None or (not lay.is_packed and lay.source != "attention_mask"):
            state.tokens.append(((PACKED_FORWARD.reset, PACKED_FORWARD.set(False)),
                                 (flight.leave, flight.enter(state, None))))
            return args, kwargs
        _refuse_leaks(config, named, forward_fn, lay.shape)
        if named.get("input_ids") is None and named.get("inputs_embeds") is not None:
            _refuse_unconfigured_parent(state, module)
    # everything by name from here on: a positional argument and a keyword for the same parameter would clash
    args, kwargs = _by_name(named)
    kwargs.update(attention_mask=None, use_cache=False)
    kwargs.pop("seq_lens", None)  # read into the layout: the layers below take their boundaries from it
    if forward:
        given = named.get("position_ids")
        if positions:  # rotary rows (mRoPE) go on as given: the layout read its boundaries from them
            kwargs["position_ids"] = given if isinstance(given, torch.Tensor) and given.dim() == 3 else lay.position_ids
        else:
            kwargs.pop("position_ids", None)
        kwargs[LAYOUT_KWARG] = lay
        if state.backend == "flash_attention_2":
            kwargs.update(cu_seq_lens_q=lay.cu_seqlens, cu_seq_lens_k=lay.cu_seqlens,
                          max_length_q=lay.max_seqlen, max_length_k=lay.max_seqlen)
    else:
        for key in _BOUNDARY_KWARGS:
            kwargs.pop(key, None)
    state.tokens.append(((PACKED_FORWARD.reset, PACKED_FORWARD.set(True)), (flight.leave, flight.enter(state, lay))))
    return args, kwargs


def _refuse_unconfigured_parent(state: PackingState, module: torch.nn.Module) -> None:
    """PackingDisabledError when this packed call of ``module`` (its tokens given as embeddings) comes from inside a
    multimodal model padfree did not configure: that model merged image or audio features into the embeddings and
    made the positions (mRoPE) without padfree seeing either, so the packed row cannot be checked or made exact."""
    from transformers import PreTrainedModel

    parent = None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, PreTrainedModel) and owner is not module:
            if packing_state(owner) is state or getattr(owner.__dict__.get(_HOOKED), "state", None) is state:
                return  # the call comes through the model padfree configured (whose own hook saw its inputs)
            if parent is None and _multimodal(owner) and packing_state(owner) is None:
                parent = owner
        frame = frame.f_back
    if parent is not None:
        raise PackingDisabledError(
            f"a packed batch reached {type(module).__name__}, configured on its own, from inside "
            f"{type(parent).__name__}, a multimodal model padfree did not configure: its image and audio features and "
            f"its positions are made outside padfree's view; configure the whole model "
            f"(configure_packing({type(parent).__name__} instance)) or pass these batches unpacked")


def _refuse_leaks(config: Any, named: dict[str, Any], forward_fn: Any, shape: tuple[int, int]) -> None:
    """PackingDisabledError for what would let the packed sequences of a ``shape`` batch see each other."""
    cache = guards.find_cache(named, forward_fn)
    if cache is not None:
        raise PackingDisabledError(_fix(f"{cache} (a cache)"))
    dense = guards.find_dense_mask(named, shape)
    if dense is not None:
        raise PackingDisabledError(_fix(dense))
    if named.get("encoder_hidden_states") is not None:
        raise PackingDisabledError(
            "encoder_hidden_states with a packed batch: cross-attention would give every token of a row that row's "
            "one encoder output, not one per packed sequence; pass these batches unpacked")
    use_cache = named.get("use_cache")
    if use_cache or (use_cache is None and getattr(config, "use_cache", False)):
        raise PackingDisabledError(_fix("use_cache=True (transformers then builds plain causal masks over the row)")
                                   + "; pass use_cache=False")


def _sharded_layout(state: PackingState, config: Any, named: dict[str, Any] | None, forward_fn: Any) -> ShardedLayout:
    """The layout of a forward under sequence parallelism: every call is this rank's slice of a row, whether the
    row holds one sequence or many. The slices' boundaries are gathered from the group into the row's layout; what
    would leak (a cache, a dense mask, a 0/1 mask with padding) is refused as for a packed batch."""
    sp = state.sp
    shape = None if named is None else _tokens(named)
    refusal = None  # found on this rank; every rank of the group must learn of it before anyone raises
    try:
        if shape is None:
            raise PackingDisabledError(
                "a forward of a model configured with sequence_parallel got no input_ids / inputs_embeds of shape "
                "(B, S): every call must pass this rank's slice of the rows (split_for_sequence_parallel)")
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
            if named.get(key) is not None:
                raise PackingDisabledError(
                    f"{key} with sequence_parallel: it describes a whole row, not this rank's slice; pass the "
                    f"slice's position_ids (split_for_sequence_parallel gives them) and leave {key} out")
        if named.get("output_router_logits"):
            raise PackingDisabledError(
                "output_router_logits=True with sequence_parallel: the MoE load-balancing loss is a mean over the "
                "tokens of a forward, and each rank holds a slice of them; pass output_router_logits=False")
        _refuse_leaks(config, named, forward_fn, shape)
    except PackingDisabledError as exc:
        refusal = str(exc)
    batch, width = shape or (0, 0)
    row = gather_boundaries(named or {}, sp, batch, width, refusal=refusal)
    total = width * sp.size
    mask = row["attention_mask"]
    if mask is not None and int(mask.max()) <= 1:
        if int(mask.min()) == 0:
            raise PackingDisabledError(
                "a 0/1 attention_mask with padding reached a model configured with sequence_parallel: padded tokens "
                "would share a segment with real ones; pass the slices split_for_sequence_parallel makes (it turns "
                "right padding into a segment of its own) instead of a mask")
        row["attention_mask"] = None  # every token real: a mask of ones marks no boundary
    row_named = {k: v for k, v in row.items() if v is not None}
    lay = _layout(row_named, (batch, total))
    if lay is None:  # no boundary inside any row: one sequence per row, positions as given (or counted)
        pos = row["position_ids"]
        if pos is None:
            ref = named["input_ids"] if isinstance(named.get("input_ids"), torch.Tensor) else named["inputs_embeds"]
            pos = torch.arange(total, device=ref.device).expand(batch, total)
        lay = PackedLayout.from_position_ids(pos)
    return ShardedLayout(lay, sp)


# module names on the paths that only non-text inputs take (vision and audio towers, their projectors): a text-only
# packed batch never reaches them, and a packed batch with such inputs is refused (see _before_multimodal)
_MODALITY = re.compile(r"(^|\.)(vision|visual|audio|image|speech|video|multi_modal|mm_|embed_vision|embed_audio)")
# the arguments of a multimodal model's forward that a text-only packed batch may carry (a tensor under any other
# name — pixel_values, image_grid_thw, mm_encoder_outputs, inputs_embeds, what a later release adds — is an input
# padfree cannot see into, so a packed batch with it is refused until handled)
_TEXT_ARGUMENTS = frozenset({
    "input_ids", "attention_mask", "position_ids", "labels", "cache_position", "logits_to_keep", "use_cache",
    "return_dict", "output_attentions", "output_hidden_states", "output_router_logits", "return_loss",
    "num_items_in_batch", "shift_labels", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "seq_lens", "token_type_ids", "mm_token_type_ids", "cache", "past_key_values",
})
# token type ids whose non-zero entries mark image (or audio) tokens, which attend bidirectionally in their block
_TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")


def _non_text(named: dict[str, Any]) -> list[str]:
    """The names of the arguments of a multimodal forward that carry something other than text (token types only
    where they mark non-text tokens)."""
    found = []
    for name, value in named.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            continue
        if name in _TOKEN_TYPES:
            if isinstance(value, torch.Tensor) and bool(value.any()):
                found.append(name)
        elif name not in _TEXT_ARGUMENTS and _holds_tensor(value):
            found.append(name)
    return found


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return hasattr(value, "to_tuple") or hasattr(value, "last_hidden_state")  # a ModelOutput of features


def _multimodal(model: torch.nn.Module) -> bool:
    config = model.config
    return any(getattr(config, key, None) is not None for key in ("vision_config", "audio_config")) or \
        type(model).__name__.endswith("ForConditionalGeneration")


def _before_multimodal(state: PackingState, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                       owner: torch.nn.Module | None = None) -> tuple[tuple, dict[str, Any]] | None:
    """The outer pre-hook of a multimodal model: for a packed batch, lay out what padfree can make exact (the images
    and videos of an mRoPE model: each sample's rotary positions, :mod:`padfree.model.mrope`), refuse every other
    non-text input, and mark the forward packed before the model builds its masks (padfree's mask functions then
    build none)."""
    named = guards.bind(type(module).forward, (module, *args), kwargs) or {}
    named.pop(next(iter(guards.parameters(type(module).forward)), "self"), None)
    call = None
    mask = named.get("attention_mask")
    lay = None if state.sp is not None else _layout(named)
    packed = state.sp is not None or (lay is not None and lay.is_packed)
    if packed and state.sp is None and named.get("position_ids") is None:
        # the model would count positions over the whole row (mRoPE: its rope index over the row as one sample)
        named = {**named, "position_ids": lay.position_ids}
        call = _by_name(named)
    if packed:
        problem = None
        extra = _non_text({k: v for k, v in named.items() if k not in ("self", "kwargs")})
        cache = guards.find_cache(named, type(module).forward)
        rule = images.block_rule(module)
        # a sample's prefix is a block whatever it holds (PaliGemma's text rows too): its token types always laid out
        prefix = rule is not None and rule.per_sample and isinstance(named.get(rule.source), torch.Tensor)
        carried = bool(extra)
        if extra and state.sp is None and set(extra) <= mrope.ROPE_INPUTS and mrope.rope_index(module) is not None:
            call = _with_rope_rows(module, named, lay)  # exact: every sample's own rotary positions
            extra = []
        elif (extra or prefix) and state.sp is None and rule is not None and set(extra) <= images.image_inputs(module):
            call = _with_blocks(module, named, rule, lay)  # exact: each image a bidirectional block of its sample
            extra = []
        elif extra and state.sp is None and images.image_route(module) == "causal" and \
                set(extra) <= images.image_inputs(module):
            extra = []  # exact: causal image tokens, each image's features from its own pixels, in row order
        unproven = _images_unproven(state, owner or module) if carried and not extra else None
        if extra:
            problem = (f"a packed batch reached {type(module).__name__} with non-text inputs ({', '.join(extra)}): "
                       f"padfree packs text-only batches (input_ids) through this multimodal model (its image, video "
                       f"and audio paths are not made boundary-aware); pass these batches unpacked")
            why = images.image_refusal(module)  # the module that keeps its images from being made exact
            problem = f"{problem} ({why})" if why is not None else problem
        elif unproven is not None:
            problem = (f"a packed batch with images reached {type(module).__name__}, whose images padfree lays out "
                       f"per sample but has not proven exact: {unproven}; pass these batches unpacked")
        elif cache is not None:
            problem = _fix(f"{cache} (a cache)")
        elif state.sp is not None and isinstance(mask, torch.Tensor) and mask.numel() and not bool((mask == 1).all()):
            # the model turns its mask into per-layer masks the language model's hook never sees
            problem = ("an attention_mask with a model configured with sequence_parallel: pass the slices "
                       "split_for_sequence_parallel makes (boundaries as position_ids) instead")
        if state.sp is not None:
            refuse_together(state.sp, problem)  # every rank of the group raises, none waits in a collective
        elif problem is not None:
            raise PackingDisabledError(problem)
    state.tokens.append(((PACKED_FORWARD.reset, PACKED_FORWARD.set(packed)),))
    return call


def _images_unproven(state: PackingState, module: torch.nn.Module) -> str | None:
    """Why images in packed rows are not proven exact for ``module`` (None: proven, or not asked — the machinery
    alone, as the proofs run it): ``configure_packing``'s check (the support table's images verdict for its type,
    or a proof on a tiny twin), asked once per configuration."""
    if state.image_check is None:
        return None
    if "why" not in state.images:
        state.images["why"] = state.image_check(module)
    return state.images["why"]


def _by_name(named: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A bound call's arguments as the ``(args, kwargs)`` a pre-hook returns: every named one by name."""
    kwargs = {name: value for name, value in named.items() if "[" not in name}
    return tuple(named[name] for name in named if "[" in name), kwargs


def _with_blocks(module: torch.nn.Module, named: dict[str, Any], rule: BlockRule, lay: PackedLayout
                 ) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments, all by name, with the forward's layout ``lay`` carrying the image blocks of every sample
    (the model's mask, which padfree's mask functions do not build in a packed forward, made per sample): the
    language model's hook takes it from its keyword arguments."""
    types = named.get(rule.source)
    if not isinstance(types, torch.Tensor) or types.shape != lay.shape:
        raise PackingDisabledError(
            f"a packed batch with images reached {type(module).__name__} without {rule.source} of the tokens' "
            f"(B, T) shape (the processor returns it): its images attend bidirectionally within their block")
    blocked = lay.with_token_types(types, rule)
    if blocked.blocks is None:  # no prefix (every token causal): the rule still says the types were read
        blocked = dataclasses.replace(lay, block_rule=rule)
    args, kwargs = _by_name(named)
    kwargs[LAYOUT_KWARG] = blocked
    return args, kwargs


def _with_rope_rows(module: torch.nn.Module, named: dict[str, Any], lay: PackedLayout
                    ) -> tuple[tuple, dict[str, Any]]:
    """The call's arguments, all by name, with ``position_ids`` the ``(4, B, T)`` mRoPE rows of its samples (laid
    out by ``lay``). Rows the caller passed must be those: a sample's rotary rows computed over the whole packed row
    would run on from the samples before it."""
    rows = mrope.packed_rope_rows(module, named, lay)
    given = named.get("position_ids")
    if isinstance(given, torch.Tensor) and given.dim() == 3:
        mine = rows if given.shape[0] == 4 else rows[1:]
        if given.shape != mine.shape or not torch.equal(given.to(mine.dtype), mine):
            raise InvalidLayoutError(
                f"position_ids of shape {tuple(given.shape)} are not the rotary positions of the packed samples "
                f"(each sample's own get_rope_index, restarting at 0); pass position_ids restarting at 0 per sample "
                f"(B, T) and padfree computes them")
    args, kwargs = _by_name(named)
    kwargs["position_ids"] = rows
    return args, kwargs

def _after(state: PackingState) -> None:
    if state.tokens:
        for reset, token in reversed(state.tokens.pop()):
            reset(token)
