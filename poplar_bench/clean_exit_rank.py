"""One rank of `poplar_bench.clean_exit`: a script that ends with a plain return, as users write them.
``python -m poplar_bench.clean_exit_rank --kind torch|poplar ...``; docs/bench.md (poplar-bench clean-exit)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _torch_only(destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(tensor)
    if destroy:
        dist.destroy_process_group()


def _train_one_stage(stage: int, work_dir: Path) -> None:
    """An engine at `stage`: two steps, a checkpoint, the parameters gathered."""
    import deepspeed
    import torch

    import poplar_ext
    from poplar_bench.cluster_files import write_uniform_cpu_job
    from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens

    # A uniform plan on real CPU ranks (the emulation plays no part in how a process exits).
    world_size, suffix = int(os.environ["WORLD_SIZE"]), os.environ["RANK"]
    cluster, plan = write_uniform_cpu_job(
        work_dir, world_size=world_size, micro_batch_size=2, accumulation_steps=2, zero_stage=stage, suffix=suffix
    )
    config = {
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10_000,
        "poplar": {"cluster": str(cluster), "plan": str(plan), "log_interval_steps": 0},
    }
    shape = GPTConfig(vocab_size=32, sequence_length=8, num_layers=1, num_heads=2, hidden_size=16)
    model = GPT(shape)
    data = SyntheticTokens(num_samples=64, sequence_length=shape.sequence_length, vocab_size=shape.vocab_size)
    engine, _, loader, _ = poplar_ext.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        training_data=data,
        config=config,
    )
    steps = 0
    for tokens in loader:
        engine.backward(engine(tokens))
        steps += engine.is_gradient_accumulation_boundary()
        engine.step()
        if steps == 2:
            break
    engine.save_checkpoint(work_dir / f"checkpoint-{os.environ['MASTER_PORT']}-{stage}")
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        _ = [p.detach().clone() for p in params]


def _poplar(work_dir: Path, handler: str) -> None:
    """Train each ZeRO stage in turn in this process (an engine each), as a script that tries stages does; then
    keep poplar-ext's exit handler (full), put one that only destroys the group (destroy), or none."""
    import atexit

    import torch.distributed as dist

    from poplar_ext import collectives
    from poplar_ext.plan.formats import ZERO_STAGES

    for stage in ZERO_STAGES:
        _train_one_stage(stage, work_dir)
    if handler != "full":
        atexit.unregister(collectives.leave_process_group)
    if handler == "destroy":
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("torch", "poplar"), required=True)
    parser.add_argument("--destroy", action="store_true", help="torch: the script destroys its group")
    parser.add_argument("--work-dir", type=Path, help="poplar: where the cluster and plan files go")
    parser.add_argument(
        "--handler",
        choices=("full", "destroy", "none"),
        default="full",
        help="poplar: poplar-ext's exit handler, one that only destroys the group, or none",
    )
    args = parser.parse_args()
    if args.kind == "torch":
        _torch_only(args.destroy)
    else:
        _poplar(args.work_dir, args.handler)


if __name__ == "__main__":
    main()
