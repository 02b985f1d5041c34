"""``gpu_run.md``: the run's provenance and every step's outcome, readable."""

from __future__ import annotations

from typing import Any

from .provenance import provenance_line

WHAT_EACH_STEP_MEASURES = {
    "exact": "Three ranks sharing the GPU, uneven plan, ZeRO 0-3, against one process on the global batch: fp32 "
    "within 1e-5 of plain torch; bf16 against one DeepSpeed rank in bf16, with the missing-loss-weight mutation "
    "shown to exceed the tolerance at stages 0 and 3 (exact.jsonl).",
    "profile": "A GPT of ~136M parameters profiled in bf16 at ZeRO 1 and 3 with the profiler's real out-of-memory "
    "probe, then the same call again, which must come from the cache (profile_trials.jsonl: a line per trial).",
    "predictions": "uniform, proportional and poplar on two ranks sharing the GPU, one an emulated 3x slower type: "
    "measured against predicted, share of the measured ideal (predictions.md).",
    "launcher": "The deepspeed launcher with bf16 and the cluster read from the hardware.",
}


def render_summary(report: dict[str, Any]) -> str:
    from .policies import predictions_markdown
    from .profiles import profiles_markdown
    from .tier import exactness_markdown

    provenance = report["provenance"]
    lines = [
        "# poplar-bench gpu" + (" (DRY RUN on CPU)" if report["dry_run"] else ""),
        "",
        f"- {provenance_line(provenance)}",
        f"- compute capability {provenance.get('compute_capability') or '-'}; torch built for "
        f"{', '.join(provenance.get('torch_arch_list') or []) or '-'}",
        f"- made {report['created_utc']}, {report['total_s']:.0f} s in all (budget {report['budget_s']:.0f} s); "
        f"load average {report['machine'].get('load_average')}",
    ]
    render_step = {
        "exact": exactness_markdown,
        "profile": profiles_markdown,
        "predictions": predictions_markdown,
        "launcher": lambda result: [],
    }
    for name, result in report["steps"].items():
        lines += ["", f"## {name}: {result['status']} ({result['seconds']:.1f} s)", "", WHAT_EACH_STEP_MEASURES[name]]
        if result.get("reason"):
            lines += ["", f"Skipped: {result['reason']}."]
        if result.get("error"):
            lines += ["", "```", result["error"][-3000:], "```"]
        try:
            lines += [""] + render_step[name](result)
        except (KeyError, TypeError):
            lines += ["", "(no results to show)"]
    return "\n".join(lines) + "\n"
