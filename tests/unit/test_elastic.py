"""A configuration or code error under torchrun's restarting agent ends the job at once (issue 36, item 11)."""

from __future__ import annotations

import signal

import pytest

from poplar_ext.elastic import end_restarting_launcher, ends_job_on_user_error, restarts_left

UNDER_TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_restarts_left_come_from_torchruns_variables():
    assert restarts_left(UNDER_TORCHRUN) == 2
    assert restarts_left({}) == 0
    assert restarts_left({**UNDER_TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "3"}) == 0


def test_with_restarts_left_the_agent_is_asked_to_end_the_job():
    signals: list[tuple[int, int]] = []
    asked = end_restarting_launcher(
        ValueError("poplar.plan: no such file"),
        env=UNDER_TORCHRUN,
        kill=lambda *a: signals.append(a),
        parent=lambda: 4242,
    )
    assert asked and signals == [(4242, signal.SIGTERM)]


def _process(proc, pid: int, parent: int, environ: dict[str, str]) -> None:
    """A process as Linux's /proc shows it: its environment at start, its parent in its stat line."""
    folder = proc / str(pid)
    folder.mkdir()
    (folder / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in environ.items()))
    (folder / "stat").write_text(f"{pid} (sh (wrapper)) S {parent} {pid} {pid} 0 -1\n")


def test_a_wrapper_between_the_agent_and_the_script_is_passed_over(tmp_path, monkeypatch):
    # torchrun --no-python ./run.sh: the shell running the script was signalled in the agent's place, ended, and
    # the agent restarted the job --max-restarts times (seen: 3 starts with --max-restarts 2).
    import poplar_ext.elastic as elastic

    monkeypatch.setattr(elastic, "PROC", tmp_path, raising=False)
    _process(tmp_path, 300, 200, {"PATH": "/bin", **UNDER_TORCHRUN})  # the wrapper: the worker's environment
    _process(tmp_path, 200, 100, {"PATH": "/bin"})  # the agent
    signals: list[tuple[int, int]] = []
    asked = end_restarting_launcher(
        ValueError("x"), env=UNDER_TORCHRUN, kill=lambda *a: signals.append(a), parent=lambda: 300
    )
    assert asked and signals == [(200, signal.SIGTERM)]
    signals.clear()  # an agent of another run started this one: the parent is asked
    _process(tmp_path, 301, 1, {**UNDER_TORCHRUN, "TORCHELASTIC_RUN_ID": "outer"})
    end_restarting_launcher(ValueError("x"), env=UNDER_TORCHRUN, kill=lambda *a: signals.append(a), parent=lambda: 301)
    assert signals == [(301, signal.SIGTERM)]


def test_an_error_ending_in_a_full_stop_is_told_with_one(capsys):
    # Seen: "... names 2 ranks but the job has 1.. An error of the job's configuration or code"
    end_restarting_launcher(
        ValueError("The cluster description names 2 ranks but the job has 1."),
        env=UNDER_TORCHRUN,
        kill=lambda *a: None,
        parent=lambda: 4242,
    )
    said = capsys.readouterr().err
    assert "but the job has 1. An error of the job's configuration or code" in said, said


def test_without_restarts_nothing_is_signalled():
    signals: list[tuple[int, int]] = []
    assert not end_restarting_launcher(ValueError("x"), env={}, kill=lambda *a: signals.append(a), parent=lambda: 1)
    assert signals == []


def test_settling_a_job_ends_the_job_on_a_user_error_and_reraises_it(monkeypatch):
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)

    @ends_job_on_user_error
    def settle(error):
        raise error

    for error in (ValueError("bad plan"), TypeError("forward() takes 2 positional arguments but 4 were given")):
        with pytest.raises(type(error)):
            settle(error)
    with pytest.raises(RuntimeError):  # a lost peer: the launcher restarts it
        settle(RuntimeError("Connection closed by peer"))
    assert [type(e) for e in ended] == [ValueError, TypeError]


def test_the_places_that_settle_a_job_end_it_on_user_errors():
    from poplar_ext.pipeline.engine import PoplarPipelineEngine
    from poplar_ext.pipeline.job import prepare_pipeline_job
    from poplar_ext.zero.engine import PoplarEngine
    from poplar_ext.zero.initialize import prepare_job

    # A checkpoint's refusal (another seed, a state that cannot be resharded) meets every restart's load again.
    loads = (PoplarEngine.load_checkpoint, PoplarPipelineEngine.load_checkpoint)
    for settle in (prepare_job, prepare_pipeline_job, *loads):
        assert settle.__wrapped__.__name__ == settle.__name__


def test_poplar_ext_initialize_ends_the_job_on_its_own_user_errors_once(monkeypatch):
    # docs/fault-tolerance.md names poplar_ext.initialize: its refusals after prepare_job (here: options a
    # pipeline module does not take) end the job too, and a nested settling place asks only once.
    import poplar_ext.elastic as elastic
    from poplar_ext.engines import initialize
    from poplar_ext.pipeline.module import PoplarPipelineModule

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    module = PoplarPipelineModule.__new__(PoplarPipelineModule)  # built elsewhere: only its type is read
    with pytest.raises(ValueError, match=r"loss_fn: expected None for a PoplarPipelineModule"):
        initialize(model=module, loss_fn=lambda engine, batch: 0)
    assert [type(e) for e in ended] == [ValueError]

    @ends_job_on_user_error
    def inner():
        raise ValueError("bad plan")

    @ends_job_on_user_error
    def outer():
        inner()

    ended.clear()
    with pytest.raises(ValueError, match="bad plan"):
        outer()
    assert len(ended) == 1
