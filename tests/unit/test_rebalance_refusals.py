"""What re-balancing and the Trainer refuse before any collective, with the field named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from poplar_ext.runtime.config import poplar_config_from_dict
from poplar_ext.runtime.initialize import job_rebalancer


def _job(**section):
    config = poplar_config_from_dict({"plan": "p.json", "profiles": "profiles", **section}, base_dir=Path("."))
    return SimpleNamespace(poplar_config=config, source="ds.json", rank=0)


def test_drop_last_with_rebalancing_asked_for_is_refused():
    with pytest.raises(ValueError, match="ds.json: poplar.rebalance.enabled: expected false .* with poplar.drop_last"):
        job_rebalancer(_job(drop_last=True, rebalance={"enabled": True}))


def test_drop_last_turns_automatic_rebalancing_off():
    assert job_rebalancer(_job(drop_last=True)) is None


def test_accelerate_s_own_accumulation_count_is_refused_by_the_trainer():
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    args = TrainingArguments(
        output_dir="unused",
        use_cpu=True,
        deepspeed={"zero_optimization": {"stage": 0}, "poplar": {}},
        accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}},
    )
    with pytest.raises(ValueError, match="gradient_accumulation_kwargs: expected no 'num_steps'"):
        PoplarTrainer(model=None, args=args)
