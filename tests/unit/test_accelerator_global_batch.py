"""The global batch PoplarAccelerator searches a plan for when no config sets one: a plain Accelerator's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

import torch  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402


@pytest.mark.parametrize(("split_batches", "expected"), [(False, 12 * 2 * 3), (True, 12 * 2)])
def test_the_default_global_batch_is_what_a_plain_accelerator_trains(split_batches, expected):
    # split_batches: a plain Accelerator cuts each DataLoader batch among its processes.
    accelerator = SimpleNamespace(gradient_accumulation_steps=2, num_processes=3, split_batches=split_batches)
    loader = torch.utils.data.DataLoader(list(range(100)), batch_size=12)
    request = PoplarAccelerator._default_global_batch(accelerator, {"poplar": {"profiles": "p"}}, loader)
    assert request.size == expected
    assert request.origin.startswith("the DataLoader's batch_size")
