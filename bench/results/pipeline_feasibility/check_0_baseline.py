"""Does DeepSpeed's PipelineEngine train on CPU ranks with gloo? 2 stages x 2 replicas.

    deepspeed --num_gpus 4 bench/results/pipeline_feasibility/check_0_baseline.py

Stock DeepSpeed: PipelineModule(num_stages=2, partition_method="uniform") on 4 ranks (grid 2 stages x 2 pipelines),
micro-batch 2, 3 micro-batches per train_batch(), ZeRO-0, SGD with momentum. Pipeline d reads
samples [d*6, d*6+6) of each 12-sample global batch. Parameters after 3 steps are compared with
one process training the whole global batch (mean loss).

    ... check_0_baseline.py --partition parameters   # fails in 0.19.8 with seed_layers=True
"""

import argparse

from common import (
    BASE_SEED,
    build_engine,
    ds_config,
    gathered_params,
    init,
    layer_specs,
    max_diff_against,
    micro_batches,
    mse,
    print_by_rank,
    reference_params,
    shut_down,
)
from deepspeed.pipe import PipelineModule

STEPS, MICRO, GAS, STAGES = 3, 2, 3, 2

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--partition", default="uniform", help="DeepSpeed's partition_method")
args = parser.parse_args()

rank, world = init()
dp = world // STAGES
module = PipelineModule(
    layer_specs(),
    num_stages=STAGES,
    loss_fn=mse,
    partition_method=args.partition,
    seed_layers=True,
    base_seed=BASE_SEED,
)
engine = build_engine(module, ds_config(MICRO, GAS, dp))
grid = engine.grid
global_size = MICRO * GAS * dp
print_by_rank(
    f"rank {rank}: stage {grid.get_stage_id()} pipeline {grid.get_data_parallel_id()} "
    f"layers [{module._local_start}, {module._local_stop}) parts {module.parts} "
    f"dp group {grid.get_data_parallel_group_ranks()} pipe group {grid.pp_group}"
)

for step in range(STEPS):
    data = micro_batches(step, global_size, grid.get_data_parallel_id() * MICRO * GAS, MICRO, GAS)
    loss = engine.train_batch(iter(data))
    if rank == 0:
        print(f"step {step}: train_batch() returned {loss.item():.6f}", flush=True)

worst, missing = max_diff_against(reference_params(STEPS, global_size), gathered_params(module))
if rank == 0:
    print(
        f"RESULT baseline 2 stages x {dp} pipelines, ZeRO-0: max |param - single process| = {worst:.3e}; "
        f"layers missing: {missing or 'none'}",
        flush=True,
    )
shut_down()
