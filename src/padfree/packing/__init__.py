"""Lengths in, plan out: the packing engine (numpy + numba, never torch)."""

from padfree.packing.balance import BalancedSteps, balance_bins
from padfree.packing.metrics import Pack, PackMetrics
from padfree.packing.packer import Packer, pack_sequences
from padfree.packing.result import PackResult, as_pack_result
from padfree.packing.spec import PackingSpec
from padfree.packing.strategies import DEFAULT_STRATEGY, STRATEGIES, Strategy, as_strategy
from padfree.packing.streaming import StreamBin, StreamPacker

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "BalancedSteps",
    "Pack",
    "PackMetrics",
    "PackResult",
    "Packer",
    "PackingSpec",
    "Strategy",
    "StreamBin",
    "StreamPacker",
    "as_pack_result",
    "as_strategy",
    "balance_bins",
    "pack_sequences",
]
