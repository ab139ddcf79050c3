"""Lengths in, plan out: the packing engine (numpy + numba, never torch)."""

from padfree.packing.balance import BalancedSteps, balance_bins
from padfree.packing.result import PackResult
from padfree.packing.strategies import STRATEGIES, Packer, Strategy, pack_sequences
from padfree.packing.streaming import StreamBin, StreamPacker

__all__ = [
    "STRATEGIES",
    "BalancedSteps",
    "PackResult",
    "Packer",
    "Strategy",
    "StreamBin",
    "StreamPacker",
    "balance_bins",
    "pack_sequences",
]
