"""A rank's ZeRO-1/2 optimizer offloaded to the host (DeepSpeed's ``offload_optimizer``), for profiler and runtime.
See docs/profiling.md (the memory levers: why ranks may differ in it at stages 1-2)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poplar_ext.plan.errors import FormatError

if TYPE_CHECKING:
    from poplar_ext.plan.formats import Plan

HOST_OPTIMIZERS = ("DeepSpeedCPUAdam", "DeepSpeedCPULion")
"""The client optimizers DeepSpeed offloads while ``zero_force_ds_cpu_optimizer`` is true (its own, by class)."""

ACCELERATE_MAPPED = ("Adam", "AdamW")
"""The torch optimizers accelerate replaces, where it offloads under ``zero_force_ds_cpu_optimizer``, by DeepSpeed's
CPU optimizer of the same rule (``map_pytorch_optim_to_deepspeed``, keeping their parameter groups): torch's own
classes, without ``amsgrad`` (DeepSpeedCPUAdam raises) or ``maximize`` (ignored), and Adam without
``decoupled_weight_decay`` (accelerate maps only AdamW to decoupled weight decay). Any other optimizer becomes
DeepSpeedCPUAdam of L2 weight decay there, Adagrad and DeepSpeed's own CPU optimizers too (accelerate 1.15 passes
DeepSpeedCPUAdagrad an ``adamw_mode`` it does not take: a TypeError)."""

_TORCH_ADAM = {"Adam": "torch.optim.adam.Adam", "AdamW": "torch.optim.adamw.AdamW"}

OFFLOAD_MODES = ("off", "smallest", "both")
"""What the profiler measures offloaded (``optimizer_offload`` of `profile_model` and of the
``poplar`` section): nothing, the device type(s) with the least memory, or every type (at ZeRO
stages 1-2; each also measured without)."""


def _of_class(optimizer: Any, names: tuple[str, ...]) -> bool:
    """Whether `optimizer` is of a class named in `names`, or derives from one (DeepSpeed's optimizers are told by
    name: importing them would build their extensions)."""
    return any(k.__name__ in names for k in type(optimizer).__mro__)


def offload_deepspeed_optimizer(ds_config: dict[str, Any]) -> dict[str, Any]:
    """`ds_config` (changed in place) with its ZeRO optimizer offloaded to the host's memory.

    Keeps the user's ``offload_optimizer`` options (``pin_memory``, ...) and sets the device to ``cpu`` unless it says
    ``nvme``. A client optimizer (not ``DeepSpeedCPUAdam``) then steps on the host: DeepSpeed refuses that unless
    ``zero_force_ds_cpu_optimizer`` is false, which is set where the config does not say; an ``optimizer`` section gets
    DeepSpeed's own CPU Adam instead."""
    zero = ds_config.setdefault("zero_optimization", {})
    given = zero.get("offload_optimizer")
    options = dict(given) if isinstance(given, dict) else {}
    if options.get("device") != "nvme":
        options["device"] = "cpu"
    zero["offload_optimizer"] = options
    ds_config.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds_config


def check_client_optimizer_offloads(
    ds_config: dict[str, Any],
    plan: Plan,
    optimizer: Any,
    *,
    source: str,
    plan_source: str = "the plan",
    accelerate_maps: bool = False,
) -> None:
    """FormatError, on every rank alike, where `plan` offloads some rank's optimizer and DeepSpeed would refuse the
    client `optimizer` there: ``zero_force_ds_cpu_optimizer`` true in `ds_config` (`source`) and an optimizer that
    is not one of `HOST_OPTIMIZERS`. DeepSpeed raises on the offloading ranks alone, inside its initialize, while
    the others go on into their first collective. A factory (not yet an optimizer) is left to DeepSpeed.

    `accelerate_maps`: the optimizer goes through accelerate (PoplarAccelerator, PoplarTrainer), which replaces it
    on the offloading ranks alone by DeepSpeed's CPU optimizer of the same rule (`ACCELERATE_MAPPED`); any other
    becomes DeepSpeedCPUAdam there, silently, so only those are refused. A DeepSpeedCPUAdam given passes only without
    decoupled weight decay (accelerate rebuilds it with ``adamw_mode`` false); Adagrad, DeepSpeedCPULion,
    ``amsgrad`` and ``maximize`` are refused (accelerate fails on them or changes their rule there)."""
    offloading = [r.rank for r in plan.ranks if r.optimizer_offload]
    force = ds_config.get("zero_force_ds_cpu_optimizer", False)
    if not offloading or not force or optimizer is None or not hasattr(optimizer, "param_groups"):
        return
    kind = type(optimizer)
    setting = None
    if accelerate_maps:
        accepted = ("DeepSpeedCPUAdam", *ACCELERATE_MAPPED)
        setting = _changed_by_accelerate(optimizer)
        if setting is None:
            return
    else:
        accepted = HOST_OPTIMIZERS
        if _of_class(optimizer, accepted):
            return
    ranks = ", ".join(f"ranks[{r}].optimizer_offload" for r in offloading)
    why = (
        "accelerate trains it as DeepSpeedCPUAdam on the offloading ranks alone, as itself on the others; Adagrad "
        "and amsgrad fail there, the others left waiting"
        if accelerate_maps
        else "DeepSpeed refuses it on the offloading ranks alone, the others left waiting"
    )
    raise FormatError(
        source,
        "zero_force_ds_cpu_optimizer",
        f"false (or unset) where {plan_source} offloads the optimizer ({ranks}) of a client optimizer other than "
        f"{' or '.join(accepted)} ({why})",
        f"{force!r} with the client optimizer {kind.__module__}.{kind.__qualname__}"
        + ("" if not setting else f" ({setting})")
        + "; set it false, pass "
        "DeepSpeedCPUAdam, or train a plan without optimizer offload"
        + ("" if len(offloading) == len(plan.ranks) else _HOST_ALONE),
    )


def _changed_by_accelerate(optimizer: Any) -> str | None:
    """None where accelerate's ``map_pytorch_optim_to_deepspeed`` gives `optimizer`'s own rule on an offloading rank;
    else what it changes: the setting (``amsgrad=True``, ...) it drops, or "" for another class."""
    kind = type(optimizer)
    groups = optimizer.param_groups
    name = f"{kind.__module__}.{kind.__qualname__}"
    if name in _TORCH_ADAM.values():
        for key in ("amsgrad", "maximize"):
            if any(group.get(key) for group in groups):
                return f"{key}=True"
        if name == _TORCH_ADAM["Adam"] and any(
            g.get("decoupled_weight_decay") and g.get("weight_decay") for g in groups
        ):
            return "decoupled_weight_decay=True with weight decay: accelerate makes it L2"
        return None
    if _of_class(optimizer, ("DeepSpeedCPUAdam",)):
        if getattr(optimizer, "adam_w_mode", False) and any(group.get("weight_decay") for group in groups):
            return "adamw_mode=True with weight decay: accelerate makes it L2"
        return None
    return ""  # another class: the message names it


_HOST_ALONE = " (DeepSpeedCPUAdam on GPUs only where every rank offloads: it steps on the host alone)"


def check_host_optimizer_placement(plan: Plan, optimizer: Any, *, device_type: str, plan_source: str) -> None:
    """ValueError, on every rank alike, where `plan` offloads some ranks' optimizer and not others' on GPUs and the
    client `optimizer` steps on the host alone (`HOST_OPTIMIZERS`): DeepSpeedCPUAdam asserts its parameters are on
    the CPU, so the ranks keeping their partitions on the GPU would fail at their first step, the others waiting."""
    kept = [r.rank for r in plan.ranks if not r.optimizer_offload]
    if device_type != "cuda" or not kept or len(kept) == len(plan.ranks) or not hasattr(optimizer, "param_groups"):
        return
    if not _of_class(optimizer, HOST_OPTIMIZERS):
        return
    kind = type(optimizer)
    raise ValueError(
        f"{plan_source}: expected a client optimizer that steps where each rank keeps its optimizer state, as the "
        f"plan offloads it on some ranks alone, found {kind.__module__}.{kind.__qualname__}, which steps on the host "
        f"alone: the ranks that keep it on the GPU ({', '.join(f'ranks[{r}]' for r in kept)}) would fail at their "
        "first step (DeepSpeed: 'CPUAdam param is on cuda'), the others left waiting; pass a torch optimizer "
        "(DeepSpeed steps it on the host where the plan offloads, with zero_force_ds_cpu_optimizer false), or name "
        "it in the DeepSpeed config's optimizer section (DeepSpeed's CPU Adam where the plan offloads, its GPU Adam "
        "elsewhere)"
    )


def check_job_optimizer_offloads(job: Any, optimizer: Any, *, accelerate_maps: bool = False) -> None:
    """`check_client_optimizer_offloads` and `check_host_optimizer_placement` for a settled job: its DeepSpeed
    config, plan, the plan's source and its device (read only where the plan offloads some rank)."""
    if any(r.optimizer_offload for r in job.plan.ranks):
        device = getattr(job, "device", None)
        if device is not None:
            check_host_optimizer_placement(job.plan, optimizer, device_type=device.type, plan_source=job.plan_reason)
        check_client_optimizer_offloads(
            job.ds_config,
            job.plan,
            optimizer,
            source=job.source,
            plan_source=job.plan_reason,
            accelerate_maps=accelerate_maps,
        )
