"""A pipeline job's checkpoint: one folder per pipeline, resumed under any plan (docs/pipeline.md)."""

from __future__ import annotations

from typing import Any

from poplar_ext.plan.pipeline_formats import PipelinePlan, plan_parallelism
from poplar_ext.runtime.checkpoint import ResumeDecision, check_data_order, plan_as_dict, rebalancing_of

UNIVERSAL_FOLDER = "universal"
"""A pipeline checkpoint's optimizer state per parameter, in its tag folder (written at its first resume under
another split: `poplar_ext.pipeline.replan`)."""


PIPELINE_FOLDER = "pipeline{index}"
"""The folder of pipeline `index` in a checkpoint's tag folder."""


def pipeline_folder(index: int) -> str:
    return PIPELINE_FOLDER.format(index=index)


def _splits(plan: dict[str, Any]) -> list[str]:
    """Each pipeline's stages as the layers they hold (``0-1, 2-5``)."""
    return [", ".join(f"{s['first_layer']}-{s['last_layer']}" for s in p["stages"]) for p in plan["pipelines"]]


def layers_move(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether some stage of `current` (a pipeline plan's JSON) holds other layers than the same stage of the same
    pipeline held in `saved`: its files of the checkpoint would not be its own."""
    return _splits(saved) != _splits(current)


def plan_changes(saved: dict[str, Any], current: dict[str, Any], *, counts: bool = True) -> list[str]:
    """What differs between two pipeline plans (JSON): layers, ZeRO stage, global batch, pipelines, their stages
    and micro-batches; with `counts` False, not the pipelines' micro-batch counts (what re-balancing changes)."""
    changes = []
    for key, what in (("zero_stage", "ZeRO stage"), ("global_batch_size", "global batch"), ("num_layers", "layers")):
        if saved[key] != current[key]:
            changes.append(f"{what} {saved[key]} then, {current[key]} now")
    if len(saved["pipelines"]) != len(current["pipelines"]):
        changes.append(f"{len(saved['pipelines'])} pipelines then, {len(current['pipelines'])} now")
    splits = zip(_splits(saved), _splits(current))
    for index, (before, now, (split_before, split_now)) in enumerate(
        zip(saved["pipelines"], current["pipelines"], splits)
    ):
        if split_before != split_now:
            changes.append(f"pipeline {index}'s stages held layers {split_before} then, {split_now} now")
        for key, what in (("micro_batch_size", "micro-batch size"), ("num_micro_batches", "micro-batches")):
            if before[key] != now[key] and (counts or key != "num_micro_batches"):
                changes.append(f"pipeline {index}'s {what} {before[key]} then, {now[key]} now")
    return changes


def check_recount(current: PipelinePlan, plan: PipelinePlan) -> None:
    """ValueError unless `plan` can replace `current` mid-run: the same pipelines, stages, layers, micro-batch
    sizes, global batch and ZeRO stage, other micro-batch counts at most (the same verdict on every rank)."""
    changes = plan_changes(plan_as_dict(current), plan_as_dict(plan), counts=False)
    if changes:
        raise ValueError(
            "plan: expected the running pipeline plan with other micro-batch counts at most, found "
            + "; ".join(changes)
        )


def _started_as_this_job(saved: dict[str, Any], plan: dict[str, Any]) -> bool:
    """The checkpoint's run started from `plan` and only re-balanced it since: its last plan differs in
    micro-batch counts alone (a resume of the same job continues where the run had got to)."""
    history = saved.get("plan_history") or []
    started_from = next((h.get("plan") for h in reversed(history) if not h.get("switched")), None)
    return (
        started_from is not None
        and plan_parallelism(started_from) == "pipeline"
        and not plan_changes(started_from, plan)
        and not plan_changes(saved["plan"], plan, counts=False)
    )


def pipeline_resume_decision(
    saved: dict | None, current: dict, *, path: str, load_module_only: bool = False
) -> ResumeDecision:
    """How a pipeline job continues from the checkpoint at `path` (`saved`: its poplar state; `current`: this
    job's). ValueError, before any file is loaded, for a checkpoint without poplar-ext's state, a ZeRO job's,
    another data order, number of layers or ZeRO stage. Another pipeline plan continues the data stream, with an
    entry in the plan history."""
    if saved is None:
        raise ValueError(
            f"load_checkpoint: {path} holds no poplar_state.json; expected a checkpoint saved by a poplar-ext "
            "pipeline job (poplar_state.json beside one pipeline<N>/ folder per pipeline)"
        )
    if plan_parallelism(saved["plan"]) != "pipeline":
        raise ValueError(
            f"load_checkpoint: {path} was saved by a job that trained every rank on the whole model (a ZeRO plan); "
            "this job trains pipelines: resume it with poplar_ext.initialize on the model it was saved from"
        )
    check_data_order(saved, current, path=path)
    _refuse_what_cannot_move(saved["plan"], current["plan"], path=path, weights_only=load_module_only)
    changes = plan_changes(saved["plan"], current["plan"])
    if changes and not load_module_only and _started_as_this_job(saved, current["plan"]):
        # A run that re-balanced: its last counts from the saved position on.
        position, history = saved["data_position"], list(saved["plan_history"])
        return ResumeDecision(
            data_position=position,
            consumed_samples=saved["consumed_samples"],
            plan_history=history,
            notes=[
                f"resumed from {path} under its last plan, re-balanced from this job's (see the plan history); the "
                f"data continues at stream position {position}"
            ],
            continue_plan=saved["plan"],
            rebalancing=rebalancing_of(saved, current["plan"]),
        )
    if load_module_only:
        return ResumeDecision(
            data_position=0,
            consumed_samples=0,
            notes=[f"{path} was loaded for its weights only: the data starts at position 0"],
        )
    position, history = saved["data_position"], list(saved.get("plan_history") or [])
    if not changes:
        return ResumeDecision(
            data_position=position,
            consumed_samples=saved["consumed_samples"],
            plan_history=history,
            rebalancing=rebalancing_of(saved, current["plan"]),
        )
    reason = f"resumed from {path} under another pipeline plan ({'; '.join(changes)})"
    entry = {"start_step": saved.get("step", 0), "data_position": position, "reason": reason, "plan": current["plan"]}
    return ResumeDecision(
        data_position=position,
        consumed_samples=saved["consumed_samples"],
        plan_history=history + [entry],
        notes=[f"{reason}; layers moved by index, the data continues at stream position {position}"],
    )


def _refuse_what_cannot_move(saved: dict[str, Any], current: dict[str, Any], *, path: str, weights_only: bool) -> None:
    """ValueError for plans whose checkpoint files cannot be read by the other: what differs in the model or
    (unless `weights_only`) in the optimizer state's layout."""
    compared = (("num_layers", "layers"),) + (() if weights_only else (("zero_stage", "ZeRO stage"),))
    changes = [f"{what} {saved[key]} then, {current[key]} now" for key, what in compared if saved[key] != current[key]]
    if changes:
        raise ValueError(
            f"load_checkpoint: {path} was saved under a pipeline plan that cannot be continued by this one "
            f"({'; '.join(changes)}); expected the same model (its layers move by index) and the same ZeRO stage "
            f"(the optimizer state's layout): resume it with the model and the ZeRO stage of {path}/poplar_state.json"
        )


def parameter_differences(saved: list[dict[str, list[int]]], current: list[dict[str, list[int]]]) -> list[str]:
    """What differs between the checkpoint's optimizer parameters and this job's (per optimizer group, name -> shape;
    this job's gathered over every rank): [] when every parameter's state can move."""
    if len(saved) != len(current):
        return [f"{len(saved)} optimizer parameter groups then, {len(current)} now"]
    differences = []
    for index, (before, now) in enumerate(zip(saved, current)):
        where = f"in optimizer group {index}" if len(saved) > 1 else "among the optimizer's parameters"
        for name in sorted(set(before) - set(now)):
            differences.append(f"{name} {where} then, not now")
        for name in sorted(set(now) - set(before)):
            differences.append(f"{name} {where} now, not then")
        for name in sorted(set(before) & set(now)):
            if list(before[name]) != list(now[name]):
                differences.append(f"{name} of shape {list(before[name])} then, {list(now[name])} now")
    return differences
