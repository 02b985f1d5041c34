"""poplar-profile's command line: checked input, one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from poplar_ext.profiler.cli import UsageError, main, parse_command


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "bf16": {"enabled": True}}))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"schema_version": 1, "nodes": [{"name": "n", "devices": [{"device_type": "cpu", "count": 2}]}]})
    )
    module = tmp_path / "my_models.py"
    module.write_text(
        "import torch\n"
        "def build():\n    return torch.nn.Linear(2, 1)\n"
        "def batch(b):\n    return torch.ones(b, 2)\n"
        "NOT_CALLABLE = 3\n"
    )
    return {"ds": str(ds), "cluster": str(cluster), "dir": str(tmp_path)}


def _args(files: dict[str, str], *extra: str) -> list[str]:
    return ["--deepspeed_config", files["ds"], "--cluster", files["cluster"], *extra]


def test_builtin_toy_gpt_with_size_options(files) -> None:
    command = parse_command(
        _args(
            files,
            "--model",
            "toy-gpt",
            "--layers",
            "3",
            "--hidden-size",
            "64",
            "--heads",
            "2",
            "--zero-stages",
            "2,0",
            "--local_rank=1",
        )
    )
    assert command.zero_stages == (0, 2)
    assert command.model_name == "toy-gpt-3x64" and command.sequence_length == 64
    model = command.model_factory()
    assert len(model.blocks) == 3
    assert tuple(command.make_batch(5).shape) == (5, 65)
    assert command.ds_config["bf16"] == {"enabled": True}


def test_the_output_dir_reads_a_tilde_as_the_home_folder(files, monkeypatch, tmp_path) -> None:
    # "--output-dir=~/profiles" reaches the program unexpanded (the shell expands only a word's start).
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    command = parse_command(_args(files, "--model", "toy-gpt", "--output-dir=~/profiles"))
    assert Path(command.cache_dir) == tmp_path / "home" / "profiles"


def test_an_empty_output_dir_is_refused(files, capsys) -> None:
    # "--output-dir $DIR" with DIR unset: not the current folder, silently.
    assert main(_args(files, "--model", "toy-gpt", "--output-dir", "")) == 2
    assert "--output-dir: expected a directory, found an empty path" in capsys.readouterr().err


def test_own_model_and_batch_factories_are_imported(files, monkeypatch) -> None:
    monkeypatch.chdir(files["dir"])
    command = parse_command(
        _args(files, "--model", "my_models:build", "--batch", "my_models:batch", "--micro-batch-sizes", "1,2,4")
    )
    assert command.model_factory().in_features == 2
    assert command.make_batch(3).shape[0] == 3
    assert command.micro_batch_sizes == (1, 2, 4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--model", "toy-gpt", "--zero-stages", "0,4"],
            "--zero-stages: expected distinct stages among 0,1,2,3, found '0,4'",
        ),
        (["--model", "toy-gpt", "--zero-stages", "a"], "--zero-stages: expected comma-separated integers, found 'a'"),
        (["--model", "toy-gpt", "--micro-batch-sizes", "0,2"], "--micro-batch-sizes: expected integers >= 1"),
        (["--model", "toy-gpt", "--repeats", "0"], "--repeats: expected an integer >= 1, found 0"),
        (
            ["--model", "toy-gpt", "--hidden-size", "30", "--heads", "4"],
            "--hidden-size: expected a multiple of --heads",
        ),
        (["--model", "my_models:build"], "--batch: required with a --model of your own"),
        # The cluster file given as the DeepSpeed config: named for what it is, not for its missing optimizer.
        (
            ["--model", "toy-gpt", "--deepspeed_config", "cluster.json"],
            "--deepspeed_config: cluster.json: (file): "
            "expected a DeepSpeed config, found a cluster description (its keys 'nodes')",
        ),  # fmt: skip
        # A misspelt built-in name, with or without --batch: not the --batch message.
        (
            ["--model", "toy_gpt"],
            "--model: expected MODULE:FACTORY (e.g. mymodels:build), found 'toy_gpt'; or a "
            "built-in model: toy-gpt, gpt2-small (did you mean 'toy-gpt'?); or hf:CONFIG",
        ),  # fmt: skip
        (["--model", "nomodule:build", "--batch", "x:y"], "--model: cannot import module 'nomodule'"),
        (
            ["--model", "my_models:missing", "--batch", "my_models:batch"],
            "--model: module 'my_models' has no attribute 'missing'",
        ),
        (["--model", "my_models:NOT_CALLABLE", "--batch", "my_models:batch"], "--model: expected a callable"),
        (["--model", "justaname", "--batch", "my_models:batch"], "--model: expected MODULE:FACTORY"),
        (
            ["--model", "toy-gpt", "--batch", "my_models:batch"],
            "--batch: the built-in model toy-gpt makes its own batches",
        ),
        (
            ["--model", "toy-gpt", "--activation-checkpointing", "sometimes"],
            "--activation-checkpointing: invalid choice",
        ),
        (
            ["--model", "my_models:build", "--batch", "my_models:batch", "--checkpointing-toggle", "my_models:missing"],
            "--checkpointing-toggle: module 'my_models' has no attribute 'missing'",
        ),
        (
            [
                "--model",
                "my_models:build",
                "--batch",
                "my_models:batch",
                "--checkpointing-toggle",
                "my_models:build",
                "--activation-checkpointing",
                "off",
            ],
            "--checkpointing-toggle: not used with --activation-checkpointing off",
        ),
        # A toggle that cannot take (model, enabled): refused now, not once a first stage was measured.
        (
            ["--model", "my_models:build", "--batch", "my_models:batch", "--checkpointing-toggle", "my_models:build"],
            "--checkpointing-toggle: expected a callable toggle(model, enabled), found build()",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(files, monkeypatch, capsys, extra, message) -> None:
    monkeypatch.chdir(files["dir"])
    assert main(_args(files, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("poplar-profile: error: ")
    assert message in err


def test_missing_required_option_is_one_line(capsys) -> None:
    assert main(["--model", "toy-gpt"]) == 2
    assert capsys.readouterr().err == (
        "poplar-profile: error: the following arguments are required: --deepspeed_config/--deepspeed-config\n"
    )


def test_bad_files_are_named(files, tmp_path, capsys) -> None:
    (tmp_path / "bad.json").write_text("[1")
    assert (
        main(["--deepspeed_config", str(tmp_path / "bad.json"), "--cluster", files["cluster"], "--model", "toy-gpt"])
        == 2
    )
    assert "--deepspeed_config: " in capsys.readouterr().err
    # A missing --cluster file is rank 0's error, sent to every rank: tests/dist/test_profiler_cli.py.


def test_help_names_the_launcher(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "deepspeed launcher" in capsys.readouterr().out


def test_the_network_help_states_the_message_sizes_timed_on_cpu_and_on_gpus(capsys) -> None:
    from poplar_ext.profiler.network import DEFAULT_MESSAGE_BYTES, message_sizes

    # CPU: the defaults; a GPU: up to DeepSpeed's default bucket, 5e8 elements, 1 GB in bf16 (not 32 MiB).
    assert (DEFAULT_MESSAGE_BYTES[0], DEFAULT_MESSAGE_BYTES[-1]) == (4 * 2**10, 32 * 2**20)
    assert message_sizes({}, element_bytes=2, capacity_bytes=80 * 2**30)[-1] == 10**9
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "from 4 KiB: to 32 MiB on CPU, about a second; on GPUs to the config's largest ZeRO bucket" in text


def test_a_deepspeed_config_that_is_not_utf8_is_named(files, tmp_path, capsys) -> None:
    bad = tmp_path / "latin1.json"
    bad.write_bytes('{"optimizer": {"type": "Adam"}, "note": "caf\u00e9"}'.encode("latin-1"))
    assert main(["--deepspeed_config", str(bad), "--cluster", files["cluster"], "--model", "toy-gpt"]) == 2
    err = capsys.readouterr().err
    assert f"--deepspeed_config: {bad}: (file): expected a UTF-8 JSON file, found a byte that is not UTF-8" in err
    assert len(err.strip().splitlines()) == 1


_TINY_GPT2 = "n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=32"


def test_a_transformers_model_from_its_config(files) -> None:
    pytest.importorskip("transformers", reason="pip install 'poplar-ext[hf]'")
    command = parse_command(
        _args(files, "--model", "hf:GPT2Config", "--hf-config", _TINY_GPT2, "--sequence-length", "16")
    )
    model = command.model_factory()
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_layer == 1
    batch = command.make_batch(3)
    assert tuple(batch["input_ids"].shape) == (3, 16) and (batch["labels"] == batch["input_ids"]).all()
    assert command.model_name == "gpt2-causal-lm" and command.sequence_length == 16
    from poplar_ext.profiler.measure import default_loss

    assert default_loss(model, batch).dim() == 0  # the ModelOutput's .loss, from dict batches
    masked = parse_command(
        _args(
            files,
            "--model",
            "hf:BertConfig",
            "--hf-task",
            "masked-lm",
            "--hf-config",
            "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,vocab_size=64",
            "--sequence-length",
            "8",
        )
    )
    assert (masked.make_batch(4)["labels"] == -100).any()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "hf:NoSuchConfig"], "--model hf:NoSuchConfig: expected the name of a transformers config class"),
        (["--model", "hf:GPT2Config", "--hf-config", "n_layer"], "--hf-config: expected KEY=VALUE pairs"),
        # A config keeps any keyword: a misspelt size would leave GPT-2's default 12 layers.
        (
            ["--model", "hf:GPT2Config", "--hf-config", "n_layers=1,n_embd=32"],
            "--hf-config: GPT2Config has no field 'n_layers' (did you mean n_layer?)",
        ),
        (
            ["--model", "hf:GPT2Config", "--hf-config", _TINY_GPT2, "--batch", "my_models:batch"],
            "--batch: the model hf:GPT2Config makes its own batches",
        ),
        # A config no model of the task takes: transformers' first line, with the options it came from.
        (
            ["--model", "hf:T5Config"],
            "--model hf:T5Config (--hf-task causal-lm): Unrecognized configuration class",
        ),
        # transformers' own check of a value's type: one line, not its traceback.
        (
            ["--model", "hf:GPT2Config", "--hf-config", "n_layer=two,n_embd=32"],
            "--hf-config: StrictDataclassFieldValidationError: Validation error for field 'n_layer': TypeError:",
        ),
        # A size below 1 builds a model without layers (or fails deep in torch): refused by its key, as given.
        (
            ["--model", "hf:GPT2Config", "--hf-config", "n_layer=-1,n_embd=32,n_head=2"],
            "--hf-config: n_layer: expected an integer >= 1, found -1",
        ),
        (
            ["--model", "hf:GPT2Config", "--hf-config", "n_layer=1,n_embd=32,n_head=2,vocab_size=0"],
            "--hf-config: vocab_size: expected an integer >= 1, found 0",
        ),
        (
            ["--model", "hf:BertConfig", "--hf-task", "masked-lm", "--hf-config", "num_hidden_layers=0,hidden_size=32"],
            "--hf-config: num_hidden_layers: expected an integer >= 1, found 0",
        ),
        # Longer than the model's positions: every rank's first forward would fail with "index out of range".
        (
            ["--model", "hf:GPT2Config", "--hf-config", _TINY_GPT2, "--sequence-length", "33"],
            "--sequence-length: expected at most 32, the positions of GPT2Config (n_positions), found 33; give "
            "--hf-config n_positions=33",
        ),
        (
            [
                "--model",
                "hf:BertConfig",
                "--hf-task",
                "masked-lm",
                "--hf-config",
                "num_hidden_layers=1,hidden_size=32,num_attention_heads=2,intermediate_size=64,vocab_size=64,"
                "max_position_embeddings=16",
                "--sequence-length",
                "17",
            ],
            "--sequence-length: expected at most 16, the positions of BertConfig (max_position_embeddings), found 17",
        ),
    ],
)
def test_bad_transformers_models_exit_2(files, monkeypatch, capsys, extra, message) -> None:
    pytest.importorskip("transformers", reason="pip install 'poplar-ext[hf]'")
    monkeypatch.chdir(files["dir"])
    assert main(_args(files, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_rotary_transformers_model_takes_samples_past_its_configs_positions(files) -> None:
    # Llama's positions are rotary, computed for any length: no table to index past, as GPT-2's and BERT's have.
    pytest.importorskip("transformers", reason="pip install 'poplar-ext[hf]'")
    sizes = (
        "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
        "vocab_size=64,max_position_embeddings=16"
    )
    command = parse_command(_args(files, "--model", "hf:LlamaConfig", "--hf-config", sizes, "--sequence-length", "24"))
    batch = command.make_batch(2)
    assert command.sequence_length == 24 and tuple(batch["input_ids"].shape) == (2, 24)
    from poplar_ext.profiler.measure import default_loss

    assert default_loss(command.model_factory(), batch).dim() == 0  # the model runs them


def test_a_loss_function_of_your_own(files, monkeypatch) -> None:
    monkeypatch.chdir(files["dir"])
    (Path(files["dir"]) / "my_loss.py").write_text("def loss(engine, batch):\n    return engine(batch).sum()\n")
    command = parse_command(
        _args(files, "--model", "my_models:build", "--batch", "my_models:batch", "--loss", "my_loss:loss")
    )
    import torch

    module, batch = torch.nn.Linear(2, 1), torch.ones(3, 2)
    assert float(command.loss_fn(module, batch)) == pytest.approx(float(module(batch).sum()))
    assert main(_args(files, "--model", "my_models:build", "--batch", "my_models:batch", "--loss", "my_loss:nope")) == 2


def test_a_deepspeed_config_without_an_optimizer_is_refused_before_any_engine(files, tmp_path, capsys) -> None:
    import torch

    from poplar_ext.profiler import profile_model

    no_optimizer = tmp_path / "no_optimizer.json"
    no_optimizer.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert main(["--deepspeed_config", str(no_optimizer), "--cluster", files["cluster"], "--model", "toy-gpt"]) == 2
    err = capsys.readouterr().err
    assert f"--deepspeed_config: {no_optimizer}: optimizer: expected an 'optimizer' section" in err
    with pytest.raises(ValueError, match="ds_config: optimizer: expected an 'optimizer' section.*optimizer_factory"):
        profile_model(
            model_factory=lambda: torch.nn.Linear(2, 1),
            make_batch=lambda b: torch.ones(b, 2),
            ds_config={"zero_optimization": {"stage": 1}},
            cluster=files["cluster"],
            cache_dir=tmp_path / "p",
        )


def test_hugging_face_auto_values_are_refused_before_any_engine_but_batch_keys(files, tmp_path, capsys) -> None:
    # A Trainer's config (examples/ds_config_hf.json) holds "auto" values, which DeepSpeed never fills: its first
    # engine failed at the first step (gradient_clipping: TypeError '>' between str and float), after the network.
    hf = tmp_path / "ds_hf.json"
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 1},
        "poplar": {"global_batch_size": "auto"},
    }
    hf.write_text(json.dumps(config))
    args = ["--deepspeed_config", str(hf), "--cluster", files["cluster"], "--model", "toy-gpt"]
    assert main([*args, "--optimizer", "torch.optim:AdamW"]) == 2
    err = capsys.readouterr().err
    assert f'--deepspeed_config: {hf}: gradient_clipping, bf16.enabled: expected a value, found "auto"' in err
    assert "train_batch_size" not in err and "global_batch_size" not in err
    config.update(gradient_clipping=1.0, bf16={"enabled": False})
    hf.write_text(json.dumps(config))
    assert parse_command([*args, "--optimizer", "torch.optim:AdamW"]).ds_config["gradient_clipping"] == 1.0


def test_activation_checkpointing_options(files, monkeypatch) -> None:
    monkeypatch.chdir(files["dir"])
    (Path(files["dir"]) / "my_toggle.py").write_text("def toggle(model, enabled):\n    model.recompute = enabled\n")
    default = parse_command(_args(files, "--model", "toy-gpt"))
    assert default.activation_checkpointing == "auto" and default.checkpointing_toggle is None
    command = parse_command(
        _args(
            files,
            "--model",
            "my_models:build",
            "--batch",
            "my_models:batch",
            "--checkpointing-toggle",
            "my_toggle:toggle",
            "--activation-checkpointing",
            "both",
        )
    )
    assert command.activation_checkpointing == "both"
    import torch

    module = torch.nn.Linear(2, 1)
    command.checkpointing_toggle(module, True)
    assert module.recompute is True
    assert (
        parse_command(_args(files, "--model", "toy-gpt", "--activation-checkpointing", "off")).activation_checkpointing
        == "off"
    )


def test_the_command_line_builds_profile_options_with_their_defaults(files, monkeypatch) -> None:
    import dataclasses

    monkeypatch.chdir(files["dir"])  # my_models is imported from where the command runs, not from an earlier test

    from poplar_ext.profiler import ProfileOptions, log_progress

    options = parse_command(_args(files, "--model", "my_models:build", "--batch", "my_models:batch"))
    assert isinstance(options, ProfileOptions)
    assert options.cluster == Path(files["cluster"]) and options.progress is log_progress
    given = {"model_factory", "make_batch", "ds_config", "cluster", "progress"}
    as_parsed = {"zero_stages": tuple, "cache_dir": Path}  # what the command line makes of the default
    for f in dataclasses.fields(ProfileOptions):
        if f.name not in given:
            assert getattr(options, f.name) == as_parsed.get(f.name, lambda v: v)(f.default), f.name
    quiet = parse_command(_args(files, "--model", "toy-gpt", "--quiet", "--output-dir", "out", "--repeats", "5"))
    assert quiet.progress is None and quiet.cache_dir == Path("out") and quiet.repeats == 5


def test_the_collective_timeout_is_given_in_seconds_and_0_keeps_the_groups_own(files, monkeypatch) -> None:
    monkeypatch.chdir(files["dir"])  # my_models is imported from where the command runs
    base = ("--model", "my_models:build", "--batch", "my_models:batch")
    assert parse_command(_args(files, *base, "--collective-timeout", "90")).collective_timeout_s == 90.0
    assert parse_command(_args(files, *base, "--collective-timeout", "0")).collective_timeout_s is None


def test_every_profile_option_is_a_command_line_option_with_the_fields_default_and_docstring() -> None:
    # The parser is built from ProfileOptions' fields: one spelling of each option.
    import dataclasses

    from poplar_ext.profiler import ProfileOptions
    from poplar_ext.profiler.cli import build_parser

    parser = build_parser()
    by_dest = {action.dest: action for action in parser._actions}
    built_by_hand = {"model_factory": "--model", "make_batch": "--batch", "ds_config": "--deepspeed_config"}
    built_by_hand |= {"progress": "--quiet", "optimizer_factory": "--optimizer"}  # else the config's optimizer
    for f in dataclasses.fields(ProfileOptions):
        if f.name in built_by_hand:
            assert f.metadata["cli"] is None, f.name
            assert built_by_hand[f.name] is None or built_by_hand[f.name] in parser._option_string_actions
            continue
        action = by_dest[f.name]
        assert action.default == f.default, f.name
        assert action.help and len(action.help) > 30, f.name  # the field's docstring, or its command-line wording
        wording = f.metadata["cli_help"]
        assert wording is None or action.help.startswith(wording.replace("%", "%%")), f.name
    assert "--no-network" in parser._option_string_actions and "--network" in parser._option_string_actions
    help_text = parser.format_help()
    assert "Measured micro-steps per size (their median is the sample's time). (default: 3)" in " ".join(
        help_text.split()
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "gpt2-small", "--layers", "4"], "--layers: only with --model toy-gpt"),
        (["--model", "gpt2-small", "--vocab-size", "512"], "--vocab-size: only with --model toy-gpt"),
        (
            ["--model", "my_models:build", "--batch", "my_models:batch", "--hidden-size", "64"],
            "--hidden-size: only with --model toy-gpt",
        ),
        (["--model", "toy-gpt", "--hf-config", "n_layer=2"], "--hf-config: only with --model hf:CONFIG_CLASS"),
        (["--model", "toy-gpt", "--hf-task", "masked-lm"], "--hf-task: only with --model hf:CONFIG_CLASS"),
    ],
)
def test_a_model_option_the_model_does_not_use_is_refused(files, monkeypatch, capsys, extra, message) -> None:
    """Not silently ignored: a gpt2-small run given --layers 4 would profile 12 layers under the user's nose."""
    monkeypatch.chdir(files["dir"])
    assert main(_args(files, *extra)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("text", ["-5", "inf", "nan"])
def test_a_collective_timeout_that_is_no_number_of_seconds_is_refused_by_its_option(files, text) -> None:
    # Refused when read and named by its option, not by the ProfileOptions field after the job started.
    with pytest.raises(ValueError, match=f"--collective-timeout: expected a number of seconds >= 0.*found '{text}'"):
        parse_command(_args(files, "--model", "toy-gpt", "--collective-timeout", text))


def test_a_command_started_without_a_launcher_exits_2_with_one_line(files, monkeypatch, capsys) -> None:
    # Not DeepSpeed's MPI discovery's 20-line "No module named 'mpi4py'" traceback.
    from poplar_ext.collectives import MPI_RANK_VARIABLES

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", *MPI_RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert main(_args(files, "--model", "toy-gpt", "--output-dir", files["dir"])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("poplar-profile: error: no launcher: expected the environment torchrun or the deepspeed ")
    assert "found none; run it as torchrun --nproc_per_node N -m poplar_ext.profiler" in err


@pytest.mark.parametrize("variable", ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"])
def test_a_launchers_environment_passes_the_launcher_check(monkeypatch, variable) -> None:
    # mpirun's variables too: DeepSpeed's MPI discovery reads the ranks from them.
    from poplar_ext.collectives import MPI_RANK_VARIABLES
    from poplar_ext.profiler.cli import _require_launcher

    for name in ("RANK", *MPI_RANK_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "0")
    _require_launcher()  # no UsageError


API_WORDS = re.compile(r"\b(None|True|False|raises|ValueError)\b")
"""The Python API's wording, which a command line cannot give: what omitting an option does is said instead."""


def test_the_options_help_speaks_of_the_command_line_not_of_the_python_api() -> None:
    import dataclasses

    from poplar_ext.profiler import ProfileOptions
    from poplar_ext.profiler.cli import build_parser

    by_dest = {action.dest: action for action in build_parser()._actions}
    for f in dataclasses.fields(ProfileOptions):
        if f.metadata["cli"] is not None:
            assert not API_WORDS.search(by_dest[f.name].help), (f.name, by_dest[f.name].help)
    help_text = " ".join(build_parser().format_help().split())
    assert "--per-layer, --no-per-layer" in help_text
    assert "Left out: the cluster is read from the hardware and written as cluster.json in --output-dir" in help_text
    assert "communication. (default: --network)" in help_text
    assert "0 keeps the groups' own." in help_text


def test_per_layer_is_automatic_unless_given_either_way(files) -> None:
    # store_true could not say "never": a pipeline model could not be profiled whole from the command line.
    base = _args(files, "--model", "toy-gpt")
    assert parse_command(base).per_layer is None
    assert parse_command([*base, "--per-layer"]).per_layer is True
    assert parse_command([*base, "--no-per-layer"]).per_layer is False


def test_the_help_states_the_defaults_the_built_in_models_get(files, capsys) -> None:
    """One spelling of each default: what --help says is what a command without the option builds."""
    with pytest.raises(SystemExit):
        parse_command(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    stated = {
        flag: int(value)
        for flag, value in re.findall(
            r"(--layers|--hidden-size|--heads|--vocab-size) N .*?\(default: (\d+)\)", help_text
        )
    }
    lengths = dict((model, int(n)) for n, model in re.findall(r"(\d+) for (gpt2-small|toy-gpt)", help_text))
    toy = parse_command(_args(files, "--model", "toy-gpt")).model_factory().cfg
    built = {"--layers": toy.num_layers, "--hidden-size": toy.hidden_size, "--heads": toy.num_heads}
    assert stated == {**built, "--vocab-size": toy.vocab_size}
    assert lengths == {"toy-gpt": toy.sequence_length, "gpt2-small": 512}
    assert parse_command(_args(files, "--model", "gpt2-small")).sequence_length == lengths["gpt2-small"]


def test_a_cluster_file_in_the_output_dir_is_never_replaced_by_the_hardwares(tmp_path):
    # Without --cluster the hardware's cluster is written as DIR/cluster.json: the same one is kept as it is,
    # one with emulated types (written by hand) or a file that is none is refused, not overwritten.
    from poplar_ext.plan.formats import cluster_from_dict, save_cluster
    from poplar_ext.profiler.cli import UsageError, _holds_cluster

    def cluster(types: dict):
        nodes = [{"name": "n", "devices": [{"device_type": t, "count": 1} for t in types]}]
        emulated = {t: {"emulation": e} for t, e in types.items() if e}
        return cluster_from_dict({"schema_version": 1, "nodes": nodes, "device_types": emulated})

    hardware, target = cluster({"cpu": None}), tmp_path / "cluster.json"
    assert _holds_cluster(target, hardware) is False  # none yet: written
    save_cluster(hardware, target)
    assert _holds_cluster(target, hardware) is True
    # An earlier run's hardware cluster (other hosts or rank counts, no emulation): replaced, as before.
    save_cluster(cluster({"cpu": None, "gpu": None}), target)
    assert _holds_cluster(target, hardware) is False
    save_cluster(cluster({"cpu": None, "cpu-slow": {"slowdown": 2.0, "memory_capacity_bytes": 2 * 10**9}}), target)
    with pytest.raises(UsageError, match=r"holds another cluster \(1 x cpu, 1 x cpu-slow \(emulated\)\) than the "):
        _holds_cluster(target, hardware)
    target.write_text('{"nodes": [')
    with pytest.raises(UsageError, match=r"cluster.json exists and is no cluster description \(.*\); mend it, or mo"):
        _holds_cluster(target, hardware)


def test_an_error_is_one_write_so_that_the_ranks_lines_do_not_run_together(files, monkeypatch) -> None:
    # Every rank prints it to the one stderr the launcher shares: print's text and newline are two writes.
    import sys

    writes: list[str] = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": writes.append, "flush": lambda self: None})())
    assert main(_args(files, "--model", "toy-gpt", "--output-dir", "")) == 2
    assert len(writes) == 1 and writes[0].startswith("poplar-profile: error: --output-dir:"), writes
    assert writes[0].endswith("\n") and writes[0].count("\n") == 1


def test_a_run_that_writes_no_profile_says_so_and_exits_1(files, monkeypatch, capsys) -> None:
    # Every stage abandoned (a real out-of-memory at micro-batch 1): profile_with returns [], as it does for a
    # pipeline model, whose layer profiles are written. Only the pipeline model's run may say so.
    import poplar_ext.profiler.cli as cli

    monkeypatch.chdir(files["dir"])
    monkeypatch.delenv("RANK", raising=False)
    (Path(files["dir"]) / "my_layers.py").write_text(
        "import torch\ndef layers():\n    return [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]\n"
    )

    def run(options):
        options.model_factory()  # as profile_with builds it first
        return []

    monkeypatch.setattr(cli, "run", run)
    own = _args(files, "--model", "my_models:build", "--batch", "my_models:batch", "--zero-stages", "0,1")
    assert main(own) == 1
    out, err = capsys.readouterr()
    assert "layer profiles" not in out
    assert err == (
        "poplar-profile: no profile written: no device type could be measured at --zero-stages 0,1 (e.g. a real "
        "out-of-memory at micro-batch 1); the lines above say why\n"
    )
    assert main([*own, "--quiet"]) == 1
    assert "run it without --quiet to see why" in capsys.readouterr().err
    assert main(_args(files, "--model", "my_layers:layers", "--batch", "my_models:batch", "--zero-stages", "0")) == 0
    assert capsys.readouterr().out == f"layer profiles in {Path('profiles') / 'layers'}\n"


def test_without_torch_it_says_what_to_install_in_one_line(files, monkeypatch, capsys) -> None:
    # The documented torch-free install (pip install --no-deps poplar-ext numpy scipy) serves poplar-search only.
    import poplar_ext.profiler.cli as cli

    def no_torch(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(cli, "_builtin_model", no_torch)
    assert main(_args(files, "--model", "toy-gpt")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("poplar-profile: error: expected torch and deepspeed installed, ")
    assert "the --no-deps install serves poplar-search alone" in err


def test_given_sizes_above_the_limit_are_said_to_be_left_out(files, capsys, monkeypatch) -> None:
    # The limit holds given sizes too (as the layer profiles' sweep does), but not without a word.
    monkeypatch.delenv("RANK", raising=False)
    args = _args(files, "--model", "toy-gpt", "--micro-batch-sizes", "1,4,8", "--max-micro-batch-size", "2")
    assert parse_command(args).micro_batch_sizes == (1, 4, 8)
    assert "--micro-batch-sizes: 4,8 above --max-micro-batch-size (2), not measured" in capsys.readouterr().err
    parse_command([*args, "--quiet"])
    assert capsys.readouterr().err == ""


def test_an_offload_mode_without_a_stage_that_offloads_is_said_to_do_nothing(files, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    parse_command(_args(files, "--model", "toy-gpt", "--zero-stages", "0,3", "--optimizer-offload", "both"))
    err = capsys.readouterr().err
    assert (
        "--optimizer-offload both: nothing offloaded at --zero-stages 0,3 (DeepSpeed offloads the optimizer at " in err
    )
    assert "stages 1 and 2 only)" in err
    parse_command(_args(files, "--model", "toy-gpt", "--zero-stages", "0,1", "--optimizer-offload", "both"))
    assert capsys.readouterr().err == ""


def _config_with_section(tmp_path: Path, section: object) -> Path:
    """A DeepSpeed config with a poplar section, in a folder of its own (relative paths start there)."""
    folder = tmp_path / "conf"
    folder.mkdir(exist_ok=True)
    ds = folder / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "poplar": section}))
    return ds


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"profile": "p"}, "poplar.profile: expected one of the keys"),
        ({"cluster": 3}, "poplar.cluster: expected a path (a non-empty string), found number 3"),
        ({"policy": "fastest"}, "poplar.policy: expected one of"),
    ],
)
def test_a_bad_poplar_section_is_refused_naming_the_file_and_the_field(tmp_path, capsys, section, message) -> None:
    # Checked as training checks it: a typo fails now, not at the training job's start.
    ds = _config_with_section(tmp_path, section)
    assert main(["--deepspeed_config", str(ds), "--model", "toy-gpt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"poplar-profile: error: --deepspeed_config: {ds}: {message}" in err, err


def test_the_poplar_section_gives_the_cluster_and_the_output_dir(tmp_path, monkeypatch, capsys) -> None:
    # Resolved from the config's folder, as training resolves them: the profiles land where training looks.
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    ds = _config_with_section(tmp_path, {"cluster": "cluster.json", "profiles": "measured"})
    options = parse_command(["--deepspeed_config", str(ds.relative_to(tmp_path)), "--model", "toy-gpt"])
    assert Path(options.cluster) == tmp_path / "conf" / "cluster.json"
    assert Path(options.cache_dir) == tmp_path / "conf" / "measured"
    assert capsys.readouterr().err == ""
    # A section without them (the automatic mode's profiles, a plan's): the options' own defaults.
    options = parse_command(["--deepspeed_config", str(_config_with_section(tmp_path, {})), "--model", "toy-gpt"])
    assert options.cluster is None and options.cache_dir == Path("profiles")


def test_an_option_given_on_the_command_line_wins_over_the_section_with_a_note(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.chdir(tmp_path)
    ds = str(_config_with_section(tmp_path, {"cluster": "cluster.json", "profiles": "measured"}))
    args = ["--deepspeed_config", ds, "--model", "toy-gpt", "--cluster", "mine.json", "--output-dir", "out"]
    options = parse_command(args)
    assert Path(options.cluster) == Path("mine.json") and Path(options.cache_dir) == Path("out")
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        f"[poplar-profile] --cluster mine.json (the command line) used, not poplar.cluster of {ds} "
        f"({tmp_path / 'conf' / 'cluster.json'}), which training uses",
        f"[poplar-profile] --output-dir out (the command line) used, not poplar.profiles of {ds} "
        f"({tmp_path / 'conf' / 'measured'}), which training uses",
    ]
    # The section's own values given again: nothing to say; rank 1 and --quiet say nothing either.
    same = ["--cluster", "conf/cluster.json", "--output-dir", str(tmp_path / "conf" / "measured")]
    parse_command(["--deepspeed_config", ds, "--model", "toy-gpt", *same])
    parse_command([*args, "--quiet"])
    monkeypatch.setenv("RANK", "1")
    parse_command(args)
    assert capsys.readouterr().err == ""


def test_the_help_says_the_poplar_section_gives_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: poplar.cluster in the --deepspeed_config file, where it has one)" in text
    # The words --help said before the section came keep their place: the section's rule is added to them.
    output_dir = text.rsplit("--output-dir DIR", 1)[1].split(" --force", 1)[0]
    assert output_dir.endswith(
        "rank 0. The --deepspeed_config file's poplar.profiles comes first, where its poplar "
        "section names one. (default: profiles)"
    ), output_dir
    cluster = text.rsplit("--cluster FILE", 1)[1].split("(default:", 1)[0]
    assert (
        "Left out: the cluster is read from the hardware and written as cluster.json in --output-dir, for "
        "poplar-search (a cluster.json there with emulated types is refused, never replaced). The "
        "--deepspeed_config file's poplar.cluster comes first, where its poplar section names one"
    ) in cluster, cluster
    assert "(a file not there yet is written with the cluster read from the hardware)" in cluster
    assert (
        "batch sizes are set per measurement). Its poplar section, if any, is checked as training checks it, and "
        "gives --cluster and --output-dir their defaults"
    ) in text


def test_a_poplar_profiles_naming_a_file_is_refused_at_once_naming_the_section(tmp_path, capsys) -> None:
    # The check --output-dir gets, before the launcher and any measurement: named by the section's field.
    ds = _config_with_section(tmp_path, {"profiles": "measured"})
    (tmp_path / "conf" / "measured").write_text("not a folder")
    assert main(["--deepspeed_config", str(ds), "--model", "toy-gpt"]) == 2
    err = capsys.readouterr().err
    expected = f"--deepspeed_config: {ds}: poplar.profiles: expected a directory, found the file "
    assert err.count("\n") == 1 and f"poplar-profile: error: {expected}{tmp_path / 'conf' / 'measured'}" in err, err
    # --output-dir given: the section's folder is not used (the note says so), nothing to refuse.
    options = parse_command(["--deepspeed_config", str(ds), "--model", "toy-gpt", "--output-dir", "out", "--quiet"])
    assert Path(options.cache_dir) == Path("out")


def _run_on_one_rank(monkeypatch, hardware):
    """`run`'s collectives on one rank without a process group; the cluster discovered is `hardware`; returns
    the options `profile_with` gets."""
    from poplar_ext import collectives, profiler
    from poplar_ext.hardware import devices, discovery
    from poplar_ext.profiler import cli

    seen = []
    monkeypatch.setattr(cli, "_require_launcher", lambda: None)
    monkeypatch.setattr(devices, "join_job", lambda: None)
    monkeypatch.setattr(collectives, "process_group_rank", lambda: (0, 1))
    monkeypatch.setattr(collectives, "decided_by_rank0", lambda decide, rank: decide())
    monkeypatch.setattr(discovery, "discover_cluster", lambda: hardware)
    monkeypatch.setattr(profiler, "profile_with", lambda options, cache_dir_name: seen.append(options) or [])
    return seen


def test_a_poplar_cluster_not_there_yet_is_written_with_the_hardwares(tmp_path, monkeypatch, capsys) -> None:
    # Profile first, then train: the config's poplar.cluster names the cluster.json this run writes.
    from poplar_ext.plan.formats import cluster_from_dict, load_cluster, save_cluster
    from poplar_ext.profiler.cli import run

    monkeypatch.delenv("RANK", raising=False)
    hardware = cluster_from_dict(
        {"schema_version": 1, "nodes": [{"name": "n", "devices": [{"device_type": "cpu", "count": 1}]}]}
    )
    seen = _run_on_one_rank(monkeypatch, hardware)
    ds = _config_with_section(tmp_path, {"cluster": "clusters/cpu.json", "profiles": "measured"})
    target = tmp_path / "conf" / "clusters" / "cpu.json"
    run(parse_command(["--deepspeed_config", str(ds), "--model", "toy-gpt"]))
    assert seen[-1].cluster == hardware and load_cluster(target) == hardware
    assert not (tmp_path / "conf" / "measured" / "cluster.json").exists()  # training reads poplar.cluster
    assert f"the cluster read from the hardware: {target} (poplar.cluster of {ds}, not there yet)" in (
        capsys.readouterr().err
    )
    # There now (or written by hand): read as --cluster is, never replaced.
    emulated = cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [{"name": "n", "devices": [{"device_type": "cpu-slow", "count": 1}]}],
            "device_types": {"cpu-slow": {"emulation": {"slowdown": 2.0, "memory_capacity_bytes": 10**9}}},
        }
    )
    save_cluster(emulated, target)
    run(parse_command(["--deepspeed_config", str(ds), "--model", "toy-gpt"]))
    assert Path(seen[-1].cluster) == target and load_cluster(target) == emulated
    # --cluster naming a file not there: no cluster is written for it (a typo is reported, as before).
    missing = tmp_path / "typo.json"
    run(parse_command(["--deepspeed_config", str(ds), "--model", "toy-gpt", "--cluster", str(missing), "--quiet"]))
    assert Path(seen[-1].cluster) == missing and not missing.exists()


def test_a_hugging_face_model_per_layer_is_refused_before_any_rank_joins_with_the_recipe(files) -> None:
    # It was refused on every rank after the job joined and built the model ("model: expected a PipelineModule,
    # ... found GPT2LMHeadModel"), without a word on how a causal LM is profiled layer by layer.
    with pytest.raises(UsageError) as error:
        parse_command(_args(files, "--model", "hf:GPT2Config", "--hf-config", _TINY_GPT2, "--per-layer"))
    message = str(error.value)
    assert message.startswith("--per-layer: expected a pipeline model to profile layer by layer, found --model ")
    assert "causal_lm_layers(model).layers" in message and "(input_ids, labels)" in message
    assert "CausalLMLoss()" in message
    # profiled whole, as before
    assert parse_command(_args(files, "--model", "hf:GPT2Config", "--hf-config", _TINY_GPT2)).per_layer is None


def test_profiles_for_a_script_that_builds_its_own_optimizer_are_keyed_as_its_job_looks_them_up(
    files, tmp_path, capsys, monkeypatch
) -> None:
    # Seen: poplar-profile needed an 'optimizer' section, which a script passing its own optimizer to initialize
    # cannot have (DeepSpeed refuses both): that job measured every profile poplar-profile had made again.
    import torch

    from poplar_ext.profiler.auto import _optimizer_factory
    from poplar_ext.profiler.cache import client_optimizer, ds_config_fingerprint

    monkeypatch.chdir(files["dir"])
    (tmp_path / "my_optimizers.py").write_text(
        "import torch\ndef adamw(parameters):\n    return torch.optim.AdamW(parameters, lr=1e-3)\n"
    )
    config = {"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    no_optimizer = tmp_path / "no_optimizer.json"
    no_optimizer.write_text(json.dumps(config))
    base = ["--cluster", files["cluster"], "--model", "my_models:build", "--batch", "my_models:batch"]
    command = parse_command(["--deepspeed_config", str(no_optimizer), *base, "--optimizer", "my_optimizers:adamw"])
    scripts = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=5e-4)
    assert ds_config_fingerprint(command.ds_config, client_optimizer(command.optimizer_factory)) == (
        ds_config_fingerprint(config, client_optimizer(_optimizer_factory(scripts, config)))
    )
    # Both an optimizer section and --optimizer: the job trains with one of them.
    assert main(["--deepspeed_config", files["ds"], *base, "--optimizer", "my_optimizers:adamw"]) == 2
    assert "--optimizer: expected either it or an 'optimizer' section in" in capsys.readouterr().err
    assert main(["--deepspeed_config", str(no_optimizer), *base]) == 2
    err = capsys.readouterr().err
    assert f"--deepspeed_config: {no_optimizer}: optimizer: expected an 'optimizer' section" in err
    assert "or pass --optimizer MODULE:FACTORY" in err
    assert main(["--deepspeed_config", str(no_optimizer), *base, "--optimizer", "my_optimizers:nope"]) == 2


def test_the_summary_says_which_device_types_were_emulated() -> None:
    # The table names types as the cluster does ("fast", "slow"): nothing in a name says emulated or real.
    from poplar_bench.synthetic import SYNTHETIC_MODEL
    from poplar_ext.plan.formats import Emulation, Profile, Sample
    from poplar_ext.profiler.cli import summary

    def profile(device_type, emulated, zero_stage=0):
        return Profile(
            device_type=device_type,
            memory_capacity_bytes=1_500_000_000,
            zero_stage=zero_stage,
            world_size=2,
            model=SYNTHETIC_MODEL,
            max_micro_batch_size=1,
            samples=(Sample(micro_batch_size=1, micro_step_time_s=0.1, peak_memory_bytes=1),),
            optimizer_step_time_s=0.01,
            emulated=emulated,
            measured_with={"source": "measured"},
        )

    slow = Emulation(slowdown=3.0, memory_capacity_bytes=1_500_000_000)
    lines = summary([profile("cpu", None), profile("slow", slow), profile("slow", slow, 1)]).splitlines()
    assert lines[0].startswith("device type       stage") and len(lines) == 5
    assert lines[-1] == "devices: cpu (real), slow (emulated: 3x slower, 1.5 GB)"
