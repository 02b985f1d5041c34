"""What several `poplar-bench` commands share: where reports go, the figure check, option types."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from poplar_ext.search.cli import parse_positive_int

_BENCH_DIR = Path(__file__).resolve().parents[1]
"""poplar_bench/: its parent is the checkout in an editable install."""

OUTPUT_HELP = (
    "directory for the report files (default: bench/results of the poplar-ext checkout when "
    "poplar-ext is installed from a checkout, as with `pip install -e .`, from whatever directory "
    "you run it; otherwise the current directory)"
)


def checkout_root() -> Path | None:
    """The checkout poplar_bench runs from (an editable install), or None (installed as a package)."""
    return _BENCH_DIR.parent if (_BENCH_DIR.parent / "pyproject.toml").is_file() else None


def default_output_dir() -> Path:
    """``bench/results`` of the checkout when running from one (an editable install),
    otherwise the current directory."""
    results = _BENCH_DIR.parent / "bench" / "results"
    if (_BENCH_DIR.parent / "pyproject.toml").is_file() and results.is_dir():
        return results
    return Path.cwd()


def check_output_dir(path: Path) -> None:
    """Refuse, before any work, an ``--output-dir`` the reports could not be written into: a file, or a folder
    (or the nearest existing folder above one to be made) this user cannot write. ValueError names it."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--output-dir: expected a directory for the report files, found a file: {path}")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--output-dir: expected a directory for the report files, found a file: {existing}")
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_write_in(existing):
        what = "a directory" if existing == path else f"{path}, to be made in a directory"
        raise ValueError(f"--output-dir: expected {what} this user can write, found {existing} not writable")


def _can_write_in(folder: Path) -> bool:
    """Whether a file can be made in `folder`: for root `os.access` says yes even of /proc or a read-only mount."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def warn_if_no_figure(command: str) -> None:
    """Say at the start, not after minutes of work, that the figure will be missing."""
    from ..report import FIGURE_NEEDS, figure_available

    if not figure_available():
        print(
            f"poplar-bench {command}: the PNG figure needs {FIGURE_NEEDS}, which is not installed; "
            "the JSON and markdown reports are written without it",
            file=sys.stderr,
            flush=True,
        )


def print_paths(paths: Iterable[Path] | None) -> int:
    """Print the files a command wrote, one a line; its exit code, 0."""
    for path in paths or []:
        print(path)
    return 0


def add_positive_int(
    parser: argparse.ArgumentParser, flag: str, default: int, help: str, action: type[argparse.Action] | None = None
) -> None:
    """An integer option >= 1 whose help ends with its default (`Given` as `action`: recorded when given)."""
    more = {} if action is None else {"action": action}
    parser.add_argument(flag, type=parse_positive_int, default=default, help=f"{help} (default {default})", **more)


class Given(argparse.Action):
    """Store the value, as ``store`` does, and record the option in ``given_options``: whether it was given, for
    options another option makes meaningless (a default cannot tell)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 (argparse's signature)
        setattr(namespace, self.dest, values)
        namespace.given_options = frozenset(getattr(namespace, "given_options", frozenset())) | {option_string}


def refuse_ignored(command: str, args: argparse.Namespace, mode: str, ignored: Iterable[str], why: str) -> bool:
    """Say on stderr, as argparse's errors read, that the given options among `ignored` have no effect `mode`
    ("with --fixed"), and `why`; whether any was given."""
    given = [flag for flag in ignored if flag in getattr(args, "given_options", frozenset())]
    if given:
        verb = "has" if len(given) == 1 else "have"
        print(f"poplar-bench {command}: error: {' and '.join(given)} {verb} no effect {mode} ({why})", file=sys.stderr)
    return bool(given)


def file_stem(text: str) -> str:
    """``--name``: the reports' file stem (NAME.json, NAME.md, NAME.png in --output-dir), a plain file name."""
    if not text or text in (".", "..") or text.startswith(".") or any(sep in text for sep in ("/", "\\", "\0")):
        raise argparse.ArgumentTypeError(
            f"expected a file name without a folder or a leading dot (NAME.json, NAME.md in --output-dir), "
            f"found {text!r}"
        )
    return text


def add_cache_dir(parser: argparse.ArgumentParser, help: str) -> None:
    """The ``--cache-dir`` of the commands that profile (default None: each command's own)."""
    parser.add_argument("--cache-dir", type=Path, default=None, help=help)


def add_output_dir(parser: argparse.ArgumentParser) -> None:
    """The ``--output-dir`` every report-writing command takes (default: `default_output_dir`)."""
    parser.add_argument("--output-dir", type=Path, default=None, help=OUTPUT_HELP)
