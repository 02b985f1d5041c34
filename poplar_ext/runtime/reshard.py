"""A ZeRO checkpoint resharded for another number of ranks, for any optimizer whose state is per-parameter.

By hand: ``python -m poplar_ext.runtime.reshard --input_folder TAG_DIR --output_folder TAG_DIR_universal``
(docs/deepspeed-notes.md, universal checkpoints).
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from poplar_ext.plan.formats import listed
from poplar_ext.runtime.checkpoint import UNIVERSAL_SUFFIX, check_rank_files, read_state
from poplar_ext.search.cli_common import EXIT_BAD_INPUT, EXIT_OK, CommandParser, printing

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SCALAR_STATES = ("step",)
"""State keys carried as one value per parameter group (DeepSpeed's ``step.pt``)."""

UNNAMED_OPTIMIZER = "the checkpoint's optimizer"
"""What messages call the optimizer when the caller does not know its class."""


def carried_states(
    state: dict[Any, Any],
    *,
    partition_numel: int,
    optimizer_name: str,
    saved_ranks: int,
    padding_numel: int = 0,
    refusal: str | None = None,
) -> dict[str, Any]:
    """The states of one flat partition (one parameter group of one rank) that are carried over (None skipped).

    `padding_numel`: the group's alignment padding, which DeepSpeed strips from the saved fp32 partition
    (`partition_numel`) but not from the optimizer's states (at stages 1-2 the last rank's states are longer by
    it; the padding is never read). ValueError, naming the optimizer and the key, for
    a state that is neither a tensor of `partition_numel` (+ padding) elements nor a scalar `step`, or whose
    key is no plain name or ``fp32`` (keys become file names beside ``fp32.pt``). `refusal` ends the message
    (default: it cannot be resharded; resume on `saved_ranks` ranks).
    """
    import torch

    default = f"resharded for another number of ranks; resume this checkpoint on {saved_ranks} ranks, as it was saved"
    carried = {}
    for key, value in state.items():
        if value is None:
            continue
        if key in SCALAR_STATES:
            fits = isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1)
        else:
            fits = (
                torch.is_tensor(value)
                and value.dim() == 1
                and value.numel() in (partition_numel, partition_numel + padding_numel)
            )
        if not isinstance(key, str) or not key.isidentifier() or key == "fp32" or not fits:
            kept = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else f"a {type(value).__name__}"
            raise ValueError(
                f"{optimizer_name} keeps the state {key!r} as {kept}: only states of one value per "
                f"element of the parameters (a flat partition of {partition_numel} elements here) and a scalar "
                f"'step' can be {refusal or default}"
            )
        carried[key] = value
    return carried


def partition_states(
    shard: dict, *, optimizer_name: str, saved_ranks: int, refusal: str | None = None
) -> list[dict[str, Any]]:
    """Per group of one rank's ZeRO 1-2 optimizer state: its fp32 partition (``fp32``) and the states carried."""
    from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, GROUP_PADDINGS, SINGLE_PARTITION_OF_FP32_GROUPS

    states = shard[BASE_OPTIMIZER_STATE]["state"]
    return [
        _flat_group(
            fp32,
            states.get(group_id, {}),  # none before the first optimizer step
            optimizer_name=optimizer_name,
            saved_ranks=saved_ranks,
            padding_numel=shard[GROUP_PADDINGS][group_id],
            refusal=refusal,
        )
        for group_id, fp32 in enumerate(shard[SINGLE_PARTITION_OF_FP32_GROUPS])
    ]


def _flat_group(fp32: torch.Tensor, states: dict[Any, Any], **carried_options: Any) -> dict[str, Any]:
    """One flat partition's fp32 copy (``fp32``) and its states that `carried_states` carries (its options)."""
    return {"fp32": fp32, **carried_states(states, partition_numel=fp32.numel(), **carried_options)}


def write_whole(target: Path, write: Callable[[Path], None]) -> None:
    """`write(work)` into a folder beside `target`, renamed to it once done: a write that stopped half-way is
    never taken for one that finished."""
    work = target.with_name(target.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)  # what a write that died left
    try:
        write(work)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def convert_checkpoint(source: str | Path, target: str | Path, *, optimizer_name: str = UNNAMED_OPTIMIZER) -> Path:
    """Write the ZeRO checkpoint `source` (a tag folder) in DeepSpeed's universal format at `target`, whole or
    not at all (`write_whole`), with every state `carried_states` accepts (ValueError otherwise). Returns `target`.
    """
    source, target = Path(source), Path(target)
    if target.exists():
        raise ValueError(f"{target} exists already: remove it, or load it as it is")
    if not source.is_dir():
        found = "a file" if source.exists() else "no such folder"
        raise ValueError(f"{source}: expected a checkpoint's tag folder, found {found}")
    tags = sorted((p.name for p in source.iterdir() if p.is_dir() and any(p.glob("*_states.pt"))), key=_natural)
    latest = (source / "latest").read_text().strip() if (source / "latest").is_file() else None
    if latest or tags:
        # The save_dir a training job writes into, one level above the tags: its own optimizer files are none.
        example = source / (latest or tags[-1])
        raise ValueError(
            f"{source}: expected a checkpoint's tag folder, found the folder holding the tags ({listed(tags)}"
            f"{f'; latest: {latest}' if latest else ''}); pass one of them, e.g. {example}"
        )

    # A rank's file missing: DeepSpeed's converter would take the files there for a checkpoint of fewer ranks.
    check_rank_files(
        source.parent, source.name, read_state(source.parent, source.name), reads_optimizer=True, caller=""
    )

    def convert(work: Path) -> None:
        stage = _zero_stage(source)
        (_convert_stage_3 if stage == 3 else _convert_stage_1_2)(
            source, work, fragments=work / "fragments", optimizer_name=optimizer_name
        )
        shutil.rmtree(work / "fragments")

    write_whole(target, convert)
    return target


def _natural(name: str) -> list:
    """``global_step9`` before ``global_step10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _zero_stage(source: Path) -> int:
    from deepspeed.checkpoint.ds_to_universal import _get_optim_files, _get_zero_stage

    try:
        files = _get_optim_files(str(source))
    except FileNotFoundError:
        raise ValueError(f"{source} holds no ZeRO optimizer state (ZeRO stages 1-3): nothing to reshard") from None
    return _get_zero_stage(files)


def _data_parallel_only(source: Path, *, tensor_parallel: int, pipeline_parallel: int) -> None:
    if (tensor_parallel, pipeline_parallel) != (1, 1):
        raise ValueError(
            f"{source} was saved with tensor parallelism {tensor_parallel} and pipeline parallelism "
            f"{pipeline_parallel}; poplar-ext reshards data-parallel checkpoints only"
        )


def _convert_stage_1_2(source: Path, work: Path, *, fragments: Path, optimizer_name: str) -> None:
    """Stages 1-2: every rank's flat partition per group, cut into parameters by its slice mappings."""
    import torch
    from deepspeed.checkpoint import DeepSpeedCheckpoint
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARAM_SHAPES, PARAM_SLICE_MAPPINGS
    from deepspeed.checkpoint.ds_to_universal import _save_optimizer_state, dump_param_fragment

    checkpoint = DeepSpeedCheckpoint(str(source))
    _data_parallel_only(source, tensor_parallel=checkpoint.tp_degree, pipeline_parallel=checkpoint.pp_degree)
    for dp_index in range(checkpoint.dp_degree):
        # Paddings kept: DeepSpeed's stripping narrows every tensor state, also one it cannot be.
        shard = checkpoint.get_zero_checkpoint_state(0, 0, dp_index, strip_tensor_paddings=False)[OPTIMIZER_STATE_DICT]
        groups = partition_states(shard, optimizer_name=optimizer_name, saved_ranks=checkpoint.dp_degree)
        for group_id, flat in enumerate(groups):
            for name, fragment in shard[PARAM_SLICE_MAPPINGS][group_id].items():
                for key, value in flat.items():
                    dump_param_fragment(str(fragments), 0, dp_index, key, value, name, fragment.start, fragment.numel)
    model_state = torch.load(checkpoint.mp_rank_files[0], map_location="cpu", weights_only=False)
    shapes = {name: shape for group in model_state[PARAM_SHAPES] for name, shape in group.items()}
    _merge_fragments(fragments, work / "zero", shapes)
    _save_optimizer_state(argparse.Namespace(output_folder=str(work)), checkpoint)
    for path in checkpoint.mp_rank_files:
        shutil.copy2(path, work)


def _convert_stage_3(source: Path, work: Path, *, fragments: Path, optimizer_name: str) -> None:
    """Stage 3: every rank's flat partition per sub-group, each parameter's padded share in turn."""
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT
    from deepspeed.checkpoint.ds_to_universal import (
        _build_zero3_rank_grid,
        _filter_zero3_optim_files,
        _get_optim_files,
        _get_zero3_model_state_files,
        _parse_model_states_stage3,
        _save_optimizer_state_stage3,
        _zero_partitioned_param_info,
        dump_param_fragment,
    )

    optim_files = _filter_zero3_optim_files(_get_optim_files(str(source)))
    grid, tensor_parallel, dp_degree = _build_zero3_rank_grid(optim_files)
    _data_parallel_only(source, tensor_parallel=tensor_parallel, pipeline_parallel=1)
    model_files = _get_zero3_model_state_files(str(source))
    shapes_per_group = _parse_model_states_stage3(model_files)
    for dp_index, path in enumerate(grid[0]):
        shard = torch.load(path, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
        states = shard[OPTIMIZER_STATE_DICT]["state"]
        for group_id, shapes in enumerate(shapes_per_group):
            fp32 = shard["fp32_flat_groups"][group_id]
            flat = _flat_group(fp32, states.get(group_id, {}), optimizer_name=optimizer_name, saved_ranks=dp_degree)
            offset = 0
            for name, shape in shapes.items():
                partitioned_numel, _ = _zero_partitioned_param_info(shape.numel(), dp_degree)
                kept_numel = max(0, min(partitioned_numel, shape.numel() - dp_index * partitioned_numel))
                for key, value in flat.items():
                    dump_param_fragment(str(fragments), 0, dp_index, key, value, name, offset, kept_numel)
                offset += partitioned_numel
    _merge_fragments(fragments, work / "zero", {n: s for group in shapes_per_group for n, s in group.items()})
    _save_optimizer_state_stage3(argparse.Namespace(output_folder=str(work)), optim_files)
    for path in model_files:
        shutil.copy2(path, work)


def _merge_fragments(fragments: Path, zero_dir: Path, shapes: dict[str, torch.Size]) -> None:
    """Each parameter's fragments, in rank order, as DeepSpeed's ``zero/<param>/<key>.pt``."""
    import torch
    from deepspeed.checkpoint.constants import CAT_DIM, PARAM
    from deepspeed.checkpoint.ds_to_universal import _merge_zero_shards

    for name, shape in shapes.items():
        pieces = fragments / name
        assert (pieces / "0").is_dir(), f"no rank held a fragment of {name}"
        keys = sorted({path.name.rsplit(".", 1)[0] for path in (pieces / "0").iterdir()})
        (zero_dir / name).mkdir(parents=True)
        for key in keys:
            if key in SCALAR_STATES:
                value = _merge_zero_shards(str(pieces), key, 1)[0]  # the same on every rank (checked there)
            else:
                value = {PARAM: _merge_zero_shards(str(pieces), key, 1, [shape])[0], CAT_DIM: 0}
            torch.save(value, zero_dir / name / f"{key}.pt")


@contextmanager
def loading_every_state(zero_optimizer: Any) -> Iterator[None]:
    """While DeepSpeed loads a universal checkpoint: at stage 3, `load_stage3_checkpoint` is this optimizer's
    loader (an instance attribute shadowing DeepSpeed's method); at stages 1-2 (and bf16's optimizer),
    `load_flat_checkpoint`, for a rank whose partition of a parameter group holds no parameter."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(zero_optimizer, DeepSpeedZeroOptimizer_Stage3):
        if not hasattr(zero_optimizer, "load_hp_checkpoint_state_from_checkpoint_dir"):
            yield
            return
        zero_optimizer.load_hp_checkpoint_state_from_checkpoint_dir = lambda groups, checkpoint_dir: (
            load_flat_checkpoint(zero_optimizer, groups, checkpoint_dir)
        )
        try:
            yield
        finally:
            del zero_optimizer.load_hp_checkpoint_state_from_checkpoint_dir
        return
    if zero_optimizer.swap_optimizer:
        raise ValueError(
            "load_checkpoint: a ZeRO-3 optimizer swapped to NVMe cannot load a checkpoint resharded for another "
            "number of ranks; resume it on the number of ranks it was saved on"
        )
    zero_optimizer.load_hp_checkpoint_state_from_checkpoint_dir_stage3 = lambda checkpoint_dir: load_stage3_checkpoint(
        zero_optimizer, checkpoint_dir
    )
    try:
        yield
    finally:
        del zero_optimizer.load_hp_checkpoint_state_from_checkpoint_dir_stage3


def load_flat_checkpoint(zero_optimizer: Any, lp_groups_name: str, checkpoint_dir: str) -> None:
    """DeepSpeed 0.19.8's universal loader of a flat-partition optimizer (ZeRO 1-2, bf16's;
    `ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir`), also on a rank whose partition of a parameter
    group holds only alignment padding (a group of a few elements over many ranks: ``Linear(1, 1)`` on 3 ranks),
    where DeepSpeed's reads the first of no steps (IndexError). Such a partition gets the state the other ranks'
    hold, at zero: each of the group's keys, and its ``step``, as the rank had before the save."""
    import torch
    from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    zero_dir = Path(checkpoint_dir) / "zero"
    saved = torch.load(zero_dir / "optimizer_state.pt", weights_only=False)
    zero_optimizer._load_global_state(saved)
    mpu = zero_optimizer.mpu
    tp_rank = bwc_tensor_model_parallel_rank(mpu=mpu)
    if mpu is None:
        tp_world_size = 1
    elif hasattr(mpu, "get_slice_parallel_world_size"):
        tp_world_size = mpu.get_slice_parallel_world_size()
    else:
        tp_world_size = mpu.get_tensor_model_parallel_world_size()
    ep_rank, ep_size = _get_universal_checkpoint_ep_info()
    lp_groups = getattr(zero_optimizer, lp_groups_name)
    state = zero_optimizer.optimizer.state
    for group_id, (group, saved_group) in enumerate(zip(zero_optimizer.optimizer.param_groups, saved["param_groups"])):
        flat = group["params"][0]
        keys, steps = set(), []
        for lp in lp_groups[group_id]:
            if lp._hp_mapping is not None:
                folder = zero_dir / zero_optimizer.param_names[lp]
                steps.append(
                    lp.load_hp_checkpoint_state(str(folder), tp_rank, tp_world_size, ep_rank=ep_rank, ep_size=ep_size)
                )
                keys.update(lp._hp_mapping.get_optim_state_keys())
        if steps:
            assert all(step == steps[0] for step in steps), f"Steps {steps} are not equal"
            if steps[0] is not None:
                state[flat]["step"] = steps[0]
            map_to_flat_opt_states(flat, lp_groups[group_id], state, keys)
        elif lp_groups[group_id]:  # padding alone here: the group's keys at zero, its step
            folder = zero_dir / zero_optimizer.param_names[lp_groups[group_id][0]]
            for key in sorted({path.stem for path in folder.glob("*.pt")} - {"fp32"}):
                if key in SCALAR_STATES:
                    state[flat][key] = torch.load(folder / f"{key}.pt", weights_only=False)
                else:
                    state[flat][key] = torch.zeros_like(flat)
        group.update({name: value for name, value in saved_group.items() if name != "params"})


def load_stage3_checkpoint(zero_optimizer: Any, checkpoint_dir: str) -> None:
    """DeepSpeed's stage-3 universal loader, for every state in the checkpoint rather than Adam's: the weights
    DeepSpeed's (from the fp32 copies), each state cut to this rank by its `load_hp_checkpoint_state`, the
    hyper-parameters the checkpoint's."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_GROUPS

    zero_dir = Path(checkpoint_dir) / "zero"
    saved = torch.load(zero_dir / "optimizer_state.pt", map_location="cpu", weights_only=False)
    zero_optimizer._load_global_state_stage3(saved)
    zero_optimizer.load_module_checkpoint_state_from_checkpoint_dir_stage3(checkpoint_dir, load_from_fp32_weights=True)
    state = zero_optimizer.optimizer.state
    for group_id, params in enumerate(zero_optimizer.fp16_groups):
        flat = zero_optimizer.fp32_partitioned_groups_flat[group_id]
        folders = [zero_dir / zero_optimizer.param_names[param] for param in params]
        keys = {path.stem for path in folders[0].glob("*.pt")} - {"fp32"}
        assert all({path.stem for path in folder.glob("*.pt")} - {"fp32"} == keys for folder in folders), folders
        for key in sorted(keys):
            if key in SCALAR_STATES:
                state[flat][key] = torch.load(folders[0] / f"{key}.pt", weights_only=False)
            else:
                state[flat][key] = _stage3_partition(zero_optimizer, folders, params, key, like=flat)
    for group, saved_group in zip(zero_optimizer.optimizer.param_groups, saved[PARAM_GROUPS]):
        group.update({name: value for name, value in saved_group.items() if name != "params"})


def _stage3_partition(
    zero_optimizer: Any, folders: Sequence[Path], params: Sequence[Any], key: str, *, like: torch.Tensor
) -> torch.Tensor:
    """This rank's flat sub-group partition of state `key`: each parameter's share, in order."""
    import torch

    partition = torch.zeros_like(like)
    offset = 0
    for folder, param in zip(folders, params):
        share = zero_optimizer.load_hp_checkpoint_state(str(folder), key, param=param)
        partition.narrow(0, offset, share.numel()).copy_(share)
        offset += share.numel()
    return partition


def resharded_tag(
    load_dir: str | Path, tag: str, *, deepspeed_engine: Any, rank: int, caller: str = "load_checkpoint"
) -> str:
    """The tag of checkpoint `tag` resharded for any number of ranks (collective): rank 0 writes ``TAG_universal``
    beside it unless there. A state that cannot be resharded, or a folder some rank cannot see, is a ValueError
    naming `caller` on every rank, before any weight is loaded."""
    from poplar_ext.collectives import decided_by_rank0, gather_objects

    source, universal = Path(load_dir) / tag, f"{tag}{UNIVERSAL_SUFFIX}"
    target = Path(load_dir) / universal
    zero_optimizer = deepspeed_engine.optimizer
    optimizer_name = type(getattr(zero_optimizer, "optimizer", zero_optimizer)).__name__

    def convert() -> bool:
        if not target.is_dir():
            logger.info("%s: %s was saved on another number of ranks; resharding it: %s", caller, source, target)
            convert_checkpoint(source, target, optimizer_name=optimizer_name)
        return True

    try:
        decided_by_rank0(convert, rank=rank)
    except ValueError as exc:
        raise ValueError(f"{caller}: {source} was saved on another number of ranks, and {exc}") from exc
    missing = [r for r, seen in enumerate(gather_objects(target.is_dir())) if not seen]
    if missing:
        raise ValueError(
            f"{caller}: the resharded checkpoint {target} is not visible on ranks {missing}: copy it to "
            f"their nodes (or write it there, on a node that has {source}: {command_line(source, target)}), "
            f"then start again"
        )
    return universal


@contextmanager
def loading_resharded(deepspeed_engine: Any) -> Iterator[None]:
    """While `deepspeed_engine` loads a checkpoint of `resharded_tag`: DeepSpeed's config says to load a universal
    checkpoint (fixed when the engine is built; a resume decides it now), and at stage 3, where DeepSpeed's loader
    reads Adam's states only, `loading_every_state` puts ours in its place."""
    config = deepspeed_engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        with loading_every_state(deepspeed_engine.optimizer):
            yield
    finally:
        config.load_universal_checkpoint = before


@contextmanager
def merging_weights_of(tag: str, deepspeed_engine: Any) -> Iterator[None]:
    """While a ZeRO-3 engine loads checkpoint `tag`'s weights alone (``load_optimizer_states=False``).

    DeepSpeed merges them from every rank's partition (`get_fp32_state_dict_from_zero_checkpoint`), but of the
    tag ``latest`` names, not the one it loads (runtime/engine.py `_load_checkpoint`: another save's weights, or a
    ValueError without ``latest``): meanwhile the merge reads `tag`. Each rank reads its own model file for the
    rest (step counts, buffers: alike in every rank's), which a rank beyond the saved
    number lacks (DeepSpeed's bare assert): meanwhile every rank reads rank 0's, as the universal load does.
    """
    import functools
    import glob

    from deepspeed.runtime import engine as deepspeed_engine_module

    def rank0_model_file(checkpoints_path: str, tag: str) -> list[str]:
        pattern = deepspeed_engine._get_ckpt_name(checkpoints_path, tag, mp_placeholder="*", pp_placeholder="0")
        return sorted(glob.glob(pattern))

    merge = deepspeed_engine_module.get_fp32_state_dict_from_zero_checkpoint
    deepspeed_engine_module.get_fp32_state_dict_from_zero_checkpoint = functools.partial(merge, tag=tag)
    deepspeed_engine._get_all_ckpt_names = rank0_model_file  # this instance's, shadowing the method
    try:
        yield
    finally:
        deepspeed_engine_module.get_fp32_state_dict_from_zero_checkpoint = merge
        del deepspeed_engine._get_all_ckpt_names


def command_line(source: str | Path, target: str | Path) -> str:
    """The command that writes `target` from `source` (what messages suggest)."""
    return f"python -m poplar_ext.runtime.reshard --input_folder {source} --output_folder {target}"


PROG = "python -m poplar_ext.runtime.reshard"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or CommandParser(
        prog=PROG,
        description="Write a ZeRO checkpoint (stages 1-3) in DeepSpeed's universal format with every optimizer "
        "state, for a resume on another number of ranks.",
    )
    parser.add_argument("--input_folder", required=True, help="the checkpoint's tag folder (e.g. ckpt/global_step100)")
    parser.add_argument(
        "--output_folder", required=True, help="where to write it; load_checkpoint looks for TAG_universal beside TAG"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; its exit status (stdout's failures as every CLI's: `printing`)."""
    return printing(PROG, _convert, build_parser().parse_args(argv))


def _convert(args: argparse.Namespace) -> int:
    try:
        target = convert_checkpoint(args.input_folder, args.output_folder)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {target}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "carried_states",
    "command_line",
    "convert_checkpoint",
    "load_flat_checkpoint",
    "load_stage3_checkpoint",
    "loading_every_state",
    "loading_resharded",
    "main",
    "resharded_tag",
]
