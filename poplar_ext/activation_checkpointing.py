"""Switching a model's activation checkpointing (the built-in GPT, Hugging Face, a user's toggle) for the profiler
and the runtime. See docs/profiling.md (which models can, and why ranks may differ in it at ZeRO stages 0-2 only)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from poplar_ext.plan.formats import Plan

CheckpointingToggle = Callable[[torch.nn.Module, bool], None]
"""``toggle(model, enabled)``: turn activation checkpointing on or off in `model`, in place."""


def checkpointing_toggle(
    model: torch.nn.Module, toggle: CheckpointingToggle | None = None
) -> CheckpointingToggle | None:
    """How to switch `model`'s activation checkpointing: `toggle` when given, a built-in one, or None (it cannot)."""
    if toggle is not None:
        if not callable(toggle):
            raise ValueError(
                f"checkpointing_toggle: expected a callable toggle(model, enabled), found {type(toggle).__name__}"
            )
        check_toggle_signature(toggle)
        return toggle
    # Declared on the class (not merely set on one object): the forward is written to read it.
    if isinstance(getattr(type(model), "activation_checkpointing", None), bool):
        return lambda model, enabled: setattr(model, "activation_checkpointing", enabled)
    prefix = _hugging_face_switch(model)
    if prefix is None:
        return None

    def switch(model: torch.nn.Module, enabled: bool) -> None:
        if enabled:
            getattr(model, f"{prefix}_enable")(**{f"{prefix}_kwargs": {"use_reentrant": False}})
        else:
            getattr(model, f"{prefix}_disable")()

    return switch


def _hugging_face_switch(model: torch.nn.Module) -> str | None:
    """The prefix of the Hugging Face methods that switch `model`: ``activation_checkpointing`` (transformers 5.24
    deprecated the ``gradient_checkpointing`` ones), the old one before 5.24 and for a class overriding the old
    method (5.24's new one would call the override with arguments it may not take); None where it cannot."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    owner = {name: next((k for k in type(model).__mro__ if name in vars(k)), None) for name in _SWITCHES}
    old, new = owner["gradient_checkpointing_enable"], owner["activation_checkpointing_enable"]
    if new is not None and not (old is not None and old is not new and issubclass(old, new)):
        return "activation_checkpointing"
    return "gradient_checkpointing" if old is not None else None


_SWITCHES = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


def check_toggle_signature(toggle: Callable[..., object], *, name: str = "checkpointing_toggle") -> None:
    """ValueError (naming the toggle as `name`) for a `toggle` that cannot be called as ``toggle(model, enabled)``:
    found now, not once a first stage was measured."""
    try:
        signature = inspect.signature(toggle)
    except (TypeError, ValueError):  # a builtin without one: called as it is
        return
    try:
        signature.bind(None, True)
    except TypeError:
        function = getattr(toggle, "__name__", type(toggle).__name__)
        raise ValueError(f"{name}: expected a callable toggle(model, enabled), found {function}{signature}") from None


def can_checkpoint(model: torch.nn.Module, toggle: CheckpointingToggle | None = None) -> bool:
    """Whether `model` can be switched (a built-in kind, or `toggle` given)."""
    return checkpointing_toggle(model, toggle) is not None


def cannot_checkpoint_message(model: torch.nn.Module, *, wanted_by: str) -> str:
    """The error for a `model` that cannot checkpoint although `wanted_by` asks for it."""
    return (
        f"{wanted_by}: expected a model that can turn activation checkpointing on (the built-in GPT, a Hugging Face "
        f"model with supports_gradient_checkpointing, or a checkpointing_toggle(model, enabled) of yours), found "
        f"{type(model).__name__} with none; pass checkpointing_toggle, or search without its checkpointed profiles "
        "(poplar-profile: --checkpointing-toggle MODULE:FN, or --activation-checkpointing off)"
    )


def set_activation_checkpointing(
    model: torch.nn.Module,
    enabled: bool,
    *,
    toggle: CheckpointingToggle | None = None,
    wanted_by: str = "activation_checkpointing",
) -> None:
    """Switch `model`'s activation checkpointing; ValueError naming `wanted_by` when it must be on and cannot be.

    Turning it off on a model that cannot checkpoint does nothing: such a model never does."""
    switch = checkpointing_toggle(model, toggle)
    if switch is None:
        if enabled:
            raise ValueError(cannot_checkpoint_message(model, wanted_by=wanted_by))
        return
    switch(model, bool(enabled))


def apply_plan_checkpointing(
    model: torch.nn.Module,
    plan: Plan,
    rank: int,
    *,
    toggle: CheckpointingToggle | None = None,
    source: str = "the plan",
) -> bool:
    """Give `model` this rank's ``activation_checkpointing`` from `plan`, before DeepSpeed wraps it; returns it.

    Every rank calls it. A model that can switch gets its rank's setting (on or off: the profiles the plan was made from
    were measured with it set so). One that cannot is left alone, unless some rank's entry asks for checkpointing: then
    ValueError, on every rank alike, since every rank holds the same plan and builds the same model."""
    switch = checkpointing_toggle(model, toggle)
    wanting = [r.rank for r in plan.ranks if r.activation_checkpointing]
    if switch is None:
        if wanting:
            raise ValueError(
                cannot_checkpoint_message(model, wanted_by=f"{source}: ranks[{wanting[0]}].activation_checkpointing")
            )
        return False
    enabled = plan.ranks[rank].activation_checkpointing
    switch(model, enabled)
    return enabled
