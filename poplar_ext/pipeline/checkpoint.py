"""A pipeline job's checkpoint: one folder per pipeline, poplar-ext's state beside them; resumed under the same plan.

Layout (``TAG`` is the job's tag, ``global_step<N>`` by default)::

    save_dir/latest                   names TAG once every rank has written its part
    save_dir/TAG/poplar_state.json    data position, plan, plan history (rank 0)
    save_dir/TAG/pipeline<P>/         DeepSpeed's pipeline checkpoint of pipeline P

Every pipeline holds the same weights and optimizer state after each step, but DeepSpeed
names its files by layer and stage (``layer_<i>-model_states.pt``,
``mp_rank_<stage>_model_states.pt``), so pipelines of one folder would write over each
other's: each saves into its own.

A resume continues exactly (weights, optimizer state, data position) under the plan the
checkpoint was saved with: the job's own, or, where the run had re-balanced it (other
micro-batch counts per pipeline, `poplar_ext.runtime.rebalance`), its last one. Another
pipeline plan is refused, naming what differs: its stages would hold other layers than the
optimizer state files were written for.
"""

from __future__ import annotations

from typing import Any

from poplar_ext.plan.pipeline_formats import PipelinePlan, plan_parallelism
from poplar_ext.runtime.checkpoint import ResumeDecision, check_data_order, plan_as_dict

PIPELINE_FOLDER = "pipeline{index}"
"""The folder of pipeline `index` in a checkpoint's tag folder."""


def pipeline_folder(index: int) -> str:
    return PIPELINE_FOLDER.format(index=index)


def plan_changes(saved: dict[str, Any], current: dict[str, Any], *, counts: bool = True) -> list[str]:
    """What differs between two pipeline plans (JSON) in what a checkpoint's files depend on; with `counts`
    False, not the pipelines' micro-batch counts (what re-balancing changes)."""
    changes = []
    for key, what in (("zero_stage", "ZeRO stage"), ("global_batch_size", "global batch"), ("num_layers", "layers")):
        if saved[key] != current[key]:
            changes.append(f"{what} {saved[key]} then, {current[key]} now")
    if len(saved["pipelines"]) != len(current["pipelines"]):
        changes.append(f"{len(saved['pipelines'])} pipelines then, {len(current['pipelines'])} now")
    for index, (before, now) in enumerate(zip(saved["pipelines"], current["pipelines"])):
        split_before, split_now = (
            ", ".join(f"{s['first_layer']}-{s['last_layer']}" for s in p["stages"]) for p in (before, now)
        )
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


def _under_the_last_plan(saved: dict[str, Any], path: str) -> ResumeDecision:
    """A resume of a run that re-balanced: its last counts from the saved position on (`continue_plan`)."""
    position = saved["data_position"]
    return ResumeDecision(
        data_position=position,
        consumed_samples=saved["consumed_samples"],
        plan_history=list(saved["plan_history"]),
        notes=[
            f"resumed from {path} under its last plan, re-balanced from this job's (see the plan history); the data "
            f"continues at stream position {position}"
        ],
        continue_plan=saved["plan"],
    )


def pipeline_resume_decision(
    saved: dict | None, current: dict, *, path: str, load_module_only: bool = False
) -> ResumeDecision:
    """How a pipeline job continues from the checkpoint at `path` (`saved`: its poplar state).

    `current` is this job's state (`poplar_ext.runtime.checkpoint.poplar_client_state`).
    ValueError, before any file is loaded, for a checkpoint without poplar-ext's state, a
    ZeRO job's checkpoint, another data order, or another pipeline plan.
    """
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
    changes = plan_changes(saved["plan"], current["plan"])
    if changes and _started_as_this_job(saved, current["plan"]) and not load_module_only:
        return _under_the_last_plan(saved, path)
    if changes:
        raise ValueError(
            f"load_checkpoint: {path} was saved under another pipeline plan ({'; '.join(changes)}); resuming a "
            f"pipeline job under another plan is not supported yet: resume under the checkpoint's plan (in "
            f"{path}/poplar_state.json)"
        )
    if load_module_only:
        return ResumeDecision(
            data_position=0,
            consumed_samples=0,
            notes=[f"{path} was loaded for its weights only: the data starts at position 0"],
        )
    return ResumeDecision(
        data_position=saved["data_position"],
        consumed_samples=saved["consumed_samples"],
        plan_history=list(saved.get("plan_history") or []),
    )


__all__ = ["PIPELINE_FOLDER", "check_recount", "pipeline_folder", "pipeline_resume_decision", "plan_changes"]
