"""Model fingerprints: same architecture -> same hash; any architectural change -> another."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar_ext.models.toy_gpt import GPT, GPTConfig
from poplar_ext.profiler.fingerprint import model_description, model_fingerprint


def test_same_architecture_with_other_weights_has_the_same_fingerprint() -> None:
    assert model_fingerprint(GPT(GPTConfig(), seed=0)) == model_fingerprint(GPT(GPTConfig(), seed=1))


@pytest.mark.parametrize(
    "changed",
    [
        GPTConfig(hidden_size=32),
        GPTConfig(num_layers=3),
        GPTConfig(vocab_size=128),
        GPTConfig(sequence_length=16),
    ],
)
def test_a_changed_shape_changes_the_fingerprint(changed: GPTConfig) -> None:
    assert model_fingerprint(GPT(changed)) != model_fingerprint(GPT(GPTConfig()))


def test_a_changed_dtype_changes_the_fingerprint() -> None:
    assert model_fingerprint(GPT(GPTConfig()).to(torch.bfloat16)) != model_fingerprint(GPT(GPTConfig()))


def test_a_changed_module_class_changes_the_fingerprint() -> None:
    relu = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    gelu = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    assert model_fingerprint(relu) != model_fingerprint(gelu)


def test_renamed_parameters_change_the_fingerprint() -> None:
    a = nn.ModuleDict({"encoder": nn.Linear(4, 4)})
    b = nn.ModuleDict({"decoder": nn.Linear(4, 4)})
    assert model_fingerprint(a) != model_fingerprint(b)


def test_fingerprint_is_a_short_sha256() -> None:
    fp = model_fingerprint(nn.Linear(2, 3))
    assert fp.startswith("sha256:") and len(fp) == len("sha256:") + 16
    assert model_description(nn.Linear(2, 3))["parameters"][0] == ["weight", [3, 2], "float32", True]


def test_not_a_module_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module, found dict"):
        model_fingerprint({})  # type: ignore[arg-type]
