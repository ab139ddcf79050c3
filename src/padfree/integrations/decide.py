"""Whether a TRL trainer runs a padfree mode: the automatic choice, its skip reasons and the explicit refusals.

Shared by padfree's TRL trainers (SFT, DPO, reward, GRPO): :func:`skip_reason` says why automatic padding-free
batching is skipped (an environment opt-out, a custom collator, a model padfree does not support; for the trainers
that pack text only, a processor or a vision-language model; for SFT, images padfree does not lay out per sample:
:func:`image_reason`), :func:`refuse_unsafe` raises for an explicit setting that cannot be exact, :func:`configure_for`
runs :func:`padfree.configure_packing` and words its refusal for the mode that asked. A :class:`Decision` carries
its :class:`Cause` (the user's setting, the model's limits, the data, or none), which is what decides whether a
skip is worth a warning — never the wording of its reason.

>>> from padfree.proof.tiny import build_tiny
>>> support_reason(build_tiny("llama")) is None
True
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from typing import Any, NamedTuple

from padfree.errors import InvalidArgumentError, UnsupportedModelError, describe
from padfree.integrations.status import PADDING_FREE, STANDARD
from padfree.model.wrappers import unwrap_model
from padfree.packing.strategies import DEFAULT_STRATEGY

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is installed wherever this module is used
    from padfree.errors import BackendUnavailableError

    raise BackendUnavailableError("padfree.integrations.decide needs transformers; pip install 'padfree[hf]'") from exc

__all__ = [
    "ENV_DISABLE_AUTO",
    "ENV_RETURN_LOGITS",
    "PROMPT_LEARNING_SKIP",
    "Cause",
    "Decision",
    "Skip",
    "as_tri_state",
    "auto_decision",
    "configure_for",
    "configure_model",
    "default_output_dir",
    "first_sample",
    "holds_images",
    "image_reason",
    "model_config",
    "prompt_learning",
    "refuse_prompt_learning",
    "refuse_unsafe",
    "skip_reason",
    "warn_once",
]

logger = logging.getLogger("padfree")

ENV_DISABLE_AUTO = "PADFREE_DISABLE_AUTO_PADDING_FREE"
ENV_RETURN_LOGITS = ("PADFREE_RETURN_LOGITS", "UNSLOTH_RETURN_LOGITS")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def support_reason(model: Any, config: Any = None) -> str | None:
    """Why padfree would not make ``model`` packing-exact, as ``"not supported because ..."`` (None: it would).

    A model instance is asked exactly what :func:`padfree.configure_packing` would decide (the scan, the support
    table the sweep proved, or an on-the-spot certification of a tiny twin — cached); a model still to be loaded
    (a name) is judged from its config against the support table, and decided for good once loaded.

    >>> import transformers
    >>> from padfree.proof.tiny import build_tiny
    >>> support_reason(build_tiny("llama")) is None
    True
    """
    from padfree.model.configure import check_packing_support
    from padfree.proof import registry

    instance = unwrap_model(model) if not isinstance(model, str) else None
    if isinstance(instance, transformers.PreTrainedModel):
        verdict = check_packing_support(instance)
        return None if verdict.ok else f"not supported because {verdict.reason}"
    model_type = getattr(config, "model_type", None)
    entry = registry.load()["types"].get(model_type)
    if entry is not None and entry.get("verdict") == "refused" and entry.get("failed") is None:
        return f"not supported because {entry.get('reason', 'the support sweep refused it')}"
    return None


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` at WARNING the first time only (a trainer per run, or per eval, must not repeat it)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


def env_flag(name: str) -> bool:
    value = os.environ.get(name)
    if value is None:
        return False
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise InvalidArgumentError(f"environment variable {name}={value!r} is not a flag; accepted: "
                               f"{', '.join(map(repr, _TRUE))} (on) or {', '.join(map(repr, _FALSE))} (off)")


class Cause(enum.Enum):
    """What made a trainer's choice of mode: what a trainer does with a skip (warn or not) reads this, never the
    reason's text."""

    USER = "user"  # an explicit setting, an opt-out, an argument the user passed (a collator, a processor)
    MODEL = "model"  # the model's own limits: padfree cannot make it exact for this trainer
    DATA = "data"  # the data: images padfree does not lay out for this model
    NONE = "none"  # nothing stood in the way: the automatic choice is on


class Skip(NamedTuple):
    """Why the automatic choice is skipped: the reason (for people) and its :class:`Cause` (for code)."""

    reason: str
    cause: Cause


@dataclasses.dataclass
class Decision:
    """A trainer's mode (:data:`~padfree.integrations.status.MODES`), why, whether padfree chose it, and how it packs.

    >>> d = auto_decision(Skip("the config sets auto_padding_free=False", Cause.USER), None)
    >>> d.mode, d.cause.value, d.warns
    ('standard batching', 'user', False)
    """

    mode: str
    reason: str
    auto: bool
    strategy: str = DEFAULT_STRATEGY
    overlong: str = "error"
    cause: Cause = Cause.USER

    @property
    def on(self) -> bool:
        """A padfree mode runs (packed or padding-free rows reach the model)."""
        return self.mode != STANDARD

    @property
    def warns(self) -> bool:
        """An automatic skip for the model's own limits: worth a warning (an opt-out or the data's is not)."""
        return self.auto and self.mode == STANDARD and self.cause is Cause.MODEL


def model_config(model: Any, args: Any) -> Any:
    if isinstance(model, str):
        kwargs = dict(args.model_init_kwargs or {}) if isinstance(args.model_init_kwargs, dict) else {}
        try:
            return transformers.AutoConfig.from_pretrained(
                model, trust_remote_code=args.trust_remote_code, revision=kwargs.get("revision"))
        except Exception as exc:  # unreadable here; TRL reports it properly when it loads the model
            logger.debug("padfree: could not read the config of %r: %s", model, exc)
            return None
    return getattr(unwrap_model(model), "config", None)


def vlm_reason(model: Any, config: Any, sample: Any) -> str | None:
    """Why a trainer that packs text only skips a vision-language model or image data (None: neither)."""
    from transformers.models.auto import modeling_auto

    if config is not None:
        model_type = getattr(config, "model_type", None)
        vlm_types = set(getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}))
        vlm_types |= set(getattr(modeling_auto, "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", {}))
        if getattr(config, "vision_config", None) is not None or model_type in vlm_types:
            name = model if isinstance(model, str) else type(unwrap_model(model)).__name__
            return f"the model is a vision-language model ({name}, model type {model_type!r})"
    if holds_images(sample):
        return "the dataset holds images (vision-language data is processed on the fly, one padded batch at a time)"
    return None


def holds_images(sample: Any) -> bool:
    """``sample`` is a row of TRL's vision formats (an ``image`` or ``images`` column)."""
    return isinstance(sample, dict) and ("image" in sample or "images" in sample)


def image_reason(model: Any) -> str | None:
    """Why padfree cannot put the images of ``model`` (an instance) in packed rows exactly; None when it can: the
    model has a route padfree lays images out by (:func:`padfree.model.images.image_route`: each sample's mRoPE
    positions from its own grids, Gemma-style image blocks made per sample, or LLaVA-style causal image tokens) and
    images through it are proven exact — by the support sweep for its type, or on a tiny twin of its class and
    config (:func:`padfree.proof.certify.certify_images`, the check configure_packing's hook runs).

    >>> from padfree.proof.tiny import build_tiny
    >>> image_reason(build_tiny("llama"))
    'LlamaForCausalLM takes no images'
    """
    from padfree.proof.certify import certify_images

    inner = unwrap_model(model)
    name = type(inner).__name__
    config = getattr(inner, "config", None)
    if config is None or getattr(config, "vision_config", None) is None:
        return f"{name} takes no images"
    why = certify_images(inner, "padfree_sdpa")
    return None if why is None else f"padfree does not put the images of {name} in packed rows: {why}"


def first_sample(dataset: Any) -> Any:
    try:
        return next(iter(dataset))
    except Exception:  # an empty or broken dataset: TRL says what is wrong with it
        return None



def as_tri_state(value: Any, name: str) -> bool | None:
    """``value`` of a ``True`` / ``False`` / ``None`` ("padfree decides") setting such as ``padding_free``, checked."""
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be True, False or None (padfree decides), got {describe(value)}")
    return value


def auto_decision(skip: Skip | None, config: Any) -> Decision:
    """The automatic choice once the skip reasons are in: standard batching naming ``skip``, else padding-free."""
    if skip is not None:
        return Decision(STANDARD, f"auto padding-free skipped: {skip.reason}", auto=True, cause=skip.cause)
    return Decision(PADDING_FREE, f"auto: model type {config.model_type!r} is packing-exact under configure_packing",
                    auto=True, cause=Cause.NONE)


def default_output_dir(model: Any, suffix: str) -> str:
    """The output folder TRL's trainers name when no config is given: the model's name, then ``-{suffix}``."""
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or (
        type(model).__name__)
    return f"{str(name).split('/')[-1]}-{suffix}"


def prompt_learning(model: Any) -> bool:
    """The model carries a prompt-learning PEFT adapter (prefix / prompt tuning): its virtual tokens are prepended to
    every sequence, which a packed row of several sequences cannot do."""
    config = getattr(model, "peft_config", None)
    return isinstance(config, dict) and any(getattr(c, "is_prompt_learning", False) for c in config.values())


PROMPT_LEARNING_SKIP = Skip(
    "the model has a prompt-learning PEFT adapter (its virtual tokens belong to every sequence)", Cause.MODEL)


def refuse_prompt_learning(setting: str, model: Any, instead: str) -> None:
    """Raise for ``setting`` on a model with a prompt-learning adapter (:func:`prompt_learning`)."""
    if prompt_learning(model):
        raise UnsupportedModelError(f"{setting}: the model has a prompt-learning PEFT adapter, whose virtual tokens "
                                    f"are prepended to every sequence and cannot be placed in a packed row; "
                                    f"{instead}")


def refuse_unsafe(setting: str, model: Any, config: Any, processing_class: Any, data_collator: Any, sample: Any,
                  *, vision: bool = False) -> None:
    """The checks an explicit ``packing=True`` / ``padding_free=True`` must pass. ``vision=True`` for a trainer that
    packs vision-language data (SFT): a processor and a vision-language model are accepted, images only where
    :func:`image_reason` finds them exact."""
    if data_collator is not None:
        raise InvalidArgumentError(
            f"{setting} needs padfree's exact collator, but a custom data_collator ({type(data_collator).__name__}) "
            f"was given; drop data_collator (padfree collates packed rows itself), or unset {setting} to train with "
            f"your collator"
        )
    if vision:
        if holds_images(sample) and not isinstance(model, str):
            why = image_reason(model)
            if why is not None:
                raise UnsupportedModelError(f"{setting} with images: {why}; unset {setting} to train with TRL's "
                                            f"padded batches")
    else:
        if isinstance(processing_class, transformers.ProcessorMixin):
            raise InvalidArgumentError(
                f"{setting} with processing_class={type(processing_class).__name__} (a ProcessorMixin): this "
                f"trainer packs text-only batches; pass the tokenizer ({type(processing_class).__name__}.tokenizer) "
                f"or unset {setting}"
            )
        vlm = vlm_reason(model, config, sample)
        if vlm is not None:
            raise UnsupportedModelError(f"{setting}: {vlm}; this trainer packs text-only causal LMs — unset "
                                        f"{setting}")
    why = support_reason(model, config)
    if why is not None:
        raise UnsupportedModelError(f"{setting}: padfree is {why}; unset {setting} to train with standard batching")


def skip_reason(args: Any, model: Any, config: Any, processing_class: Any, data_collator: Any, sample: Any, *,
                returns_logits: bool = True, vision: bool = False) -> Skip | None:
    """Why automatic padding-free batching is skipped, with its :class:`Cause` (None: it is not).
    ``returns_logits=False`` for trainers whose padding-free forward hands outputs back in the padded layout (DPO,
    reward, GRPO), so the environment's request for returned logits does not concern them. ``vision=True`` for a
    trainer that packs vision-language data (SFT): a processor or a vision-language model is no reason, images are
    where :func:`image_reason` has one."""
    if env_flag(ENV_DISABLE_AUTO):
        return Skip(f"{ENV_DISABLE_AUTO}={os.environ[ENV_DISABLE_AUTO]} is set", Cause.USER)
    if getattr(args, "auto_padding_free", True) is False:
        return Skip("the config sets auto_padding_free=False", Cause.USER)
    for name in ENV_RETURN_LOGITS if returns_logits else ():
        if env_flag(name):
            return Skip(f"{name}={os.environ[name]} asks for logits to be returned, and a padding-free forward returns "
                        f"one flattened row of logits instead of one per sample", Cause.USER)
    if data_collator is not None:
        return Skip(f"a custom data_collator ({type(data_collator).__name__}) was given", Cause.USER)
    if vision:
        if holds_images(sample) and not isinstance(model, str):
            why = image_reason(model)
            if why is not None:
                return Skip(why, Cause.DATA)
    else:
        if isinstance(processing_class, transformers.ProcessorMixin):
            return Skip(f"processing_class is a ProcessorMixin ({type(processing_class).__name__}), i.e. a multimodal "
                        f"processor", Cause.USER)
        vlm = vlm_reason(model, config, None)  # the model alone, then the data
        if vlm is not None:
            return Skip(vlm, Cause.MODEL)
        if holds_images(sample):
            return Skip(vlm_reason(model, None, sample), Cause.DATA)
    if config is None:
        return Skip("the model's config could not be read", Cause.MODEL)
    why = support_reason(model, config)
    return None if why is None else Skip(why, Cause.MODEL)


def configure_model(model: Any, sequence_parallel: int | None = None) -> Any:
    """``configure_packing`` on the transformers model inside ``model`` (kept if already configured — configured
    again if PEFT changed it since, :func:`~padfree.model.configure.refresh_packing` — unless
    ``sequence_parallel`` asks for a group size it was not configured with): its
    :class:`~padfree.model.configure.PackingReport`, or :class:`~padfree.errors.UnsupportedModelError`."""
    from padfree.model.configure import configure_packing, packing_state, refresh_packing

    base = unwrap_model(model)
    state = packing_state(base)
    wanted = sequence_parallel if sequence_parallel is not None and sequence_parallel > 1 else None
    if state is not None and (wanted is None or (state.sp is not None and state.sp.size == wanted)):
        return refresh_packing(model)  # configured again if PEFT wrapped it since (adapters, modules_to_save copies)
    return configure_packing(base, sequence_parallel=wanted)


def configure_for(model: Any, decision: Decision, sequence_parallel: int | None = None) -> None:
    try:
        configure_model(model, sequence_parallel=sequence_parallel)
    except UnsupportedModelError as exc:
        how = (f"set {ENV_DISABLE_AUTO}=1 or auto_padding_free=False to train with standard batching"
               if decision.auto else "unset packing / padding_free to train with standard batching")
        raise UnsupportedModelError(f"padfree cannot run {decision.mode} ({decision.reason}) exactly: {exc}; {how}"
                                    ) from exc
