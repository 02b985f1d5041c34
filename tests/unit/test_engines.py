"""`poplar_ext.initialize` picks the engine: DeepSpeed pipelines for a PoplarPipelineModule, ZeRO for any
other model, with every argument handed on and none silently dropped."""

from __future__ import annotations

import pytest
import torch

import poplar_ext
from poplar_ext import engines
from poplar_ext.pipeline import initialize as pipeline_initialize
from poplar_ext.pipeline.module import PoplarPipelineModule
from poplar_ext.zero import initialize as zero_initialize


def _recording(calls: list, name: str):
    def stand_in(**kwargs):
        calls.append((name, kwargs))
        return ("engine", "optimizer", "loader", "scheduler")

    return stand_in


@pytest.fixture
def calls(monkeypatch) -> list:
    recorded: list = []
    monkeypatch.setattr(zero_initialize, "initialize", _recording(recorded, "zero"))
    monkeypatch.setattr(pipeline_initialize, "initialize_pipeline", _recording(recorded, "pipeline"))
    return recorded


def _pipeline_module() -> PoplarPipelineModule:
    return PoplarPipelineModule.__new__(PoplarPipelineModule)  # its type is all the choice reads


def test_the_package_initialize_is_the_engine_choice():
    assert poplar_ext.initialize is engines.initialize


def test_a_plain_model_goes_to_zero_with_every_argument(calls):
    model, toggle, loss_fn = torch.nn.Linear(2, 2), object(), object()
    result = poplar_ext.initialize(model=model, config={"x": 1}, loss_fn=loss_fn, checkpointing_toggle=toggle)
    assert result == ("engine", "optimizer", "loader", "scheduler")
    ((name, kwargs),) = calls
    assert name == "zero"
    assert kwargs["model"] is model and kwargs["loss_fn"] is loss_fn and kwargs["checkpointing_toggle"] is toggle
    assert kwargs["config"] == {"x": 1}


def test_a_pipeline_module_goes_to_the_pipeline_engine(calls):
    module, data = _pipeline_module(), [1, 2]
    poplar_ext.initialize(model=module, training_data=data, config_params={"y": 2})
    ((name, kwargs),) = calls
    assert name == "pipeline"
    assert kwargs["model"] is module and kwargs["training_data"] is data and kwargs["config_params"] == {"y": 2}
    assert not {"loss_fn", "checkpointing_toggle", "distributed_port"} & set(kwargs)


@pytest.mark.parametrize("argument", ["loss_fn", "checkpointing_toggle", "distributed_port"])
def test_a_pipeline_module_refuses_what_only_zero_uses(calls, argument):
    with pytest.raises(
        ValueError, match=rf"poplar_ext.initialize: {argument}: expected None for a PoplarPipelineModule"
    ):
        poplar_ext.initialize(
            model=_pipeline_module(), **{argument: 29500 if argument == "distributed_port" else object()}
        )
    assert calls == []
