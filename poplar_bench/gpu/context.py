"""What each step of `poplar-bench gpu` gets (`StepContext`), and the JSON-lines files steps append to."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import GpuRunSettings, RunLog


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
