"""Train the toy GPT with poplar_ext under the deepspeed launcher or torchrun.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/ds_config.json
    torchrun --nproc_per_node 2 examples/train.py --deepspeed_config examples/ds_config.json

The loop is the ordinary DeepSpeed one; only ``poplar_ext.initialize`` differs.

With ``--checkpoint-dir`` it saves every ``--checkpoint-interval-steps`` optimizer steps
and, when the directory already holds a checkpoint, starts from the latest one: the
data continues where it stopped, on whatever cluster the job now has (see docs/fault-tolerance.md
for restarting by itself when a node is lost, with torchrun's elastic agent).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import deepspeed
import torch

import poplar_ext
from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--local_rank",
        type=int,
        default=-1,
        help="set by the deepspeed launcher (--local_rank=N); torchrun sets LOCAL_RANK instead",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to train")
    parser.add_argument("--num-samples", type=int, default=500, help="size of the synthetic data set")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--result", help="rank 0 writes a JSON summary of the run here")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here, and start from the latest one found here")
    parser.add_argument(
        "--checkpoint-interval-steps",
        type=int,
        default=10,
        help="optimizer steps between checkpoints: after a lost node, the steps since the last "
        "checkpoint are trained again; each checkpoint costs a save",
    )
    deepspeed.add_config_arguments(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name in ("steps", "num_samples", "checkpoint_interval_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, found {getattr(args, name)}")
    # poplar_ext logs each rank's allocation and the true samples/s at INFO; the script decides where.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(name)s] %(message)s")
    shape = GPTConfig(vocab_size=64, sequence_length=16, num_layers=2, num_heads=2, hidden_size=32)
    model = GPT(shape)
    data = SyntheticTokens(
        num_samples=args.num_samples, sequence_length=shape.sequence_length, vocab_size=shape.vocab_size
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine, optimizer, loader, _ = poplar_ext.initialize(
        args=args, model=model, optimizer=optimizer, model_parameters=model.parameters(), training_data=data
    )
    if args.checkpoint_dir and os.path.isfile(os.path.join(args.checkpoint_dir, "latest")):
        # The data, the plan history and the optimizer state continue, also on another number of ranks.
        engine.load_checkpoint(args.checkpoint_dir)
    first_step, losses, iteration_loss = engine.global_steps, [], 0.0
    started = time.perf_counter()
    while engine.global_steps < args.steps:
        for tokens in loader:
            loss = engine(tokens.to(engine.device))
            # backward returns the loss weighted to the global batch: its sum over every rank's micro-batches is
            # world_size times the global batch's mean loss (a rank's own micro-batch loss is not the job's).
            iteration_loss += engine.backward(loss).item()
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                summed = torch.tensor([iteration_loss], device=engine.device)
                deepspeed.comm.all_reduce(summed)
                losses.append(summed.item() / engine.world_size)
                iteration_loss = 0.0
                if args.checkpoint_dir and engine.global_steps % args.checkpoint_interval_steps == 0:
                    engine.save_checkpoint(args.checkpoint_dir)
                if engine.global_steps == args.steps:
                    break
    elapsed_s = time.perf_counter() - started
    if engine.global_rank == 0 and losses:
        print(
            f"steps {first_step + 1}-{engine.global_steps}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"{engine.train_batch_size() * len(losses) / elapsed_s:.1f} samples/s"
        )
    if engine.global_rank == 0 and args.result:
        summary = {
            "steps": engine.global_steps,
            "first_step": first_step,
            "world_size": engine.world_size,
            "global_batch_size": engine.train_batch_size(),
            "rank0_device": engine.device_label,
            "devices": list(engine.rank_device_labels),
            "rank0_micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "rank0_gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "consumed_samples": engine.consumed_samples,
            "samples_per_s": engine.train_batch_size() * len(losses) / elapsed_s,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
        }
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
