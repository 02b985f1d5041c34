"""Evaluation under a plan (poplar_ext.runtime.evaluation): rounds that cover the data set once, in order."""

from __future__ import annotations

import random

import pytest

from poplar_ext.plan.formats import Plan, Prediction, RankPlan
from poplar_ext.runtime.evaluation import PADDING_INDEX, EvalBatchSampler, eval_batch_sizes, evaluation_rounds


def _plan(micro_batches: list[int]) -> Plan:
    ranks = tuple(
        RankPlan(rank=r, device_type="cpu", micro_batch_size=b, gradient_accumulation_steps=1)
        for r, b in enumerate(micro_batches)
    )
    prediction = Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0)
    return Plan(
        policy="test",
        zero_stage=0,
        global_batch_size=sum(micro_batches),
        ranks=ranks,
        predicted=prediction,
        profile_fingerprints=(),
    )


@pytest.mark.parametrize("seed", range(40))
def test_every_sample_once_in_order_and_no_batch_above_its_size(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
    num_samples = rng.randint(1, 80)
    samplers = [EvalBatchSampler(num_samples=num_samples, batch_sizes=sizes, rank=r) for r in range(len(sizes))]
    batches = [list(s) for s in samplers]
    assert len({len(b) for b in batches}) == 1, "every rank runs the same number of batches"
    gathered = []
    for k in range(len(batches[0])):
        real = samplers[0].real_counts(k)
        for r, rank_batches in enumerate(batches):
            batch = rank_batches[k]
            assert 1 <= len(batch) <= sizes[r]
            gathered.extend(batch[: real[r]])
            if real[r] == 0:
                assert batch == [PADDING_INDEX]
    assert gathered == list(range(num_samples))


def test_the_last_round_is_shared_in_proportion_and_ranks_without_a_sample_pad():
    assert evaluation_rounds(23, [3, 6, 3]) == [[(0, 3), (3, 6), (9, 3)], [(12, 3), (15, 5), (20, 3)]]
    assert evaluation_rounds(13, [3, 6, 3])[-1] == [(12, 0), (12, 1), (13, 0)]
    assert list(EvalBatchSampler(num_samples=13, batch_sizes=[3, 6, 3], rank=0)) == [[0, 1, 2], [PADDING_INDEX]]


def test_eval_batches_follow_the_plan_micro_batches_from_the_smallest():
    assert eval_batch_sizes(_plan([2, 4, 2]), smallest_batch_size=3) == [3, 6, 3]
    assert eval_batch_sizes(_plan([3, 1, 5]), smallest_batch_size=8) == [24, 8, 40]
    with pytest.raises(ValueError, match="per_device_eval_batch_size: expected an integer >= 1"):
        eval_batch_sizes(_plan([2, 4]), smallest_batch_size=0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="batch_sizes: expected one integer >= 1 per rank"):
        evaluation_rounds(10, [2, 0])
    with pytest.raises(ValueError, match="expected at least one sample"):
        EvalBatchSampler(num_samples=0, batch_sizes=[2, 2], rank=0)
