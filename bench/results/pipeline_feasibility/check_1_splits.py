"""Q1: explicit layer splits; pipelines with different splits or different numbers of stages.

    deepspeed --num_gpus 4 check_1_splits.py --mode MODE

explicit        stock grid (2 stages x 2 pipelines), both pipelines parts [0, 1, 6] through
                ExplicitSplitModule (common.py); stock engine.
uneven-stock    stock grid and engine, pipeline 0 parts [0, 2, 6], pipeline 1 parts [0, 4, 6]:
                DeepSpeed's per-stage data-parallel collectives now meet different layers.
uneven-plan     the same pipelines and splits on the adaptation (hetero.py): PlanGrid (DeepSpeed
                sees one pipeline, dp 1), SegmentReducePipelineEngine (each layer's gradient
                adapted over its holders), micro-batch loss weighted by gas * b / B.
hetero          the adaptation with pipeline A = ranks [0, 1, 2], parts [0, 1, 3, 6], micro 2 x 4,
                and pipeline B = rank [3], one stage holding all 6 layers, micro 3 x 2.

Each prints where every layer lives and the max |param - single process on the global batch|.
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
from hetero import build_plan_engine

STEPS = 3
# per pipeline: global ranks in stage order, stage boundaries, micro-batch size, micro-batches per step
PLANS = {
    "explicit": [([0, 2], [0, 1, 6], 2, 3), ([1, 3], [0, 1, 6], 2, 3)],
    "uneven-stock": [([0, 2], [0, 2, 6], 2, 3), ([1, 3], [0, 4, 6], 2, 3)],
    "uneven-plan": [([0, 2], [0, 2, 6], 2, 3), ([1, 3], [0, 4, 6], 2, 3)],
    "hetero": [([0, 1, 2], [0, 1, 3, 6], 2, 4), ([3], [0, 6], 3, 2)],
}

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--mode", choices=sorted(PLANS), required=True)
mode = parser.parse_args().mode

rank, world = init()
plan = PLANS[mode]
index = next(i for i, (ranks, *_) in enumerate(plan) if rank in ranks)
ranks, parts, micro, gas = plan[index]
global_size = sum(m * g for _, _, m, g in plan)
if mode in ("uneven-plan", "hetero"):
    engine, data = build_plan_engine(plan)  # hetero.py: loss weight gas * micro / B, segment sum
    weight = gas * micro / global_size
    if rank == 0:
        print(
            "segment groups (owner ranks -> layers):",
            [(owners, layers) for owners, _, layers in engine.segment_reducer.segments],
            flush=True,
        )
else:  # stock: DeepSpeed averages over the dp pipelines, so the weight is dp * gas * micro / B (= 1 here)
    weight = len(plan) * gas * micro / global_size
    module = ExplicitSplitModule(
        layer_specs(), parts, num_stages=len(ranks), loss_fn=weighted_mse(weight), seed_layers=True, base_seed=BASE_SEED
    )
    engine = build_engine(module, ds_config(micro, gas, dp=len(plan)))
    data = lambda step: iter(micro_batches(step, global_size, index * micro * gas, micro, gas))  # noqa: E731
module, grid = engine.module, engine.grid
print_by_rank(
    f"rank {rank}: pipeline {index} stage {grid.get_stage_id()}/{grid.get_pipe_parallel_world_size()} "
    f"layers [{module._local_start}, {module._local_stop}) "
    f"params {sorted(n for n, _ in module.named_parameters())} "
    f"DeepSpeed dp group {grid.get_data_parallel_group_ranks()} micro {micro} x {gas} weight {weight:.4f}"
)

for step in range(STEPS):
    engine.train_batch(data(step))

worst, missing = max_diff_against(reference_params(STEPS, global_size), gathered_params(module))
if rank == 0:
    print(f"RESULT {mode}: max |param - single process| = {worst:.3e}; layers missing: {missing or 'none'}", flush=True)
shut_down()
