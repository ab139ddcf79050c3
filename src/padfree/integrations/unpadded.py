"""A padded batch run as one packed row, with every per-token output given back in the padded shape.

Preference and RL trainers (TRL's DPO, reward and GRPO trainers) build padded batches and compute their losses and
metrics from per-token outputs laid out ``(batch, seq)``. :class:`Unpadded` is the bridge that lets padfree run the
forward padding-free without touching that arithmetic: the real tokens of the batch become one row (each sequence's
``position_ids`` restarting at 0, so a model configured by :func:`padfree.configure_packing` keeps every sequence to
itself), and each output comes back as ``(batch, seq, ...)`` with ``fill`` where the padded forward had padding.
A vision-language batch keeps its images: the per-token columns (``mm_token_type_ids``, ``token_type_ids``) are
packed like the tokens, the per-sample ones (``pixel_values``, ``image_grid_thw``, ...) passed on as they are — the
sequences keep their order in the row, so their images stay in the order the model meets their image tokens.
:func:`unpadded_forwards` installs that on a model's ``forward`` for the calls made inside it, so a trainer's own
loss code runs unchanged over exactly the numbers the padded forward would have given.

>>> import torch
>>> mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [1, 1, 1, 1]])
>>> u = Unpadded.from_attention_mask(mask)
>>> u.position_ids.tolist(), u.seq_lens.tolist()
([[0, 1, 2, 0, 1, 0, 1, 2, 3]], [3, 2, 4])
>>> ids = torch.arange(12).view(3, 4)
>>> u.pack(ids).tolist()
[[0, 1, 2, 5, 6, 8, 9, 10, 11]]
>>> u.unpack(u.pack(ids), fill=-1).tolist()
[[0, 1, 2, -1], [-1, 5, 6, -1], [8, 9, 10, 11]]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from padfree.data.carry import PER_TOKEN
from padfree.errors import BackendUnavailableError, InvalidArgumentError, describe
from padfree.layout import IGNORE_INDEX
from padfree.model.wrappers import unwrap_model

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError("padfree.integrations.unpadded needs torch; pip install 'padfree[torch]'") from exc

__all__ = ["Unpadded", "unpadded_forwards"]


@dataclasses.dataclass(frozen=True)
class Unpadded:
    """The real tokens of a padded ``(N, L)`` batch as one packed row of ``T`` tokens.

    Attributes:
        mask: ``(N, L) bool`` — the real tokens. Each row's real tokens are one contiguous run (right, left or
            both-sided padding); a row may be empty.
        index: ``(T,) int64`` — their positions in the flattened ``N·L`` batch, row after row.
        position_ids: ``(1, T) int64`` — restarting at 0 at each sequence.
        seq_lens: ``(N,) int64`` — real tokens per row.
        starts: ``(N,) int64`` — where each row's sequence starts in the packed row (its end for an empty row).
    """

    mask: torch.Tensor
    index: torch.Tensor
    position_ids: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> Unpadded:
        """The layout of a padded batch from its 0/1 ``attention_mask`` ``(N, L)``.

        Raises:
            InvalidArgumentError: not a 2-D 0/1 tensor, or a row whose real tokens are not one contiguous run (a
                hole inside a sequence has no packed equivalent).
        """
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
            raise InvalidArgumentError(f"attention_mask must be a 2-D (batch, seq) 0/1 tensor, got "
                                       f"{describe(attention_mask)}")
        if attention_mask.dtype != torch.bool:
            if attention_mask.is_floating_point() or attention_mask.is_complex():
                raise InvalidArgumentError(f"attention_mask must hold 0/1 integers or booleans, got dtype "
                                           f"{attention_mask.dtype}")
            if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
                raise InvalidArgumentError("attention_mask must hold only 0 and 1 (a padding mask); a segment-id "
                                           "mask is already packed — pass position_ids instead")
        mask = attention_mask.bool()
        runs = mask[:, :1].sum(1) + (mask[:, 1:] & ~mask[:, :-1]).sum(1)
        if bool((runs > 1).any()):
            row = int(torch.nonzero(runs > 1)[0, 0])
            raise InvalidArgumentError(f"attention_mask row {row} has padding between real tokens "
                                       f"({mask[row].int().tolist()}); only left or right padding is accepted")
        seq_lens = mask.sum(1)
        index = torch.nonzero(mask.reshape(-1)).squeeze(1)
        position_ids = (mask.cumsum(1) - 1)[mask].unsqueeze(0)
        starts = seq_lens.cumsum(0) - seq_lens
        return cls(mask, index, position_ids, seq_lens, starts)

    @property
    def num_tokens(self) -> int:
        """``T``, the length of the packed row."""
        return int(self.index.shape[0])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(N, L, ...)`` -> ``(1, T, ...)``: the real positions of ``x``, row after row."""
        return x.reshape(-1, *x.shape[2:])[self.index.to(x.device)].unsqueeze(0)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` labels (Hugging Face convention: aligned with the inputs) -> ``(1, T)``, with each sequence's
        first token ``-100``: in the packed row it would otherwise be predicted from the previous sequence."""
        packed = self.pack(labels).clone()
        packed[0, self.starts[self.seq_lens > 0].to(packed.device)] = IGNORE_INDEX
        return packed

    def shift_labels(self, shift_labels: torch.Tensor) -> torch.Tensor:
        """``(N, L)`` pre-shifted labels (position ``t`` holds the target of token ``t``'s prediction) -> ``(1, T)``,
        with each sequence's last token ``-100``: its next token in the packed row is another sequence's."""
        packed = self.pack(shift_labels).clone()
        real = self.seq_lens > 0
        packed[0, (self.starts + self.seq_lens - 1)[real].to(packed.device)] = IGNORE_INDEX
        return packed

    def unpack(self, y: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """``(1, T, ...)`` -> ``(N, L, ...)``: each token's value at its padded place, ``fill`` on padding."""
        n, width = self.mask.shape
        out = y.new_full((n * width, *y.shape[2:]), fill)
        out = out.index_copy(0, self.index.to(y.device), y[0])
        return out.view(n, width, *y.shape[2:])

    def unpack_shifted(self, y: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """``(1, T - 1, ...)`` -> ``(N, L - 1, ...)`` for next-token outputs: position ``t`` of the packed row
        scores token ``t + 1``; at padded place ``(n, t)`` lands the score of token ``(n, t + 1)`` from its own
        sequence, ``fill`` where that token or its predecessor is padding."""
        n, width = self.mask.shape
        both = self.mask[:, :-1] & self.mask[:, 1:]
        src = (self.mask.reshape(-1).cumsum(0) - 1).view(n, width)[:, :-1][both]
        dest = torch.nonzero(both.reshape(-1)).squeeze(1)
        out = y.new_full((n * max(width - 1, 0), *y.shape[2:]), fill)
        out = out.index_copy(0, dest.to(y.device), y[0].index_select(0, src.to(y.device)))
        return out.view(n, max(width - 1, 0), *y.shape[2:])


_ACTIVE: list[bool] = [False]
# the stand-ins for a fused LM head on a packed row, by the model they score (id of the unwrapped model)
_HEADS: dict[int, Callable[[Any, dict[str, Any]], Any]] = {}


def _unpack_output(output: Any, layout: Unpadded) -> Any:
    """Every per-token tensor of a model output back to the padded shape: ``(1, T, ...)`` fields through
    :meth:`Unpadded.unpack`, ``(1, T - 1, ...)`` next-token fields through :meth:`Unpadded.unpack_shifted`; scalars and
    anything else as they are."""
    t = layout.num_tokens
    items = output.items() if hasattr(output, "items") else ()
    for key, value in list(items):
        if not isinstance(value, torch.Tensor) or value.ndim < 2 or value.shape[0] != 1:
            continue
        if value.shape[1] == t:
            output[key] = layout.unpack(value)
        elif value.shape[1] == t - 1:
            output[key] = layout.unpack_shifted(value)
    return output


def _install(model: Any) -> None:
    """Wrap ``model.forward`` (an instance attribute, as TRL's fused head is) once; the wrapper only acts inside
    :func:`unpadded_forwards`."""
    inner = unwrap_model(model)
    if getattr(inner.forward, "__padfree_unpadded__", False):
        return
    original = inner.forward

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids")
        if (not _ACTIVE[0] or args or mask is None or ids is None or ids.ndim != 2 or mask.ndim != 2
                or kwargs.get("position_ids") is not None or kwargs.get("inputs_embeds") is not None):
            return original(*args, **kwargs)
        layout = Unpadded.from_attention_mask(mask)
        kwargs = dict(kwargs)
        kwargs.pop("attention_mask")
        kwargs["input_ids"] = layout.pack(ids)
        for key in sorted(PER_TOKEN & kwargs.keys()):  # token types: one per token, packed like the tokens
            if kwargs[key] is None:
                continue
            value = kwargs[key]
            if not isinstance(value, torch.Tensor) or value.shape != ids.shape:
                got = f"of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else describe(value)
                raise InvalidArgumentError(f"{key} is {got}, not one value per token of input_ids "
                                           f"{tuple(ids.shape)}; it is packed like the tokens")
            kwargs[key] = layout.pack(kwargs[key])
        kwargs["position_ids"] = layout.position_ids.to(ids.device)
        if kwargs.get("labels") is not None:
            kwargs["labels"] = layout.labels(kwargs["labels"])
        if kwargs.get("shift_labels") is not None:
            kwargs["shift_labels"] = layout.shift_labels(kwargs["shift_labels"])
        # through the module's call again, not straight to ``original``: the hooks configure_packing put on the model
        # itself (a multimodal model's, which lay out each sample's images) must see the packed row, not the padded
        # batch; the call comes back here with position_ids and goes on to ``original``
        head = _HEADS.get(id(self)) if kwargs.get("fused_lm_head") else None
        return _unpack_output(self(**kwargs) if head is None else head(self, kwargs), layout)

    forward.__padfree_unpadded__ = True  # type: ignore[attr-defined]
    inner.forward = types.MethodType(forward, inner)


@contextlib.contextmanager
def unpadded_forwards(*models: Any, heads: Mapping[Any, Callable[[Any, dict[str, Any]], Any]] | None = None
                      ) -> Iterator[None]:
    """Inside the block, a call ``model(input_ids=..., attention_mask=...)`` with a ``(N, L)`` 0/1 padding mask runs
    as one packed row (:class:`Unpadded`) and returns its per-token outputs padded again.

    The models must be configured for packing (:func:`padfree.configure_packing`), or the packed row leaks across
    sequences; padfree's trainers do both. Calls with ``position_ids``, ``inputs_embeds`` or positional arguments,
    and every call outside the block (generation included), run the model's own forward untouched. ``None`` entries
    are skipped (a trainer without a reference model).

    The other arguments of the call pass through, the token types (``mm_token_type_ids``, ``token_type_ids``, shaped
    like ``input_ids``) packed like the tokens, images and their grids as given. The packed call goes through the
    model's call again, so the hooks of ``configure_packing`` on the model itself (a multimodal model's, which lays
    out each sample's images) see the packed row.

    ``heads`` maps some of the models to a stand-in for TRL's fused LM head: a packed call that asks for it
    (``fused_lm_head=True``) is answered by ``head(model, kwargs)`` — the unwrapped model and the packed row's keyword
    arguments — instead of the model's forward, and its per-token outputs are padded again like the forward's
    (padfree's DPO trainer scores its rows with :mod:`padfree.integrations.fused_head` there).
    """
    installed = {}
    for model in models:
        if model is not None:
            _install(model)
    for model, head in (heads or {}).items():
        if model is not None and head is not None:
            _install(model)
            installed[id(unwrap_model(model))] = head
    previous, saved = _ACTIVE[0], dict(_HEADS)
    _ACTIVE[0] = True
    _HEADS.update(installed)
    try:
        yield
    finally:
        _ACTIVE[0] = previous
        _HEADS.clear()
        _HEADS.update(saved)
