"""padfree: exact padding-free (packed-sequence) training for causal language models.

``import padfree`` stays free of torch and datasets: the names that need them are imported on first use.
"""

from typing import Any

from padfree import layout
from padfree.analysis import LengthAnalysis, analyze_lengths
from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidLengthsError,
    InvalidSampleError,
    InvalidTokensError,
    OverlongSequenceError,
    PackingDisabledError,
    PackingMismatchError,
    PadfreeError,
    RankMismatchError,
    StateMismatchError,
    TokenizerLoadError,
    UnsupportedModelError,
)
from padfree.layout import get_seqlens_in_batch, get_unpad_data
from padfree.packing import (
    DEFAULT_STRATEGY,
    STRATEGIES,
    BalancedSteps,
    Packer,
    PackResult,
    StreamBin,
    StreamPacker,
    balance_bins,
    pack_sequences,
)
from padfree.rows import PackedRows, packed_rows

__version__ = "0.1.0"

# name -> module, imported on first access (PEP 562): these need torch or datasets
_LAZY = {
    "PackedBatch": "padfree.data.batch",
    "PaddingFreeCollator": "padfree.data.batch",
    "pack_result_to_tensors": "padfree.data.batch",
    "packed_collate_fn": "padfree.data.batch",
    "PackingDataset": "padfree.data.datasets",
    "IterablePackingDataset": "padfree.data.datasets",
    "pack_dataset": "padfree.data.hf",
    "pack_dataset_from_result": "padfree.data.hf",
    "configure_packing": "padfree.model.configure",
    "unconfigure_packing": "padfree.model.configure",
    "packing_state": "padfree.model.configure",
    "PackingReport": "padfree.model.configure",
    "SUPPORTED_MODEL_TYPES": "padfree.model.configure",
    "verify": "padfree.model.verify",
    "VerifyReport": "padfree.model.verify",
    "check_support": "padfree.model.support",
    "causal_lm_loss": "padfree.model.loss",
    "linear_cross_entropy": "padfree.model.loss",
    "SFTTrainer": "padfree.integrations.trl",
    "SFTConfig": "padfree.integrations.trl",
    "Trainer": "padfree.integrations.trainer",
    "enable": "padfree.integrations.enable",
    "packing_status": "padfree.integrations.status",
    "PackingStatus": "padfree.integrations.status",
    "PackingTelemetryCallback": "padfree.integrations.telemetry",
    "PackedRowsCollator": "padfree.integrations.trainer_data",
    "pack_for_trainer": "padfree.integrations.trainer_data",
    "DistributedPackedBatchSampler": "padfree.integrations.distributed",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'padfree' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "SUPPORTED_MODEL_TYPES",
    "BackendUnavailableError",
    "BalancedSteps",
    "DataLoadError",
    "DistributedPackedBatchSampler",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidLengthsError",
    "InvalidSampleError",
    "InvalidTokensError",
    "IterablePackingDataset",
    "LengthAnalysis",
    "OverlongSequenceError",
    "PackResult",
    "PackedBatch",
    "PackedRows",
    "PackedRowsCollator",
    "Packer",
    "PackingDataset",
    "PackingDisabledError",
    "PackingMismatchError",
    "PackingReport",
    "PackingStatus",
    "PackingTelemetryCallback",
    "PaddingFreeCollator",
    "PadfreeError",
    "RankMismatchError",
    "SFTConfig",
    "SFTTrainer",
    "StateMismatchError",
    "StreamBin",
    "StreamPacker",
    "TokenizerLoadError",
    "Trainer",
    "UnsupportedModelError",
    "VerifyReport",
    "analyze_lengths",
    "balance_bins",
    "causal_lm_loss",
    "check_support",
    "configure_packing",
    "enable",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "layout",
    "linear_cross_entropy",
    "pack_dataset",
    "pack_dataset_from_result",
    "pack_for_trainer",
    "pack_result_to_tensors",
    "pack_sequences",
    "packed_collate_fn",
    "packed_rows",
    "packing_state",
    "packing_status",
    "unconfigure_packing",
    "verify",
]
