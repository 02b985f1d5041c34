"""Resume on more ranks where a rank's ZeRO 1-2 partition of a parameter group holds only padding.

A group of a few elements (``Linear(1, 1)``'s two; a scalar temperature in a group of its own, in any model)
is padded to a multiple of 2 x the number of ranks and cut into equal partitions: on 3 ranks those of ranks 1
and 2 hold padding alone. DeepSpeed 0.19.8's universal loader reads the first of no steps there (IndexError in
base_optimizer.py); poplar_ext.runtime.reshard.load_flat_checkpoint gives such a partition the state it had.
Saved on 2 ranks after 2 optimizer steps, resumed on 3 for 2 more, at stages 1 and 2 in fp32 and stage 1 in
bf16 (DeepSpeed's BF16_Optimizer): the parameters equal an uninterrupted 4 steps on 2 ranks, and every rank's
Adam ``step`` is back. Two forked groups (2 ranks, then 3) run every case in turn.
"""

from __future__ import annotations

import os

import _training as t
import pytest
import torch
from harness import run_ranks

STEPS = 2
CASES = [(1, False), (2, False), (1, True)]
"""(ZeRO stage, bf16)."""
ALLOCATIONS = {2: [(3, 1), (1, 1)], 3: [(2, 1), (1, 1), (1, 1)]}


class _Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.line = torch.nn.Linear(1, 1)

    def forward(self, x):
        return (self.line(x.to(self.line.weight.dtype)) ** 2).float().mean()


def _train(root, case, *, steps, load, save):
    import poplar_ext

    world_size = int(os.environ["WORLD_SIZE"])
    stage, bf16 = case
    config = t.ds_config(
        cluster=root / f"cluster{world_size}.json", plan=root / f"plan{world_size}-{stage}.json", stage=stage
    )
    if bf16:
        config["bf16"] = {"enabled": True}
    model = _Line()
    engine, *_ = poplar_ext.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01), config=config
    )
    checkpoints = root / f"stage{stage}-bf16{bf16}"
    if load:
        engine.load_checkpoint(checkpoints)
    data = torch.arange(25, dtype=torch.float32).reshape(25, 1) / 25
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))
    t.train_steps(engine, loader, steps)
    if save:
        engine.save_checkpoint(checkpoints)
    base = engine.deepspeed_engine.optimizer.optimizer
    return {"params": t.full_parameters(engine), "steps": [float(s["step"]) for s in base.state.values()]}


def _phase(root, *, resume):
    if resume:
        return {case: _train(root, case, steps=STEPS, load=True, save=False) for case in CASES}
    results = {}
    for case in CASES:
        _train(root, case, steps=STEPS, load=False, save=True)
        results[case] = _train(root, case, steps=2 * STEPS, load=False, save=False)  # uninterrupted
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("padding_partition")
    for ranks, allocation in ALLOCATIONS.items():
        t.write_cluster(root / f"cluster{ranks}.json", slow=ranks - 1, slowdown=1.0)
        for stage in (1, 2):
            types = ["cpu"] + ["cpu-slow"] * (ranks - 1)
            t.write_plan(root / f"plan{ranks}-{stage}.json", allocation, stage=stage, device_types=types)
    options = {"tmp_path": root, "timeout_s": 300}
    uninterrupted = run_ranks(_phase, world_size=2, args=(root,), kwargs={"resume": False}, **options)
    resumed = run_ranks(_phase, world_size=3, args=(root,), kwargs={"resume": True}, **options)
    return uninterrupted, resumed


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"stage{c[0]}-{'bf16' if c[1] else 'fp32'}")
def test_a_padding_partition_resumes_on_more_ranks_with_its_state(runs, case):
    uninterrupted, resumed = runs
    tolerance = 1e-2 if case[1] else 1e-6  # bf16: 3 ranks reduce the gradients in another order than 2
    for rank in resumed:
        assert t.max_difference(rank[case]["params"], uninterrupted[0][case]["params"]) <= tolerance
        assert rank[case]["steps"] == [2.0 * STEPS]  # also on ranks 1 and 2, whose partition is padding
