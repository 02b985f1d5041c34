"""The examples' command lines: a count below one is refused with the option named, and --help shows defaults."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

CASES = [
    ("train.py", "main", ["--steps", "-1"], "--steps: expected a positive integer, found -1"),
    ("pipeline_train.py", "main", ["--num-samples", "0"], "--num-samples: expected a positive integer, found 0"),
    ("pipeline_gpt.py", "main", ["--layers", "0"], "--layers: expected a positive integer, found 0"),
    ("hf_trainer.py", "main", ["--deepspeed", "x.json", "--steps", "0"], "--steps: expected a positive integer"),
    ("accelerate_diffusion.py", "parse_args", ["--max_train_steps", "0"], "--max_train_steps: expected a positive"),
    (
        "train.py",
        "main",
        ["--checkpoint-interval-steps", "0"],
        "--checkpoint-interval-steps: expected a positive integer, found 0",
    ),
    ("hf_trainer.py", "main", ["--deepspeed", "x.json", "--save-steps", "-1"], "--save-steps: expected 0 (never)"),
    ("accelerate_diffusion.py", "parse_args", ["--lr_warmup_steps", "0"], "--lr_warmup_steps: expected a positive"),
]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"poplar_example_{Path(name).stem}", EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("name", "entry", "argv", "message"), CASES, ids=[case[0] for case in CASES])
def test_a_count_below_one_is_refused_naming_the_option(name, entry, argv, message, monkeypatch, capsys):
    module = _load(name)
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exit_info:
        getattr(module, entry)()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_shows_the_defaults(monkeypatch, capsys):
    module = _load("train.py")
    monkeypatch.setattr(sys, "argv", ["train.py", "--help"])
    with pytest.raises(SystemExit):
        module.main()
    assert "(default: 20)" in capsys.readouterr().out


HELP_CASES = [
    ("hf_trainer.py", "main", ["--deepspeed", "x.json"], ["--steps", "--output-dir", "--save-steps"]),
    ("accelerate_diffusion.py", "parse_args", [], ["--output_dir", "--resolution", "--seed", "--checkpointing_steps"]),
    ("train.py", "main", [], ["--steps", "--checkpoint-interval-steps", "--lr", "--local_rank"]),
    ("pipeline_train.py", "main", [], ["--steps", "--num-samples", "--lr", "--local_rank"]),
    ("pipeline_gpt.py", "main", [], ["--steps", "--layers", "--local_rank"]),
    ("hf_trainer.py", "main", ["--deepspeed", "x.json"], ["--local_rank"]),
    ("accelerate_diffusion.py", "parse_args", [], ["--local_rank"]),
]


@pytest.mark.parametrize(("name", "entry", "argv", "options"), HELP_CASES, ids=[case[0] for case in HELP_CASES])
def test_help_explains_each_option_with_its_default_once(name, entry, argv, options, monkeypatch, capsys):
    # ArgumentDefaultsHelpFormatter shows a default only beside a help text, and adds it to one that has its own.
    module = _load(name)
    monkeypatch.setattr(sys, "argv", [name, *argv, "--help"])
    with pytest.raises(SystemExit):
        getattr(module, entry)()
    help_text = capsys.readouterr().out
    assert "(default " not in " ".join(help_text.split())
    entries = {item.split()[0]: " ".join(item.split()) for item in re.split(r"\n  (?=-)", help_text)[1:]}
    for option in options:
        assert "(default: " in entries[option], entries[option]
