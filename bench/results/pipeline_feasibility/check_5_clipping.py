"""Supplement: gradient clipping with the pipe engine (0.19.8 clips by default, at 1.0).

    deepspeed --num_gpus 4 check_5_clipping.py --zero 0|1 --layout stock|plan|hetero

SGD, gradient_clipping 0.05 (below the gradient norm, so every step clips), against one process
that clips the global gradient norm to 0.05.
stock   stock grid 2 stages x 2 pipelines, parts [0, 3, 6], micro 2 x 3;
plan    the same layout on the adaptation (hetero.py);
hetero  the adaptation with pipelines [0, 1, 2] parts [0, 1, 3, 6] micro 2 x 4 and [3] (all layers) micro 3 x 2.
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
    reference_params,
    shut_down,
    weighted_mse,
)
from hetero import build_plan_engine

STEPS, CLIP = 3, 0.05
PLANS = {
    "plan": [([0, 2], [0, 3, 6], 2, 3), ([1, 3], [0, 3, 6], 2, 3)],
    "hetero": [([0, 1, 2], [0, 1, 3, 6], 2, 4), ([3], [0, 6], 3, 2)],
}

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--zero", type=int, choices=[0, 1], required=True)
parser.add_argument("--layout", choices=["stock", "plan", "hetero"], required=True)
args = parser.parse_args()

rank, world = init()
if args.layout == "stock":
    global_size = 12
    module = ExplicitSplitModule(
        layer_specs(), [0, 3, 6], num_stages=2, loss_fn=weighted_mse(1.0), seed_layers=True, base_seed=BASE_SEED
    )
    engine = build_engine(module, ds_config(2, 3, 2, args.zero, clip=CLIP))
    data = lambda step: iter(micro_batches(step, global_size, rank % 2 * 6, 2, 3))  # noqa: E731
else:
    plan = PLANS[args.layout]
    global_size = sum(m * g for _, _, m, g in plan)
    engine, data = build_plan_engine(plan, zero_stage=args.zero, config_extra={"gradient_clipping": CLIP})
for step in range(STEPS):
    engine.train_batch(data(step))
everyone = gathered_params(engine.module)
clipped, _ = max_diff_against(reference_params(STEPS, global_size, clip=CLIP), everyone)
unclipped, _ = max_diff_against(reference_params(STEPS, global_size), everyone)
if rank == 0:
    print(
        f"RESULT {args.layout} ZeRO-{args.zero}, gradient_clipping {CLIP}: "
        f"max |param - single process clipped at {CLIP}| = {clipped:.3e}, "
        f"max |param - single process unclipped| = {unclipped:.3e}",
        flush=True,
    )
shut_down()
