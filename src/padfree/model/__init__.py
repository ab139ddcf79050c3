"""The model side: make a transformers causal LM packing-exact (``configure_packing``) and prove it (``verify``).

- :mod:`padfree.model.packed` — the boundaries of one packed forward (:class:`PackedLayout`);
- :mod:`padfree.model.attention` — boundary-exact attention backends registered with transformers;
- :mod:`padfree.model.configure` — ``configure_packing``: support registry, backend choice, fail-closed guards;
- :mod:`padfree.model.verify` — ``verify``: packed vs per-sequence logits, loss and gradients.
"""
