"""Shared pieces of the runtime's multi-process tests: files, models, a reference run."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens
from poplar_ext.runtime.data import SampleStream

TINY = GPTConfig(vocab_size=32, sequence_length=8, num_layers=1, num_heads=2, hidden_size=16)
NUM_SAMPLES = 25
"""Not a multiple of any global batch used here: iterations straddle epochs."""
CLIP = 0.3
"""Small enough that the global gradient is clipped in the first steps."""


class RecordingSampler:
    """Passes a batch sampler's micro-batches through and remembers their sample indices."""

    def __init__(self, sampler, seen: list):
        self.sampler, self.seen = sampler, seen

    def __iter__(self):
        for batch in self.sampler:
            self.seen.append(list(batch))
            yield batch

    def __len__(self):
        return len(self.sampler)


def write_cluster(path: Path, *, fast: int = 1, slow: int = 2, slowdown: float = 1.5, fast_type: str = "cpu") -> Path:
    """A cluster of `fast` real ranks followed by `slow` emulated slower ones.

    The real type must be what the hardware reports (``cpu`` on CPU ranks); any other
    `fast_type` is declared emulated with no slowdown (e.g. on a GPU, whose name the
    parent process cannot read without initialising CUDA before the ranks fork).
    """
    nodes = [{"name": "n0", "devices": [{"device_type": fast_type, "count": fast}]}]
    types = {}
    if fast_type != "cpu":
        types[fast_type] = {"emulation": {"slowdown": 1.0, "memory_capacity_bytes": 2_000_000_000}}
    if slow:
        nodes.append({"name": "n1", "devices": [{"device_type": "cpu-slow", "count": slow}]})
        types["cpu-slow"] = {"emulation": {"slowdown": slowdown, "memory_capacity_bytes": 2_000_000_000}}
    path.write_text(json.dumps({"schema_version": 1, "nodes": nodes, "device_types": types}))
    return path


def write_plan(
    path: Path,
    allocation: list[tuple[int, int]],
    *,
    stage: int,
    device_types: list[str],
    checkpointing: list[bool] | None = None,
    offload: list[bool] | None = None,
) -> Path:
    """A hand-written plan: (micro_batch_size, gradient_accumulation_steps) per rank, and
    activation checkpointing and optimizer offload per rank when given."""
    ranks = [
        {"rank": r, "device_type": t, "micro_batch_size": b, "gradient_accumulation_steps": s}
        for r, ((b, s), t) in enumerate(zip(allocation, device_types))
    ]
    for entry, on in zip(ranks, checkpointing or []):
        entry["activation_checkpointing"] = on
    for entry, on in zip(ranks, offload or []):
        entry["optimizer_offload"] = on
    plan = {
        "schema_version": 1,
        "policy": "poplar",
        "zero_stage": stage,
        "global_batch_size": sum(b * s for b, s in allocation),
        "ranks": ranks,
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
        "profile_fingerprints": {},
    }
    path.write_text(json.dumps(plan))
    return path


def write_stage_files(folder: Path, allocations: dict[int, list[tuple[int, int]]], *, device_types: list[str]) -> dict:
    """``{"cluster": path, stage: plan path, ...}``: the fast-plus-two-slow cluster (no slowdown) and a
    hand-written plan for each stage of `allocations`."""
    files: dict = {"cluster": write_cluster(folder / "cluster.json", fast=1, slow=2, slowdown=1.0)}
    for stage, allocation in allocations.items():
        files[stage] = write_plan(folder / f"plan{stage}.json", allocation, stage=stage, device_types=device_types)
    return files


def write_world_files(folder: Path, allocations: dict[int, dict[int, list[tuple[int, int]]]]) -> dict:
    """``{(ranks, stage): (cluster path, plan path)}`` for `allocations` (ranks -> stage -> allocation): per
    number of ranks, one real rank and the others emulated ``cpu-slow`` (no slowdown)."""
    files = {}
    for ranks, per_stage in allocations.items():
        cluster = write_cluster(folder / f"cluster{ranks}.json", slow=ranks - 1, slowdown=1.0)
        types = ["cpu"] + ["cpu-slow"] * (ranks - 1)
        for stage, allocation in per_stage.items():
            plan = write_plan(folder / f"plan{ranks}-{stage}.json", allocation, stage=stage, device_types=types)
            files[ranks, stage] = (cluster, plan)
    return files


def write_profiles(
    directory: Path,
    fingerprint: str,
    types_and_caps: list[tuple[str, int, float]],
    *,
    slowdowns: dict[str, float] | None = None,
    zero_stage: int = 1,
) -> Path:
    """Synthetic profiles at `zero_stage` of the tiny GPT (by its `fingerprint`) in `directory` (made if missing):
    ``(device_type, largest micro-batch, seconds per sample)`` each, for 3 ranks. `slowdowns`: device type ->
    the emulated slowdown its times include, its micro-steps compute alone, as a profile measured on that emulated
    CPU type says; such a type's compute is steady at the profile (default: none)."""
    import dataclasses

    from poplar_bench.synthetic import synthetic_profile
    from poplar_ext.plan.formats import Emulation, ModelInfo, save_profile

    directory.mkdir(exist_ok=True)
    model = ModelInfo(name="tiny-gpt", fingerprint=fingerprint, num_parameters=1, dtype="float32")
    for device_type, cap, seconds_per_sample in types_and_caps:
        profile = synthetic_profile(
            device_type,
            zero_stage=zero_stage,
            max_micro_batch_size=cap,
            overhead_s=0.001,
            seconds_per_sample=seconds_per_sample,
            world_size=3,
        )
        slowdown = (slowdowns or {}).get(device_type)
        emulated = None if slowdown is None else Emulation(slowdown=slowdown, memory_capacity_bytes=2_000_000_000)
        measured_with = dict(profile.measured_with)
        if emulated is not None:
            measured_with["micro_step_times_include_communication"] = False
        profile = dataclasses.replace(profile, model=model, emulated=emulated, measured_with=measured_with)
        save_profile(profile, directory / f"{device_type}-stage{zero_stage}.json")
    return directory


def write_steady_profiles(
    directory: Path,
    model: torch.nn.Module,
    slowdowns: dict[str, float],
    *,
    fast_s_per_sample: float,
    largest: int = 16,
    zero_stage: int = 1,
) -> Path:
    """`write_profiles` of `model` for emulated types, each `slowdowns[type]` x `fast_s_per_sample` per sample, so
    that every rank's compute is steady at its profile: a drift test's checks then read exactly the schedule's
    factor, whatever the machine's load. `fast_s_per_sample` must exceed the model's real compute per sample,
    or steady emulation cannot pad a micro-step to its profile."""
    from poplar_ext.profiler.fingerprint import model_fingerprint

    types = [(device_type, largest, fast_s_per_sample * slowdown) for device_type, slowdown in slowdowns.items()]
    return write_profiles(directory, model_fingerprint(model), types, slowdowns=slowdowns, zero_stage=zero_stage)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        # eps well above the default: the attention key bias's true gradient is exactly
        # zero (softmax ignores a constant added to every key), so its gradient is pure
        # rounding noise (~1e-9) whose value depends on summation order, and Adam with
        # eps=1e-8 turns any noise into lr-sized steps, in any two implementations.
        return torch.optim.Adam(params, lr=0.01, eps=1e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.01, eps=1e-4, weight_decay=0.1)  # eps: as Adam's
    if name == "rmsprop":
        # Momentum and centred, so that square_avg, momentum_buffer and grad_avg all exist;
        # eps as Adam's: a zero true gradient's rounding noise over its root mean square.
        return torch.optim.RMSprop(params, lr=0.01, alpha=0.9, eps=1e-4, momentum=0.5, centered=True)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05, eps=1e-4)  # eps: as RMSprop's
    raise ValueError(name)


class OddStateSGD(torch.optim.SGD):
    """SGD that also keeps a per-parameter state of one element, whatever the parameter's size."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["running_norm"] = p.detach().norm().reshape(1)
        return loss


def refusal(call) -> str | None:
    """The message of the ValueError `call()` raises (None when it raises none)."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def ds_config(*, cluster: Path, plan: Path | None, stage: int, **poplar) -> dict:
    if plan is not None:
        poplar["plan"] = str(plan)
    return {
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "poplar": {"cluster": str(cluster), "log_interval_steps": 0, **poplar},
    }


def dataset(gpt: GPTConfig = TINY, num_samples: int = NUM_SAMPLES) -> SyntheticTokens:
    """Token sequences for `gpt` (default: the tiny GPT's `NUM_SAMPLES`)."""
    return SyntheticTokens(num_samples=num_samples, sequence_length=gpt.sequence_length, vocab_size=gpt.vocab_size)


def full_parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter, whole, on every rank (gathered at ZeRO stage 3)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def train_steps(engine, loader, steps: int) -> None:
    """The ordinary DeepSpeed loop, for `steps` optimizer steps (over as many passes as needed)."""
    done = 0
    while True:
        for tokens in loader:
            engine.backward(engine(tokens.to(engine.device)))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            done += boundary
            if done == steps:
                return


def reference_parameters(
    optimizer_name: str,
    global_batch_size: int,
    steps: int,
    *,
    seed: int = 0,
    restart_optimizer_at: int | None = None,
    gpt: GPTConfig = TINY,
    num_samples: int = NUM_SAMPLES,
):
    """One process training on the concatenated global batch; also the pre-clip norms.

    `restart_optimizer_at`: a fresh optimizer (its state lost) from that step on; what a
    resume that dropped the optimizer state would train, to show a tolerance sees it.
    `gpt`, `num_samples`: the model and `dataset` trained (default: the tiny GPT on the tests' data).
    """
    model = GPT(gpt)
    optimizer = make_optimizer(optimizer_name, model.parameters())
    data = dataset(gpt, num_samples)
    stream = SampleStream(num_samples=num_samples, seed=seed)
    norms = []
    for step in range(steps):
        if step == restart_optimizer_at:
            optimizer = make_optimizer(optimizer_name, model.parameters())
        batch = torch.stack([data[i] for i in stream.indices(step * global_batch_size, global_batch_size)])
        optimizer.zero_grad()
        model(batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@contextlib.contextmanager
def logged_lines(name: str) -> Iterator[list[str]]:
    """The INFO lines logger `name` emits inside the block (this process's), for a failure's message."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
