"""A ZeRO-0 pipeline checkpoint's optimizer state per parameter (issue 34), without a process group.

Two stages of a toy model step their own Adam and write what DeepSpeed's pipeline engine
writes per stage (``mp_rank_<stage>_model_states.pt``: the torch state_dict, and the
parameters' names poplar-ext records); the conversion writes each parameter's states, and
an optimizer over another split of the layers loads its own, equal to those saved. States
that are not per parameter, and a checkpoint without the names, are refused before anything
is written. A ZeRO-1 stage's flat partitions are read from the file DeepSpeed names
(``bf16_zero_pp_rank_0_...`` in bf16).
"""

from __future__ import annotations

import pytest
import torch

from poplar_ext.models.toy_pipeline import mse, toy_sequential
from poplar_ext.pipeline.checkpoint import UNIVERSAL_FOLDER
from poplar_ext.pipeline.replan import (
    PARAMETER_SHAPES_KEY,
    convert_pipeline_checkpoint,
    load_parameter_states,
)

SAVED_SPLIT = [[0, 1], [2, 3]]


def _named(model, layers):
    return [(name, p) for name, p in model.named_parameters() if int(name.split(".")[0]) in layers]


def _save_stages(tag_dir, *, names=True, extra_state=None):
    """Two stages of one step of Adam each, as DeepSpeed's pipeline engine saves them; returns the model and
    each parameter's saved state."""
    model = toy_sequential(dim=3, num_layers=4)
    generator = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(5, 3, generator=generator), torch.randn(5, 1, generator=generator)
    mse(model(inputs), labels).backward()
    folder = tag_dir / "pipeline0"
    folder.mkdir(parents=True)
    states = {}
    for stage, layers in enumerate(SAVED_SPLIT):
        named = _named(model, layers)
        optimizer = torch.optim.Adam([p for _, p in named], lr=0.01)
        optimizer.step()
        states.update({name: dict(optimizer.state[p]) for name, p in named})
        saved = {"optimizer": optimizer.state_dict()}
        if extra_state is not None and stage == 1:
            saved["optimizer"]["state"][0][extra_state[0]] = extra_state[1]
        if names:
            saved[PARAMETER_SHAPES_KEY] = [{name: list(p.shape) for name, p in named}]
        torch.save(saved, folder / f"mp_rank_{stage:02d}_model_states.pt")
    return model, states


def test_another_split_loads_each_parameters_saved_state(tmp_path):
    tag_dir = tmp_path / "global_step1"
    model, saved = _save_stages(tag_dir)
    shapes = convert_pipeline_checkpoint(tag_dir, num_stages=2, zero_stage=0, optimizer_name="Adam")
    assert shapes == [{name: list(p.shape) for name, p in model.named_parameters()}]
    named = _named(model, [1, 2, 3])  # a stage of another split: layers of both saved stages
    optimizer = torch.optim.Adam([p for _, p in named], lr=0.5)
    load_parameter_states(optimizer, tag_dir / UNIVERSAL_FOLDER, names={p: name for name, p in named})
    assert optimizer.param_groups[0]["lr"] == 0.01  # the checkpoint's hyper-parameters, as DeepSpeed's loader
    for name, parameter in named:
        state = optimizer.state[parameter]
        assert set(state) == set(saved[name]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in saved[name].items():
            assert torch.equal(state[key], value), (name, key)


@pytest.mark.parametrize(
    "extra,described",
    [
        (torch.zeros(2), "a tensor of shape (2,)"),
        ([1.0, 2.0], "a list"),
    ],
)
def test_a_state_that_is_not_per_parameter_is_refused_before_anything_is_written(tmp_path, extra, described):
    tag_dir = tmp_path / "global_step1"
    _save_stages(tag_dir, extra_state=("row_statistics", extra))
    with pytest.raises(ValueError) as error:
        convert_pipeline_checkpoint(tag_dir, num_stages=2, zero_stage=0, optimizer_name="Adam")
    assert f"Adam keeps the state 'row_statistics' as {described}: only states of one value per element" in str(
        error.value
    )
    assert (
        f"can be moved between stages (saved in {tag_dir / 'pipeline0' / 'mp_rank_01_model_states.pt'}); resume "
        f"this checkpoint under its plan (in {tag_dir / 'poplar_state.json'})"
    ) in str(error.value)
    assert sorted(path.name for path in tag_dir.iterdir()) == ["pipeline0"]


def test_a_zero0_checkpoint_without_its_parameters_names_is_refused(tmp_path):
    tag_dir = tmp_path / "global_step1"
    _save_stages(tag_dir, names=False)
    with pytest.raises(ValueError, match="does not name its optimizer's parameters: expected poplar_param_shapes"):
        convert_pipeline_checkpoint(tag_dir, num_stages=2, zero_stage=0, optimizer_name="Adam")
    assert not (tag_dir / UNIVERSAL_FOLDER).exists()


def test_a_half_precision_optimizer_names_the_models_parameters_not_its_fp32_copies():
    # DeepSpeed's bf16 and fp16 optimizers at ZeRO 0 step fp32 copies (their param_groups); a pipeline checkpoint
    # names the model's parameters, which they keep in bf16_groups / fp16_groups (a save crashed on the copies).
    from types import SimpleNamespace

    from poplar_ext.pipeline.replan import half_precision_master_copies, optimizer_parameter_shapes

    weight = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    copy = torch.nn.Parameter(weight.detach().float())
    optimizer = SimpleNamespace(bf16_groups=[[weight]], param_groups=[{"params": [copy]}])
    engine = SimpleNamespace(zero_optimization=lambda: False, optimizer=optimizer, param_names={weight: "0.weight"})
    assert optimizer_parameter_shapes(engine) == [{"0.weight": [3, 2]}]
    assert half_precision_master_copies(optimizer)
    assert not half_precision_master_copies(SimpleNamespace(param_groups=[{"params": [copy]}]))


def test_a_zero_0_save_takes_the_parameter_shapes_before_save_whole_begins(monkeypatch):
    """The shapes enter the client state before the save's cleanup and barrier, as they always did."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from poplar_ext.pipeline import engine as pipeline_engine
    from poplar_ext.runtime import engine_core

    order = []

    def shapes(engine):
        order.append("shapes")
        return [{"w": [2, 2]}]

    def whole(save_dir, tag, save, **kwargs):
        order.append("save_whole")
        return save(f"{tag}.saving")

    def deepspeed_save(self, save_dir, tag, client_state, **kwargs):
        order.append("deepspeed")
        return client_state

    monkeypatch.setattr(pipeline_engine, "optimizer_parameter_shapes", shapes)
    monkeypatch.setattr(engine_core, "save_whole", whole)
    monkeypatch.setattr(PipelineEngine, "save_checkpoint", deepspeed_save)
    engine = pipeline_engine.PoplarPipelineEngine.__new__(pipeline_engine.PoplarPipelineEngine)  # no DeepSpeed
    for name, value in {"optimizer": object(), "zero_optimization": lambda: False, "pipeline_index": 0}.items():
        object.__setattr__(engine, name, value)
    client_state = engine.save_checkpoint("checkpoints", "t", client_state={"mine": 1})
    assert order == ["shapes", "save_whole", "deepspeed"]
    assert client_state == {"mine": 1, pipeline_engine.PARAMETER_SHAPES_KEY: [{"w": [2, 2]}]}


def _save_zero1_stages(tag_dir, *, prefix):
    """Two stages of a ZeRO-1 job after one step of Adam, as DeepSpeed's pipeline engine saves them: the
    parameters' shapes in ``mp_rank_<stage>_model_states.pt``, the flat fp32 partition and its states in
    ``<prefix>zero_pp_rank_0_mp_rank_<stage>_optim_states.pt``; returns each parameter's fp32 weight and states."""
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
        PARAM_SLICE_MAPPINGS,
        SINGLE_PARTITION_OF_FP32_GROUPS,
    )
    from deepspeed.utils.tensor_fragment import fragment_address

    model = toy_sequential(dim=3, num_layers=4)
    folder = tag_dir / "pipeline0"
    folder.mkdir(parents=True)
    expected = {}
    for stage, layers in enumerate(SAVED_SPLIT):
        named = _named(model, layers)
        flat = torch.cat([p.detach().reshape(-1) for _, p in named]).clone()
        optimizer = torch.optim.Adam([torch.nn.Parameter(flat.clone())], lr=0.01)
        optimizer.param_groups[0]["params"][0].grad = torch.linspace(-1, 1, flat.numel())
        optimizer.step()
        state = optimizer.state_dict()
        mappings, start = {}, 0
        for name, p in named:
            mappings[name] = fragment_address(numel=p.numel(), start=start)
            expected[name] = {
                key: state["state"][0][key].narrow(0, start, p.numel()).reshape(p.shape)
                for key in ("exp_avg", "exp_avg_sq")
            }
            start += p.numel()
        torch.save(
            {"param_shapes": [{name: p.shape for name, p in named}]}, folder / f"mp_rank_{stage:02d}_model_states.pt"
        )
        saved = {
            BASE_OPTIMIZER_STATE: state,
            SINGLE_PARTITION_OF_FP32_GROUPS: [flat],
            GROUP_PADDINGS: [0],
            PARAM_SLICE_MAPPINGS: [mappings],
        }
        torch.save(
            {OPTIMIZER_STATE_DICT: saved}, folder / f"{prefix}zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt"
        )
    return expected


@pytest.mark.parametrize("prefix", ["", "bf16_"], ids=["fp32", "bf16"])
def test_a_zero1_checkpoint_is_read_under_the_name_deepspeed_gave_it(tmp_path, prefix):
    # In bf16 DeepSpeed names a stage's ZeRO optimizer file bf16_zero_pp_rank_0_...: a resume under another
    # split failed with FileNotFoundError for zero_pp_rank_0_... on a tied GPT-2 in bf16 at ZeRO 1.
    tag_dir = tmp_path / "global_step1"
    expected = _save_zero1_stages(tag_dir, prefix=prefix)
    shapes = convert_pipeline_checkpoint(tag_dir, num_stages=2, zero_stage=1, optimizer_name="Adam")
    assert set(shapes[0]) == set(expected)
    for name, states in expected.items():
        for key, value in states.items():
            saved = torch.load(tag_dir / UNIVERSAL_FOLDER / "zero" / name / f"{key}.pt", weights_only=False)
            assert torch.equal(saved["param"], value), (name, key)


def test_a_zero1_checkpoint_without_its_optimizer_file_names_both_names(tmp_path):
    tag_dir = tmp_path / "global_step1"
    _save_zero1_stages(tag_dir, prefix="")
    (tag_dir / "pipeline0" / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(ValueError) as error:
        convert_pipeline_checkpoint(tag_dir, num_stages=2, zero_stage=1, optimizer_name="Adam")
    assert (
        f"{tag_dir / 'pipeline0'}: expected stage 1's ZeRO-1 optimizer state in zero_pp_rank_0_mp_rank_01_optim_states"
        ".pt (or bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt, as DeepSpeed names it in bf16), found neither"
    ) in str(error.value)
    assert not (tag_dir / UNIVERSAL_FOLDER).exists()
