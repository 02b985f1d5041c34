"""What PoplarTrainer does to the engine the Trainer builds, before training starts (no process group)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

import torch  # noqa: E402
from test_trainer_loss_weights import _trainer  # noqa: E402  (a PoplarTrainer without a process group)
from transformers import Trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # the Trainer creates output_dir


@pytest.mark.parametrize(("resume", "undone"), [(None, True), ("checkpoint-2", False)])
def test_the_fp16_zero_step_is_undone_on_the_built_engine_unless_a_checkpoint_loads(monkeypatch, resume, undone):
    # DeepSpeed's fp16 optimizers at ZeRO 0 step the optimizer on zero gradients when built (AdamW's masters
    # decayed, a step counted): a PoplarTrainer job at ZeRO 0 in fp16 ended 1.48e-3 away from one fp32 process
    # where ZeRO 1 was 1.3e-4. A checkpoint loaded by the Trainer's build replaces the masters and the state.
    from poplar_ext.integrations import transformers as integration

    built = object()  # the DeepSpeed engine the Trainer's build leaves in model_wrapped

    def prepare(self, max_steps, train_dataloader, resume_from_checkpoint):
        self.model_wrapped = built
        return "prepared"

    calls = []
    monkeypatch.setattr(Trainer, "_prepare_for_training", prepare)
    monkeypatch.setattr(integration, "undo_initial_zero_step", calls.append, raising=False)
    monkeypatch.setattr(integration.PoplarTrainerMixin, "_wrap_engine", lambda self: None)
    trainer = _trainer(monkeypatch, torch.nn.Linear(2, 1))
    assert trainer._prepare_for_training(1, None, resume) == "prepared"
    assert calls == ([built] if undone else [])
