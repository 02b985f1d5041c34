"""Profiling's short collective timeout: every group of this rank, those made inside too, restored after
(one process, a gloo group of one rank)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from poplar_ext.collectives import ShortCollectiveTimeouts


def _timeout(group=None) -> datetime.timedelta:
    group = group or dist.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=30))
    yield
    dist.destroy_process_group()


def test_every_group_gets_the_short_timeout_and_its_own_again_after(one_rank_group) -> None:
    with ShortCollectiveTimeouts(120) as short:
        assert _timeout() == datetime.timedelta(seconds=120)
        engine_group = dist.new_group([0], timeout=datetime.timedelta(minutes=20))  # as an engine makes one
        short.apply()
        assert _timeout(engine_group) == datetime.timedelta(seconds=120)
    assert _timeout() == datetime.timedelta(minutes=30)
    assert _timeout(engine_group) == datetime.timedelta(minutes=20)


def test_without_a_group_it_does_nothing() -> None:
    with ShortCollectiveTimeouts(120):
        pass


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s: expected seconds > 0, found 0"):
        ShortCollectiveTimeouts(0)


def test_profiling_warns_where_nccl_would_not_tear_a_waiting_rank_down(monkeypatch, caplog) -> None:
    from types import SimpleNamespace

    from poplar_ext.profiler import api

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    with api._short_timeouts(SimpleNamespace(collective_timeout_s=120.0), torch.device("cuda")) as timeouts:
        assert timeouts.timeout_s == 120.0
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a rank lost while profiling leaves the others waiting" in caplog.text
    with api._short_timeouts(SimpleNamespace(collective_timeout_s=None), torch.device("cuda")) as timeouts:
        assert timeouts is None


@pytest.mark.parametrize("timeout_s", [0, -5.0, float("inf")])
def test_profiling_refuses_a_timeout_that_is_not_positive(timeout_s) -> None:
    # inf too: the group timeout is a timedelta, which overflows on it once the job has started.
    from poplar_ext.profiler import ProfileOptions
    from poplar_ext.profiler.api import _checked

    options = ProfileOptions(
        model_factory=lambda: torch.nn.Linear(2, 2),
        make_batch=lambda size: torch.zeros(size, 2),
        ds_config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        collective_timeout_s=timeout_s,
    )
    with pytest.raises(ValueError, match=f"collective_timeout_s: expected seconds > 0, or None, found {timeout_s}"):
        _checked(options)
