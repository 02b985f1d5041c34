"""Q4 with the adaptation: a checkpoint of heterogeneous pipelines resumed on another plan.

    deepspeed --num_gpus 4 check_4_hetero_universal.py

Plan A: pipeline ranks [0, 1, 2] parts [0, 1, 3, 6] micro 2 x 4; rank [3] alone, all 6 layers, micro 3 x 2.
Plan B: pipeline ranks [0, 1] parts [0, 4, 6] micro 2 x 4; ranks [2, 3] parts [0, 2, 6] micro 3 x 2.
Both: global batch 14, PlanGrid + SegmentReducePipelineEngine (hetero.py), ZeRO-1 over the
1-rank dp group (no sharding; it gives the ZeRO checkpoint layout), Adam.

Every pipeline holds the same parameters and optimizer state, so each saves into its own folder
(DeepSpeed names files by stage, which would collide across pipelines); rank 0 converts pipeline
0's folder with ds_to_universal; plan B loads it with "load_universal".
"""

import argparse
import os
import shutil
import subprocess
import sys

from common import gathered_params, init, max_diff_against, print_by_rank, reference_params, shut_down
from deepspeed import comm as dist
from hetero import build_plan_engine

PLAN_A = [([0, 1, 2], [0, 1, 3, 6], 2, 4), ([3], [0, 6], 3, 2)]
PLAN_B = [([0, 1], [0, 4, 6], 2, 4), ([2, 3], [0, 2, 6], 3, 2)]
GLOBAL = 14

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.parse_args()
rank, world = init()
root = f"/tmp/pipe_feasibility_hetero_{os.environ['MASTER_PORT']}"
pipeline = next(i for i, (ranks, *_) in enumerate(PLAN_A) if rank in ranks)

saver, data = build_plan_engine(PLAN_A, zero_stage=1, optimizer="adam")
for step in range(2):
    saver.train_batch(data(step))
saved = {n: v for params in gathered_params(saver.module) for n, v in params.items()}
if rank == 0:
    shutil.rmtree(root, ignore_errors=True)
dist.barrier()
saver.save_checkpoint(f"{root}/pipeline_{pipeline}", tag="step2")
dist.barrier()
if rank == 0:
    for p in range(len(PLAN_A)):
        print(f"pipeline {p} saved:", sorted(os.listdir(f"{root}/pipeline_{p}/step2")), flush=True)
    convert = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            f"{root}/pipeline_0/step2",
            "--output_folder",
            f"{root}/universal/step2",
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
        capture_output=True,
        text=True,
    )
    print(f"ds_to_universal exit status {convert.returncode}", flush=True)
dist.barrier()
reference = reference_params(3, GLOBAL, optimizer="adam")
saver.train_batch(data(2))  # control: plan A's own third step
control_diff, _ = max_diff_against(reference, gathered_params(saver.module))

loader, data = build_plan_engine(
    PLAN_B, zero_stage=1, optimizer="adam", base_seed=99, config_extra={"checkpoint": {"load_universal": True}}
)
loader.load_checkpoint(f"{root}/universal", tag="step2")
print_by_rank(
    f"rank {rank}: plan B stage {loader.grid.get_stage_id()}/{loader.grid.get_pipe_parallel_world_size()} "
    f"layers [{loader.module._local_start}, {loader.module._local_stop}) loaded"
)
loaded_diff, missing = max_diff_against(saved, gathered_params(loader.module))
loader.train_batch(data(2))
after_diff, _ = max_diff_against(reference, gathered_params(loader.module))
if rank == 0:
    print(
        f"RESULT plan A -> universal -> plan B: max |loaded - saved| = {loaded_diff:.3e} (layers missing: "
        f"{missing or 'none'}); after a 3rd step max |param - single process, 3 Adam steps| = {after_diff:.3e} "
        f"(control, plan A's own 3rd step: {control_diff:.3e})",
        flush=True,
    )
shut_down()
