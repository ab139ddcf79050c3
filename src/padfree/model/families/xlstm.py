"""xLSTM's mLSTM layers, restarted at every sequence start.

An ``xLSTMLayer`` runs the mLSTM recurrence — a matrix memory ``C``, a normaliser ``n`` and a stabiliser ``m``
carried from token to token — through transformers' chunkwise kernel: chunk states by a recurrence over the chunks,
then every chunk's outputs in parallel from the state it starts with. In a packed row the state runs from one
sequence into the next. For a packed batch an installed layer runs transformers' own forward with its
``mlstm_backend`` replaced by :func:`segment_mlstm`: every sequence is laid out on chunks of its own, starting at a
chunk boundary as it does alone (its last chunk zero-padded: the recurrence is causal, so the padding reaches no
token of it), and the chunk recurrence sets ``(C, n, m)`` back to the zeros a lone sequence starts from at every
chunk that begins a sequence. The outputs of every chunk come from transformers' own
``mlstm_chunkwise_parallel_fw_H``; a lone sequence's last partial chunk, which transformers runs through its
token-by-token kernel, is computed chunkwise here — the same algebra, rounded differently.

``xLSTMFeedForward`` is claimed as what it is, a per-token MLP (the scan flags it only because of the model's name).
Ordinary batches and generation with a cache run transformers' code untouched; a packed batch with a cache is
refused.

>>> import torch
>>> from padfree.model.packed import PackedLayout
>>> lay = PackedLayout.from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]))
>>> gather, where, starts = chunk_plan(lay, 2)  # chunks of 2: [0 1] [2 -] [3 4]
>>> gather.tolist(), where.tolist(), starts.tolist()
([[0, 1, 2, 5, 3, 4]], [0, 1, 2, 4, 5], [[True, False, True]])
"""

from __future__ import annotations

import inspect
import sys
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from padfree.errors import PackingDisabledError, UnsupportedModelError
from padfree.model import rebind
from padfree.model.packed import PackedLayout
from padfree.model.state import layout_if_packed, patch, unpatch

CLASSES: dict[str, str] = {
    "xLSTMLayer": "mLSTM: every sequence on chunks of its own, state restarted at every sequence start",
    "xLSTMFeedForward": "per-token feed-forward: nothing crosses tokens",
}

_LAYOUT: ContextVar[PackedLayout | None] = ContextVar("padfree_xlstm_layout", default=None)


def chunk_plan(lay: PackedLayout, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's segments on whole chunks of their own: ``(gather (B, NC·chunk), where (B·T,), starts (B, NC))``.

    ``gather`` holds the flat ``B·T`` index of the token in every slot, ``B·T`` (a zero slot) for the padding after
    each segment and after each row; ``where`` is the slot (flat over ``B·NC·chunk``) of every token; ``starts``
    marks the chunks that begin a segment (and the padding chunks that end a row).
    """
    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq_len = lay.shape
        lengths = lay.lengths
        total = batch * seq_len
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        row = first // seq_len  # segments never cross rows, and come row after row
        chunks = -(-lengths // chunk)
        before = np.cumsum(chunks) - chunks
        row_base = np.zeros(batch, dtype=np.int64)
        row_base[row[::-1]] = before[::-1]  # the chunk count before each row's first segment
        offset = before - row_base[row]  # first chunk of every segment in its row's stream
        per_row = np.bincount(row, weights=chunks, minlength=batch).astype(np.int64)
        nc = int(per_row.max())
        token = np.arange(total, dtype=np.int64)
        seg_of = np.repeat(np.arange(lengths.size), lengths)
        slot = offset[seg_of] * chunk + (token - first[seg_of])
        gather = np.full((batch, nc * chunk), total, dtype=np.int64)
        gather[row[seg_of], slot] = token
        starts = np.ones((batch, nc), dtype=bool)  # padding chunks after a row's end: fresh, read by no token
        of_chunk = np.repeat(np.arange(lengths.size), chunks)
        within = np.arange(int(chunks.sum())) - np.repeat(before, chunks)
        starts[row[of_chunk], offset[of_chunk] + within] = within == 0
        where = row[seg_of] * (nc * chunk) + slot
        dev = lay.device
        return (torch.from_numpy(gather).to(dev), torch.from_numpy(where).to(dev), torch.from_numpy(starts).to(dev))
    return lay.memo(("padfree.xlstm", "plan", chunk), build)


def _chunk_states(key: torch.Tensor, value: torch.Tensor, vec_b: torch.Tensor, vec_i: torch.Tensor,
                  starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' ``mlstm_chunkwise_recurrent_fw_C`` (no initial state) with ``(C, n, m)`` set back to zeros
    before every chunk that ``starts`` (``(B, NC)``) marks: the state each chunk begins with, as
    ``(B, NH, NC·DHQK, DHV)``, ``(B, NH, NC·DHQK)``, ``(B, NH, NC)`` — the layout ``mlstm_chunkwise_parallel_fw_H``
    reads."""
    batch, heads, nc, chunk = vec_b.shape
    dhqk, dhv = key.shape[-1], value.shape[-1]
    c_k = key.new_zeros(batch, heads, dhqk, dhv)
    n_k = key.new_zeros(batch, heads, dhqk)
    m_k = key.new_zeros(batch, heads)
    vec_a = vec_b[..., -1, None] - vec_b + vec_i
    sca_g = vec_b[..., -1]
    sca_a_max = vec_a.max(-1).values
    keys = key.view(batch, heads, nc, chunk, dhqk).unbind(2)
    values = value.view(batch, heads, nc, chunk, dhv).unbind(2)
    cs, ns, ms = [], [], []
    for k in range(nc):  # the recurrence over chunks, as transformers runs it
        fresh = starts[:, k].view(batch, 1)
        c_k = torch.where(fresh[..., None, None], torch.zeros_like(c_k), c_k)
        n_k = torch.where(fresh[..., None], torch.zeros_like(n_k), n_k)
        m_k = torch.where(fresh, torch.zeros_like(m_k), m_k)
        cs.append(c_k)
        ns.append(n_k)
        ms.append(m_k)
        m_next = torch.max(sca_g[:, :, k] + m_k, sca_a_max[:, :, k])
        a_bar = torch.exp(vec_a[:, :, k, :] - m_next[..., None])[:, :, :, None]
        k_gated = keys[k] * a_bar
        g_bar = torch.exp(sca_g[:, :, k] + m_k - m_next)[:, :, None]
        c_k = g_bar[..., None] * c_k + k_gated.transpose(-2, -1) @ values[k]
        n_k = g_bar * n_k + k_gated.transpose(-2, -1).sum(-1)
        m_k = m_next
    return torch.cat(cs, dim=2), torch.cat(ns, dim=2), torch.stack(ms, dim=2)


def segment_mlstm(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
                  fgate: torch.Tensor, lay: PackedLayout, *, chunk_size: int, eps: float,
                  parallel: Any) -> torch.Tensor:
    """The mLSTM over a packed batch, every segment from a zero state: exact reference.

    Args:
        query, key: ``(B, NH, T, DHQK)``; value: ``(B, NH, T, DHV)``; igate, fgate: ``(B, NH, T)`` pre-activations.
        lay: the batch's layout.
        chunk_size, eps: the config's.
        parallel: transformers' ``mlstm_chunkwise_parallel_fw_H`` (the per-chunk outputs).

    Returns:
        ``(B, NH, T, DHV)`` in the inputs' dtype, as transformers' chunkwise kernel computes it.
    """
    batch, heads, seq_len, dhqk = query.shape
    gather, where, starts = chunk_plan(lay, chunk_size)
    nc = starts.shape[1]
    total = batch * seq_len

    def spread(x: torch.Tensor) -> torch.Tensor:  # (B, NH, T, ...) -> (B, NH, NC·chunk, ...), zeros in the gaps
        flat = x.movedim(2, 1).reshape(total, heads, *x.shape[3:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat[gather].movedim(2, 1)

    q, k, v, i, f = (spread(x) for x in (query, key, value, igate, fgate))
    vec_i = i.reshape(batch, heads, nc, chunk_size)
    vec_b = F.logsigmoid(f.reshape(batch, heads, nc, chunk_size)).cumsum(-1)
    c_states, n_states, m_states = _chunk_states(k, v, vec_b, vec_i, starts)
    h, _, _ = parallel(matQ=q, matK=k, matV=v, matC_states=c_states, vecN_states=n_states,
                       scaMinter_states=m_states, vecI=vec_i, vecB=vec_b, qk_scale=dhqk**-0.5,
                       chunk_size=chunk_size, num_chunks=nc, eps=eps)
    h = h.movedim(1, 2).reshape(batch * nc * chunk_size, heads, -1).index_select(0, where)
    return h.view(batch, seq_len, heads, -1).movedim(2, 1)


@torch.compiler.disable  # host-side boundaries (see padfree.model.rebind)
def _backend_forward(self: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     igate: torch.Tensor, fgate: torch.Tensor, c_initial: torch.Tensor | None = None,
                     n_initial: torch.Tensor | None = None, m_initial: torch.Tensor | None = None,
                     return_last_states: bool | None = None, mode: str | None = None) -> Any:
    """Installed as ``mlstm_backend.forward``: :func:`segment_mlstm` inside a packed layer call, else transformers'."""
    lay = _LAYOUT.get()
    if lay is None:
        return type(self).forward(self, query, key, value, igate, fgate, c_initial, n_initial, m_initial,
                                  return_last_states, mode)
    if c_initial is not None or n_initial is not None or m_initial is not None:
        raise PackingDisabledError(
            "a packed batch reached an mLSTM layer with a recurrent state (a cache, or xLSTMModel's chunked evaluation "
            "of rows longer than config.max_inference_chunksize); packed training never uses a cache")
    config = self.config
    parallel = sys.modules[type(self).__module__].mlstm_chunkwise_parallel_fw_H
    h = segment_mlstm(query, key, value, igate, fgate, lay, chunk_size=config.chunk_size, eps=config.eps,
                      parallel=parallel)
    return h, None


def _layer_forward(self: torch.nn.Module, x: torch.Tensor, state: Any = None) -> Any:
    """Installed as the layer's ``forward``: transformers' forward; its backend restarts at segments when packed."""
    lay = layout_if_packed(self._padfree_xlstm, x, type(self).__name__)
    if lay is None:
        return type(self).forward(self, x, state)
    if state is not None:
        raise PackingDisabledError(f"{type(self).__name__} got a recurrent state with a packed batch; packed training "
                                   f"never uses a cache (pass use_cache=False)")
    token = _LAYOUT.set(lay)
    try:
        return type(self).forward(self, x, None)
    finally:
        _LAYOUT.reset(token)


_PARALLEL_PARAMS = ("matQ", "matK", "matV", "matC_states", "vecN_states", "scaMinter_states", "vecI", "vecB",
                    "qk_scale", "chunk_size", "num_chunks", "eps")


def _check_layer(layer: torch.nn.Module) -> None:
    name = type(layer).__name__
    backend = getattr(layer, "mlstm_backend", None)
    module = sys.modules[type(layer).__module__]
    parallel = getattr(module, "mlstm_chunkwise_parallel_fw_H", None)
    if backend is None or parallel is None or type(backend).__name__ != "xLSTMBackend":
        raise UnsupportedModelError(
            f"{name} does not run transformers' native mLSTM backend (the external xlstm package's kernels take no "
            f"sequence boundaries); padfree cannot restart its state at sequence starts")
    if tuple(inspect.signature(parallel).parameters) != _PARALLEL_PARAMS:
        raise UnsupportedModelError(f"{name}: transformers' mlstm_chunkwise_parallel_fw_H now takes "
                                    f"{tuple(inspect.signature(parallel).parameters)}; refusing rather than guessing")
    kernel = getattr(backend, "chunkwise_kernel_fn", None)
    if getattr(kernel, "__name__", None) != "mlstm_chunkwise_native_autograd":
        raise UnsupportedModelError(f"{name}: its backend's chunkwise kernel is {kernel!r}, not the native chunkwise "
                                    f"kernel padfree proved exact")


def install(module: torch.nn.Module, state: Any) -> str:
    """Make one ``xLSTMLayer`` boundary-exact for packed batches of the model ``state`` belongs to (see the module
    docstring), or accept an ``xLSTMFeedForward`` as per-token; returns what runs for packed batches. Idempotent."""
    name = type(module).__name__
    if name == "xLSTMFeedForward":
        if rebind.globals_used(type(module).forward) - {"torch"}:
            raise UnsupportedModelError(f"{name}.forward calls {sorted(rebind.globals_used(type(module).forward))}; "
                                        f"padfree proved it per-token only when it calls torch alone")
        return "per-token feed-forward (nothing crosses tokens)"
    if name != "xLSTMLayer":
        raise UnsupportedModelError(f"{name} is not an xLSTM module padfree knows how to make packing-exact")
    _check_layer(module)
    patch(module, "_padfree_xlstm", state, _layer_forward, {"mlstm_backend": _backend_forward})
    return ("mLSTM: transformers' chunkwise kernel with every sequence on chunks of its own, state restarted at "
            "sequence starts")


def uninstall(model: torch.nn.Module) -> bool:
    """Undo :func:`install` on every module of ``model``; False if nothing was installed."""
    return unpatch(model, "_padfree_xlstm", children=("mlstm_backend",))
