"""search_plan, check_plan and predict (poplar_ext/search/api.py)."""

import dataclasses

import numpy as np
import pytest

from poplar_bench.synthetic import random_profiles, simple_cluster, synthetic_profile
from poplar_ext.plan.formats import ModelInfo, plan_from_dict, plan_to_dict
from poplar_ext.search import check_plan, predict, search_plan


@pytest.fixture
def profiles():
    return random_profiles(np.random.default_rng(3), ["A100", "V100"])


@pytest.fixture
def cluster():
    return simple_cluster({"A100": 2, "V100": 3})


def test_auto_stage_keeps_the_fastest_and_says_why_others_lost(profiles, cluster):
    result = search_plan(profiles, cluster, global_batch_size=120)
    assert result.ok and result.plan.global_batch_size == 120
    reports = {r.zero_stage: r for r in result.stage_reports}
    assert set(reports) == {0, 1, 2, 3}
    assert reports[result.zero_stage].status == "chosen"
    for stage, report in reports.items():
        assert report.iteration_time_s >= reports[result.zero_stage].iteration_time_s
        if stage != result.zero_stage:
            assert report.status == "slower" and "lower predicted throughput than stage" in report.reason
    assert "global batch 120" in result.message and "world size 4, the cluster has 5 ranks" in result.message


def test_plan_is_complete_and_round_trips(profiles, cluster):
    plan = search_plan(profiles, cluster, global_batch_size=120, zero_stage=2).plan
    assert plan.zero_stage == 2 and plan.policy == "poplar"
    assert [r.device_type for r in plan.ranks] == list(cluster.rank_device_types)
    fingerprints = {p.device_type: p.fingerprint for p in profiles if p.zero_stage == 2}
    assert plan.profile_fingerprints == fingerprints
    assert plan_from_dict(plan_to_dict(plan)) == plan
    assert check_plan(plan, cluster, profiles) == []
    prediction = predict(plan, profiles)
    assert prediction.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)
    assert prediction.samples_per_s == pytest.approx(plan.predicted.samples_per_s)
    assert len(prediction.rank_busy_time_s) == 5
    assert max(prediction.rank_busy_time_s) + prediction.boundary_s == pytest.approx(prediction.iteration_time_s)


def test_auto_batch_respects_the_maximum_and_says_which(profiles, cluster):
    result = search_plan(profiles, cluster, max_global_batch_size=100)
    assert result.ok and result.plan.global_batch_size <= 100
    assert (
        f"global batch {result.plan.global_batch_size} (chosen for the highest predicted throughput up to 100)"
        in result.message
    )


@pytest.mark.parametrize("policy", ["poplar", "uniform", "proportional"])
def test_every_policy_returns_the_same_result_type(profiles, cluster, policy):
    result = search_plan(profiles, cluster, global_batch_size=150, policy=policy, zero_stage=1)
    assert result.ok and result.policy == policy and result.plan.policy == policy


def test_poplar_never_predicts_slower_than_the_baselines(profiles, cluster):
    best = search_plan(profiles, cluster, global_batch_size=150).plan.predicted.iteration_time_s
    for policy in ("uniform", "proportional"):
        other = search_plan(profiles, cluster, global_batch_size=150, policy=policy)
        assert best <= other.plan.predicted.iteration_time_s


def test_model_that_fits_no_stage_on_a_device_is_infeasible_with_reason(cluster):
    profiles = [
        synthetic_profile(
            name,
            zero_stage=stage,
            max_micro_batch_size=0 if name == "V100" else 8,
            overhead_s=0.1,
            seconds_per_sample=0.01,
        )
        for name in ("A100", "V100")
        for stage in (0, 3)
    ]
    result = search_plan(profiles, cluster, global_batch_size=64)
    assert result.status == "infeasible" and result.plan is None
    assert "The model does not fit V100 at stage 0" in result.message
    reports = {r.zero_stage: r for r in result.stage_reports}
    assert reports[1].status == "infeasible" and "No profile for A100, V100 at stage 1" in reports[1].reason


def test_unreachable_batch_is_infeasible(profiles, cluster):
    result = search_plan(profiles, cluster, global_batch_size=3, zero_stage=0)
    assert result.status == "infeasible" and "smaller than the 5 ranks" in result.message


def test_stages_that_price_the_same_work_tie_and_the_lower_stage_wins():
    # At one accumulation step stages 1 and 2 issue the same collectives; their float sums differ in the last
    # digits (0.16471656099997936 s at stage 2, 0.1647165609999794 s at stage 1), which chose stage 2, reported
    # "0.0% lower predicted throughput than stage 2" for stage 1, against the documented tie rule.
    from poplar_ext.plan.formats import load_cluster, load_profiles
    from poplar_ext.plan.network_format import find_network
    from poplar_ext.search.examples import example_cluster_file, example_profiles_dir

    cluster = load_cluster(example_cluster_file())
    network = find_network(example_profiles_dir(), cluster)
    result = search_plan(load_profiles(example_profiles_dir()), cluster, global_batch_size=100, network=network)
    reports = {r.zero_stage: r for r in result.stage_reports}
    assert reports[1].iteration_time_s == pytest.approx(reports[2].iteration_time_s, rel=1e-12)
    assert result.zero_stage == 1 and reports[1].status == "chosen"
    assert reports[2].reason == "0.0% lower predicted throughput than stage 1 (a tie: the lower stage is chosen)."


def test_unknown_device_type_is_bad_input(profiles):
    with pytest.raises(
        ValueError, match=r"cluster: expected device types that the profiles cover \(A100, V100\), found 'H100'"
    ):
        search_plan(profiles, simple_cluster({"A100": 1, "H100": 1}), global_batch_size=8)


def test_profiles_of_two_models_are_bad_input(profiles, cluster):
    other = dataclasses.replace(
        profiles[0], model=ModelInfo(name="other", fingerprint="f2", num_parameters=3, dtype="float32")
    )
    with pytest.raises(ValueError, match=r"profiles: expected profiles of one model, found 2 models"):
        search_plan(profiles[1:] + [other], cluster)


@pytest.mark.parametrize("field, other", [("dtype", "bfloat16"), ("sequence_length", 512)])
def test_profiles_of_one_model_measured_two_ways_are_bad_input(profiles, cluster, field, other):
    # One fingerprint in two dtypes (taken before DeepSpeed casts) or sequence lengths: a cache may hold both, one
    # type in each; the search mixed them silently (and priced every type's collectives in the last type's dtype).
    profiles = [dataclasses.replace(p, model=dataclasses.replace(p.model, sequence_length=256)) for p in profiles]
    v100 = [dataclasses.replace(p, model=dataclasses.replace(p.model, **{field: other})) for p in profiles if
            p.device_type == "V100"]  # fmt: skip
    mixed = [p for p in profiles if p.device_type != "V100"] + v100
    with pytest.raises(ValueError, match=rf"profiles: expected one model\.{field} over the profiles used, found "):
        search_plan(mixed, cluster, global_batch_size=120)
    plan = search_plan(profiles, cluster, global_batch_size=120, zero_stage=2).plan
    with pytest.raises(ValueError, match=rf"profiles: expected one model\.{field} over the profiles used, found "):
        predict(plan, mixed)
    # A type the cluster does not have is not used: its profiles may be another job's.
    others = [dataclasses.replace(p, device_type="H100") for p in v100]
    assert search_plan(profiles + others, cluster, global_batch_size=120).ok


def test_check_plan_names_the_files_of_profiles_of_two_models(profiles, cluster, tmp_path):
    # check_plan said how many models, not which nor where: the files of each are named, as loaded.
    from poplar_ext.plan.formats import load_profiles, save_profile

    plan = search_plan(profiles, cluster, global_batch_size=120, zero_stage=2).plan
    other = dataclasses.replace(
        profiles[0], model=ModelInfo(name="other", fingerprint="f2", num_parameters=3, dtype="float32")
    )
    for index, profile in enumerate([*profiles, other]):
        save_profile(profile, tmp_path / f"p{index:02}.json")
    problems = check_plan(plan, cluster, load_profiles(tmp_path))
    mixed = next(p for p in problems if p.startswith("The profiles describe 2 different models; expected one."))
    assert f"other (f2): {tmp_path / f'p{len(profiles):02}.json'}" in mixed, mixed
    assert f"({profiles[1].model.fingerprint}): {tmp_path / 'p00.json'}" in mixed, mixed
    # Made in Python, they have no files: the models alone.
    mixed = next(p for p in check_plan(plan, cluster, [*profiles, other]) if "different models" in p)
    model = profiles[0].model
    assert mixed.endswith(f"The models: other (f2); {model.name} ({model.fingerprint})."), mixed


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"global_batch_size": 0},
            r"global_batch_size: expected None or an integer from 1 to 2147483648 \(the search.s limit\), found 0",
        ),
        (
            {"global_batch_size": 2.5},
            r"global_batch_size: expected None or an integer from 1 to 2147483648 \(the search.s limit\), found 2.5",
        ),
        (
            {"max_global_batch_size": True},
            r"max_global_batch_size: expected None or an integer from 1 to 2147483648 \(the search.s limit\), found "
            r"True",
        ),
        ({"zero_stage": 4}, r"zero_stage: expected 'auto' or one of 0, 1, 2, 3, found 4"),
        ({"policy": "fastest"}, r"policy: expected one of 'uniform', 'proportional', 'poplar', found 'fastest'"),
        (
            {"global_batch_size": 50, "max_global_batch_size": 40},
            r"global_batch_size: expected at most max_global_batch_size \(40\), found 50",
        ),
    ],
)
def test_bad_arguments(profiles, cluster, kwargs, match):
    with pytest.raises(ValueError, match=match):
        search_plan(profiles, cluster, **kwargs)


def test_bad_argument_types(profiles, cluster):
    with pytest.raises(ValueError, match=r"cluster: expected a poplar_ext.plan.formats.Cluster, found dict"):
        search_plan(profiles, {"nodes": []})
    with pytest.raises(ValueError, match=r"profiles\[1\]: expected a poplar_ext.plan.formats.Profile, found str"):
        search_plan([profiles[0], "p.json"], cluster)


def test_check_plan_reports_each_problem_as_a_sentence(profiles, cluster):
    plan = search_plan(profiles, cluster, global_batch_size=100, zero_stage=2).plan
    assert check_plan(plan, simple_cluster({"A100": 2, "V100": 2})) == ["The plan has 5 ranks but the cluster has 4."]
    problems = check_plan(plan, simple_cluster({"V100": 2, "A100": 3}))
    assert problems == [
        "Device types differ from the cluster's at rank 0 (A100 in the plan, V100 in the cluster), "
        "rank 1 (A100 in the plan, V100 in the cluster), rank 2 (V100 in the plan, A100 in the cluster) and 2 more."
    ]
    ranks = list(plan.ranks)
    ranks[0] = dataclasses.replace(
        ranks[0], gradient_accumulation_steps=ranks[0].gradient_accumulation_steps + 1, micro_batch_size=500
    )
    bad = dataclasses.replace(plan, ranks=tuple(ranks))
    problems = check_plan(bad, cluster, profiles)
    assert any("ZeRO stage 2 needs the same gradient_accumulation_steps on every rank" in p for p in problems)
    assert any(
        "micro_batch_size is above the profile's max_micro_batch_size at rank 0 (A100: 500 >" in p for p in problems
    )
    only_a100 = [p for p in profiles if p.device_type == "A100"]
    assert check_plan(plan, cluster, only_a100) == ["No profile at ZeRO stage 2 for V100."]


def test_predict_rejects_plans_outside_the_profiles(profiles, cluster):
    plan = search_plan(profiles, cluster, global_batch_size=100, zero_stage=1).plan
    with pytest.raises(ValueError, match=r"found none for V100"):
        predict(plan, [p for p in profiles if p.device_type == "A100"])
    ranks = list(plan.ranks)
    ranks[0] = dataclasses.replace(ranks[0], micro_batch_size=10_000)
    with pytest.raises(ValueError, match=r"micro_batch_size: expected 1 to \d+ on A100 at ZeRO stage 1, found"):
        predict(dataclasses.replace(plan, ranks=tuple(ranks)), profiles)


def test_profiles_without_a_sequence_length_go_with_any(profiles, cluster):
    # A sequence length of None (data without token ids) reuses cached profiles of any length
    # (ProfileCache.holds): the search must not then refuse the mix the cache made.
    a100 = [dataclasses.replace(p, model=dataclasses.replace(p.model, sequence_length=512)) for p in profiles if
            p.device_type != "V100"]  # fmt: skip
    mixed = a100 + [p for p in profiles if p.device_type == "V100"]
    assert {p.model.sequence_length for p in mixed} == {512, None}
    assert search_plan(mixed, cluster, global_batch_size=120).ok
