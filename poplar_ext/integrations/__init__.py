"""Integrations with training frameworks, each importing its framework (never imported by the core).

`transformers` (`PoplarTrainer`, ``poplar-ext[hf]``), `trl` (`PoplarSFTTrainer`, `PoplarDPOTrainer`,
``poplar-ext[trl]``) and `accelerate` (`PoplarAccelerator`, ``poplar-ext[accelerate]``).
"""
