"""Boundary-aware implementations of the modules the attention interface does not cover, one family per module.

:func:`padfree.configure_packing` imports every module listed in
:data:`padfree.model.install.FAMILY_MODULES` (they never import ``install``) and routes each instance of a
class a family names to that family. A family module defines:

- ``CLASSES: dict[str, str]`` — transformers module class name -> one line on what the family makes exact;
- ``install(module, state) -> str`` — make that *instance* boundary-exact for packed batches of the configured
  model whose :class:`~padfree.model.state.PackingState` is ``state`` (patch the instance, never its class or
  transformers' globals); return a one-line description of the implementation chosen; raise
  :class:`~padfree.UnsupportedModelError` when the instance's forward is not the shape the family proved;
- ``uninstall(model) -> bool`` — undo ``install`` on every module of ``model``.

An installed module runs transformers' own forward, untouched, for an ordinary batch (no packed layout in flight:
:func:`padfree.model.state.current_layout` returns None, or :func:`padfree.model.state.hooks_live` is False), and
its boundary-exact computation for a packed one, reading the boundaries from the layout.
"""
