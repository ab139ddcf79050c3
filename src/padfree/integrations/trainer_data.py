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

from collections.abc import Sequence
from typing import Any

import numpy as np

from padfree.data.batch import PaddingFreeCollator  # needs torch, and says so when it is missing
from padfree.errors import InvalidArgumentError, describe
from padfree.layout import IGNORE_INDEX
from padfree.packing.strategies import DEFAULT_STRATEGY

__all__ = ["PackedRowsCollator", "pack_for_trainer"]

class PackedRowsCollator(PaddingFreeCollator):
    """A :class:`~padfree.PaddingFreeCollator` for the ``Trainer``: every loader batch becomes one row with
    restarting ``position_ids``, no padding and no ``attention_mask``, returned as a dict of model inputs.

    Samples are token ids or dicts with ``input_ids`` (and optionally ``labels``). Rows that are already packed
    (:func:`pack_for_trainer`, :func:`padfree.pack_dataset` with ``padding=None``, TRL's ``pack_dataset``) keep their
    boundaries, read by :func:`padfree.samples.row_boundaries` — the rule of every collator — from any spelling they
    carry: ``seq_lens``, TRL's ``seq_lengths``, ``cu_seq_lens`` / ``cu_seqlens``, a LLaMA-Factory segment
    ``attention_mask``, or — when the ``Trainer`` dropped the others (``remove_unused_columns``) — ``position_ids``
    restarting at every sequence. A packed row without any is trained as one sequence, so keep one column; spellings
    that are not a packing (a jump in the positions, lengths that do not sum to the row, padding inside a sample) or
    that disagree raise :class:`~padfree.errors.InvalidLayoutError` naming the sample and the field.

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
    >>> collate([{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]}])["position_ids"].tolist()
    [[0, 1, 2, 0, 1]]
    """

    def __init__(self, *, label_padding_value: int = IGNORE_INDEX, seq_idx: bool = False,
                 max_tokens: int | None = None, flash_kwargs: bool = False) -> None:
        super().__init__(label_padding_value=label_padding_value, seq_idx=seq_idx, return_dict=False,
                         max_tokens=max_tokens)
        self.flash_kwargs = bool(flash_kwargs)

    def __call__(self, samples: Sequence[Any]) -> Any:
        return super().__call__(samples).model_inputs(flash_kwargs=self.flash_kwargs)


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
