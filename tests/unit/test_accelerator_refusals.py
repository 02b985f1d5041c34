"""What PoplarAccelerator refuses when it is built ends a restarting launcher's job (one process, no DeepSpeed)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

from accelerate.state import AcceleratorState  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """accelerate's process-wide state, as a process that built no Accelerator has it, before and after."""
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_an_accelerator_without_deepspeed_ends_a_restarting_launchers_job(monkeypatch, fresh_accelerate_state):
    # The same at every restart: the launcher is asked to end the job instead of restarting it.
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    with pytest.raises(
        ValueError, match=r"PoplarAccelerator: expected DeepSpeed .* found DistributedType.NO"
    ) as refused:
        PoplarAccelerator(cpu=True)
    assert ended == [refused.value]
