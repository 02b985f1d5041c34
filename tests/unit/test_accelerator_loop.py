"""PoplarAccelerator's counters around accelerate's loop: accumulate()'s micro-step counter after load_state, a
backward outside accumulate(), free_memory() before another prepare (one process, no process group; accelerate's
own methods stubbed where they would need DeepSpeed's engine)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate", reason="PoplarAccelerator needs pip install 'poplar-ext[accelerate]'")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402

from poplar_ext.integrations.accelerate import PoplarAccelerator  # noqa: E402
from poplar_ext.plan.formats import plan_from_dict, plan_to_dict  # noqa: E402
from poplar_ext.runtime.config import poplar_config_from_dict  # noqa: E402

CONFIG = {"train_batch_size": 4, "zero_optimization": {"stage": 1}, "poplar": {"plan": "plan.json"}}


@pytest.fixture
def accelerator(monkeypatch):
    """A PoplarAccelerator in a process that built no Accelerator before (accelerate's process-wide state reset)."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # set, so that it is unset again afterwards
    AcceleratorState._reset_state(reset_partial_state=True)
    yield PoplarAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(CONFIG)))
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("saved_step", [2, 5, 0])
def test_load_state_counts_micro_steps_from_the_iteration_start(monkeypatch, accelerator, saved_step):
    # accelerate sets `step` from the checkpoint's RNG file: a multiple of the saved plan's count (2 under
    # counts of 2 when this plan counts 3), a micro-step inside an iteration (5: saved mid-iteration), or 0
    # (a rank the saved run did not have). The data resumes at an iteration start: 0 in every case.
    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        self.step = saved_step
        return "loaded"

    monkeypatch.setattr(Accelerator, "load_state", load_state)
    accelerator.gradient_accumulation_steps = 3
    accelerator._micro_steps_in_iteration = 2
    assert accelerator.load_state("checkpoint") == "loaded"
    assert (accelerator.step, accelerator._micro_steps_in_iteration) == (0, 0)
    assert accelerator.gradient_accumulation_steps == 3


def _settled(accelerator, counts: list[int]) -> None:
    """`accelerator` as a first prepare leaves it, on a plan of micro-batch 2 and `counts` (rank 0 is this process)."""
    ranks = [
        {"rank": r, "device_type": "cpu", "micro_batch_size": 2, "gradient_accumulation_steps": s}
        for r, s in enumerate(counts)
    ]
    plan = {
        "schema_version": 1,
        "policy": "poplar",
        "zero_stage": 1,
        "global_batch_size": 2 * sum(counts),
        "ranks": ranks,
        "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
        "profile_fingerprints": {},
    }
    accelerator.job = SimpleNamespace(
        plan=plan_from_dict(plan, source="test"),
        rank=0,
        poplar_config=poplar_config_from_dict({"plan": "plan.json"}, base_dir=Path(".")),
        ds_config={**CONFIG, "train_batch_size": 2 * sum(counts)},
        source="test",
    )
    accelerator.gradient_accumulation_steps = counts[0]


@pytest.fixture
def backwards(monkeypatch):
    """The losses accelerate's backward was given (it would call DeepSpeed's engine)."""
    given: list[float] = []
    monkeypatch.setattr(Accelerator, "backward", lambda self, loss, **kwargs: given.append(float(loss)))
    return given


@pytest.mark.parametrize("counts", [[2, 1], [1, 3]])
def test_a_backward_outside_accumulate_is_refused_when_any_rank_accumulates(accelerator, backwards, counts):
    # accelerate's nlp_example loop: sync_gradients stays True, so each micro-batch would be an optimizer step.
    # Refused on a rank of count 1 too ([1, 3]): its peer refuses at the same backward, before any collective.
    _settled(accelerator, counts)
    with pytest.raises(ValueError) as refused:
        accelerator.backward(torch.tensor(1.0))
    message = str(refused.value)
    assert message.startswith("PoplarAccelerator.backward: expected each micro-batch's backward inside `with ")
    assert f"accumulation counts above 1 (counts by rank: {counts})" in message
    assert "Wrap the forward, accelerator.backward" in message and "accelerator.accumulate(model)" in message
    assert backwards == []


def test_backward_inside_accumulate_once_per_block(accelerator, backwards):
    _settled(accelerator, [2, 1])
    for loss in (1.0, 2.0, 3.0):
        with accelerator.accumulate():
            accelerator.backward(torch.tensor(loss))
    assert backwards == [1.0, 2.0, 3.0]
    assert accelerator.step == 3 and accelerator.sync_gradients is False  # 3 micro-steps of count 2
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(4.0))
        with pytest.raises(ValueError, match="found a backward without accumulate\\(\\) since the previous one"):
            accelerator.backward(torch.tensor(5.0))
    assert backwards == [1.0, 2.0, 3.0, 4.0]


def test_a_plan_without_accumulation_needs_no_accumulate(accelerator, backwards):
    _settled(accelerator, [1, 1])
    accelerator.backward(torch.tensor(1.0))
    accelerator.backward(torch.tensor(2.0))
    assert backwards == [1.0, 2.0]


def test_the_refusal_ends_a_restarting_launchers_job(monkeypatch, accelerator, backwards):
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    _settled(accelerator, [2, 2])
    with pytest.raises(ValueError, match="accumulate") as refused:
        accelerator.backward(torch.tensor(1.0))
    assert ended == [refused.value]


def test_free_memory_forgets_the_last_prepare_s_training_state(accelerator):
    # accelerate's find_executable_batch_size / a second training phase: free_memory(), then prepare again. The next
    # prepare's first DataLoader is the training one again (planned), and accumulate() counts the job's plan.
    _settled(accelerator, [2, 1])
    accelerator._train_loader = accelerator._prepared_train_loader = accelerator._train_sampler = object()
    accelerator.poplar_engine, accelerator._model = object(), object()
    accelerator._iteration_tokens[0] = [3, 4]
    accelerator._micro_steps_in_iteration, accelerator._accumulated_since_backward = 1, True
    accelerator.gradient_accumulation_steps = 4  # a re-balanced plan's count
    accelerator.free_memory()
    assert (accelerator._train_loader, accelerator._prepared_train_loader, accelerator._train_sampler) == (None,) * 3
    assert (accelerator.poplar_engine, accelerator._model, accelerator._iteration_tokens) == (None, None, {})
    assert (accelerator._micro_steps_in_iteration, accelerator._accumulated_since_backward, accelerator.step) == (
        0,
        False,
        0,
    )
    assert accelerator.gradient_accumulation_steps == 2
    assert accelerator.state.deepspeed_plugin.deepspeed_config["train_batch_size"] == 2 * 2 * 2  # b_r x s_r x W
    assert accelerator.plan is accelerator.job.plan


def test_the_planned_dataloader_keeps_the_loaders_generator_and_worker_settings(accelerator):
    # The generator seeds the workers' base seed (random augmentation in workers): a rebuilt loader without it
    # would draw another seed from the global RNG than the user's loader.
    _settled(accelerator, [2, 1])
    generator = torch.Generator().manual_seed(7)
    loader = torch.utils.data.DataLoader(
        list(range(12)), batch_size=2, shuffle=True, generator=generator, num_workers=1, prefetch_factor=3
    )
    planned = accelerator._plan_dataloader(loader)
    assert planned.generator is generator
    assert (planned.num_workers, planned.prefetch_factor) == (1, 3)


@pytest.mark.parametrize(
    ("loader_options", "words"),
    [
        ({"shuffle": False}, "shuffle=False by poplar.shuffle true"),
        ({"shuffle": True, "drop_last": True}, "drop_last=True by poplar.drop_last false"),
        ({"batch_sampler": [[0, 1], [2, 3]]}, "batch_sampler list (poplar.shuffle true)"),
        ({"sampler": torch.utils.data.SubsetRandomSampler(range(8))}, "sampler SubsetRandomSampler (poplar.shuffle"),
    ],
)
def test_a_training_dataloader_order_the_plan_replaces_is_warned_of(accelerator, caplog, loader_options, words):
    # The Trainer refuses such arguments; accelerate's DataLoader defaults to shuffle=False, so here it is a warning.
    _settled(accelerator, [2])
    options = {"batch_size": 2, **loader_options}
    if "batch_sampler" in options:
        options.pop("batch_size")
    loader = torch.utils.data.DataLoader(list(range(8)), **options)
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        accelerator._plan_dataloader(loader)
    assert f"PoplarAccelerator: the plan's sampler replaces the training DataLoader's {words}" in caplog.text, (
        caplog.text
    )
    caplog.clear()
    accelerator.poplar_engine = None
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        accelerator._plan_dataloader(torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True))
    assert "DataLoader's" not in caplog.text


class _DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed 0.19.8's batch setters and training ``deepspeed_io`` on the engine accelerate builds: an equal
    share of the data per rank in batches of the rank's micro-batch, a new global batch changing this rank's
    accumulation count alone."""

    def __init__(self, micro_batch_size: int, gas: int, world_size: int) -> None:
        super().__init__()
        self.micro_batch_size, self.gas, self.world_size = micro_batch_size, gas, world_size
        self.micro_steps = self.global_steps = self.global_rank = 0
        self._config = SimpleNamespace(train_batch_size=0)
        self.device = torch.device("cpu")

    def set_train_batch_size(self, train_batch_size: int) -> None:
        self.gas = train_batch_size // (self.micro_batch_size * self.world_size)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        self.micro_batch_size = micro_batch_size

    def deepspeed_io(self, dataset, batch_size=None, route="train", data_sampler=None, **kwargs):
        sampler = data_sampler or torch.utils.data.DistributedSampler(dataset, num_replicas=self.world_size, rank=0)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size or self.micro_batch_size, sampler=sampler)


def test_the_deepspeed_engine_prepare_returns_answers_as_the_plan_does(monkeypatch, accelerator):
    # The script's `model` is DeepSpeed's engine, not the PoplarEngine: on a plan of micro-batches 2 x 3 and 2 x 1,
    # model.set_train_batch_size(24) made DeepSpeed accumulate 6 on rank 0 while accumulate() and the loss weights
    # kept 3, and model.deepspeed_io(data) gave DeepSpeed's even split (10 of 20 samples, every rank alike), silently.
    import poplar_ext.integrations.accelerate as integration
    from poplar_ext.zero.engine import PoplarEngine

    _settled(accelerator, [3, 1])
    raw = _DeepSpeedEngine(micro_batch_size=2, gas=3, world_size=2)

    def build(self, *args):
        self.deepspeed_engine_wrapped = SimpleNamespace(engine=raw)
        self._models.append(raw)
        return (raw,)

    monkeypatch.setattr(Accelerator, "_prepare_deepspeed", build)
    monkeypatch.setattr(integration, "check_job_optimizer_offloads", lambda *args, **kwargs: None)
    monkeypatch.setattr(integration, "set_up_rank", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(integration, "undo_initial_zero_step", lambda engine: None)
    job = accelerator.job
    monkeypatch.setattr(
        integration,
        "wrap_built_engine",
        lambda job, engine, **kwargs: PoplarEngine(
            engine, plan=job.plan, rank=0, poplar_config=job.poplar_config, device_label="cpu (real)", slowdown=None
        ),
    )
    (model,) = accelerator._prepare_deepspeed(torch.nn.Linear(2, 1))
    assert model is raw
    with pytest.raises(ValueError, match=r"^set_train_batch_size: expected the plan's global batch \(8\), found 24"):
        model.set_train_batch_size(24)
    with pytest.raises(ValueError, match=r"^set_train_micro_batch_size: expected this rank's micro-batch in the plan"):
        model.set_train_micro_batch_size(4)
    model.set_train_batch_size(8)  # the plan's: nothing to change
    assert (raw.micro_batch_size, raw.gas) == (2, 3)
    data = torch.utils.data.TensorDataset(torch.arange(20))
    batches = [batch[0].tolist() for batch in model.deepspeed_io(data)]
    assert [len(b) for b in batches] == [2] * 9  # 3 iterations of 3 micro-batches: 6 of each 8 samples are rank 0's
    assert len(set(sum(batches[:6], []))) == 12  # the first epoch's 2 whole iterations: no sample twice
    assert [len(b[0]) for b in model.deepspeed_io(data, batch_size=5, route="eval")] == [5, 5]  # DeepSpeed's own
    # A plan switch (re-balancing, a resume under another plan) still sets DeepSpeed's own batch.
    other = plan_from_dict(
        {
            **plan_to_dict(job.plan),
            "ranks": [{**r, "gradient_accumulation_steps": 2} for r in plan_to_dict(job.plan)["ranks"]],
        },
        source="test",
    )
    accelerator.poplar_engine.switch_plan(other, reason="test")
    assert (raw.micro_batch_size, raw.gas) == (2, 2)
    assert accelerator.gradient_accumulation_steps == 2


@pytest.fixture
def saves(monkeypatch):
    """The folders accelerate's save_state was given (it would call DeepSpeed's engine)."""
    given: list[str] = []
    monkeypatch.setattr(Accelerator, "save_state", lambda self, output_dir=None, **kwargs: given.append(output_dir))
    return given


def test_a_save_between_optimizer_steps_is_refused_when_ranks_accumulate_differently(
    monkeypatch, accelerator, backwards, saves
):
    # accelerate's examples (checkpointing.py) save every N batches: with counts 2, 3 and 1 and N = 2, rank 1 called
    # save_state after 2 of its 3 micro-batches while ranks 0 and 2 waited in the gradient reduction: the job hung
    # until it was killed, without a word.
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    _settled(accelerator, [3, 2, 1])
    for loss in (1.0, 2.0):
        with accelerator.accumulate():
            accelerator.backward(torch.tensor(loss))
    with pytest.raises(ValueError) as refused:
        accelerator.save_state("step_2")
    message = str(refused.value)
    assert message.startswith("PoplarAccelerator.save_state: expected a call at an optimizer step")
    assert "(counts by rank: [3, 2, 1]); found one after micro-batch 2 of this rank's 3" in message
    assert "`if accelerator.sync_gradients:`" in message
    assert saves == [] and ended == [refused.value]
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(3.0))
    assert accelerator.sync_gradients
    accelerator.save_state("step_1")  # at the optimizer step: every rank is at its own
    assert saves == ["step_1"]


def test_a_save_mid_iteration_is_fine_where_every_rank_accumulates_alike(accelerator, backwards, saves):
    _settled(accelerator, [2, 2])
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(1.0))
    assert not accelerator.sync_gradients
    accelerator.save_state("mid")  # every rank at the same micro-batch: the data resumes at the iteration start
    assert saves == ["mid"]


@pytest.fixture
def collectives(monkeypatch):
    """The calls of accelerate's gather and reduce (they would need a process group)."""
    called: list[str] = []
    monkeypatch.setattr(Accelerator, "gather", lambda self, tensor: called.append("gather") or tensor)
    monkeypatch.setattr(
        Accelerator, "reduce", lambda self, tensor, reduction="sum", scale=1.0: called.append("reduce") or tensor
    )
    return called


@pytest.mark.parametrize("call", ["gather", "reduce"])
def test_a_collective_between_optimizer_steps_is_refused_when_ranks_accumulate_differently(
    monkeypatch, accelerator, backwards, collectives, call
):
    # diffusers' train_text_to_image.py gathers the loss inside accumulate() on every micro-batch: with counts 2, 3
    # and 1 (accelerate launch, 3 ranks, ZeRO-1) rank 1 aborted in gloo (exit code -6) and rank 0 ended with
    # "Connection reset by peer", before any optimizer step, without a word of why.
    import poplar_ext.elastic as elastic

    ended: list[BaseException] = []
    monkeypatch.setattr(elastic, "end_restarting_launcher", ended.append)
    _settled(accelerator, [2, 3, 1])
    with accelerator.accumulate():
        with pytest.raises(ValueError) as refused:
            getattr(accelerator, call)(torch.tensor([1.0]))
        accelerator.backward(torch.tensor(1.0))
    message = str(refused.value)
    assert message.startswith(f"PoplarAccelerator.{call}: expected a call at an optimizer step")
    assert "(counts by rank: [2, 3, 1]); found one at micro-batch 1 of this rank's 2" in message
    assert "under `if accelerator.sync_gradients:`" in message
    assert collectives == [] and ended == [refused.value]
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(2.0))
    assert accelerator.sync_gradients
    getattr(accelerator, call)(torch.tensor([1.0]))  # at the optimizer step: every rank is at its own
    assert collectives == [call]


@pytest.mark.parametrize("call", ["wait_for_everyone", "pad_across_processes"])
def test_a_barrier_or_padding_between_optimizer_steps_is_refused_when_ranks_accumulate_differently(
    monkeypatch, accelerator, backwards, call
):
    # accelerate's barrier and pad_across_processes (which gathers every rank's sizes) are collectives too: inside
    # accumulate() on counts 2, 3 and 1 they met other micro-batches' calls or the gradient reduction.
    import poplar_ext.elastic as elastic

    called: list[str] = []
    monkeypatch.setattr(Accelerator, "wait_for_everyone", lambda self: called.append("wait_for_everyone"))
    monkeypatch.setattr(
        Accelerator, "pad_across_processes", lambda self, tensor, **kwargs: called.append(call) or tensor
    )
    monkeypatch.setattr(elastic, "end_restarting_launcher", lambda error: None)
    arguments = () if call == "wait_for_everyone" else (torch.tensor([1.0]),)
    _settled(accelerator, [2, 3, 1])
    with accelerator.accumulate():
        with pytest.raises(ValueError, match=rf"^PoplarAccelerator\.{call}: expected a call at an optimizer step"):
            getattr(accelerator, call)(*arguments)
        accelerator.backward(torch.tensor(1.0))
    assert called == []
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(2.0))
    getattr(accelerator, call)(*arguments)  # at the optimizer step
    assert called == [call]


def test_collectives_on_every_micro_batch_are_fine_where_every_rank_accumulates_alike(
    accelerator, backwards, collectives
):
    _settled(accelerator, [2, 2])
    with accelerator.accumulate():
        accelerator.gather(torch.tensor([1.0]))
        accelerator.reduce(torch.tensor([1.0]))
        accelerator.backward(torch.tensor(1.0))
    assert not accelerator.sync_gradients and collectives == ["gather", "reduce"]


def test_gather_for_metrics_of_objects_between_optimizer_steps_is_refused_too(
    monkeypatch, accelerator, backwards, collectives
):
    # gather_for_metrics of objects (strings, lists of ids) goes to accelerate's gather_object, past `gather`: inside
    # accumulate() on uneven counts it started its collective on every micro-batch while docs/accelerate.md says
    # gather_for_metrics is refused there, as a tensor's is.
    import accelerate.accelerator as accelerate_module

    import poplar_ext.elastic as elastic

    gathered: list = []
    monkeypatch.setattr(accelerate_module, "gather_object", lambda data: gathered.append(data) or data)
    monkeypatch.setattr(elastic, "end_restarting_launcher", lambda error: None)
    _settled(accelerator, [2, 3, 1])
    with accelerator.accumulate():
        with pytest.raises(ValueError) as refused:
            accelerator.gather_for_metrics(["a sample's text"])
        accelerator.backward(torch.tensor(1.0))
    assert str(refused.value).startswith("PoplarAccelerator.gather_for_metrics: expected a call at an optimizer step")
    assert "(counts by rank: [2, 3, 1]); found one at micro-batch 1 of this rank's 2" in str(refused.value)
    assert gathered == [] and collectives == []
    with pytest.raises(ValueError, match=r"^PoplarAccelerator\.gather: expected a call at an optimizer step"):
        accelerator.gather_for_metrics(torch.tensor([1.0]))  # a tensor's: refused by gather, as before
    with accelerator.accumulate():
        accelerator.backward(torch.tensor(2.0))
    assert accelerator.sync_gradients
    assert accelerator.gather_for_metrics(["a sample's text"]) == ["a sample's text"]  # at the optimizer step
    assert gathered == [["a sample's text"]]


def test_skip_first_batches_of_the_training_dataloader_without_load_state_is_warned_of(accelerator, caplog):
    # A script resuming by its own means (weights loaded without load_state) called skip_first_batches(loader, 4):
    # the loader was returned as it was, and only an INFO line, which said it "already continues where load_state
    # left the data", told of it: the skipped batches were trained again.
    _settled(accelerator, [2, 1])
    loader = accelerator._plan_dataloader(torch.utils.data.DataLoader(list(range(12)), batch_size=2, shuffle=True))
    accelerator._prepared_train_loader = loader
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        assert accelerator.skip_first_batches(loader, 4) is loader
    assert "skip_first_batches(4): the training dataloader is not skipped: no load_state ran since prepare" in (
        caplog.text
    )
    assert "it continues at stream position 0" in caplog.text
    caplog.clear()
    accelerator._data_position_loaded = True  # what load_state sets
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        assert accelerator.skip_first_batches(loader, 4) is loader
    assert caplog.text == ""


def test_load_state_marks_the_training_data_moved(monkeypatch, accelerator):
    monkeypatch.setattr(Accelerator, "load_state", lambda self, input_dir=None, **kwargs: None)
    assert not accelerator._data_position_loaded
    accelerator.load_state("checkpoint")
    assert accelerator._data_position_loaded
    accelerator.free_memory()
    assert not accelerator._data_position_loaded


def test_a_scheduler_prepared_without_the_model_is_warned_of_where_ranks_accumulate_differently(
    monkeypatch, accelerator, caplog
):
    # accelerate wraps a scheduler under DeepSpeed only when the model is in the same prepare call: prepared alone it
    # stayed a LambdaLR, stepped on every micro-batch inside accumulate(). With counts 2, 3 and 1 the three ranks had
    # stepped it 8, 12 and 4 times after 4 optimizer steps (learning rates 0.0078, 0.01 and 0.0044 at step 3), each
    # updating its ZeRO-1 partition at its own rate, without a word.
    monkeypatch.setattr(Accelerator, "_prepare_deepspeed", lambda self, *args: args)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _settled(accelerator, [2, 3, 1])
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        assert accelerator._prepare_deepspeed(scheduler) == (scheduler,)
    assert "PoplarAccelerator: the LR scheduler LambdaLR was prepared without the model" in caplog.text
    assert "(counts by rank: [2, 3, 1])" in caplog.text and "`if accelerator.sync_gradients:`" in caplog.text
    caplog.clear()
    _settled(accelerator, [2, 2, 2])  # every rank steps it alike, as with a plain Accelerator
    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        accelerator._prepare_deepspeed(scheduler)
    assert caplog.text == ""


def test_an_evaluation_dataloader_passed_before_a_shuffling_one_is_warned_of(caplog):
    # prepare(model, optimizer, eval_dl, train_dl) took eval_dl (shuffle=False) as the training DataLoader, as
    # documented, and left train_dl to accelerate's even split: with counts 2, 3 and 1 the job hung at the first
    # optimizer step (3 ranks, killed after 300 s), its only hints the global batch and shuffle warnings.
    from poplar_ext.integrations.accelerate import _warn_of_a_later_shuffling_loader

    def loader(shuffle):
        return torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=shuffle)

    with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
        _warn_of_a_later_shuffling_loader([loader(False), loader(True)])
    assert "prepare takes its first DataLoader, which reads in order, as the training one, yet its DataLoader " in (
        caplog.text
    )
    assert "number 2 shuffles: if that one trains, pass it to prepare first" in caplog.text
    for quiet in ([loader(True), loader(False)], [loader(False), loader(False)], [loader(False)]):
        caplog.clear()
        with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
            _warn_of_a_later_shuffling_loader(quiet)
        assert caplog.text == ""


def _masking_collate(items: list[dict]) -> dict:
    """A collate_fn that draws random numbers, as an MLM collator's masking does: each label kept with p 0.5."""
    ids = torch.tensor([item["input_ids"] for item in items])
    labels = torch.where(torch.rand(ids.shape) < 0.5, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def test_token_mean_counts_the_micro_batches_it_hands_out_under_a_random_collate_fn(accelerator):
    # The label tokens of an iteration are counted before its first backward; a second collate of its micro-batches
    # for the count would draw other masks than the batches trained, and weight them by another count.
    _settled(accelerator, [2])
    accelerator.job.poplar_config = poplar_config_from_dict(
        {"plan": "plan.json", "loss_reduction": "token_mean"}, base_dir=Path(".")
    )
    data = [{"input_ids": list(range(i, i + 6))} for i in range(8)]
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True, collate_fn=_masking_collate)
    torch.manual_seed(0)
    trained = [int(batch["labels"].ne(-100).sum()) for batch in accelerator._plan_dataloader(loader)]
    assert len(trained) == 4  # two iterations of 2 micro-batches of 2
    assert accelerator._iteration_tokens == {0: trained[:2], 4: trained[2:]}
    # A pass left inside an iteration: the micro-batch it collated and did not hand out is not the next pass's.
    accelerator._iteration_tokens.clear()
    planned = accelerator._plan_dataloader(loader)
    next(iter(planned))
    rest = [int(batch["labels"].ne(-100).sum()) for batch in planned]
    assert accelerator._iteration_tokens[4] == rest
    # That loader planned again (prepared again after free_memory), once left inside an iteration.
    accelerator._iteration_tokens.clear()
    planned = accelerator._plan_dataloader(loader)
    next(iter(planned))
    again = accelerator._plan_dataloader(planned)
    batches = list(again)
    trained = [int(batch["labels"].ne(-100).sum()) for batch in batches]
    assert accelerator._iteration_tokens == {0: trained[:2], 4: trained[2:]}
    assert sorted(int(first) for batch in batches for first in batch["input_ids"][:, 0]) == list(range(8))


def test_a_first_dataloader_with_a_sampler_of_its_own_is_not_said_to_read_in_order(caplog):
    # A training DataLoader over a SubsetRandomSampler, or a shuffling batch sampler of the script's own, passed
    # first beside a shuffled evaluation one: rank 0 warned that the first one "reads in order".
    from poplar_ext.integrations.accelerate import _warn_of_a_later_shuffling_loader

    data = list(range(8))
    subset = torch.utils.data.DataLoader(data, batch_size=2, sampler=torch.utils.data.SubsetRandomSampler(range(8)))
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), batch_size=2, drop_last=False)
    own_batches = torch.utils.data.DataLoader(data, batch_sampler=_OwnBatches(batches))
    for first in (subset, own_batches):
        caplog.clear()
        with caplog.at_level("WARNING", logger="poplar_ext.integrations.accelerate"):
            _warn_of_a_later_shuffling_loader([first, torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)])
        assert caplog.text == ""


class _OwnBatches:
    """A script's batch sampler (a length-grouped one, say): not torch's ``BatchSampler``."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)
