"""Optional CUDA kernels for the sequence mixers: loaded only when usable, called with the boundaries, or a reason.

flash-linear-attention (``chunk_gated_delta_rule`` with ``cu_seqlens``), causal-conv1d (``causal_conv1d_fn`` with
``seq_idx``) and mamba_ssm (``mamba_chunk_scan_combined`` with ``seq_idx``) are imported only with CUDA present (a
broken triton cannot even be touched on a CPU machine). A kernel whose import or first call fails is switched off
with its reason, and the exact references of :mod:`padfree.model.scans` run instead: never a crash mid-training,
never a leak.

>>> kernel_name("fla")
'flash-linear-attention'
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["broken_reason", "causal_conv1d_kernel", "gated_delta_rule_kernel", "kernel_status", "ssd_kernel"]

log = logging.getLogger("padfree")

# ---- loading: importable and runnable, or a reason ---------------------------------------------------------------

# name -> (distribution, module, attribute)
_KERNELS = {
    "causal_conv1d": ("causal-conv1d", "causal_conv1d", "causal_conv1d_fn"),
    "fla": ("flash-linear-attention", "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "mamba_ssm": ("mamba-ssm", "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
}
_loaded: dict[str, tuple[Callable | None, str]] = {}
_broken: dict[str, str] = {}  # kernels whose call raised once: the reference runs from then on


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _on_accelerator(t: torch.Tensor) -> bool:
    """Whether a kernel may run on ``t`` (a CUDA tensor)."""
    return t.is_cuda


def _load_kernel(name: str) -> tuple[Callable | None, str]:
    """``(function, "")`` when kernel ``name`` imports here, else ``(None, why not)``; never imports without CUDA."""
    if name in _loaded:
        return _loaded[name]
    dist, module, attr = _KERNELS[name]
    top = module.split(".")[0]
    if not _cuda_available():
        result: tuple[Callable | None, str] = (None, f"{dist} kernels need a CUDA GPU, none here")
    elif importlib.util.find_spec(top) is None:
        result = (None, f"{dist} is not installed")
    else:
        try:
            result = (getattr(importlib.import_module(module), attr), "")
        except Exception as exc:  # a broken install (e.g. triton without a GPU driver) must not take training down
            result = (None, f"{dist} is installed but {module}.{attr} failed to import ({type(exc).__name__}: "
                            f"{str(exc)[:120]})")
    _loaded[name] = result
    return result


def kernel_name(name: str) -> str:
    """The distribution that provides kernel ``name`` (``"fla"`` -> ``"flash-linear-attention"``)."""
    return _KERNELS[name][0]


def broken_reason(name: str) -> str | None:
    """Why kernel ``name`` was switched off after it raised (None: it has not failed)."""
    return _broken.get(name)


def kernel_status(name: str) -> tuple[bool, str]:
    """``(usable, reason)`` for one of ``"causal_conv1d"``, ``"fla"``, ``"mamba_ssm"``."""
    if name in _broken:
        return False, _broken[name]
    fn, why = _load_kernel(name)
    return fn is not None, why or "importable, CUDA present"


def _call(name: str, run: Callable[[Callable], Any]) -> Any:
    """``run(kernel)``, or None (the caller then runs the reference) when the kernel is unusable or raises."""
    if name in _broken:
        return None
    fn, _ = _load_kernel(name)
    if fn is None:
        return None
    try:
        return run(fn)
    except Exception as exc:
        dist = _KERNELS[name][0]
        _broken[name] = (f"{dist} failed at its first call ({type(exc).__name__}: {str(exc)[:160]}); the exact "
                         f"reference runs instead")
        log.warning("padfree: %s kernel failed (%s); using the exact PyTorch reference from now on",
                    dist, _broken[name])
        return None


# ---- the calls: each kernel with the boundaries of a packed row, or None (then the reference runs) ------------


def causal_conv1d_kernel(x, weight, bias, activation, lay):
    if activation not in (None, "silu", "swish") or not _on_accelerator(x):
        return None

    def run(fn):
        xc = x if x.stride(1) == 1 else x.transpose(1, 2).contiguous().transpose(1, 2)  # seq_idx wants channels-last
        return fn(xc, weight, bias, seq_idx=lay.seq_idx, activation=activation)

    return _call("causal_conv1d", run)


def gated_delta_rule_kernel(query, key, value, g, beta, lay, use_qk_l2norm_in_kernel):
    if not _on_accelerator(query) or query.dtype not in (torch.bfloat16, torch.float16):
        return None  # flash-linear-attention refuses fp32

    def run(fn):
        hk, hv = key.shape[2], value.shape[2]
        q, k = query, key
        if hk != hv:  # older fla releases have no grouped value heads
            q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        batch, seq_len = q.shape[:2]

        def flat(x):
            return x.reshape(1, batch * seq_len, *x.shape[2:])

        out, _ = fn(flat(q), flat(k), flat(value), g=flat(g), beta=flat(beta), initial_state=None,
                    output_final_state=False, cu_seqlens=lay.cu_seqlens.to(torch.long),
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out.reshape(batch, seq_len, hv, -1)

    return _call("fla", run)


def ssd_kernel(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, lay):
    if not _on_accelerator(hidden_states):
        return None
    return _call("mamba_ssm", lambda fn: fn(
        hidden_states, dt, A, B, C, chunk_size, D=D, z=None, dt_bias=dt_bias, initial_states=None,
        seq_idx=lay.seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=False))
