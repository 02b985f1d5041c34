"""A rank's ZeRO-1/2 optimizer offloaded to the host (DeepSpeed's ``offload_optimizer``), for profiler and runtime.
See docs/profiling.md (the memory levers: why ranks may differ in it at stages 1-2)."""

from __future__ import annotations

from typing import Any

OFFLOAD_MODES = ("off", "smallest", "both")
"""What the profiler measures offloaded (``optimizer_offload`` of `profile_model` and of the
``poplar`` section): nothing, the device type(s) with the least memory, or every type (at ZeRO
stages 1-2; each also measured without)."""


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
