"""poplar-ext's state inside a DeepSpeed checkpoint: the plan and the data position.

DeepSpeed's ``save_checkpoint`` stores a ``client_state`` dict beside the model and
optimizer states; poplar-ext keeps its own entry there under `CLIENT_STATE_KEY`.
A resume must continue the same sample stream with the same allocation, so loading
checks that the saved plan's allocation, seed and shuffle match the job's.
"""

from __future__ import annotations

from pathlib import Path

from search.formats import Plan, plan_to_dict

CLIENT_STATE_KEY = "poplar"
"""Where poplar-ext keeps its state in a DeepSpeed checkpoint's client_state."""


def _allocation(plan_dict: dict) -> dict:
    """The part of a plan that decides which samples each rank sees and how gradients add."""
    return {
        "zero_stage": plan_dict["zero_stage"],
        "global_batch_size": plan_dict["global_batch_size"],
        "ranks": [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in plan_dict["ranks"]],
    }


def poplar_client_state(plan: Plan, *, consumed_samples: int, seed: int, shuffle: bool, drop_last: bool = False) -> dict:
    """What poplar-ext stores in a checkpoint: the plan and where the data stream stands."""
    return {
        "plan": plan_to_dict(plan),
        "consumed_samples": consumed_samples,
        "seed": seed,
        "shuffle": shuffle,
        "drop_last": drop_last,
    }


def restored_consumed_samples(path: str | Path, client_state: dict, current: dict) -> tuple[int, dict]:
    """The data position saved in a checkpoint at `path`, and its client_state without poplar's entry.

    `current` is this job's `poplar_client_state`. Raises ValueError when the
    checkpoint was not saved by poplar-ext, or with another allocation, seed or shuffle.
    """
    client_state = dict(client_state or {})
    saved = client_state.pop(CLIENT_STATE_KEY, None)
    if saved is None:
        raise ValueError(
            f"load_checkpoint: {path} was not saved by poplar_ext (its client_state has no "
            f"'{CLIENT_STATE_KEY}' entry), so its data position and plan are unknown"
        )
    if _allocation(saved["plan"]) != _allocation(current["plan"]):
        raise ValueError(
            f"load_checkpoint: {path} was saved with the plan {_allocation(saved['plan'])} but this job runs "
            f"{_allocation(current['plan'])}; resume with the checkpoint's plan (its samples and gradients differ otherwise)"
        )
    if (saved["seed"], saved["shuffle"]) != (current["seed"], current["shuffle"]):
        raise ValueError(
            f"load_checkpoint: {path} was saved with poplar.seed {saved['seed']} and shuffle {saved['shuffle']}, "
            f"this job has {current['seed']} and {current['shuffle']}; the data order would differ"
        )
    saved_drop_last = saved.get("drop_last", False)  # absent in checkpoints made before the option
    if saved_drop_last != current["drop_last"]:
        raise ValueError(
            f"load_checkpoint: {path} was saved with poplar.drop_last {saved_drop_last}, this job has "
            f"{current['drop_last']}; the samples of each epoch would differ"
        )
    return saved["consumed_samples"], client_state


__all__ = ["CLIENT_STATE_KEY", "poplar_client_state", "restored_consumed_samples"]
