"""Training script for the Hugging Face tests (run by torchrun): PoplarTrainer on a tiny GPT-2.

The model is built from a `GPT2Config` with random weights (nothing downloaded), the
data are token sequences of random lengths, padded per micro-batch with labels -100,
so the token-mean loss depends on how tokens are counted. Each rank records the
sample indices it trained (by content: accelerate's loader reads a batch ahead); rank 0
saves the parameters and the Trainer's metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import _hf_common as hf
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=hf.STEPS)
    parser.add_argument("--per-device", type=int, default=4, help="TrainingArguments.per_device_train_batch_size")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--model-init", action="store_true", help="pass model_init instead of a model")
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TrainingArguments(gradient_checkpointing=True), which the plan overrides per rank",
    )
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    import transformers

    logging.basicConfig(level=logging.INFO)  # poplar_ext's lines
    transformers.logging.set_verbosity_info()  # the Trainer's "Total train batch size"
    train(
        args.deepspeed_config,
        Path(args.out),
        steps=args.steps,
        per_device=args.per_device,
        save_steps=args.save_steps,
        resume=args.resume,
        model_init=args.model_init,
        gradient_checkpointing=args.gradient_checkpointing,
    )


def train(
    deepspeed_config: str,
    out: Path,
    *,
    steps: int = hf.STEPS,
    per_device: int = 4,
    save_steps: int = 0,
    resume: bool | str = False,
    model_init: bool = False,
    gradient_checkpointing: bool = False,
    save_model: bool = False,
) -> None:
    """One PoplarTrainer run; each rank writes what it trained, rank 0 the parameters and the Trainer's metrics.
    Also called on forked ranks (tests/dist/test_hf_trainer.py), several runs per group. `resume`: True for
    the output folder's last checkpoint, or a checkpoint's path. `save_model`: trainer.save_model(out / "model")
    once trained."""
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import MICRO_BATCHES, PoplarTrainer

    class RecordingTrainer(PoplarTrainer):
        """Remembers which samples each optimizer step's micro-batches had (accelerate's loader reads ahead)."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            for batch in inputs[MICRO_BATCHES]:
                for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
                    trained.append(index_of[tuple(i for i, m in zip(ids, mask) if m)])
            return super().training_step(model, inputs, num_items_in_batch)

    model = hf.tiny_gpt2()
    data = hf.RecordingVarLen()
    index_of = {tuple(item): index for index, item in enumerate(data.items)}
    trained: list[int] = []
    training = TrainingArguments(
        output_dir=str(out),
        deepspeed=deepspeed_config,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=steps,
        per_device_train_batch_size=per_device,
        report_to=[],
        logging_steps=1,
        dataloader_num_workers=0,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        **hf.OPTIMIZATION,
        **({"gradient_checkpointing": True} if gradient_checkpointing else {}),
    )
    if model_init:
        trainer = RecordingTrainer(model_init=hf.tiny_gpt2, args=training, train_dataset=data, data_collator=hf.collate)
    else:
        trainer = RecordingTrainer(model=model, args=training, train_dataset=data, data_collator=hf.collate)
    result = trainer.train(resume_from_checkpoint=resume or None)
    rank = int(os.environ["RANK"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"samples-rank{rank}.json").write_text(json.dumps(trained))
    (out / f"checkpointing-rank{rank}.json").write_text(json.dumps(trainer.model.is_gradient_checkpointing))
    offloading = bool(getattr(trainer.model_wrapped.optimizer, "cpu_offload", False))
    (out / f"offload-rank{rank}.json").write_text(json.dumps(offloading))
    params = hf.full_parameters(trainer.model_wrapped)
    if save_model:
        trainer.save_model(str(out / "model"))
    if rank == 0:
        torch.save(params, out / "params.pt")
        (out / "metrics.json").write_text(json.dumps(result.metrics))
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        # The scheduler's step count: a resume that restored scheduler.pt continues it (the constant
        # schedule's learning rate would not tell)
        (out / "scheduler.json").write_text(json.dumps({"last_epoch": trainer.lr_scheduler.last_epoch}))
    (out / f"done-rank{rank}").touch()  # everything written: what an exit abort cannot undo


if __name__ == "__main__":
    main()
