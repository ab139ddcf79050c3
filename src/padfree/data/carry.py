"""Columns a collator carries beside the tokens into a packed batch — what a vision-language processor returns.

A processor gives every sample, besides ``input_ids``, columns of two kinds:

- **per token** (as long as the sample's ``input_ids``: ``mm_token_type_ids``, ``token_type_ids``, ...): laid out
  exactly like the tokens, in the same rows and slots (padding: 0);
- **per sample** (anything else: ``pixel_values`` — an image's patches or pixels —, ``image_grid_thw``,
  ``image_sizes``, ...): the samples' tensors concatenated along their first dimension in the order the samples sit in
  the rows, row after row — the order in which the model meets their image tokens. A sample without one (no image)
  adds nothing.

A sample whose tokens are split across rows or truncated keeps its tokens but not its images' place: carrying a
per-sample value for it is refused by name. Already-packed samples (several sequences in one) are refused with
per-sample values too: the packer may place their sequences apart.

>>> samples = [{"input_ids": [1, 2, 3], "types": [0, 1, 0], "grid": [[1, 2, 2]]},
...            {"input_ids": [4, 5], "types": [0, 0]}]
>>> per_token, per_sample = split_columns(samples, ("types", "grid"), np.array([3, 2]))
>>> per_token, per_sample
(['types'], ['grid'])
>>> concat_per_sample(samples, "grid", np.array([1, 0]), np.array([True, True])).tolist()
[[1, 2, 2]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from padfree.errors import InvalidArgumentError, InvalidSampleError, describe

__all__ = ["as_carry", "concat_per_sample", "per_token_values", "split_columns"]

#: columns that are per token by their meaning, whatever their values look like
PER_TOKEN = frozenset({"mm_token_type_ids", "token_type_ids"})
# what a collator reads itself: never carried
_OWN = frozenset({"input_ids", "labels", "attention_mask", "position_ids", "seq_lens", "seq_lengths", "cu_seq_lens",
                  "cu_seqlens"})


def as_carry(carry: Any) -> tuple[str, ...]:
    """``carry`` (None, or column names) as a tuple of names, or :class:`InvalidArgumentError`."""
    if carry is None:
        return ()
    names = (carry,) if isinstance(carry, str) else carry
    if not isinstance(names, Sequence) or not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError(f"carry must be None or a list of column names, got {describe(carry)}")
    own = sorted(set(names) & _OWN)
    if own:
        raise InvalidArgumentError(f"carry names {own}, which the collator builds itself; carry other columns "
                                   f"(pixel_values, image_grid_thw, mm_token_type_ids, ...)")
    return tuple(dict.fromkeys(names))


def _value(sample: Any, key: str) -> Any:
    return sample.get(key) if isinstance(sample, Mapping) else None


def _length(value: Any) -> int | None:
    """The length of a 1-D sequence (a list of scalars, a 1-D array or tensor), else None."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    if isinstance(value, (list, tuple)) and all(np.isscalar(v) for v in value):
        return len(value)
    return None


def split_columns(samples: Sequence[Any], carry: Sequence[str], lengths: np.ndarray) -> tuple[list[str], list[str]]:
    """``(per-token columns, per-sample columns)`` of ``carry``: a column is per token when every sample's value is
    a 1-D sequence as long as its tokens (or its name says so, :data:`PER_TOKEN`, and then it must be); a column
    whose values are 1-D and as long as the tokens in some samples but not in others is refused."""
    per_token, per_sample = [], []
    for key in carry:
        sizes = [_length(_value(s, key)) for s in samples]
        fits = [size == int(n) for size, n in zip(sizes, lengths, strict=True)]
        if key in PER_TOKEN or (any(fits) and all(size is not None for size in sizes)):
            bad = next((i for i, ok in enumerate(fits) if not ok), None)
            if bad is not None:
                raise InvalidSampleError(
                    f"samples[{bad}][{key!r}] is {describe(_value(samples[bad], key))}, not one value per token of "
                    f"its {int(lengths[bad])} input_ids; {key} is laid out like the tokens")
            per_token.append(key)
        else:
            per_sample.append(key)
    return per_token, per_sample


def per_token_values(samples: Sequence[Any], key: str) -> list[np.ndarray]:
    """Every sample's ``key`` as a flat int64 array (a ``(1, n)`` tensor flattened)."""
    out = []
    for i, sample in enumerate(samples):
        value = _value(sample, key)
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if not np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_:
            raise InvalidSampleError(f"samples[{i}][{key!r}] holds {array.dtype} values; a per-token column is "
                                     f"carried as integers")
        out.append(array.reshape(-1).astype(np.int64, copy=False))
    return out


def concat_per_sample(samples: Sequence[Any], key: str, order: np.ndarray, whole: np.ndarray) -> torch.Tensor | None:
    """The samples' ``key`` values concatenated along dim 0 in ``order`` (sample index of every piece, row after
    row); ``whole[i]``: piece ``i`` is its sample entire. None when no sample has one.

    Raises:
        InvalidSampleError: a sample with a value is split, truncated or packed twice, or values that cannot be
            concatenated (ranks or trailing sizes differ).
    """
    parts = []
    seen = set()
    for piece, index in enumerate(order.tolist()):
        value = _value(samples[index], key)
        if value is None or (hasattr(value, "__len__") and len(value) == 0):
            continue
        if not whole[piece] or index in seen:
            raise InvalidSampleError(
                f"samples[{index}] carries {key!r} but its tokens were split across rows or truncated, so its "
                f"{key} would not sit beside its tokens; raise the capacity or use overlong='drop' for such samples")
        seen.add(index)
        parts.append(value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value)))
    if not parts:
        return None
    trailing = {tuple(p.shape[1:]) for p in parts}
    if len(trailing) > 1 or any(p.dim() == 0 for p in parts):
        raise InvalidSampleError(f"the samples' {key!r} values cannot be concatenated along their first dimension "
                                 f"(shapes {sorted(tuple(p.shape) for p in parts)[:4]}); give every sample's {key} "
                                 f"the same trailing sizes")
    return torch.cat(parts)
