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
import torch

from padfree.data.batch import PaddingFreeCollator  # needs torch, and says so when it is missing
from padfree.data.carry import PER_TOKEN
from padfree.errors import InvalidArgumentError, InvalidLayoutError, InvalidSampleError, describe
from padfree.layout import IGNORE_INDEX
from padfree.packing.packer import pack_sequences
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY
from padfree.rows import RowSpec

__all__ = ["PackedRowsCollator", "PackedVisionCollator", "pack_for_trainer", "pack_vision_rows", "trainer_rows"]

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


#: the layout of the rows a ``Trainer`` reads: unpadded, without a mask (:class:`PackedRowsCollator` builds the
#: boundaries from ``position_ids`` and ``seq_lens``)
TRAINER_ROWS = RowSpec(padding=None, attention_mask=None)
#: the columns a ``Trainer`` keeps and :class:`PackedRowsCollator` reads
TRAINER_COLUMNS = ("input_ids", "labels", "position_ids", "seq_lens")


def pack_for_trainer(dataset: Any, max_length: int | None = None, strategy: str = DEFAULT_STRATEGY,
                     seed: int | None = None, *, overlong: str = "error", max_sequences_per_bin: int | None = None,
                     spec: PackingSpec | None = None) -> Any:
    """Pack a tokenized dataset globally into unpadded rows of at most ``max_length`` tokens for the ``Trainer``.

    :func:`padfree.pack_dataset` with the columns a ``Trainer`` keeps and :class:`PackedRowsCollator` reads:
    ``input_ids``, ``labels`` (the first token of every sequence and masked input labels ``-100``),
    ``position_ids`` (restarting per sequence) and ``seq_lens``. ``dataset`` has ``input_ids`` and optionally
    ``labels`` (or TRL's ``completion_mask`` / ``assistant_masks``). ``spec``: the packing settings as one
    :class:`~padfree.PackingSpec` (its ``capacity`` is ``max_length``), in place of the keywords. For the plan too,
    make it with :func:`padfree.plan_dataset` and lay it out with :func:`trainer_rows`.

    >>> rows = pack_for_trainer({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}, max_length=6)
    >>> rows[:]["input_ids"], rows[:]["position_ids"]
    ([[6, 7, 8, 9, 4, 5], [1, 2, 3]], [[0, 1, 2, 3, 0, 1], [0, 1, 2]])
    """
    from padfree.data.hf import pack_dataset

    if spec is None or max_length is not None:
        _check_max_length(max_length)
    packing = PackingSpec.resolve(spec, {"capacity": max_length, "strategy": strategy, "seed": seed,
                                         "overlong": overlong, "max_sequences_per_bin": max_sequences_per_bin},
                                  names={"capacity": "max_length"})
    return pack_dataset(dataset, spec=packing, rows=TRAINER_ROWS, columns=list(TRAINER_COLUMNS))


def trainer_rows(plan: Any, dataset: Any) -> Any:
    """The rows of ``plan`` (:func:`padfree.plan_dataset` over ``dataset``) laid out as :func:`pack_for_trainer`
    lays them out.

    >>> from padfree import plan_dataset
    >>> data = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}
    >>> trainer_rows(plan_dataset(data, 6), data)[:]["seq_lens"]
    [[4, 2], [3]]
    """
    from padfree.data.hf import pack_dataset_from_result

    return pack_dataset_from_result(plan, dataset, rows=TRAINER_ROWS, columns=list(TRAINER_COLUMNS))


def _check_max_length(max_length: Any) -> None:
    if max_length is None or isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) \
            or max_length < 1:
        raise InvalidArgumentError(f"max_length must be an int >= 1 (the tokens of one packed row), got "
                                   f"{describe(max_length)}")


class PackedVisionCollator:
    """A padded vision-language collator (TRL's ``DataCollatorForVisionLanguageModeling``: it runs the processor on
    the images and texts of a loader batch) made padding-free: the batch it returns becomes one row.

    The processor's padded batch ``(B, T)`` with its right-padding ``attention_mask`` turns into one row of the
    ``N = Σ lengths`` real tokens: ``input_ids``, ``labels`` and the per-token columns (``mm_token_type_ids``,
    ``token_type_ids``) ``(1, N)``, ``position_ids`` ``(1, N)`` restarting at 0 per sample, the first label of
    every sample ``-100`` and no ``attention_mask``. Every other value (``pixel_values``, ``image_grid_thw``, ...)
    is passed on as the processor made it: the samples keep their order, so their images stay concatenated in the
    order the model meets their image tokens. A model configured by :func:`padfree.configure_packing` computes each
    sample's mRoPE positions or image blocks from them.

    A loader batch may also hold rows of samples (lists, as :func:`pack_vision_rows` makes them): their samples go
    through ``collator`` together, row after row, into the one row.

    Args:
        collator: called with a list of samples, returns a mapping with ``input_ids``, ``attention_mask`` and
            ``labels`` of shape ``(B, T)`` (padded on the right) and the vision values.

    >>> import torch
    >>> def padded(samples):  # what a processor's padded batch looks like
    ...     ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    ...     return {"input_ids": ids, "attention_mask": (ids > 0).long(), "labels": ids.masked_fill(ids == 0, -100),
    ...             "pixel_values": torch.ones(2, 4)}
    >>> batch = PackedVisionCollator(padded)([{}, {}])
    >>> batch["input_ids"].tolist(), batch["position_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [[-100, 6, 7, -100, 9]])
    >>> tuple(batch["pixel_values"].shape), "attention_mask" in batch
    ((2, 4), False)
    """

    def __init__(self, collator: Any) -> None:
        if not callable(collator):
            raise InvalidArgumentError(f"collator must be callable (samples -> a padded batch), got "
                                       f"{describe(collator)}")
        self.collator = collator

    def __call__(self, samples: Sequence[Any]) -> dict[str, Any]:
        flat = [s for item in samples for s in (item if isinstance(item, list) else [item])]
        return unpad_vision_batch(dict(self.collator(flat)))


def unpad_vision_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A processor's right-padded batch as one padding-free row (see :class:`PackedVisionCollator`)."""
    mask = batch.pop("attention_mask", None)
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise InvalidSampleError(f"the vision collator returned input_ids {describe(ids)}; a (B, T) tensor expected")
    if mask is None:
        mask = torch.ones_like(ids)
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise InvalidLayoutError(f"attention_mask is {describe(mask)}, not a 0/1 mask of input_ids' shape "
                                 f"{tuple(ids.shape)}")
    keep = mask.bool()
    lengths = keep.sum(1)
    cols = torch.arange(ids.shape[1], device=ids.device)
    if not torch.equal(keep, cols[None] < lengths[:, None]):
        # padding before or inside a sample moves its positions; transformers' processors pad on the right
        raise InvalidLayoutError("the vision collator's attention_mask pads before or inside a sample; padfree reads "
                                 "batches padded on the right (padding_side='right')")
    if bool((lengths == 0).any()):
        raise InvalidSampleError(f"sample {int((lengths == 0).nonzero()[0])} of the batch has no tokens")
    out: dict[str, Any] = {}
    for key, value in batch.items():
        per_token = key in ("input_ids", "labels") or key in PER_TOKEN
        if per_token and isinstance(value, torch.Tensor) and value.shape == ids.shape:
            out[key] = value[keep][None]
        else:
            out[key] = value
    starts = torch.cumsum(lengths, 0) - lengths
    labels = out.get("labels")
    if labels is None:
        labels = out["input_ids"].clone()
    labels = labels.clone()
    labels[0, starts] = IGNORE_INDEX  # no sample's first token is the target of the sample before it
    out["labels"] = labels
    out["position_ids"] = cols.expand_as(ids)[keep][None]
    out["use_cache"] = False
    return out


class VisionRows(torch.utils.data.Dataset):
    """Rows of vision-language samples, packed by their token counts: item ``i`` is the list of the samples of row
    ``i`` (read from ``dataset`` when asked: images are processed by the collator, one loader batch at a time)."""

    def __init__(self, dataset: Any, rows: list[list[int]]) -> None:
        self.dataset, self.rows = dataset, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[Any]:
        return [self.dataset[int(i)] for i in self.rows[index]]


def pack_vision_rows(dataset: Any, lengths: Any, max_length: int, strategy: str = DEFAULT_STRATEGY,
                     seed: int | None = None) -> tuple[VisionRows, Any]:
    """``(rows, plan)``: the samples of ``dataset`` — whose processed token counts are ``lengths`` ``(n,)`` — packed
    into rows of at most ``max_length`` tokens (:func:`padfree.pack_sequences`); every sample whole, since its images
    belong to its tokens.

    >>> rows, plan = pack_vision_rows(["a", "b", "c"], [3, 2, 4], max_length=6)
    >>> [rows[i] for i in range(len(rows))], plan.num_bins
    ([['c', 'b'], ['a']], 2)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = pack_sequences(lengths, int(max_length), strategy, seed)
    return VisionRows(dataset, plan.bins), plan
