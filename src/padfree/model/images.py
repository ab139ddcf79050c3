"""Images in packed rows of vision-language models: how padfree lays them out per model, and samples to prove it on.

A packed row holds several samples, each with its own images: their pixel inputs concatenated in the order the
samples sit in the row (:mod:`padfree.data.carry`), the tokens side by side, positions restarting per sample. What
else makes such a row exact depends on how the model places its image tokens — its *route*:

- ``"rope"``: multi-axis rotary positions computed from each sample's image grids (Qwen-VL, GLM-4V, ...:
  :mod:`padfree.model.mrope` gives every sample its own);
- ``"blocks"``: image tokens attend to each other both ways inside their image (Gemma 3, Gemma 4 with bidirectional
  vision), or a sample's prefix of images and prompt does (PaliGemma, PaliGemma 2): each image, or each sample's
  prefix, a block of its own sample on the forward's layout (:data:`padfree.model.packed.BLOCK_RULES`);
- ``"causal"``: image tokens are ordinary causal tokens (LLaVA, Idefics, SmolVLM, Mistral 3, InternVL, ...): the
  vision tower runs per image, the features land on the placeholder tokens in order, and the language model sees
  1-D positions under a causal mask only — the row's own boundaries are all it needs;
- None: refused (:func:`image_refusal` says why: cross-attention to a row's images, a mask or positions the model
  builds above its language model that padfree does not lay out per sample, ...).

:func:`probe_samples` builds three tiny samples (an image; text only; two images, of different sizes where the model
takes sizes) as a processor returns them, and :func:`pack_samples` lays them out as one packed row — what
:func:`padfree.proof.compare_images.prove_images` compares against each sample alone.

>>> image_route(torch.nn.Linear(2, 2)) is None  # no language model, no images
True
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from padfree.model import mrope
from padfree.model.packed import BLOCK_RULES, BlockRule

__all__ = ["block_rule", "image_inputs", "image_refusal", "image_route", "pack_samples", "probe_samples"]

#: the forward arguments that carry a row's images on the causal route, each concatenated in row order: per image
#: (``pixel_values`` — on its image axis, or its patch axis —, ``image_sizes``, ``pixel_attention_mask``,
#: ``spatial_shapes``, ``image_grid_thw``: a Qwen-style tower's patch grid beside a language model of 1-D positions)
#: or per sample (``batch_num_images``, LLaVA-OneVision's count of images in each sample, which decides its anyres
#: tiling)
IMAGE_INPUTS = frozenset({"pixel_values", "image_sizes", "pixel_attention_mask", "spatial_shapes", "batch_num_images",
                          "image_grid_thw"})

# words in the source of a multimodal model's forward (the outer class and the inner model holding the language model)
# that mean it does more to a packed row than put image features on their tokens: each a reason the causal route
# would be wrong, with what it is
_BUILDS_MASK = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate",
                "create_bidirectional_mask", "block_sequence_ids", "or_mask_function", "and_mask_function",
                "_prepare_4d_causal_attention_mask", "_prepare_decoder_attention_mask")
_BUILDS_POSITIONS = ("get_rope_index", "rope_deltas", "compute_3d_position_ids")
_READS = (("token_type_ids", "token types (a mask made from them: bidirectional image or prefix blocks)"),
          ("cross_attention", "cross-attention to the row's images"))
_PER_TOKEN = ("token_type_ids", "mm_token_type_ids")
# the names of a forward's image arguments (videos apart: a packed batch with them stays refused by the hook)
_IMAGE_ARGUMENT = re.compile(r"^(pixel_|image_|high_res_|spatial_)(?!.*video)")
_SPECIAL = re.compile(r"(token_id|token_index|_id)$")


def block_rule(model: torch.nn.Module) -> BlockRule | None:
    """The rule of the bidirectional blocks ``model``'s own mask makes (:data:`BLOCK_RULES`), where padfree lays
    them out per sample: Gemma3's images; Gemma4's images and videos when its text config makes them bidirectional;
    PaliGemma's prefix (``token_type_ids == 0``: its images and prompt), with or without images — its attention is
    built with ``is_causal=False`` and made causal only by the mask of its token types, which the layout's blocks
    are (:func:`padfree.model.attention.packed_forward` accepts such a module exactly when they are laid out).
    None: none (a model whose images are plain causal tokens needs no rule)."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    if model_type in ("gemma3", "shieldgemma2", "paligemma"):
        return BLOCK_RULES[model_type]
    if model_type in ("gemma4", "gemma4_unified"):
        text = config.get_text_config()
        if getattr(text, "use_bidirectional_attention", None) == "vision":
            return BLOCK_RULES[model_type]
    return None


# where a vision-language model keeps its language model (Idefics2/3 and SmolVLM: text_model)
_LANGUAGE_MODEL = ("language_model", "text_model")


def _holder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose forward hands the language model its inputs (``model.model`` or the model itself)."""
    for candidate in (getattr(model, "model", None), model):
        if isinstance(candidate, torch.nn.Module) and _language_model(candidate) is not None:
            return candidate
    return None


def _language_model(holder: torch.nn.Module) -> torch.nn.Module | None:
    for name in _LANGUAGE_MODEL:
        found = getattr(holder, name, None)
        if isinstance(found, torch.nn.Module):
            return found
    return None


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return ""


def _parameters(model: torch.nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return []


def _cross_attention(model: torch.nn.Module) -> str | None:
    """The class name of the model's cross-attention (the attention module itself where there is one)."""
    names = [type(module).__name__ for module in model.modules() if "CrossAttention" in type(module).__name__]
    return next((n for n in names if n.endswith("CrossAttention")), names[0] if names else None)


def image_refusal(model: torch.nn.Module) -> str | None:
    """Why a packed batch with images through ``model`` cannot be made exact (naming the module), or None when
    :func:`image_route` has a route for it."""
    if mrope.rope_index(model) is not None or block_rule(model) is not None:
        return None
    name = type(model).__name__
    cross = _cross_attention(model)
    if cross is not None:
        # Mllama, Idefics (1): text tokens attend to a dense state of every image of their row through a per-token
        # cross-attention mask the model applies itself; padfree's packed attention reads no such mask
        return (f"{cross}: cross-attention from each token to its row's images (through a dense cross-attention "
                f"mask that padfree does not lay out per sample): a packed row would let one sample's tokens attend "
                f"to another sample's images")
    holder = _holder(model)
    if holder is None:
        return (f"{name} has no language model apart from its image path (no language_model or text_model "
                f"module): padfree cannot tell how its images meet the text")
    sources = {cls.__name__: _source(cls) for cls in (type(model), type(holder))}
    for owner, source in sources.items():
        if not source:
            return f"{owner}.forward cannot be read: padfree cannot tell how its images meet the text"
    for owner, source in sources.items():
        for word in _BUILDS_MASK:
            if word in source:
                return (f"{owner}.forward builds its own attention mask above its language model ({word}), which "
                        f"padfree does not lay out per sample")
    for owner, source in sources.items():
        for word in _BUILDS_POSITIONS:
            if word in source:
                return (f"{owner}.forward computes positions of its own ({word}) with a scheme padfree does not lay "
                        f"out per sample")
    for owner, source in sources.items():
        for word, what in _READS:
            if word in source:
                return f"{owner}.forward reads {what}, which padfree does not lay out per sample"
    text = _text_config(model)
    if "mrope_section" in (getattr(text, "rope_parameters", None) or {}):
        return (f"{type(_language_model(holder)).__name__} takes multi-axis rotary positions that {name} computes "
                f"without a rope index padfree knows")
    if "position_ids" not in _parameters(_language_model(holder)):
        return (f"{type(_language_model(holder)).__name__} takes no position_ids, so its positions cannot restart per "
                f"sample")
    unknown = [p for p in _parameters(model) if _IMAGE_ARGUMENT.match(p) and p not in IMAGE_INPUTS]
    if unknown:  # a Qwen-style tower's grids, a second resolution, ...: inputs padfree has not proven in row order
        return f"{name}.forward takes image inputs padfree does not lay out per sample ({', '.join(unknown)})"
    if not set(_parameters(model)) & IMAGE_INPUTS:
        return f"{name}.forward takes none of the image inputs padfree lays out ({', '.join(sorted(IMAGE_INPUTS))})"
    return None


def image_route(model: torch.nn.Module) -> str | None:
    """How padfree lays out a packed batch with images through ``model``: ``"rope"``, ``"blocks"``, ``"causal"``
    (see the module's docstring) or None (refused: :func:`image_refusal`).

    The causal route is read from the model's structure, not from a list of names: a language model (under
    ``language_model``) that takes ``position_ids`` and 1-D rotary positions, and forwards (the outer class's and
    its inner model's) that build no mask, no positions and read no token types or cross-attention inputs of their
    own — all they do to a row is put each image's features on its placeholder tokens, in order."""
    if mrope.rope_index(model) is not None:
        return "rope"
    if block_rule(model) is not None:
        return "blocks"
    return "causal" if image_refusal(model) is None else None


def image_inputs(model: torch.nn.Module) -> frozenset[str]:
    """The forward arguments that carry a packed row's images on ``model``'s route (empty when refused): the ones
    padfree lays out (rope, blocks) or lets through in row order (causal)."""
    route = image_route(model)
    if route == "rope":
        return mrope.ROPE_INPUTS
    if route == "blocks":
        rule = block_rule(model)
        # Gemma4's patches come with their coordinates (padding patches at -1), one row per image
        return frozenset({"pixel_values", rule.source, *({"image_position_ids"} & set(_parameters(model)))})
    if route == "causal":
        return frozenset(set(_parameters(model)) & IMAGE_INPUTS)
    return frozenset()


# ---- samples to prove it on --------------------------------------------------------------------------------------


# the images of the three probe samples: an image; none; two images (in units of the model's smallest image step)
_PLAN = (((5, (2, 2)), 4), ((7, None),), ((3, (2, 4)), (2, (4, 2)), 3))
# a sample's parts: (text tokens, an image's (height, width) in steps or None), or text tokens alone
_IMAGES = tuple(part[1] for plan in _PLAN for part in plan if isinstance(part, tuple) and part[1] is not None)
# the largest image of the plan, in steps: every sample's pixels are padded to it (as a processor pads a batch)
_HEIGHT, _WIDTH = max(h for h, _ in _IMAGES), max(w for _, w in _IMAGES)


def _text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _words(model: torch.nn.Module, n: int, g: torch.Generator) -> list[int]:
    """``n`` random ordinary token ids (none of the config's special ids)."""
    vocab = int(_text_config(model).vocab_size)
    special = set()
    for config in (model.config, _text_config(model)):
        for key, value in config.to_dict().items():
            if _SPECIAL.search(key) and isinstance(value, int):
                special.add(value)
    allowed = torch.tensor([i for i in range(3, vocab) if i not in special])
    return allowed[torch.randint(len(allowed), (n,), generator=g)].tolist()


def _convention(model: torch.nn.Module) -> str:
    """How the causal-route model takes its images, from its forward's arguments."""
    params = set(_parameters(model))
    if "image_grid_thw" in params:
        return "grid"  # (Σ patches, D) patch rows of every image, image_grid_thw (N, 3): Qwen-style towers
    if "spatial_shapes" in params:
        return "patches"  # (N, P, C*p*p) patch rows, spatial_shapes (N, 2), pixel_attention_mask (N, P): LFM2-VL
    if "pixel_attention_mask" in params:
        return "tiles"  # (B, N, C, H, W), pixel_attention_mask (B, N, H, W): Idefics2/3, SmolVLM
    if "image_sizes" in params and getattr(model.config, "image_grid_pinpoints", None):
        return "anyres"  # (N, P, C, S, S) tiles of each image, image_sizes (N, 2): LLaVA-NeXT, OneVision
    holder = _holder(model)
    towers = [getattr(holder, name, None) for name in ("vision_tower", "vision_encoder", "vision_model")]
    if "image_sizes" in params and any(t is not None and "image_sizes" in _parameters(t) for t in towers):
        return "sized"  # (N, C, H, W) padded to the largest, image_sizes (N, 2): Pixtral towers (Mistral 3)
    return "plain"  # (N, C, S, S) at the tower's one size


def _side(vision: Any) -> tuple[int, int]:
    size, patch = vision.image_size, vision.patch_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return int(size), int(patch)


def _grid_step(vision: Any) -> int:
    """The patches of a grid side that merge into whole tokens: the product of the tower's merge factors (a spatial
    merge, an adapter's, a ``(k, k)`` kernel's ``k``), so that any multiple of it tiles."""
    step = 1
    for key, value in vision.to_dict().items():
        if "merge" in key and value:
            step *= int(value[0] if isinstance(value, (list, tuple)) else value)
    return step


def _patch_rows(model: torch.nn.Module) -> tuple[int, ...] | None:
    """The shape of one patch row a Qwen-style tower takes (``pixel_values`` is ``(Σ patches, *shape)``): flat, as
    wide as its patch embedding's input, or — for a tower that convolves each patch as an image — ``(C, kh, kw)``;
    the first the tower runs on. None: neither."""
    holder = _holder(model)
    towers = [getattr(holder, n) for n in ("vision_tower", "visual", "vision_model", "vision_encoder")
              if isinstance(getattr(holder, n, None), torch.nn.Module)]
    embed = next((m for t in towers for m in t.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d,
                                                                           torch.nn.Conv3d))), None)
    if embed is None:
        return None
    if isinstance(embed, torch.nn.Linear):
        shapes: list[tuple[int, ...]] = [(embed.in_features,)]
    else:
        shapes = [(embed.in_channels * int(torch.tensor(embed.kernel_size).prod()),)]
        if isinstance(embed, torch.nn.Conv2d):
            shapes.append((embed.in_channels, *embed.kernel_size))
    step = _grid_step(model.config.vision_config)
    for shape in shapes:
        try:
            with torch.no_grad():
                holder.get_image_features(pixel_values=torch.zeros(step * step, *shape),
                                          image_grid_thw=torch.tensor([[1, step, step]]))
        except (RuntimeError, ValueError, IndexError, TypeError):  # a shape the tower does not take: the next
            continue
        return shape
    return None


def _tile_mask(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The all-real ``pixel_attention_mask`` of tiles ``(1, N, C, H, W)``: per pixel ``(1, N, H, W)`` (Idefics2/3,
    SmolVLM) or per tile ``(1, N)`` (Granite Docling) — the one the model's image path takes."""
    per_pixel = torch.ones(pixels.shape[:2] + pixels.shape[3:], dtype=torch.bool)
    try:
        with torch.no_grad():
            _holder(model).get_image_features(pixel_values=pixels, pixel_attention_mask=per_pixel)
    except (IndexError, RuntimeError, ValueError):  # a mask of another shape
        return torch.ones(pixels.shape[:2], dtype=torch.bool)
    return per_pixel


def _causal_images(model: torch.nn.Module, shapes: Sequence[tuple[int, int]], g: torch.Generator) -> dict[str, Any]:
    """One sample's image inputs for ``shapes`` (each an image's size in steps), as the model's processor returns."""
    vision = model.config.vision_config
    kind = _convention(model)
    if kind == "grid":
        step, row = _grid_step(vision), _patch_rows(model)
        grids = [(1, h * step, w * step) for h, w in shapes]
        pixels = [torch.randn(t * h * w, *row, generator=g) for t, h, w in grids]
        return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids)}
    n = len(shapes)
    if kind == "patches":
        factor = int(getattr(model.config, "downsample_factor", 1) or 1)
        patch, channels = int(vision.patch_size), int(vision.num_channels)
        grids = [(h * factor, w * factor) for h, w in shapes]
        longest = _HEIGHT * _WIDTH * factor * factor
        mask = torch.zeros(n, longest, dtype=torch.bool)
        for i, (h, w) in enumerate(grids):
            mask[i, :h * w] = True
        pixels = torch.randn(n, longest, channels * patch * patch, generator=g) * mask[..., None]
        return {"pixel_values": pixels, "spatial_shapes": torch.tensor(grids), "pixel_attention_mask": mask}
    side, patch = _side(vision)
    channels = int(getattr(vision, "num_channels", 3))
    if kind == "tiles":
        pixels = torch.randn(1, n, channels, side, side, generator=g)
        return {"pixel_values": pixels, "pixel_attention_mask": _tile_mask(model, pixels)}
    if kind == "anyres":  # image sizes of whole tiles: each image's grid of tiles is exact
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        def tiles(h: int, w: int) -> int:
            return image_size_to_num_patches([h * side // 2, w * side // 2], model.config.image_grid_pinpoints, side)

        counts = [tiles(h, w) for h, w in shapes]
        most = max(tiles(h, w) for h, w in _IMAGES)
        sizes = torch.tensor([[h * side // 2, w * side // 2] for h, w in shapes])
        pixels = torch.zeros(n, most, channels, side, side)
        for i, count in enumerate(counts):
            pixels[i, :count] = torch.randn(count, channels, side, side, generator=g)
        out = {"pixel_values": pixels, "image_sizes": sizes}
        if "batch_num_images" in _parameters(model):
            out["batch_num_images"] = torch.tensor([n])
        return out
    if kind == "sized":
        step = patch * int(getattr(model.config, "spatial_merge_size", 1) or 1)
        sizes = torch.tensor([[h * step, w * step] for h, w in shapes])
        pixels = torch.zeros(n, channels, _HEIGHT * step, _WIDTH * step)
        for i, (h, w) in enumerate(sizes.tolist()):
            pixels[i, :, :h, :w] = torch.randn(channels, h, w, generator=g)
        return {"pixel_values": pixels, "image_sizes": sizes}
    return {"pixel_values": torch.randn(n, channels, side, side, generator=g)}


def _tokens_per_image(model: torch.nn.Module, images: dict[str, Any], n: int) -> list[int]:
    """How many placeholder tokens each of ``n`` images takes: the model's own image features counted."""
    holder = _holder(model)
    function = holder.get_image_features
    accepted = set(inspect.signature(function).parameters)
    if "image_grid_thw" in images and n > 1:  # patch rows of images of different sizes: count each alone
        rows = images["image_grid_thw"].prod(-1).tolist()
        parts = zip(images["pixel_values"].split(rows), images["image_grid_thw"].split(1), strict=True)
        return [_tokens_per_image(model, {"pixel_values": p, "image_grid_thw": grid}, 1)[0] for p, grid in parts]
    with torch.no_grad():
        out = function(**{k: v for k, v in images.items() if k in accepted})
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        counts = [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in features]
    elif features.dim() == 3:
        counts = [int(features.shape[1])] * features.shape[0]
    else:
        counts = [int(features.reshape(-1, features.shape[-1]).shape[0])]
    # per sample (Idefics: a list over the batch) or flat: the images are of one size, so they share the count
    return counts if len(counts) == n else [sum(counts) // n] * n


def _causal_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator) -> dict[str, Any]:
    shapes = [part[1] for part in plan if isinstance(part, tuple) and part[1] is not None]
    images = _causal_images(model, shapes, g) if shapes else {}
    counts = _tokens_per_image(model, images, len(shapes)) if shapes else []
    token = int(getattr(model.config, "image_token_id", None) or model.config.image_token_index)
    ids: list[int] = []
    for part in plan:
        text, image = part if isinstance(part, tuple) else (part, None)
        ids += _words(model, text, g)
        if image is not None:
            ids += [token] * counts.pop(0)
    return {"input_ids": torch.tensor([ids]), **images}


def _markers(config: Any) -> tuple[Any, Any]:
    """The tokens around an image of an mRoPE model: Qwen's vision start / end, GLM-4V's image start / end."""
    start = getattr(config, "vision_start_token_id", None)
    end = getattr(config, "vision_end_token_id", None)
    if start is None or end is None:
        start, end = getattr(config, "image_start_token_id", None), getattr(config, "image_end_token_id", None)
    return start, end


def _marked_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator, markers: tuple[int, int],
                   types_key: str, image: Callable[[tuple[int, int]], tuple[int, dict[str, torch.Tensor]]]
                   ) -> dict[str, Any]:
    """A sample whose every image is ``count`` placeholder tokens between two ``markers``, token type 1 inside and 0
    elsewhere (under ``types_key``); ``image(size)`` gives an image's ``count`` and its inputs, each concatenated
    over the sample's images in order."""
    start, end = markers
    ids: list[int] = []
    types: list[int] = []
    inputs: dict[str, list[torch.Tensor]] = {}
    for part in plan:
        text, size = part if isinstance(part, tuple) else (part, None)
        ids += _words(model, text, g)
        types += [0] * text
        if size is not None:
            count, tensors = image(size)
            ids += [start, *[model.config.image_token_id] * count, end]
            types += [0, *[1] * count, 0]
            for key, value in tensors.items():
                inputs.setdefault(key, []).append(value)
    return {"input_ids": torch.tensor([ids]), types_key: torch.tensor([types]),
            **{key: torch.cat(values) for key, values in inputs.items()}}


def _rope_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator) -> dict[str, Any]:
    """Qwen-VL-style: each image a grid of patch rows between the vision start and end tokens."""
    merge = int(model.config.vision_config.spatial_merge_size)
    row = _patch_rows(model)

    def image(size: tuple[int, int]) -> tuple[int, dict[str, torch.Tensor]]:
        h, w = size[0] * merge, size[1] * merge
        return h * w // (merge * merge), {"pixel_values": torch.randn(h * w, *row, generator=g),
                                          "image_grid_thw": torch.tensor([[1, h, w]])}

    return _marked_sample(model, plan, g, _markers(model.config), "mm_token_type_ids", image)


def _blocks_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator) -> dict[str, Any]:
    """Gemma3-style: each image ``mm_tokens_per_image`` tokens between its markers, one image at the tower's size."""
    config, vision = model.config, model.config.vision_config

    def image(size: tuple[int, int]) -> tuple[int, dict[str, torch.Tensor]]:
        side = vision.image_size
        return int(config.mm_tokens_per_image), {
            "pixel_values": torch.randn(1, vision.num_channels, side, side, generator=g)}

    return _marked_sample(model, plan, g, (config.boi_token_id, config.eoi_token_id), "token_type_ids", image)


def _prefix_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator) -> dict[str, Any]:
    """PaliGemma-style: every image's ``num_image_tokens`` tokens first, then the prompt, both the prefix (token type
    0, bidirectional within the sample); the last text part the suffix (type 1, causal) — a sample of text alone
    splits its text in two."""
    config, vision = model.config, model.config.vision_config
    texts = [part[0] if isinstance(part, tuple) else part for part in plan]
    count = sum(1 for part in plan if isinstance(part, tuple) and part[1] is not None)
    prefix = sum(texts[:-1]) if len(texts) > 1 else -(-texts[0] // 2)
    suffix = sum(texts) - prefix
    image = int(_text_config(model).num_image_tokens)
    ids = [config.image_token_id] * (count * image) + _words(model, prefix + suffix, g)
    out: dict[str, Any] = {"input_ids": torch.tensor([ids]),
                           "token_type_ids": torch.tensor([[0] * (count * image + prefix) + [1] * suffix])}
    if count:
        side = int(vision.image_size)
        out["pixel_values"] = torch.randn(count, vision.num_channels, side, side, generator=g)
    return out


def _patch_blocks_sample(model: torch.nn.Module, plan: Sequence[Any], g: torch.Generator) -> dict[str, Any]:
    """Gemma4-style: an image of ``(h, w)`` steps is ``h·k x w·k`` patches (``k``: the pooling kernel) pooled to
    ``h·w`` soft tokens between its markers; every image's patches padded to the plan's largest (coordinates ``-1``),
    as the processor pads each image to one patch budget."""
    config, vision = model.config, model.config.vision_config
    k, patch = int(vision.pooling_kernel_size), int(vision.patch_size)
    budget = _HEIGHT * k * _WIDTH * k

    def image(size: tuple[int, int]) -> tuple[int, dict[str, torch.Tensor]]:
        h, w = size[0] * k, size[1] * k
        values = torch.zeros(1, budget, 3 * patch * patch)
        values[0, :h * w] = torch.randn(h * w, 3 * patch * patch, generator=g)
        where = torch.full((1, budget, 2), -1, dtype=torch.long)
        ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        where[0, :h * w] = torch.stack([xs.flatten(), ys.flatten()], -1)
        return size[0] * size[1], {"pixel_values": values, "image_position_ids": where}

    return _marked_sample(model, plan, g, (config.boi_token_id, config.eoi_token_id), "mm_token_type_ids", image)


def probe_samples(model: torch.nn.Module, seed: int = 0) -> list[dict[str, Any]] | None:
    """Three samples of text and images for a tiny ``model`` — one image; text only; two images (of different sizes
    where the model takes sizes) — each as its processor returns it: ``input_ids`` ``(1, T)`` with as many
    placeholder tokens per image as the model's features, the pixel inputs, grids / sizes / masks, token types.
    None where padfree has no builder for the model (or no route: :func:`image_route`).

    The image sizes are in units of the model's smallest step (a merged patch, an anyres half tile, ...); the
    images' pixel tensors of one sample share their trailing sizes (padded as the processor pads a batch), and so do
    the three samples', so that they concatenate.
    """
    route = image_route(model)
    g = torch.Generator().manual_seed(seed)
    config = model.config
    if route == "causal":
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        if _convention(model) == "anyres" and any(v % _side(config.vision_config)[0] for p in pinpoints for v in p):
            return None  # resolutions that are no whole number of tiles: the model's own tiling does not add up
        if _convention(model) == "grid" and _patch_rows(model) is None:
            return None  # a tower whose patch rows padfree cannot shape
        build = _causal_sample
    elif route == "rope":
        ids = [*_markers(config), getattr(config, "image_token_id", None)]
        if None in ids or len(set(ids)) < 3 or max(ids) >= int(_text_config(model).vocab_size):
            return None  # no distinct marker tokens in the vocabulary: no sample the processor could make
        if _patch_rows(model) is None:
            return None  # a tower whose patch rows padfree cannot shape
        build = _rope_sample
    elif route == "blocks" and block_rule(model).per_sample:
        build = _prefix_sample
    elif route == "blocks" and block_rule(model).source == "token_type_ids":
        build = _blocks_sample
    elif route == "blocks" and hasattr(getattr(config, "vision_config", None), "pooling_kernel_size"):
        build = _patch_blocks_sample
    else:
        return None
    return [build(model, plan, g) for plan in _PLAN]


def pack_samples(model: torch.nn.Module, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``samples`` (:func:`probe_samples`' form: batches of one) as one packed row ``(1, ΣT)``: the tokens and the
    per-token inputs side by side, ``position_ids`` restarting at 0 per sample, every image input concatenated in
    row order — on the image axis (axis 1 of a ``(B, N, ...)`` tile tensor and its mask), as one sample's images
    are."""
    row: dict[str, Any] = {
        "input_ids": torch.cat([s["input_ids"] for s in samples], 1),
        "position_ids": torch.cat([torch.arange(s["input_ids"].shape[1]) for s in samples])[None]}
    tiles = image_route(model) == "causal" and _convention(model) == "tiles"
    keys = dict.fromkeys(k for s in samples for k in s if k != "input_ids")
    for key in keys:
        if key in _PER_TOKEN:
            row[key] = torch.cat([s[key] for s in samples], 1)
            continue
        parts = [s[key] for s in samples if key in s]
        axis = 1 if tiles and key in ("pixel_values", "pixel_attention_mask") else 0
        row[key] = torch.cat(parts, axis)
    return row
