"""What PoplarTrainer's evaluation weights each batch's loss by, for the exact mean over the set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

import torch  # noqa: E402
from transformers import BatchEncoding  # noqa: E402

from poplar_ext.integrations.transformers import PoplarTrainerMixin  # noqa: E402


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
