"""Can ranks differ in optimizer offload under DeepSpeed ZeRO stages 1-2? (issue 16, the second lever)

Two forked CPU ranks (gloo) train the project's tiny GPT for 3 steps with plain
DeepSpeed 0.19.8 at ZeRO stage 1 and 2 (Adam, torch's implementation), with no rank,
rank 1 alone or both ranks offloading the optimizer (``offload_optimizer: cpu``; on
this CPU-only machine the "device" is the CPU too, so this checks DeepSpeed's code
paths and collectives, not memory). Prints, per case, "ok" and the largest parameter
difference from the run without offload, or the failure.

Run from the repository root: python bench/results/mixed_offload/check.py
"""

import tempfile

from poplar_ext.local_ranks import RankFailure, run_ranks
from poplar_ext.models.toy_gpt import GPT, GPTConfig, SyntheticTokens

TINY = GPTConfig(vocab_size=32, sequence_length=8, num_layers=1, num_heads=2, hidden_size=16)
"""The multi-process tests' tiny GPT (tests/dist/_training.py), trained on their 25 samples."""


def _dataset() -> SyntheticTokens:
    return SyntheticTokens(num_samples=25, sequence_length=TINY.sequence_length, vocab_size=TINY.vocab_size)


def _full_parameters(engine) -> dict:
    """Every parameter, whole, on every rank (gathered at ZeRO stage 3)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=engine.zero_optimization_stage() == 3):
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _train(stage: int, offload_ranks: list[int]) -> dict:
    import deepspeed
    import torch

    rank = torch.distributed.get_rank()
    model = GPT(TINY)
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
    data = _dataset()
    for step in range(3):
        batch = torch.stack([data[i] for i in range(6 * step + 3 * rank, 6 * step + 3 * rank + 3)])
        engine.backward(engine(batch))
        engine.step()
    initial = GPT(TINY).state_dict()
    params = _full_parameters(engine)
    moved = max(float((params[k] - initial[k]).abs().max()) for k in params)
    return {"params": params, "offloading": bool(getattr(engine.optimizer, "cpu_offload", False)), "moved": moved}


if __name__ == "__main__":
    for stage in (1, 2):
        reference = None
        for offload in ([], [1], [0, 1]):
            try:
                results = run_ranks(
                    _train, world_size=2, log_dir=tempfile.mkdtemp(), args=(stage, offload), timeout_s=300
                )
                params = results[0]["params"]
                offloading = [r["offloading"] for r in results]
                assert offloading == [rank in offload for rank in range(2)], offloading
                assert results[0]["moved"] > 1e-3, "the parameters did not train"
                reference = reference or params
                across = _max_difference(results[0]["params"], results[1]["params"])
                print(
                    f"stage {stage}, offload on ranks {offload} (the optimizers say cpu_offload {offloading}): ok, "
                    f"parameters moved up to {results[0]['moved']:.3g}, max |difference| from no offload "
                    f"{_max_difference(params, reference):.3g}, between the ranks {across:.3g}"
                )
            except RankFailure as failure:
                # The failed ranks' tracebacks (their log tails hold crash dumps with the launcher's frames).
                errors = "\n".join(o.error for o in failure.outcomes if not o.ok)
                last = [line for line in errors.splitlines() if "File " in line or "Error" in line][-4:]
                print(f"stage {stage}, offload on ranks {offload}: FAILED", *last, sep="\n  ")
