"""Lengths in, plan out: the packing engine (numpy + numba, never torch)."""

from padfree.packing.balance import BalancedSteps, balance_bins
from padfree.packing.metrics import Pack, PackMetrics
from padfree.packing.result import PackResult, as_pack_result
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, Packer, Strategy, as_strategy, pack_sequences
from padfree.packing.streaming import StreamBin, StreamPacker

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "BalancedSteps",
    "Pack",
    "PackMetrics",
    "PackResult",
    "Packer",
    "Strategy",
    "StreamBin",
    "StreamPacker",
    "as_pack_result",
    "as_strategy",
    "balance_bins",
    "pack_sequences",
]
