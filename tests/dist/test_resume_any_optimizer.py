"""Resume on another number of ranks with any optimizer whose state is per-parameter.

SGD with momentum, AdamW, RMSprop (momentum, centred) and Adagrad, at ZeRO stages 1-3,
go 3 -> 2 and 2 -> 3 ranks, each side with its own plan: 3 optimizer steps, a
checkpoint, 3 more steps on the other number of ranks. The parameters equal one
process replaying the 6 global batches and every ``step`` is back, as a tensor. An
optimizer with a state shaped unlike its parameter is refused on every rank before any
weight is loaded. One checkpoint is converted beforehand by ``python -m
poplar_ext.runtime.reshard`` (the command load_checkpoint's messages name), and the
resume uses it. Three forked groups (2, 3, then 2 ranks) run every case in turn.
"""

from __future__ import annotations

import functools
import os
import shlex

import _training as t
import pytest
import torch
from harness import run_ranks

from poplar_ext.runtime import reshard

OPTIMIZERS = ("sgd", "adamw", "rmsprop", "adagrad")
STAGES = (1, 2, 3)
STEPS = 3
GLOBAL_BATCH = 12
TOLERANCE = 1e-5
TYPES = {3: ["cpu", "cpu-slow", "cpu-slow"], 2: ["cpu", "cpu-slow"]}
ALLOCATIONS = {  # (micro-batch, accumulation) per rank; one micro-step count at stages 2-3
    3: {1: [(2, 2), (2, 2), (4, 1)], 2: [(2, 2), (1, 2), (3, 2)], 3: [(2, 2), (1, 2), (3, 2)]},
    2: {1: [(3, 2), (6, 1)], 2: [(4, 2), (2, 2)], 3: [(4, 2), (2, 2)]},
}
RESUMES = [(name, stage, saved) for name in OPTIMIZERS for stage in STAGES for saved in (3, 2)]
"""(optimizer, ZeRO stage, ranks that saved); the other number of ranks resumes."""
REFUSED = [("odd", stage, 3) for stage in (1, 3)]
CONVERTED_BY_COMMAND = ("sgd", 3, 3)


def _case_dir(files, case):
    name, stage, saved = case
    return files["root"] / f"{name}-stage{stage}-from{saved}"


def _engine(files, case, world_size):
    import poplar_ext

    name, stage, _ = case
    model = t.GPT(t.TINY)
    optimizer = (
        t.OddStateSGD(model.parameters(), lr=0.1) if name == "odd" else t.make_optimizer(name, model.parameters())
    )
    config = t.ds_config(cluster=files["cluster", world_size], plan=files["plan", world_size, stage], stage=stage)
    engine, *_ = poplar_ext.initialize(model=model, optimizer=optimizer, config=config)
    data = t.dataset()
    loader = torch.utils.data.DataLoader(data, batch_sampler=engine.create_batch_sampler(len(data)))
    return engine, loader


def _steps_in_state(engine):
    """Every `step` the base optimizer keeps, as (type, value)."""
    base = engine.deepspeed_engine.optimizer.optimizer
    return sorted({(type(s["step"]).__name__, float(s["step"])) for s in base.state.values() if "step" in s})


def _resume(files, case, world_size):
    engine, loader = _engine(files, case, world_size)
    if case[0] == "odd":
        before = t.full_parameters(engine)
        try:
            engine.load_checkpoint(_case_dir(files, case))
        except ValueError as exc:
            unchanged = t.max_difference(before, t.full_parameters(engine)) == 0.0
            return {"error": str(exc), "unchanged": unchanged, "global_steps": engine.global_steps}
        return {"error": None}
    engine.load_checkpoint(_case_dir(files, case))
    t.train_steps(engine, loader, STEPS)
    return {"params": t.full_parameters(engine), "steps": _steps_in_state(engine)}


def _phase(files, *, save, resume):
    """Resume the cases saved on the other number of ranks, then save this group's."""
    world_size = int(os.environ["WORLD_SIZE"])
    results = {case: _resume(files, case, world_size) for case in resume}
    for case in save:
        engine, loader = _engine(files, case, world_size)
        t.train_steps(engine, loader, STEPS)
        engine.save_checkpoint(_case_dir(files, case))
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("any_optimizer")
    files = {"root": root}
    for ranks, types in TYPES.items():
        files["cluster", ranks] = t.write_cluster(root / f"cluster{ranks}.json", slow=ranks - 1, slowdown=1.0)
        for stage in STAGES:
            files["plan", ranks, stage] = t.write_plan(
                root / f"plan{ranks}-{stage}.json", ALLOCATIONS[ranks][stage], stage=stage, device_types=types
            )
    on = {ranks: [c for c in RESUMES + REFUSED if c[2] == ranks] for ranks in TYPES}
    options = {"tmp_path": root, "timeout_s": 300}
    run_ranks(_phase, world_size=2, args=(files,), kwargs={"save": on[2], "resume": []}, **options)
    from_two = run_ranks(_phase, world_size=3, args=(files,), kwargs={"save": on[3], "resume": on[2]}, **options)
    source = _case_dir(files, CONVERTED_BY_COMMAND)
    tag = (source / "latest").read_text().strip()
    command = shlex.split(reshard.command_line(source / tag, source / f"{tag}_universal"))
    exit_code = reshard.main(command[3:])
    from_three = run_ranks(_phase, world_size=2, args=(files,), kwargs={"save": [], "resume": on[3]}, **options)
    results = {case: [rank[case] for rank in group] for group in (from_two, from_three) for case in group[0]}
    return {**results, "command": (command[:3], exit_code)}


@functools.cache
def _reference(name: str, restart_optimizer_at: int | None = None):
    return t.reference_parameters(name, GLOBAL_BATCH, 2 * STEPS, restart_optimizer_at=restart_optimizer_at)[0]


@pytest.mark.parametrize("case", RESUMES, ids=lambda c: f"{c[0]}-stage{c[1]}-{c[2]}to{5 - c[2]}")
def test_parameters_equal_one_process_and_step_is_back(resumed, case):
    for rank in resumed[case]:
        assert t.max_difference(rank["params"], _reference(case[0])) <= TOLERANCE
        assert rank["steps"] == ([] if case[0] == "sgd" else [("Tensor", 2.0 * STEPS)])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_tolerance_sees_a_lost_optimizer_state(name):
    assert t.max_difference(_reference(name, restart_optimizer_at=STEPS), _reference(name)) > 100 * TOLERANCE


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: f"stage{c[1]}")
def test_a_state_unlike_its_parameter_is_refused_before_any_weight_on_every_rank(resumed, case):
    for rank in resumed[case]:
        assert rank["error"] is not None
        assert "OddStateSGD" in rank["error"] and "'running_norm'" in rank["error"]
        assert "python -m" not in rank["error"]  # no command to suggest: it would fail the same way
        assert rank["unchanged"] and rank["global_steps"] == 0


def test_the_command_messages_name_writes_what_the_resume_loads(resumed):
    """The command runs this module's main (its folder was there before the resume: the
    engine loaded it as it was, and test_parameters_... checks that resume)."""
    assert resumed["command"] == (["python", "-m", reshard.__name__], 0)
