"""padfree: exact padding-free (packed-sequence) training for causal language models."""

from padfree.errors import (
    InvalidArgumentError,
    InvalidLengthsError,
    InvalidTokensError,
    OverlongSequenceError,
    PadfreeError,
)
from padfree.packing import (
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

__all__ = [
    "STRATEGIES",
    "BalancedSteps",
    "InvalidArgumentError",
    "InvalidLengthsError",
    "InvalidTokensError",
    "OverlongSequenceError",
    "PackResult",
    "PackedRows",
    "Packer",
    "PadfreeError",
    "StreamBin",
    "StreamPacker",
    "balance_bins",
    "pack_sequences",
    "packed_rows",
]
