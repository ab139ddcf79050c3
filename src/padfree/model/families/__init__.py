"""Boundary-aware implementations of the modules the attention interface does not cover, one family per module.

:func:`padfree.configure_packing` discovers every module of this package that defines ``CLASSES``
(:func:`discover`; they never import ``padfree.model.install``) and routes each instance of a class a family names
to that family. A family module follows :class:`Family`:

- ``CLASSES: dict[str, str]`` — transformers module class name -> one line on what the family makes exact;
- ``install(module, state) -> str`` — make that *instance* boundary-exact for packed batches of the configured
  model whose :class:`~padfree.model.state.PackingState` is ``state`` (patch the instance, never its class or
  transformers' globals); return a one-line description of the implementation chosen; raise
  :class:`~padfree.UnsupportedModelError` when the instance's forward is not the shape the family proved;
- ``uninstall(model) -> bool`` — undo ``install`` on every module of ``model``;
- optionally ``SEQUENCE_PARALLEL`` (the classes that also run split across a sequence-parallel group) and
  ``sharding_problem(module, size) -> str | None``.

An installed module runs transformers' own forward, untouched, for an ordinary batch (no packed layout in flight:
:func:`padfree.model.state.current_layout` returns None, or :func:`padfree.model.state.hooks_live` is False), and
its boundary-exact computation for a packed one, reading the boundaries from the layout. The toolkits the families
share are :mod:`padfree.model.rebind` (a forward rebound to other primitives) and :mod:`padfree.model.families.replay`
(a forward replayed per sequence).

Adding a family is one module here: define the three names above and prove it (a test comparing packed with each
sequence alone, and the support sweep's rows of the model types it claims).

>>> "scan_mixers" in discover() and "replay" not in discover()  # a toolkit defines no CLASSES
True
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import types
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["discover"]


@runtime_checkable
class Family(Protocol):
    """What a family module provides (see the package docstring)."""

    CLASSES: Mapping[str, str]

    def install(self, module: torch.nn.Module, state: Any) -> str: ...

    def uninstall(self, model: torch.nn.Module) -> bool: ...


@functools.cache
def discover() -> Mapping[str, types.ModuleType]:
    """Every family module of this package, by short name (sorted): the modules that define ``CLASSES``."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "CLASSES"):
            found[info.name] = module
    return types.MappingProxyType(found)
