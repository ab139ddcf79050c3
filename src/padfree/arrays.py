"""The few array operations numpy and torch spell differently, behind one interface: numpy in, numpy out; torch in,
torch out, on the input's device. Torch is imported only when a tensor arrives, so modules built on this stay
torch-free until one does.

>>> import numpy as np
>>> backend_of(np.array([1, 2])).flatnonzero(np.array([0, 3, 0, 4])).tolist()
[1, 3]
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from padfree.errors import BackendUnavailableError

__all__ = ["NumpyOps", "TorchOps", "backend_of", "import_torch", "torch_module"]


# ---- the two backends -----------------------------------------


class NumpyOps:
    """Array operations on numpy arrays; ``like`` arguments are ignored (there is one device)."""

    int32, int64, bool_ = np.int32, np.int64, np.bool_

    @staticmethod
    def is_array(x: Any) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def asarray(x: Any, like: Any) -> np.ndarray:
        if torch_module(x) is not None:
            x = x.detach().cpu().numpy()
        return np.asarray(x)

    @staticmethod
    def kind(x: np.ndarray) -> str:
        """'b' bool, 'i' integer, 'f' anything else."""
        return {"b": "b", "i": "i", "u": "i"}.get(x.dtype.kind, "f")

    @staticmethod
    def cast(x: np.ndarray, dtype: Any) -> np.ndarray:
        return x.astype(dtype, copy=False)

    @staticmethod
    def arange(n: int, like: Any) -> np.ndarray:
        return np.arange(n, dtype=np.int64)

    @staticmethod
    def zeros(shape: tuple[int, ...], dtype: Any, like: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    @staticmethod
    def cat(xs: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(xs)

    @staticmethod
    def flatnonzero(x: np.ndarray) -> np.ndarray:
        return np.flatnonzero(x)

    @staticmethod
    def cummax(x: np.ndarray, axis: int) -> np.ndarray:
        return np.maximum.accumulate(x, axis=axis)

    @staticmethod
    def repeat(x: np.ndarray, counts: np.ndarray, total: int) -> np.ndarray:
        return np.repeat(x, counts)

    @staticmethod
    def where(cond: np.ndarray, a: Any, b: Any) -> np.ndarray:
        return np.where(cond, a, b)

    @staticmethod
    def amax(x: np.ndarray, axis: int) -> np.ndarray:
        return x.max(axis=axis, keepdims=True)

    @staticmethod
    def diagonal(x: np.ndarray, offset: int) -> np.ndarray:
        return np.diagonal(x, offset=offset, axis1=-2, axis2=-1)

    @staticmethod
    def first_true(bad: np.ndarray) -> tuple[int, ...] | None:
        hits = np.flatnonzero(bad)
        return tuple(int(i) for i in np.unravel_index(hits[0], bad.shape)) if hits.size else None


class TorchOps:
    """The same operations on torch tensors, on the device of ``like``."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.int32, self.int64, self.bool_ = torch.int32, torch.int64, torch.bool

    def is_array(self, x: Any) -> bool:
        return isinstance(x, self.torch.Tensor)

    def asarray(self, x: Any, like: Any) -> Any:
        if not isinstance(x, self.torch.Tensor):
            x = self.torch.as_tensor(np.asarray(x))
        return x.to(like.device) if like is not None else x

    def kind(self, x: Any) -> str:
        if x.dtype == self.torch.bool:
            return "b"
        return "f" if x.dtype.is_floating_point or x.dtype.is_complex else "i"

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.to(dtype)

    def arange(self, n: int, like: Any) -> Any:
        return self.torch.arange(n, dtype=self.torch.int64, device=like.device)

    def zeros(self, shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
        return self.torch.zeros(shape, dtype=dtype, device=like.device)

    def cat(self, xs: list[Any]) -> Any:
        return self.torch.cat(xs)

    def flatnonzero(self, x: Any) -> Any:
        return self.torch.nonzero(x.reshape(-1)).reshape(-1)

    def cummax(self, x: Any, axis: int) -> Any:
        return self.torch.cummax(x, dim=axis).values

    def repeat(self, x: Any, counts: Any, total: int) -> Any:
        # output_size spares repeat_interleave a second device-to-host sync to size its output
        return self.torch.repeat_interleave(x, counts, output_size=total)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.torch.where(cond, a, b)

    def amax(self, x: Any, axis: int) -> Any:
        return x.amax(dim=axis, keepdim=True)

    def diagonal(self, x: Any, offset: int) -> Any:
        return self.torch.diagonal(x, offset=offset, dim1=-2, dim2=-1)

    def first_true(self, bad: Any) -> tuple[int, ...] | None:
        if not bool(bad.any()):  # the one sync of a check
            return None
        return tuple(int(i) for i in self.torch.nonzero(bad)[0].tolist())


NUMPY = NumpyOps()


def torch_module(x: Any) -> Any:
    """The torch module if ``x`` is a tensor, else None — without importing torch (no tensor exists without it)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


def backend_of(x: Any) -> Any:
    torch = torch_module(x)
    return TorchOps(torch) if torch is not None else NUMPY


def import_torch(what: str) -> Any:
    try:
        import torch
    except ImportError as exc:
        msg = f"{what} needs torch, which is not installed; pip install 'padfree[torch]'"
        raise BackendUnavailableError(msg) from exc
    return torch
