"""Train pipelines of a pipeline plan with poplar_ext under torchrun or the deepspeed launcher.

    torchrun --nproc_per_node 4 examples/pipeline_train.py --deepspeed_config examples/ds_config_pipeline.json
    deepspeed --num_gpus 4 examples/pipeline_train.py --deepspeed_config examples/ds_config_pipeline.json

The model is DeepSpeed's PipelineModule with the plan's stages (`PoplarPipelineModule`:
no num_stages, no partition_method) and the loop is DeepSpeed's pipeline loop
(``engine.train_batch()``): only the module's class and ``poplar_ext.initialize`` differ
from a DeepSpeed pipeline script.
"""

from __future__ import annotations

import argparse
import json
import logging

import deepspeed
import torch

import poplar_ext
from poplar_ext.models.toy_pipeline import RegressionData, mse, toy_layers
from poplar_ext.pipeline import PoplarPipelineModule


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
    parser.add_argument("--num-samples", type=int, default=200, help="size of the synthetic data set")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate (momentum 0.9)")
    parser.add_argument("--save-dir", help="save a checkpoint here at the end")
    parser.add_argument("--result", help="rank 0 writes a JSON summary of the run here")
    deepspeed.add_config_arguments(parser)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    for name in ("steps", "num_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, found {getattr(args, name)}")
    # poplar_ext logs each rank's place in the plan and the true samples/s at INFO; the script decides where.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] [%(name)s] %(message)s")
    # Collective, as DeepSpeed's PipelineModule: builds this rank's stage of its pipeline only.
    model = PoplarPipelineModule(layers=toy_layers(), loss_fn=mse, seed_layers=True, args=args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    engine, _, _, _ = poplar_ext.initialize(
        args=args, model=model, optimizer=optimizer, training_data=RegressionData(num_samples=args.num_samples)
    )
    losses = [float(engine.train_batch()) for _ in range(args.steps)]  # the global batch's mean loss
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if engine.global_rank == 0 and args.result:
        summary = {
            "steps": engine.global_steps,
            "global_batch_size": engine.train_batch_size(),
            "data_position": engine.data_position,
            "losses": losses,
        }
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
