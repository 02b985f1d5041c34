"""Q4: pipe-engine checkpoints on CPU, and loading them with other stage boundaries.

    deepspeed --num_gpus 4 check_4_checkpoint.py --load-parts 0,3,6 [--module-only]
    deepspeed --num_gpus 4 check_4_checkpoint.py --load-parts 0,2,6 [--module-only]
    deepspeed --num_gpus 4 check_4_checkpoint.py --load-parts 0,1,2,4,6 [--module-only]
    deepspeed --num_gpus 3 check_4_checkpoint.py --save-parts 0,1,3,6 --load-parts 0,2,4,6

Saves after 2 steps with --save-parts (default [0, 3, 6]: 2 stages x 2 pipelines; micro 2, global
batch 12, ZeRO-0, SGD with momentum), lists the files, builds a fresh module and engine with
--load-parts (world / stages pipelines), loads, compares the loaded parameters and SGD momentum
with the saved ones, trains a third step and compares with one process trained 3 steps (equal
only if the momentum came back too).
"""

import argparse
import os
import shutil

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
from deepspeed import comm as dist

MICRO, GLOBAL = 2, 12

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--save-parts", default="0,3,6")
parser.add_argument("--load-parts", required=True)
parser.add_argument("--module-only", action="store_true", help="load_module_only=True (no optimizer state)")
args = parser.parse_args()
save_parts = [int(x) for x in args.save_parts.split(",")]
load_parts = [int(x) for x in args.load_parts.split(",")]

rank, world = init()
ckpt_dir = f"/tmp/pipe_feasibility_ckpt_{os.environ['MASTER_PORT']}"


def engine_for(parts, seed):
    stages = len(parts) - 1
    dp = world // stages
    gas = GLOBAL // (MICRO * dp)
    module = ExplicitSplitModule(
        layer_specs(), parts, num_stages=stages, loss_fn=weighted_mse(1.0), seed_layers=True, base_seed=seed
    )
    engine = build_engine(module, ds_config(MICRO, gas, dp))
    return engine, (
        lambda step: iter(micro_batches(step, GLOBAL, engine.grid.get_data_parallel_id() * MICRO * gas, MICRO, gas))
    )


def momentum(engine):
    """SGD's momentum buffers by global parameter name."""
    return {
        name: engine.optimizer.state[p]["momentum_buffer"].clone()
        for name, p in engine.module.named_parameters()
        if "momentum_buffer" in engine.optimizer.state[p]
    }


def merged(per_rank):
    return {name: value for entries in per_rank for name, value in entries.items()}


saver, data = engine_for(save_parts, BASE_SEED)
for step in range(2):
    saver.train_batch(data(step))
saved = merged(gathered_params(saver.module))
everyone = [None] * world
dist.all_gather_object(everyone, momentum(saver))
saved_momentum = merged(everyone)
if rank == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
dist.barrier()
saver.save_checkpoint(ckpt_dir, tag="step2")
dist.barrier()
if rank == 0:
    print(f"saved with parts {save_parts}:", sorted(os.listdir(os.path.join(ckpt_dir, "step2"))), flush=True)

# a different base seed: a layer the load skipped would show as a difference
loader, data = engine_for(load_parts, BASE_SEED + 1)
try:
    loader.load_checkpoint(ckpt_dir, tag="step2", load_module_only=args.module_only)
    loaded = momentum(loader)
    worst = max([(v - saved_momentum[n]).abs().max().item() for n, v in loaded.items()] or [0])
    outcome = (
        f"loaded; momentum of {len(loaded)} parameters, max |momentum - saved momentum of the same "
        f"parameter| = {worst:.3e}"
    )
except Exception as error:  # reported, not hidden: this is what the check measures
    outcome = f"raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"
print_by_rank(
    f"rank {rank}: stage {loader.grid.get_stage_id()} layers [{loader.module._local_start}, "
    f"{loader.module._local_stop}) load_checkpoint {outcome}"
)
outcomes = [None] * world
dist.all_gather_object(outcomes, outcome)
if any(o.startswith("raised") for o in outcomes):
    shut_down()
loaded_diff, missing = max_diff_against(saved, gathered_params(loader.module))
loader.train_batch(data(2))
after_diff, _ = max_diff_against(reference_params(3, GLOBAL), gathered_params(loader.module))
if rank == 0:
    print(
        f"RESULT load with parts {load_parts} ({'module only' if args.module_only else 'module + optimizer'}): "
        f"max |loaded - saved| = {loaded_diff:.3e} (layers missing: {missing or 'none'}); after a 3rd step "
        f"max |param - single process, 3 steps| = {after_diff:.3e}",
        flush=True,
    )
shut_down()
