"""Can ranks differ in activation checkpointing under DeepSpeed ZeRO? (issue 16, groundwork)

Two forked CPU ranks (gloo) train the project's tiny GPT for 3 steps with plain
DeepSpeed at ZeRO stage 2 and 3, either with no rank recomputing activations or with
only rank 1 wrapping each block in torch.utils.checkpoint. Prints, per case, "ok" and
the sum of the final parameters (equal sums: the same training), or the failure.

Run from the repository root: python bench/results/mixed_checkpointing/check.py
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


def _train(stage: int, checkpointing_ranks: list[int]) -> dict:
    import deepspeed
    import torch

    from poplar_ext.activation_checkpointing import set_activation_checkpointing

    rank = torch.distributed.get_rank()
    model = GPT(TINY)
    set_activation_checkpointing(model, rank in checkpointing_ranks)
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    data = _dataset()
    for step in range(3):
        batch = torch.stack([data[i] for i in range(6 * step + 3 * rank, 6 * step + 3 * rank + 3)])
        engine.backward(engine(batch))
        engine.step()
    return {"params": _full_parameters(engine)}


if __name__ == "__main__":
    for stage in (2, 3):
        for checkpointing in ([], [1], [0, 1]):
            try:
                results = run_ranks(
                    _train, world_size=2, log_dir=tempfile.mkdtemp(), args=(stage, checkpointing), timeout_s=120
                )
                total = float(sum(v.float().sum() for v in results[0]["params"].values()))
                print(f"stage {stage}, checkpointing on ranks {checkpointing}: ok, parameter sum {total:.6f}")
            except RankFailure as failure:
                # The failed ranks' tracebacks (their log tails hold crash dumps with the launcher's frames).
                errors = "\n".join(o.error for o in failure.outcomes if not o.ok)
                last = [line for line in errors.splitlines() if "File " in line][-3:]
                print(f"stage {stage}, checkpointing on ranks {checkpointing}: FAILED", *last, sep="\n  ")
