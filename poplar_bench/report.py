"""Benchmark reports (JSON, markdown table, PNG figure): derives the comparisons and renders, measures nothing.
See docs/bench.md (reports: the layout)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import math
import os
import platform
import re
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import POLICIES, ZERO_STAGES, write_json_atomic


def progress(message: str, bench: str = "demo", rank: int = 0) -> None:
    """One progress line of `bench` on stderr (rank 0's only)."""
    if rank == 0:
        print(f"[poplar-bench {bench}] {message}", file=sys.stderr, flush=True)


POPLAR_SHARE_GOAL = 0.95  # the demo's goal: poplar's measured samples/s against the measured ideal (issue 15)
PREDICTION_ERROR_GOAL = 0.05  # every policy's predicted iteration time within this of the measured (issue 35)
OVERRUN_GOAL = 0.02  # emulated compute past its steady time, at most this share of it on every rank (else unsteady)

REPORT_SCHEMA = "poplar-bench-report/1"
_LIBRARIES = ("poplar-ext", "torch", "deepspeed", "numpy", "scipy", "matplotlib")


def machine_description() -> dict[str, Any]:
    """The machine a report was made on; library versions read without importing them."""
    versions = {name: _version(name) for name in _LIBRARIES}
    cpu_model = None
    with contextlib.suppress(OSError):  # not Linux: platform.processor() below is the fallback
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu_model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": None,
        # Other processes slow a CPU benchmark down; this says how busy the machine was
        # (1, 5 and 15 minute averages when the report was written).
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "libraries": versions,
        # Which code made the report: the checkout's commit (None where poplar-ext is not run from a checkout).
        "code": source_commit(),
    }


def source_commit() -> dict[str, Any] | None:
    """The commit checked out (HEAD) in the git checkout poplar_bench runs from, read from the repository's files
    (no git process); None outside a checkout or where HEAD cannot be read. Uncommitted changes are not seen."""
    root = Path(__file__).resolve().parents[1]
    with contextlib.suppress(OSError, ValueError):
        git_dir = root / ".git"
        if git_dir.is_file():  # a worktree or submodule: "gitdir: PATH"
            git_dir = (root / git_dir.read_text().split("gitdir:", 1)[1].strip()).resolve()
        if not git_dir.is_dir():
            return None
        common = git_dir
        if (git_dir / "commondir").is_file():  # a worktree's refs live in the main repository
            common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return {"commit": head, "ref": None}
        ref = head.split(":", 1)[1].strip()
        for base in (git_dir, common):
            if (base / ref).is_file():
                return {"commit": (base / ref).read_text().strip(), "ref": ref}
        if (common / "packed-refs").is_file():
            for line in (common / "packed-refs").read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return {"commit": parts[0], "ref": ref}
    return None


def code_text(machine: dict[str, Any] | None) -> str | None:
    """``code: commit SHA (the checkout's HEAD)`` from a report's machine;
    ``code: not a git checkout, poplar-ext VERSION`` without one; None for a report made before this was kept."""
    machine = machine or {}
    if "code" not in machine:
        return None
    code = machine["code"]
    if not code:
        return f"code: not a git checkout, poplar-ext {(machine.get('libraries') or {}).get('poplar-ext')}"
    return f"code: commit {code.get('commit')} (the checkout's HEAD)"


def code_lines(machine: dict[str, Any] | None) -> list[str]:
    """``- code: ...`` as a markdown list item (`code_text`), or nothing for an older report."""
    text = code_text(machine)
    return [] if text is None else [f"- {text}"]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def repetitions(values: list[float]) -> dict[str, Any]:
    """A measured figure: its median and every repetition."""
    if not values:
        raise ValueError("values: expected at least one repetition, found none")
    return {"median": statistics.median(values), "repetitions": list(values)}


def group_ranks(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge runs of consecutive ranks whose entries are equal apart from the rank number: each keeps the first
    ``rank`` and gets ``count``, so large simulated clusters stay a few entries long instead of thousands."""
    groups: list[dict[str, Any]] = []
    for entry in ranks:
        content = {k: v for k, v in entry.items() if k not in ("rank", "count")}
        if groups and {k: v for k, v in groups[-1].items() if k not in ("rank", "count")} == content:
            groups[-1]["count"] += entry.get("count", 1)
        else:
            groups.append({"rank": entry["rank"], "count": entry.get("count", 1), **content})
    return groups


def summarise_allocation(ranks: list[dict[str, Any]]) -> str:
    """``A100-80GB: 8x 12*2; A100-40GB: 8x 4*2`` (ranks x micro-batch*accumulation), per type."""
    groups: dict[str, Counter[tuple[int, int]]] = defaultdict(Counter)
    for r in ranks:
        groups[r["device_type"]][r["micro_batch_size"], r["gradient_accumulation_steps"]] += r.get("count", 1)
    return "; ".join(
        f"{device_type}: " + ", ".join(f"{count}x {mbs}*{gas}" for (mbs, gas), count in combos.items())
        for device_type, combos in groups.items()
    )


def _throughput(entry: dict[str, Any]) -> tuple[float | None, str]:
    """The policy's samples/s and whether it is measured or predicted (measured wins)."""
    if entry.get("measured"):
        return entry["measured"]["samples_per_s"], "measured"
    if entry.get("predicted"):
        return entry["predicted"]["samples_per_s"], "predicted"
    return None, "none"


def derive_comparisons(scenario: dict[str, Any]) -> dict[str, Any]:
    """Fill in prediction_error ((predicted - measured) / measured iteration time), speedup_over_uniform and
    share_of_ideal for each policy: measured figures against the measured ideal and uniform run, predicted ones
    (simulation) against the predicted."""
    entries = {e["policy"]: e for e in scenario["policies"]}
    uniform = entries.get("uniform")
    uniform_rate, uniform_kind = _throughput(uniform) if uniform and uniform["status"] == "ok" else (None, "none")
    ideal = scenario.get("ideal_samples_per_s") or {}
    for entry in scenario["policies"]:
        entry.update(prediction_error=None, speedup_over_uniform=None, share_of_ideal=None)
        if entry["status"] != "ok":
            continue
        rate, kind = _throughput(entry)
        if entry.get("measured") and entry.get("predicted"):
            measured_s = entry["measured"]["iteration_time_s"]["median"]
            entry["prediction_error"] = (entry["predicted"]["iteration_time_s"] - measured_s) / measured_s
        if uniform_rate and kind == uniform_kind:
            entry["speedup_over_uniform"] = rate / uniform_rate
        if ideal.get(kind):
            entry["share_of_ideal"] = rate / ideal[kind]
    return scenario


def goal_entry(goal: str, value: Any, target: str | None, met: bool) -> dict[str, Any]:
    """One goal of a report, evaluated (reported, never asserted)."""
    return {"goal": goal, "value": value, "target": target, "met": met}


def demo_goals(scenario: dict[str, Any]) -> list[dict[str, Any]]:
    """The demo's goals, evaluated (reported, never asserted)."""
    entries = {e["policy"]: e for e in scenario["policies"] if e["status"] == "ok"}
    poplar = entries.get("poplar")
    if poplar is None:
        return [goal_entry("poplar policy produced a plan", None, None, False)]
    share = poplar.get("share_of_ideal")
    met = share is not None and share >= POPLAR_SHARE_GOAL
    goals = [goal_entry("poplar share of the measured ideal", share, f">= {POPLAR_SHARE_GOAL}", met)]
    band = f"between -{PREDICTION_ERROR_GOAL:.2f} and +{PREDICTION_ERROR_GOAL:.2f}"
    for entry in entries.values():
        error = entry.get("prediction_error")
        met = error is not None and abs(error) <= PREDICTION_ERROR_GOAL
        goals.append(goal_entry(f"{entry['policy']} prediction error", error, band, met))
    overrun = scenario.get("emulation_overrun_share")
    if overrun is not None:
        what = "emulated compute past its steady time (largest share of any rank)"
        goals.append(goal_entry(what, overrun, f"<= {OVERRUN_GOAL}", overrun <= OVERRUN_GOAL))
    poplar_rate, _ = _throughput(poplar)
    for other in (p for p in POLICIES if p != "poplar" and p in entries):
        other_rate, _ = _throughput(entries[other])
        ratio, met = (poplar_rate / other_rate, poplar_rate > other_rate) if other_rate else (None, False)
        goals.append(goal_entry(f"poplar faster than {other}", ratio, "> 1 (ratio of samples/s)", met))
    return goals


def infeasible_entry(policy: str, status: str, message: str) -> dict[str, Any]:
    """A report entry for a policy without a plan."""
    return dict(policy=policy, status=status, message=message, zero_stage=None, ranks=[], predicted=None, measured=None)


def emulation_dict(emulation: Any) -> dict[str, Any] | None:
    """A device type's emulation as a report gives it (None: real)."""
    return emulation and {"slowdown": emulation.slowdown, "memory_capacity_bytes": emulation.memory_capacity_bytes}


def curve(points: Any) -> list[dict[str, float]]:
    """``(micro_batch_size, micro_step_time_s)`` pairs as a report's curve, with samples/s added."""
    return [{"micro_batch_size": b, "micro_step_time_s": t, "samples_per_s": b / t} for b, t in points]


def profile_curve(profile: Any) -> list[dict[str, float]]:
    """A profile's samples as a report's curve."""
    return curve((s.micro_batch_size, s.micro_step_time_s) for s in profile.samples)


# --- Markdown ---
def num_text(value: float | None, pattern: str = "{:.3g}") -> str:
    """`value` by `pattern` for a report's tables, "-" for none."""
    return "-" if value is None else pattern.format(value)


def _cell(text: Any) -> str:
    """Text for a markdown table cell: a bare '|' would end the cell."""
    return str(text).replace("|", "\\|")


def readme_table(report: dict[str, Any]) -> str:
    """The README's result table, made from a demo report (its first scenario): a test keeps the README's
    table equal to this one of bench/results/demo.json, so the README shows a run and not a memory of one."""
    lines = [
        "| policy | allocation (micro-batch x accumulation) | iteration s measured / predicted | samples/s | "
        "speedup over uniform | share of ideal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in report["scenarios"][0]["policies"]:
        if entry["status"] != "ok":
            lines.append(f"| {entry['policy']} | infeasible | - | - | - | - |")
            continue
        allocation = ", ".join(f"{r['micro_batch_size']}x{r['gradient_accumulation_steps']}" for r in entry["ranks"])
        measured_s = entry["measured"]["iteration_time_s"]["median"]
        lines.append(
            f"| {entry['policy']} | {allocation} | {measured_s:.2f} / {entry['predicted']['iteration_time_s']:.2f} | "
            f"{entry['measured']['samples_per_s']:.3g} | {num_text(entry.get('speedup_over_uniform'), '{:.2f}x')} | "
            f"{num_text(entry.get('share_of_ideal'), '{:.3f}')} |"
        )
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    """A readable summary: provenance first, then one table per scenario."""
    lines = _provenance_lines(report)
    for scenario in report["scenarios"]:
        lines += _scenario_lines(scenario)
    if report.get("scaling"):
        lines += render_scaling(report["scaling"])
    if report.get("checkpointing"):
        lines += render_checkpointing(report["checkpointing"])
    if report.get("offload"):
        lines += render_offload(report["offload"])
    if report.get("parallelism"):
        from .simulate_pipelines import render_parallelism  # here: it imports the simulation, which imports this

        lines += render_parallelism(report["parallelism"])
    return "\n".join(lines) + "\n"


def made_line(created_utc: str | None, machine: dict[str, Any] | None) -> str:
    """``- made WHEN on MACHINE (cpu, usable CPUs, GPUs, load average; python, torch, deepspeed)``."""
    machine = machine or {}
    libraries = machine.get("libraries") or {}
    load = machine.get("load_average")
    load_text = " / ".join(f"{x:.1f}" for x in load) + " (1 / 5 / 15 min)" if load else "unknown"
    return (
        f"- made {created_utc} on {machine.get('hostname')} ({machine.get('cpu')}, "
        f"{machine.get('usable_cpus')} usable CPUs, GPUs: {machine.get('gpus') or 'none'}, "
        f"load average {load_text}; "
        f"python {machine.get('python')}, torch {libraries.get('torch')}, "
        f"deepspeed {libraries.get('deepspeed')})" + (f"; {code}" if (code := code_text(machine)) else "")
    )


def summary_provenance(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """When and where a summary of demo reports was made: the last report's time and machine (pure)."""
    last = reports[-1] if reports else {}
    return {"created_utc": last.get("created_utc"), "machine": last.get("machine")}


def _provenance_lines(report: dict[str, Any]) -> list[str]:
    """The title, where the data comes from, the machine and libraries, the run's time, the notes."""
    lines = [
        f"# {report['title']}",
        "",
        f"- data: **{report['data_source']}**",
        made_line(report["created_utc"], report["machine"]),
    ]
    timings = report.get("timings_s") or {}
    if "total_s" in timings:
        lines.append(f"- the run took {timings['total_s']:.0f} s (imports {timings.get('import_s', 0):.0f} s)")
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    return lines


def _scenario_lines(scenario: dict[str, Any]) -> list[str]:
    """One scenario: what ran, the policies, where each rank's time went, the network, the goals."""
    lines = ["", f"## {scenario['name']}", "", _scenario_summary(scenario)]
    lines += _policy_table(scenario["policies"])
    lines += _busy_table(scenario["policies"])
    lines += _decomposition_table(scenario["policies"])
    if network := scenario.get("network"):
        fits = ", ".join(
            f"{name} {fit['bus_bandwidth_bytes_per_s'] / 1e9:.2f} GB/s + {fit['latency_s'] * 1e6:.0f} us/hop"
            for name, fit in network["collectives"].items()
        )
        where = f"{network['measured_with']['source']}, {network['backend']}, {network['world_size']} ranks"
        lines += ["", f"Network ({where}): {fits}."]
    if scenario.get("goals"):
        lines += ["", *goals_table(scenario["goals"])]
    return lines


def goals_table(goals: list[dict[str, Any]], pattern: str = "{:.3g}") -> list[str]:
    """The `goal_entry` goals as a markdown table, each value formatted with `pattern` (`goal_value_text`)."""
    lines = ["| goal | value | target | met |", "| --- | --- | --- | --- |"]
    for g in goals:
        met = "yes" if g["met"] else "NO"
        lines.append(f"| {_cell(g['goal'])} | {goal_value_text(g, pattern)} | {_cell(g['target'])} | {met} |")
    return lines


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def goal_value_text(goal: dict[str, Any], pattern: str = "{:.3g}") -> str:
    """A goal's value by `pattern`, with more digits where the rounded text would read as a bound of its target
    that the value is not (0.94997 against ">= 0.95" reads 0.94997, not 0.95, beside "missed")."""
    value = goal.get("value")
    text = num_text(value, pattern)
    if not isinstance(value, float) or not math.isfinite(value):
        return text
    bounds = {float(number) for number in _NUMBER.findall(str(goal.get("target") or ""))}
    digits = 4
    while digits <= 17 and value not in bounds and _parsed(text) in bounds:
        text = f"{value:.{digits}g}"
        digits += 1
    return text


def _parsed(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _scenario_summary(scenario: dict[str, Any]) -> str:
    devices = []
    for name, info in scenario["device_types"].items():
        e = info.get("emulation")
        emulation = f": slowdown {e['slowdown']:g}, memory {e['memory_capacity_bytes'] / 2**20:.0f} MiB" if e else ""
        devices.append(f"{name} ({info['source']}{emulation})")
    ideal = scenario.get("ideal_samples_per_s") or {}
    text = (
        f"{scenario['cluster']['world_size']} ranks: {', '.join(devices)}. Model {scenario['model']['name']} "
        f"({scenario['model']['num_parameters']:,} parameters). Global batch {scenario['global_batch_size']}. "
        f"Ideal samples/s: measured {num_text(ideal.get('measured'))}, predicted {num_text(ideal.get('predicted'))}."
    )
    if "profiles_from_cache" in scenario:
        text += " Profiles: " + (
            "reused from the cache." if scenario["profiles_from_cache"] else "measured in this run."
        )
    if scenario.get("emulation_overrun_share") is not None:
        text += (
            " Emulated compute steady at its profiles' times; past them: at most "
            f"{scenario['emulation_overrun_share'] * 100:.1f}% on any rank."
        )
    return text


def _policy_table(policies: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "| policy | ZeRO stage | allocation (ranks x micro-batch*accumulation) | iteration s measured | iteration "
        "s predicted | prediction error | samples/s measured | samples/s predicted | speedup over uniform | share "
        "of ideal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in policies:
        if e["status"] != "ok":
            lines.append(f"| {e['policy']} | - | infeasible: {e['message']} | - | - | - | - | - | - | - |")
            continue
        measured = e.get("measured") or {}
        predicted = e["predicted"]
        lines.append(
            f"| {e['policy']} | {e['zero_stage']} | {summarise_allocation(e['ranks'])} | "
            f"{num_text(measured.get('iteration_time_s', {}).get('median'))} | "
            f"{num_text(predicted['iteration_time_s'])} | "
            f"{num_text(e.get('prediction_error'), '{:+.1%}')} | {num_text(measured.get('samples_per_s'))} | "
            f"{num_text(predicted['samples_per_s'])} | {num_text(e.get('speedup_over_uniform'), '{:.2f}x')} | "
            f"{num_text(e.get('share_of_ideal'), '{:.2f}')} |"
        )
    return lines


def _ranks_with(policies: list[dict[str, Any]], key: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(policy entry, rank entry) for every rank of a feasible policy whose entry has `key`."""
    return [(e, r) for e in policies if e["status"] == "ok" for r in e["ranks"] if r.get(key)]


def _busy_table(policies: list[dict[str, Any]]) -> list[str]:
    """Each rank's measured busy time against the predicted ([] when nothing was measured)."""
    measured_ranks = _ranks_with(policies, "measured_busy_s")
    if not measured_ranks:
        return []
    lines = [
        "",
        "Per rank, busy time per iteration (its own micro-steps, without waiting for the others):",
        "",
        "| policy | rank | device type | micro-batch * accumulation | busy s measured (median) | busy s predicted |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for e, r in measured_ranks:
        lines.append(
            f"| {e['policy']} | {r['rank']} | {r['device_type']} | {r['micro_batch_size']} * "
            f"{r['gradient_accumulation_steps']} "
            f"| {num_text(r['measured_busy_s']['median'])} | {num_text(r['predicted_busy_s'])} |"
        )
    return lines


def _decomposition_table(policies: list[dict[str, Any]]) -> list[str]:
    """Where each rank's time goes, predicted against measured ([] when not recorded)."""
    decomposed = _ranks_with(policies, "decomposition")
    if not decomposed:
        return []
    lines = [
        "",
        "Where the time goes, per rank and iteration (seconds, medians; predicted / measured). Compute: the "
        "profile's micro-steps / the rank's busy time (micro-steps, with their communication at stages 2-3). "
        "Boundary: predicted collectives + optimizer step / measured reduction with the wait for the slowest "
        "rank + engine.step. First micro-step after an optimizer step / the others.",
        "",
        "| policy | rank | compute | micro-step comm. (pred.) | boundary comm. + optimizer step | "
        "reduction + wait / step (meas.) | first / other micro-step (meas.) | iteration |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e, r in decomposed:
        p, m = r["decomposition"]["predicted"], r["decomposition"]["measured"]
        lines.append(
            f"| {e['policy']} | {r['rank']} ({r['device_type']}) | {num_text(p['compute_s'])} / "
            f"{num_text(m['busy_s'])} "
            f"| {num_text(p['micro_step_communication_s'])} "
            f"| {num_text(p['boundary_communication_s'])} + {num_text(p['optimizer_step_s'])} "
            f"| {num_text(m['boundary_reduction_and_wait_s'])} / {num_text(m['step_s'])} "
            f"| {num_text(m['first_micro_step_s'])} / {num_text(m['later_micro_step_s'])} "
            f"| {num_text(p['iteration_time_s'])} / {num_text(m['iteration_time_s'])} |"
        )
    return lines


def render_checkpointing(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: poplar with the per-type activation checkpointing choice against poplar without (predicted)."""
    return _render_lever(
        rows,
        lever="activation_checkpointing",
        column="checkpointing on",
        title="Activation checkpointing per device type (poplar, predicted)",
        intro=(
            "Each type MODELLED without and with activation checkpointing (one more forward, 4/3 the FLOPs, one more "
            "weight all-gather at stage 3; each layer's input kept instead of its activations). Cells: samples/s "
            "without -> with the choice (gain), the types that checkpoint, and each type's micro-batch x steps."
        ),
    )


def render_offload(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: poplar with the per-type optimizer offload choice against poplar without (predicted)."""
    return _render_lever(
        rows,
        lever="optimizer_offload",
        column="offload on",
        title="Optimizer offload per device type (poplar, predicted)",
        intro=(
            "Each type MODELLED without and with its optimizer offloaded to the host at stages 1-2 (fp32 master "
            "weights and Adam's moments off the device; the boundary adds the host's Adam update at an assumed "
            "rate and the PCIe copies, see poplar_bench.gpu_model), without activation checkpointing. Cells: samples/s "
            "without -> with the choice (gain), the types that offload, and each type's micro-batch x steps."
        ),
    )


def _render_lever(rows: list[dict[str, Any]], *, lever: str, column: str, title: str, intro: str) -> list[str]:
    lines = ["", f"## {title}", "", intro]
    for row in rows:
        lines += [
            "",
            f"### {row['name']} ({row['world_size']} GPUs, global batch {row['global_batch_size']})",
            "",
            f"| stage | without | with the choice | gain | {column} | micro-batch x steps (with) |",
            "| --- | ---: | ---: | ---: | --- | --- |",
        ]
        for stage, cell in row["stages"].items():
            without, chosen = cell["without"], cell["with_choice"]
            on = ", ".join(t for t, v in chosen.get("types", {}).items() if v.get(lever)) or "none"
            shape = ", ".join(
                f"{t} {v['micro_batch_size']}x{v['gradient_accumulation_steps']}"
                for t, v in chosen.get("types", {}).items()
            )
            gain = "-" if cell["gain"] is None else f"{cell['gain']:.2f}x"
            lines.append(
                f"| {stage} | {_lever_rate(without)} | {_lever_rate(chosen)} | {gain} | "
                f"{on if chosen['status'] == 'ok' else '-'} | {shape} |"
            )
    return lines


def _lever_rate(c: dict[str, Any]) -> str:
    return f"{c['samples_per_s']:.1f} (stage {c['zero_stage']})" if c["status"] == "ok" else "infeasible"


def _stops_paying_text(rows: list[dict[str, Any]], stage: str, at: int | None) -> str:
    """Where `stage` stops paying, against the smallest cluster it can train on: a stage infeasible on the
    series' smallest clusters is measured from its own first feasible size, and one never feasible says so."""
    feasible = [row["world_size"] for row in rows if row["stages"][stage]["status"] == "ok"]
    if not feasible:
        return "infeasible at every size"
    if len(feasible) == 1 and len(rows) > 1:  # nothing to compare it with
        return f"feasible only at {feasible[0]} GPUs"
    text = "never (in this range)" if at is None else f"{at} GPUs"
    if feasible[0] != rows[0]["world_size"]:
        text += f" (against {feasible[0]} GPUs, its smallest feasible cluster)"
    return text


def render_scaling(series: list[dict[str, Any]]) -> list[str]:
    """Markdown: each stage alone as the cluster grows (see `poplar_bench.simulate.scaling_series`)."""
    rows = [row for item in series for row in item["rows"]]
    per_gpu = {row["global_batch_size"] / row["world_size"] for row in rows}
    batches = {row["global_batch_size"] for row in rows}
    if len(per_gpu) == 1 and next(iter(per_gpu)).is_integer():
        batch = f"{next(iter(per_gpu)):.0f} samples per GPU"
    else:
        batch = f"{next(iter(batches))} samples" if len(batches) == 1 else "each cluster's own"
    lines = [
        "",
        "## Each ZeRO stage as the cluster grows (poplar, predicted)",
        "",
        (
            "Samples/s per GPU, share of the ideal and, in brackets, the share of the iteration spent in communication "
            f"not hidden behind compute (stage 3 overlaps its backward collectives); global batch = {batch}."
        ),
    ]
    for item in series:
        lines += [
            "",
            f"### {item['name']}",
            "",
            "| GPUs | stage 0 | stage 1 | stage 2 | stage 3 | fastest |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in item["rows"]:
            cells = [
                "infeasible"
                if cell["status"] != "ok"
                else f"{cell['samples_per_s_per_gpu']:.3g} / {cell['share_of_ideal']:.2f} "
                f"({100 * cell['communication_share']:.0f}%)"
                for cell in (row["stages"][str(stage)] for stage in ZERO_STAGES)
            ]
            lines.append(f"| {row['world_size']} | {' | '.join(cells)} | {num_text(row['fastest_stage'], '{}')} |")
        stops = ", ".join(
            f"stage {stage}: {_stops_paying_text(item['rows'], stage, at)}"
            for stage, at in item["stops_paying_at_world_size"].items()
        )
        lines.append("")
        lines.append(f"Stops paying (per-GPU throughput below 0.9 of its smallest cluster's): {stops}.")
    return lines


# --- Figure ---
def render_figure(report: dict[str, Any], path: Path, *, featured: int = 0) -> None:
    """Device performance curves, per-rank time per iteration under each policy and,
    for multi-scenario reports, poplar's predicted speedup against world size."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window, work without a display
    import matplotlib.pyplot as plt

    scenarios = report["scenarios"]
    scenario = scenarios[featured]
    panels = 3 if len(scenarios) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.6))
    _plot_curves(axes[0], scenarios, scenario)
    _plot_rank_times(axes[1], scenario)
    if panels == 3:
        _plot_speedups(axes[2], scenarios)
    fig.suptitle(f"{report['title']}\n{report['data_source']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_curves(ax: Any, scenarios: list[dict[str, Any]], featured: dict[str, Any]) -> None:
    shown: set[str] = set()
    for scenario in [featured] + [s for s in scenarios if s["model"]["name"] == featured["model"]["name"]]:
        for device_type, points in scenario.get("curves", {}).items():
            if device_type in shown or not points:
                continue
            shown.add(device_type)
            source = scenario["device_types"].get(device_type, {}).get("source", "?")
            kind = scenario.get("curves_kind", "profile")
            (line,) = ax.plot(*_xy(points), marker="o", label=f"{device_type} ({source}), {kind}")
            profiled = scenario.get("profiled_curves", {}).get(device_type)
            if profiled:
                ax.plot(*_xy(profiled), linestyle=":", color=line.get_color(), label=f"{device_type} profile")
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("samples/s (one device, micro-steps only)")
    ax.set_title(
        f"device performance curves, {featured['model']['name']}\n(at the ZeRO stage of each scenario's poplar plan)",
        fontsize=9,
    )
    _legend(ax, 7)
    ax.grid(alpha=0.3)


def _xy(curve: list[dict[str, float]]) -> tuple[list[float], list[float]]:
    return [p["micro_batch_size"] for p in curve], [p["samples_per_s"] for p in curve]


def _plot_rank_times(ax: Any, scenario: dict[str, Any]) -> None:
    entries = [e for e in scenario["policies"] if e["status"] == "ok"]
    world_size = scenario["cluster"]["world_size"]
    per_rank = world_size <= 16
    width = 0.8 / max(1, len(entries))
    labels: list[str] = []
    for index, entry in enumerate(entries):
        if per_rank:
            labels = [
                f"r{r['rank']}"
                + (f"-{r['rank'] + r['count'] - 1}" if r.get("count", 1) > 1 else "")
                + f"\n{r['device_type']}"
                for r in entry["ranks"]
            ]
            measured = [(r.get("measured_busy_s") or {}).get("median") for r in entry["ranks"]]
            predicted = [r.get("predicted_busy_s") for r in entry["ranks"]]
        else:
            by_type: dict[str, list[dict[str, Any]]] = {}
            for r in entry["ranks"]:
                by_type.setdefault(r["device_type"], []).append(r)
            labels = list(by_type)
            predicted = [
                sum(r["predicted_busy_s"] * r.get("count", 1) for r in ranks) / sum(r.get("count", 1) for r in ranks)
                for ranks in by_type.values()
            ]
            measured = [None] * len(labels)
        xs = [i + (index - (len(entries) - 1) / 2) * width for i in range(len(labels))]
        has_measured = any(m is not None for m in measured)
        heights = [m if m is not None else 0.0 for m in measured] if has_measured else predicted
        bars = ax.bar(xs, heights, width=width, label=f"{entry['policy']} (stage {entry['zero_stage']})")
        if has_measured:
            ax.scatter(xs, predicted, marker="_", s=200, color="black", zorder=3)
        iteration = (entry.get("measured") or {}).get("iteration_time_s", {}).get("median")
        color = bars.patches[0].get_facecolor()
        ax.axhline(iteration or entry["predicted"]["iteration_time_s"], color=color, linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    what = (
        "bars: measured busy time, black: predicted"
        if any((r.get("measured_busy_s") or None) for e in entries for r in e["ranks"])
        else ("predicted busy time" + ("" if per_rank else ", mean per device type"))
    )
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"time per iteration per rank ({what};\ndashed: iteration time)\n{scenario['name']}", fontsize=8)
    _legend(ax, 7)
    ax.grid(alpha=0.3, axis="y")


def _plot_speedups(ax: Any, scenarios: list[dict[str, Any]]) -> None:
    series: dict[str, list[tuple[int, float]]] = {}
    for scenario in scenarios:
        poplar = next((e for e in scenario["policies"] if e["policy"] == "poplar"), None)
        if poplar is None or poplar.get("speedup_over_uniform") is None:
            continue
        key = f"{'+'.join(scenario['cluster']['type_counts'])}, {scenario['model']['name']}"
        series.setdefault(key, []).append((scenario["cluster"]["world_size"], poplar["speedup_over_uniform"]))
    for key, points in series.items():
        ax.plot(*zip(*sorted(points)), marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("poplar speedup over uniform (predicted)")
    ax.set_title("predicted speedup against cluster size", fontsize=9)
    _legend(ax, 6)
    ax.grid(alpha=0.3)


def _legend(ax: Any, fontsize: int) -> None:
    if ax.get_legend_handles_labels()[0]:  # an empty legend only warns
        ax.legend(fontsize=fontsize)


def write_json_and_markdown(
    report: Any,
    markdown: str,
    out_dir: str | os.PathLike[str],
    name: str,
    figure: Callable[[Any, Path], None] | None = None,
) -> list[Path]:
    """Write ``name.json`` (the report), ``name.md`` (`markdown`) and, with `figure` where matplotlib is
    installed, ``name.png`` (``figure(report, path)``) into `out_dir`; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    write_json_atomic(report, paths[0])
    paths[1].write_text(markdown, encoding="utf-8")
    if figure is not None and figure_available():
        paths.append(out_dir / f"{name}.png")
        figure(report, paths[-1])
    return paths


# What the PNG figure needs; the JSON and markdown reports need nothing beyond poplar-ext.
FIGURE_NEEDS = "matplotlib (pip install 'poplar-ext[bench]')"


def figure_available() -> bool:
    """Whether the PNG figure can be drawn here (matplotlib is an optional dependency)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(report: dict[str, Any], out_dir: str | os.PathLike[str], name: str) -> list[Path]:
    """Write ``name.json``, ``name.md`` and, where matplotlib is installed, ``name.png`` into
    `out_dir`; returns the paths written. Check `figure_available` before long work."""
    return write_json_and_markdown(report, render_markdown(report), out_dir, name, figure=render_figure)
