"""Q2: pipelines with different micro-batch sizes and micro-batch counts on the stock engine.

    deepspeed --num_gpus 4 check_2_micro_batches.py --weighting {share,none} [--zero 0|1]

Stock grid, 2 stages x 2 pipelines, same split. Pipeline 0 runs 4 micro-batches of 1 sample,
pipeline 1 runs 2 micro-batches of 3 samples (global batch B = 10). Each rank gets a DeepSpeed
config valid for its own pipeline: train_batch_size = micro * gas * dp (the check is local).
share: micro-batch loss x dp * gas_p * b_p / B (its share of the global batch, undoing
       DeepSpeed's 1/gas and its average over the dp pipelines);
none:  plain mean loss per micro-batch (DeepSpeed's own weighting).
"""

import argparse

from common import (
    BASE_SEED,
    ExplicitSplitModule,
    build_engine,
    ds_config,
    gathered_params,
    init,
    layer_specs,
    max_diff_against,
    micro_batches,
    print_by_rank,
    reference_params,
    shut_down,
    weighted_mse,
)

STEPS, PARTS = 3, [0, 3, 6]
PIPELINES = [(1, 4), (3, 2)]  # (micro-batch size, micro-batches per train_batch) of pipelines 0 and 1


def run(weighting, zero_stage):
    rank, world = init()
    dp = len(PIPELINES)
    pipeline = rank % dp  # stock topology: rank = stage * dp + pipeline
    micro, gas = PIPELINES[pipeline]
    global_size = sum(m * g for m, g in PIPELINES)
    start = sum(m * g for m, g in PIPELINES[:pipeline])
    weight = dp * gas * micro / global_size if weighting == "share" else 1.0
    module = ExplicitSplitModule(
        layer_specs(),
        PARTS,
        num_stages=world // dp,
        loss_fn=weighted_mse(weight),
        seed_layers=True,
        base_seed=BASE_SEED,
    )
    engine = build_engine(module, ds_config(micro, gas, dp, zero_stage))
    print_by_rank(
        f"rank {rank}: pipeline {engine.grid.get_data_parallel_id()} stage {engine.grid.get_stage_id()} "
        f"engine micro_batch_size {engine.micro_batch_size} micro_batches {engine.micro_batches} "
        f"train_batch_size {engine.train_batch_size()} weight {weight:.3f} "
        f"optimizer {type(engine.optimizer).__name__}"
    )
    for step in range(STEPS):
        engine.train_batch(iter(micro_batches(step, global_size, start, micro, gas)))
    worst, missing = max_diff_against(reference_params(STEPS, global_size), gathered_params(module))
    if rank == 0:
        print(
            f"RESULT ZeRO-{zero_stage}, micro x count {PIPELINES}, weighting {weighting}: "
            f"max |param - single process| = {worst:.3e}; layers missing: {missing or 'none'}",
            flush=True,
        )
    return engine


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--weighting", choices=["share", "none"], required=True)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    run(args.weighting, args.zero)
    shut_down()
