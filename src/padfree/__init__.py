"""padfree: exact padding-free (packed-sequence) training for causal language models.

The top level holds the seed-compatible names (SeqPacker's packing API, LLaMA-Factory's helpers), the routes to
packed rows (and to a rank's slice of them under sequence parallelism), the model and trainer entry points (SFT, DPO,
reward, GRPO and the plain Trainer), the packing options (``PackingSpec``, ``RowSpec``) and the errors users catch —
50 names. Everything else is reachable from its module (``padfree.packing``, ``padfree.rows``, ``padfree.samples``,
``padfree.model.*``, ``padfree.proof.*``, ``padfree.integrations.*``).
``import padfree`` stays free of torch and datasets: the names that need them are imported on first use.

>>> import padfree
>>> len(padfree.__all__)
50
>>> padfree.pack_sequences([3, 2, 2], capacity=4).bins
[[0], [1, 2]]
"""

from typing import Any

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
    PadfreeError,
    StateMismatchError,
    UnsupportedModelError,
)

__version__ = "0.1.0"

# name -> module, imported on first access (PEP 562): these need torch or datasets, or numba (the packing
# engine), which the command line does not import before its argument checks
_LAZY = {
    "Packer": "padfree.packing",
    "PackResult": "padfree.packing",
    "StreamPacker": "padfree.packing",
    "pack_sequences": "padfree.packing",
    "PackingSpec": "padfree.packing",
    "RowSpec": "padfree.rows",
    "get_seqlens_in_batch": "padfree.layout",
    "get_unpad_data": "padfree.layout",
    "PackedBatch": "padfree.data.batch",
    "PaddingFreeCollator": "padfree.data.batch",
    "pack_result_to_tensors": "padfree.data.batch",
    "packed_collate_fn": "padfree.data.batch",
    "PackingDataset": "padfree.data.datasets",
    "IterablePackingDataset": "padfree.data.datasets",
    "pack_dataset": "padfree.data.hf",
    "pack_dataset_from_result": "padfree.data.hf",
    "plan_dataset": "padfree.data.hf",
    "configure_packing": "padfree.model.configure",
    "unconfigure_packing": "padfree.model.configure",
    "verify": "padfree.proof.check",
    "causal_lm_loss": "padfree.model.loss",
    "SFTTrainer": "padfree.integrations.sft",
    "SFTConfig": "padfree.integrations.sft",
    "DPOTrainer": "padfree.integrations.dpo",
    "DPOConfig": "padfree.integrations.dpo",
    "RewardTrainer": "padfree.integrations.reward",
    "RewardConfig": "padfree.integrations.reward",
    "GRPOTrainer": "padfree.integrations.grpo",
    "GRPOConfig": "padfree.integrations.grpo",
    "Trainer": "padfree.integrations.trainer",
    "enable": "padfree.integrations.enable",
    "packing_status": "padfree.integrations.status",
    "PackingTelemetryCallback": "padfree.integrations.telemetry",
    "PackedRowsCollator": "padfree.integrations.trainer_data",
    "pack_for_trainer": "padfree.integrations.trainer_data",
    "DistributedPackedBatchSampler": "padfree.integrations.distributed",
    "split_for_sequence_parallel": "padfree.sequence_parallel",
}

# names that were top-level before the public surface shrank to 40: where they live now
_MOVED = {
    "BalancedSteps": "padfree.packing",
    "DEFAULT_STRATEGY": "padfree.packing",
    "LengthAnalysis": "padfree.analysis",
    "PackedRows": "padfree.rows",
    "PackingMismatchError": "padfree.errors",
    "PackingReport": "padfree.model.configure",
    "PackingStatus": "padfree.integrations.status",
    "RankMismatchError": "padfree.errors",
    "STRATEGIES": "padfree.packing",
    "SUPPORTED_MODEL_TYPES": "padfree.model.configure",
    "StreamBin": "padfree.packing",
    "TokenizerLoadError": "padfree.errors",
    "VerifyReport": "padfree.proof.check",
    "analyze_lengths": "padfree.analysis",
    "balance_bins": "padfree.packing",
    "check_support": "padfree.proof.backends",
    "linear_cross_entropy": "padfree.model.loss",
    "packed_rows": "padfree.rows",
    "packing_state": "padfree.model.configure",
}


def __getattr__(name: str) -> Any:
    if name == "layout":  # the module itself; importing it binds the attribute
        import importlib

        return importlib.import_module("padfree.layout")
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        raise AttributeError(f"padfree.{name} is not a top-level name; use {_MOVED[name]}.{name} "
                             f"(from {_MOVED[name]} import {name})")
    raise AttributeError(f"module 'padfree' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BackendUnavailableError",
    "DPOConfig",
    "DPOTrainer",
    "DataLoadError",
    "DistributedPackedBatchSampler",
    "GRPOConfig",
    "GRPOTrainer",
    "InvalidArgumentError",
    "InvalidLayoutError",
    "InvalidLengthsError",
    "InvalidSampleError",
    "InvalidTokensError",
    "IterablePackingDataset",
    "OverlongSequenceError",
    "PackResult",
    "PackedBatch",
    "PackedRowsCollator",
    "Packer",
    "PackingDataset",
    "PackingDisabledError",
    "PackingSpec",
    "PackingTelemetryCallback",
    "PaddingFreeCollator",
    "PadfreeError",
    "RewardConfig",
    "RewardTrainer",
    "RowSpec",
    "SFTConfig",
    "SFTTrainer",
    "StateMismatchError",
    "StreamPacker",
    "Trainer",
    "UnsupportedModelError",
    "causal_lm_loss",
    "configure_packing",
    "enable",
    "get_seqlens_in_batch",
    "get_unpad_data",
    "layout",
    "pack_dataset",
    "pack_dataset_from_result",
    "pack_for_trainer",
    "pack_result_to_tensors",
    "pack_sequences",
    "packed_collate_fn",
    "packing_status",
    "plan_dataset",
    "split_for_sequence_parallel",
    "unconfigure_packing",
    "verify",
]
