"""Integrations with training frameworks, each the only importer of its framework (never imported by the core).
See docs/trainer.md and docs/accelerate.md."""
