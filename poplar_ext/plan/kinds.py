"""Which of the project's file formats a parsed JSON file is, told by the top-level keys only that format has: a file
given where another format is read is named for what it is, not reported as a misspelt key of the expected one.
See profiles/README.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import WrongFormatError


@dataclass(frozen=True)
class FileFormat:
    """One format: what messages call it, the class its reader builds, the top-level keys no other format has."""

    name: str
    reader: str
    keys: tuple[str, ...]


PROFILE = FileFormat("a profile", "Profile", ("max_micro_batch_size", "samples", "optimizer_step_time_s"))
LAYER_PROFILE = FileFormat("a layer profile", "LayerProfile", ("layers", "base_memory_bytes"))
CLUSTER = FileFormat("a cluster description", "Cluster", ("nodes", "device_types"))
PLAN = FileFormat("a plan", "Plan", ("ranks", "calibration"))
PIPELINE_PLAN = FileFormat("a pipeline plan", "PipelinePlan", ("pipelines", "num_layers"))
NETWORK = FileFormat("a network file", "NetworkProfile", ("cluster_key", "num_nodes", "backend", "collectives"))
DEEPSPEED_CONFIG = FileFormat(
    "a DeepSpeed config",
    "",  # read by DeepSpeed and the runtime (its poplar section), never by these readers
    (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "zero_optimization",
        "optimizer",
        "scheduler",
        "gradient_clipping",
        "fp16",
        "bf16",
        "amp",
        "poplar",
        "steps_per_print",
        "wall_clock_breakdown",
        "zero_allow_untested_optimizer",
    ),
)
POLICY_PLANS = FileFormat(
    "the JSON that poplar-search --policy all prints (a plan per policy: its 'poplar' entry is the plan, which "
    "--output writes alone)",
    "",  # never read: named where a plan is expected (it holds plans), and skipped beside profiles
    ("uniform", "proportional"),
)
PARALLELISM_PLANS = FileFormat(
    "the JSON that poplar-search --parallelism auto prints (its 'zero' and 'pipeline' plans: the one 'chosen' "
    "names is the plan, which --output writes alone)",
    "",
    ("chosen",),
)
SEARCH_OUTPUTS = (POLICY_PLANS, PARALLELISM_PLANS)
"""poplar-search's JSON of several plans: a file of one of them is a plan's kin, never one of the formats above."""
FORMATS = (PROFILE, LAYER_PROFILE, CLUSTER, PLAN, PIPELINE_PLAN, NETWORK, DEEPSPEED_CONFIG, *SEARCH_OUTPUTS)


def _keys_of(data: dict[str, Any], fmt: FileFormat) -> list[str]:
    """`fmt`'s own keys in `data` (a network file's ``kind`` counts, its value naming it)."""
    found = [key for key in fmt.keys if key in data]
    if fmt is DEEPSPEED_CONFIG and _keys_of(data, POLICY_PLANS):
        found = [key for key in found if key != "poplar"]  # the poplar policy's plan beside the others', no section
    return found + ["kind"] if fmt is NETWORK and data.get("kind") == "network" else found


def recognised(data: Any) -> FileFormat | None:
    """The one format whose own keys `data` has; None for no format, or keys of several (a broken file)."""
    if not isinstance(data, dict):
        return None
    matches = [fmt for fmt in FORMATS if _keys_of(data, fmt)]
    return matches[0] if len(matches) == 1 else None


def refuse_other_format(data: Any, source: str, reader: str) -> None:
    """Raise `WrongFormatError` where `data`, read to build a `reader`, clearly is another format's file (then it holds
    keys the reader does not know, whose closest known key would be a misleading suggestion)."""
    found = recognised(data)
    expected = next(fmt for fmt in FORMATS if fmt.reader == reader)
    if found is None or found is expected:
        return
    keys = sorted(_keys_of(data, found), key=str)
    shown = ", ".join(map(repr, keys[:3])) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    raise WrongFormatError(source, "(file)", expected.name, f"{found.name} (its keys {shown})")
