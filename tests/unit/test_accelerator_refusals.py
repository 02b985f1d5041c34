"""What PoplarAccelerator and its prepare refuse ends a restarting launcher's job (one process, no process group)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

from _dataset_checks import Settling, counted_dataset_checks  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402


@pytest.fixture
def fresh_accelerate_state(monkeypatch):
    """accelerate's process-wide state, as a process that built no Accelerator has it, before and after."""
    # Set, so that it is unset again after a DeepSpeed Accelerator set it.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
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


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(8)


@pytest.mark.parametrize(
    ("args", "device_placement", "match"),
    [
        # A training DataLoader in a prepare after the one that settled the plan.
        (
            (torch.utils.data.DataLoader(_Stream()),),
            None,
            r"^the training DataLoader: expected a map-style dataset .* found _Stream, which has no indices to split: "
            r"the plan's sampler cuts range\(len\(dataset\)\)",
        ),
        # accelerate's own refusal of what prepare is given.
        ((torch.nn.Linear(2, 1),), [True], "customize device placements with DeepSpeed"),
    ],
)
def test_what_prepare_is_given_ends_a_restarting_launchers_job(
    monkeypatch, fresh_accelerate_state, args, device_placement, match
):
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}
    accelerator = PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    accelerator.job = object()  # settled by an earlier prepare (a collective: none in one process here)
    with pytest.raises(ValueError, match=match) as refused:
        accelerator.prepare(*args, device_placement=device_placement)
    assert ended == [refused.value]


def test_the_first_prepare_names_the_dataloader_it_was_given(monkeypatch, fresh_accelerate_state):
    # Refused before the plan is settled, in the words of what accelerate was given (no training_data,
    # no engine.rank_plan: poplar_ext.initialize's words).
    import poplar_ext.integrations.accelerate as integration

    def settle(*args, **kwargs):
        raise AssertionError("the job was settled")

    monkeypatch.setattr(integration, "prepare_job", settle)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}
    accelerator = PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(ValueError, match=r"^the training DataLoader: expected a map-style dataset") as refused:
        accelerator.prepare(torch.nn.Linear(2, 1), torch.utils.data.DataLoader(_Stream()))
    assert "training_data" not in str(refused.value)


def test_the_first_prepare_checks_the_training_data_once(monkeypatch, fresh_accelerate_state):
    # Checked where prepare takes the training DataLoader, for the first prepare (which settles the plan) and a later
    # one alike; prepare_job (stubbed here: a one-rank job) checks none (poplar_ext.initialize checks its own).
    from pathlib import Path
    from types import SimpleNamespace

    import poplar_ext.integrations.accelerate as integration
    from poplar_ext.plan.formats import plan_from_dict
    from poplar_ext.runtime.config import poplar_config_from_dict

    ranks = [{"rank": 0, "device_type": "cpu", "micro_batch_size": 2, "gradient_accumulation_steps": 2}]
    predicted = {"iteration_time_s": 1.0, "samples_per_s": 4.0, "ideal_samples_per_s": 4.0}
    plan = {"schema_version": 1, "policy": "uniform", "zero_stage": 1, "global_batch_size": 4, "ranks": ranks}
    job = SimpleNamespace(
        plan=plan_from_dict({**plan, "predicted": predicted, "profile_fingerprints": {}}, source="test"),
        rank=0,
        poplar_config=poplar_config_from_dict({"plan": "plan.json"}, base_dir=Path(".")),
    )
    checked = []

    def check(dataset, what, **options):
        checked.append(what)

    class Settled(Exception):
        """The training DataLoader is the plan's: the engine is built next."""

    def set_up_rank(*args, **kwargs):
        raise Settled

    monkeypatch.setattr(integration, "check_plan_dataset", check)
    monkeypatch.setattr(integration, "prepare_job", lambda *args, **kwargs: job)
    monkeypatch.setattr(integration, "set_up_rank", set_up_rank)
    monkeypatch.setattr(PoplarAccelerator, "_use_rank_config", lambda self, job: None)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}
    accelerator = PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(Settled):
        accelerator.prepare(torch.nn.Linear(2, 1), torch.utils.data.DataLoader(list(range(8))))
    assert checked == ["the training DataLoader"]


def test_the_training_data_is_checked_once_with_prepare_job(monkeypatch, fresh_accelerate_state):
    # prepare_job runs (up to the process group): the data set prepare checked, in its own words, is not checked
    # again in poplar_ext.initialize's words.
    import poplar_ext.integrations.accelerate as integration

    checked = counted_dataset_checks(monkeypatch, integration)
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}
    accelerator = PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(Settling):
        accelerator.prepare(torch.nn.Linear(2, 1), torch.utils.data.DataLoader(list(range(8))))
    assert checked == ["the training DataLoader"]


def test_a_deepspeed_config_without_the_poplar_section_names_accelerates_accelerator(fresh_accelerate_state):
    # The refusal told an accelerate script to "use deepspeed.initialize for a run without one": what runs such a
    # script without poplar-ext is accelerate's own Accelerator.
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 1}}
    accelerator = PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    with pytest.raises(ValueError) as refused:
        accelerator.prepare(torch.nn.Linear(2, 1), torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    message = str(refused.value)
    assert message.startswith("DeepSpeed config: expected a top-level 'poplar' section ({} for the automatic mode")
    assert message.endswith("; use accelerate's Accelerator (not PoplarAccelerator) for a run without one")
    assert "deepspeed.initialize" not in message
