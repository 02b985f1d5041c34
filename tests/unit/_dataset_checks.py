"""The training data's checks counted while a job is settled, up to the process group (tests/unit)."""

from __future__ import annotations


class Settling(Exception):
    """prepare_job went past its refusals to the process group."""


def counted_dataset_checks(monkeypatch, integration) -> list[str]:
    """What each `check_plan_dataset` call (in `integration` and in poplar_ext.zero.initialize) named, in order;
    prepare_job raises `Settling` where it would join the process group."""
    import poplar_ext.zero.initialize as zero_initialize
    from poplar_ext.runtime.data import check_plan_dataset

    checked: list[str] = []

    def check(dataset, what, **options):
        checked.append(what)
        check_plan_dataset(dataset, what, **options)

    def join_job(**options):
        raise Settling

    for module in (integration, zero_initialize):
        monkeypatch.setattr(module, "check_plan_dataset", check)
    monkeypatch.setattr(zero_initialize, "join_job", join_job)
    return checked
