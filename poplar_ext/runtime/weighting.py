"""The one place where a rank's micro-batch loss is weighted for uneven batches.

DeepSpeed, at every ZeRO stage, ends with the gradient ``(1/W) * sum over ranks and
micro-steps of d(loss passed to backward)`` when backward is called with
``scale_wrt_gas=False`` (W: world size; see ../shared/deepspeed-notes.md). The
optimizer must instead see the gradient of the mean loss over the whole global batch
``B = sum_r b_r * s_r``, i.e. ``(1/B) * sum over all samples of d(loss_i)``.

* Mean-reduced micro-batch loss ``L = (1/b_r) * sum_i loss_i`` (the usual case):
  pass ``L * W * b_r / B``. Then ``(1/W) * sum W * b_r / B * (1/b_r) * sum_i d loss_i
  = (1/B) * sum d loss_i``.
* Sum-reduced micro-batch loss ``L = sum_i loss_i``: pass ``L * W / B``.

The weight does not depend on the accumulation count s_r, the ZeRO stage or gradient
clipping (clipping acts on the already exact global gradient).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[Reduction, ...] = get_args(Reduction)
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def loss_weight(*, world_size: int, micro_batch_size: int, global_batch_size: int, reduction: Reduction = "mean") -> float:
    """The factor for a rank's micro-batch loss: ``W * b_r / B`` (mean) or ``W / B`` (sum)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss_reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, found {reduction!r}")
    assert world_size >= 1 and micro_batch_size >= 1 and global_batch_size >= micro_batch_size
    if reduction == "mean":
        return world_size * micro_batch_size / global_batch_size
    return world_size / global_batch_size


def weight_loss(loss, *, world_size: int, micro_batch_size: int, global_batch_size: int, reduction: Reduction = "mean"):
    """`loss` times `loss_weight(...)`: what the engine passes to DeepSpeed's backward
    (with ``scale_wrt_gas=False``).

    A bf16 or fp16 loss is weighted in fp32 (the result is fp32): a weight like 3/11
    rounded to bf16's 8 significant bits would be off by up to 0.4%.
    """
    weight = loss_weight(
        world_size=world_size, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, reduction=reduction
    )
    if getattr(loss, "dtype", None) in _HALF_DTYPES:
        return loss.float() * weight
    return loss * weight


__all__ = ["REDUCTIONS", "loss_weight", "weight_loss"]
