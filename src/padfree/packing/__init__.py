"""Lengths in, plan out: the packing engine (numpy + numba, never torch)."""

from padfree.packing.result import PackResult
from padfree.packing.strategies import STRATEGIES, Packer, Strategy, pack_sequences

__all__ = ["STRATEGIES", "PackResult", "Packer", "Strategy", "pack_sequences"]
