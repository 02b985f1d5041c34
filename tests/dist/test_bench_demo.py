"""Smoke test of `poplar-bench demo` (poplar_bench/demo.py): a tiny model, one iteration per policy.

Real DeepSpeed on 3 forked CPU ranks with emulated device types, run twice: the
second run must reuse the profiles and the emulated cluster of the first. Speed and
the demo's goals are not asserted here (they are reported by the demo itself).
"""

from __future__ import annotations

import dataclasses
import json

from poplar_bench.demo import run_demo
from poplar_bench.demo_config import DemoModel, DemoSettings


def _settings(cache_dir):
    return DemoSettings(
        model=DemoModel(vocab_size=64, sequence_length=16, num_layers=1, num_heads=2, hidden_size=32),
        global_batch_size=12,
        max_micro_batch_size=2,
        iterations=1,
        rounds=1,
        warmup_iterations=0,
        standalone_repeats=1,
        cache_dir=cache_dir,
        timeout_s=240,
    )


def test_demo_trains_every_policy_and_reuses_profiles(tmp_path):
    settings = _settings(tmp_path / "cache")
    paths = run_demo(settings, out_dir=tmp_path / "out", name="demo")
    assert [p.name for p in paths] == ["demo.json", "demo.md", "demo.png"]
    report = json.loads(paths[0].read_text())
    scenario = report["scenarios"][0]
    assert scenario["profiles_from_cache"] is False
    assert {info["source"] for info in scenario["device_types"].values()} == {"emulated"}
    entries = {e["policy"]: e for e in scenario["policies"]}
    assert set(entries) == {"uniform", "proportional", "poplar"}
    for entry in entries.values():
        assert entry["status"] == "ok", entry["message"]
        assert len(entry["measured"]["iteration_time_s"]["repetitions"]) == 1
        assert entry["measured"]["samples_per_s"] > 0 and entry["prediction_error"] is not None
        assert sum(r["micro_batch_size"] * r["gradient_accumulation_steps"] for r in entry["ranks"]) == 12
    assert scenario["ideal_samples_per_s"]["measured"] > 0
    assert {g["goal"] for g in scenario["goals"]} >= {
        "poplar share of the measured ideal",
        "poplar faster than uniform",
    }

    assert scenario["calibration"] == {}, "fresh profiles are not checked"
    # Emulated compute is steady at its profile: the demo checks nothing unless asked; asked, cached ones.
    assert settings.calibration == "off"
    cached = dataclasses.replace(settings, calibration="cached")
    again = json.loads(run_demo(cached, out_dir=tmp_path / "out2", name="demo")[0].read_text())
    assert again["scenarios"][0]["profiles_from_cache"] is True
    # The same profiles, but for what a rescaled one says of its rescaling.
    types = again["scenarios"][0]["device_types"]
    calibrated = {t: info["profile"].pop("calibration", None) for t, info in types.items()}
    assert types == scenario["device_types"]
    # Cached profiles were timed at start against their curves, and every plan records it.
    checks = again["scenarios"][0]["calibration"]
    assert set(checks) == set(scenario["device_types"])
    assert all(c["outcome"] in ("trusted", "rescaled") and c["sizes"] for c in checks.values())
    assert all((calibrated[t] is not None) == (c["outcome"] == "rescaled") for t, c in checks.items())
    assert again["timings_s"]["rank0_calibration_s"] > 0
