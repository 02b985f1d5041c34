"""Q3: ZeRO with the pipe engine on CPU.

    deepspeed --num_gpus 4 check_3_zero.py --zero 1   # check 2's uneven pipelines, weighted, under ZeRO-1
    deepspeed --num_gpus 4 check_3_zero.py --zero 2   # refused by PipelineEngine.__init__

Under ZeRO-1 each rank also prints its fp32 partition: the optimizer state of a stage is split
over that stage's data-parallel group (the same stage of every pipeline).
"""

import argparse

from check_2_micro_batches import run
from common import print_by_rank, shut_down
from deepspeed import comm as dist

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--zero", type=int, choices=[1, 2], required=True)
zero = parser.parse_args().zero

try:
    engine = run("share", zero)
    partition = engine.optimizer.single_partition_of_fp32_groups[0]
    stage_params = sum(p.numel() for p in engine.module.parameters())
    print_by_rank(
        f"rank {dist.get_rank()}: {type(engine.optimizer).__name__} over dp group "
        f"{engine.grid.get_data_parallel_group_ranks()}: fp32 partition {partition.numel()} "
        f"of the stage's {stage_params} parameters"
    )
except AssertionError as error:
    if "incompatible with pipeline" not in str(error):
        raise
    print_by_rank(f"rank {dist.get_rank()}: ZeRO-{zero} refused: AssertionError: {error}")
shut_down()
