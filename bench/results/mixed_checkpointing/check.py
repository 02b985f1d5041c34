"""Can ranks differ in activation checkpointing under DeepSpeed ZeRO? (issue 16, groundwork)

Two forked CPU ranks (gloo) train the project's tiny GPT for 3 steps with plain
DeepSpeed at ZeRO stage 2 and 3, either with no rank recomputing activations or with
only rank 1 wrapping each block in torch.utils.checkpoint. Prints, per case, "ok" and
the sum of the final parameters (equal sums: the same training), or the failure.

Run from the repository root: python bench/results/mixed_checkpointing/check.py
"""

import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "dist"))

import _training as t  # noqa: E402
from harness import RankFailure, run_ranks  # noqa: E402


def _train(stage: int, checkpointing_ranks: list[int]) -> dict:
    import deepspeed
    import torch

    from poplar_ext.activation_checkpointing import set_activation_checkpointing

    rank = torch.distributed.get_rank()
    model = t.GPT(t.TINY)
    set_activation_checkpointing(model, rank in checkpointing_ranks)
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    data = t.dataset()
    for step in range(3):
        batch = torch.stack([data[i] for i in range(6 * step + 3 * rank, 6 * step + 3 * rank + 3)])
        engine.backward(engine(batch))
        engine.step()
    return {"params": t.full_parameters(engine)}


if __name__ == "__main__":
    for stage in (2, 3):
        for checkpointing in ([], [1], [0, 1]):
            try:
                results = run_ranks(
                    _train, world_size=2, tmp_path=tempfile.mkdtemp(), args=(stage, checkpointing), timeout_s=120
                )
                total = float(sum(v.float().sum() for v in results[0]["params"].values()))
                print(f"stage {stage}, checkpointing on ranks {checkpointing}: ok, parameter sum {total:.6f}")
            except RankFailure as failure:
                last = [line for line in str(failure).splitlines() if "File " in line][-3:]
                print(f"stage {stage}, checkpointing on ranks {checkpointing}: FAILED", *last, sep="\n  ")
