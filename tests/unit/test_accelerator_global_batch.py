"""What PoplarAccelerator gives the plan search at start: a plain Accelerator's global batch when no config sets one,
and the profiling loss_fn it was built with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

import torch  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402


@pytest.mark.parametrize(("split_batches", "expected"), [(False, 12 * 2 * 3), (True, 12 * 2)])
def test_the_default_global_batch_is_what_a_plain_accelerator_trains(split_batches, expected):
    # split_batches: a plain Accelerator cuts each DataLoader batch among its processes.
    accelerator = SimpleNamespace(gradient_accumulation_steps=2, num_processes=3, split_batches=split_batches)
    loader = torch.utils.data.DataLoader(list(range(100)), batch_size=12)
    request = PoplarAccelerator._default_global_batch(accelerator, {"poplar": {"profiles": "p"}}, loader)
    assert request.size == expected
    assert request.origin.startswith("the DataLoader's batch_size")


def test_loss_fn_reaches_the_automatic_modes_profiling(monkeypatch):
    # A diffusers-style model returns no loss from model(**batch): its loss_fn is what profiling calls.
    import poplar_ext.integrations.accelerate as integration

    def loss_fn(engine, batch):
        return engine(batch["x"]).pow(2).mean()

    given = {}
    monkeypatch.setattr(integration, "prepare_job", lambda loaded, **options: given.update(options) or "job")
    accelerator = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={"poplar": {}})),
        _default_global_batch=lambda ds_config, loader: None,
        _use_rank_config=lambda job: None,
        _profiling_loss_fn=loss_fn,
    )
    assert PoplarAccelerator._start_job(accelerator, torch.nn.Linear(2, 1), None, None) == "job"
    assert given["loss_fn"] is loss_fn


@pytest.mark.parametrize(
    ("plan_file", "batch_size", "steps", "warned"),
    [("p.json", 4, 4, True), ("p.json", 6, 1, False), (None, 4, 4, False)],
)
def test_a_plan_file_replacing_the_scripts_global_batch_is_said(
    monkeypatch, caplog, plan_file, batch_size, steps, warned
):
    # Documented (the plan's batch is trained), but a learning rate tuned for the script's may not fit it.
    import logging

    import poplar_ext.integrations.accelerate as integration

    # Without a plan file the plan was searched for the config's batch, which the user set (not the script's).
    job = SimpleNamespace(
        rank=0, plan=SimpleNamespace(global_batch_size=12), poplar_config=SimpleNamespace(plan=plan_file)
    )
    monkeypatch.setattr(integration, "prepare_job", lambda loaded, **options: job)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={"poplar": {"plan": "p.json"}})),
        gradient_accumulation_steps=steps,
        num_processes=2,
        split_batches=False,
        _default_global_batch=lambda ds_config, loader: None,
        _profiling_loss_fn=None,
    )
    # The real one sets this rank's plan count: the script's was read before.
    accelerator._use_rank_config = lambda job: setattr(accelerator, "gradient_accumulation_steps", 3)
    loader = torch.utils.data.DataLoader(list(range(100)), batch_size=batch_size)
    with caplog.at_level(logging.WARNING, logger=integration.logger.name):
        assert PoplarAccelerator._start_job(accelerator, torch.nn.Linear(2, 1), None, loader) is job
    expected = (
        "the plan's global batch of 12 samples replaces the 32 of the DataLoader's batch_size x "
        "gradient_accumulation_steps x processes (4 x 4 x 2)"
    )
    assert (expected in caplog.text) is warned, caplog.text
    assert ("replaces" in caplog.text) is warned


def test_a_training_dataloader_smaller_than_the_global_batch_is_refused_before_the_engine(monkeypatch):
    import poplar_ext.integrations.accelerate as integration

    job = SimpleNamespace(rank=0, plan=SimpleNamespace(global_batch_size=12), poplar_config=SimpleNamespace(plan=None))
    monkeypatch.setattr(integration, "prepare_job", lambda loaded, **options: job)
    accelerator = SimpleNamespace(
        state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config={"poplar": {}})),
        gradient_accumulation_steps=1,
        num_processes=2,
        split_batches=False,
        _default_global_batch=lambda ds_config, loader: None,
        _use_rank_config=lambda job: None,
        _profiling_loss_fn=None,
    )
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    message = r"^the training DataLoader: num_samples: expected at least the global batch \(12 samples\), found 5"
    with pytest.raises(ValueError, match=message):
        PoplarAccelerator._start_job(accelerator, torch.nn.Linear(2, 1), None, loader)
