"""PoplarTrainerMixin on a Trainer subclass with its own compute_loss, on forked ranks.

3 ranks (one real CPU type, two emulated) under an uneven plan; the subclass's loss is a
sample mean (each sequence's mean token loss, averaged over the micro-batch) and says
so with ``loss_is_scaled_for_ga = False``, although GPT-2 accepts loss kwargs and the
batches carry labels (where a token-mean weighting would be wrong). The parameters after
3 optimizer steps equal one process training the same global batches with the same loss.
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks

pytest.importorskip("transformers", reason="the Hugging Face tests need pip install 'poplar-ext[hf]'")

import _hf_common as hf  # noqa: E402
import _training as t  # noqa: E402

TYPES = ["cpu", "cpu-slow", "cpu-slow"]
CASES = {2: [(3, 2), (1, 2), (2, 2)]}  # one case: ZeRO 0, 1 and 3 are test_trl.py's
GLOBAL_BATCH = 12


def sequence_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's mean next-token loss (padding -100 ignored)."""
    shifted = labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), shifted.flatten(), ignore_index=-100, reduction="none"
    ).view_as(shifted)
    counted = shifted.ne(-100)
    return ((per_token * counted).sum(1) / counted.sum(1).clamp(min=1)).mean()


def _train_custom(configs: dict[int, str], out: str) -> dict:
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainerMixin

    class SequenceMeanTrainer(Trainer):
        loss_is_scaled_for_ga = False  # a micro-batch mean, as the Trainer's contract says

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = sequence_mean_loss(outputs.logits, labels)
            return (loss, outputs) if return_outputs else loss

    class PoplarSequenceMeanTrainer(PoplarTrainerMixin, SequenceMeanTrainer):
        pass

    results = {}
    for stage, config in configs.items():
        AcceleratorState._reset_state(reset_partial_state=False)  # each case its own DeepSpeed plugin
        args = TrainingArguments(
            output_dir=f"{out}/{stage}",
            deepspeed=config,
            use_cpu=True,
            ddp_backend="gloo",
            max_steps=hf.STEPS,
            per_device_train_batch_size=4,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            dataloader_num_workers=0,
            **hf.OPTIMIZATION,
        )
        trainer = PoplarSequenceMeanTrainer(
            model=hf.tiny_gpt2(), args=args, train_dataset=hf.RecordingVarLen(), data_collator=hf.collate
        )
        trainer.train()
        results[stage] = hf.full_parameters(trainer.model_wrapped)
    return results


def _reference(global_batch: int, steps: int) -> dict[str, torch.Tensor]:
    model = hf.tiny_gpt2()
    data = hf.RecordingVarLen()
    optimizer = hf.make_optimizer("adamw", model.parameters())
    stream = t.SampleStream(num_samples=len(data), seed=0)
    for step in range(steps):
        batch = hf.collate([data[i] for i in stream.indices(step * global_batch, global_batch)])
        labels = batch.pop("labels")
        optimizer.zero_grad()
        sequence_mean_loss(model(**batch).logits, labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hf.CLIP)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_a_subclass_with_its_own_sample_mean_loss_trains_the_global_batch(tmp_path):
    results = run_ranks(
        _train_custom,
        world_size=3,
        tmp_path=tmp_path,
        args=(hf.trainer_configs(tmp_path, CASES, TYPES), str(tmp_path / "out")),
        timeout_s=240,
    )
    expected = _reference(GLOBAL_BATCH, hf.STEPS)
    for stage in CASES:
        assert t.max_difference(results[0][stage], expected) <= 1e-5, f"ZeRO stage {stage}"
