"""Integrations with training frameworks, each importing its framework (never imported by the core).

* `transformers`: `PoplarTrainer`, the Hugging Face Trainer with a plan's per-rank batches
  (``pip install 'poplar-ext[hf]'``).
"""
