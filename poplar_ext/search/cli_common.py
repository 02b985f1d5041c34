"""What every mode of `poplar-search` shares: its exit statuses, its tables, the network its options choose; every
CLI's standard output (its --help too) handled as a command-line tool's. See docs/search.md."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

from poplar_ext.plan import kinds
from poplar_ext.plan.errors import FormatError, WrongFormatError
from poplar_ext.plan.formats import Profile, load_profiles, read_json, write_json_atomic
from poplar_ext.plan.network_format import NETWORK_DIRECTORY, NetworkProfile, cluster_key, find_network, load_network
from poplar_ext.plan.pipeline_formats import layer_profiles_dir
from poplar_ext.plan.validation import closest

from .api import SearchResult, StageReport, predict

PROG = "poplar-search"
EXIT_OK = 0
EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 3
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program its output's reader left."""


class _StdoutFailed(Exception):
    """Writing standard output failed; its OSError is the cause (told apart from any other OSError)."""


class _WatchedStdout:
    """`sys.stdout` whose write and flush raise `_StdoutFailed` where they fail."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._checked(self._stream.write, text)

    def flush(self) -> None:
        self._checked(self._stream.flush)

    @staticmethod
    def _checked(method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except OSError as exc:
            raise _StdoutFailed from exc


def printing(prog: str, command: Callable[..., int], *args: Any) -> int:
    """`command(*args)`'s exit status, its standard output handled as a command-line tool's (every CLI's main):
    its reader gone (``| head``) ends it quietly with `EXIT_BROKEN_PIPE`, like a program ended by SIGPIPE;
    another failure to write it (a full disk) is one line on stderr and `EXIT_BAD_INPUT`. What `command` did
    before, a file written included, stands."""
    stdout = sys.stdout
    if stdout is None:  # started with stdout closed (``>&-``): print writes nothing, as without this guard
        return command(*args)
    sys.stdout = _WatchedStdout(stdout)
    try:
        status = command(*args)
        sys.stdout.flush()  # a failure found here, not in Python's own flush at exit
        return status
    except _StdoutFailed as failure:
        # What is left unwritten, Python's own flush at exit included, goes nowhere instead of failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        cause = failure.__cause__
        if isinstance(cause, BrokenPipeError):
            return EXIT_BROKEN_PIPE
        print(f"{prog}: error: standard output: {getattr(cause, 'strerror', None) or cause}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        sys.stdout = stdout


class CommandParser(argparse.ArgumentParser):
    """Every CLI's parser (its sub-commands' too): --help printed as the commands' output is, through `printing`,
    where argparse's own print_help ignores a failed write and exits 0."""

    def print_help(self, file: Any = None) -> None:
        status = printing(self.prog, lambda: argparse.ArgumentParser.print_help(self, file) or EXIT_OK)
        if status != EXIT_OK:
            self.exit(status)


def error(message: str) -> int:
    """``poplar-search: error: message`` on stderr; the bad-input exit status."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def bad_input(exc: ValueError, context: str, args: Any = None) -> int:
    """A `FormatError` (it names the file and field) as it is, another ValueError with the files in `context`; a file
    of another format given to an option of `args` (a profile as ``--cluster``) with the format that option takes."""
    if not isinstance(exc, FormatError):
        return error(f"{exc} ({context})")
    option = _OPTION_OF.get(exc.expected) if isinstance(exc, WrongFormatError) else None
    given = option is not None and getattr(args, option[2:], None) == exc.source
    return error(f"{exc}: pass {exc.expected} to {option}" if given else str(exc))


_OPTION_OF = {
    kinds.CLUSTER.name: "--cluster",
    kinds.NETWORK.name: "--network",
    kinds.PLAN.name: "--predict",
    kinds.PIPELINE_PLAN.name: "--predict",
}
"""The option that names a file of each format (a profile's is a folder: a file there is no option's)."""


def write_plan(data: dict[str, Any], path: str) -> bool:
    """Whether the plan's JSON could be written to `path` (when not, the error is printed)."""
    try:
        write_json_atomic(data, path)
    except OSError as exc:
        error(f"{path}: cannot write the plan: {exc.strerror or exc}{_unwritable_why(Path(path))}")
        return False
    return True


def _unwritable_why(path: Path) -> str:
    """What the OS error of writing `path` leaves unsaid: the file among its folders, or that it is a folder."""
    if path.is_dir():
        return f" (a folder: --output takes the plan's file name, e.g. {path / 'plan.json'})"
    blocking = next((parent for parent in path.parents if parent.exists()), None)
    return f" (its folder {blocking} is a file)" if blocking is not None and not blocking.is_dir() else ""


def emit(args: Any, plan: dict[str, Any], shown: Any, text: Callable[[], str]) -> int:
    """Write `plan` to ``--output`` (where given), then print `shown` as JSON or `text()`; the exit status."""
    if args.output and not write_plan(plan, args.output):
        return EXIT_BAD_INPUT
    print(json.dumps(shown, indent=2) if args.format == "json" else text())
    return EXIT_OK


def output_problem(args: Any) -> str | None:
    """Why ``--output`` may not be written: it names a file the run reads (the cluster, the network file, a file of
    the profile directory or its layers/ or network/ other than a plan), which the plan would replace."""
    output = Path(os.path.realpath(args.output))  # as write_plan resolves it
    if not output.is_file():
        return None
    profiles = Path(args.profiles)
    folders = [profiles, layer_profiles_dir(profiles), profiles / NETWORK_DIRECTORY]
    read = any(path and Path(path).is_file() and output.samefile(path) for path in (args.cluster, args.network))
    if read or (any(f.is_dir() and output.parent.samefile(f) for f in folders) and not _is_plan(output)):
        return f"--output: expected a file that is not one of the inputs, found {args.output}, which this run reads"
    return None


def _is_plan(path: Path) -> bool:
    try:
        data = read_json(path)
    except FormatError:
        return False
    return isinstance(data, dict) and ("ranks" in data or "pipelines" in data)


def model_profiles(args: Any) -> list[Profile]:
    """``--profiles``' profiles; with ``--model``, that model's alone (a folder may hold several models', as the
    automatic mode's cache does)."""
    return of_model(args, load_profiles(args.profiles), args.profiles)


def of_model(args: Any, profiles: list[Any], folder: Any) -> list[Any]:
    """`profiles` (whole-model or layer profiles, read from `folder`) of ``--model``'s model; all without it."""
    if getattr(args, "model", None) is None:
        return profiles
    chosen = [p for p in profiles if args.model in (p.model.name, p.model.fingerprint)]
    # A model is its fingerprint: its profiles under another name (one measured by the automatic mode) go with it.
    fingerprints = {p.model.fingerprint for p in chosen}
    chosen = [p for p in profiles if p.model.fingerprint in fingerprints]
    if not chosen:
        chosen = _of_fingerprint_prefix(args.model, profiles)
    there = ", ".join(sorted({f"{p.model.name} ({p.model.fingerprint})" for p in chosen or profiles}))
    if not chosen:
        raise ValueError(f"--model: expected the name or fingerprint of a model in {folder}, found "
                         f"{args.model!r}; there: {there}")  # fmt: skip
    if len({p.model.fingerprint for p in chosen}) > 1 and args.model not in {p.model.name for p in chosen}:
        raise ValueError(f"--model: {args.model!r} begins the fingerprints of several models in {folder}: {there}; "
                         "expected more of one")  # fmt: skip
    return chosen


FINGERPRINT_PREFIX_MIN = 8
"""The fewest hex digits of a fingerprint ``--model`` takes: the 8 that profile file names show."""


def _of_fingerprint_prefix(wanted: str, profiles: list[Any]) -> list[Any]:
    """`profiles` whose fingerprint's digits begin with `wanted` (with or without its ``sha256:``), as a profile's
    file name shows them; none for a shorter `wanted`."""
    digits = wanted.split(":")[-1].lower()
    if len(digits) < FINGERPRINT_PREFIX_MIN:
        return []
    return [p for p in profiles if p.model.fingerprint.split(":")[-1].lower().startswith(digits)]


def note_unused_types(args: Any, profiles: Sequence[Any], cluster: Any) -> None:
    """A note on stderr for profiles of a type the cluster lacks but nearly names (a misspelt ``device_type``):
    the search ignores them, as it does a folder's other GPUs'. A type whose every (stage, memory levers) the
    nearly named one has profiled too stands for nothing that is missing: another GPU of a folder that holds
    several (the automatic mode's cache: V100-16GB's or A100-40GB's beside a cluster of A100-80GB), no note."""
    types = list(cluster.type_counts())
    settings: dict[str, set[tuple[int, Any]]] = {}
    for profile in profiles:
        settings.setdefault(profile.device_type, set()).add((profile.zero_stage, profile.levers))
    for stranger in sorted(set(settings) - set(types)):
        close = closest(stranger, types)
        if close is not None and not settings[stranger] <= settings.get(close, set()):
            print(
                f"{PROG}: note: {args.profiles} has profiles of {stranger!r}, a device type the cluster does not "
                f"have (not used): a misspelt {close!r}?",
                file=sys.stderr,
            )


def note_mixed_config_keys(args: Any, profiles: Sequence[Any], cluster: Any) -> None:
    """A note on stderr where the cluster's profiles were measured under several DeepSpeed configs (their
    ``measured_with.ds_config_fingerprint``: the optimizer and the config's fields that change a step's time or
    memory): a job re-measuring under its own config (the automatic mode) keys some stages anew, and the search
    would compare stages measured under different optimizers without a word. With ``--zero-stage N`` only
    stage N's profiles are searched, so only theirs count."""
    types = set(cluster.type_counts())
    stage = getattr(args, "zero_stage", "auto")
    keys: dict[str, set[int]] = {}
    for profile in profiles:
        key = profile.measured_with.get("ds_config_fingerprint")
        searched = stage == "auto" or profile.zero_stage == stage
        if profile.device_type in types and isinstance(key, str) and searched:
            keys.setdefault(key, set()).add(profile.zero_stage)
    if len(keys) > 1:
        found = "; ".join(f"{key} at ZeRO stage {', '.join(map(str, sorted(keys[key])))}" for key in sorted(keys))
        print(
            f"{PROG}: note: {args.profiles} holds profiles measured under {len(keys)} DeepSpeed configs "
            f"(measured_with.ds_config_fingerprint: {found}): their stages are compared as they are; profile "
            "again with the job's config (optimizer included) for a like-for-like comparison",
            file=sys.stderr,
        )


def labelled(text: str, profiles: Sequence[Any], types: Sequence[str], *, under_table: bool = False) -> str:
    """`text` (a table's headline block, a blank line, the rest) with a line after its headline block where the
    profiles of `types` it was priced from are modelled (``measured_with.source``), as the shipped example's are,
    and one where they were measured on emulated devices (their ``emulated`` field): nothing else in the table
    tells an analytic model's times, or an emulated device's, from a real device's measured ones. The lines name
    no device type (a table's rows are told by theirs). `under_table`: the first block is a table (``--policy
    all``'s comparison), and the lines go apart from its rows."""
    priced = set(types)
    modelled = {p.device_type for p in profiles if p.source == "modelled" and p.device_type in priced}
    emulated = {p.device_type for p in profiles if p.emulated is not None and p.device_type in priced}
    lines = []
    if modelled:
        lines.append(
            f'Profiles: MODELLED{_of_types(modelled, priced)} (measured_with.source "modelled": an analytic '
            "model's times, not measured on a device); the predictions rest on that model."
        )
    if emulated:
        lines.append(
            f"Profiles: EMULATED{_of_types(emulated, priced)} (their emulated field: measured on other hardware, "
            "its compute slowed down and its memory capped to stand for the device type); the predictions are "
            "for the emulated devices, not for real ones."
        )
    if not lines:
        return text
    label = "\n".join(lines)
    head, blank, rest = text.partition("\n\n")
    before = blank if under_table else "\n"
    return f"{head}{before}{label}{blank}{rest}"


def _of_types(labelled_types: set[str], priced: set[str]) -> str:
    """`` for k of n device types`` where a label holds for some of the priced types only; '' for all."""
    return "" if labelled_types == priced else f" for {len(labelled_types)} of {len(priced)} device types"


def chosen_network(args: Any, cluster: Any) -> NetworkProfile | None:
    """The network file the options name: none with ``--no-network``, ``--network FILE``, else the one in
    ``--profiles`` measured on `cluster` (none without a cluster)."""
    if args.no_network:
        return None
    if args.network:
        network = load_network(args.network)
        measured = network.measured_with.get("source") != "modelled"  # a modelled one is for any cluster
        if measured and cluster is not None and network.cluster_key != cluster_key(cluster):
            # Allowed (pricing a cluster not measured yet), but its fits are another network's: say so.
            print(
                f"{PROG}: note: --network {args.network} was measured on another cluster "
                f"({network.world_size} ranks, {network.num_nodes} node(s), {network.backend}); its collectives are "
                f"priced for this one's {cluster.world_size} ranks as if its network were the same",
                file=sys.stderr,
            )
        return network
    return None if cluster is None else find_network(args.profiles, cluster)


def idle_text(busy_s: float, span_s: float) -> str:
    """The idle column of every table: the share of `span_s` (before the boundary: the slowest rank's busy time,
    or the slowest pipeline's 1F1B time) a rank busy for `busy_s` waits; the boundary is shown apart."""
    return f"{100 * (1 - busy_s / span_s):.1f}%"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def rank_span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def runs(items: Sequence[Any], key: Callable[[Any], Any]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive `items` alike under `key` (end excluded)."""
    ends = list(itertools.accumulate(len(list(group)) for _, group in itertools.groupby(items, key)))
    return list(zip([0, *ends[:-1]], ends))


def or_dash(value: float | None, shown: str) -> str:
    return "-" if value is None else format(value, shown)


def stage_table(reports: Sequence[StageReport], *, with_batch: bool = True) -> str:
    """One row per evaluated ZeRO stage: status, (global batch,) prediction, reason."""
    rows = [["stage", "status", *(["global batch"] if with_batch else []), "iteration s", "samples/s", "reason"]]
    for report in reports:
        batch = [or_dash(report.global_batch_size, "d")] if with_batch else []
        rows.append(
            [str(report.zero_stage), report.status, *batch, or_dash(report.iteration_time_s, ".4g")]
            + [or_dash(report.samples_per_s, ".4g"), report.reason]
        )
    return table(rows)


def plan_table(result: SearchResult, profiles: Sequence, network: NetworkProfile | None = None) -> str:
    """Groups of consecutive ranks with the same device type and allocation, and the stage reports."""
    plan = result.plan
    assert plan is not None
    busy = predict(plan, profiles, network).rank_busy_time_s
    slowest = max(busy)
    # A column per memory lever only where some rank uses it.
    checkpointing = any(r.activation_checkpointing for r in plan.ranks)
    offload = any(r.optimizer_offload for r in plan.ranks)
    rows = [
        ["ranks", "device type", "micro-batch", "accumulation", "samples/iter", "busy s/iter", "idle"]
        + (["checkpointing"] if checkpointing else [])
        + (["optimizer offload"] if offload else [])
    ]
    alike = attrgetter("device_type", "micro_batch_size", "gradient_accumulation_steps", "levers")
    for start, end in runs(plan.ranks, alike):
        first = plan.ranks[start]
        rows.append(
            [rank_span(start, end - 1), first.device_type, str(first.micro_batch_size)]
            + [str(first.gradient_accumulation_steps), str(first.samples_per_iteration), f"{busy[start]:.4g}"]
            + [idle_text(busy[start], slowest)]
            + (["on" if first.activation_checkpointing else "off"] if checkpointing else [])
            + (["on" if first.optimizer_offload else "off"] if offload else [])
        )
    text = [result.message, "", table(rows)]
    if len(result.stage_reports) > 1:
        text += ["", stage_table(result.stage_reports)]
    return "\n".join(text)


def comparison_table(results: dict[str, SearchResult]) -> str:
    """One row per policy: stage, batch, predicted time and throughput, against poplar."""
    rows = [["policy", "status", "stage", "global batch", "iteration s", "samples/s", "of ideal", "poplar speed-up"]]
    reference = results["poplar"].plan
    for name, result in results.items():
        plan = result.plan
        if plan is None:
            versus = result.message
        elif name == "poplar" or reference is None:
            versus = "-"
        else:
            versus = f"{reference.predicted.samples_per_s / plan.predicted.samples_per_s:.2f}x"
        rows.append(plan_row(name, "ok", plan, versus))
    return table(rows)


def plan_row(name: str, status: str, plan: Any, last: str) -> list[str]:
    """A row of a plan's ZeRO stage, global batch and prediction (`last` closes it); ``infeasible`` for no plan."""
    if plan is None:
        return [name, "infeasible", "-", "-", "-", "-", "-", last]
    p = plan.predicted
    share = f"{100 * p.samples_per_s / p.ideal_samples_per_s:.1f}%"
    times = [f"{p.iteration_time_s:.4g}", f"{p.samples_per_s:.4g}", share]
    return [name, status, str(plan.zero_stage), str(plan.global_batch_size), *times, last]
