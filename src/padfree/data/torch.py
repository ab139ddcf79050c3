"""The torch side of the data layer in one import: batches and collators (:mod:`padfree.data.batch`) and the
packing datasets (:mod:`padfree.data.datasets`)."""

from padfree.data.batch import (
    PackedBatch,
    PackedCollator,
    PaddingFreeCollator,
    pack_result_to_tensors,
    packed_collate_fn,
)
from padfree.data.datasets import IterablePackingDataset, PackingDataset

__all__ = [
    "IterablePackingDataset",
    "PackedBatch",
    "PackedCollator",
    "PackingDataset",
    "PaddingFreeCollator",
    "pack_result_to_tensors",
    "packed_collate_fn",
]
