"""Q4, continued: a ZeRO-1 pipe checkpoint through DeepSpeed's universal checkpoint, loaded with
other stage boundaries (and another number of stages).

    deepspeed --num_gpus 4 check_4_universal.py --load-parts 0,2,6
    deepspeed --num_gpus 4 check_4_universal.py --load-parts 0,1,2,4,6

Saves after 2 steps with parts [0, 3, 6] (2 stages x 2 pipelines, micro 2, global batch 12,
ZeRO-1, Adam: universal checkpoints carry fp32, exp_avg, exp_avg_sq), converts it on rank 0
with deepspeed.checkpoint.ds_to_universal, loads it with "load_universal" into --load-parts,
trains a third step and compares with one process trained 3 steps with Adam (and, as a control,
the saving engine's own third step).
"""

import argparse
import os
import shutil
import subprocess
import sys

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

SAVE_PARTS, MICRO, GLOBAL = [0, 3, 6], 2, 12

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--load-parts", required=True)
load_parts = [int(x) for x in parser.parse_args().load_parts.split(",")]

rank, world = init()
ckpt_dir = f"/tmp/pipe_feasibility_universal_{os.environ['MASTER_PORT']}"


def engine_for(parts, seed, universal=False):
    stages = len(parts) - 1
    dp = world // stages
    gas = GLOBAL // (MICRO * dp)
    module = ExplicitSplitModule(
        layer_specs(), parts, num_stages=stages, loss_fn=weighted_mse(1.0), seed_layers=True, base_seed=seed
    )
    config = ds_config(MICRO, gas, dp, zero_stage=1)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine = build_engine(module, config, optimizer="adam")
    return engine, (
        lambda step: iter(micro_batches(step, GLOBAL, engine.grid.get_data_parallel_id() * MICRO * gas, MICRO, gas))
    )


saver, data = engine_for(SAVE_PARTS, BASE_SEED)
for step in range(2):
    saver.train_batch(data(step))
if rank == 0:
    shutil.rmtree(ckpt_dir, ignore_errors=True)
dist.barrier()
saver.save_checkpoint(ckpt_dir, tag="step2")
dist.barrier()
if rank == 0:
    print(f"saved with parts {SAVE_PARTS}:", sorted(os.listdir(os.path.join(ckpt_dir, "step2"))), flush=True)
    convert = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            os.path.join(ckpt_dir, "step2"),
            "--output_folder",
            os.path.join(ckpt_dir, "step2_universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
    )
    print(
        f"ds_to_universal exit status {convert.returncode}; last lines:",
        *convert.stdout.strip().splitlines()[-3:],
        *convert.stderr.strip().splitlines()[-3:],
        sep="\n  ",
        flush=True,
    )
    print(
        "universal folder:",
        sorted(os.listdir(os.path.join(ckpt_dir, "step2_universal"))),
        sorted(os.listdir(os.path.join(ckpt_dir, "step2_universal", "zero")))[:8],
        flush=True,
    )
dist.barrier()

saved = {n: v for params in gathered_params(saver.module) for n, v in params.items()}
reference = reference_params(3, GLOBAL, optimizer="adam")
saver.train_batch(data(2))  # control: the third step without a checkpoint in between
control_diff, _ = max_diff_against(reference, gathered_params(saver.module))
loader, data = engine_for(load_parts, BASE_SEED + 1, universal=True)
try:
    loader.load_checkpoint(ckpt_dir, tag="step2_universal")
    outcome = "loaded"
except Exception as error:  # reported, not hidden: this is what the check measures
    outcome = f"raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"
print_by_rank(
    f"rank {rank}: stage {loader.grid.get_stage_id()} layers [{loader.module._local_start}, "
    f"{loader.module._local_stop}) load_checkpoint {outcome}"
)
outcomes = [None] * world
dist.all_gather_object(outcomes, outcome)
if any(o != "loaded" for o in outcomes):
    shut_down()
loaded_diff, missing = max_diff_against(saved, gathered_params(loader.module))
loader.train_batch(data(2))
after_diff, _ = max_diff_against(reference, gathered_params(loader.module))
if rank == 0:
    print(
        f"RESULT universal load with parts {load_parts}: max |loaded - saved| = {loaded_diff:.3e} "
        f"(layers missing: {missing or 'none'}); after a 3rd step max |param - single process, 3 Adam steps| "
        f"= {after_diff:.3e} (control, the saving engine's own 3rd step: {control_diff:.3e})",
        flush=True,
    )
shut_down()
