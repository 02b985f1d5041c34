"""What both loops of `poplar-bench drift` share: the settings, the ``poplar`` section of a run, and the
record of re-balancing (its cost, the plans it switched to). `poplar_bench.drift` runs the plain loop,
`poplar_bench.drift_trainer` the Trainer's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .demo_config import DemoSettings

LOOPS = ("plain", "trainer")  # `DriftSettings.loop`'s values


@dataclass(frozen=True, kw_only=True)
class DriftSettings(DemoSettings):
    """The demo's settings plus the drift and the re-balancing options."""

    drift_rank: int = 0
    """The rank that drifts (rank 0, the fastest device, carries the most samples)."""
    factor: float = 2.5
    """How much slower it becomes."""
    drift_at: int = 8
    """Optimizer steps done when it slows down."""
    recover_at: int = 24
    """Optimizer steps done when it is back to its own speed."""
    drift_iterations: int = 36
    """Iterations of each run."""
    check_interval_steps: int = 4
    threshold: float = 0.2
    min_gain: float = 0.05
    sustained_checks: int = 2
    loop: str = "plain"
    """What trains: ``plain``, `poplar_ext.initialize` and a hand-written loop on the demo's toy GPT; ``trainer``,
    `PoplarTrainer` on a GPT-2 of the same shape in its automatic mode (`poplar_bench.drift.LOOP_TEXT`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loop not in LOOPS:
            raise ValueError(f"loop: expected one of {', '.join(LOOPS)}, found {self.loop!r}")
        if not 0 <= self.drift_rank < len(self.devices):
            raise ValueError(f"drift_rank: expected 0..{len(self.devices) - 1}, found {self.drift_rank}")
        if not self.factor >= 1.0:
            raise ValueError(f"factor: expected a number >= 1, found {self.factor} (--factor)")
        if not 0 < self.drift_at < self.recover_at <= self.drift_iterations:
            raise ValueError(
                "drift_at, recover_at, drift_iterations: expected 0 < drift_at < recover_at <= drift_iterations, found "
                f"{self.drift_at}, {self.recover_at}, {self.drift_iterations} (--drift-at, --recover-at, --iterations)"
            )
        if not self.recover_at > self.drift_at + 2 * self.check_interval_steps:
            # The adaptive goal is judged from two check intervals after the change until the recovery.
            raise ValueError(
                "drift_at, recover_at, check_interval_steps (--drift-at, --recover-at, --check-interval-steps): "
                "expected recover_at > drift_at + 2 x check_interval_steps, so that the adaptive goal (judged from "
                "two check intervals after the change until the recovery) has iterations to judge, found "
                f"{self.drift_at}, {self.recover_at}, {self.check_interval_steps}"
            )

    def cache_root(self) -> Path:
        """The demo's cache, or for the Trainer its ``trainer`` folder: its GPT-2 ranks carry transformers, so
        the emulated capacities (set above a measured baseline) and the profiles are kept apart from the demo's."""
        root = super().cache_root()
        return root / "trainer" if self.loop == "trainer" and self.cache_dir is None else root

    def schedule(self, base_slowdown: float) -> list[list[float]]:
        return [
            [self.drift_at, base_slowdown * self.factor, self.drift_rank],
            [self.recover_at, base_slowdown, self.drift_rank],
        ]


def poplar_section(settings: DriftSettings, *, cluster_path: Path, adaptive: bool) -> dict[str, Any]:
    """What every run's ``poplar`` section says: the cluster, the profiles re-balancing re-plans from, one
    thread and a steady allocator (as the profiler measured), ``poplar.rebalance`` on (adaptive) or off."""
    return {
        "cluster": str(cluster_path),
        "profiles": str(settings.profiles_dir()),
        "cpu_threads": 1,
        "steady_cpu_allocator": True,
        "log_interval_steps": 0,
        "rebalance": {
            "enabled": adaptive,
            "check_interval_steps": settings.check_interval_steps,
            "threshold": settings.threshold,
            "min_gain": settings.min_gain,
            "sustained_checks": settings.sustained_checks,
        },
    }


def timed_rebalancing(engine: Any) -> list[float]:
    """``[seconds]`` that grows by the time of each call of the engine's re-balancing hook (with its
    collectives); stays 0 when re-balancing is off. Reset it to leave out the warm-up."""
    hook_s = [0.0]
    rebalancer = engine.rebalancer
    if rebalancer is None:
        return hook_s
    original = rebalancer.after_step

    def timed_after_step(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args)
        finally:
            hook_s[0] += time.perf_counter() - start

    rebalancer.after_step = timed_after_step
    return hook_s


def plan_history(engine: Any) -> list[dict[str, Any]]:
    """The engine's plans: where each started, why, and its (micro-batch, accumulation count) per rank."""
    return [
        {
            "start_step": h["start_step"],
            "reason": h["reason"],
            "allocation": [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in h["plan"]["ranks"]],
        }
        for h in engine.plan_history
    ]
