"""`poplar-bench pipeline`: its options and the call into the module that does the work (imported when it runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._options import add_output_dir, default_output_dir, print_paths


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "pipeline",
        help="the best ZeRO plan against the best pipeline plan on 2 emulated CPU nodes, slow and fast link",
        description=(
            "4 forked CPU ranks as 2 emulated nodes of 2 (emulated types 6x and 12x slower than a core), the toy "
            "pipeline MLP or a GPT-2 with tied embeddings (--model): profiled (whole model, network with the link "
            "in place), then a ZeRO job and a pipeline "
            "job whose plans are searched at start, each trained and timed against its prediction; with the link "
            "between the nodes capped (poplar_bench/link_emulation.py) and uncapped. Writes pipeline.json, "
            "pipeline.md and pipeline.png (pipeline_gpt.* with --model gpt; poplar_bench/pipeline_compare.py). "
            "Several minutes on a 2-core VM."
        ),
    )
    add_output_dir(p)
    p.add_argument("--work-dir", type=Path, default=None, help="profiles and rank logs (default: a temporary folder)")
    p.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="mlp: the toy pipeline MLP (default); gpt: a GPT-2 from its config, head tied to the embedding, "
        "token-mean loss (needs transformers)",
    )
    p.add_argument(
        "--repetitions",
        type=int,
        default=3,
        help="runs of both links, interleaved; the report gives each kind's median and every run (default 3)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import pipeline_compare

    paths = pipeline_compare.run_pipeline_bench(
        out_dir=args.output_dir or default_output_dir(),
        work_dir=args.work_dir,
        model=args.model,
        repetitions=args.repetitions,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    return print_paths(paths)
