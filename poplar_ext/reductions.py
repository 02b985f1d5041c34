"""How a training loss reduces over a micro-batch: one vocabulary for ``poplar.loss_reduction``, the loss weighting
and the built-in model's loss, below every other module so that models and the runtime can both name it.
See docs/training.md."""

from __future__ import annotations

from typing import Literal, get_args

Reduction = Literal["mean", "sum", "token_mean"]
"""``mean`` of samples, ``sum``, or ``token_mean`` (of label tokens, ``-100`` ignored)."""

REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)
