"""PoplarTrainer's resume decision, taken before anything is loaded (no process group, no Trainer built).

The Trainer resumes by its step count: the stream continues at the saved position when
the global batch is the checkpoint's, whatever the allocation or the number of ranks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers", reason="PoplarTrainer needs pip install 'poplar-ext[hf]'")

from poplar_ext.integrations.transformers import PoplarTrainer  # noqa: E402
from poplar_ext.plan.formats import plan_from_dict  # noqa: E402
from poplar_ext.runtime.checkpoint import history_entry, poplar_client_state, write_state  # noqa: E402
from poplar_ext.runtime.config import poplar_config_from_dict  # noqa: E402


def _plan(allocation: list[tuple[int, int]], stage: int = 1):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": stage,
            "global_batch_size": sum(b * s for b, s in allocation),
            "ranks": [
                {"rank": r, "device_type": "cpu", "micro_batch_size": b, "gradient_accumulation_steps": s}
                for r, (b, s) in enumerate(allocation)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
            "profile_fingerprints": {},
        },
        source="test",
    )


def _trainer(plan, output_dir: Path) -> SimpleNamespace:
    """What `_check_resume` reads of a PoplarTrainer."""
    config = poplar_config_from_dict({"plan": "p.json"}, base_dir=Path("."))
    trainer = SimpleNamespace(
        args=SimpleNamespace(output_dir=str(output_dir)),
        plan=plan,
        _train_sampler=None,
        job=SimpleNamespace(rank=0, poplar_config=config, plan_reason="the plan file p.json"),
        state=SimpleNamespace(global_step=0),
        _reshard_on_resume=False,
        poplar_engine=None,
    )
    trainer._plan_history = [history_entry(plan, start_step=0, data_position=0, reason="the plan file p.json")]
    trainer._poplar_state = lambda: PoplarTrainer._poplar_state(trainer)
    return trainer


def _checkpoint(output_dir: Path, plan, step: int) -> Path:
    state = poplar_client_state(plan, consumed_samples=step * plan.global_batch_size, seed=0, shuffle=True)
    state["step"] = step
    write_state(output_dir, f"checkpoint-{step}", state)
    return output_dir / f"checkpoint-{step}"


def test_fewer_ranks_with_the_same_global_batch_resume_resharded_and_recorded(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(3, 2), (2, 3)]), tmp_path)
    PoplarTrainer._check_resume(trainer, str(folder))
    assert trainer._reshard_on_resume
    assert "under another plan (3 ranks then, 2 now)" in trainer._plan_history[-1]["reason"]
    assert trainer._plan_history[-1]["start_step"] == 2


def test_the_same_number_of_ranks_needs_no_resharding(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(4, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(3, 2), (2, 3)]), tmp_path)
    PoplarTrainer._check_resume(trainer, True)  # the last checkpoint of output_dir
    assert not trainer._reshard_on_resume
    assert trainer._plan_history[-1]["reason"].startswith(f"resumed from {folder} under another plan")


def test_another_global_batch_is_refused(tmp_path):
    folder = _checkpoint(tmp_path, _plan([(2, 2), (2, 2), (4, 1)]), step=2)
    trainer = _trainer(_plan([(2, 2), (2, 3)]), tmp_path)
    with pytest.raises(ValueError, match="trained global batches of 12 samples, this job's plan has 10"):
        PoplarTrainer._check_resume(trainer, str(folder))
