"""What PoplarTrainer's evaluation weights each batch's loss by, for the exact mean over the set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

import torch  # noqa: E402
from transformers import BatchEncoding  # noqa: E402

from poplar_ext.integrations.transformers import PoplarTrainerMixin, _EvalRound, _PlanEvaluation  # noqa: E402
from poplar_ext.runtime.evaluation import EvalBatchSampler  # noqa: E402


def _trainer() -> SimpleNamespace:
    """What `_eval_loss_count` reads of a PoplarTrainer over a causal LM whose loss is its token mean."""
    trainer = SimpleNamespace(
        _inner_loss_is_scaled_for_ga=None,
        model_accepts_loss_kwargs=True,
        compute_loss_func=None,
        _loss_shifts_labels_truly=lambda: True,
    )
    trainer._loss_is_a_token_mean = lambda batch: PoplarTrainerMixin._loss_is_a_token_mean(trainer, batch)
    return trainer


@pytest.mark.parametrize("kind", [dict, BatchEncoding])
def test_a_token_mean_loss_is_weighted_by_its_label_tokens_whatever_mapping_holds_the_batch(kind):
    # What DataCollatorForLanguageModeling returns is a BatchEncoding (a Mapping, not a dict).
    labels = torch.tensor([[5, 6, 7, -100], [5, 6, 7, 8]])
    batch = kind({"input_ids": labels.clamp(min=0), "labels": labels})
    # Shifted as the causal LM's loss counts them: 2 + 3 label tokens, not 2 samples.
    assert PoplarTrainerMixin._eval_loss_count(_trainer(), batch) == 5


class _TokenMeanLoss:
    """The Trainer's prediction_step for a causal LM: each batch's loss its shifted label tokens' mean (0/0, NaN, for a
    batch with none, as the model computes it)."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        labels = inputs["labels"][:, 1:]
        counted = labels != -100
        return labels.float().mul(counted).sum() / counted.sum(), None, None


class _Evaluating(_PlanEvaluation, _TokenMeanLoss):
    def __init__(self) -> None:
        self.job = SimpleNamespace(rank=0)
        self._eval_round = _EvalRound(sampler=EvalBatchSampler(num_samples=3, batch_sizes=[1], rank=0))
        self._eval_loss_count = lambda batch: PoplarTrainerMixin._eval_loss_count(_trainer(), batch)


def test_a_batch_without_label_tokens_adds_nothing_to_the_exact_mean():
    # A sample whose completion was truncated away, alone in its batch: its loss is 0/0; the exact mean over the set
    # is over the other batches' tokens, as the plain Trainer's stays finite.
    trainer = _Evaluating()
    for labels in ([[1, 2, 4]], [[1, -100, -100]], [[1, 6, -100]]):
        batch = {"input_ids": torch.tensor(labels).clamp(min=0), "labels": torch.tensor(labels)}
        trainer.prediction_step(None, batch, prediction_loss_only=True)
    progress = trainer._eval_round
    assert (progress.loss_sum, progress.loss_count) == (2 + 4 + 6, 3)
