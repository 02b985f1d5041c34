"""examples/hf_trainer.py resumes only from a checkpoint whose save finished: a restart after a node lost during
the first save starts afresh instead of failing on the half-written checkpoint at every restart."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


def _resume_argument(tmp_path, monkeypatch):
    """What main passes to `train` as resume_from_checkpoint for output directory tmp_path/out (nothing built)."""
    spec = importlib.util.spec_from_file_location("poplar_example_hf_trainer_resume", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    passed = []

    class Trainer:
        def __init__(self, **_):
            pass

        def train(self, resume_from_checkpoint=None):
            passed.append(resume_from_checkpoint)

    monkeypatch.setattr(example, "PoplarTrainer", Trainer)
    monkeypatch.setattr(example, "TrainingArguments", lambda **kwargs: kwargs)
    monkeypatch.setattr(example, "GPT2LMHeadModel", lambda config: None)
    monkeypatch.setattr(example, "RandomSequences", lambda *args: None)
    argv = ["hf_trainer.py", "--deepspeed", "ds.json", "--save-steps", "4", "--output-dir", str(tmp_path / "out")]
    monkeypatch.setattr(sys, "argv", argv)
    example.main()
    return passed[0]


def test_a_checkpoint_whose_save_stopped_is_not_resumed(tmp_path, monkeypatch):
    assert _resume_argument(tmp_path, monkeypatch) is None
    # What a rank killed inside the first save left (seen: SIGKILL in DeepSpeed's write of checkpoint-4): resumed
    # with True, every restart failed on it ("expected a whole checkpoint, found a save into it that did not finish").
    stopped = tmp_path / "out" / "checkpoint-4"
    (stopped / "global_step4.saving").mkdir(parents=True)
    (stopped / "model.safetensors").touch()
    assert _resume_argument(tmp_path, monkeypatch) is None
    (tmp_path / "out" / "checkpoint-2").mkdir()
    (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert _resume_argument(tmp_path, monkeypatch) is True
