"""Can ranks differ in optimizer offload under DeepSpeed ZeRO stages 1-2? (issue 16, the second lever)

Two forked CPU ranks (gloo) train the project's tiny GPT for 3 steps with plain
DeepSpeed 0.19.8 at ZeRO stage 1 and 2 (Adam, torch's implementation), with no rank,
rank 1 alone or both ranks offloading the optimizer (``offload_optimizer: cpu``; on
this CPU-only machine the "device" is the CPU too, so this checks DeepSpeed's code
paths and collectives, not memory). Prints, per case, "ok" and the largest parameter
difference from the run without offload, or the failure.

Run from the repository root: python bench/results/mixed_offload/check.py
"""

import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "dist"))

import _training as t  # noqa: E402
from harness import RankFailure, run_ranks  # noqa: E402


def _train(stage: int, offload_ranks: list[int]) -> dict:
    import deepspeed
    import torch

    rank = torch.distributed.get_rank()
    model = t.GPT(t.TINY)
    zero = {"stage": stage}
    if rank in offload_ranks:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = t.dataset()
    for step in range(3):
        batch = torch.stack([data[i] for i in range(6 * step + 3 * rank, 6 * step + 3 * rank + 3)])
        engine.backward(engine(batch))
        engine.step()
    initial = t.GPT(t.TINY).state_dict()
    params = t.full_parameters(engine)
    moved = max(float((params[k] - initial[k]).abs().max()) for k in params)
    return {"params": params, "offloading": bool(getattr(engine.optimizer, "cpu_offload", False)), "moved": moved}


if __name__ == "__main__":
    for stage in (1, 2):
        reference = None
        for offload in ([], [1], [0, 1]):
            try:
                results = run_ranks(
                    _train, world_size=2, tmp_path=tempfile.mkdtemp(), args=(stage, offload), timeout_s=300
                )
                params = results[0]["params"]
                offloading = [r["offloading"] for r in results]
                assert offloading == [rank in offload for rank in range(2)], offloading
                assert results[0]["moved"] > 1e-3, "the parameters did not train"
                reference = reference or params
                across = t.max_difference(results[0]["params"], results[1]["params"])
                print(
                    f"stage {stage}, offload on ranks {offload} (the optimizers say cpu_offload {offloading}): ok, "
                    f"parameters moved up to {results[0]['moved']:.3g}, max |difference| from no offload "
                    f"{t.max_difference(params, reference):.3g}, between the ranks {across:.3g}"
                )
            except RankFailure as failure:
                last = [line for line in str(failure).splitlines() if "File " in line or "Error" in line][-4:]
                print(f"stage {stage}, offload on ranks {offload}: FAILED", *last, sep="\n  ")
