"""A pipeline checkpoint resumed under another split: layers moved by index, optimizer state by parameter.

See docs/pipeline.md (checkpoints) and docs/deepspeed-notes.md (pipeline engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from poplar_ext.pipeline.checkpoint import UNIVERSAL_FOLDER
from poplar_ext.runtime.reshard import SCALAR_STATES, carried_states, partition_states, write_whole

ZERO_FILE_PREFIXES = ("", "bf16_")
"""How DeepSpeed's ZeRO optimizer files of a stage begin: fp32 and fp16, then bf16 (its ``_get_zero_ckpt_prefix``)."""

PARAMETER_SHAPES_KEY = "poplar_param_shapes"
"""DeepSpeed client state at ZeRO 0: per optimizer group, each parameter's name and shape, in the optimizer's order."""


def optimizer_parameter_shapes(engine: Any) -> list[dict[str, list[int]]]:
    """Per optimizer group of `engine` (ZeRO 0 or 1), its parameters' names and shapes, in the optimizer's order."""
    if engine.zero_optimization():
        return [{name: list(shape) for name, shape in group.items()} for group in engine._get_zero_param_shapes()]
    return [{engine.param_names[p]: list(p.shape) for p in group} for group in model_parameter_groups(engine.optimizer)]


def model_parameter_groups(optimizer: Any) -> list[list[torch.nn.Parameter]]:
    """The model's parameters per group of a ZeRO-0 `optimizer`: DeepSpeed's bf16 and fp16 optimizers step fp32
    copies (their ``param_groups``) and keep the model's own in ``bf16_groups`` / ``fp16_groups``."""
    for attribute in ("bf16_groups", "fp16_groups"):
        groups = getattr(optimizer, attribute, None)
        if groups is not None:
            return [list(group) for group in groups]
    return [list(group["params"]) for group in optimizer.param_groups]


def half_precision_master_copies(optimizer: Any) -> bool:
    """Whether a ZeRO-0 `optimizer` steps fp32 copies of the model's parameters (DeepSpeed's bf16 and fp16 ones)."""
    return any(getattr(optimizer, attribute, None) is not None for attribute in ("bf16_groups", "fp16_groups"))


def _refusal(path: Path) -> str:
    """How a refused state's message ends: what it cannot be, and the plan it can resume under."""
    return (
        f"moved between stages (saved in {path}); resume this checkpoint under its plan "
        f"(in {path.parent.parent / 'poplar_state.json'})"
    )


def _zero0_states(model_states: dict, shapes: list[dict], *, optimizer_name: str, path: Path) -> dict[str, dict]:
    """Each parameter's states from a stage's torch optimizer state_dict (ZeRO 0)."""
    saved = model_states["optimizer"]
    per_parameter: dict[str, dict] = {}
    for group, named in zip(saved["param_groups"], shapes):
        for index, (name, shape) in zip(group["params"], named.items()):
            flat = {
                key: value.reshape(-1) if torch.is_tensor(value) and key not in SCALAR_STATES else value
                for key, value in saved["state"].get(index, {}).items()
            }
            states = carried_states(
                flat,
                partition_numel=int(torch.Size(shape).numel()),
                optimizer_name=optimizer_name,
                saved_ranks=1,
                refusal=_refusal(path),
            )
            per_parameter[name] = {k: v if k in SCALAR_STATES else v.reshape(shape) for k, v in states.items()}
    return per_parameter


def _zero1_states(zero_states: dict, shapes: list[dict], *, optimizer_name: str, path: Path) -> dict[str, dict]:
    """Each parameter's fp32 weight and states from a stage's ZeRO-1 flat partitions (one rank: the whole group)."""
    from deepspeed.checkpoint.constants import PARAM_SLICE_MAPPINGS

    per_parameter: dict[str, dict] = {}
    groups = partition_states(zero_states, optimizer_name=optimizer_name, saved_ranks=1, refusal=_refusal(path))
    for group_id, flat in enumerate(groups):
        for name, fragment in zero_states[PARAM_SLICE_MAPPINGS][group_id].items():
            shape = shapes[group_id][name]
            per_parameter[name] = {
                key: value if key in SCALAR_STATES else value.narrow(0, fragment.start, fragment.numel).reshape(shape)
                for key, value in flat.items()
            }
    return per_parameter


def _write_parameter(folder: Path, states: Mapping[str, Any]) -> None:
    """One parameter's states as DeepSpeed's universal files: ``{"param": tensor, "cat_dim": 0}``, `step` as it is."""
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM

    folder.mkdir(parents=True)
    for key, value in states.items():
        torch.save(value if key in SCALAR_STATES else {PARAM: value.clone(), CAT_DIM: 0}, folder / f"{key}.pt")


def convert_pipeline_checkpoint(
    tag_dir: str | Path, *, num_stages: int, zero_stage: int, optimizer_name: str
) -> list[dict[str, list[int]]]:
    """Write the optimizer state of pipeline 0 (of `num_stages`) of the checkpoint at `tag_dir` per parameter
    (rank 0's job) into ``tag_dir/universal``, whole or not at all, unless there. Returns the checkpoint's
    parameters per optimizer group (name -> shape). ValueError, naming the checkpoint, for a state that is not
    per parameter or a ZeRO-0 checkpoint without its parameters' names.
    """
    tag_dir = Path(tag_dir)
    target = tag_dir / UNIVERSAL_FOLDER
    if not target.is_dir():
        write_whole(
            target,
            lambda work: _convert(
                tag_dir, work, num_stages=num_stages, zero_stage=zero_stage, optimizer_name=optimizer_name
            ),
        )
    return torch.load(target / "zero" / "optimizer_state.pt", weights_only=False)[PARAMETER_SHAPES_KEY]


def _zero_file(source: Path, stage: int) -> Path:
    """Stage `stage`'s ZeRO-1 optimizer state as DeepSpeed names it: ``bf16_zero_pp_rank_0_...`` in bf16,
    ``zero_pp_rank_0_...`` otherwise; ValueError naming both where neither is there."""
    names = [source / f"{prefix}zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt" for prefix in ZERO_FILE_PREFIXES]
    for name in names:
        if name.is_file():
            return name
    raise ValueError(
        f"{source}: expected stage {stage}'s ZeRO-1 optimizer state in {names[0].name} (or {names[1].name}, "
        "as DeepSpeed names it in bf16), found neither"
    )


def _stage_states(source: Path, stage: int, *, zero_stage: int, optimizer_name: str) -> tuple[dict, list, dict, dict]:
    """Stage `stage` of the saved pipeline: its parameters' states, shapes and optimizer groups, and (ZeRO 1)
    the ZeRO optimizer's own state (what DeepSpeed's universal ``optimizer_state.pt`` keeps of it)."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        OPTIMIZER_STATE_DICT,
        PARAM_GROUPS,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )

    model_file = source / f"mp_rank_{stage:02d}_model_states.pt"
    model_states = torch.load(model_file, map_location="cpu", weights_only=False)
    shapes = model_states.get(PARAMETER_SHAPES_KEY) or model_states.get("param_shapes")
    if shapes is None:
        raise ValueError(
            f"{model_file} does not name its optimizer's parameters: expected {PARAMETER_SHAPES_KEY} (recorded "
            f"since poplar-ext resumes under another plan), found none; resume this checkpoint under its plan (in "
            f"{source.parent / 'poplar_state.json'})"
        )
    if not zero_stage:
        states = _zero0_states(model_states, shapes, optimizer_name=optimizer_name, path=model_file)
        return states, shapes, model_states["optimizer"][PARAM_GROUPS], {}
    zero_file = _zero_file(source, stage)
    saved = torch.load(zero_file, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
    states = _zero1_states(saved, shapes, optimizer_name=optimizer_name, path=zero_file)
    sharded = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)  # as DeepSpeed's
    own = {key: value for key, value in saved.items() if key not in sharded}
    return states, shapes, saved[BASE_OPTIMIZER_STATE][PARAM_GROUPS], own


def _convert(tag_dir: Path, work: Path, *, num_stages: int, zero_stage: int, optimizer_name: str) -> None:
    from deepspeed.checkpoint.constants import PARAM_GROUPS

    groups: list[dict] = []
    shapes_per_group: list[dict] = []
    zero_state: dict = {}
    for stage in range(num_stages):
        states, shapes, param_groups, own = _stage_states(
            tag_dir / "pipeline0", stage, zero_stage=zero_stage, optimizer_name=optimizer_name
        )
        zero_state = zero_state or own
        for index, (named, group) in enumerate(zip(shapes, param_groups)):
            if index == len(groups):  # the hyper-parameters are every stage's: stage 0's kept
                groups.append({key: value for key, value in group.items() if key != "params"})
                shapes_per_group.append({})
            shapes_per_group[index].update({name: list(shape) for name, shape in named.items()})
        for name, parameter_states in states.items():
            if not (work / "zero" / name).is_dir():  # a tied module: held (and equal) on several stages
                _write_parameter(work / "zero" / name, parameter_states)
    (work / "zero").mkdir(parents=True, exist_ok=True)
    torch.save(
        {**zero_state, PARAM_GROUPS: groups, PARAMETER_SHAPES_KEY: shapes_per_group},
        work / "zero" / "optimizer_state.pt",
    )


def load_parameter_states(optimizer: torch.optim.Optimizer, folder: str | Path, *, names: Mapping[Any, str]) -> None:
    """ZeRO 0: `optimizer`'s state from the per-parameter files of `folder` (``TAG/universal``), by the
    optimizer's own ``load_state_dict``; `names`: each parameter's name (DeepSpeed's ``param_names``)."""
    from deepspeed.checkpoint.constants import PARAM, PARAM_GROUPS

    zero = Path(folder) / "zero"
    saved_groups = torch.load(zero / "optimizer_state.pt", weights_only=False)[PARAM_GROUPS]
    state: dict[int, dict] = {}
    groups: list[dict] = []
    for group, saved in zip(optimizer.param_groups, saved_groups):
        indices = list(range(len(state), len(state) + len(group["params"])))
        groups.append({**saved, "params": indices})
        for index, parameter in zip(indices, group["params"]):
            files = sorted((zero / names[parameter]).glob("*.pt"))
            loaded = {path.stem: torch.load(path, weights_only=False) for path in files if path.stem != "fp32"}
            state[index] = {key: value[PARAM] if isinstance(value, dict) else value for key, value in loaded.items()}
    optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s}, PARAM_GROUPS: groups})
