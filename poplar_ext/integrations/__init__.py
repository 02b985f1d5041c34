"""Integrations with training frameworks, each importing its framework (never imported by the core).

* `transformers`: `PoplarTrainer`, the Hugging Face Trainer with a plan's per-rank batches
  (``pip install 'poplar-ext[hf]'``).
* `accelerate`: `PoplarAccelerator`, Hugging Face accelerate's Accelerator for hand-written
  loops (diffusers-style scripts) with a plan's per-rank batches (``pip install 'poplar-ext[accelerate]'``).
"""
