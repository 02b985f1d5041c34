"""Training script for the two-node test (run by torchrun, one invocation per simulated node).

Trains the tiny GPT for a few optimizer steps with poplar_ext from `--deepspeed_config`
and has rank 0 save every parameter to `--result`. Only the first node's directory
holds the cluster and plan files the config names; the second has the config alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _training as t
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--result", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    import poplar_ext

    model = t.GPT(t.TINY)
    engine, _, loader, _ = poplar_ext.initialize(
        model=model,
        optimizer=t.make_optimizer("sgd", model.parameters()),
        training_data=t.dataset(),
        config=args.deepspeed_config,
    )
    t.train_steps(engine, loader, args.steps)
    params = t.full_parameters(engine)
    if engine.global_rank == 0:
        torch.save(
            {
                "params": params,
                "plan": [(r.micro_batch_size, r.gradient_accumulation_steps) for r in engine.plan.ranks],
                "devices": list(engine.rank_device_labels),
            },
            args.result,
        )
    done = Path(args.result).with_name(f"done-rank{engine.global_rank}")
    done.touch()  # everything written: what an exit abort cannot undo


if __name__ == "__main__":
    main()
