"""poplar-ext's state in a DeepSpeed checkpoint, saves whole or not at all, resumes (docs/training.md)."""

from __future__ import annotations

import logging
import shutil
import uuid
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import Plan, listed, plan_to_dict, read_json, write_json_atomic, write_text_atomic
from poplar_ext.plan.pipeline_formats import PipelinePlan, pipeline_plan_to_dict, plan_parallelism
from poplar_ext.plan.validation import Node

STATE_FILE = "poplar_state.json"
"""poplar-ext's state, in a checkpoint's tag folder."""

UNIVERSAL_SUFFIX = "_universal"
"""``TAG_universal``: checkpoint TAG resharded for another number of ranks, beside it (`poplar_ext.runtime.reshard`)."""

SAVING_SUFFIX = ".saving"
"""``TAG.saving``: a save into TAG while its ranks write it, beside it (`save_whole`)."""
REPLACED_SUFFIX = ".replaced"
"""``TAG.replaced``: the checkpoint a save replaces, between the two renames that swap it out (`save_whole`)."""

CLIENT_STATE_KEY = "poplar"
"""Where checkpoints of poplar-ext 0.1 kept the state, in DeepSpeed's client_state (still read)."""

logger = logging.getLogger(__name__)


def plan_as_dict(plan: Plan | PipelinePlan) -> dict[str, Any]:
    """A ZeRO plan's or a pipeline plan's JSON (the history and the state file hold either)."""
    return pipeline_plan_to_dict(plan) if isinstance(plan, PipelinePlan) else plan_to_dict(plan)


def _allocation(plan_dict: dict) -> dict:
    """The part of a plan that decides which samples each rank sees and how gradients add."""
    return {
        "zero_stage": plan_dict["zero_stage"],
        "global_batch_size": plan_dict["global_batch_size"],
        "ranks": [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in plan_dict["ranks"]],
    }


def history_entry(
    plan: Plan | PipelinePlan, *, start_step: int, data_position: int, reason: str, switched: bool = False
) -> dict[str, Any]:
    """One plan of the history: from which optimizer step and stream position it ran, and why; `switched`: it
    replaced another during the run (re-balancing), not one the job started or resumed with."""
    entry = {"start_step": start_step, "data_position": data_position, "reason": reason, "plan": plan_as_dict(plan)}
    if switched:
        entry["switched"] = True
    return entry


def poplar_client_state(
    plan: Plan | PipelinePlan,
    *,
    consumed_samples: int,
    seed: int,
    shuffle: bool,
    drop_last: bool = False,
    data_position: int | None = None,
    plan_history: list[dict] | None = None,
) -> dict:
    """What poplar-ext stores in a checkpoint: the plan, the history, where the data stream stands."""
    return {
        "plan": plan_as_dict(plan),
        "consumed_samples": consumed_samples,
        "data_position": consumed_samples if data_position is None else data_position,
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": drop_last,
        "plan_history": list(plan_history or []),
    }


def checkpoint_tag(load_dir: str | Path, tag: Any) -> str | None:
    """`tag`, or the one DeepSpeed's ``latest`` file names (None when there is none); ValueError for the name of
    a folder `save_whole` writes beside a tag (`check_tag_name`)."""
    latest = Path(load_dir) / "latest"
    if tag is None and not latest.is_file():
        return None
    resolved = str(tag) if tag is not None else latest.read_text().strip()
    check_tag_name(resolved, caller="load_checkpoint", named=f"{latest} names tag" if tag is None else "tag")
    return resolved


def check_tag_name(tag: str, *, caller: str, named: str = "tag") -> None:
    """ValueError for a tag ending like a folder `save_whole` writes beside tag T: ``T.saving`` (a save not yet whole,
    or one that failed) and ``T.replaced`` are no checkpoints of their own; a save into T removes them."""
    for suffix in (SAVING_SUFFIX, REPLACED_SUFFIX):
        if tag.endswith(suffix):
            raise ValueError(
                f"{caller}: {named} {tag!r}: expected a tag not ending in {suffix!r}, found one: the name of the "
                f"folder poplar-ext writes beside tag {tag[: -len(suffix)]!r} while a save replaces it, never a "
                "whole checkpoint of its own"
            )


def write_state(save_dir: str | Path, tag: str, state: dict) -> Path:
    """Write the state file into the tag folder (rank 0's job); returns its path."""
    path = Path(save_dir) / tag / STATE_FILE
    write_json_atomic(state, path)
    return path


def save_whole(
    save_dir: str | Path,
    tag: Any,
    save: Callable[[str], Any],
    *,
    deepspeed_engine: Any,
    state: Callable[[], dict],
    save_latest: bool,
) -> Any:
    """Save checkpoint `tag` whole or not at all (collective): `save` (every rank's DeepSpeed save into tag
    ``TAG.saving``) writes that folder; once every rank has, the first rank of each storage (rank 0, or each node's
    on DeepSpeed's node-local storage) writes `state` there with the save's id, and once every storage has, removes
    ``TAG_universal``, puts the new folder in TAG's place and names it in ``latest``. Returns `save`'s. On
    node-local storage the storages first agree on the save under TAG (`agree_storages`): one whole only beside
    TAG on some node is swapped in before this save empties ``TAG.saving``.

    Why a new folder: a save in place would keep files of an earlier save there (other ranks' shards, another
    dtype's or ZeRO stage's files), which a load may read as this save's, and a save failing on some rank would
    mix old and new. DeepSpeed writes ``latest`` right after its own rank's files: a node lost meanwhile would
    leave it naming a checkpoint without that node's part.
    """
    from poplar_ext.collectives import gather_objects, raise_if_any_failed

    engine = deepspeed_engine
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"  # DeepSpeed's default
    folder = Path(save_dir) / tag
    check_pattern_safe(folder, caller="save_checkpoint")  # every rank passes the same folder: all refuse alike
    check_tag_name(tag, caller="save_checkpoint")
    new_tag = tag + SAVING_SUFFIX
    storage_rank = _storage_rank(engine)
    if engine.use_node_local_storage():
        # The save every node holds may be whole only in some node's TAG.saving (a save that failed after other
        # nodes swapped it in) or TAG.replaced: swapped in before this save empties TAG.saving.
        # Without the refusal: this save replaces whatever the storages hold.
        _settle_tag(
            save_dir, tag, storage_rank=storage_rank, rank=engine.global_rank, caller="save_checkpoint", refuse=False
        )
    if storage_rank == 0:  # what a save that failed left; its state file first, so no part of it reads as whole
        with suppress(OSError):  # one that stays (not a folder, read-only) fails DeepSpeed's writes, on every rank
            (Path(save_dir) / new_tag / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(Path(save_dir) / new_tag, ignore_errors=True)
    node_local, token = engine.use_node_local_storage(), uuid.uuid4().hex
    marker = _mark_storage(save_dir, token, rank=engine.global_rank) if node_local and storage_rank == 0 else None
    # Rank 0's id for this save, on every storage: a load tells two saves apart by it (`agree_storages`). The
    # gather also waits for every rank: none writes into the new folder before it is empty.
    gathered = gather_objects((token if engine.global_rank == 0 else None, marker and marker.name))
    save_id = gathered[0][0]
    if node_local:
        try:
            _refuse_shared_storage(save_dir, marker, [name for _, name in gathered], rank=engine.global_rank)
        finally:
            if marker is not None:
                marker.unlink(missing_ok=True)
    with _writes_failing_at_the_end(engine) as write_failures:
        saved = save(new_tag)
        writer = getattr(engine, "checkpoint_engine", None)
        if writer is not None and writer.is_decoupled():
            # An asynchronous writer (checkpoint.writer.decoupled, DataStates) writes at the next step's commit,
            # when the folder it writes into would be gone: its files are written here, before the swap.
            engine._commit_decoupled_checkpoint()
    # every rank's files written: the new checkpoint is whole; or every rank fails with the one that could not
    raise_if_any_failed(write_failures[0] if write_failures else None, rank=engine.global_rank)
    for step in (
        lambda: write_state(save_dir, new_tag, {**state(), "save_id": save_id}),
        lambda: _swap_in(save_dir, tag, save_latest=save_latest),
    ):
        failure = None
        if storage_rank == 0:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - raised on every rank, below
                failure = exc
        # First: every storage holds the new save whole (its state file) before any replaces TAG with it, so a
        # node stopping from then on leaves it on every node, which a load swaps in everywhere (`agree_storages`).
        # Then: the checkpoint in its place before any rank reads it. Either fails on every rank with the storage
        # rank that could not (disk full).
        raise_if_any_failed(failure, rank=engine.global_rank)
    return saved


def _mark_storage(save_dir: str | Path, token: str, *, rank: int) -> Path | None:
    """A file naming this save and rank in `save_dir`, for `_refuse_shared_storage` (None where it cannot be
    written: the save's own writes then fail with the reason)."""
    marker = Path(save_dir) / f".poplar-storage-rank{rank}-{token}"
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        return None
    return marker


def _refuse_shared_storage(save_dir: str | Path, own: Path | None, markers: list[str | None], *, rank: int) -> None:
    """On node-local storage, a ValueError on every rank (collective) where a storage rank sees another node's
    marker of this save (`markers`: every rank's, by rank): its nodes share `save_dir`. Without the refusal every
    node's first rank renames the same folders and the save fails with a rename error on every rank."""
    from poplar_ext.collectives import raise_if_any_failed

    seen = []
    if own is not None:
        others = [r for r, name in enumerate(markers) if name and name != own.name]
        with suppress(OSError):  # a folder it cannot look into: not known to be shared (every rank must agree below)
            seen = [r for r in others if (Path(save_dir) / str(markers[r])).exists()]
    failure = None
    if seen:
        failure = ValueError(
            f"save_checkpoint: {save_dir} is one storage for several nodes: rank {rank} sees the file that rank "
            f"{seen[0]} wrote there, both first ranks of a node (LOCAL_RANK 0), but DeepSpeed's "
            "checkpoint.use_node_local_storage is true, which has each node's first rank write the files rank 0 "
            "writes; set it false for shared storage, or give each node a folder of its own (or, where both run on "
            "one machine, have the launcher set each process's LOCAL_RANK)"
        )
    raise_if_any_failed(failure, rank=rank)


@contextmanager
def _writes_failing_at_the_end(engine: Any) -> Iterator[list[Exception]]:
    """Inside: a file DeepSpeed's checkpoint engine fails to write is a failure in the list yielded (the rank
    writes no more), not an exception: DeepSpeed's save ends in a barrier, which a rank raising from a write never
    reaches, and the others would wait there until the group's timeout (NCCL's: 30 minutes). A save failing
    otherwise still raises at once."""
    failures: list[Exception] = []
    writer = getattr(engine, "checkpoint_engine", None)
    if writer is None:
        yield failures
        return
    write = writer.save

    def write_or_note(state_dict: Any, path: str) -> Any:
        if failures:
            return None
        try:
            return write(state_dict, path)
        except Exception as exc:  # noqa: BLE001 - raised after DeepSpeed's save, on every rank
            failures.append(exc)
            return None

    writer.save = write_or_note  # this instance's, shadowing the method while DeepSpeed saves
    try:
        yield failures
    finally:
        del writer.save


def _tag_folders(checkpoint_dir: str | Path, tag: str) -> tuple[Path, Path, Path]:
    """TAG's folder and the two `save_whole` writes beside it: ``TAG.saving`` and ``TAG.replaced``."""
    return tuple(Path(checkpoint_dir) / f"{tag}{suffix}" for suffix in ("", SAVING_SUFFIX, REPLACED_SUFFIX))


def _swap_in(save_dir: str | Path, tag: str, *, save_latest: bool) -> None:
    """The storage rank's part of `save_whole` once ``TAG.saving`` is whole on every storage."""
    folder, new, old = _tag_folders(save_dir, tag)
    _remove(Path(save_dir) / f"{tag}{UNIVERSAL_SUFFIX}")
    if folder.exists():  # else TAG.replaced, if there, is the last whole checkpoint: kept until TAG is again
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        write_text_atomic(tag, Path(save_dir) / "latest")


def _remove(folder: Path) -> None:
    """`folder` removed, renamed aside first: a removal that stops leaves no part of it under its name (a load
    would take a part of ``TAG_universal`` for the whole; `resharded_tag` looks only for the folder)."""
    aside = folder.with_name(folder.name + REPLACED_SUFFIX)
    shutil.rmtree(aside, ignore_errors=True)
    if folder.exists():
        folder.rename(aside)
    shutil.rmtree(aside, ignore_errors=True)


def unfinished_save(folder: Path) -> Path | None:
    """What checkpoint folder `folder` lacks where a `save_whole` into it did not finish (a ``TAG.saving`` in it):
    ``latest``, or the state file of the tag it names; None otherwise."""
    if not any(folder.glob(f"*{SAVING_SUFFIX}")):
        return None
    tag = checkpoint_tag(folder, None)
    if tag is None:
        return folder / "latest"
    return None if (folder / tag / STATE_FILE).is_file() else folder / tag / STATE_FILE


def refresh_master_weights(optimizer: Any, load_options: dict[str, Any]) -> None:
    """After DeepSpeed loaded a checkpoint without the optimizer state (`load_options`): the bf16/fp16 optimizer's
    fp32 master copy made the loaded weights. DeepSpeed 0.19.8 loads none at ZeRO 0 (FP16_(Unfused)Optimizer, a
    pipeline's BF16_Optimizer), where the first step would copy the pre-load weights back into the model (ZeRO 1-3
    and load_module_only restore it already)."""
    if not load_options.get("load_optimizer_states", True) and hasattr(optimizer, "refresh_fp32_params"):
        optimizer.refresh_fp32_params()


def _storage_rank(engine: Any) -> int:
    """This rank's number among those writing one storage, as DeepSpeed numbers them for its saves."""
    return engine.local_rank if engine.use_node_local_storage() else engine.global_rank


def tag_for_load(load_dir: str | Path, tag: Any, *, deepspeed_engine: Any, rank: int) -> str | None:
    """The tag a load reads, rank 0's `checkpoint_tag` (collective); a tag folder a stopped save left missing is
    put back first (`restore_replaced`) on every storage before any rank reads TAG."""
    from poplar_ext.collectives import decided_by_rank0

    resolved = decided_by_rank0(lambda: checkpoint_tag(load_dir, tag), rank=rank)
    if resolved is None:
        return None
    storage_rank, node_local = _storage_rank(deepspeed_engine), deepspeed_engine.use_node_local_storage()
    _settle_tag(
        load_dir, resolved, storage_rank=storage_rank, rank=rank, caller="load_checkpoint", node_local=node_local
    )
    return resolved


def _settle_tag(
    load_dir: str | Path,
    tag: str,
    *,
    storage_rank: int,
    rank: int,
    caller: str,
    node_local: bool = True,
    refuse: bool = True,
) -> None:
    """`restore_replaced`, then `agree_storages` (collective; `refuse`: its). A storage rank that cannot do its
    part (a permission or I/O error) fails every rank at once, in place of a barrier: restored on every storage
    before any rank reads TAG."""
    from poplar_ext.collectives import raise_if_any_failed

    failure = None
    try:
        restore_replaced(load_dir, tag, storage_rank=storage_rank, caller=caller, node_local=node_local)
    except OSError as exc:  # noqa: BLE001 - raised on every rank, below
        failure = exc
    raise_if_any_failed(failure, rank=rank)
    agree_storages(load_dir, tag, storage_rank=storage_rank, rank=rank, caller=caller, refuse=refuse)


def agree_storages(
    load_dir: str | Path, tag: str, *, storage_rank: int, rank: int, caller: str, refuse: bool = True
) -> None:
    """Every storage (each node's, on node-local storage) holds the same save under `tag` (collective).

    Each storage's first rank tells which saves it holds whole: in TAG, in ``TAG.saving`` and in ``TAG.replaced``
    (`save_whole` swaps a save in only once every storage holds it whole, so a save stopped on some nodes is whole
    on all of them beside TAG). Where the TAGs differ, the newest save every storage holds is brought into TAG on
    each, and ``TAG.replaced`` dropped once it is. Where no save is on every storage, one ValueError on every rank
    (`refuse`; else each storage keeps what it holds: a save about to replace them all) rather than DeepSpeed
    loading two checkpoints as one, or failing on some ranks. A save is told by its state file's ``save_id``
    (older ones: their data position); a TAG without a state file (a plain DeepSpeed checkpoint, an older
    poplar-ext's node) is taken for the save the others hold unless it holds that save whole beside it."""
    from poplar_ext.collectives import gather_objects, raise_if_any_failed

    folders = _tag_folders(load_dir, tag)
    held = None
    if storage_rank == 0:
        try:
            held = tuple(
                _save_of(f) if f.is_dir() else (_MISSING if place == 0 else None) for place, f in enumerate(folders)
            )
        except OSError as exc:  # noqa: BLE001 - raised on every rank, below
            held = f"rank {rank} failed: {type(exc).__name__}: {exc}"
    gathered = gather_objects(held)
    unreadable = [saves for saves in gathered if isinstance(saves, str)]
    if unreadable:
        raise RuntimeError(unreadable[0])
    storages = [(rank, saves) for rank, saves in enumerate(gathered) if saves is not None]
    chosen = _newest_on_every_storage([saves for _, saves in storages])
    if chosen == _NONE_EVERYWHERE:
        if refuse:
            raise ValueError(
                f"{caller}: tag {tag!r}: expected one save under it on every node's storage, found different ones "
                f"({_holding(storages)}) and no save whole on all of them: a save into it stopped on some nodes "
                "before it was whole; load another checkpoint"
            )
        return
    failure = None
    if held is not None and chosen is not None:
        try:
            _bring_in(load_dir, tag, held, chosen, caller=caller)
        except OSError as exc:  # noqa: BLE001 - raised on every rank, below
            failure = exc
    raise_if_any_failed(failure, rank=rank)


_MISSING = ("", "no folder for the tag")
"""What `agree_storages` gathers for a storage without TAG's folder."""
_NONE_EVERYWHERE = "no save on every storage"
"""`_newest_on_every_storage`'s answer where no save is on every storage (no save id: those are hex or
"data position N")."""


def _newest_on_every_storage(storages: list[tuple]) -> str | None:
    """The save every storage is to hold in TAG, from each one's (TAG, ``TAG.saving``, ``TAG.replaced``) saves
    (`_save_of`): None where each loads TAG as it is (the same save in every TAG, TAGs without a state file
    taken for it, or TAG missing on every storage: the engine's own check names it); `_NONE_EVERYWHERE` where
    no one save is on every storage. Of several, the newest: one a save was writing beside TAG, then TAG's."""
    in_tag = {saves[0][0] for saves in storages}
    if in_tag == {_MISSING[0]}:
        return None
    identified = in_tag - {None}
    if _MISSING[0] not in identified and len(identified) <= 1:
        (only,) = identified or {None}
        return only  # brought in where a TAG without a state file holds it whole beside it (`_bring_in`)
    everywhere = set.intersection(*({s[0] for s in saves if s} - {None, _MISSING[0]} for saves in storages))
    if not everywhere:
        return _NONE_EVERYWHERE
    recency = {place: age for age, place in enumerate((2, 0, 1))}  # TAG.replaced, TAG, TAG.saving
    newest = {
        save: max(recency[place] for saves in storages for place, s in enumerate(saves) if s and s[0] == save)
        for save in everywhere
    }
    return max(sorted(everywhere), key=newest.__getitem__)


def _bring_in(load_dir: str | Path, tag: str, held: tuple, chosen: str, *, caller: str) -> None:
    """This storage's TAG made to hold save `chosen` (from ``TAG.saving`` or ``TAG.replaced``, where `held`
    says it is), and ``TAG.replaced`` dropped once TAG holds it."""
    folder, saving, replaced = _tag_folders(load_dir, tag)
    if held[0][0] != chosen and held[1] and held[1][0] == chosen:
        logger.warning("%s: %s does not hold the save other nodes do; swapped in %s, whole", caller, folder, saving)
        _swap_in(load_dir, tag, save_latest=False)  # the stopped save's own last step; drops TAG.replaced
    elif held[0][0] != chosen and held[2] and held[2][0] == chosen:
        logger.warning("%s: %s does not hold the save other nodes do; restored %s, whole", caller, folder, replaced)
        if folder.exists():
            (folder / STATE_FILE).unlink(missing_ok=True)  # a removal that stops leaves no save to take it for
            shutil.rmtree(folder)
        replaced.rename(folder)
    elif held[0][0] == chosen:
        shutil.rmtree(replaced, ignore_errors=True)  # superseded, as at the end of `_swap_in`


def _holding(storages: list[tuple[int, tuple]]) -> str:
    """What each storage holds, for people: its TAG, then any save whole beside it."""
    described = []
    for rank, (in_tag, saving, replaced) in storages:
        beside = [f"{s[1]} in {name}" for s, name in ((saving, "TAG.saving"), (replaced, "TAG.replaced")) if s and s[0]]
        described.append(f"rank {rank}'s storage: {in_tag[1]}" + (f" ({', '.join(beside)})" if beside else ""))
    return "; ".join(described)


def _save_of(folder: Path) -> tuple[str | None, str]:
    """Which save `folder` holds, by its state file: (its id, or None without one; words for people)."""
    if not (folder / STATE_FILE).is_file():
        return None, f"a folder without {STATE_FILE}"
    try:
        state = read_json(folder / STATE_FILE)
        position = state.get("data_position", state["consumed_samples"])
    except Exception as exc:  # noqa: BLE001 - told on every rank by the caller, not raised on this one alone
        return f"unreadable: {exc}", f"an unreadable {STATE_FILE} ({exc})"
    if "save_id" in state:
        return str(state["save_id"]), f"the save at data position {position} ({str(state['save_id'])[:8]})"
    # An older save: each node wrote its own state (its plan history may name its own paths): its position.
    return f"data position {position}", f"the save at data position {position}"


def restore_replaced(
    load_dir: str | Path, tag: str, *, storage_rank: int, caller: str, node_local: bool = False
) -> None:
    """A save whose storage rank stopped between its two renames left no TAG: the first rank of each storage
    renames into its place the save's ``TAG.saving`` if whole (it has its state file), else the earlier
    ``TAG.replaced``, with a warning. The newer first: on shared storage it is the newest whole checkpoint, all of
    its ranks having saved, and ``TAG.replaced`` is dropped; on node-local storage (`node_local`) other nodes may
    not hold it, and ``TAG.replaced`` stays for `agree_storages` to choose the save every node holds. The caller
    waits for every storage before any rank reads TAG."""
    folder, saving, replaced = _tag_folders(load_dir, tag)
    if storage_rank != 0 or folder.exists():
        return
    for whole, holds in (
        (saving, "the save into it that stopped, whole"),
        (replaced, "the checkpoint a save into it was replacing when it stopped"),
    ):
        if (whole / STATE_FILE).is_file():
            logger.warning("%s: %s is missing and %s holds %s: restored as %s", caller, folder, whole, holds, folder)
            try:
                whole.rename(folder)
            except OSError as exc:  # no rank waits for this one: rank 0's check of TAG then refuses it on every rank
                logger.error("%s: could not restore %s as %s: %s", caller, whole, folder, exc)
                return
            if not node_local:
                shutil.rmtree(replaced, ignore_errors=True)  # superseded, as at the end of `_swap_in`
            return


def check_pattern_safe(folder: Path, *, caller: str) -> None:
    """ValueError for a checkpoint folder whose path has ``*``, ``?`` or ``[`` (DeepSpeed globs it)."""
    if any(character in str(folder) for character in "*?["):
        raise ValueError(
            f"{caller}: expected a checkpoint folder without the characters * ? [ (DeepSpeed finds its files by a "
            f"glob pattern of its path, so it could not load it), found {folder}"
        )


def check_deepspeed_files(load_dir: str | Path, tag: str, *, named_by_latest: bool) -> None:
    """ValueError unless the folder of `tag` holds DeepSpeed's model states (DeepSpeed would fail a bare assert)."""
    folder = Path(load_dir) / tag
    check_pattern_safe(folder, caller="load_checkpoint")
    if not any(folder.glob("*model_states.pt")):
        named = f"{Path(load_dir) / 'latest'} names tag {tag!r}" if named_by_latest else f"tag {tag!r}"
        found = "a folder without them" if folder.is_dir() else "no such folder"
        raise ValueError(f"load_checkpoint: {named}: expected DeepSpeed's *model_states.pt in {folder}, found {found}")


def check_rank_files(
    load_dir: str | Path, tag: str, saved: dict | None, *, reads_optimizer: bool, caller: str = "load_checkpoint"
) -> None:
    """ValueError, before any weight is loaded, unless the folder of `tag` holds the ZeRO files of every rank that
    saved it (`saved`: its state file; the number of ranks its plan's) where it holds some rank's (the message
    starts with `caller`, none where empty): each rank's
    optimizer states at stages 1-2 where the load reads them (`reads_optimizer`), and at stage 3 (its weights
    are in them) each rank's model states too. Without them DeepSpeed fails on the rank that reads the missing
    file while the others wait for it, or, resharding, misreads the files there are. So is one of those files cut
    short (`_cut_short`): the rank reading it failed alone while the others went on. Without a state file (a
    plain DeepSpeed checkpoint) the ranks are the ``dp_world_size`` DeepSpeed records in the model states file
    (`plain_checkpoint_layout`). The caller leaves out node-local storage, where each node holds its own ranks'
    files."""
    plan = (saved or {}).get("plan") or {}
    folder, missing = Path(load_dir) / tag, []
    if saved is None and (layout := plain_checkpoint_layout(load_dir, tag)) is not None:
        (stage, ranks), told_by = layout, f"{model_states_file(load_dir, tag).name}: dp_world_size"
    elif "ranks" not in plan:  # no state file nor a recorded world size, or a pipeline plan's (refused later)
        return
    else:
        stage, ranks, told_by = plan["zero_stage"], len(plan["ranks"]), f"{STATE_FILE}: plan.ranks"
    stage_3 = stage == 3
    kinds = (["optim"] if stage_3 or (stage != 0 and reads_optimizer) else []) + (["model"] if stage_3 else [])
    for kind in kinds:
        held = [any(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_*_{kind}_states.pt")) for rank in range(ranks)]
        if any(held):  # none at all: DeepSpeed's own error, the same on every rank
            missing += [f"*zero_pp_rank_{rank}_mp_rank_*_{kind}_states.pt" for rank in range(ranks) if not held[rank]]
    if missing:
        raise ValueError(
            f"{caller}{': ' if caller else ''}{folder}: expected the ZeRO stage {stage} files of each of the {ranks} "
            f"ranks that saved it ({told_by}), found {len(missing)} missing ({listed(missing)}): the "
            "checkpoint is incomplete (a file lost, or not copied); copy the missing files from where it was "
            "saved, or load another checkpoint"
        )
    cut = [
        path.name
        for kind in kinds
        for rank in range(ranks)
        for path in sorted(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_*_{kind}_states.pt"))
        if _cut_short(path)
    ]
    if cut:
        raise ValueError(
            f"{caller}{': ' if caller else ''}{folder}: expected whole ZeRO files, found {len(cut)} cut short "
            f"({listed(cut)}: a zip file without its end, which torch cannot read): the checkpoint is damaged (a "
            "copy cut short); copy those files again from where it was saved, or load another checkpoint"
        )


def _cut_short(path: Path) -> bool:
    """Whether `path`, a file in torch's zip format, lacks the zip's central directory at its end (a copy cut
    short: torch fails to read it). Read from its end, not whole; a file in torch's legacy format is not judged."""
    try:
        if not _in_zip_format(path):
            return False
        with zipfile.ZipFile(path):
            return False
    except zipfile.BadZipFile:
        return True
    except OSError:  # unreadable here: DeepSpeed's load says so
        return False


def plain_checkpoint_layout(load_dir: str | Path, tag: str) -> tuple[int | str, int] | None:
    """``(ZeRO stage, ranks)`` of DeepSpeed checkpoint `tag` without a state file, as `check_rank_files` needs
    them: the ranks that saved it (`saved_world_size`), the stage told by its files (DeepSpeed names stage 3's
    model states ``zero_pp_rank_*``; otherwise ``"1-2"``, whose ZeRO files are optimizer states alone). None
    where the model states file records no world size."""
    ranks = saved_world_size(load_dir, tag)
    if ranks is None:
        return None
    stage_3 = any((Path(load_dir) / tag).glob("*zero_pp_rank_*_mp_rank_*_model_states.pt"))
    return (3 if stage_3 else "1-2"), ranks


def saved_world_size(load_dir: str | Path, tag: str) -> int | None:
    """The number of data-parallel ranks that saved `tag`, as DeepSpeed records it in the tag's model states file
    (``dp_world_size``, which its own load compares with the job's): how many ranks saved a checkpoint without a
    state file, such as a plain DeepSpeed one. None where the folder holds no model states file or it records none
    (a file torch cannot read is refused by `saved_parameter_shapes`, which every load runs first)."""
    world_size = _model_states_record(load_dir, tag).get("dp_world_size")
    return world_size if isinstance(world_size, int) else None


def saved_zero_stage(load_dir: str | Path, tag: str) -> int | None:
    """The ZeRO stage of the DeepSpeed config recorded in `tag`'s model states file (``ds_config``, where the
    engine was given a dict: a path is not read); None where it records none."""
    config = _model_states_record(load_dir, tag).get("ds_config")
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    return stage if isinstance(stage, int) and 0 <= stage <= 3 else None


def _model_states_record(load_dir: str | Path, tag: str) -> dict:
    """The entries of `tag`'s model states file but its weights (mapped, not read); empty where none is read."""

    path = model_states_file(load_dir, tag)
    if path is None:
        return {}
    try:
        saved = _load_model_states(path)
    except Exception:  # noqa: BLE001 - not known; DeepSpeed's load says what is wrong with the file
        return {}
    return saved if isinstance(saved, dict) else {}


def _in_zip_format(path: Path) -> bool:
    """Whether `path` begins as torch's zip format does (DeepSpeed writes the legacy one under
    ``"checkpoint": {"checkpoint_serialization": false}``)."""
    with path.open("rb") as file:
        return file.read(4) == b"PK\x03\x04"


def _load_model_states(path: Path) -> Any:
    """DeepSpeed's model states file `path` as torch loads it, mapped where torch can (its zip format): the entries
    and shapes are read, not the weights (the file may hold the whole model)."""
    import torch

    return torch.load(path, map_location="cpu", weights_only=False, mmap=_in_zip_format(path))


def check_optimizer_precision(load_dir: str | Path, tag: str, *, bf16: bool, caller: str = "load_checkpoint") -> None:
    """ValueError, before any weight is loaded, where the ZeRO optimizer files of `tag` are another precision's
    than this job's (`bf16`: DeepSpeed's ``bf16.enabled``) and DeepSpeed reads them as they are (the same number
    of ranks): it names them ``bf16_zero_pp_rank_*`` under bf16 and ``zero_pp_rank_*`` otherwise, and fails on
    every rank with a bare FileNotFoundError for the other's. (Resharded, a checkpoint loads in either.)"""
    folder = Path(load_dir) / tag
    files = sorted(path.name for path in folder.glob("*zero_pp_rank_*_optim_states.pt"))
    if not files or any(name.startswith("bf16_") == bf16 for name in files):
        return
    saved, now = ("bf16", "fp32 or fp16") if not bf16 else ("fp32 or fp16", "bf16")
    raise ValueError(
        f"{caller}: {folder}: expected the optimizer states of a {now} job, as this one trains "
        f"(bf16.enabled {str(bf16).lower()}), found those of a {saved} job ({listed(files)}), which DeepSpeed "
        f"cannot load in {now} on the number of ranks that saved it: resume it with bf16.enabled "
        f"{str(not bf16).lower()}, as it was saved"
    )


def model_states_file(load_dir: str | Path, tag: str) -> Path | None:
    """Rank 0's DeepSpeed model states file of `tag` (``mp_rank_00_model_states.pt``, or at ZeRO stage 3
    ``zero_pp_rank_0_mp_rank_00_model_states.pt``); None where the folder holds none."""
    files = sorted((Path(load_dir) / tag).glob("*model_states.pt"))
    return files[0] if files else None


def module_parameter_shapes(module: Any) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Each of `module`'s parameters and its full shape (at ZeRO stage 3 not its partition's), by the names
    DeepSpeed saves them under, and the names of those without a gradient; none where there is no module."""
    if module is None:
        return {}, frozenset()
    named = list(module.named_parameters())
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in named}
    return shapes, frozenset(name for name, p in named if not p.requires_grad)


def saved_parameter_shapes(
    path: Path, *, caller: str = "load_checkpoint"
) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Each parameter's full shape in DeepSpeed's model states file `path`, from its module state dict (empty
    ZeRO-3 partitions left out; buffers too) and its ``param_shapes`` and ``frozen_param_shapes`` (ZeRO 1-3);
    and the names of the latter two, parameters alone. ValueError naming the file where torch cannot read it."""
    import torch

    try:
        saved = _load_model_states(path)
    except Exception as exc:  # noqa: BLE001 - a file torch cannot read: refused naming it
        raise ValueError(
            f"{caller}: {path}: expected a model states file that torch can read, found one it cannot "
            f"({type(exc).__name__}: {exc}): the checkpoint is damaged (a save that stopped, a copy cut short); "
            "load another checkpoint"
        ) from exc
    shapes: dict[str, tuple[int, ...]] = {}
    module = saved.get("module") if isinstance(saved, dict) else None
    for name, value in (module or {}).items():
        if torch.is_tensor(value) and value.numel() > 0:
            shapes[name] = tuple(value.shape)
    groups = saved.get("param_shapes") if isinstance(saved, dict) else None
    frozen = saved.get("frozen_param_shapes") if isinstance(saved, dict) else None
    parameters: set[str] = set()
    for group in [*(groups or []), frozen or {}]:
        shapes.update({name: tuple(shape) for name, shape in group.items()})
        parameters.update(group)
    return shapes, parameters


def check_parameter_shapes(
    load_dir: str | Path,
    tag: str,
    model_shapes: dict[str, tuple[int, ...]],
    *,
    strict: bool = True,
    frozen: frozenset[str] = frozenset(),
    caller: str = "load_checkpoint",
) -> None:
    """ValueError, before any weight is loaded, unless checkpoint `tag` holds this job's parameters:
    `model_shapes` (each parameter's name and full shape) against rank 0's model states file. Every parameter
    in both must have its shape; with `strict` (DeepSpeed's ``load_module_strict``) the names must match too
    (a `frozen` parameter may be missing: DeepSpeed's ``exclude_frozen_parameters`` leaves it out). DeepSpeed
    fails on another shape deep in its loader on some ranks, or, where a ZeRO-3 checkpoint is resharded, pads
    or cuts each saved tensor to the parameter's size without a word."""
    path = model_states_file(load_dir, tag)
    if path is None or not model_shapes:
        return
    saved, parameters = saved_parameter_shapes(path, caller=caller)
    if not saved:
        return
    differ = [
        f"{name}: expected {list(shape)}, found {list(saved[name])}"
        for name, shape in model_shapes.items()
        if name in saved and tuple(saved[name]) != tuple(shape)
    ]
    missing = [name for name in model_shapes if name not in saved and name not in frozen] if strict else []
    unknown = [name for name in sorted(parameters) if name not in model_shapes] if strict else []
    if not (differ or missing or unknown):
        return
    found = []
    if differ:
        found.append(f"{len(differ)} parameters of another shape ({listed(differ)})")
    if missing:
        found.append(f"{len(missing)} of the model's parameters missing ({listed(missing)})")
    if unknown:
        found.append(f"{len(unknown)} parameters the model lacks ({listed(unknown)})")
    raise ValueError(
        f"{caller}: {path}: expected the parameters of this job's model ({len(model_shapes)}, each "
        f"shape as the model has it), found {'; '.join(found)}: the checkpoint was saved from another model; "
        "build the model it was saved from"
    )


def check_deepspeed_load(
    load_dir: str | Path,
    tag: str,
    saved: dict | None,
    *,
    module: Any,
    strict: bool,
    reads_optimizer: bool,
    node_local: bool,
    bf16: bool | None,
    world_size: int,
    caller: str = "load_checkpoint",
    zero_stage: int | None = None,
) -> None:
    """Rank 0's refusals, before any weight is loaded, of DeepSpeed checkpoint `tag` (`saved`: its state file) where
    DeepSpeed would fail on some ranks or load it wrong: parameters of another model than `module`
    (`check_parameter_shapes`, `strict` as DeepSpeed's ``load_module_strict``); a rank's ZeRO file missing
    (`check_rank_files`; not on `node_local` storage, where each node holds its own ranks'); and, loading the
    optimizer (`reads_optimizer`) on as many ranks as saved it (`world_size` now; without a state file, the
    ``dp_world_size`` DeepSpeed recorded: `saved_world_size`), optimizer states of another precision than `bf16`
    (`check_optimizer_precision`; None: not known); a checkpoint without a state file saved at a ZeRO stage whose
    files DeepSpeed cannot load at this job's `zero_stage` (`saved_zero_stage`; None: not known). The engine's
    load and the Trainer's resume both run it."""
    shapes, frozen = module_parameter_shapes(module)
    check_parameter_shapes(load_dir, tag, shapes, strict=strict, frozen=frozen, caller=caller)
    if saved is None and zero_stage is not None and (saved_stage := saved_zero_stage(load_dir, tag)) is not None:
        check_zero_stage(
            saved_stage,
            zero_stage,
            path=str(Path(load_dir) / tag),
            weights_only=not reads_optimizer,
            field=f"{model_states_file(load_dir, tag).name}: ds_config.zero_optimization.stage",
            caller=caller,
        )
    if not node_local:
        check_rank_files(load_dir, tag, saved, reads_optimizer=reads_optimizer, caller=caller)
    saved_ranks = len(((saved or {}).get("plan") or {}).get("ranks") or ())
    if saved is None and bf16 is not None and reads_optimizer:  # a plain DeepSpeed checkpoint: as DeepSpeed recorded
        saved_ranks = saved_world_size(load_dir, tag) or 0
    if bf16 is not None and reads_optimizer and saved_ranks == world_size:
        check_optimizer_precision(load_dir, tag, bf16=bf16, caller=caller)


def read_state(load_dir: str | Path, tag: str | None) -> dict | None:
    """The saved state, or None when the checkpoint has none (not written by poplar-ext)."""
    if tag is None:
        return None
    path = Path(load_dir) / tag / STATE_FILE
    if not path.is_file():
        return None
    state = read_json(path)
    _check_state(Node(state, str(path)))
    return state


def _check_state(state: Node) -> None:
    """FormatError for a state file without what a resume reads, rather than a KeyError deep in the resume."""
    state.field("seed").integer(minimum=0)
    state.field("shuffle").boolean()
    state.field("consumed_samples").integer(minimum=0)
    for key in ("data_position", "step"):
        if (value := state.optional(key)) is not None:
            value.integer(minimum=0)
    if (drop_last := state.optional("drop_last")) is not None:
        drop_last.boolean()
    if (history := state.optional("plan_history")) is not None:
        for entry in history.items():
            entry.field("plan").obj()
    if (pending := state.optional("pending_switch")) is not None:
        pending.field("plan").obj()
        pending.field("position").integer(minimum=0)
        pending.field("reason").string()
    if (speeds := state.optional("drift_monitor")) is not None:
        scales = [scale.number(positive=True) for scale in speeds.field("rank_scales").items(min_length=1)]
        streaks = speeds.field("streaks").items(min_length=len(scales), max_length=len(scales))
        for streak in streaks:
            streak.integer(minimum=0)
    plan = state.field("plan")
    plan.field("zero_stage").integer(minimum=0, maximum=3)
    plan.field("global_batch_size").integer(minimum=1)


def check_data_order(saved: dict, current: dict, *, path: str) -> None:
    """ValueError unless the saved data order (seed, shuffle, drop_last) is the job's: another order would repeat or
    skip samples."""
    saved_drop_last = saved.get("drop_last", False)  # absent in checkpoints of poplar-ext 0.1
    job_order = (current["seed"], current["shuffle"], current["drop_last"])
    if (saved["seed"], saved["shuffle"], saved_drop_last) != job_order:
        raise ValueError(
            f"load_checkpoint: {path} was saved with poplar.seed {saved['seed']}, shuffle {saved['shuffle']} and "
            f"drop_last {saved_drop_last}; this job has {current['seed']}, {current['shuffle']} and "
            f"{current['drop_last']}: the data order would differ, so samples would be repeated or skipped"
        )


@dataclass(frozen=True, kw_only=True)
class ResumeDecision:
    """What a job does with a checkpoint (the same on every rank)."""

    data_position: int
    """Stream position where the next iteration starts."""
    consumed_samples: int
    """Samples trained before the checkpoint (all ranks)."""
    plan_history: list[dict] = field(default_factory=list)
    """The checkpoint's plans, and this job's plan from the resume on."""
    notes: list[str] = field(default_factory=list)
    """What people should know about the resume (logged)."""
    world_size_changed: bool = False
    """The optimizer state must be resharded (a universal checkpoint at ZeRO stages 1-3)."""
    continue_plan: dict | None = None
    """The checkpoint's last plan (JSON) when the job continues under it rather than its own: the
    run had switched plans during training, and this job starts from the plan that run started from."""
    rebalancing: dict = field(default_factory=dict)
    """The saved run's re-balancing where this job continues its last plan on the same device types
    (`FollowsRebalancing.rebalancing_state`; empty otherwise)."""


REBALANCING_KEYS = ("pending_switch", "drift_monitor")
"""The state file's keys of re-balancing (`FollowsRebalancing.rebalancing_state`), absent where it has none."""


def rebalancing_of(saved: dict, plan: dict) -> dict:
    """The re-balancing state a saved run left (`REBALANCING_KEYS`), for a resume that continues its last plan under
    `plan` (JSON, ZeRO or pipeline); none where a rank has another device type (its speeds are another device's)."""
    if _rank_device_types(saved["plan"]) != _rank_device_types(plan):
        return {}
    return {key: saved[key] for key in REBALANCING_KEYS if key in saved}


def _rank_device_types(plan: dict) -> list[str]:
    if "ranks" in plan:
        return [r["device_type"] for r in plan["ranks"]]
    stages = {s["rank"]: s["device_type"] for pipeline in plan["pipelines"] for s in pipeline["stages"]}
    return [stages[rank] for rank in sorted(stages)]


def _file_layout(zero_stage: int) -> int:
    """DeepSpeed's checkpoint layout of a ZeRO stage: 0 (all in the model's file), 1 (stages 1-2) or 3."""
    return min(zero_stage, 1) if zero_stage < 3 else 3


def _stages_like(zero_stage: int) -> str:
    """The ZeRO stages of `zero_stage`'s checkpoint layout (``1 or 2``)."""
    return " or ".join(str(s) for s in range(4) if _file_layout(s) == _file_layout(zero_stage))


def check_zero_stage(
    saved_stage: int,
    stage: int,
    *,
    path: str,
    weights_only: bool = False,
    field: str = "poplar_state.json: plan.zero_stage",
    caller: str = "load_checkpoint",
) -> None:
    """ValueError unless DeepSpeed can load a checkpoint saved at ZeRO `saved_stage` at `stage` (it fails deep in
    its loader otherwise, or finds no file); its weights alone (`weights_only`) load across stages 0-2, whose model
    file holds every weight. `field` names where the saved stage was read."""
    layouts = {_file_layout(saved_stage), _file_layout(stage)}
    if len(layouts) == 1 or (weights_only and 3 not in layouts):
        return
    weights = "" if 3 in layouts else ", or load its weights alone (load_optimizer_states=False)"
    raise ValueError(
        f"{caller}: {path}: {field}: expected a ZeRO stage whose files "
        f"DeepSpeed loads at this job's stage {stage} ({_stages_like(stage)}), found {saved_stage}: resume it "
        f"at ZeRO stage {_stages_like(saved_stage)} (zero_optimization.stage, or poplar.zero_stage){weights}"
    )


def _shape(plan: dict) -> tuple:
    """What a re-balanced plan keeps: each rank's device type and memory levers, the stage, the global batch."""
    ranks = tuple(
        (r["device_type"], bool(r.get("activation_checkpointing", False)), bool(r.get("optimizer_offload", False)))
        for r in plan["ranks"]
    )
    return (ranks, plan["zero_stage"], plan["global_batch_size"])


def resume_decision(
    saved: dict | None,
    current: dict,
    *,
    path: str,
    step: int,
    load_module_only: bool = False,
    load_optimizer_states: bool = True,
) -> ResumeDecision:
    """Decide how to continue from a checkpoint at `path` saved with `saved` (None: no poplar state).

    `current`: this job's `poplar_client_state`; `step`: the optimizer step resumed at. ValueError where the data
    order differs (every sample would not be used once per epoch). Where the saved run had re-balanced and this
    job starts from the plan that run started from, the job continues under the saved (last) plan.
    """
    plan = current["plan"]
    resume_entry = {"start_step": step, "reason": "", "plan": plan}
    if saved is None or load_module_only:
        why = (
            "holds no poplar-ext state (a plain DeepSpeed checkpoint)"
            if saved is None
            else "was loaded for its weights only"
        )
        resume_entry.update(data_position=0, reason=f"started from {path}, which {why}")
        return ResumeDecision(
            data_position=0,
            consumed_samples=0,
            plan_history=[resume_entry],
            notes=[f"{path} {why}: the data starts at position 0 under this job's plan"],
        )
    if plan_parallelism(saved["plan"]) == "pipeline":
        raise ValueError(
            f"load_checkpoint: {path} was saved by a pipeline job (a PoplarPipelineModule under a pipeline plan); "
            "this job trains every rank on the whole model: resume it with the same PoplarPipelineModule and plan"
        )
    check_data_order(saved, current, path=path)
    check_zero_stage(saved["plan"]["zero_stage"], plan["zero_stage"], path=path, weights_only=not load_optimizer_states)
    position = saved.get("data_position", saved["consumed_samples"])
    history = list(saved.get("plan_history") or [])
    notes: list[str] = []
    old_plan = saved["plan"]
    if _allocation(old_plan) == _allocation(plan) and len(old_plan["ranks"]) == len(plan["ranks"]):
        return ResumeDecision(
            data_position=position,
            consumed_samples=saved["consumed_samples"],
            plan_history=history,
            rebalancing=rebalancing_of(saved, plan) if _shape(old_plan) == _shape(plan) else {},
        )
    started_from = next((h["plan"] for h in reversed(history) if not h.get("switched")), None)
    if (
        started_from is not None
        and _allocation(started_from) == _allocation(plan)
        and _shape(started_from) == _shape(plan) == _shape(old_plan)
    ):
        return ResumeDecision(
            data_position=position,
            consumed_samples=saved["consumed_samples"],
            plan_history=history,
            notes=[
                f"resumed from {path} under its last plan (see the plan history); the data continues at stream "
                f"position {position}"
            ],
            continue_plan=old_plan,
            rebalancing=rebalancing_of(saved, plan),
        )
    world_before, world_now = len(old_plan["ranks"]), len(plan["ranks"])
    changes = []
    if world_before != world_now:
        changes.append(f"{world_before} ranks then, {world_now} now")
    if old_plan["zero_stage"] != plan["zero_stage"]:
        changes.append(f"ZeRO stage {old_plan['zero_stage']} then, {plan['zero_stage']} now")
    if old_plan["global_batch_size"] != plan["global_batch_size"]:
        changes.append(f"global batch {old_plan['global_batch_size']} then, {plan['global_batch_size']} now")
        notes.append(
            f"the checkpoint trained global batches of {old_plan['global_batch_size']} samples, this job trains "
            f"{plan['global_batch_size']}: the data continues at stream position {position} with the new batch"
            + (
                " (with drop_last, at the new batch's first iteration of the epoch at or after it: the samples "
                "between, fewer than a batch, are skipped in this epoch; where the epoch holds no whole iteration of "
                "the new batch after it, at the next epoch's first, and the rest of this epoch is skipped too: up to "
                "twice the new batch less 2 samples)"
                if saved.get("drop_last", False)
                else ""
            )
            + ", and optimizer steps (and a learning-rate schedule that counts them) now take that many samples"
        )
    reason = f"resumed from {path} under another plan ({'; '.join(changes) or 'another allocation'})"
    resume_entry.update(data_position=position, reason=reason)
    notes.insert(0, f"{reason}; the data continues at stream position {position}")
    return ResumeDecision(
        data_position=position,
        consumed_samples=saved["consumed_samples"],
        plan_history=history + [resume_entry],
        notes=notes,
        world_size_changed=world_before != world_now,
    )
