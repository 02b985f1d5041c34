"""`poplar-bench drift --trainer`: the drift bench's runs through `PoplarTrainer` (docs/bench.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from poplar_ext.plan.formats import Cluster

from .drift_settings import DriftSettings, plan_history, poplar_section, timed_rebalancing

WARMUP_ITERATIONS = 1  # optimizer steps before the measured ones (the first has no previous step to time from)


def gpt2(settings: DriftSettings) -> Any:
    """A GPT-2 of the demo model's shape, seeded alike on every rank."""
    import torch

    from poplar_ext.models.hugging_face import model_from_config

    m = settings.model
    torch.manual_seed(settings.seed)
    sizes = dict(n_positions=m.sequence_length, n_layer=m.num_layers, n_head=m.num_heads, n_embd=m.hidden_size)
    return model_from_config("GPT2Config", dict(vocab_size=m.vocab_size, bos_token_id=0, eos_token_id=0, **sizes))


def token_samples(settings: DriftSettings, count: int) -> list[dict[str, Any]]:
    """`count` random sequences of the model's length, each its own labels (the model shifts them)."""
    import torch

    from poplar_ext.models.synthetic import random_tokens

    ids = random_tokens(settings.model.vocab_size, (count, settings.model.sequence_length), seed=settings.seed)
    mask = torch.ones(settings.model.sequence_length, dtype=torch.long)
    return [{"input_ids": row, "attention_mask": mask, "labels": row} for row in ids]


def deepspeed_config(settings: DriftSettings, *, cluster_path: Path, adaptive: bool) -> dict[str, Any]:
    """Hugging Face's "auto" batch values, filled per rank from the plan; the Trainer's own optimizer."""
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": settings.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "poplar": {
            **poplar_section(settings, cluster_path=cluster_path, adaptive=adaptive),
            "global_batch_size": settings.global_batch_size,
            # Every run searches its plan from the same profiles, as the plain bench's runs share one plan.
            "calibration": {"action": "off"},
        },
    }


def _recorder(trainer: Any) -> Any:
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Each measured optimizer step's time and the re-balancing hook's time after the warm-up."""

        def __init__(self) -> None:
            self.iteration_s: list[float] = []
            self.hook_s = [0.0]

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # The Trainer has built its PoplarEngine by now.
            self.hook_s = timed_rebalancing(trainer.poplar_engine)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == WARMUP_ITERATIONS:
                self.hook_s[0] = 0.0
            elif state.global_step > WARMUP_ITERATIONS:
                self.iteration_s.append(trainer.poplar_engine.last_iteration_time_s)

    return Recorder()


def train(settings: DriftSettings, work: Path, *, cluster_path: Path, adaptive: bool) -> dict[str, Any]:
    """One run: ``PoplarTrainer.train()``; the drift bench's per-rank result of a run."""
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from poplar_ext.integrations.transformers import PoplarTrainer

    # One process builds several Trainers: each must set accelerate up again.
    AcceleratorState._reset_state(reset_partial_state=False)
    steps = WARMUP_ITERATIONS + settings.drift_iterations
    args = TrainingArguments(
        output_dir=str(work / "trainer"),
        deepspeed=deepspeed_config(settings, cluster_path=cluster_path, adaptive=adaptive),
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=steps,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=settings.seed,
    )
    trainer = PoplarTrainer(
        model=gpt2(settings), args=args, train_dataset=token_samples(settings, steps * settings.global_batch_size)
    )
    recorder = _recorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    return {
        "iteration_s": recorder.iteration_s,
        "rebalance_hook_s": recorder.hook_s[0],
        "history": plan_history(trainer.poplar_engine),
        "warmup_iterations": WARMUP_ITERATIONS,
    }


def measure_standalone(settings: DriftSettings, cluster: Cluster, rank: int) -> list[dict[str, Any]]:
    """This rank's standalone micro-steps of the GPT-2 (`demo_worker.measure_standalone`) at the sizes its
    profile from the runs says are best and largest."""
    from poplar_ext.plan.formats import load_profiles
    from poplar_ext.profiler.auto import batches_of
    from poplar_ext.profiler.fingerprint import model_fingerprint

    from . import demo_worker

    model = gpt2(settings)
    fingerprint, device_type = model_fingerprint(model), cluster.rank_device_types[rank]
    profile = next(
        (
            p
            for p in load_profiles(settings.profiles_dir())
            if p.model.fingerprint == fingerprint
            and p.key == (device_type, settings.zero_stage, False, False)
            and p.world_size == len(cluster.rank_device_types)
        ),
        None,
    )
    if profile is None:
        raise RuntimeError(
            f"drift --trainer: no profile of {device_type} at ZeRO stage {settings.zero_stage} for this GPT-2 in "
            f"{settings.profiles_dir()} after the runs"
        )
    samples = token_samples(settings, profile.max_micro_batch_size)
    return demo_worker.measure_standalone(
        settings, cluster, rank, profile, model=model, make_batch=batches_of(samples, None)
    )


__all__ = ["deepspeed_config", "gpt2", "measure_standalone", "token_samples", "train"]
