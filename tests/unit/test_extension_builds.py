"""A build lock left by a killed extension build stops a job at once, naming the file (issue 36, item 10)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from poplar_ext.hardware import extension_builds
from poplar_ext.hardware.extension_builds import check_extension_build_locks, extension_build_locks


def _lock(root, *parts: str, age_s: float):
    path = root.joinpath(*parts, "lock")
    path.parent.mkdir(parents=True)
    path.write_text("")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_stale_lock_is_refused_with_its_path_and_the_command(tmp_path):
    lock = _lock(tmp_path, "py311_cpu", "deepspeed_shm_comm", age_s=3600)
    with pytest.raises(RuntimeError) as raised:
        check_extension_build_locks(root=tmp_path)
    message = str(raised.value)
    assert str(lock) in message and f"rm {lock}" in message and "60 minutes old" in message


def test_a_fresh_lock_is_logged_not_refused(tmp_path, caplog):
    lock = _lock(tmp_path, "deepspeed_shm_comm", age_s=5)
    with caplog.at_level(logging.WARNING, logger=extension_builds.__name__):
        check_extension_build_locks(root=tmp_path)
    assert str(lock) in caplog.text


def test_no_lock_no_folder_nothing_to_say(tmp_path, caplog):
    check_extension_build_locks(root=tmp_path / "missing")
    check_extension_build_locks(root=tmp_path)
    assert extension_build_locks(tmp_path) == [] and not caplog.text


def test_torch_extensions_dir_is_where_locks_are_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path, "cpu_adam", age_s=3600)
    assert extension_build_locks() == [lock]
    with pytest.raises(RuntimeError, match="cpu_adam"):
        check_extension_build_locks()


def test_join_job_checks_the_locks_before_the_group_starts(tmp_path, monkeypatch):
    import poplar_ext.collectives as collectives
    from poplar_ext.hardware.devices import join_job

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _lock(tmp_path, "deepspeed_shm_comm", age_s=3600)
    started: list[bool] = []
    monkeypatch.setattr(collectives, "ensure_process_group", lambda **options: started.append(True))
    with pytest.raises(RuntimeError, match="deepspeed_shm_comm"):
        join_job(dist_backend="gloo")
    assert not started
