"""``gpu_run.md``: the run's provenance and every step's outcome, readable."""

from __future__ import annotations

from typing import Any

from .provenance import provenance_line

WHAT_EACH_STEP_MEASURES = {
    "tests": "The GPU test tier (tests/gpu): ZeRO 0-3, three ranks with uneven micro-batches against one process on "
    "the global batch (fp32 <= 1e-5; bf16 against a bf16 reference, with the missing-loss-weight mutation shown to "
    "exceed the tolerance), the profiler on a real GPU, the deepspeed launcher with bf16.",
    "profiles": "A GPT-style model profiled in bf16 at every ZeRO stage with the profiler's real out-of-memory "
    "probe, then the same call again, which must come from the cache.",
    "policies": "uniform, proportional and poplar on ranks of different speed sharing the GPU: speedup, share of "
    "the measured ideal, prediction error, each rank's decomposition (gpu_policies.md).",
}


def render_summary(report: dict[str, Any]) -> str:
    from .profiles import profiles_markdown
    from .tier import tier_markdown

    provenance = report["provenance"]
    lines = [
        "# poplar-bench gpu" + (" (DRY RUN on CPU)" if report["dry_run"] else ""),
        "",
        f"- {provenance_line(provenance)}",
        f"- made {report['created_utc']}, part {report['part']}, {report['total_s']:.0f} s in all; load average "
        f"{report['machine'].get('load_average')}",
    ]
    render_step = {"tests": tier_markdown, "profiles": profiles_markdown, "policies": _policies_lines}
    for name, result in report["steps"].items():
        lines += ["", f"## {name}: {result['status']} ({result['seconds']:.1f} s)", "", WHAT_EACH_STEP_MEASURES[name]]
        if result.get("error"):
            lines += ["", "```", result["error"][-3000:], "```"]
        try:
            lines += [""] + render_step[name](result)
        except (KeyError, TypeError):
            lines += ["", "(no results to show)"]
    return "\n".join(lines) + "\n"


def _policies_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        f"Mode: {result['mode']}" + (f" (MPS not used: {result['why_not_mps']})" if result.get("why_not_mps") else ""),
        "",
        "| policy | status | samples/s measured | speedup over uniform | share of ideal | prediction error |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for policy, p in result["policies"].items():
        cells = [p["samples_per_s_measured"], p["speedup_over_uniform"], p["share_of_ideal"], p["prediction_error"]]
        shown = " | ".join("-" if c is None else f"{c:.3g}" for c in cells)
        lines.append(f"| {policy} | {p['status']} | {shown} |")
    return lines + ["", f"Full report: {', '.join(result['files'])}"]
