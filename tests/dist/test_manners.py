"""`poplar_ext.initialize` changes no process-wide state the user did not ask for.

It installs no logging handler and leaves torch's thread count and glibc's allocator
alone, unless the `poplar` section asks (`cpu_threads`, `steady_cpu_allocator`):
then it applies them and logs what it did.
"""

from __future__ import annotations

import logging

import _training as t
from harness import run_ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _initialize(tmp, **poplar):
    import torch

    import poplar_ext

    torch.set_num_threads(2)  # the user's own setting (the harness gives ranks 1)
    root_handlers = list(logging.getLogger().handlers)
    library = logging.getLogger("poplar_ext")
    records = _Records()
    library.addHandler(records)
    library.setLevel(logging.INFO)
    try:
        model = t.GPT(t.TINY)
        plan = t.write_plan(tmp / "plan.json", [(2, 1), (1, 2)], stage=1, device_types=["cpu", "cpu-slow"])
        config = t.ds_config(cluster=t.write_cluster(tmp / "cluster.json", slow=1), plan=plan, stage=1, **poplar)
        poplar_ext.initialize(model=model, optimizer=t.make_optimizer("sgd", model.parameters()), config=config)
    finally:
        library.removeHandler(records)
        library.setLevel(logging.NOTSET)
    return {
        "threads": torch.get_num_threads(),
        "library_handlers": [type(h).__name__ for h in library.handlers],
        "root_handlers_unchanged": logging.getLogger().handlers == root_handlers,
        "messages": records.messages,
    }


def _both(tmp_dir):
    import os
    from pathlib import Path

    tmp = Path(tmp_dir) / f"rank{os.environ['RANK']}"
    (tmp / "plain").mkdir(parents=True)
    (tmp / "asked").mkdir()
    return {
        "plain": _initialize(tmp / "plain"),
        "asked": _initialize(tmp / "asked", cpu_threads=1, steady_cpu_allocator=True),
    }


def test_initialize_leaves_threads_and_logging_alone_unless_asked(tmp_path):
    results = run_ranks(_both, world_size=2, tmp_path=tmp_path, args=(str(tmp_path),), timeout_s=120)
    for rank, result in enumerate(results):
        plain, asked = result["plain"], result["asked"]
        assert plain["threads"] == 2, f"rank {rank}: initialize changed torch's thread count"
        assert plain["library_handlers"] == ["NullHandler"] and plain["root_handlers_unchanged"]
        assert not any("threads set to" in m or "glibc now keeps" in m for m in plain["messages"])
        assert asked["threads"] == 1
        assert any("poplar.cpu_threads: torch intra-op threads set to 1 (were 2)" in m for m in asked["messages"])
        assert any("poplar.steady_cpu_allocator" in m for m in asked["messages"])
        assert asked["library_handlers"] == ["NullHandler"] and asked["root_handlers_unchanged"]
    # The emulated rank (rank 1) is told that emulation needs one thread when it has two.
    assert any("set poplar.cpu_threads to 1" in m for m in results[1]["plain"]["messages"])
