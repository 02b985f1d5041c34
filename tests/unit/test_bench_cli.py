"""`poplar-bench` command line (poplar_bench/cli.py): options, exit codes, output files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poplar_bench import cli
from poplar_bench.cluster_files import CLUSTER_DIR

SMALL_CLUSTER = CLUSTER_DIR / "a100-80gb+a100-40gb-x8.json"


def test_simulate_writes_the_three_report_files(tmp_path, capsys):
    code = cli.main(
        [
            "simulate",
            "--cluster",
            str(SMALL_CLUSTER),
            "--model",
            "gpt2-xl-1.5b",
            "--output-dir",
            str(tmp_path),
            "--name",
            "s",
        ]
    )
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.md", "s.png"]
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["kind"] == "simulation" and len(report["scenarios"]) == 1
    # Paths inside the checkout are written relative to it.
    assert report["scenarios"][0]["cluster"]["file"] == "poplar_bench/clusters/a100-80gb+a100-40gb-x8.json"
    assert str(tmp_path / "s.json") in capsys.readouterr().out


def test_simulate_global_batch_size_applies_to_every_policy(tmp_path):
    code = cli.main(
        [
            "simulate",
            "--cluster",
            str(SMALL_CLUSTER),
            "--model",
            "gpt2-xl-1.5b",
            "--global-batch-size",
            "64",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert code == 0
    scenario = json.loads((tmp_path / "simulation.json").read_text())["scenarios"][0]
    assert {e["global_batch_size"] for e in scenario["policies"]} == {64}


def test_a_bad_cluster_file_exits_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "nodes": []}')
    assert cli.main(["simulate", "--cluster", str(bad), "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json: nodes: expected" in err
    assert not (tmp_path / "simulation.json").exists()


def test_an_unknown_model_exits_2(tmp_path, capsys):
    assert (
        cli.main(["simulate", "--cluster", str(SMALL_CLUSTER), "--model", "gpt-9", "--output-dir", str(tmp_path)]) == 2
    )
    assert "model: expected one of the model presets" in capsys.readouterr().err


def test_profiles_and_model_together_exit_2(tmp_path, capsys):
    assert (
        cli.main(["simulate", "--profiles", str(tmp_path), "--model", "gpt2-xl-1.5b", "--output-dir", str(tmp_path)])
        == 2
    )
    assert "--model: only for modelled profiles" in capsys.readouterr().err


def test_profiles_of_two_models_are_refused_with_what_simulate_can_do(tmp_path, capsys):
    # The search's message said "(poplar-search: --model NAME picks one)"; simulate refuses --model with --profiles.
    from poplar_bench import gpu_model
    from poplar_ext.plan.formats import save_profile

    folder = tmp_path / "profiles"
    folder.mkdir()
    for shape in gpu_model.MODEL_SHAPES:
        for index, profile in enumerate(
            gpu_model.modelled_profiles(["A100-80GB", "A100-40GB"], shape, world_size=8, zero_stages=(1,))
        ):
            save_profile(profile, folder / f"{shape.name}-{index}.json")
    argv = ["simulate", "--profiles", str(folder), "--cluster", str(SMALL_CLUSTER), "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "profiles: expected profiles of one model, found 2 models" in err
    assert err.rstrip().endswith(
        "poplar-bench simulate cannot pick one (its --model is for modelled profiles only): give --profiles a "
        f"folder holding one model's profiles, not {folder}"
    )
    assert "[1/1]" not in err, "refused before any search"


def test_a_bad_stage_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["simulate", "--zero-stage", "5"])
    assert exit_info.value.code == 2
    assert "expected auto, 0, 1, 2 or 3, found '5'" in capsys.readouterr().err


def test_a_subcommand_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    assert exit_info.value.code == 2
    # The error lists every command each module registered, and only those.
    listed = capsys.readouterr().err.rsplit("required: ", 1)[1].strip()
    registered = [a for a in cli.build_parser()._actions if a.dest == "command"][0].choices
    assert listed == "{" + ",".join(registered) + "}" and len(registered) == len(cli.COMMANDS)


def test_default_output_dir_is_the_checkouts_bench_results():
    assert cli.default_output_dir() == Path(cli.__file__).resolve().parents[1] / "bench" / "results"


def test_demo_help_says_where_reports_go(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "bench/results" in out and "--iterations" in out and "--cache-dir" in out


def test_demo_help_states_the_default_devices_slowdowns(capsys):
    from poplar_bench.demo_config import default_devices

    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    fast, medium, slow = (d.slowdown for d in default_devices())
    assert f"cpu-fast, {fast:g}x slower than a CPU core; cpu-medium, {medium:g}x; cpu-slow, {slow:g}x" in out


def test_the_demo_says_where_its_report_went_and_that_it_replaced_the_checkouts(monkeypatch, tmp_path, capsys):
    from poplar_bench import demo

    monkeypatch.setattr(demo, "run_demo", lambda settings, *, out_dir, name: [out_dir / f"{name}.json"])
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'demo.json'}\n", "stdout: the paths alone"
    assert err.endswith(f"[poplar-bench demo] report written into {tmp_path}: demo.json\n"), err
    monkeypatch.setattr(demo, "run_demo", lambda settings, *, out_dir, name: [])
    assert cli.main(["demo"]) == 0
    assert "(this checkout's bench/results, replacing the committed report;" in capsys.readouterr().err


def test_the_demo_s_goal_summary_names_what_was_missed():
    from poplar_bench.demo import goals_summary

    met = {"goal": "prediction error", "target": "<= 0.05", "met": True}
    missed = {"goal": "poplar share of the measured ideal", "target": ">= 0.95", "met": False}
    assert goals_summary([met, met]) == "2 of 2 goals met"
    assert goals_summary([met, missed]) == (
        "1 of 2 goals met (missed: poplar share of the measured ideal >= 0.95); a goal is a measurement, "
        "reported here, not in the exit status"
    )


def test_the_demo_s_console_summary_says_the_devices_are_emulated_and_what_each_policy_ran():
    # The console ended with samples/s per policy alone: nothing said the devices were emulated (on a cached run no
    # line did) nor which allocation each policy trained with.
    from poplar_bench.demo import console_summary

    ranks = [
        {"device_type": "cpu-fast", "micro_batch_size": 22, "gradient_accumulation_steps": 5},
        {"device_type": "cpu-slow", "micro_batch_size": 13, "gradient_accumulation_steps": 2},
    ]
    poplar = {
        "policy": "poplar",
        "status": "ok",
        "zero_stage": 1,
        "ranks": ranks,
        "measured": {"samples_per_s": 135.6},
        "predicted": {"samples_per_s": 135.5},
        "speedup_over_uniform": 2.4,
        "share_of_ideal": 0.96,
    }
    report = {
        "data_source": "measured on CPU ranks with EMULATED device types (compute slowdown, memory capacity)",
        "scenarios": [
            {
                "name": "2 CPU ranks emulating cpu-fast, cpu-slow",
                "global_batch_size": 136,
                "policies": [poplar, {"policy": "uniform", "status": "infeasible", "message": "no plan"}],
                "goals": [{"goal": "g", "target": "> 1", "value": 2.4, "met": True}],
            }
        ],
    }
    lines = console_summary(report)
    assert lines[0].startswith("2 CPU ranks emulating cpu-fast, cpu-slow, global batch 136: measured on CPU ranks ")
    assert "EMULATED" in lines[0]
    assert lines[1] == (
        "      poplar: 135.6 samples/s measured, 135.5 predicted, 2.40x uniform, 0.96 of ideal "
        "(ZeRO 1, micro-batch x accumulation: cpu-fast 22x5, cpu-slow 13x2)"
    )
    assert lines[2:] == ["uniform: no plan", "goal g > 1: 2.4 (met)", "1 of 1 goals met"]


@pytest.mark.multiprocess
def test_simulate_never_imports_torch(tmp_path):
    code = (
        "import sys; from poplar_bench import cli; "
        f"rc = cli.main(['simulate', '--cluster', {str(SMALL_CLUSTER)!r}, '--model', 'gpt2-xl-1.5b', '--output-dir', "
        f"{str(tmp_path)!r}]); "
        "assert rc == 0, rc; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr


def test_search_speed_runs_the_search_engineers_benchmark(tmp_path, monkeypatch):
    from poplar_bench import search_speed

    calls = []
    real = search_speed.run_search_speed

    def small(**kwargs):
        calls.append(kwargs)
        # Every kind of cell, each at one small size: the command is under test here, not the search.
        return real(
            rank_counts=(8,), type_counts=(1,), repeats=kwargs["repeats"], large_batches=(2**22,), lever_ranks=64
        )

    monkeypatch.setattr(search_speed, "run_search_speed", small)
    assert cli.main(["search-speed", "--repeats", "1", "--output-dir", str(tmp_path)]) == 0
    assert calls == [{"repeats": 1}]
    assert (tmp_path / "search_speed.json").exists() and (tmp_path / "search_speed.md").exists()


def test_search_speed_times_as_many_lever_problems_as_asked(tmp_path, monkeypatch):
    from poplar_bench import search_speed

    calls = []
    real = search_speed.run_search_speed

    def small(**kwargs):
        calls.append(kwargs)
        return real(rank_counts=(), type_counts=(), repeats=1, large_batches=(), lever_ranks=None)

    monkeypatch.setattr(search_speed, "run_search_speed", small)
    argv = ["search-speed", "--repeats", "1", "--lever-problems", "3", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    assert calls == [{"repeats": 1, "lever_seeds": (0, 1, 2)}]


def _without_matplotlib(monkeypatch):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_simulate_writes_json_and_markdown_and_says_so_first(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    code = cli.main(
        [
            "simulate",
            "--cluster",
            str(SMALL_CLUSTER),
            "--model",
            "gpt2-xl-1.5b",
            "--output-dir",
            str(tmp_path),
            "--name",
            "s",
        ]
    )
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.md"]
    err = capsys.readouterr().err
    warning = "the PNG figure needs matplotlib"
    assert warning in err and err.index(warning) < err.index("[1/1]")  # before the work, not after


def test_without_matplotlib_the_demo_warns_before_it_starts(tmp_path, capsys, monkeypatch):
    _without_matplotlib(monkeypatch)
    from poplar_bench import demo

    def no_demo(settings, *, out_dir, name):
        assert "the PNG figure needs matplotlib" in capsys.readouterr().err  # said before any work
        return []

    monkeypatch.setattr(demo, "run_demo", no_demo)
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 0


def test_demo_takes_a_stage_and_one_rank_per_slowdown(monkeypatch, tmp_path):
    from poplar_bench import demo

    seen = {}

    def record(settings, *, out_dir, name):
        seen["settings"] = settings
        return []

    monkeypatch.setattr(demo, "run_demo", record)
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--zero-stage", "3", "--slowdowns", "3,4.5,9"]) == 0
    settings = seen["settings"]
    assert settings.zero_stage == 3
    assert [(d.name, d.slowdown) for d in settings.devices] == [("cpu0-x3", 3.0), ("cpu1-x4.5", 4.5), ("cpu2-x9", 9.0)]
    headrooms = [d.memory_headroom_bytes for d in settings.devices]
    assert headrooms == sorted(headrooms, reverse=True), "slower devices get less memory, as in the default cluster"
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 0
    assert [d.name for d in seen["settings"].devices] == ["cpu-fast", "cpu-medium", "cpu-slow"]


def test_eight_ranks_write_their_own_report_beside_the_three_rank_one(monkeypatch, tmp_path):
    # `--eight-ranks` wrote demo.json, demo.md and demo.png, replacing the 3-rank report (which the README's table
    # shows) instead of demo_eight_ranks.md, where docs/bench.md and bench/results/README.md say its results are.
    from poplar_bench import demo

    names = []
    monkeypatch.setattr(demo, "run_demo", lambda settings, *, out_dir, name: names.append(name) or [])
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--eight-ranks"]) == 0
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--eight-ranks", "--name", "mine"]) == 0
    assert cli.main(["demo", "--output-dir", str(tmp_path)]) == 0
    assert names == ["demo_eight_ranks", "mine", "demo"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slowdowns", "3"], "at least 2 comma-separated numbers >= 1"),
        (["--slowdowns", "3,x"], "expected comma-separated numbers >= 1"),
        (["--slowdowns", "0.5,3"], "at least 2 comma-separated numbers >= 1"),
        (["--zero-stage", "4"], "invalid choice"),
    ],
)
def test_demo_refuses_bad_slowdowns_and_stages(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["demo", *argv])
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_demo_refuses_slowdowns_that_need_more_cores_than_the_machine_has(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--slowdowns", "1,1,2"]) == 2
    assert "need 2.50 cores together" in capsys.readouterr().err


def test_slowdowns_and_drawn_cases_count_the_cores_this_process_may_use(monkeypatch, tmp_path, capsys):
    # Under `taskset -c 0` on a 2-core machine (os.cpu_count() 2, one usable CPU, as the reports say) the demo took
    # --slowdowns 1.5,1.5 (1.33 cores of steady compute on one) and predictions drew cases of up to 0.97 cores,
    # beyond half the usable ones: ranks slowed by each other, not by their emulation.
    from poplar_bench import demo
    from poplar_bench.prediction_check import draw_cases, max_core_demand

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--slowdowns", "1.5,1.5"]) == 2
    assert "need 1.33 cores together (sum of 1/slowdown), this machine has 1" in capsys.readouterr().err
    assert max(case.core_demand for case in draw_cases(27, 20)) <= max_core_demand(1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--eight-ranks", "--slowdowns", "2,3"], "expected --eight-ranks or --slowdowns, found both"),
        (["drift", "--drift-at", "10", "--recover-at", "5"], "expected 0 < drift_at < recover_at"),
    ],
)
def test_demo_and_drift_bad_input_reads_as_argparse_errors(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"poplar-bench {argv[0]}: error: ") and message in err


def test_an_output_dir_that_cannot_take_the_reports_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    # It was found only when the reports were written, after the whole run: a FileExistsError traceback.
    from poplar_bench import search_speed

    monkeypatch.setattr(search_speed, "run_search_speed", lambda *a, **k: pytest.fail("the run started"))
    a_file = tmp_path / "results.md"
    a_file.write_text("")
    assert cli.main(["search-speed", "--output-dir", str(a_file)]) == 2
    err = capsys.readouterr().err
    expected = "poplar-bench search-speed: --output-dir: expected a directory for the report files, found a file"
    assert err == f"{expected}: {a_file}\n"
    assert cli.main(["search-speed", "--output-dir", str(a_file / "below")]) == 2
    assert f"found a file: {a_file}" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # root writes anywhere
        assert cli.main(["search-speed", "--output-dir", str(locked / "new")]) == 2
        assert f"found {locked} not writable" in capsys.readouterr().err


def test_an_output_dir_where_no_file_can_be_made_is_refused_for_root_too(monkeypatch, capsys):
    # os.access says yes to root everywhere: overhead --output-dir /proc/x ran its whole bench (about 25 s) and
    # then failed in mkdir with a FileNotFoundError traceback.
    from poplar_bench import search_speed

    monkeypatch.setattr(search_speed, "run_search_speed", lambda *a, **k: pytest.fail("the run started"))
    assert cli.main(["search-speed", "--output-dir", "/proc/poplar-bench-results"]) == 2
    assert "found /proc not writable" in capsys.readouterr().err


def test_a_command_writing_into_the_checkouts_results_says_it_replaced_the_committed_one(monkeypatch, capsys):
    # Only the demo said it had replaced the committed report; drift, predictions, pipeline, search-speed and the
    # rest replaced bench/results/NAME.* without a word.
    from poplar_bench import search_speed
    from poplar_bench.commands._options import checkout_root

    if checkout_root() is None or cli.default_output_dir() == Path.cwd():
        pytest.skip("poplar_bench does not run from a checkout with bench/results here")
    notice = "replacing the committed one (git diff bench/results shows the change; --output-dir DIR writes elsewhere)"
    written = []
    monkeypatch.setattr(search_speed, "run_search_speed", lambda **kwargs: {})
    monkeypatch.setattr(search_speed, "write_report", lambda result, out_dir: written.append(out_dir) or [])
    assert cli.main(["search-speed"]) == 0
    assert written == [cli.default_output_dir()]
    err = capsys.readouterr().err
    assert (
        err
        == f"poplar-bench search-speed: the report went into this checkout's bench/results ({written[0]}), {notice}\n"
    )
    assert cli.main(["search-speed", "--output-dir", str(cli.default_output_dir())]) == 0
    assert notice not in capsys.readouterr().err  # asked for: nothing to say


def test_overhead_and_search_speed_help_say_what_they_run_and_how_it_is_judged(capsys):
    # Their --help said only "Per-iteration overhead of ... writes runtime_overhead.json and .md" and "Time
    # search_plan for 8 to 4096 ranks and 1 to 6 device types": not on which devices, how long, which cells, the goals.
    import inspect

    from poplar_bench import runtime_overhead, search_speed

    def help_of(command: str) -> str:
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        return " ".join(capsys.readouterr().out.split())

    text = help_of("overhead")
    defaults = inspect.signature(runtime_overhead.run_overhead).parameters
    assert f"{'Two' if runtime_overhead.WORLD_SIZE == 2 else runtime_overhead.WORLD_SIZE} REAL CPU ranks" in text
    assert (
        f"(micro-batch {runtime_overhead.MICRO_BATCH_SIZE}, {runtime_overhead.ACCUMULATION_STEPS} accumulation "
        f"steps, ZeRO {runtime_overhead.ZERO_STAGE}, fp32)" in text
    )
    assert f"in {defaults['blocks'].default} blocks of {defaults['block_iterations'].default} iterations" in text
    assert f"goal <= {runtime_overhead.GOAL_RATIO}" in text
    text = help_of("search-speed")
    assert "global batches 2^22, 10^9 and 2^31" in text
    assert search_speed.LARGE_BATCHES == (2**22, 10**9, 2**31)
    assert [goal["target_s"] for goal in search_speed.GOALS] == [1.0, 0.05]
    assert "4096 ranks x 6 types under 1 s, 64 ranks under 50 ms, every large-batch and lever cell under 1 s" in text
    assert "No profile is a measurement" in text


def test_clean_exit_refuses_a_case_given_twice(tmp_path, capsys):
    # --case torch --case torch --launches 1 ran torch twice per launch and reported two equal rows, each
    # "torch | 2 |" launches: neither what was asked nor one row per case.
    argv = ["clean-exit", "--case", "torch", "--case", "torch", "--launches", "1", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "poplar-bench clean-exit: cases: expected each case once (--launches sets how often), "
        "found torch more than once\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../outside"])
def test_a_report_name_that_is_not_a_plain_file_name_is_refused(name, tmp_path, capsys):
    # --name "" wrote .json and .md (hidden files) and .png.png, while printing a .png path that did not exist;
    # "../outside" wrote beside --output-dir, not in it.
    for command in ("simulate", "demo"):
        with pytest.raises(SystemExit) as caught:
            cli.main([command, "--name", name, "--output-dir", str(tmp_path / "out")])
        assert caught.value.code == 2
        err = capsys.readouterr().err
        assert "argument --name: expected a file name without a folder or a leading dot" in err and repr(name) in err
    assert not (tmp_path / "out").exists() and sorted(tmp_path.iterdir()) == []


def test_clean_exit_help_names_its_cases(capsys, monkeypatch):
    # --case took names that only the refusal of a wrong one listed.
    from poplar_bench.clean_exit import CASES

    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens otherwise
    with pytest.raises(SystemExit):
        cli.main(["clean-exit", "--help"])
    assert f"a case to run (repeatable; default: all): {', '.join(CASES)}" in capsys.readouterr().out
