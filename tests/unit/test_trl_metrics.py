"""TRL's training metrics under a plan: every rank's merged when the Trainer logs (issue 36, item 7)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="the TRL integration needs pip install 'poplar-ext[trl]'")

from poplar_ext.integrations.trl import merged_training_metrics  # noqa: E402


def test_a_mean_is_over_every_micro_step_of_every_rank_and_a_token_count_is_the_jobs():
    # Rank 0 took 3 micro-steps, rank 1 one: rank 0's own mean (0.5) is not the job's.
    rank0 = {"mean_token_accuracy": (1.5, 3), "entropy": (6.0, 3), "num_tokens": (120.0, 1)}
    rank1 = {"mean_token_accuracy": (0.9, 1), "entropy": (1.0, 1), "num_tokens": (40.0, 1)}
    merged = merged_training_metrics([rank0, rank1])
    assert merged["mean_token_accuracy"] == [pytest.approx(2.4 / 4)]
    assert merged["entropy"] == [pytest.approx(7.0 / 4)]
    assert merged["num_tokens"] == [160.0]


def test_a_metric_only_some_ranks_have_and_an_empty_one():
    merged = merged_training_metrics([{"rewards/chosen": (2.0, 2)}, {"rewards/chosen": (0.0, 0), "x": (0.0, 0)}])
    assert merged == {"rewards/chosen": [1.0]}
