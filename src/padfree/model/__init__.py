"""The model side: make a transformers causal LM packing-exact (``configure_packing``) and prove it (``verify``).

- :mod:`padfree.model.packed` — the boundaries of one packed forward (:class:`PackedLayout`);
- :mod:`padfree.model.attention` — boundary-exact attention backends registered with transformers;
- :mod:`padfree.model.install` — the machinery: scan, padfree attention backend, families, fail-closed hooks;
- :mod:`padfree.model.configure` — ``configure_packing``: install, then accept from the support table or certify;

The proofs (the sweep, on-the-spot certification, ``verify``) live in :mod:`padfree.proof`.
"""
