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


def test_the_token_count_logged_with_an_evaluation_is_the_jobs_not_rank_0s(monkeypatch):
    # TRL logs its running count of training tokens as eval_num_tokens; training kept it per rank (rank 0's
    # 381 of the job's 580 were logged). The evaluation's own metrics are already every rank's: left alone.
    from types import SimpleNamespace

    import poplar_ext.integrations.trl as trl_integration

    class Logged:
        def log(self, logs, *args, **kwargs):
            self.logged = dict(self._metrics["eval"])

    class Probe(trl_integration._LocalMetrics, Logged):
        pass

    sent = []
    monkeypatch.setattr(
        trl_integration, "gather_objects", lambda mine: sent.append(mine) or [mine, {"num_tokens": (199.0, 1)}]
    )
    probe = object.__new__(Probe)
    probe.model = SimpleNamespace(training=False)
    probe._metrics = {"train": {}, "eval": {"num_tokens": [381.0], "entropy": [4.0, 4.2]}}
    probe.log({"eval_loss": 1.0, "eval_runtime": 0.5})
    assert sent == [{"num_tokens": (381.0, 1)}]
    assert probe.logged == {"num_tokens": [580.0], "entropy": [4.0, 4.2]}

    sent.clear()  # the Trainer's last log after an evaluation: nothing of TRL's left, no gather
    probe._metrics = {"train": {}, "eval": {}}
    probe.log({"train_runtime": 1.0})
    assert sent == []

    # predict() leaves TRL's eval token count and logs nothing: a log of the user's own afterwards (perhaps on one
    # rank) starts no gather, which the other ranks would never meet.
    probe._metrics = {"train": {}, "eval": {"num_tokens": [381.0]}}
    probe.log({"my_metric": 1.0})
    assert sent == []
    probe.log({"test_loss": 1.0, "test_runtime": 0.5})  # evaluate(metric_key_prefix="test")
    assert sent == [{"num_tokens": (381.0, 1)}]
