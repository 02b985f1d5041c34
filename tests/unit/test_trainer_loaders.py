"""PoplarTrainer's dataloaders (the plan's samplers) keep the Trainer's own DataLoader settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir


def test_the_plan_s_dataloaders_take_the_trainer_s_dataloader_settings():
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainerMixin

    args = TrainingArguments(
        output_dir="unused",
        use_cpu=True,
        dataloader_num_workers=2,
        dataloader_persistent_workers=True,
        dataloader_prefetch_factor=4,
        dataloader_pin_memory=False,
    )
    trainer = SimpleNamespace(args=args)
    options = PoplarTrainerMixin._dataloader_options(trainer, training=True)
    assert (options["num_workers"], options["persistent_workers"], options["prefetch_factor"]) == (2, True, 4)
    assert options["pin_memory"] is False and options["worker_init_fn"].keywords == {"num_workers": 2, "rank": 0}
    assert "worker_init_fn" not in PoplarTrainerMixin._dataloader_options(trainer, training=False)
