"""Switching a model's activation checkpointing (poplar_ext.activation_checkpointing) and the gradients it gives."""

import dataclasses
import warnings

import pytest
import torch

from poplar_ext.activation_checkpointing import (
    apply_plan_checkpointing,
    can_checkpoint,
    checkpointing_toggle,
    set_activation_checkpointing,
)
from poplar_ext.models.toy_gpt import GPT, GPTConfig
from poplar_ext.plan.formats import Plan, Prediction, RankPlan

CFG = GPTConfig(vocab_size=32, sequence_length=8, num_layers=2, num_heads=2, hidden_size=16)


def _gradients(model):
    tokens = torch.randint(0, CFG.vocab_size, (3, CFG.sequence_length + 1), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    model(tokens).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _block_calls(model):
    calls = [0]
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_the_built_in_gpt_recomputes_and_gives_the_same_gradients():
    plain, checkpointed = GPT(CFG), GPT(CFG)
    set_activation_checkpointing(checkpointed, True)
    assert checkpointed.activation_checkpointing and can_checkpoint(plain)
    plain_calls, checkpointed_calls = _block_calls(plain), _block_calls(checkpointed)
    expected, found = _gradients(plain), _gradients(checkpointed)
    assert (plain_calls[0], checkpointed_calls[0]) == (1, 2), "the checkpointed block runs its forward again"
    assert max(float((expected[k] - found[k]).abs().max()) for k in expected) <= 1e-6
    with torch.no_grad():  # no recomputation without a backward
        checkpointed(torch.zeros(1, CFG.sequence_length + 1, dtype=torch.long))
    set_activation_checkpointing(checkpointed, False)
    assert not checkpointed.activation_checkpointing


def test_a_hugging_face_model_switches_through_its_own_methods():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    )
    assert can_checkpoint(model)
    # transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing*: the switch uses what it offers.
    name = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    for enabled in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # the deprecated names warn
            set_activation_checkpointing(model, enabled)
            assert getattr(model, name) is enabled


def test_a_hugging_face_model_overriding_the_old_switch_is_switched_through_it():
    """transformers 5.24's activation_checkpointing_enable calls an override of gradient_checkpointing_enable with
    arguments an override written for the old signature does not take."""
    transformers = pytest.importorskip("transformers")

    class Overriding(transformers.GPT2LMHeadModel):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.switched_on_by_override = gradient_checkpointing_kwargs
            super().gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    model = Overriding(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the override calls the deprecated name itself
        set_activation_checkpointing(model, True)
        assert model.switched_on_by_override == {"use_reentrant": False} and model.is_gradient_checkpointing
        set_activation_checkpointing(model, False)
        assert not model.is_gradient_checkpointing


class Opaque(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = GPT(CFG)

    def forward(self, tokens):
        return self.inner(tokens)


def test_other_models_need_a_toggle():
    model = Opaque()
    assert checkpointing_toggle(model) is None
    set_activation_checkpointing(model, False)  # off is what such a model always does
    with pytest.raises(ValueError, match="Opaque with none; pass checkpointing_toggle"):
        set_activation_checkpointing(model, True, wanted_by="the plan")
    with pytest.raises(ValueError, match=r"\(poplar-profile: --checkpointing-toggle MODULE:FN, or --activation-che"):
        set_activation_checkpointing(model, True, wanted_by="the plan")

    def toggle(m, enabled):
        m.inner.activation_checkpointing = enabled

    set_activation_checkpointing(model, True, toggle=toggle)
    assert model.inner.activation_checkpointing
    with pytest.raises(ValueError, match="checkpointing_toggle: expected a callable"):
        checkpointing_toggle(model, toggle="yes")


def _plan(checkpointing):
    ranks = tuple(
        RankPlan(
            rank=r,
            device_type="a" if r == 0 else "b",
            micro_batch_size=1,
            gradient_accumulation_steps=1,
            activation_checkpointing=on,
        )
        for r, on in enumerate(checkpointing)
    )
    return Plan(
        policy="poplar",
        zero_stage=2,
        global_batch_size=len(ranks),
        ranks=ranks,
        predicted=Prediction(iteration_time_s=1.0, samples_per_s=1.0, ideal_samples_per_s=1.0),
        profile_fingerprints={},
    )


def test_each_rank_takes_its_plan_entry_and_a_model_that_cannot_is_refused_everywhere():
    plan = _plan([False, True])
    for rank, expected in ((0, False), (1, True)):
        model = GPT(CFG)
        model.activation_checkpointing = not expected
        assert apply_plan_checkpointing(model, plan, rank) is expected
        assert model.activation_checkpointing is expected
    for rank in (0, 1):  # rank 0's own entry is off, but the plan cannot run: refused there too
        with pytest.raises(ValueError, match=r"my plan: ranks\[1\]\.activation_checkpointing: expected a model"):
            apply_plan_checkpointing(Opaque(), plan, rank, source="my plan")
    assert apply_plan_checkpointing(Opaque(), _plan([False, False]), 0) is False
    off = dataclasses.replace(
        plan, ranks=tuple(dataclasses.replace(r, activation_checkpointing=False) for r in plan.ranks)
    )
    assert apply_plan_checkpointing(Opaque(), off, 1) is False


def test_profile_model_checks_its_checkpointing_mode_first(tmp_path):
    from poplar_ext.profiler import profile_model

    with pytest.raises(ValueError, match="activation_checkpointing: expected one of 'auto', 'both', 'off', found 'on'"):
        profile_model(
            model_factory=lambda: GPT(CFG),
            make_batch=lambda b: None,
            ds_config={"optimizer": {}},
            cache_dir=tmp_path,
            activation_checkpointing="on",
        )


def test_a_toggle_that_cannot_take_model_and_enabled_is_refused_before_any_use():
    with pytest.raises(ValueError, match=r"expected a callable toggle\(model, enabled\), found <lambda>\(model\)"):
        checkpointing_toggle(Opaque(), lambda model: None)
    assert checkpointing_toggle(Opaque(), print) is print  # no signature to read: called as it is
