"""Pipelines (issue 22) without a process group: what is refused, the loss weight, the resume decision."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from poplar_ext.pipeline.checkpoint import layers_move, parameter_differences, pipeline_resume_decision
from poplar_ext.pipeline.initialize import pipeline_deepspeed_config
from poplar_ext.pipeline.planning import check_pipeline_config, pipeline_plan_problems, resolve_pipeline_plan
from poplar_ext.plan.formats import cluster_from_dict, plan_from_dict
from poplar_ext.plan.pipeline_formats import pipeline_plan_from_dict
from poplar_ext.runtime.checkpoint import poplar_client_state, resume_decision
from poplar_ext.runtime.config import GlobalBatchRequest, poplar_config_from_dict
from poplar_ext.runtime.weighting import pipeline_loss_weight

PREDICTED = {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0}


def _pipeline_plan(pipelines=None, *, stage=1, num_layers=6) -> dict:
    """Per pipeline: ((rank, device type, first, last) per stage, micro-batch size, micro-batches)."""
    pipelines = pipelines or [([(0, "a", 0, 1), (1, "a", 2, 5)], 2, 3), ([(2, "b", 0, 5)], 3, 2)]
    return {
        "schema_version": 1,
        "parallelism": "pipeline",
        "policy": "poplar",
        "zero_stage": stage,
        "global_batch_size": sum(b * s for _, b, s in pipelines),
        "num_layers": num_layers,
        "pipelines": [
            {
                "stages": [{"rank": r, "device_type": d, "first_layer": f, "last_layer": z} for r, d, f, z in stages],
                "micro_batch_size": b,
                "num_micro_batches": s,
            }
            for stages, b, s in pipelines
        ],
        "predicted": PREDICTED,
        "profile_fingerprints": {},
    }


def _cluster(types=("a", "a", "b")):
    return cluster_from_dict(
        {"schema_version": 1, "nodes": [{"name": "n", "devices": [{"device_type": t, "count": 1} for t in types]}]}
    )


def _zero_plan(world_size: int) -> dict:
    rank = {"device_type": "a", "micro_batch_size": 1, "gradient_accumulation_steps": 1}
    return {
        "schema_version": 1,
        "policy": "poplar",
        "zero_stage": 1,
        "global_batch_size": world_size,
        "ranks": [{"rank": r, **rank} for r in range(world_size)],
        "predicted": PREDICTED,
        "profile_fingerprints": {},
    }


def _poplar(**section):
    return poplar_config_from_dict({"plan": "plan.json", **section}, base_dir=Path("."))


# -- refused from the config alone ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("ds_config", "section", "message"),
    [
        ({"zero_optimization": {"stage": 2}}, {}, r"expected 0 or 1 with pipelines, found 2"),
        ({}, {"zero_stage": 3}, r"expected 0 or 1 with pipelines, found 3"),
        # Beside a plan "auto" is refused where the section is read (both engines); without one, here.
        (
            {},
            {"global_batch_size": "auto", "plan": None},
            r"global_batch_size: expected a number or none with pipelines",
        ),
    ],
)
def test_what_the_config_asks_and_pipelines_cannot_do_is_refused(ds_config, section, message):
    with pytest.raises(ValueError, match=message):
        check_pipeline_config(ds_config, _poplar(**section))


def test_an_auto_global_batch_is_refused_once_not_also_as_missing():
    with pytest.raises(ValueError) as refused:
        check_pipeline_config({}, _poplar(global_batch_size="auto", plan=None))
    assert "found 'auto'" in str(refused.value) and "found none" not in str(refused.value)


def test_a_pipeline_job_without_a_plan_file_searches_one_given_a_global_batch():
    poplar = poplar_config_from_dict({"profiles": "profiles"}, base_dir=Path("."))
    with pytest.raises(ValueError, match=r"expected the global batch to search a pipeline plan at start"):
        check_pipeline_config({}, poplar)
    check_pipeline_config({"train_batch_size": 8}, poplar)


@pytest.mark.parametrize("policy", ["uniform", "proportional"])
def test_a_pipeline_search_at_start_refuses_another_policy(policy):
    # The pipeline search has one policy: another was silently replaced by it (poplar-search refuses it too).
    section = {"profiles": "profiles", "policy": policy}
    with pytest.raises(
        ValueError,
        match=rf"^ds.json: this pipeline job cannot run: poplar.policy: expected poplar with pipelines \(the pipeline "
        rf"search's one policy\), found {policy}$",
    ):
        check_pipeline_config(
            {"train_batch_size": 8}, poplar_config_from_dict(section, base_dir=Path("."), source="ds.json")
        )
    check_pipeline_config(
        {"train_batch_size": 8}, poplar_config_from_dict({**section, "policy": "poplar"}, base_dir=Path("."))
    )


def test_two_global_batches_in_one_pipeline_config_are_refused():
    # As in a ZeRO job: train_batch_size and poplar.global_batch_size must not say two things.
    with pytest.raises(
        ValueError, match=r"poplar.global_batch_size: expected train_batch_size's 14 or no poplar.global_batch_size"
    ):
        check_pipeline_config({"train_batch_size": 14}, _poplar(global_batch_size=12))
    check_pipeline_config({"train_batch_size": 12}, _poplar(global_batch_size=12))
    check_pipeline_config({"train_batch_size": "auto"}, _poplar(global_batch_size=12))


def test_a_pipeline_batch_above_the_configs_bound_is_refused():
    # As in a ZeRO job: poplar.max_global_batch_size bounds the batch the config asks for.
    with pytest.raises(ValueError, match=r"poplar.max_global_batch_size: expected at least the global batch \(8, "):
        check_pipeline_config({"train_batch_size": 8}, _poplar(max_global_batch_size=4))
    check_pipeline_config({"train_batch_size": 8}, _poplar(max_global_batch_size=8))


def test_a_batch_above_the_bound_is_refused_alike_by_both_engines():
    # One refusal, two engines: a ZeRO job raises it, a pipeline job lists it after its file.
    from poplar_ext.zero.planning import resolve_plan

    config = _poplar(max_global_batch_size=4)
    batch = GlobalBatchRequest(size=8, origin="train_batch_size")
    with pytest.raises(ValueError) as zero:
        resolve_plan(config, _cluster(), world_size=3, rank=0, zero_stage=1, global_batch=batch, broadcast=lambda o: o)
    with pytest.raises(ValueError) as pipeline:
        check_pipeline_config({"train_batch_size": 8}, config)
    detail = (
        "poplar.max_global_batch_size: expected at least the global batch (8, from train_batch_size) "
        "or no poplar.max_global_batch_size, found number 4"
    )
    assert str(zero.value) == f"{config.source}: {detail}"
    assert str(pipeline.value) == f"{config.source}: this pipeline job cannot run: {detail}"


def test_auto_global_batch_beside_a_plan_file_is_refused_alike_by_both_engines(tmp_path, monkeypatch):
    # "auto" asks the search at start for the batch; beside a plan file nothing searches. A ZeRO job trained the
    # plan's batch without a word where a pipeline job refused: one refusal, where every engine reads the section.
    from poplar_ext.pipeline.job import prepare_pipeline_job
    from poplar_ext.runtime.config import load_deepspeed_config
    from poplar_ext.zero import initialize as zero_initialize

    def accepted(**_):
        raise AssertionError("the config was accepted: the job went on to join the process group")

    monkeypatch.setattr(zero_initialize, "join_job", accepted)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"poplar": {"plan": "plan.json", "global_batch_size": "auto"}}))
    expected = (
        f"{config}: poplar.global_batch_size: expected a number or none beside poplar.plan (the plan's global batch; "
        "'auto' lets a search at start pick one), found 'auto' beside poplar.plan"
    )
    for prepare, options in ((zero_initialize.prepare_job, {}), (prepare_pipeline_job, {"num_layers": 6})):
        with pytest.raises(ValueError) as refused:
            prepare(load_deepspeed_config(config), **options)
        assert str(refused.value) == expected
    # DeepSpeed's own "auto" batch keys beside a plan are the Trainer's and accelerate's to fill: still accepted.
    examples = Path(__file__).resolve().parents[2] / "examples"
    with pytest.raises(AssertionError, match="the config was accepted"):
        zero_initialize.prepare_job(load_deepspeed_config(examples / "ds_config_accelerate.json"))


@pytest.mark.parametrize("given", ["14", 14.5, True, 0])
def test_a_train_batch_size_that_is_no_batch_is_refused_not_ignored(given):
    # A ZeRO job refuses it; a pipeline job replaced it with the plan's without a word.
    for section in ({}, {"global_batch_size": 14}):
        with pytest.raises(ValueError, match=r"train_batch_size: expected an integer from 1 to \d+, found "):
            check_pipeline_config({"train_batch_size": given}, _poplar(**section))


def test_a_plain_config_is_fine():
    check_pipeline_config({"zero_optimization": {"stage": 1}, "bf16": {"enabled": False}}, _poplar())


def test_rebalancing_asked_for_is_accepted_by_a_pipeline_job():
    check_pipeline_config({}, _poplar(rebalance={"enabled": True}))  # issue 34: pipelines re-balance


# -- refused from the plan, on rank 0 ----------------------------------------------------------------
def test_a_plan_that_fits_the_job_has_no_problems():
    plan = pipeline_plan_from_dict(_pipeline_plan())
    assert (
        pipeline_plan_problems(
            plan,
            _cluster(),
            world_size=3,
            num_layers=6,
            zero_stage=1,
            global_batch=GlobalBatchRequest(size=12, origin="x"),
        )
        == []
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world_size": 4}, "The plan names 3 ranks but the job has 4 (WORLD_SIZE)."),
        ({"cluster": _cluster(("a", "b", "b"))}, "Device types differ from the cluster's at rank 1 (a in the plan, b"),
        ({"num_layers": 7}, "The plan splits 6 layers but the model has 7"),
        ({"zero_stage": 0}, "The plan is for ZeRO stage 1 but the config asks for stage 0"),
        (
            {"global_batch": GlobalBatchRequest(size=16, origin="train_batch_size")},
            "global batch is 12 but the config asks for 16 (train_batch_size)",
        ),
    ],
)
def test_a_plan_that_does_not_fit_the_job_says_why(change, message):
    arguments = {"cluster": _cluster(), "world_size": 3, "num_layers": 6, "zero_stage": 1, "global_batch": None}
    arguments.update(change)
    plan = pipeline_plan_from_dict(_pipeline_plan())
    assert any(message in p for p in pipeline_plan_problems(plan, **arguments))


def test_a_plan_for_another_number_of_ranks_says_so_once():
    plan = pipeline_plan_from_dict(_pipeline_plan())  # 3 ranks, against a job and a cluster of 4
    problems = pipeline_plan_problems(
        plan, _cluster(("a", "b", "b", "b")), world_size=4, num_layers=6, zero_stage=1, global_batch=None
    )
    assert problems == ["The plan names 3 ranks but the job has 4 (WORLD_SIZE)."]


def _resolve(tmp_path, plan_dict, **overrides):
    (tmp_path / "plan.json").write_text(json.dumps(plan_dict))
    arguments = dict(world_size=3, rank=0, num_layers=6, zero_stage=None, global_batch=None, broadcast=lambda o: o)
    arguments.update(overrides)
    return resolve_pipeline_plan(_poplar(plan=str(tmp_path / "plan.json")), _cluster(), **arguments)


def test_rank_0_reads_the_pipeline_plan(tmp_path):
    assert _resolve(tmp_path, _pipeline_plan()).pipelines[0].boundaries == (0, 2, 6)


def test_a_policy_other_than_the_pipeline_plans_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(_pipeline_plan()))
    config = _poplar(plan=str(tmp_path / "plan.json"), policy="uniform")
    with pytest.raises(
        ValueError, match=r"poplar.policy: expected 'poplar' \(the policy poplar.plan .*, found 'uniform'"
    ):
        resolve_pipeline_plan(
            config, _cluster(), world_size=3, rank=0, num_layers=6, zero_stage=None, global_batch=None,
            broadcast=lambda o: o,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"profiles": "profiels"}, r"poplar.profiles: expected a directory of profiles beside poplar.plan .*, found "
         r"nothing at .*profiels$"),
        ({"plan": None, "profiles": "none"}, r"poplar.profiles: no plan was given and .*none.layers lacks layer"),
    ],
)  # fmt: skip
def test_a_missing_profiles_folder_names_the_config_with_or_without_a_pipeline_plan(tmp_path, section, message):
    (tmp_path / "plan.json").write_text(json.dumps(_pipeline_plan()))
    config = poplar_config_from_dict({"plan": "plan.json", **section}, base_dir=tmp_path, source="ds.json")
    with pytest.raises(ValueError, match=rf"^ds.json: {message}"):
        resolve_pipeline_plan(
            config, _cluster(), world_size=3, rank=0, num_layers=6, zero_stage=None,
            global_batch=GlobalBatchRequest(size=12, origin="train_batch_size"), broadcast=lambda o: o,
        )  # fmt: skip


def test_a_zero_plan_for_a_pipeline_module_is_refused(tmp_path):
    zero_plan = _zero_plan(3)
    with pytest.raises(ValueError, match=r"is a ZeRO plan \(every rank trains the whole model\)"):
        _resolve(tmp_path, zero_plan)


def test_a_layer_split_with_a_gap_is_refused_with_the_field(tmp_path):
    plan = _pipeline_plan()
    plan["pipelines"][0]["stages"][1]["first_layer"] = 3
    with pytest.raises(ValueError, match=r"poplar.plan: .*pipelines\[0\].stages\[1\].first_layer: expected 2"):
        _resolve(tmp_path, plan)


def test_a_plan_that_cannot_run_names_its_file_and_every_reason(tmp_path):
    with pytest.raises(ValueError, match=r"plan.json: this pipeline plan cannot run: The plan names 3 ranks .* has 4"):
        _resolve(tmp_path, _pipeline_plan(), world_size=4)


def test_a_pipeline_plan_file_above_the_configs_bound_is_refused_as_a_zero_plan_is(tmp_path):
    # No batch in the config: the plan's is the job's, and poplar.max_global_batch_size bounds it (as in ZeRO).
    (tmp_path / "plan.json").write_text(json.dumps(_pipeline_plan()))  # global batch 12
    arguments = dict(world_size=3, rank=0, num_layers=6, zero_stage=None, global_batch=None, broadcast=lambda o: o)
    bounded = _poplar(plan=str(tmp_path / "plan.json"), max_global_batch_size=4)
    check_pipeline_config({}, bounded)
    with pytest.raises(ValueError) as raised:
        resolve_pipeline_plan(bounded, _cluster(), **arguments)
    assert str(raised.value) == (
        f"{bounded.source}: poplar.max_global_batch_size: expected at least the global batch (12, from poplar.plan "
        f"{tmp_path / 'plan.json'}) or no poplar.max_global_batch_size, found number 4"
    )
    at_bound = _poplar(plan=str(tmp_path / "plan.json"), max_global_batch_size=12)
    assert resolve_pipeline_plan(at_bound, _cluster(), **arguments).global_batch_size == 12


def test_a_pipeline_plan_for_a_plain_model_is_refused(tmp_path):
    from poplar_ext.zero.planning import resolve_plan

    (tmp_path / "plan.json").write_text(json.dumps(_pipeline_plan()))
    with pytest.raises(ValueError, match=r"is a pipeline plan .* trains a poplar_ext.pipeline.PoplarPipelineModule"):
        resolve_plan(
            _poplar(plan=str(tmp_path / "plan.json")), _cluster(), world_size=3, rank=0, zero_stage=None,
            broadcast=lambda o: o,
        )  # fmt: skip


# -- the module's own arguments, refused before anything starts ---------------------------------------
@pytest.mark.parametrize("argument", [{"num_stages": 2}, {"topology": object()}, {"partition_method": "uniform"}])
def test_what_the_plan_says_cannot_be_given(argument):
    from poplar_ext.pipeline import PoplarPipelineModule

    with pytest.raises(ValueError, match=rf"expected no {next(iter(argument))}, .* the pipeline plan \(poplar.plan\)"):
        PoplarPipelineModule([torch.nn.Linear(1, 1)], config={"poplar": {"plan": "p.json"}}, **argument)


def test_token_mean_and_a_loss_that_does_not_fit_it_are_refused_before_the_job_starts():
    from poplar_ext.pipeline import PoplarPipelineModule
    from poplar_ext.pipeline.causal_lm import CausalLMLoss

    message = (
        r"^<DeepSpeed config dict>: poplar.loss_reduction: expected token_mean with loss_fn causal_lm_loss, found mean"
    )
    with pytest.raises(ValueError, match=message):  # no process group exists: it was refused before one
        PoplarPipelineModule([torch.nn.Linear(1, 1)], loss_fn=CausalLMLoss(), config={"poplar": {"plan": "p.json"}})
    token_mean = {"poplar": {"plan": "p.json", "loss_reduction": "token_mean"}}
    with pytest.raises(
        ValueError,
        match=r"^<DeepSpeed config dict>: poplar.loss_reduction: expected mean or sum without a loss_fn .*, "
        r"found token_mean",
    ):
        PoplarPipelineModule([torch.nn.Linear(1, 1)], config=token_mean)


def test_a_plain_pipeline_module_is_refused_naming_the_poplar_one():
    from deepspeed.pipe import PipelineModule

    import poplar_ext

    model = PipelineModule.__new__(PipelineModule)  # without its process groups
    torch.nn.Module.__init__(model)
    with pytest.raises(
        ValueError, match=r"a PipelineModule \(pipeline parallelism: build it as .*PoplarPipelineModule"
    ):
        poplar_ext.initialize(model=model, config={"poplar": {"plan": "p.json"}})


# -- the loss weight and the per-pipeline config -----------------------------------------------------
def test_a_pipelines_loss_weight_is_its_count_times_its_share_of_the_batch():
    assert pipeline_loss_weight(micro_batch_size=3, num_micro_batches=2, global_batch_size=11) == pytest.approx(6 / 11)
    sum_weight = pipeline_loss_weight(micro_batch_size=3, num_micro_batches=2, global_batch_size=11, reduction="sum")
    assert sum_weight == pytest.approx(2 / 11)
    # token_mean: per label token of the micro-batch; the engine divides by the iteration's tokens.
    assert (
        pipeline_loss_weight(micro_batch_size=3, num_micro_batches=2, global_batch_size=11, reduction="token_mean") == 2
    )


@pytest.mark.parametrize("first", [True, False])
def test_train_batch_without_data_says_where_the_data_comes_from_before_deepspeeds_schedule(first):
    # Without training_data nor data_iter, DeepSpeed read None as the micro-batch inside its schedule:
    # "TypeError: 'NoneType' object is not subscriptable" on the stages that read data.
    from types import SimpleNamespace

    from poplar_ext.pipeline.engine import PoplarPipelineEngine

    engine = SimpleNamespace(
        module=SimpleNamespace(loss_fn=SimpleNamespace(tokens=0, refused=None)),
        is_first_stage=lambda: first,
        is_last_stage=lambda: not first,
        _fed_by_caller=False,
        data_iterator=None,
        _loader=None,
        batch_fn=None,
        global_rank=3,
        pipeline_index=1,
    )
    stage = "first" if first else "last"
    message = (
        rf"^train_batch: expected micro-batches to train on, found none on rank 3 \(pipeline 1's {stage} stage, "
        r"which reads them\): give poplar_ext.initialize training_data .*train_batch\(data_iter\)"
    )
    with pytest.raises(ValueError, match=message):
        PoplarPipelineEngine.train_batch(engine)


@pytest.mark.parametrize(
    ("setter", "value", "message"),
    [
        ("set_train_batch_size", 24, r"^set_train_batch_size: expected the plan's global batch \(12\), found 24"),
        ("set_train_micro_batch_size", 2, r"^set_train_micro_batch_size: expected this pipeline's micro-batch in the "),
    ],
)
def test_deepspeeds_batch_setters_on_a_pipeline_keep_the_plan(setter, value, message):
    # engine.set_train_batch_size(engine.train_batch_size()), a no-op under plain DeepSpeed, made each pipeline of
    # micro-batches 2 x 1 and 1 x 2 (B = 4) run 2 and 4 micro-batches per step, the loss weights still those of the
    # plan: each step trained the sum of two global batches' mean gradients, without an error.
    from types import SimpleNamespace

    from poplar_ext.pipeline.engine import PoplarPipelineEngine

    plan = pipeline_plan_from_dict(_pipeline_plan())  # pipelines of 2 x 3 and 3 x 2: B = 12
    engine = PoplarPipelineEngine.__new__(PoplarPipelineEngine)  # DeepSpeed's setters alone: no process group
    torch.nn.Module.__init__(engine)
    engine._config = SimpleNamespace(
        train_batch_size=12, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2
    )
    engine.dp_world_size, engine.micro_batches, engine.plan, engine.pipeline_index = 1, 2, plan, 1
    engine.set_train_batch_size(12)  # the plan's: nothing to change
    engine.set_train_micro_batch_size(3)
    assert (engine.micro_batches, engine._config.gradient_accumulation_steps) == (2, 2)
    with pytest.raises(ValueError, match=message):
        getattr(engine, setter)(value)
    assert (engine.micro_batches, engine._config.gradient_accumulation_steps) == (2, 2)
    assert engine._config.train_micro_batch_size_per_gpu == 3


def test_a_users_reentrant_interval_leaves_out_the_block_that_embeds_the_token_ids():
    # DeepSpeed's reentrant checkpoint of a first stage's token embedding detached it: with causal_lm_layers and
    # activation_checkpoint_interval=1 the first stages failed "element 0 of tensors does not require grad".
    from deepspeed.runtime.activation_checkpointing import checkpointing

    from poplar_ext.pipeline.causal_lm import TokenEmbedding
    from poplar_ext.pipeline.module import PoplarPipelineModule

    module = PoplarPipelineModule.__new__(PoplarPipelineModule)  # the decision alone: no process group
    torch.nn.Module.__init__(module)
    embedding, block = TokenEmbedding(torch.nn.Embedding(8, 4)), torch.nn.Linear(4, 4)
    module.forward_funcs, module._local_start, module.checkpointable_layers = [embedding, block], 0, None
    module.activation_checkpoint_func = checkpointing.checkpoint
    assert not module._is_checkpointable([embedding])
    assert not module._is_checkpointable([embedding, block])
    assert module._is_checkpointable([block])
    module.forward_funcs = [torch.nn.Embedding(8, 4)]  # a plain embedding as layer 0 alike
    assert not module._is_checkpointable(module.forward_funcs)
    module.forward_funcs, module._local_start = [embedding, block], 2  # not the data's layer: DeepSpeed's rule
    assert module._is_checkpointable([embedding])
    module._local_start = 0
    module.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint  # takes token ids: checkpointed
    assert module._is_checkpointable([embedding, block])


def test_an_evaluated_loss_is_unweighted_and_counted_by_its_share_of_the_evaluated_batch():
    from poplar_ext.pipeline.module import WeightedLoss

    def loss_of(outputs, labels):
        return outputs

    ids = torch.tensor([[5, -100, 7], [8, 9, -100]])  # 4 label tokens, 2 samples
    for reduction, count in (("mean", 2), ("sum", 2), ("token_mean", 4)):
        weighted = WeightedLoss(loss_of, 6 / 11, reduction=reduction)
        with weighted.evaluating(device="cpu", micro_batch_size=3) as totals:
            assert float(weighted(torch.tensor(0.5), ids)) == 0.5  # not times the training weight
            labels = ids[:1] if reduction == "token_mean" else {"n": 2, "y": ids[:1]}  # its first tensor's rows
            assert float(weighted(torch.tensor(0.25), labels)) == 0.25
        summed = 0.5 + 0.25 if reduction == "sum" else 0.5 * count + 0.25 * (count // 2)
        assert totals.tolist() == [summed, count + count // 2, 0.0], reduction
        assert weighted.evaluation is None and weighted.tokens == 0  # training's weighting is back, nothing counted
        assert float(weighted(torch.tensor(0.5), ids)) == pytest.approx(0.5 * 6 / 11 * (4 if count == 4 else 1))
    weighted = WeightedLoss(None, 1.0)
    with weighted.evaluating(device="cpu", micro_batch_size=3) as totals:  # labels without a tensor: the plan's size
        weighted(torch.tensor(2.0), None)
    assert totals.tolist() == [6.0, 3.0, 0.0]


def test_deepspeed_gets_a_config_valid_for_the_pipeline_alone():
    plan = pipeline_plan_from_dict(_pipeline_plan())
    user = {"train_batch_size": 12, "zero_optimization": {"stage": 1}, "poplar": {}}
    nominal = pipeline_deepspeed_config(user, plan, 1)
    assert (nominal["train_micro_batch_size_per_gpu"], nominal["gradient_accumulation_steps"]) == (3, 2)
    assert nominal["train_batch_size"] == 6 and nominal["zero_optimization"]["stage"] == 1
    assert user["train_batch_size"] == 12


def test_deepspeeds_loss_line_of_one_pipelines_share_is_off():
    # DeepSpeedExamples' pipeline script: its "steps: 10 loss: 1.43" disagreed with poplar's "loss 2.28".
    plan = pipeline_plan_from_dict(_pipeline_plan())
    for user in ({"steps_per_print": 10, "poplar": {}}, {"poplar": {}}):
        nominal = pipeline_deepspeed_config(user, plan, 0)
        assert nominal["steps_per_print"] > 10**15  # never reached


# -- resuming ----------------------------------------------------------------------------------------
def _state(plan_dict, position=24):
    plan = pipeline_plan_from_dict(plan_dict)
    return poplar_client_state(plan, consumed_samples=position, seed=0, shuffle=True, plan_history=[{"start_step": 0}])


def test_a_resume_under_the_same_plan_continues_the_stream():
    decision = pipeline_resume_decision(_state(_pipeline_plan()), _state(_pipeline_plan(), 0), path="ckpt/step2")
    assert (decision.data_position, decision.consumed_samples, decision.plan_history) == (24, 24, [{"start_step": 0}])


def test_a_resume_under_another_pipeline_plan_continues_the_stream_naming_what_differs():
    other = _pipeline_plan([([(0, "a", 0, 3), (1, "a", 4, 5)], 2, 3), ([(2, "b", 0, 5)], 2, 3)])
    saved = _state(_pipeline_plan())
    saved["step"] = 2
    decision = pipeline_resume_decision(saved, _state(other, 0), path="ckpt/step2")
    assert (decision.data_position, decision.consumed_samples) == (24, 24)
    entry = decision.plan_history[-1]
    assert decision.plan_history[:-1] == [{"start_step": 0}]
    assert (entry["start_step"], entry["data_position"], entry["plan"]) == (2, 24, _state(other)["plan"])
    assert entry["reason"].startswith("resumed from ckpt/step2 under another pipeline plan (")
    for change in (
        "pipeline 0's stages held layers 0-1, 2-5 then, 0-3, 4-5 now",
        "pipeline 1's micro-batch size 3 then, 2 now",
        "pipeline 1's micro-batches 2 then, 3 now",
    ):
        assert change in entry["reason"]
    assert layers_move(saved["plan"], _state(other)["plan"])
    same_split = _pipeline_plan([([(0, "a", 0, 1), (1, "a", 2, 5)], 1, 3), ([(2, "b", 0, 5)], 3, 2)])
    assert not layers_move(saved["plan"], _state(same_split)["plan"])


@pytest.mark.parametrize(
    "other,what",
    [
        (
            _pipeline_plan(
                num_layers=7, pipelines=[([(0, "a", 0, 1), (1, "a", 2, 6)], 2, 3), ([(2, "b", 0, 6)], 3, 2)]
            ),
            "layers 6 then, 7 now",
        ),
        (_pipeline_plan(stage=0), "ZeRO stage 1 then, 0 now"),
    ],
)
def test_a_resume_under_a_plan_of_another_model_or_zero_stage_is_refused_before_loading(other, what):
    with pytest.raises(ValueError, match="saved under a pipeline plan that cannot be continued by this one") as error:
        pipeline_resume_decision(_state(_pipeline_plan()), _state(other, 0), path="ckpt/step2")
    assert f"ckpt/step2 was saved under a pipeline plan that cannot be continued by this one ({what})" in str(
        error.value
    )
    assert "resume it with the model and the ZeRO stage of ckpt/step2/poplar_state.json" in str(error.value)


def test_parameters_that_differ_from_the_checkpoints_are_named():
    saved = [{"0.weight": [8, 8], "0.bias": [8], "1.weight": [1, 8]}]
    assert parameter_differences(saved, [dict(saved[0])]) == []
    now = [{"0.weight": [4, 8], "0.bias": [8], "2.weight": [1, 8]}]
    assert parameter_differences(saved, now) == [
        "1.weight among the optimizer's parameters then, not now",
        "2.weight among the optimizer's parameters now, not then",
        "0.weight of shape [8, 8] then, [4, 8] now",
    ]
    assert parameter_differences(saved, saved + [{}]) == ["1 optimizer parameter groups then, 2 now"]


def test_a_resume_with_another_data_order_is_refused():
    current = _state(_pipeline_plan(), 0)
    current["seed"] = 1
    with pytest.raises(ValueError, match="the data order would differ"):
        pipeline_resume_decision(_state(_pipeline_plan()), current, path="ckpt/step2")


def test_a_checkpoint_without_poplar_state_or_of_a_zero_job_is_refused_by_a_pipeline_job():
    with pytest.raises(ValueError, match="holds no poplar_state.json; expected a checkpoint saved by a poplar-ext"):
        pipeline_resume_decision(None, _state(_pipeline_plan(), 0), path="ckpt/x")
    zero = _state(_pipeline_plan())
    zero["plan"] = {"ranks": [], "zero_stage": 1, "global_batch_size": 12}
    with pytest.raises(ValueError, match="saved by a job that trained every rank on the whole model"):
        pipeline_resume_decision(zero, _state(_pipeline_plan(), 0), path="ckpt/x")


def test_a_pipeline_checkpoint_is_refused_by_a_zero_job():
    zero_plan = plan_from_dict(_zero_plan(1))
    current = poplar_client_state(zero_plan, consumed_samples=0, seed=0, shuffle=True)
    with pytest.raises(
        ValueError, match=r"was saved by a pipeline job .* resume it with the same PoplarPipelineModule"
    ):
        resume_decision(copy.deepcopy(_state(_pipeline_plan())), current, path="ckpt/x", step=2)


# -- initialize with a built module, and the engine's emulated instructions ---------------------------
class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(1)


def _built_module(ds_config):
    """What initialize reads of a PoplarPipelineModule before anything collective: its settled job."""
    from types import SimpleNamespace

    return SimpleNamespace(poplar_job=SimpleNamespace(ds_config=ds_config))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mpu": object()}, r"expected no mpu= or mesh_param= with a PoplarPipelineModule"),
        ({"config": {"poplar": {"plan": "other.json"}}}, r"expected the DeepSpeed config the PoplarPipelineModule was"),
        (
            {"training_data": _Stream()},
            r"training_data: expected a map-style dataset .* found _Stream, which has no indices to split: "
            r"the plan's sampler cuts range\(len\(dataset\)\)",
        ),
    ],
)
def test_initialize_refuses_what_a_pipeline_job_cannot_take(arguments, message):
    from poplar_ext.pipeline.initialize import initialize_pipeline

    with pytest.raises(ValueError, match=message):
        initialize_pipeline(model=_built_module({"poplar": {"plan": "p.json"}}), **arguments)


def test_initialize_refuses_training_data_smaller_than_the_global_batch_before_building_the_engine():
    from types import SimpleNamespace

    from poplar_ext.pipeline.initialize import initialize_pipeline

    module = _built_module({"poplar": {"plan": "p.json"}})
    module.poplar_job.poplar_config = SimpleNamespace(loss_reduction="mean")
    module.poplar_job.plan = SimpleNamespace(global_batch_size=10)
    message = r"^training_data: num_samples: expected at least the global batch \(10 samples\), found 5: one iteration"
    with pytest.raises(ValueError, match=message):
        initialize_pipeline(model=module, training_data=list(range(5)))


def test_an_emulated_rank_runs_forward_backward_and_step_in_its_slowed_window():
    from types import SimpleNamespace

    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from poplar_ext.hardware.emulation import ComputeSlowdown
    from poplar_ext.pipeline.engine import PoplarPipelineEngine, _timed

    slowed = [schedule.ForwardPass, schedule.BackwardPass, schedule.OptimizerStep]
    for instruction, run in PoplarPipelineEngine._INSTRUCTION_MAP.items():
        assert (run is PipelineEngine._INSTRUCTION_MAP[instruction]) == (instruction not in slowed), instruction
    timer = ComputeSlowdown(None)
    engine = SimpleNamespace(compute_timer=timer, emulated_compute=None, seen=[])
    _timed(lambda e, **kwargs: e.seen.append((e.compute_timer.running, kwargs)))(engine, buffer_id=1)
    assert engine.seen == [(True, {"buffer_id": 1})] and not timer.running


def test_the_optimizer_step_is_slowed_but_not_counted_as_the_compute_rebalancing_compares():
    from types import SimpleNamespace

    from poplar_ext.hardware.emulation import ComputeSlowdown
    from poplar_ext.pipeline.engine import _timed
    from poplar_ext.plan.formats import Emulation

    def work(engine, **kwargs):
        engine.seen.append(engine.compute_timer.running)
        sum(range(20_000))  # some thread CPU time

    emulated = ComputeSlowdown(Emulation(slowdown=2.0, memory_capacity_bytes=10**9))
    engine = SimpleNamespace(compute_timer=emulated, emulated_compute=emulated, seen=[])
    _timed(work)(engine)
    counted = emulated.busy_time_s
    _timed(work, compute=False)(engine)
    assert engine.seen == [True, True] and counted > 0 and emulated.busy_time_s == counted
    measured = ComputeSlowdown(None)  # a real rank watched by re-balancing: its optimizer step is not timed
    engine = SimpleNamespace(compute_timer=measured, emulated_compute=None, seen=[])
    _timed(work, compute=False)(engine)
    assert engine.seen == [False] and measured.busy_time_s == 0.0


def test_a_token_mean_job_refuses_samples_whose_labels_are_not_one_tensor():
    from poplar_ext.pipeline.initialize import check_token_mean_samples

    ids = torch.zeros(4, dtype=torch.long)
    check_token_mean_samples([(ids, ids)], "token_mean")
    check_token_mean_samples([{"input_ids": ids}], "mean")  # counted only for token_mean
    expected = r"training_data: expected \(inputs, labels\) samples .* token_mean, found"
    with pytest.raises(ValueError, match=expected + " a sample of type dict"):
        check_token_mean_samples([{"input_ids": ids, "labels": ids}], "token_mean")
    with pytest.raises(ValueError, match=expected + " tuple"):
        check_token_mean_samples([(ids, (ids, ids))], "token_mean")


def test_token_mean_labels_no_last_stage_can_count_are_refused_by_every_rank_after_the_token_sum(monkeypatch):
    from types import SimpleNamespace

    from poplar_ext.pipeline import engine as engine_module
    from poplar_ext.pipeline.engine import PoplarPipelineEngine
    from poplar_ext.pipeline.module import WeightedLoss

    refusing = WeightedLoss(lambda outputs, labels: outputs, 2.0, reduction="token_mean")
    assert float(refusing(torch.tensor(0.5), {"y": torch.zeros(2)})) == 0.0  # inside the schedule: not raised
    assert refusing.refused.endswith("expected labels that are a tensor of token ids, found dict")
    # A last stage whose labels were counted learns of the other pipeline's in the tokens' all-reduce.
    counting = WeightedLoss(lambda outputs, labels: outputs, 2.0, reduction="token_mean")
    counting(torch.tensor(0.5), torch.ones(3, dtype=torch.long))
    monkeypatch.setattr(engine_module, "sum_in_group", lambda summed: summed.add_(torch.tensor([0, 1])))
    engine = SimpleNamespace(
        module=SimpleNamespace(loss_fn=counting),
        is_last_stage=lambda: True,
        device="cpu",
        plan=SimpleNamespace(pipelines=[None, None]),
    )
    engine._labels_refused = lambda: PoplarPipelineEngine._labels_refused(engine)
    engine._refuse_labels = lambda call, count: PoplarPipelineEngine._refuse_labels(engine, call, count)
    gradient = torch.ones(2)
    with pytest.raises(
        ValueError,
        match=r"^train_batch: expected micro-batches \(inputs, labels\) with labels one tensor of token ids with "
        r"poplar.loss_reduction token_mean, found another type on the last stage of 1 of 2 pipelines",
    ):
        PoplarPipelineEngine._divide_by_iteration_tokens(engine, [gradient])
    assert gradient.tolist() == [1.0, 1.0] and counting.tokens == 0


def test_a_pipeline_jobs_bad_timers_section_is_named_in_its_config_file():
    plan = pipeline_plan_from_dict(_pipeline_plan())
    with pytest.raises(ValueError, match=r"^ds\.json: timers: expected an object, found str"):
        pipeline_deepspeed_config({"timers": "on"}, plan, 0, source="ds.json")


def _searched_at_start(poplar, **more):
    """The pipeline plan a 3-rank job of 6 layers (types a, a, b) searches at start for a batch of 12."""
    return resolve_pipeline_plan(
        poplar,
        _cluster(),
        world_size=3,
        rank=0,
        num_layers=6,
        zero_stage=None,
        global_batch=GlobalBatchRequest(size=12, origin="poplar.global_batch_size"),
        broadcast=lambda o: o,
        **more,
    )


@pytest.mark.parametrize("cluster_file", [None, "cluster.json"])
def test_missing_layer_profiles_name_a_command_that_runs(tmp_path, cluster_file):
    # poplar-profile requires --deepspeed_config; a job with a cluster file (emulated types, say) needs the
    # profiles of its types, which poplar-profile reads from --cluster (without it: from the hardware).
    section = {"profiles": str(tmp_path / "profiles"), "global_batch_size": 12}
    if cluster_file is not None:
        section["cluster"] = cluster_file
    poplar = poplar_config_from_dict(section, base_dir=tmp_path)
    with pytest.raises(ValueError, match=r"poplar-profile --per-layer ") as raised:
        _searched_at_start(poplar)
    message = str(raised.value)
    assert "--deepspeed_config DS.json" in message
    if cluster_file is None:
        assert "--cluster" not in message
    else:
        assert f"--cluster {tmp_path / cluster_file} " in message


def test_stored_layer_profiles_of_another_dtype_are_measured_again(tmp_path, monkeypatch):
    # The layers' fingerprint is taken before DeepSpeed casts them: a job switched from fp32 to bf16
    # finds its model's fp32 layer profiles, which are not its times or memory. They are measured again.
    import dataclasses

    import numpy as np

    import poplar_ext.search.pipeline_search as pipeline_search
    from poplar_bench.synthetic import SYNTHETIC_LAYERED_MODEL, random_layer_profiles
    from poplar_ext.plan.pipeline_formats import layer_profiles_dir, save_layer_profile

    def store(dtype):
        layers = layer_profiles_dir(tmp_path / "profiles")
        layers.mkdir(parents=True, exist_ok=True)
        model = dataclasses.replace(SYNTHETIC_LAYERED_MODEL, dtype=dtype)
        stored = random_layer_profiles(np.random.default_rng(0), ["a", "b"], num_layers=6, zero_stages=(0, 1))
        for p in stored:  # the file measuring replaces (store_layer_profile: one per type, stage and model)
            save_layer_profile(dataclasses.replace(p, model=model), layers / f"{p.device_type}-{p.zero_stage}.json")

    store("float32")
    measured, searched = [], []
    search = pipeline_search.search_pipeline_plan
    monkeypatch.setattr(
        pipeline_search,
        "search_pipeline_plan",
        lambda profiles, *a, **k: searched.append(profiles) or search(profiles, *a, **k),
    )
    _searched_at_start(
        poplar_config_from_dict({"profiles": str(tmp_path / "profiles"), "global_batch_size": 12}, base_dir=tmp_path),
        layers_fingerprint=lambda: SYNTHETIC_LAYERED_MODEL.fingerprint,
        measure_missing=lambda types, cluster, stages: measured.append(types) or store("bfloat16"),
        dtype="bfloat16",
    )
    assert measured == [["a", "b"]]
    assert {p.model.dtype for p in searched[0]} == {"bfloat16"}


@pytest.mark.parametrize(("stored_optimizer", "measured_again"), [("SGD", True), ("Adam", False)])
def test_the_automatic_mode_reuses_stored_layer_profiles_where_its_profilers_cache_would(
    tmp_path, stored_optimizer, measured_again
):
    # Layer profiles of the model measured under another optimizer (other state, another step) are not this
    # job's: the automatic mode measures them again, as its profiler's cache would; the same config's are reused.
    import dataclasses

    import numpy as np

    from poplar_bench.synthetic import SYNTHETIC_LAYERED_MODEL, random_layer_profiles
    from poplar_ext.plan.pipeline_formats import layer_profiles_dir, save_layer_profile
    from poplar_ext.profiler.auto import missing_layer_profiles_measurer

    def measurer(optimizer):
        ds_config = {"train_batch_size": 12, "optimizer": {"type": optimizer, "params": {"lr": 0.1}}}
        return missing_layer_profiles_measurer(
            layers=[],
            loss_fn=None,
            training_data=[0],
            ds_config=ds_config,
            profiles_dir=tmp_path / "profiles",
            micro_batch_size_limit=12,
        )

    layers = layer_profiles_dir(tmp_path / "profiles")
    layers.mkdir(parents=True)
    key = measurer(stored_optimizer).profiles_key(_cluster(), SYNTHETIC_LAYERED_MODEL.fingerprint)
    provenance = {
        "source": "measured",
        "torch": key.torch_version,
        "deepspeed": key.deepspeed_version,
        "ds_config_fingerprint": key.ds_config_fingerprint,
    }
    for p in random_layer_profiles(np.random.default_rng(0), ["a", "b"], num_layers=6, zero_stages=(0, 1)):
        stored = dataclasses.replace(p, model=SYNTHETIC_LAYERED_MODEL, measured_with=provenance)
        save_layer_profile(stored, layers / f"{p.device_type}-{p.zero_stage}.json")
    measured = []

    def measure(types, cluster, stages):
        measured.append(types)
        raise RuntimeError("measuring")  # which types the job measures is what the test checks

    measure.profiles_key = measurer("Adam").profiles_key
    poplar = poplar_config_from_dict(
        {"profiles": str(tmp_path / "profiles"), "global_batch_size": 12}, base_dir=tmp_path
    )
    fingerprint = SYNTHETIC_LAYERED_MODEL.fingerprint
    if measured_again:
        with pytest.raises(RuntimeError, match="measuring"):
            _searched_at_start(poplar, layers_fingerprint=lambda: fingerprint, measure_missing=measure)
        assert measured == [["a", "b"]]
    else:
        plan = _searched_at_start(poplar, layers_fingerprint=lambda: fingerprint, measure_missing=measure)
        assert measured == [] and set(plan.profile_fingerprints) == {"a", "b"}


def test_a_plan_that_fits_nothing_says_so_in_the_checks_order():
    """Counts, device types, layers, stage, batch: the order pipeline_plan_problems has always said them in."""
    plan = pipeline_plan_from_dict(_pipeline_plan())
    problems = pipeline_plan_problems(
        plan,
        _cluster(("a", "b", "b")),
        world_size=3,
        num_layers=7,
        zero_stage=0,
        global_batch=GlobalBatchRequest(size=16, origin="x"),
    )
    starts = ["Device types differ", "The plan splits", "The plan is for ZeRO stage", "The plan's global batch"]
    assert [next(i for i, p in enumerate(problems) if p.startswith(s)) for s in starts] == [0, 1, 2, 3]
    counts = pipeline_plan_problems(
        plan,
        _cluster(("a", "b", "b", "b")),
        world_size=2,
        num_layers=6,
        zero_stage=0,
        global_batch=GlobalBatchRequest(size=16, origin="x"),
    )
    assert [p.split(" ")[2] for p in counts] == ["names", "description", "is", "global"]


def test_the_pipeline_folder_pattern_is_public():
    from poplar_ext.pipeline.checkpoint import PIPELINE_FOLDER, pipeline_folder

    assert PIPELINE_FOLDER.format(index=2) == pipeline_folder(2) == "pipeline2"


def test_the_zero_0_fp32_clip_reports_the_norm_it_clipped_by(monkeypatch):
    # DeepSpeed's get_global_grad_norm() said None for an fp32 pipeline at ZeRO 0 with clipping on: its clip
    # dropped the norm it computed (the Trainer logs no grad_norm, a loop has none to log).
    from types import SimpleNamespace

    import poplar_ext.pipeline.engine as pipeline_engine
    from poplar_ext.pipeline.engine import PoplarPipelineEngine

    monkeypatch.setattr(pipeline_engine, "sum_in_group", lambda tensor, group=None: None)  # one pipeline stage
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0])
    engine = SimpleNamespace(
        module=torch.nn.ParameterList([weight]),
        device=torch.device("cpu"),
        grid=SimpleNamespace(get_pipe_parallel_group=lambda: None),
        gradient_clipping=lambda: 1.0,
    )
    PoplarPipelineEngine.clip_fp32_gradients(engine)
    assert engine._global_grad_norm == pytest.approx(5.0)
    assert torch.allclose(weight.grad, torch.tensor([0.6, 0.8]), atol=1e-5)


def test_a_pipeline_job_logs_where_its_plan_came_from(monkeypatch, caplog):
    # A ZeRO job and a PoplarTrainer log "poplar plan from step 0: the plan file ..." or "searched at start from
    # ..."; a pipeline job logged its ranks' places alone, so its log never said which plan it trained.
    import logging
    from types import SimpleNamespace

    from poplar_ext.pipeline import initialize as pipeline_initialize

    plan = pipeline_plan_from_dict(_pipeline_plan(), source="p.json")
    cluster = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [{"name": "n", "devices": [{"device_type": "a", "count": 2}, {"device_type": "b", "count": 1}]}],
        }  # fmt: skip
    )
    job = SimpleNamespace(
        rank=0,
        plan=plan,
        pipeline_index=0,
        stage_index=0,
        pipeline=plan.pipelines[0],
        cluster=cluster,
        ds_config={},
        plan_reason="searched at start from the layer profiles in profiles",
        poplar_config=SimpleNamespace(log_interval_steps=10, loss_reduction="mean"),
    )
    engine = SimpleNamespace(optimizer=None, lr_scheduler=None)
    monkeypatch.setattr(pipeline_initialize, "_build_engine", lambda *args, **kwargs: engine)
    monkeypatch.setattr(pipeline_initialize, "warn_unloadable_optimizer_state", lambda *args, **kwargs: None)
    with caplog.at_level(logging.INFO, logger=pipeline_initialize.logger.name):
        assert pipeline_initialize.initialize_pipeline(model=SimpleNamespace(poplar_job=job))[0] is engine
    assert "poplar plan from step 0: searched at start from the layer profiles in profiles" in caplog.text
    assert "rank 0: a (real), pipeline 0 stage 0 of 2 (layers 0-1)" in caplog.text
