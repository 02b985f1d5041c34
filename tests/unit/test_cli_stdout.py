"""Standard output that cannot be written, for every command line (poplar-search, poplar-profile, poplar-bench)
and their --help: its reader gone (``| head``) ends the program quietly, as SIGPIPE would; a full disk is one line
and status 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from poplar_ext.plan.formats import load_plan

pytestmark = pytest.mark.multiprocess  # every test here starts a process

# Each program's main, in a fresh interpreter; poplar-profile's and poplar-bench's work stubbed: what is
# tested is what their main does with the lines they print.
SEARCH = (
    "from poplar_ext.search.cli import main; "
    "sys.exit(main(['--example', '--global-batch-size', '512', '--output', 'plan.json']))"
)
PROFILE = (
    "from poplar_ext.profiler import cli; cli.parse_command = lambda argv: SimpleNamespace(cache_dir='p'); "
    "cli.run = lambda options: []; sys.exit(cli.main([]))"
)
BENCH = (
    "from poplar_bench import cli; from poplar_bench.commands._options import print_paths; "
    "args = SimpleNamespace(command='demo', run=lambda args: print_paths(['report.json'])); "
    "cli.build_parser = lambda: SimpleNamespace(parse_args=lambda argv: args); sys.exit(cli.main([]))"
)
RESHARD = (
    "from poplar_ext.runtime import reshard; reshard.convert_checkpoint = lambda source, target: target; "
    "sys.exit(reshard.main(['--input_folder', 'ckpt/t', '--output_folder', 'ckpt/t_universal']))"
)
ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = {
    "poplar-search": SEARCH,
    "poplar-profile": PROFILE,
    "poplar-bench demo": BENCH,
    "python -m poplar_ext.runtime.reshard": RESHARD,
}
# --help is output too (argparse's own print_help ignores a failed write and exits 0), a sub-command's included.
PROGRAMS |= {
    "poplar-search --help": "from poplar_ext.search.cli import main; sys.exit(main(['--help']))",
    "poplar-profile --help": "from poplar_ext.profiler.cli import main; sys.exit(main(['--help']))",
    "poplar-bench --help": "from poplar_bench.cli import main; sys.exit(main(['--help']))",
    "poplar-bench demo --help": "from poplar_bench.cli import main; sys.exit(main(['demo', '--help']))",
    "python -m poplar_ext.runtime.reshard --help": (
        "from poplar_ext.runtime.reshard import main; sys.exit(main(['--help']))"
    ),
}


def start(program: str, stdout, cwd, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a shell's buffered stdout
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # this checkout
    command = "import sys; from types import SimpleNamespace; " + PROGRAMS[program]
    argv = [sys.executable, "-c", command]
    return subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, env=env, cwd=cwd, **popen)


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_reader_that_leaves_early_ends_the_program_quietly(program, tmp_path):
    process = start(program, subprocess.PIPE, tmp_path)
    process.stdout.close()  # `program | head`: the reader gone before the output is printed
    err = process.stderr.read().decode()
    assert (process.wait(timeout=120), err) == (141, "")


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_full_disk_under_the_output_is_one_line_and_status_2(program, tmp_path):
    with open("/dev/full", "w") as full:
        process = start(program, full, tmp_path)
    err = process.stderr.read().decode()
    prog = program.removesuffix(" --help")
    assert (process.wait(timeout=120), err) == (2, f"{prog}: error: standard output: No space left on device\n")
    if program == "poplar-search":  # written before the table was printed: it stands
        assert load_plan(tmp_path / "plan.json").global_batch_size == 512


@pytest.mark.parametrize("program", [p for p in PROGRAMS if not p.endswith("--help")])
def test_a_closed_standard_output_prints_nothing_and_fails_nothing(program, tmp_path):
    """``program >&-``: Python's sys.stdout is None, where print writes nothing (argparse's help goes to
    stderr then)."""
    process = start(program, None, tmp_path, preexec_fn=lambda: os.close(1))
    err = process.stderr.read().decode()
    assert (process.wait(timeout=120), err) == (0, "")
    if program == "poplar-search":
        assert load_plan(tmp_path / "plan.json").global_batch_size == 512
