"""padfree: exact padding-free (packed-sequence) training for causal language models."""

from padfree import layout
from padfree.analysis import LengthAnalysis, analyze_lengths
from padfree.errors import (
    BackendUnavailableError,
    DataLoadError,
    InvalidArgumentError,
    InvalidLayoutError,
    InvalidLengthsError,
    InvalidTokensError,
    OverlongSequenceError,
    PadfreeError,
    TokenizerLoadError,
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

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "BackendUnavailableError",
    "BalancedSteps",
    "DataLoadError",
    "InvalidArgumentError",
    "InvalidLayoutError",
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
    "get_seqlens_in_batch",
    "get_unpad_data",
    "layout",
    "pack_sequences",
    "packed_rows",
]
