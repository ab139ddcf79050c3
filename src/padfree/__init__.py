"""padfree: exact padding-free (packed-sequence) training for causal language models."""

from padfree.errors import (
    InvalidArgumentError,
    InvalidLengthsError,
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

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "BalancedSteps",
    "InvalidArgumentError",
    "InvalidLengthsError",
    "OverlongSequenceError",
    "PackResult",
    "Packer",
    "PadfreeError",
    "StreamBin",
    "StreamPacker",
    "balance_bins",
    "pack_sequences",
]
