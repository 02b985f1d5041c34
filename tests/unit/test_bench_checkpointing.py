"""poplar-bench checkpointing and simulate's checkpointing section (issue 16): the parts that need no ranks."""

from pathlib import Path

import pytest

from poplar_bench import checkpointing, gpu_model, simulate
from poplar_bench.cli import build_parser
from poplar_bench.report import render_checkpointing

CLUSTERS = Path(__file__).resolve().parents[2] / "poplar_bench" / "clusters"


def test_modelled_checkpointing_trades_compute_for_memory():
    shape, spec, assumptions = (
        gpu_model.model_shape("gpt2-xl-1.5b"),
        gpu_model.gpu_spec("T4-16GB"),
        gpu_model.Assumptions(),
    )
    for stage in (1, 2, 3):
        plain = gpu_model.modelled_profile(spec, shape, zero_stage=stage, world_size=8)
        ckpt = gpu_model.modelled_profile(spec, shape, zero_stage=stage, world_size=8, activation_checkpointing=True)
        assert ckpt.activation_checkpointing and not plain.activation_checkpointing
        assert ckpt.max_micro_batch_size > plain.max_micro_batch_size > 0
        times = {s.micro_batch_size: s.micro_step_time_s for s in plain.samples}
        for sample in ckpt.samples:
            if sample.micro_batch_size in times:
                assert sample.micro_step_time_s > times[sample.micro_batch_size]
    # Stage 3 gathers the weights once more for the recomputed forward.
    at = {"spec": spec, "shape": shape, "world_size": 8, "micro_batch_size": 1, "assumptions": assumptions}
    extra_3 = gpu_model.micro_step_time_s(
        zero_stage=3, activation_checkpointing=True, **at
    ) - gpu_model.micro_step_time_s(zero_stage=3, **at)
    extra_2 = gpu_model.micro_step_time_s(
        zero_stage=2, activation_checkpointing=True, **at
    ) - gpu_model.micro_step_time_s(zero_stage=2, **at)
    assert extra_3 > extra_2 > 0


def test_simulate_shows_the_choice_on_the_small_memory_clusters():
    cases = simulate.shipped_cases(
        [CLUSTERS / "v100-16gb+t4-16gb-x8.json"], [gpu_model.model_shape("gpt2-xl-1.5b")], checkpointing=(False, True)
    )
    rows = simulate.checkpointing_effect(cases)
    stage2 = rows[0]["stages"]["2"]
    assert stage2["gain"] > 1.0
    assert any(t["activation_checkpointing"] for t in stage2["with_choice"]["types"].values())
    for cell in rows[0]["stages"].values():
        assert cell["gain"] is None or cell["gain"] >= 1.0 - 1e-12, "the choice includes leaving it off"
        if cell["without"]["status"] == "ok":
            assert cell["with_choice"]["status"] == "ok", "the choice never loses a feasible plan"
    text = "\n".join(render_checkpointing(rows))
    assert "v100-16gb+t4-16gb-x8" in text and "MODELLED" in text
    assert f"{stage2['gain']:.2f}x" in text, "the table shows the stage-2 gain"


def test_the_cli_knows_the_checkpointing_bench():
    args = build_parser().parse_args(["checkpointing", "--rounds", "2", "--output-dir", "out"])
    assert args.rounds == 2 and args.output_dir == Path("out")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["checkpointing", "--rounds", "0"])


def test_the_cases_differ_only_in_the_fast_types_memory(tmp_path):
    tight, roomy = (checkpointing.case_settings(c, cache_dir=tmp_path) for c in checkpointing.CASES)
    assert tight.activation_checkpointing == roomy.activation_checkpointing == "both"
    assert tight.zero_stage == 2 and tight.profiles_dir() != roomy.profiles_dir()
    assert tight.devices[0].memory_headroom_bytes < roomy.devices[0].memory_headroom_bytes
    assert tight.devices[1:] == roomy.devices[1:]
    with pytest.raises(ValueError, match="case: expected one of tight, roomy"):
        checkpointing.case_settings("huge")


def test_the_report_names_what_was_checkpointed_and_the_ratio():
    plan = {
        "ranks": [
            {
                "device_type": "cpu-slow",
                "micro_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "activation_checkpointing": True,
            }
        ],
        "predicted_samples_per_s": 10.0,
        "measured_samples_per_s": 9.0,
    }
    other = {**plan, "ranks": [{**plan["ranks"][0], "activation_checkpointing": False}]}
    report = {
        "data_source": "Measured on emulated devices",
        "notes": "n",
        "cases": [
            {
                "case": "tight",
                "plans": {"poplar": plan, "poplar-no-checkpointing": other},
                "checkpointed_types": ["cpu-slow"],
                "measured_ratio": 1.25,
                "predicted_ratio": 1.2,
                "profiles": [
                    {"device_type": "cpu-slow", "activation_checkpointing": False, "max_micro_batch_size": 1},
                    {"device_type": "cpu-slow", "activation_checkpointing": True, "max_micro_batch_size": 6},
                ],
            }
        ],
    }
    text = checkpointing.markdown(report)
    assert "| tight | poplar | cpu-slow | 4x2 | 10.00 | 9.00 |" in text
    assert "| tight | poplar-no-checkpointing | none |" in text
    assert "cpu-slow 1 / 6" in text and "measured 1.250x" in text and "emulated" in text


def test_modelled_offload_frees_the_optimizer_state_and_slows_the_boundary():
    shape, spec = gpu_model.model_shape("gpt2-xl-1.5b"), gpu_model.gpu_spec("T4-16GB")
    for stage in (1, 2):
        plain = gpu_model.modelled_profile(spec, shape, zero_stage=stage, world_size=8)
        offloaded = gpu_model.modelled_profile(spec, shape, zero_stage=stage, world_size=8, optimizer_offload=True)
        assert offloaded.optimizer_offload and offloaded.max_micro_batch_size >= plain.max_micro_batch_size
        # 12 bytes per parameter of the shard (fp32 master weights, Adam's two moments) leave the device.
        for before, after in zip(plain.samples, offloaded.samples):
            assert before.peak_memory_bytes - after.peak_memory_bytes == pytest.approx(
                1.5 * shape.num_parameters, rel=1e-6
            )
        assert offloaded.optimizer_step_time_s > plain.optimizer_step_time_s
        assert [s.micro_step_time_s for s in offloaded.samples[: len(plain.samples)]] == [
            s.micro_step_time_s for s in plain.samples
        ]
    assert offloaded.max_micro_batch_size > plain.max_micro_batch_size, "at stage 2 one more sample fits"
    with pytest.raises(ValueError, match="optimizer_offload: expected ZeRO stage 1 or 2, found stage 3"):
        gpu_model.modelled_profile(spec, shape, zero_stage=3, world_size=8, optimizer_offload=True)
    both = gpu_model.modelled_profiles(["T4-16GB"], shape, world_size=8, offload=(False, True))
    assert sorted((p.zero_stage, p.optimizer_offload) for p in both) == [
        (0, False),
        (1, False),
        (1, True),
        (2, False),
        (2, True),
        (3, False),
    ]


def test_simulate_shows_the_offload_choice_apart_from_checkpointing():
    cases = simulate.shipped_cases(
        [CLUSTERS / "v100-16gb+t4-16gb-x8.json"],
        [gpu_model.model_shape("gpt2-xl-1.5b")],
        checkpointing=(False, True),
        offload=(False, True),
    )
    stage2 = simulate.offload_effect(cases)[0]["stages"]["2"]
    assert stage2["gain"] > 1.0
    chosen = stage2["with_choice"]["types"].values()
    assert any(t["optimizer_offload"] for t in chosen) and not any(t["activation_checkpointing"] for t in chosen)
    # The checkpointing section is what it was without offloaded profiles.
    plain_cases = simulate.shipped_cases(
        [CLUSTERS / "v100-16gb+t4-16gb-x8.json"], [gpu_model.model_shape("gpt2-xl-1.5b")], checkpointing=(False, True)
    )
    with_offload, without = (simulate.checkpointing_effect(c)[0]["stages"] for c in (cases, plain_cases))
    assert {s: c["gain"] for s, c in with_offload.items()} == {s: c["gain"] for s, c in without.items()}
    report = simulate.simulation_report(cases[:1], scaling=False, checkpointing_cases=cases)
    from poplar_bench.report import render_offload

    text = "\n".join(render_offload(report["offload"]))
    assert "Optimizer offload per device type" in text and f"{stage2['gain']:.2f}x" in text
