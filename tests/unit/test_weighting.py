"""The loss weight reproduces the global-batch gradient under DeepSpeed's (1/W) * sum rule."""

from __future__ import annotations

import pytest
import torch

from poplar_ext.runtime.weighting import label_token_count, loss_weight, weight_loss


def test_mean_weight():
    assert loss_weight(world_size=3, micro_batch_size=2, global_batch_size=12) == pytest.approx(0.5)


def test_sum_weight():
    assert loss_weight(world_size=3, micro_batch_size=2, global_batch_size=12, reduction="sum") == pytest.approx(0.25)


def test_unknown_reduction():
    with pytest.raises(ValueError, match="loss_reduction: expected one of 'mean', 'sum', 'token_mean', found 'none'"):
        loss_weight(world_size=1, micro_batch_size=1, global_batch_size=1, reduction="none")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_deepspeed_rule_gives_the_global_mean_gradient(reduction):
    # Ranks with uneven (micro-batch size, accumulation count); DeepSpeed sums the
    # gradients of what reaches backward over ranks and micro-steps, then divides by W.
    allocation = [(3, 2), (1, 4), (5, 1)]
    world_size = len(allocation)
    global_batch = sum(b * s for b, s in allocation)
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(global_batch, 4)

    def per_sample_loss(rows):
        return (rows @ w).sin()

    per_sample_loss(x).mean().backward()
    expected = w.grad.clone()
    w.grad = None
    start = 0
    for b, s in allocation:
        for _ in range(s):
            losses = per_sample_loss(x[start : start + b])
            loss = losses.mean() if reduction == "mean" else losses.sum()
            weight_loss(
                loss, world_size=world_size, micro_batch_size=b, global_batch_size=global_batch, reduction=reduction
            ).backward()
            start += b
    assert torch.allclose(w.grad / world_size, expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_loss_is_weighted_in_fp32(dtype):
    loss = torch.tensor(1.0, dtype=dtype)
    weighted = weight_loss(loss, world_size=3, micro_batch_size=3, global_batch_size=11)
    assert weighted.dtype == torch.float32
    assert float(weighted) == pytest.approx(9 / 11, rel=1e-7)  # bf16 would be off by up to 0.4%
    assert abs(float(loss * (9 / 11)) - 9 / 11) > 1e-4  # what multiplying in the loss's dtype gives


def test_a_micro_batch_whose_labels_are_named_otherwise_is_refused_naming_its_keys():
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "targets": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="found dict with keys 'input_ids', 'targets'.*name the labels 'labels'"):
        label_token_count(batch, shifted=True)
    with pytest.raises(ValueError, match=r"dicts with 'labels' \(or 'shift_labels'\), found tuple: "):
        label_token_count((batch["input_ids"], batch["targets"]), shifted=True)


def test_a_token_mean_micro_batch_without_label_tokens_adds_zero_to_the_summed_loss():
    # A micro-batch whose labels are all -100 (a prompt whose completion was cut away): torch's (and Hugging
    # Face's) mean over no token is NaN. Its weight is 0, and the weighted losses summed over the iteration are
    # the global batch's loss (docs/training.md, examples/train.py): 0 there, not NaN, with the zero gradients
    # the loss gives.
    logits = torch.randn(1, 4, 5, requires_grad=True)
    labels = torch.full((1, 4), -100)
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 5), labels.view(-1), ignore_index=-100)
    assert torch.isnan(loss)
    arguments = dict(world_size=3, micro_batch_size=1, global_batch_size=11, reduction="token_mean")
    weighted = weight_loss(loss, **arguments, micro_batch_tokens=0, global_batch_tokens=30)
    assert float(weighted) == 0.0
    weighted.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    other = torch.tensor(2.0)
    assert float(weight_loss(other, **arguments, micro_batch_tokens=6, global_batch_tokens=30)) == pytest.approx(1.2)


def test_an_iteration_without_label_tokens_is_refused_naming_the_setting_and_the_cure():
    with pytest.raises(ValueError) as refusal:
        weight_loss(
            torch.tensor(float("nan")),
            world_size=2,
            micro_batch_size=1,
            global_batch_size=4,
            reduction="token_mean",
            micro_batch_tokens=0,
            global_batch_tokens=0,
        )
    message = str(refusal.value)
    assert message.startswith("global_batch_tokens: expected at least one label token in the iteration, found 0")
    assert "poplar.loss_reduction token_mean" in message
    assert "every label of this iteration's samples on every rank is -100" in message
    assert "leave samples without label tokens out of the training data" in message
