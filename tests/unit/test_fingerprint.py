"""Model fingerprints: same architecture -> same hash; any architectural change (a setting too) -> another."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from poplar_ext.activation_checkpointing import set_activation_checkpointing
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
        GPTConfig(num_heads=4),
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


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (nn.Dropout(0.0), nn.Dropout(0.1)),
        (nn.MultiheadAttention(16, 2), nn.MultiheadAttention(16, 8)),
        (nn.Conv1d(2, 2, 3, stride=1), nn.Conv1d(2, 2, 3, stride=2)),
    ],
)
def test_a_changed_setting_with_the_same_shapes_changes_the_fingerprint(a: nn.Module, b: nn.Module) -> None:
    assert model_fingerprint(a) != model_fingerprint(b)


def test_an_attribute_with_a_to_dict_of_its_own_is_not_taken_for_a_config() -> None:
    class Table:  # say a data frame: to_dict takes arguments and holds no setting of the model
        def to_dict(self, orient: str) -> dict:
            return {}

    model = nn.Linear(2, 2)
    model.table = Table()
    assert model_fingerprint(model) == model_fingerprint(nn.Linear(2, 2))


def _gpt2(**changed: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    shape = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**shape, **changed}))


@pytest.mark.parametrize("changed", [{"n_head": 16}, {"attn_implementation": "eager"}, {"attn_pdrop": 0.0}])
def test_a_changed_hugging_face_config_changes_the_fingerprint(changed: dict) -> None:
    # Heads, attention implementation and dropout change no shape: a 16-head model once reused a 2-head profile.
    assert model_fingerprint(_gpt2(**changed)) != model_fingerprint(_gpt2())


def test_what_a_trainer_or_the_profiler_switches_keeps_the_fingerprint() -> None:
    gpt, hf = GPT(GPTConfig()), _gpt2()
    before = model_fingerprint(gpt), model_fingerprint(hf)
    for model in (gpt, hf):
        set_activation_checkpointing(model, True)  # keyed apart: the profile's activation_checkpointing
        model.eval()
    hf.config.use_cache, hf.config.pad_token_id = False, 0  # what the Trainer and TRL set
    assert (model_fingerprint(gpt), model_fingerprint(hf)) == before
    assert model_fingerprint(hf) == model_fingerprint(_gpt2(name_or_path="elsewhere"))


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


def test_a_config_dataclass_holding_a_lock_is_read_by_its_json_fields() -> None:
    import dataclasses
    import threading

    @dataclasses.dataclass
    class Settings:
        heads: int
        lock: object  # not JSON (a process group, a lock): left out, not copied

    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    model.cfg, other.cfg = Settings(2, threading.Lock()), Settings(4, threading.Lock())
    assert model_fingerprint(model) != model_fingerprint(other)


def test_what_a_hub_config_or_a_same_size_resize_adds_keeps_the_fingerprint() -> None:
    hub = _gpt2(n_ctx=1024, task_specific_params={"text-generation": {"max_length": 50}}, initializer_range=0.05)
    assert model_fingerprint(hub) == model_fingerprint(_gpt2())
    resized = _gpt2()
    resized.resize_token_embeddings(64)  # to the same size: sets a top-level vocab_size
    assert model_fingerprint(resized) == model_fingerprint(_gpt2())
