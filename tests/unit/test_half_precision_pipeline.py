"""Pipelines in bf16 and fp16 (issue 34) without a process group: the config, the loss weight, the loss
scale DeepSpeed leaves out at ZeRO 0, and the overflow every rank agrees on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer

from poplar_ext.pipeline.engine import PoplarPipelineEngine, agree_on_overflow
from poplar_ext.pipeline.module import WeightedLoss
from poplar_ext.pipeline.planning import check_pipeline_config
from poplar_ext.runtime.config import poplar_config_from_dict


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_precision_pipeline_job_is_not_refused_from_its_config(precision):
    poplar = poplar_config_from_dict({"plan": "plan.json"}, base_dir=Path("."))
    check_pipeline_config({precision: {"enabled": True}, "zero_optimization": {"stage": 0}}, poplar)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "token_mean"])
def test_a_half_precision_loss_is_weighted_in_fp32(dtype, reduction):
    weight = 8 / 14  # not a bf16 number: rounded to one, it is off by 0.2%
    labels = torch.tensor([5, 7, 9])
    weighted = WeightedLoss(None, weight, reduction=reduction)(torch.tensor(1.0, dtype=dtype), labels)
    assert weighted.dtype == torch.float32
    tokens = 3 if reduction == "token_mean" else 1
    assert float(weighted) == float(torch.tensor(weight * tokens, dtype=torch.float32))


class _Agreement:
    """Stands in for `agree_sum`: the other ranks' overflow flags added to this rank's."""

    def __init__(self, others: int) -> None:
        self.others, self.seen = others, None

    def __call__(self, value: int, device) -> int:
        self.seen = value
        return value + self.others


def test_no_overflow_anywhere_leaves_the_gradients_alone():
    gradients = [torch.ones(3, dtype=torch.float16), torch.full((2, 2), 2.0)]
    agreement = _Agreement(others=0)
    assert agree_on_overflow(gradients, device="cpu", agree=agreement) is False
    assert agreement.seen == 0
    assert torch.equal(gradients[0], torch.ones(3, dtype=torch.float16)) and bool((gradients[1] == 2).all())


def test_an_overflow_on_another_rank_makes_this_ranks_gradients_overflow_too():
    gradients = [torch.ones(3, dtype=torch.float16), torch.ones(2)]
    assert agree_on_overflow(gradients, device="cpu", agree=_Agreement(others=1)) is True
    assert all(bool(torch.isnan(g).all()) for g in gradients), "DeepSpeed's own check must see it here too"


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_an_overflow_here_is_told_to_the_other_ranks(bad):
    gradients = [torch.ones(3), torch.tensor([1.0, bad], dtype=torch.bfloat16)]
    agreement = _Agreement(others=0)
    assert agree_on_overflow(gradients, device="cpu", agree=agreement) is True
    assert agreement.seen == 1
    assert bool(torch.isfinite(gradients[0]).all()), "gradients are left as they are where this rank overflowed"


def _engine(*, fp16: bool, optimizer) -> SimpleNamespace:
    return SimpleNamespace(fp16_enabled=lambda: fp16, optimizer=optimizer)


def test_the_loss_scale_deepspeed_leaves_out_at_zero_0_is_put_in():
    fp16_optimizer = SimpleNamespace(loss_scale_config=SimpleNamespace(use_grad_scaling=True, cur_scale=256.0))
    assert PoplarPipelineEngine._unapplied_loss_scale(_engine(fp16=True, optimizer=fp16_optimizer)) == 256.0
    # bf16 through the same optimizer class: no loss scale to apply.
    unscaled = SimpleNamespace(loss_scale_config=SimpleNamespace(use_grad_scaling=False, cur_scale=1.0))
    assert PoplarPipelineEngine._unapplied_loss_scale(_engine(fp16=True, optimizer=unscaled)) is None
    assert PoplarPipelineEngine._unapplied_loss_scale(_engine(fp16=False, optimizer=fp16_optimizer)) is None


class _ZeroOptimizer(ZeROOptimizer):
    """A ZeRO optimizer by its class only, which is what DeepSpeed's backward asks before it scales the loss."""

    def __init__(self) -> None:
        self.loss_scale_config = SimpleNamespace(use_grad_scaling=True, cur_scale=256.0)


def test_the_loss_scale_of_a_zero_optimizer_is_left_to_deepspeed():
    assert PoplarPipelineEngine._unapplied_loss_scale(_engine(fp16=True, optimizer=_ZeroOptimizer())) is None


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_a_bf16_job_at_zero_0_is_told_at_start_that_its_checkpoints_will_not_resume_their_optimizer(
    caplog, rank, zero_stage
):
    # A tiny GPT-2 in bf16, its plan searched at ZeRO 0 (the search's auto: stage 1 predicts the same), trained
    # and saved without a word; only the resume refused its optimizer state, after the run.
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from poplar_ext.pipeline.engine import warn_unloadable_optimizer_state

    engine = SimpleNamespace(optimizer=object.__new__(BF16_Optimizer), zero_optimization=lambda: zero_stage > 0)
    with caplog.at_level("WARNING", logger="poplar_ext.pipeline.engine"):
        warn_unloadable_optimizer_state(engine, rank=rank)
    warned = [r.getMessage() for r in caplog.records if "will not resume" in r.getMessage()]
    assert len(warned) == (rank == 0 and zero_stage == 0)
    if warned:
        assert warned[0].startswith("bf16 at ZeRO stage 0: this job's checkpoints will not resume with their")
        assert "zero_optimization.stage 1 (a plan searched with --zero-stage 1) resumes exactly" in warned[0]
    caplog.clear()
    warn_unloadable_optimizer_state(SimpleNamespace(optimizer=object(), zero_optimization=lambda: False), rank=0)
    assert not caplog.records  # fp32, fp16: nothing to say
