"""ZeRO initialize's order: a call refused before DeepSpeed's engine imports no deepspeed; the plan's origin is
logged once the PoplarEngine exists."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiprocess
def test_a_refused_call_imports_no_deepspeed():
    script = (
        "import sys, torch\n"
        "from poplar_ext.zero.initialize import initialize\n"
        "class Stream(torch.utils.data.IterableDataset):\n"
        "    def __iter__(self):\n"
        "        return iter(())\n"
        "try:\n"
        "    initialize(model=None, training_data=Stream(), config={'poplar': {}})\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
        "print('deepspeed imported:', 'deepspeed' in sys.modules)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=120
    )
    assert "refused: training_data" in result.stdout, result.stdout + result.stderr
    assert "deepspeed imported: False" in result.stdout, result.stdout + result.stderr


def test_the_plans_origin_is_logged_after_the_engine_is_built(monkeypatch, caplog):
    from poplar_ext.zero import initialize as zero_initialize

    def failing_engine(*args, **kwargs):
        raise RuntimeError("engine not built")

    monkeypatch.setattr(zero_initialize, "PoplarEngine", failing_engine)
    job = SimpleNamespace(rank=0, plan=None, poplar_config=None, plan_reason="searched at start")
    with caplog.at_level(logging.INFO, logger=zero_initialize.logger.name), pytest.raises(RuntimeError):
        zero_initialize.poplar_engine(job, None, labels=("a",), slowdown=None, rebalancer=None)
    assert "poplar plan from step 0" not in caplog.text

    monkeypatch.setattr(zero_initialize, "PoplarEngine", lambda *args, **kwargs: "engine")
    with caplog.at_level(logging.INFO, logger=zero_initialize.logger.name):
        assert zero_initialize.poplar_engine(job, None, labels=("a",), slowdown=None, rebalancer=None) == "engine"
    assert "poplar plan from step 0: searched at start" in caplog.text
    caplog.clear()  # a caller that logged it already (PoplarTrainer, when it was built)
    with caplog.at_level(logging.INFO, logger=zero_initialize.logger.name):
        zero_initialize.poplar_engine(job, None, labels=("a",), slowdown=None, rebalancer=None, log_origin=False)
    assert "poplar plan from step 0" not in caplog.text


def test_training_data_smaller_than_the_global_batch_is_refused_naming_it_before_the_engine(monkeypatch):
    import torch

    from poplar_ext.zero import initialize as zero_initialize

    job = SimpleNamespace(plan=SimpleNamespace(global_batch_size=10))
    monkeypatch.setattr(zero_initialize, "load_deepspeed_config", lambda *args, **kwargs: ({}, ROOT, "ds.json"))
    monkeypatch.setattr(zero_initialize, "read_poplar_section", lambda *args, **kwargs: None)
    monkeypatch.setattr(zero_initialize, "_refuse_another_drop_last", lambda *args: None)
    monkeypatch.setattr(zero_initialize, "prepare_job", lambda *args, **kwargs: job)
    message = r"^training_data: num_samples: expected at least the global batch \(10 samples\), found 5: one iteration"
    with pytest.raises(ValueError, match=message):
        zero_initialize.initialize(model=torch.nn.Linear(2, 1), training_data=list(range(5)), config={})


@pytest.mark.parametrize(
    ("name", "expected"),
    [({}, "training_data: num_samples"), ({"training_data_name": "train_dataset"}, "train_dataset: num_samples")],
)
def test_data_smaller_than_the_configs_global_batch_is_refused_before_the_cluster_profiles_or_plan(
    monkeypatch, tmp_path, name, expected
):
    # Seen: 5 samples under train_batch_size 8 were refused only after the automatic mode had profiled a stage,
    # checked the cache and searched a plan; the config said the batch before any of it.
    import torch

    from poplar_ext.zero import initialize as zero_initialize

    monkeypatch.setenv("POPLAR_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(zero_initialize, "join_job", lambda **kwargs: torch.device("cpu"))
    monkeypatch.setattr(zero_initialize, "process_group_rank", lambda: (0, 2))

    def too_late(*args, **kwargs):
        raise AssertionError("the cluster was settled before the data was checked")

    monkeypatch.setattr(zero_initialize, "agreed_job_cluster", too_late)
    loaded = ({"train_batch_size": 8, "poplar": {}}, tmp_path, "ds.json")
    message = rf"^{expected}: expected at least the global batch \(8 samples\), found 5: one iteration"
    with pytest.raises(ValueError, match=message):
        zero_initialize.prepare_job(loaded, model=torch.nn.Linear(2, 1), training_data=list(range(5)), **name)
    # A batch the config leaves to the plan ("auto"): the plan's is checked after it.
    auto = ({"train_micro_batch_size_per_gpu": "auto", "poplar": {}}, tmp_path, "ds.json")
    with pytest.raises(AssertionError, match="the cluster was settled"):
        zero_initialize.prepare_job(auto, model=torch.nn.Linear(2, 1), training_data=list(range(5)))
    # poplar.global_batch_size "auto" too (it was compared with the data as a number: a TypeError).
    auto = ({"poplar": {"global_batch_size": "auto"}}, tmp_path, "ds.json")
    with pytest.raises(AssertionError, match="the cluster was settled"):
        zero_initialize.prepare_job(auto, model=torch.nn.Linear(2, 1), training_data=list(range(5)))
