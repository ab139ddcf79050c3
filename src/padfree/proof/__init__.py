"""The proofs: packed against each sequence alone, on tiny twins and on the user's own model.

Nothing here runs in a training step; :mod:`padfree.model.configure` reads the support table and certifies on the
spot, and the in-run proof calls :mod:`padfree.proof.check`.

- :mod:`padfree.proof.tiny` — the one tiny-model builder (``build``) and the hand-made tiny configs;
- :mod:`padfree.proof.shrink` — a tiny twin's config from any config, features kept, sizes shrunk;
- :mod:`padfree.proof.compare` — ``prove``: a packed training step against every sequence alone, with a leaking control;
- :mod:`padfree.proof.compare_images` — ``prove_images``: a packed row with images against each sample alone;
- :mod:`padfree.proof.sweep` — one model type proven into its support-table entry;
- :mod:`padfree.proof.registry` — reads ``support.json`` (the sweep's table) and renders its docs;
- :mod:`padfree.proof.certify` — on-the-spot proof of a class the table does not cover, cached on disk;
- :mod:`padfree.proof.versions` — the tested transformers range and the warning outside it;
- :mod:`padfree.proof.check` — ``padfree.verify``: the check on the user's own model, device and precision;
- :mod:`padfree.proof.backends` — ``check_support``: what every attention backend does on this machine.
"""
