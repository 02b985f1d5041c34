"""`poplar-search`: profiles + cluster (+ global batch) -> plan; parse, load, search, print, write.
See docs/search.md."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from poplar_ext.plan.formats import (
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_SIZE,
    MAX_WORLD_SIZE,
    POLICIES,
    load_cluster,
    plan_to_dict,
)

from .api import search_plan
from .cli_common import (
    EXIT_BAD_INPUT,
    EXIT_INFEASIBLE,
    EXIT_INTERNAL_ERROR,
    PROG,
    CommandParser,
    bad_input,
    chosen_network,
    comparison_table,
    emit,
    error,
    labelled,
    model_profiles,
    note_mixed_config_keys,
    note_unused_types,
    output_problem,
    plan_table,
    printing,
)
from .examples import example_cluster_file, example_profiles_dir
from .pipeline_cli import run_pipelines
from .pipeline_sizing import MAX_SUMSET
from .policies import AUTO_ACCUMULATION_STEPS
from .predict_cli import run_predict

DESCRIPTION = """\
Search per-rank micro-batch sizes and gradient-accumulation counts for a DeepSpeed
ZeRO job on a cluster that mixes device types, and predict its iteration time.

Inputs (JSON, documented field by field with units in profiles/README.md):
  --profiles DIR   every *.json in DIR is a profile: one model on one device type at
                   one ZeRO stage (micro-step time and peak memory per micro-batch).
  --cluster FILE   the nodes and their devices; ranks are numbered in node order.
Output: a plan (per-rank micro_batch_size and gradient_accumulation_steps, the ZeRO
stage, the predicted iteration time), printed as a table or as JSON and, with
--output, written to a file.
"""

EPILOG = f"""\
Without --global-batch-size the global batch with the highest predicted throughput is
chosen, up to --max-global-batch-size or, without it, up to {AUTO_ACCUMULATION_STEPS}
micro-steps of every rank at its largest micro-batch.
With --policy all, every policy is run and compared; the poplar plan is the one
written to --output, and --json (--format json) prints an object mapping each policy to its
plan (null when infeasible).

With --parallelism pipeline the plan is pipelines side by side (each the ranks of its
stages, each stage's layers, the pipeline's micro-batch size and count; format in
profiles/README.md), searched from the layer profiles in DIR/layers/; the table shows
each stage's rank, device type, layers, busy time and idle share of the iteration.
With --parallelism auto both are searched at the same global batch and the faster
predicted plan is the one printed and written. It needs a network file (--network, or
the one in DIR/network/ measured on the cluster) and refuses to run without one: the
choice turns on communication (ZeRO's collectives against a pipeline's transfers and
all-reduces), which without one is priced for neither side alike (ZeRO keeps the
collectives its profiles measured, pipelines would send everything for free).
There --json (--format json) prints an object: "chosen" ("zero" or "pipeline") and each
search's plan under "zero" and "pipeline" (null when infeasible); --output writes the
chosen plan alone, which --predict and training read.

With --predict PLAN no search runs: the plan (ZeRO or pipeline, told apart by its
file) is priced from the profiles and the network file, and the table shows where each
rank's time goes: compute, communication or activation transfers, the boundary, idle.
Without --cluster (or --network) no network file is found: a ZeRO boundary is then shown
as profiled, its optimizer step and collectives not told apart, and so is a stage 2-3
micro-step's compute and communication ("-").

exit status:
  0  a plan was found (and written, with --output)
  1  infeasible: no plan satisfies the constraints; the reason is on stderr
  2  bad input: an unreadable or invalid file (the message names the file and the
     field), an unknown device type, or bad arguments; or an output that cannot be
     written (--output, or standard output on a full disk)
  3  an internal error of poplar-search (a bug: please report it with the output of
     --debug, which shows the traceback)
  141  the output's reader left before all of it was printed (e.g. | head), as a
     program ended by SIGPIPE; what it did before, writing --output included, stands
No output file is written, not even partly, unless the exit status is 0, 141, or 2 for
a standard output that could not be written (the plan is written before it is printed).

Limits (what the search is built for): global batches up to {MAX_GLOBAL_BATCH_SIZE} (with pipelines up to
{MAX_SUMSET}), micro-batches up to {MAX_MICRO_BATCH_SIZE} samples, clusters up to {MAX_WORLD_SIZE} ranks; larger
values are bad input.
"""


class _OneLineErrorParser(CommandParser):
    """Argument errors as one line and exit status 2, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def parse_positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}")
    return value


def parse_global_batch_size(text: str) -> int:
    """argparse type: a positive integer within the search's limit (a larger one is the option's error)."""
    value = parse_positive_int(text)
    if value > MAX_GLOBAL_BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_GLOBAL_BATCH_SIZE} (the search's limit), found {text!r}"
        )
    return value


def parse_path(text: str) -> str:
    """argparse type: a path, not empty (an unset variable in ``--output "$PLAN"`` would otherwise be ignored)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a path, found ''")
    return text


def parse_zero_stage(text: str) -> int | str:
    """argparse type: `auto` or a ZeRO stage 0..3."""
    if text not in ("auto", "0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"expected auto, 0, 1, 2 or 3, found {text!r}")
    return text if text == "auto" else int(text)


def build_parser(subparsers: argparse._SubParsersAction | None = None) -> argparse.ArgumentParser:
    """The `poplar-search` parser; standalone, or added as a sub-command to `subparsers`."""
    options = dict(description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    if subparsers is None:
        parser = _OneLineErrorParser(prog=PROG, **options)
    else:
        parser = subparsers.add_parser("search", help="search a plan from profiles and a cluster", **options)
    parser.add_argument(
        "--profiles", type=parse_path, metavar="DIR", help="directory of profile JSON files (required unless --example)"
    )
    parser.add_argument(
        "--cluster",
        type=parse_path,
        metavar="FILE",
        help="cluster description JSON file (required unless --example; optional with --predict, but without it "
        "the network file in --profiles is not found, so unless --network names one the network is not priced "
        "apart)",
    )
    parser.add_argument(
        "--example",
        action="store_true",
        help="the shipped example: MODELLED profiles of GPT-2 small on 4 A100-80GB + 4 V100-16GB "
        "and their cluster, for --profiles and --cluster where those are not given",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="the model whose profiles to plan from, by its name or fingerprint, where --profiles holds several "
        "models' (the automatic mode's cache does); default: the folder's one model. A fingerprint may be cut "
        "to its first 8 or more digits, as profile file names show it. A model is its fingerprint: a name picks "
        "its profiles under other names too (the automatic mode names them by the model's class)",
    )
    parser.add_argument(
        "--global-batch-size",
        type=parse_global_batch_size,
        metavar="N",
        help="samples per iteration over all ranks (default: the best predicted throughput)",
    )
    parser.add_argument(
        "--max-global-batch-size",
        type=parse_global_batch_size,
        metavar="N",
        help="upper bound for the automatic global batch",
    )
    parser.add_argument(
        "--zero-stage",
        type=parse_zero_stage,
        default="auto",
        metavar="auto|0|1|2|3",
        help="ZeRO stage; auto evaluates every stage that has profiles and keeps the fastest (default)",
    )
    parser.add_argument(
        "--policy",
        choices=(*POLICIES, "all"),
        default="poplar",
        help="poplar: fastest predicted allocation (default); uniform: DeepSpeed's one micro-batch "
        "for all; proportional: Whale's throughput-proportional shares; all: compare them. Where DIR "
        "holds a type's profiles with memory levers (activation checkpointing, optimizer offload: "
        "poplar-profile), poplar also chooses them per device type (at ZeRO 3 one checkpointing setting for "
        "all); uniform and proportional take each type's first profiled setting, no lever where profiled so",
    )
    parser.add_argument(
        "--parallelism",
        choices=("zero", "pipeline", "auto"),
        default="zero",
        help="zero: every rank holds the model, ZeRO data parallelism (default); pipeline: pipelines of stages side "
        "by side (layer profiles from DIR/layers/, ZeRO stage 0 or 1, needs --global-batch-size); auto: both, the "
        "faster predicted plan is written, the table shows both (needs a network file: see below)",
    )
    network = parser.add_mutually_exclusive_group()
    network.add_argument(
        "--network",
        type=parse_path,
        metavar="FILE",
        help="collective times (a network file, see profiles/README.md): communication is then priced for the "
        "cluster's world size; default: the network file in --profiles measured on this cluster, if there is one",
    )
    network.add_argument(
        "--no-network", action="store_true", help="ignore any network file: the boundary is the profiles' measured one"
    )
    parser.add_argument(
        "--predict",
        type=parse_path,
        metavar="PLAN",
        help="price this plan (ZeRO or pipeline) instead of searching one: where each rank's time goes, from "
        "--profiles (and DIR/layers/ for a pipeline plan) and the network file; --cluster is optional here, but "
        "without it (or --network) the network is not priced apart: a ZeRO boundary is shown as profiled, its "
        "optimizer step and collectives not told apart",
    )
    parser.add_argument(
        "--output",
        type=parse_path,
        metavar="PLAN.json",
        help="write the (poplar) plan here (its folder made if missing), only on success; never over an input file",
    )
    output_format = parser.add_mutually_exclusive_group()
    # No default value: argparse refuses two of a group only when the value given is not the default object.
    output_format.add_argument("--format", choices=("table", "json"), help="what to print (default: table)")
    output_format.add_argument(
        "--json", dest="format", action="store_const", const="json", help="print JSON: the same as --format json"
    )
    parser.add_argument("--debug", action="store_true", help="on an internal error, print the traceback")
    return parser


# -- main
def run(args: argparse.Namespace) -> int:
    """Run a parsed command line; returns the exit status."""
    if args.example:
        args.profiles = args.profiles or str(example_profiles_dir())
        args.cluster = args.cluster or str(example_cluster_file())
    # --predict needs no cluster.
    missing = [
        o for o, value in (("--profiles", args.profiles), ("--cluster", args.cluster or args.predict)) if not value
    ]
    if missing:
        return error(
            f"the following arguments are required: {', '.join(missing)} (or --example for the shipped example) "
            "(see --help)"
        )
    if args.predict:
        given = {
            "--global-batch-size": args.global_batch_size is not None,
            "--max-global-batch-size": args.max_global_batch_size is not None,
            "--zero-stage": args.zero_stage != "auto",
            "--policy": args.policy != "poplar",
            "--parallelism": args.parallelism != "zero",
            "--output": args.output is not None,
        }
        ignored = [option for option, is_given in given.items() if is_given]
        if ignored:
            return error(f"{', '.join(ignored)}: not used with --predict, which prices the plan as it is (see --help)")
        return run_predict(args)
    batch, most = args.global_batch_size, args.max_global_batch_size
    if batch is not None and most is not None and batch > most:
        # Every mode's: the option's error, not the input files' (the pipeline search itself never reads the bound).
        return error(
            f"--global-batch-size: expected at most --max-global-batch-size ({most}), found {batch} (see --help)"
        )
    problem = args.output and output_problem(args)
    if problem:
        return error(f"{problem} (see --help)")
    if args.parallelism != "zero":
        return run_pipelines(args)
    try:
        profiles = model_profiles(args)
        cluster = load_cluster(args.cluster)
        note_unused_types(args, profiles, cluster)
        note_mixed_config_keys(args, profiles, cluster)
        network = chosen_network(args, cluster)
        policies = list(POLICIES) if args.policy == "all" else [args.policy]
        results = {
            policy: search_plan(
                profiles,
                cluster,
                global_batch_size=args.global_batch_size,
                zero_stage=args.zero_stage,
                policy=policy,
                max_global_batch_size=args.max_global_batch_size,
                network=network,
            )
            for policy in policies
        }
    except ValueError as exc:
        return bad_input(exc, f"profiles: {args.profiles}, cluster: {args.cluster}", args)
    # With --policy all, poplar's plan is the one reported on and written.
    main_result = results["poplar" if args.policy == "all" else args.policy]
    if not main_result.ok:
        print(f"{PROG}: infeasible: {main_result.message}", file=sys.stderr)
        return EXIT_INFEASIBLE
    data = plan_to_dict(main_result.plan)
    every = {name: None if r.plan is None else plan_to_dict(r.plan) for name, r in results.items()}

    def text() -> str:
        plan = plan_table(main_result, profiles, network)
        shown = plan if len(results) == 1 else comparison_table(results) + "\n\nPlan of the poplar policy:\n" + plan
        return labelled(shown, profiles, list(cluster.type_counts()), under_table=len(results) > 1)

    return emit(args, data, data if len(results) == 1 else every, text)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `poplar-search`; returns the exit status (0 ok, 1 infeasible, 2 bad input, 3 a bug)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argument error (2, already printed)
        return int(exc.code or 0)
    try:
        return printing(PROG, run, args)  # a reader gone or a full disk under stdout: not a bug
    except Exception as exc:  # noqa: BLE001 - anything run() did not expect is a bug: say so in one line
        if args.debug:
            traceback.print_exc()
        print(
            f"{PROG}: internal error: {type(exc).__name__}: {exc} (a bug in poplar-search; "
            "run again with --debug for the traceback and report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
