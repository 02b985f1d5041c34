"""What the run of `poplar-bench gpu` and its steps share: the run's settings (`GpuRunSettings`),
its log (`RunLog`), what each step gets (`StepContext`), the JSON-lines files steps append to."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STEPS = ("exact", "profile", "predictions", "launcher")  # the steps after the provenance, in order: evidence first

BUDGET_S = 390.0  # the whole command: with the wheels' install (~20 s) it ends within 7 minutes


@dataclass(frozen=True, kw_only=True)
class GpuRunSettings:
    """One `poplar-bench gpu` call."""

    output_dir: Path
    """Where the eight result files go (created)."""
    dry_run: bool = False
    """The same code paths on CPU with CPU stand-ins and tiny sizes (the test suite runs it)."""
    repo: Path = field(default_factory=Path.cwd)
    """The repository root: the exactness and launcher checks are its tests/gpu (default: the current directory)."""
    budget_s: float = BUDGET_S
    """Seconds the whole run may take; each step gets what is left, at most its limit."""
    steps: tuple[str, ...] = STEPS
    """Which steps run (a subset of `STEPS`, in that order)."""
    work_dir: Path | None = None
    """The ranks' logs, profile caches and plans (None: a new temporary folder, left in place)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"steps: expected some of {', '.join(STEPS)}, found {', '.join(unknown)}")
        if self.budget_s <= 0:
            raise ValueError(f"budget_s: expected a number of seconds > 0, found {self.budget_s!r}")


class RunLog:
    """``gpu_run.log``: every line with its time since the start, also on stderr."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.perf_counter()
        path.write_text("")

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def say(self, message: str) -> None:
        line = f"[poplar-bench gpu {self.elapsed_s():6.1f} s] {message}"
        with self.path.open("a") as log:
            log.write(line + "\n")
        print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What a step gets: the run's settings, its folders, its time limit and the log."""

    settings: GpuRunSettings
    work_dir: Path
    """This step's own folder for rank logs and caches (outside the output folder)."""
    timeout_s: float
    log: RunLog
    provenance: dict[str, Any]

    @property
    def out(self) -> Path:
        return self.settings.output_dir


def append_json_line(path: Path, record: dict[str, Any]) -> None:
    """`record` as one more line of the JSON-lines file `path` (kept if the run is stopped right after)."""
    with path.open("a") as lines:
        lines.write(json.dumps(record) + "\n")
