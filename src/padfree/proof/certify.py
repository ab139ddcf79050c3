"""On-the-spot certification: prove a model the support table does not cover, on a tiny twin of its own class.

A model type registered at run time, a custom subclass, a transformers version the table was not proven on, or a
config with features the sweep did not see: :func:`certify` builds a tiny fp32 twin of the model's *own class* from
a shrunk copy of its *own config* (:func:`padfree.proof.shrink.shrink_config`), installs padfree on it with the
backend the model is about to use, and

1. runs :func:`padfree.proof.compare.prove` — packed against every sequence alone, logits, loss and every gradient,
   with the leaking negative control — and checks that an ordinary padded batch is unchanged;
2. checks the guards: a packed batch with ``use_cache=True``, with a 0/1 mask and with the model's own cache object
   is refused;
3. accepts only if all of that holds; otherwise it names the first module whose packed output diverges from the
   per-sequence one (:func:`padfree.proof.compare.first_divergence`).

The verdict is cached on disk (``$PADFREE_CACHE_DIR``, else ``$XDG_CACHE_HOME/padfree`` or ``~/.cache/padfree``)
under a key made of the class, the source of every module its class hierarchy lives in, the config's features, the
backend, and the padfree, transformers and torch versions — so a cached class is never checked twice, and a changed
class or library is checked again.

>>> import transformers
>>> from padfree.proof.shrink import shrink_config
>>> class MyLlama(transformers.LlamaForCausalLM):  # a custom subclass: not in the support table
...     pass
>>> model = MyLlama(shrink_config(transformers.LlamaConfig()))
>>> verdict = certify(model, "padfree_sdpa", cache=False)
>>> verdict.ok, verdict.how.split(":")[0]
(True, 'certified on the spot')
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from padfree import cachedir
from padfree.errors import PackingDisabledError, PadfreeError
from padfree.proof.registry import Verdict, features

__all__ = ["certify", "certify_images"]

log = logging.getLogger("padfree")

_MEMORY: dict[str, Verdict] = {}
_IMAGES: dict[str, str | None] = {}
_CUDA_ONLY = ("padfree_varlen", "flash_attention_2")  # half-precision kernels: proven in bf16
# run on the model's own device: these backends are refused on the CPU (flex: no backward there, and torch's
# compiled CPU kernel is wrong for some head sizes), so a CPU twin could never prove what a GPU model will run
_ON_MODEL_DEVICE = (*_CUDA_ONLY, "padfree_flex")


def cache_dir() -> Path:
    """Where verdicts are cached (:func:`padfree.cachedir.cache_dir`: ``$PADFREE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/padfree`` or ``~/.cache/padfree``)."""
    return cachedir.cache_dir()


@functools.cache
def _file_hash(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "?"


@functools.cache
def _padfree_source() -> str:
    here = Path(__file__).resolve().parent
    return hashlib.sha256("".join(_file_hash(str(p)) for p in sorted(here.rglob("*.py"))).encode()).hexdigest()[:16]


def _class_source(cls: type) -> str:
    """A hash of the source files of ``cls`` and every class it derives from (torch's and builtins' excluded)."""
    files = []
    for klass in cls.__mro__:
        module = sys.modules.get(klass.__module__)
        if module is None or klass.__module__.split(".")[0] in ("torch", "builtins", "abc", "typing"):
            continue
        try:
            files.append(inspect.getsourcefile(klass) or "")
        except TypeError:  # defined interactively: its identity is all there is
            files.append(f"{klass.__module__}.{klass.__qualname__}")
    return hashlib.sha256("|".join(f"{f}:{_file_hash(f)}" for f in dict.fromkeys(files)).encode()).hexdigest()[:16]


def _key(model: Any, backend: str, tiny_features: dict[str, Any]) -> str:
    import transformers

    from padfree import __version__

    cls = type(model)
    parts = {
        "padfree": __version__, "padfree_source": _padfree_source(), "transformers": transformers.__version__,
        "torch": torch.__version__, "class": f"{cls.__module__}.{cls.__qualname__}", "source": _class_source(cls),
        "backend": backend, "features": tiny_features,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read(key: str) -> Verdict | None:
    path = cache_dir() / "certificates" / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return Verdict(bool(data["ok"]), str(data["how"]) + f" (cached in {path})", str(data.get("reason", "")),
                       data.get("module"))
    except (OSError, ValueError, KeyError):
        return None


def _write(key: str, verdict: Verdict, model: Any) -> None:
    folder = cache_dir() / "certificates"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"ok": verdict.ok, "how": verdict.how, "reason": verdict.reason,
                                   "module": verdict.module, "class": type(model).__qualname__}, indent=1))
        tmp.replace(folder / f"{key}.json")
    except OSError as exc:  # a read-only home: certify again next time, never fail training over a cache
        log.debug("padfree: could not cache the certification in %s (%s)", folder, exc)


def _twin_class(model: Any) -> type:
    """``type(model)``, or for a base ``*Model`` without a head (the backbone a reward model or another head sits on)
    the causal LM of its config: the proof compares logits, and that LM runs exactly this backbone under its head."""
    import transformers

    cls = type(model)
    if getattr(model, "get_output_embeddings", lambda: None)() is not None:
        return cls
    causal = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model.config), None)
    return causal if causal is not None and getattr(causal, "base_model_prefix", None) == getattr(
        cls, "base_model_prefix", None) else cls


def _twin(model: Any, device: torch.device) -> Any:
    """A tiny fp32 model of ``type(model)`` (:func:`_twin_class`) from a shrunk copy of its config, deterministic
    weights (:func:`padfree.proof.tiny.build`, on the model's attention implementation from before padfree's)."""
    from padfree.model.state import packing_state
    from padfree.proof.compare import perturb
    from padfree.proof.shrink import shrink_config
    from padfree.proof.tiny import build

    config = shrink_config(model.config)
    state = packing_state(model)
    base = state.previous[0][""] if state is not None and state.previous[0] else None
    config._attn_implementation_internal = None
    with torch.device(device):
        twin = build(config, seed=0, attn_implementation=base or None, model_class=_twin_class(model))
    return perturb(twin.eval())


def _guards_hold(twin: Any, backend: str) -> str | None:
    """None when a packed batch with a cache, ``use_cache=True`` or a 0/1 mask is refused; else what got through."""
    from padfree.model.install import install_packing, unconfigure_packing

    install_packing(twin, backend=backend if backend != "none" else "auto")
    device = next(twin.parameters()).device
    ids = torch.full((1, 6), 3, dtype=torch.long, device=device)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    try:
        calls = {"use_cache=True": dict(use_cache=True), "a 0/1 attention_mask": dict(
            attention_mask=torch.ones_like(ids), use_cache=False)}
        with torch.no_grad():
            for what, extra in calls.items():
                try:
                    twin(input_ids=ids, position_ids=pos, **extra)
                except PackingDisabledError:
                    continue
                return what
    finally:
        unconfigure_packing(twin)
    return None


def certify(model: Any, backend: str, *, why: str = "", cache: bool = True) -> Verdict:
    """Prove ``model``'s class and config packing-exact on ``backend`` with a tiny twin (see the module docstring).

    Args:
        model: the user's (configured or not) causal LM; it is not run or modified.
        backend: the resolved backend (``padfree_sdpa``, ``padfree_eager``, ``padfree_flex``, ``padfree_varlen``,
            ``flash_attention_2``, or ``none`` for a model without attention).
        why: why the support table did not cover the model (for the verdict's text).
        cache: read and write the on-disk cache.
    """
    from padfree.proof.compare import first_divergence, prove
    from padfree.proof.shrink import shrink_config

    start = time.perf_counter()
    try:
        tiny_features = features(shrink_config(model.config))
    except Exception as exc:
        return Verdict(False, "certification could not start", f"its config could not be shrunk into a tiny twin "
                       f"({type(exc).__name__}: {str(exc)[:200]})", type(model.config).__name__)
    key = _key(model, backend, tiny_features)
    if cache and key in _MEMORY:
        return _MEMORY[key]
    if cache:
        hit = _read(key)
        if hit is not None:
            _MEMORY[key] = hit
            return hit
    device = next(model.parameters()).device if backend in _ON_MODEL_DEVICE else torch.device("cpu")
    precisions = ("bf16",) if backend in _CUDA_ONLY else ("fp32",)
    requested = "auto" if backend == "none" else backend
    try:
        twin = _twin(model, device)
        proof = prove(twin, backends=[requested], precisions=precisions)
    except PadfreeError as exc:
        verdict = Verdict(False, "certification refused", str(exc).splitlines()[0], type(model).__name__)
    except Exception as exc:  # the twin could not be built or run: say what, do not guess
        verdict = Verdict(False, "certification failed to run", f"a tiny twin of {type(model).__name__} could not "
                          f"be built or run ({type(exc).__name__}: {str(exc)[:200]})", type(model).__name__)
    else:
        seconds = time.perf_counter() - start
        context = f" ({why})" if why else ""
        if proof.refused:
            verdict = Verdict(False, f"certification on the spot{context}", next(iter(proof.refused.values())),
                              type(model).__name__)
        elif not proof.ok:
            bad = next((c for c in proof.checks if not c.ok), None)
            module = first_divergence(twin, requested)
            what = ("configuring it changed an ordinary padded batch" if bad is None else
                    f"packed differs from per-sequence ({bad})")
            verdict = Verdict(False, f"certification on the spot{context}",
                              f"a tiny twin of its class and config is not packing-exact: {what}", module)
        else:
            leaked = _guards_hold(twin, requested)
            if leaked is not None:
                verdict = Verdict(False, f"certification on the spot{context}", f"a packed batch with {leaked} "
                                  f"was not refused", type(model).__name__)
            else:
                c = proof.checks[0]
                verdict = Verdict(True, f"certified on the spot{context}: a tiny twin of {type(model).__name__} "
                                  f"({sum(p.numel() for p in twin.parameters())} parameters) packed vs per-sequence "
                                  f"on {c.backend}/{c.precision}: max |Δlogit| {c.logits:.1e}, leaking control "
                                  f"{c.leak:.1e}; guards hold; {seconds:.1f} s")
    log.info("padfree: %s: %s%s", type(model).__name__, verdict.how, f" — {verdict.reason}" if verdict.reason else "")
    if cache:
        _MEMORY[key] = verdict
        _write(key, verdict, model)
    return verdict


def certify_images(model: Any, backend: str) -> str | None:
    """None when images in packed rows are proven exact for ``model``: the support table's images verdict for its
    type where the table covers its config (:func:`padfree.proof.registry.lookup`), else
    :func:`padfree.proof.compare_images.prove_images` on a tiny twin of its class and config (kept for the process);
    otherwise why not, naming the module where padfree refuses the model's images.

    Args:
        model: the user's vision-language model (configured or not); it is not run or modified.
        backend: the resolved backend its packed rows run on.
    """
    from padfree.model import images
    from padfree.proof import registry
    from padfree.proof.compare_images import prove_images
    from padfree.proof.shrink import shrink_config

    route = images.image_route(model)
    if route is None:
        return images.image_refusal(model) or f"{type(model).__name__} lays out no images per sample"
    status, entry = registry.lookup(model, backend)
    proven = (entry or {}).get("images") if status == "covered" else None
    if proven is not None and proven.get("route") == route and proven.get("verdict") in ("exact", "refused"):
        return None if proven["verdict"] == "exact" else f"the support sweep: {proven.get('reason', 'not exact')}"
    try:
        key = _key(model, backend, features(shrink_config(model.config)))
    except Exception as exc:  # a config its own class cannot rebuild: no twin, no proof
        return f"its config could not be shrunk for a proof ({type(exc).__name__}: {str(exc)[:160]})"
    if key not in _IMAGES:
        start = time.perf_counter()
        try:
            # asked from inside the caller's forward: its no_grad / autocast are not the proof's (fp32, backward)
            with torch.enable_grad(), torch.autocast("cpu", enabled=False):
                run = "auto" if backend == "none" else backend.removeprefix("padfree_")
                proof = prove_images(_twin(model, torch.device("cpu")), backend=run)
        except Exception as exc:  # the twin could not be built: say what, do not guess
            _IMAGES[key] = f"a tiny twin could not be built ({type(exc).__name__}: {str(exc)[:160]})"
        else:
            _IMAGES[key] = None if proof.ok else (proof.refused or (
                f"a tiny twin's packed row differs from its samples alone (logits {proof.logits:.1e}, loss "
                f"{proof.loss:.1e}, gradients {proof.grads:.1e}; tolerance {proof.tolerance:.0e})"))
            log.info("padfree: images through %s %s on a tiny twin (%.2f s)", type(model).__name__,
                     "proven exact" if proof.ok else "not proven", time.perf_counter() - start)
    return _IMAGES[key]
