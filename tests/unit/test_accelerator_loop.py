"""PoplarAccelerator's counters around accelerate's loop: accumulate()'s micro-step counter after load_state
(one process, no process group; accelerate's own methods stubbed where they would need DeepSpeed's engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402

CONFIG = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}


@pytest.fixture
def accelerator(monkeypatch):
    """A PoplarAccelerator in a process that built no Accelerator before (accelerate's process-wide state reset)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # set, so that it is unset again afterwards
    AcceleratorState._reset_state(reset_partial_state=True)
    yield PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(CONFIG)))
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("saved_step", [2, 5, 0])
def test_load_state_counts_micro_steps_from_the_iteration_start(monkeypatch, accelerator, saved_step):
    # accelerate sets `step` from the checkpoint's RNG file: a multiple of the saved plan's count (2 under
    # counts of 2 when this plan counts 3), a micro-step inside an iteration (5: saved mid-iteration), or 0
    # (a rank the saved run did not have). The data resumes at an iteration start: 0 in every case.
    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        self.step = saved_step
        return "loaded"

    monkeypatch.setattr(Accelerator, "load_state", load_state)
    accelerator.gradient_accumulation_steps = 3
    accelerator._micro_steps_in_iteration = 2
    assert accelerator.load_state("checkpoint") == "loaded"
    assert (accelerator.step, accelerator._micro_steps_in_iteration) == (0, 0)
    assert accelerator.gradient_accumulation_steps == 3
