"""Shared pieces of the pipeline feasibility checks (DeepSpeed 0.19.8, CPU, gloo).

A 6-layer MLP given as LayerSpecs; every layer seeded by its index (seed_layers), so its
initial weights are the same whatever stage builds it. Parameters are named
"<layer index>.<name>" both in a PipelineModule and in the reference nn.Sequential.
The reference is one process training the whole global batch with the same SGD.
"""

from __future__ import annotations

import datetime
import glob
import os
import sys

import deepspeed
import torch
import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime import utils as ds_utils

DIM = 8
NUM_LAYERS = 6
BASE_SEED = 1234
LR, MOMENTUM = 0.1, 0.9
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),  # the state universal checkpoints carry
}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def layer_specs():
    return [LayerSpec(Block) for _ in range(NUM_LAYERS - 1)] + [LayerSpec(nn.Linear, DIM, 1)]


def mse(outputs, labels):
    return ((outputs - labels) ** 2).mean()


def weighted_mse(weight):
    """The loss a micro-batch hands to DeepSpeed: its mean loss times `weight`."""
    return lambda outputs, labels: mse(outputs, labels) * weight


def global_batch(step, size):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(size, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def micro_batches(step, global_size, start, micro, count):
    """`count` micro-batches of `micro` samples taken from the global batch at `start`."""
    x, y = global_batch(step, global_size)
    return [
        (x[start + i * micro : start + (i + 1) * micro], y[start + i * micro : start + (i + 1) * micro])
        for i in range(count)
    ]


def reference_params(steps, global_size, optimizer="sgd", clip=0.0):
    """One process, the whole global batch, mean loss, same initial weights and optimizer;
    the global gradient norm clipped to `clip` when it is positive."""
    layers = []
    for idx, spec in enumerate(layer_specs()):
        ds_utils.set_random_seed(BASE_SEED + idx)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for step in range(steps):
        x, y = global_batch(step, global_size)
        opt.zero_grad()
        mse(model(x), y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ds_config(micro, gas, dp, zero_stage=0, clip=0.0):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * dp,
        "gradient_clipping": clip,  # set explicitly: 0.19.8 defaults to 1.0
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # the client torch SGD under ZeRO
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def init(timeout_s=300):
    """Gloo process group with a short timeout, so a mismatched collective fails instead of hanging."""
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def build_engine(module, config, engine_cls=None, optimizer="sgd"):
    optimizer = OPTIMIZERS[optimizer](list(module.parameters()))
    if engine_cls is None:
        engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        return engine
    return engine_cls(
        args=None,
        model=module,
        optimizer=optimizer,
        model_parameters=None,
        training_data=None,
        lr_scheduler=None,
        mpu=module.mpu(),
        dist_init_required=False,
        collate_fn=None,
        config=config,
        config_class=deepspeed.DeepSpeedConfig(config, module.mpu()),
    )


def print_by_rank(line):
    """Every rank's line, printed by rank 0 in rank order."""
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def gathered_params(module):
    """Every rank's parameters by global name, merged on all ranks (each layer once per pipeline)."""
    mine = {k: v.detach().clone() for k, v in module.state_dict().items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def max_diff_against(reference, everyone):
    """Largest |param - reference| over every copy held on any rank; also reports missing layers."""
    worst, seen = 0.0, set()
    for params in everyone:
        for name, value in params.items():
            worst = max(worst, (value - reference[name]).abs().max().item())
            seen.add(name)
    missing = sorted(set(reference) - seen)
    return worst, missing


def shut_down():
    """Barrier, then exit without interpreter teardown (gloo teardown aborts now and then).
    Exiting so skips DeepSpeed's removal of the CPU all-reduce buffer it maps in /dev/shm
    (~69 MB per rank), so this rank's buffer is removed here."""
    dist.barrier()
    port, local_rank = os.environ.get("MASTER_PORT"), os.environ.get("LOCAL_RANK")
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_{local_rank}"):
        os.remove(path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class ExplicitSplitModule(PipelineModule):
    """A PipelineModule with exact stage boundaries: `parts` is [0, b1, ..., num_layers].

    The smallest seam: `_partition_layers` is the only place DeepSpeed computes `self.parts`
    (runtime/pipe/module.py:396-447) and PipelineModule.__init__ calls it once (module.py:192),
    before any layer is built.
    """

    def __init__(self, layers, parts, **kwargs):
        self._explicit_parts = list(parts)
        super().__init__(layers, **kwargs)

    def _partition_layers(self, method="uniform"):
        parts = self._explicit_parts
        if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs):
            raise ValueError(f"parts {parts} do not cover {len(self._layer_specs)} layers in {self.num_stages} stages")
        self.parts = parts
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])
