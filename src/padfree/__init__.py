"""padfree: exact padding-free (packed-sequence) training for causal language models."""

from padfree.analysis import LengthAnalysis, analyze_lengths
from padfree.errors import (
    DataLoadError,
    InvalidArgumentError,
    InvalidLengthsError,
    InvalidTokensError,
    OverlongSequenceError,
    PadfreeError,
    TokenizerLoadError,
)
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

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "BalancedSteps",
    "DataLoadError",
    "InvalidArgumentError",
    "InvalidLengthsError",
    "InvalidTokensError",
    "LengthAnalysis",
    "OverlongSequenceError",
    "PackResult",
    "PackedRows",
    "Packer",
    "PadfreeError",
    "StreamBin",
    "StreamPacker",
    "TokenizerLoadError",
    "analyze_lengths",
    "balance_bins",
    "pack_sequences",
    "packed_rows",
]
