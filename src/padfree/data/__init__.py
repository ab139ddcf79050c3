"""Data plumbing: packed rows as torch batches and collators (:mod:`padfree.data.batch`), map-style and streaming
packing datasets (:mod:`padfree.data.datasets`), and packed Hugging Face datasets (:mod:`padfree.data.hf`). Nothing is
imported here, so that the torch-free layers stay torch-free."""
