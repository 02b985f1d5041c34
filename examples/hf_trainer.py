"""Fine-tune a (tiny, randomly initialised) GPT-2 with the Hugging Face Trainer and poplar-ext.

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json
    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json
    accelerate launch --multi_gpu --num_processes 2 examples/hf_trainer.py --deepspeed examples/ds_config_hf.json

The only change from an ordinary Trainer script is `PoplarTrainer` in place of
`Trainer`; the DeepSpeed config has Hugging Face's "auto" values and a `poplar`
section. The model is built from a config (nothing is downloaded) and trained on
random token sequences of different lengths, padded per micro-batch (labels -100), so
the loss is a token mean: poplar-ext makes it the mean over the whole global batch.
Add --cpu to run on CPU ranks (gloo).

With ``--save-steps N`` it saves a checkpoint every N steps and, when the output
directory already holds one, resumes from the latest: after a lost node (torchrun's
elastic agent restarts the job on the nodes left), on whatever cluster is left, the
optimizer state resharded and the data continued (keep the global batch fixed with
``poplar.global_batch_size``: the Trainer's default, per device x ranks, would shrink).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME

from poplar_ext.integrations.transformers import PoplarTrainer


class RandomSequences(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, vocab_size: int, max_length: int) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, max_length + 1, (num_samples,), generator=generator)
        self.items = [torch.randint(0, vocab_size, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.items[index]}


def collate(items: list[dict]) -> dict:
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = item["input_ids"], 1, item["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def holds_whole_checkpoint(output_dir: str) -> bool:
    """Whether `output_dir` holds a ``checkpoint-N`` whose save finished: the Trainer writes its
    ``trainer_state.json`` last. A node lost during the first save leaves a ``checkpoint-N`` without it, which
    ``resume_from_checkpoint=True`` refuses: every restart would fail on it, instead of starting afresh."""
    return any(
        re.fullmatch(r"checkpoint-\d+", folder.name) and (folder / TRAINER_STATE_NAME).is_file()
        for folder in (Path(output_dir).iterdir() if os.path.isdir(output_dir) else ())
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config with a poplar section")
    parser.add_argument("--cpu", action="store_true", help="train on CPU ranks (gloo)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--output-dir", default="hf-trainer-output", help="the Trainer's output_dir: checkpoints")
    parser.add_argument(
        "--save-steps",
        type=int,
        default=0,
        help="save a checkpoint every this many steps and resume from the latest one in --output-dir (0: never); "
        "after a lost node, the steps since the last checkpoint are trained again",
    )
    parser.add_argument(
        "--local_rank",
        type=int,
        default=-1,
        help="set by the deepspeed launcher (--local_rank=N); torchrun sets LOCAL_RANK instead",
    )
    args = parser.parse_args()
    for name in ("steps",):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, found {getattr(args, name)}")
    if args.save_steps < 0:
        parser.error(f"--save-steps: expected 0 (never) or a positive integer, found {args.save_steps}")
    logging.basicConfig(level=logging.INFO)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64))
    training = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=args.deepspeed,
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=5,
        report_to=[],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        **({"use_cpu": True, "ddp_backend": "gloo"} if args.cpu else {}),
    )
    trainer = PoplarTrainer(
        model=model, args=training, train_dataset=RandomSequences(400, 256, 64), data_collator=collate
    )
    resume = args.save_steps > 0 and holds_whole_checkpoint(args.output_dir)
    trainer.train(resume_from_checkpoint=True if resume else None)


if __name__ == "__main__":
    main()
