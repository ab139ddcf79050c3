"""The data a ``Trainer`` trains on: packed rows (:func:`pack_for_trainer`) and the collator that reads them.

:func:`pack_for_trainer` packs a tokenized ``datasets.Dataset`` globally into unpadded rows; :class:`PackedRowsCollator`
flattens each loader batch into one row with restarting ``position_ids`` and no ``attention_mask`` (rows that are
already packed keep their boundaries).

>>> rows = pack_for_trainer({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}, max_length=6)
>>> batch = PackedRowsCollator()([rows[0], rows[1]])
>>> batch["input_ids"].tolist(), batch["position_ids"].tolist()
([[6, 7, 8, 9, 4, 5, 1, 2, 3]], [[0, 1, 2, 3, 0, 1, 0, 1, 2]])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from padfree.data.batch import PaddingFreeCollator
from padfree.errors import BackendUnavailableError, InvalidArgumentError, InvalidLayoutError, describe
from padfree.layout import IGNORE_INDEX, position_ids_to_lengths
from padfree.packing.strategies import DEFAULT_STRATEGY

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is installed wherever this module is used
    raise BackendUnavailableError("padfree.integrations.trainer_data needs torch; pip install 'padfree[torch]'"
                                  ) from exc

__all__ = ["PackedRowsCollator", "pack_for_trainer"]

_ACCEPTED_POSITIONS = ("accepted: one position per input_ids token, restarting at 0 at every sequence of the row and "
                       "counting up by 1 within it")


class PackedRowsCollator(PaddingFreeCollator):
    """A :class:`~padfree.PaddingFreeCollator` for the ``Trainer``: every loader batch becomes one row with
    restarting ``position_ids``, no padding and no ``attention_mask``, returned as a dict of model inputs.

    Samples are token ids or dicts with ``input_ids`` (and optionally ``labels``). Rows that are already packed
    (:func:`pack_for_trainer`, :func:`padfree.pack_dataset` with ``padding=None``) keep their boundaries: read from
    ``seq_lens``, or — when the ``Trainer`` dropped that column (``remove_unused_columns``) — from their
    ``position_ids``, which restart at every sequence. A packed row without either raises rather than being trained
    as one long sequence, and so do ``position_ids`` that are not a packing (a jump, a negative value, a row that
    does not start at 0, one position more or fewer than tokens) or that disagree with ``seq_lens``
    (:class:`~padfree.errors.InvalidLayoutError`).

    Args:
        label_padding_value, seq_idx, max_tokens: as in :class:`~padfree.PaddingFreeCollator`.
        flash_kwargs: also return ``cu_seq_lens_q/k`` and ``max_length_q/k``. Off by default: a model made exact by
            ``configure_packing`` derives its boundaries from ``position_ids`` (and hands flash-attn its own
            offsets), and a batch that holds a single sequence must reach transformers' ordinary code without them
            (its recurrent layers refuse ``cu_seqlens`` when their kernels are missing).

    >>> collate = PackedRowsCollator()
    >>> batch = collate([{"input_ids": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]}, {"input_ids": [3, 4]}])
    >>> batch["position_ids"].tolist(), batch["labels"].tolist()
    ([[0, 1, 2, 0, 1, 0, 1]], [[-100, 6, 7, -100, 9, -100, 4]])
    >>> sorted(batch)
    ['input_ids', 'labels', 'position_ids', 'use_cache']
    """

    def __init__(self, *, label_padding_value: int = IGNORE_INDEX, seq_idx: bool = False,
                 max_tokens: int | None = None, flash_kwargs: bool = False) -> None:
        super().__init__(label_padding_value=label_padding_value, seq_idx=seq_idx, return_dict=False,
                         max_tokens=max_tokens)
        self.flash_kwargs = bool(flash_kwargs)

    def __call__(self, samples: Sequence[Any]) -> Any:
        if samples and isinstance(samples[0], Mapping):
            samples = [self._with_seq_lens(s, i) for i, s in enumerate(samples)]
            if any("seq_lens" in s for s in samples):
                samples = [s if "seq_lens" in s else {**s, "seq_lens": [len(s["input_ids"])]} for s in samples]
        return super().__call__(samples).model_inputs(flash_kwargs=self.flash_kwargs)

    @staticmethod
    def _with_seq_lens(sample: Any, i: int) -> Any:
        """``sample`` with the boundaries its ``position_ids`` spell, as ``seq_lens`` (kept when it has them and
        they agree); anything that is not a dict with both fields is left to the sample reader to judge."""
        if not isinstance(sample, Mapping) or sample.get("position_ids") is None:
            return sample
        try:
            tokens = len(sample["input_ids"])
        except (KeyError, TypeError):  # no token ids: the sample reader refuses the sample by name
            return sample
        lengths = _position_lengths(sample["position_ids"], tokens, f"samples[{i}]['position_ids']")
        given = sample.get("seq_lens")
        if given is None:
            return {k: v for k, v in sample.items() if k != "position_ids"} | {"seq_lens": lengths.tolist()}
        given = given.tolist() if isinstance(given, torch.Tensor) else given
        try:
            agree = np.asarray(given).tolist() == lengths.tolist()
        except (TypeError, ValueError):  # unreadable seq_lens: the sample reader refuses them by name
            return sample
        if not agree:
            raise InvalidLayoutError(
                f"samples[{i}]['position_ids'] split the row into sequences of {lengths.tolist()} tokens, but its "
                f"'seq_lens' = {describe(given)}; both spell the same boundaries, so they must agree")
        return sample


def _position_lengths(position_ids: Any, tokens: int, where: str) -> np.ndarray:
    """``(n,) int64`` — the sequence lengths that one row's ``position_ids`` spell, or InvalidLayoutError naming
    ``where``, the value and what is accepted."""
    values = position_ids.tolist() if isinstance(position_ids, torch.Tensor) else position_ids
    try:
        row = np.asarray(values)
    except (TypeError, ValueError):  # ragged nesting
        row = None
    if row is None or row.ndim != 1 or row.shape[0] != tokens:
        got = "a ragged nesting" if row is None else f"shape {row.shape}"
        raise InvalidLayoutError(f"{where} = {describe(position_ids)} must be 1-D with one position per token "
                                 f"({tokens}), got {got}; {_ACCEPTED_POSITIONS}")
    try:
        return position_ids_to_lengths(row[None, :])
    except InvalidLayoutError as exc:
        # layout names the offending entry of the (1, T) row it was given; its hint about attention masks does
        # not apply to a sample, so only the first clause is kept
        detail = str(exc).split(";")[0]
        raise InvalidLayoutError(f"{where} = {describe(position_ids)} is not a packed row ({detail}); "
                                 f"{_ACCEPTED_POSITIONS}") from exc


def pack_for_trainer(dataset: Any, max_length: int, strategy: str = DEFAULT_STRATEGY, seed: int | None = None, *,
                     overlong: str = "error", max_sequences_per_bin: int | None = None,
                     return_result: bool = False) -> Any:
    """Pack a tokenized dataset globally into unpadded rows of at most ``max_length`` tokens for the ``Trainer``.

    :func:`padfree.pack_dataset` with the columns a ``Trainer`` keeps and :class:`PackedRowsCollator` reads:
    ``input_ids``, ``labels`` (the first token of every sequence and masked input labels ``-100``),
    ``position_ids`` (restarting per sequence) and ``seq_lens``. ``dataset`` has ``input_ids`` and optionally
    ``labels`` (or TRL's ``completion_mask`` / ``assistant_masks``).

    >>> rows = pack_for_trainer({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}, max_length=6)
    >>> rows[:]["input_ids"], rows[:]["position_ids"]
    ([[6, 7, 8, 9, 4, 5], [1, 2, 3]], [[0, 1, 2, 3, 0, 1], [0, 1, 2]])
    """
    from padfree.data.hf import pack_dataset

    if max_length is None or isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) \
            or max_length < 1:
        raise InvalidArgumentError(f"max_length must be an int >= 1 (the tokens of one packed row), got "
                                   f"{describe(max_length)}")
    return pack_dataset(dataset, int(max_length), strategy, seed, overlong=overlong,
                        max_sequences_per_bin=max_sequences_per_bin, padding=None, attention_mask=None,
                        columns=["input_ids", "labels", "position_ids", "seq_lens"], return_result=return_result)
