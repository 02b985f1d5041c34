"""The one place a rank's micro-batch loss is weighted for uneven batches (docs/design.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from poplar_ext.reductions import REDUCTIONS, Reduction

IGNORE_INDEX = -100
"""The label value losses skip (PyTorch's and Hugging Face's convention)."""


def loss_weight(
    *,
    world_size: int,
    micro_batch_size: int,
    global_batch_size: int,
    reduction: Reduction = "mean",
    micro_batch_tokens: int | None = None,
    global_batch_tokens: int | None = None,
) -> float:
    """The factor for a rank's micro-batch loss: ``W * b_r / B`` (mean), ``W / B`` (sum) or
    ``W * n / T`` (token_mean, with the micro-batch's and the global batch's label tokens)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"loss_reduction: expected one of {', '.join(map(repr, REDUCTIONS))}, found {reduction!r}")
    assert world_size >= 1 and micro_batch_size >= 1 and global_batch_size >= micro_batch_size
    if reduction == "mean":
        return world_size * micro_batch_size / global_batch_size
    if reduction == "sum":
        return world_size / global_batch_size
    if micro_batch_tokens is None or global_batch_tokens is None:
        raise ValueError(
            "loss_reduction token_mean: expected this micro-batch's label tokens and the iteration's, found none; "
            "train from the dataloader poplar_ext.initialize returns, or call engine.set_token_counts(...) "
            "with your micro-batches' label tokens before each iteration"
        )
    if global_batch_tokens < 1:
        raise ValueError(
            f"global_batch_tokens: expected at least one label token in the iteration, found {global_batch_tokens}: "
            "under poplar.loss_reduction token_mean the loss is the mean over the global batch's label tokens, and "
            "every label of this iteration's samples on every rank is -100 (a causal LM's first label is not "
            "counted either); leave samples without label tokens out of the training data"
        )
    return world_size * micro_batch_tokens / global_batch_tokens


def pipeline_loss_weight(
    *, micro_batch_size: int, num_micro_batches: int, global_batch_size: int, reduction: Reduction = "mean"
) -> float:
    """The factor for a pipeline's micro-batch loss: ``s_p * b_p / B`` (mean), ``s_p / B`` (sum), or ``s_p`` per
    label token (token_mean: the engine divides the summed gradients by the iteration's tokens at the boundary).

    DeepSpeed's pipeline engine divides every micro-batch loss by s_p (no ``scale_wrt_gas=False``), and the
    gradients are summed over the pipelines (no ``1/W``): the rank weight with ``W = 1``, times s_p. token_mean's
    total ``T`` cannot be agreed before the first backward inside DeepSpeed's schedule, hence the division after
    (linear: the same gradient).
    """
    if reduction == "token_mean":
        assert micro_batch_size >= 1 and global_batch_size >= micro_batch_size
        return float(num_micro_batches)
    return num_micro_batches * loss_weight(
        world_size=1, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, reduction=reduction
    )


def loss_shifts_labels(model: Any) -> bool:
    """Whether `model`'s loss predicts ``labels[..., 1:]``: its own ``loss_shifts_labels``, else whether a Hugging
    Face model's ``loss_function`` is the causal one (by name: the core never imports transformers) and the model
    is not an encoder-decoder."""
    own = getattr(model, "loss_shifts_labels", None)
    if isinstance(own, bool):
        return own
    function = getattr(model, "loss_function", None)
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return getattr(function, "__name__", "") == "ForCausalLMLoss" and not encoder_decoder


def label_tokens(labels: Any, *, shifted: bool) -> int:
    """Label tokens in a tensor of labels, as a loss counts them (``-100`` ignored; `shifted`: a
    causal LM's, which predicts ``labels[..., 1:]``)."""
    if not isinstance(labels, torch.Tensor):
        raise ValueError(
            f"loss_reduction token_mean: expected labels that are a tensor of token ids, found {type(labels).__name__}"
        )
    return int((labels[..., 1:] if shifted else labels).ne(IGNORE_INDEX).sum())


def label_token_count(batch: Any, *, shifted: bool) -> int:
    """Label tokens in a micro-batch, as its loss counts them (``-100`` ignored)."""
    if not isinstance(batch, Mapping) or ("labels" not in batch and "shift_labels" not in batch):
        keys = f" with keys {', '.join(map(repr, batch))}" if isinstance(batch, Mapping) else ""
        raise ValueError(
            "loss_reduction token_mean: expected micro-batches that are dicts with 'labels' (or 'shift_labels'), "
            f"found {type(batch).__name__}{keys}: the label tokens are counted from that key (-100 ignored); "
            "have the collate_fn name the labels 'labels'"
        )
    if "shift_labels" in batch:
        return label_tokens(batch["shift_labels"], shifted=False)
    return label_tokens(batch["labels"], shifted=shifted)


def weight_loss(
    loss,
    *,
    world_size: int,
    micro_batch_size: int,
    global_batch_size: int,
    reduction: Reduction = "mean",
    micro_batch_tokens: int | None = None,
    global_batch_tokens: int | None = None,
):
    """`loss` times `loss_weight(...)`, for DeepSpeed's backward with ``scale_wrt_gas=False``; a bf16 or fp16 loss
    in fp32 (a weight like 3/11 rounded to bf16 would be off by up to 0.4%). A ``token_mean`` micro-batch without
    label tokens (weight 0) gives 0 where its loss, a mean over none, is NaN: what it adds to the global batch's
    loss, which the weighted losses sum to (its gradients are those the loss gives, zero for torch's mean)."""
    weight = loss_weight(
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        reduction=reduction,
        micro_batch_tokens=micro_batch_tokens,
        global_batch_tokens=global_batch_tokens,
    )
    if getattr(loss, "dtype", None) in (torch.bfloat16, torch.float16):
        loss = loss.float()
    weighted = loss * weight
    if weight == 0 and isinstance(weighted, torch.Tensor):
        weighted = torch.nan_to_num(weighted, nan=0.0)
    return weighted


__all__ = [
    "IGNORE_INDEX",
    "REDUCTIONS",
    "label_token_count",
    "label_tokens",
    "loss_shifts_labels",
    "loss_weight",
    "pipeline_loss_weight",
    "weight_loss",
]
