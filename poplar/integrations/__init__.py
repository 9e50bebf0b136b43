"""Poplar inside the training loops people already have. Each module imports its framework, an
optional dependency, so import the one you use:

- ``poplar.integrations.lightning``: ``PoplarStrategy``, a PyTorch Lightning strategy
  (``pip install poplar[lightning]``);
- ``poplar.integrations.hf``: ``PoplarTrainer``, a Hugging Face ``transformers.Trainer``
  (``pip install poplar[hf]``);
- ``poplar.integrations.global_batches``: the per-rank cut of a user's ``DataLoader`` both use.

The layer sits above the training loop (``poplar.train``) and below the command line.
"""
