"""One rank of `poplar-bench demo`: profile, search, train every policy in interleaved rounds, measure the
standalone ideal. See docs/bench.md."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from poplar_ext.models.synthetic import random_tokens
from poplar_ext.plan.errors import FormatError
from poplar_ext.plan.formats import (
    POLICIES,
    Cluster,
    Profile,
    cluster_to_dict,
    load_cluster,
    load_plan,
    plan_to_dict,
    read_json,
    save_cluster,
    save_plan,
    write_json_atomic,
)

from .demo_config import (
    BASELINE_ROUNDING_BYTES,
    DemoSettings,
    deepspeed_config,
    demo_cluster,
)
from .report import profile_curve, progress

PG_TIMEOUT_S = 180.0  # the demo's process-group timeout: a rank stuck in a collective fails after it
# torch collectives DeepSpeed calls and torch deprecates (a FutureWarning on every rank).
KNOWN_WARNINGS = ("all_gather_into_tensor", "reduce_scatter_tensor")


def demo_rank(run: Callable[[Any, Path], dict[str, Any]], settings: Any, work: Path) -> dict[str, Any]:
    """A rank of the demo, drift or checkpointing bench: `run(settings, work)` without the known warnings
    (DeepSpeed's business, not the reader's: filtered in the bench's own ranks only, never in the library)."""
    for name in KNOWN_WARNINGS:
        warnings.filterwarnings(
            "ignore", message=rf"`torch\.distributed\.{name}` is deprecated", category=FutureWarning
        )
    return run(settings, work)


def _timed(timings: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    value = fn()
    timings[key] = time.perf_counter() - start
    return value


def run_rank(settings: DemoSettings, work: Path) -> dict[str, Any]:
    """All phases on one rank; returns this rank's measurements."""
    rank = dist.get_rank()
    timings: dict[str, float] = {}
    cluster_path = work / "cluster.json"
    cluster = _timed(timings, "cluster_s", lambda: agreed_cluster(settings, cluster_path))
    device_type = cluster.rank_device_types[rank]

    progress(
        f"profiling {', '.join(cluster.type_counts())} at ZeRO stage {settings.zero_stage} (cache: "
        f"{settings.profiles_dir()})",
        rank=rank,
    )
    profiles, cache_hit = _timed(timings, "profile_s", lambda: profile_devices(settings, cluster_path))
    progress(f"profiles {'from the cache' if cache_hit else 'measured'} in {timings['profile_s']:.1f} s", rank=rank)
    checks: dict[str, Any] = {}
    if settings.calibration == "always" or (settings.calibration == "cached" and cache_hit):
        profiles, checks = _timed(
            timings, "calibration_s", lambda: calibrate_profiles(settings, cluster_path, cluster, profiles)
        )
        found = "; ".join(
            f"{t} {c.measured_over_profiled:.2f}x the profile, {c.outcome}" for t, c in sorted(checks.items())
        )
        progress(f"calibration in {timings['calibration_s']:.1f} s: {found}", rank=rank)

    if rank == 0:
        write_json_atomic(make_plans(settings, profiles, cluster, work, checks=checks), work / "plans.json")
    dist.barrier()
    plans = read_json(work / "plans.json")

    policies = [p for p in POLICIES if plans["policies"][p]["status"] == "ok"]
    engines = {
        policy: _timed(
            timings,
            f"initialize_{policy}_s",
            lambda p=policy: build_engine(settings, cluster_path, work / f"plan-{p}.json"),
        )
        for policy in policies
    }
    first_s = timings.get(f"initialize_{policies[0]}_s", 0.0) if policies else 0.0
    progress(
        f"engines ready (first initialize {first_s:.1f} s); training {', '.join(policies)} for {settings.rounds} "
        f"rounds x {settings.iterations} iterations",
        rank=rank,
    )

    measured = train_rounds(settings, engines, rank)
    progress("measuring each rank's standalone throughput (the ideal)", rank=rank)
    profile = next(p for p in profiles if p.device_type == device_type)
    standalone = _timed(timings, "standalone_s", lambda: measure_standalone(settings, cluster, rank, profile))
    dist.barrier()
    emulated = {policy: run.engine.emulated_compute for policy, run in engines.items()}
    return {
        "emulation": {p: None if e is None else e.overrun_report() for p, e in emulated.items()},
        "rank": rank,
        "device_type": device_type,
        "timings_s": timings,
        "profile_cache_hit": cache_hit,
        "policies": measured,
        "standalone": standalone,
    }


# --- Phase 0: the emulated cluster ---
def measure_baseline_bytes(settings: DemoSettings) -> int:
    """This rank's peak memory for the model, its gradients and Adam state at micro-batch 1: the profiler
    measures the whole process on CPU (on a GPU the CUDA allocator's peak), so the emulated capacities are set
    above this baseline (which depends on the machine and library versions)."""
    # The network fit's scipy.optimize, which profiling loads, is in the baseline (the search loaded
    # it before the network file moved to the plan): the headroom is the model's and DeepSpeed's.
    import poplar_ext.search.network  # noqa: F401
    from poplar_ext.hardware.memory import peak_memory_bytes, release_memory, reset_peak_memory

    device = rank_device()
    reset_peak_memory(device)
    model = make_model(settings).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(_batch(settings, 1).to(device)).backward()
    optimizer.step()
    peak = peak_memory_bytes(device)
    del model, optimizer
    release_memory(device)
    return peak


def _baseline_of(cluster: Cluster, settings: DemoSettings) -> int | None:
    """The baseline a stored demo cluster was made with, or None when it does not fit `settings`."""
    if cluster.rank_device_types != tuple(d.name for d in settings.devices):
        return None
    pairs = [(cluster.emulation_of(d.name), d) for d in settings.devices]
    if any(e is None or e.slowdown != d.slowdown for e, d in pairs):
        return None
    baselines = {e.memory_capacity_bytes - d.memory_headroom_bytes for e, d in pairs}
    baseline = baselines.pop() if len(baselines) == 1 else 0
    return baseline if baseline > 0 and baseline % BASELINE_ROUNDING_BYTES == 0 else None


def agreed_cluster(settings: DemoSettings, cluster_path: Path) -> Cluster:
    """The emulated cluster, the same on every rank, written to `cluster_path`. Its capacities depend on the
    measured baseline; it is kept in the cache directory and reused while every capacity is still above the
    baseline, so the profiles cached for it (keyed by the emulation) are reused on the next run."""
    baseline = torch.tensor([measure_baseline_bytes(settings)], dtype=torch.int64)
    dist.all_reduce(baseline, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        stored = settings.cluster_file()
        cluster = candidate = None
        if stored.exists() and not settings.force_profile:
            with contextlib.suppress(FormatError):  # a damaged file is replaced below
                candidate = load_cluster(stored)
            stored_baseline = None if candidate is None else _baseline_of(candidate, settings)
            # Reused while every emulated capacity is still above today's baseline: the
            # baseline drifts by a few MiB from run to run, and a new cluster would
            # make every cached profile (keyed by the emulation) useless.
            smallest_headroom = min(d.memory_headroom_bytes for d in settings.devices)
            if stored_baseline is not None and int(baseline) < stored_baseline + smallest_headroom:
                cluster = candidate
        if cluster is None:
            cluster = demo_cluster(settings, baseline_bytes=int(baseline))
            save_cluster(cluster, stored)
        save_cluster(cluster, cluster_path)
    dist.barrier()
    return load_cluster(cluster_path)


# --- Phase 1: profiles ---
def rank_device() -> torch.device:
    """Where this rank computes: the CPU, or, on a machine with CUDA (`poplar-bench gpu`), the rank's
    GPU (`select_job_device`: ranks beyond the GPUs share them)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from poplar_ext.hardware.devices import select_job_device

    return select_job_device()


def make_model(settings: DemoSettings) -> torch.nn.Module:
    """The demo's toy GPT (`DemoModel`'s shape), seeded as every rank seeds it."""
    from poplar_ext.models.toy_gpt import GPT, GPTConfig

    return GPT(GPTConfig(**dataclasses.asdict(settings.model)), seed=settings.seed)


def _batch(settings: DemoSettings, micro_batch_size: int) -> torch.Tensor:
    """Random tokens: the content does not change the time of a step."""
    shape = (micro_batch_size, settings.model.sequence_length + 1)
    return random_tokens(settings.model.vocab_size, shape, seed=settings.seed * 7919 + micro_batch_size)


def _cached_fingerprints(cache_dir: Path, world_size: int) -> set[str]:
    """Fingerprints of the profiles already in the cache, also those of `world_size` ranks it keeps apart (to tell
    reuse from measurement)."""
    from poplar_ext.plan.formats import load_profile
    from poplar_ext.profiler.cache import parked_profiles

    found = {p.fingerprint for p in parked_profiles(cache_dir, world_size)}
    for path in cache_dir.glob("*.json") if cache_dir.is_dir() else []:
        with contextlib.suppress(FormatError):  # damaged: the profiler measures again
            found.add(load_profile(path).fingerprint)
    return found


def _profile_options(settings: DemoSettings, cluster_path: Path, **options: Any) -> Any:
    """The demo model's `ProfileOptions` on this job, with `options`."""
    from poplar_ext.profiler import ProfileOptions

    return ProfileOptions(
        model_factory=lambda: make_model(settings),
        make_batch=lambda size: _batch(settings, size),
        ds_config=deepspeed_config(settings),
        cluster=cluster_path,
        model_name="toy-gpt",
        sequence_length=settings.model.sequence_length,
        **options,
    )


def profile_devices(settings: DemoSettings, cluster_path: Path) -> tuple[list[Profile], bool]:
    """Profiles of every device type at the demo's stage from the profiler, and whether all came from its cache."""
    from poplar_ext.profiler import profile_with

    before = _cached_fingerprints(settings.profiles_dir(), dist.get_world_size())
    options = _profile_options(
        settings,
        cluster_path,
        zero_stages=(settings.zero_stage,),
        cache_dir=settings.profiles_dir(),
        force=settings.force_profile,
        progress=lambda line: progress(f"profiler: {line}", rank=dist.get_rank()),
        micro_batch_size_limit=settings.max_micro_batch_size,
        repeats=settings.profile_repeats,
        activation_checkpointing=settings.activation_checkpointing,
    )
    profiles = profile_with(options)
    return profiles, all(p.fingerprint in before for p in profiles)


def calibrate_profiles(
    settings: DemoSettings, cluster_path: Path, cluster: Cluster, profiles: list[Profile]
) -> tuple[list[Profile], dict[str, Any]]:
    """`profiles` checked against micro-steps timed now at the sizes poplar's plan uses, as a job checks its plan's
    (collective); the profiles to plan from (rescaled or measured again beyond the threshold) and each type's check.

    One size per type (`calibration_sizes`): a type's curve is rescaled by one factor either way, which the other
    policies' plans use too; timing every policy's sizes cost about three times as long (each trial lasts as
    long as its slowest type's micro-steps)."""
    from poplar_ext.collectives import broadcast_from_rank0
    from poplar_ext.plan.network_format import find_network
    from poplar_ext.profiler.api import time_micro_steps
    from poplar_ext.profiler.calibration import REMEASURED, apply_checks, check_profiles

    sizes = None
    if dist.get_rank() == 0:
        sizes = calibration_sizes(
            search_policies(settings, profiles, cluster, find_network(settings.profiles_dir(), cluster))
        )
    options = _profile_options(settings, cluster_path)
    measured = time_micro_steps(options, broadcast_from_rank0(sizes), zero_stage=settings.zero_stage)
    checks = check_profiles(
        profiles, measured, threshold=settings.calibration_threshold, action=settings.calibration_action
    )
    if any(c.outcome == REMEASURED for c in checks.values()):
        # The profiler measures every type of a stage in one engine: all of them again.
        profiles, _ = profile_devices(dataclasses.replace(settings, force_profile=True), cluster_path)
    return apply_checks(profiles, checks), checks


def calibration_sizes(results: dict[str, Any]) -> dict[str, list[int]]:
    """Device type -> the sizes the start-up check times: those of poplar's plan (what a job checks, one plan),
    every plan's when poplar has none."""
    from poplar_ext.profiler.calibration import plan_sizes

    plans = {policy: r.plan for policy, r in results.items() if r.plan is not None}
    return plan_sizes([plans["poplar"]] if "poplar" in plans else list(plans.values()))


# --- Phase 2: plans (rank 0) ---
def search_policies(
    settings: DemoSettings, profiles: list[Profile], cluster: Cluster, network: Any, policies: Any = POLICIES
) -> dict[str, Any]:
    """Policy -> the search's result for the demo's batch and stage."""
    from poplar_ext.search import search_plan

    return {
        policy: search_plan(
            profiles,
            cluster,
            global_batch_size=settings.global_batch_size,
            zero_stage=settings.zero_stage,
            policy=policy,
            network=network,
        )
        for policy in policies
    }


def make_plans(
    settings: DemoSettings,
    profiles: list[Profile],
    cluster: Cluster,
    work: Path,
    *,
    checks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Search every policy, write each plan to ``plan-<policy>.json`` in `work`; what
    `poplar_bench.demo.assemble_report` reads as ``plans``. `checks`: the profiles' calibration, recorded in every
    plan and in ``calibration``."""
    from poplar_ext.plan.network_format import find_network, network_to_dict
    from poplar_ext.profiler.calibration import with_calibration
    from poplar_ext.search import predict

    # The profiler measured the network beside the profiles: communication is priced.
    network = find_network(settings.profiles_dir(), cluster)
    out: dict[str, Any] = {
        "policies": {},
        "cluster": cluster_to_dict(cluster),
        "calibration": {t: c.to_dict() for t, c in sorted((checks or {}).items())},
        "network": None,
    }
    if network is not None:  # the fits, without the samples behind them
        out["network"] = network_to_dict(network)
        for fit in out["network"]["collectives"].values():
            del fit["samples"]
    for policy, result in search_policies(settings, profiles, cluster, network).items():
        if result.status != "ok":
            out["policies"][policy] = {"status": result.status, "message": result.message, "plan": None}
            continue
        plan = with_calibration(result.plan, checks) if checks else result.plan
        save_plan(plan, work / f"plan-{policy}.json")
        prediction = predict(plan, profiles, network)
        out["policies"][policy] = {
            "status": "ok",
            "message": result.message,
            "plan": plan_to_dict(plan),
            "predicted_busy_s": [float(t) for t in prediction.rank_busy_time_s],
            "predicted_compute_s": [float(t) for t in prediction.rank_compute_time_s],
            "predicted_boundary": {
                "communication_s": float(prediction.boundary_communication_s),
                "optimizer_step_s": float(prediction.optimizer_step_s),
                "boundary_s": float(prediction.boundary_s),
            },
            "predicted": {key: float(getattr(prediction, key)) for key in ("iteration_time_s", "samples_per_s")},
        }
        out["ideal_predicted"] = max(out.get("ideal_predicted", 0.0), plan.predicted.ideal_samples_per_s)
    model = profiles[0].model
    out["model"] = {"name": model.name, "num_parameters": model.num_parameters, "fingerprint": model.fingerprint}
    out["profiles"] = {
        p.device_type: {
            "curve": profile_curve(p),
            "max_micro_batch_size": p.max_micro_batch_size,
            "optimizer_step_time_s": p.optimizer_step_time_s,
            "provenance": {**p.measured_with, "emulated": p.emulated and dataclasses.asdict(p.emulated)},
        }
        for p in profiles
        if p.zero_stage == settings.zero_stage
    }
    return out


# --- Phase 3: training with each policy ---
class PolicyRun:
    """One poplar_ext engine and this rank's share of a plan; times whole iterations and their parts."""

    MEASURES = ("iteration_time_s", "busy_s", "boundary_wait_s", "step_s", "first_micro_step_s", "later_micro_step_s")
    """What `run_iteration` returns: the iteration (common start to the end of this rank's
    step); busy (until its boundary reduction, without it); the boundary reduction with
    its wait; the boundary ``engine.step`` (optimizer step, and at stages 1-2 the
    parameter all-gather); the first micro-step after an optimizer step and the median
    of the others (forward + backward, with the boundary reduction left out)."""

    def __init__(self, engine: Any, batch: torch.Tensor, accumulation_steps: int) -> None:
        self.engine = engine
        self.batch = batch
        self.accumulation_steps = accumulation_steps
        self._boundary_wait_s = 0.0
        inner = engine.deepspeed_engine  # poplar_ext.PoplarEngine wraps the real engine
        original = inner.allreduce_gradients  # the engine's: it ends the emulated window first
        slowdown = engine.emulated_compute

        def timed_allreduce(*args: Any, **kwargs: Any) -> Any:
            boundary = inner.is_gradient_accumulation_boundary()
            if slowdown is not None:
                # The engine ends the emulated window (and sleeps) here anyway; ending
                # it before the clock starts keeps that sleep out of the boundary wait.
                slowdown.stop()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                # Stages 0 and 1 communicate only here: the time spent in this call
                # is waiting for the other ranks (plus a small reduction), not work.
                if boundary:
                    self._boundary_wait_s += time.perf_counter() - start

        inner.allreduce_gradients = timed_allreduce

    def run_iteration(self) -> dict[str, float]:
        """One iteration from a common start: the `MEASURES`, in seconds."""
        self._boundary_wait_s = 0.0
        dist.barrier()
        start = time.perf_counter()
        micro_steps_s = []
        for _ in range(self.accumulation_steps):
            micro_start = time.perf_counter()
            loss = self.engine(self.batch)
            self.engine.backward(loss)
            backward_end = time.perf_counter()
            micro_steps_s.append(backward_end - micro_start)
            self.engine.step()
        end = time.perf_counter()
        micro_steps_s[-1] -= self._boundary_wait_s
        return {
            "iteration_time_s": end - start,
            "busy_s": backward_end - start - self._boundary_wait_s,
            "boundary_wait_s": self._boundary_wait_s,
            "step_s": end - backward_end,
            "first_micro_step_s": micro_steps_s[0],
            "later_micro_step_s": statistics.median(micro_steps_s[1:]) if len(micro_steps_s) > 1 else None,
        }


def train_rounds(
    settings: DemoSettings, runs: dict[str, PolicyRun], rank: int, bench: str = "demo"
) -> dict[str, dict[str, list[float]]]:
    """Every run in turn, `settings.rounds` times: each run's `PolicyRun.MEASURES` of every measured iteration."""
    measured: dict[str, dict[str, list[float]]] = {name: {key: [] for key in PolicyRun.MEASURES} for name in runs}
    for round_index in range(settings.rounds):
        for name, run in runs.items():
            # The runs share this process, and in one instrumented run the first
            # micro-steps after a switch took up to twice the CPU time of later ones (a
            # single-process check did not reproduce it). A job trains one engine
            # throughout, as the profiles were measured: warm up after every switch.
            for _ in range(settings.warmup_iterations):
                run.run_iteration()
            for _ in range(settings.iterations):
                for key, value in run.run_iteration().items():
                    measured[name][key].append(value)
            this_round = measured[name]["iteration_time_s"][-settings.iterations :]
            progress(
                f"round {round_index + 1}/{settings.rounds} {name}: {statistics.median(this_round):.2f} s per "
                "iteration (rank 0)",
                bench,
                rank,
            )
    return measured


def build_engine(settings: DemoSettings, cluster_path: Path, plan_path: Path) -> PolicyRun:
    """`poplar_ext.initialize` with this policy's plan, as a user's script would call it."""
    import poplar_ext

    plan = load_plan(plan_path)
    rank_plan = plan.ranks[dist.get_rank()]
    config = deepspeed_config(settings)
    # One thread (emulation times compute by the thread's CPU time) and the allocator
    # the profiler measured under: the demo owns its processes and asks for both.
    config["poplar"] = {
        "cluster": str(cluster_path),
        "plan": str(plan_path),
        "cpu_threads": 1,
        "steady_cpu_allocator": True,
        # Emulated compute is steady at the times of the profiles the plans were made from; each policy's plan
        # is measured as it is, never re-balanced.
        "profiles": str(settings.profiles_dir()),
        "rebalance": {"enabled": False},
    }
    model = make_model(settings)
    engine, _, _, _ = poplar_ext.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = _batch(settings, rank_plan.micro_batch_size).to(engine.device)
    return PolicyRun(engine, batch, rank_plan.gradient_accumulation_steps)


# --- Phase 4: standalone throughput (the measured ideal) ---
def standalone_sizes(profile: Profile) -> list[int]:
    """The micro-batch sizes whose standalone throughput is measured: the one of highest throughput on the
    profile's fitted curve and the largest. The curve is what the search plans with and what steady
    emulation runs at, so the ideal is measured on the same times as the plans; a raw sample that ran fast
    by chance (pooled away by the fit) would not be run at its own time, and a size between samples where
    the curve runs faster would be missed."""
    from poplar_ext.search.curves import fastest_size, fit_curve

    return sorted({fastest_size(fit_curve(profile).table()), profile.max_micro_batch_size})


def measure_standalone(
    settings: DemoSettings,
    cluster: Cluster,
    rank: int,
    profile: Profile,
    *,
    model: torch.nn.Module | None = None,
    make_batch: Callable[[int], Any] | None = None,
) -> list[dict[str, Any]]:
    """This rank's micro-step time on its own (forward + backward, emulated slowdown, no communication, so no
    waiting), `settings.standalone_repeats` times after one warm-up per size. The demo's toy GPT and batches
    unless `model` and ``make_batch(size)`` are given (a batch as the profiler gives it: `default_loss`).

    All ranks measure at the same time, as they train: the machine's shared caches and memory bandwidth are
    then as busy as during training, and the ideal is comparable with the training runs."""
    from poplar_ext.hardware.emulation import ComputeSlowdown, emulation_for_rank, micro_step_key, steady_reference
    from poplar_ext.profiler.measure import default_loss, move_to_device

    device = rank_device()
    slowdown = ComputeSlowdown(
        emulation_for_rank(cluster, rank),
        clock="cuda" if device.type == "cuda" else "thread",
        reference=steady_reference(profile),  # steady as in training
    )
    model = (model if model is not None else make_model(settings)).to(device)
    make_batch = make_batch or (lambda size: _batch(settings, size))
    sizes = standalone_sizes(profile)
    batches = {size: move_to_device(make_batch(size), device) for size in sizes}
    times: dict[int, list[float]] = {size: [] for size in sizes}
    # One size at a time, as the profiler and training run them: the first steps
    # after a change of size are slower (memory and caches laid out for the other),
    # and alternating sizes would make every step such a first one.
    for size in sizes:
        for repeat in range(settings.standalone_repeats + 1):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            slowdown.start(micro_step_key(size))
            default_loss(model, batches[size]).backward()
            slowdown.stop()
            if repeat:  # the first is a warm-up
                times[size].append(time.perf_counter() - start)
    dist.barrier()
    return [{"micro_batch_size": size, "micro_step_time_s": times[size]} for size in sizes]
