"""The engine proxy against a stand-in DeepSpeed engine: weighting, counting, logging, checkpoints."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from poplar_ext.hardware.emulation import ComputeSlowdown
from poplar_ext.plan.formats import Cluster, ClusterNode, DeviceGroup, Emulation, plan_from_dict, plan_to_dict
from poplar_ext.runtime.checkpoint import STATE_FILE
from poplar_ext.runtime.config import RebalanceConfig, poplar_config_from_dict
from poplar_ext.runtime.rebalance import DriftMonitor, Rebalancer
from poplar_ext.zero.engine import PoplarEngine


def _plan(allocation, stage=1):
    return plan_from_dict(
        {
            "schema_version": 1,
            "policy": "poplar",
            "zero_stage": stage,
            "global_batch_size": sum(b * s for b, s in allocation),
            "ranks": [
                {"rank": r, "device_type": "x", "micro_batch_size": b, "gradient_accumulation_steps": s}
                for r, (b, s) in enumerate(allocation)
            ],
            "predicted": {"iteration_time_s": 1.0, "samples_per_s": 1.0, "ideal_samples_per_s": 1.0},
            "profile_fingerprints": {},
        }
    )


def write_model_states(save_dir, tag, name="mp_rank_00_model_states.pt"):
    """The file by which DeepSpeed finds a checkpoint (poplar-ext checks it is there before loading), or `name`."""
    folder = Path(save_dir) / tag
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).touch()


class FakeDeepSpeedEngine:
    """Records what the proxy passes on; accumulation boundary every `gas` micro-steps."""

    def __init__(self, gas):
        self.gas, self.micro_steps, self.global_steps = gas, 0, 0
        self.backward_calls, self.saved, self.events = [], None, []
        self.some_attribute = "from deepspeed"
        self.local_rank = self.global_rank = 0
        self.device = torch.device("cpu")

    def use_node_local_storage(self):
        return False

    def __call__(self, x):
        return x.sum()

    def backward(self, loss, **kwargs):
        self.backward_calls.append((float(loss), kwargs))
        self.allreduce_gradients()  # as DeepSpeed's backward epilogue does

    def allreduce_gradients(self):
        self.events.append("reduce")

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def step(self):
        self.events.append("step")
        if self.is_gradient_accumulation_boundary():
            self.global_steps += 1
        self.micro_steps += 1

    def save_checkpoint(self, save_dir, tag=None, client_state=None, **kwargs):
        write_model_states(save_dir, tag)
        self.saved = client_state
        self.events.append(("save", kwargs))

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        return ("path/to/ckpt", dict(self.saved)) if self.saved is not None else (None, None)


def _engine(plan, rank=0, slowdown=None, rebalancer=None, **poplar):
    config = poplar_config_from_dict(
        {"cluster": "c.json", "plan": "p.json", **poplar}, base_dir=__import__("pathlib").Path(".")
    )
    fake = FakeDeepSpeedEngine(plan.ranks[rank].gradient_accumulation_steps)
    return PoplarEngine(
        fake,
        plan=plan,
        rank=rank,
        poplar_config=config,
        device_label="x (real)",
        slowdown=slowdown,
        rebalancer=rebalancer,
    ), fake


def test_backward_weights_the_loss_and_disables_deepspeeds_scaling():
    engine, fake = _engine(_plan([(3, 2), (1, 3)]), rank=0)  # W=2, b=3, B=9
    engine.backward(torch.tensor(1.5))
    assert fake.backward_calls == [(pytest.approx(1.5 * 2 * 3 / 9), {"scale_wrt_gas": False})]


@pytest.mark.parametrize("log_notes", [True, False])
def test_continue_from_logs_the_decisions_notes_unless_the_caller_did(caplog, log_notes):
    from poplar_ext.runtime.checkpoint import ResumeDecision

    engine, _ = _engine(_plan([(3, 2), (1, 3)]), rank=0)
    decision = ResumeDecision(data_position=9, consumed_samples=9, notes=["the saved plan differs"])
    with caplog.at_level("INFO", logger="poplar_ext"):
        engine.continue_from(decision, log_notes=log_notes)
    assert ("load_checkpoint: the saved plan differs" in caplog.text) == log_notes
    assert engine.consumed_samples == 9


class _LossScaleConfig:
    def __init__(self, use_grad_scaling, cur_scale):
        self.use_grad_scaling, self.cur_scale = use_grad_scaling, cur_scale


class _FP16UnfusedOptimizer:
    """Stands in for DeepSpeed's FP16_(Unfused)Optimizer (fp16 at ZeRO 0): its step divides by the loss scale."""

    def __init__(self, use_grad_scaling=True, cur_scale=256.0):
        self.loss_scale_config = _LossScaleConfig(use_grad_scaling, cur_scale)


def test_fp16_at_zero_0_puts_in_the_loss_scale_deepspeeds_backward_leaves_out():
    # DeepSpeed 0.19.8's backward scales the loss for ZeRO optimizers only; FP16_UnfusedOptimizer.step then
    # divides by the scale: without it every update was the loss scale (256 here, 65536 by default) times too small.
    engine, fake = _engine(_plan([(3, 2), (1, 3)], stage=0), rank=0)  # W=2, b=3, B=9
    fake.fp16_enabled = lambda: True
    fake.optimizer = _FP16UnfusedOptimizer(cur_scale=256.0)
    engine.backward(torch.tensor(1.5))
    assert fake.backward_calls == [(pytest.approx(1.5 * 2 * 3 / 9 * 256.0), {"scale_wrt_gas": False})]


def test_no_loss_scale_is_added_without_fp16_or_where_deepspeed_applies_it():
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    class _ZeroOptimizer(ZeROOptimizer, _FP16UnfusedOptimizer):
        def __init__(self):  # ZeROOptimizer.__init__ calls no other: the loss scale config is set here
            _FP16UnfusedOptimizer.__init__(self)

    for fp16, optimizer in [
        (False, _FP16UnfusedOptimizer()),  # bf16 or fp32
        (True, _FP16UnfusedOptimizer(use_grad_scaling=False)),
        (True, _ZeroOptimizer()),  # ZeRO 1-3: DeepSpeed's backward scales the loss itself
    ]:
        engine, fake = _engine(_plan([(3, 2), (1, 3)], stage=0), rank=0)
        fake.fp16_enabled = lambda fp16=fp16: fp16
        fake.optimizer = optimizer
        engine.backward(torch.tensor(1.5))
        assert fake.backward_calls == [(pytest.approx(1.5 * 2 * 3 / 9), {"scale_wrt_gas": False})]


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this one process (no process started), which DeepSpeed's fp16 optimizers ask for."""
    import datetime

    import deepspeed.comm.comm as comm
    import torch.distributed as dist

    class _TorchDistributed:  # deepspeed.comm over this group; its own backend builds ops (a compiler process)
        def is_initialized(self):
            return True

        def __getattr__(self, name):
            return getattr(dist, name)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    timeout = datetime.timedelta(minutes=5)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    previous, comm.cdb = comm.cdb, _TorchDistributed()
    yield
    comm.cdb = previous
    dist.destroy_process_group()


def test_the_groups_deepspeed_made_for_the_engine_time_out_as_the_job_does(one_rank_group):
    # DeepSpeed makes its data-parallel group (every gradient reduction) without a timeout: torch gave it 30 minutes
    # on gloo, the job's 5 ignored, so the ranks left by one that stopped answering waited in it for 30 minutes.
    import datetime

    import torch.distributed as dist

    def timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout

    made_by_deepspeed = dist.new_group([0])
    own = dist.new_group([0], timeout=datetime.timedelta(minutes=45))  # a timeout of its own stays
    _engine(_plan([(2, 1)]))
    assert timeout(made_by_deepspeed) == datetime.timedelta(minutes=5)
    assert timeout(own) == datetime.timedelta(minutes=45)


def test_fp16_at_zero_0_starts_the_optimizer_as_torch_does(one_rank_group):
    # DeepSpeed's FP16_UnfusedOptimizer (fp16 at ZeRO 0) steps the user's optimizer on zero gradients when built:
    # AdamW then decayed every master weight by lr x weight_decay and counted a step, so that a 3-rank fp16 job
    # at ZeRO 0 ended 1.5e-2 away from one fp32 process (1.1e-3 at ZeRO 1), its first update another size.
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from poplar_ext.runtime.engine_core import undo_initial_zero_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    model.half()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    optimizer = FP16_UnfusedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
    engine = type("Engine", (), {"optimizer": optimizer})()
    assert undo_initial_zero_step(engine)
    with torch.no_grad():  # the same start: the reference at the fp16 weights
        for low, high in zip(model.parameters(), reference.parameters()):
            high.copy_(low.float())
    for low, high in zip(model.parameters(), reference.parameters()):
        grad = torch.full_like(high, 0.25)
        high.grad, low.grad = grad, grad.half()
    reference_optimizer.step()
    optimizer.step()
    for master, high in zip(optimizer.fp32_groups[0], reference.parameters()):
        assert torch.allclose(master, high, atol=1e-6), (master, high)
    assert [s["step"] for s in optimizer.optimizer.state.values()] == [1.0, 1.0]
    assert not undo_initial_zero_step(type("Engine", (), {"optimizer": reference_optimizer})())


def test_sum_reduced_loss_weight():
    engine, fake = _engine(_plan([(3, 2), (1, 3)]), rank=1, loss_reduction="sum")
    engine.backward(torch.tensor(1.0))
    assert fake.backward_calls[0][0] == pytest.approx(2 / 9)


def test_backward_refuses_scale_wrt_gas():
    engine, _ = _engine(_plan([(2, 1)]))
    with pytest.raises(ValueError, match="backward: scale_wrt_gas is set by poplar_ext"):
        engine.backward(torch.tensor(1.0), scale_wrt_gas=True)


def test_steps_count_true_samples_and_log_them(caplog):
    engine, _ = _engine(_plan([(3, 2), (1, 3)]), log_interval_steps=2)
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        for _ in range(3 * 2):  # three iterations of rank 0's two micro-steps
            engine.backward(engine(torch.ones(3)))
            engine.step()
    assert engine.consumed_samples == 27
    assert engine.train_batch_size() == 9
    lines = [r.getMessage() for r in caplog.records if "poplar step" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("poplar step 2: true global batch 9 samples,")
    assert "x (real), micro-batch 3 x 2" in lines[0]
    assert engine.last_samples_per_s == pytest.approx(9 / engine.last_iteration_time_s)


def test_everything_else_is_deepspeeds():
    engine, _ = _engine(_plan([(2, 1)]))
    assert engine.some_attribute == "from deepspeed"
    with pytest.raises(AttributeError):
        _ = engine.no_such_attribute


def _one_second_of_compute_per_reading(monkeypatch, emulation):
    """Each reading of the clocks is 1 s later in CPU time and in wall time (a core to itself)."""
    seconds = {"now": -1.0}

    def thread_time():
        seconds["now"] += 1.0
        return seconds["now"]

    monkeypatch.setattr(emulation.time, "thread_time", thread_time)
    monkeypatch.setattr(emulation.time, "perf_counter", lambda: seconds["now"])


def test_emulated_window_sleeps_before_the_gradient_reduction(monkeypatch):
    from poplar_ext.hardware import emulation

    _one_second_of_compute_per_reading(monkeypatch, emulation)
    slowdown = ComputeSlowdown(Emulation(slowdown=3.0, memory_capacity_bytes=1))
    engine, fake = _engine(_plan([(2, 1)]), slowdown=slowdown)
    monkeypatch.setattr(emulation.time, "sleep", lambda s: fake.events.append(f"sleep {s:g}"))
    engine.backward(engine(torch.ones(2)))  # forward starts the window at 0, the reduction ends it at 1
    engine.step()  # a boundary: the optimizer step is emulated compute too (2 to 3 on the clock)
    assert fake.events == ["sleep 2", "reduce", "step", "sleep 2"]
    assert not slowdown.running
    assert engine.emulated_compute is slowdown


def test_ordinary_micro_step_leaves_the_optimizer_step_alone(monkeypatch):
    from poplar_ext.hardware import emulation

    _one_second_of_compute_per_reading(monkeypatch, emulation)
    slowdown = ComputeSlowdown(Emulation(slowdown=3.0, memory_capacity_bytes=1))
    engine, fake = _engine(_plan([(2, 2)]), slowdown=slowdown)
    monkeypatch.setattr(emulation.time, "sleep", lambda s: fake.events.append(f"sleep {s:g}"))
    engine.backward(engine(torch.ones(2)))
    engine.step()  # not a boundary (2 accumulation steps): no emulated window around it
    assert fake.events == ["sleep 2", "reduce", "step"]


def test_real_device_has_no_emulated_compute():
    engine, _ = _engine(_plan([(2, 1)]))
    assert engine.emulated_compute is None


def test_checkpoint_keeps_plan_and_position(tmp_path):
    plan = _plan([(3, 2), (1, 3)])
    engine, fake = _engine(plan)
    for _ in range(4):
        engine.backward(engine(torch.ones(3)))
        engine.step()
    engine.save_checkpoint(tmp_path, tag="t", client_state={"mine": 1})
    state = json.loads((tmp_path / "t" / STATE_FILE).read_text())
    assert state["consumed_samples"] == 18 and state["data_position"] == 18 and state["plan"] == plan_to_dict(plan)
    assert [entry["reason"] for entry in state["plan_history"]] == ["the job's plan"]
    resumed, resumed_fake = _engine(plan)
    sampler = resumed.create_batch_sampler(100)
    resumed_fake.saved = fake.saved
    path, client_state = resumed.load_checkpoint(tmp_path, tag="t")
    assert client_state["mine"] == 1
    assert resumed.consumed_samples == 18 and sampler.consumed_samples == 18


def test_a_client_state_key_named_poplar_comes_back_from_a_checkpoint_with_a_state_file(tmp_path):
    plan = _plan([(2, 1)])
    engine, fake = _engine(plan)
    engine.save_checkpoint(tmp_path, tag="t", client_state={"poplar": {"mine": 1}, "other": 2})
    resumed, resumed_fake = _engine(plan)
    resumed_fake.saved = fake.saved
    path, client_state = resumed.load_checkpoint(tmp_path, tag="t")
    assert client_state == {"poplar": {"mine": 1}, "other": 2}


def test_the_saved_data_position_is_the_first_iteration_no_step_trained(tmp_path):
    engine, _ = _engine(_plan([(2, 1), (3, 2)]))  # rank 0: one micro-batch per iteration, B = 8
    handed_out = iter(engine.create_batch_sampler(50))
    next(handed_out)  # iteration 0
    # A DataLoader reading ahead (accelerate's fetches the next micro-batch before handing one out)
    # has begun iteration 1 before the step that ends iteration 0.
    next(handed_out)
    engine.backward(engine(torch.ones(2)))
    engine.step()
    assert engine.data_position == 8
    engine.save_checkpoint(tmp_path, tag="t")
    assert json.loads((tmp_path / "t" / STATE_FILE).read_text())["data_position"] == 8


def _train_a_pass(engine, sampler):
    for _ in sampler:
        engine.backward(engine(torch.ones(2)))
        engine.step()


def test_the_data_position_follows_the_sampler_that_trains_not_the_first_made(tmp_path):
    engine, _ = _engine(_plan([(2, 1), (3, 2)]))  # B = 8; 20 samples: passes of 3, 2, 3 iterations
    engine.create_batch_sampler(20)  # initialize's dataloader, never read
    starts = []
    for _ in range(3):  # a new sampler (a new DataLoader) every pass
        sampler = engine.create_batch_sampler(20)
        starts.append(sampler.consumed_samples)
        _train_a_pass(engine, sampler)
    assert starts == [0, 24, 40] and engine.data_position == engine.consumed_samples == 64
    engine.save_checkpoint(tmp_path, tag="t")
    assert json.loads((tmp_path / "t" / STATE_FILE).read_text())["data_position"] == 64


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pass_after_one_left_early_hands_out_again_what_was_read_ahead_but_not_trained(rank):
    # A loop that leaves a pass (a break every few steps) while the DataLoader has read ahead (its workers;
    # accelerate's loader always fetches the next micro-batch): rank 0, one micro-batch per iteration, had begun
    # later iterations than rank 1, and skipped them in the next pass while rank 1 did not.
    plan = _plan([(2, 1), (3, 2)])  # B = 8
    engine, _ = _engine(plan, rank=rank)
    sampler = engine.create_batch_sampler(50)  # passes of 7 iterations
    handed_out = iter(sampler)
    for _ in range(plan.ranks[rank].gradient_accumulation_steps):  # iteration 0 trained
        next(handed_out)
        engine.backward(engine(torch.ones(2)))
        engine.step()
    for _ in range(4):  # read ahead: iterations 1 and 2 (rank 1: iteration 1), then the loop leaves the pass
        next(handed_out, None)
    assert engine.data_position == 8
    again = list(sampler)
    assert again[0] == sampler.micro_batches(1)[0] and len(again) == 6 * plan.ranks[rank].gradient_accumulation_steps
    # A position the loop sets itself is kept.
    next(iter(sampler))
    sampler.set_epoch(1)
    assert next(iter(sampler)) == sampler.micro_batches(7)[0]


def test_steps_on_batches_of_the_scripts_own_take_nothing_from_the_stream(tmp_path):
    engine, _ = _engine(_plan([(2, 1), (3, 2)]))  # B = 8
    sampler = engine.create_batch_sampler(64)  # initialize's dataloader, made at start
    for _ in range(3):  # warm-up steps on batches of the script's own
        engine.backward(engine(torch.ones(2)))
        engine.step()
    handed_out = iter(sampler)
    for _ in range(2):  # two iterations from the loader
        for _ in range(engine.rank_plan.gradient_accumulation_steps):
            next(handed_out)
            engine.backward(engine(torch.ones(2)))
        engine.step()
    assert sampler.consumed_samples == engine.data_position == 16
    engine.save_checkpoint(tmp_path, tag="t")
    assert json.loads((tmp_path / "t" / STATE_FILE).read_text())["data_position"] == 16


def _read_ahead_then_switch(engine, allocation, *, iterations=2):
    """A DataLoader that has handed out `iterations` more than trained when the switch is agreed: it waits."""
    handed_out = iter(engine.create_batch_sampler(50))
    for _ in range(iterations):
        next(handed_out)
    engine.rebalance_to(_plan(allocation), reason="first")
    return handed_out


def test_a_switch_while_another_waits_for_its_iteration_is_refused():
    engine, _ = _engine(_plan([(2, 1), (3, 2)]))
    _read_ahead_then_switch(engine, [(1, 2), (3, 2)])
    assert engine.pending_switch.position == 16
    with pytest.raises(ValueError, match=r"rebalance_to: expected no plan switch pending, found one .* position 16"):
        engine.rebalance_to(_plan([(4, 1), (2, 2)]), reason="second")
    assert engine.pending_switch.reason == "first"


def test_a_plan_that_cannot_replace_the_running_one_is_refused_naming_what_it_found():
    import dataclasses

    plan = _plan([(2, 2), (3, 2)], stage=2)
    engine, _ = _engine(plan)
    other_type = dataclasses.replace(plan, ranks=(plan.ranks[0], dataclasses.replace(plan.ranks[1], device_type="y")))
    refusals = {
        r"each rank keeps its device type \(x, x\), found x, y": other_type,
        r"every rank has the same accumulation count at ZeRO stage 2, found 2, 6": _plan([(2, 2), (1, 6)], stage=2),
    }
    for message, refused in refusals.items():
        with pytest.raises(ValueError, match=r"plan: expected a plan that can replace the running one: " + message):
            engine.rebalance_to(refused)
    # A plan read as JSON but not made a Plan: before, asdict()'s "should be called on dataclass instances".
    with pytest.raises(TypeError, match=r"rebalance_to: plan: expected a ZeRO plan .*load_plan.*, found dict"):
        engine.rebalance_to(plan_to_dict(plan))
    assert engine.plan == plan and engine.pending_switch is None


def test_a_switch_pending_at_a_save_waits_again_after_the_resume(tmp_path):
    plan, switched = _plan([(2, 1), (3, 2)]), [(1, 2), (3, 2)]
    engine, fake = _engine(plan)
    _read_ahead_then_switch(engine, switched)
    engine.save_checkpoint(tmp_path, tag="t")
    resumed, resumed_fake = _engine(plan)
    before = resumed.create_batch_sampler(50)
    resumed_fake.saved = fake.saved
    resumed.load_checkpoint(tmp_path, tag="t")
    after = resumed.create_batch_sampler(50)
    assert (resumed.pending_switch.plan, resumed.pending_switch.position) == (_plan(switched), 16)
    sizes = [[[len(b) for b in s.micro_batches(i)] for i in (1, 2)] for s in (before, after)]
    assert sizes == [[[2], [1, 1]]] * 2, "iteration 1 (from 8) under the job's plan, 2 (from 16) the switched one's"


def test_a_load_into_an_engine_that_switched_since_the_save_hands_out_its_plan_from_there(tmp_path, monkeypatch):
    # A roll-back: a checkpoint saved before a switch, loaded into the engine that made it and agreed another since.
    # From the restored position the samplers hand out the plan the engine trains, and no switch of the run before the
    # load waits: the stale switch positions gave rank 0 the first plan's 2-sample micro-batch at position 8 while
    # DeepSpeed trained the switched 1 x 2 (one process against 3 ranks: parameters off by 0.04, samples twice).
    def deepspeed_batch(fake, plan, rank):  # what DeepSpeed's batch setters do to the stand-in
        fake.gas = plan.ranks[rank].gradient_accumulation_steps
        fake.micro_steps = -(-fake.micro_steps // fake.gas) * fake.gas

    monkeypatch.setattr("poplar_ext.zero.engine.set_deepspeed_batch", deepspeed_batch)
    plan, switched, later = _plan([(2, 1), (3, 2)]), _plan([(1, 2), (3, 2)]), _plan([(4, 1), (2, 2)])
    engine, _ = _engine(plan)
    sampler = engine.create_batch_sampler(50)
    handed_out = iter(sampler)

    def train_iteration():
        for _ in range(engine.rank_plan.gradient_accumulation_steps):
            next(handed_out)
            engine.backward(engine(torch.ones(2)))
            engine.step()

    train_iteration()
    engine.save_checkpoint(tmp_path, tag="t")  # at stream position 8, under the first plan
    train_iteration()
    engine.rebalance_to(switched, reason="switched at 16")
    train_iteration()
    next(handed_out)  # read ahead: the next switch waits for position 32
    engine.rebalance_to(later, reason="agreed for 32")
    assert (engine.plan, engine.pending_switch.position) == (switched, 32)
    engine.load_checkpoint(tmp_path, tag="t")
    assert engine.plan == switched and engine.pending_switch is None
    assert sampler.consumed_samples == engine.data_position == 8
    assert [[len(b) for b in sampler.micro_batches(i)] for i in (1, 2, 4)] == [[1, 1]] * 3, "the switched plan's 1 x 2"


def _watched(plan):
    """Rank 0's engine with re-balancing on: its monitor assumes each rank as fast as profiled."""
    cluster = Cluster(nodes=(ClusterNode(name="n", devices=(DeviceGroup(device_type="x", count=2),)),))
    monitor = DriftMonitor(config=RebalanceConfig(enabled=True), profiles=[], cluster=cluster)
    return _engine(plan, rebalancer=Rebalancer(monitor.config, rank=0, monitor=monitor))


def test_a_real_devices_compute_window_ends_before_the_gradient_reduction():
    # Re-balancing compares each rank's busy time with its profile, which ends a micro-step's compute at the
    # reduction: a window left open through it would count the wait for the slowest rank as this rank's compute.
    engine, fake = _watched(_plan([(2, 1), (3, 1)]))
    timer = engine.compute_timer
    assert timer is not None and engine.emulated_compute is None  # a real device, timed for re-balancing
    stop = timer.stop

    def recorded_stop():
        fake.events.append("window ends" if timer.running else "no window")
        return stop()

    timer.stop = recorded_stop
    engine.backward(engine(torch.ones(2)))
    assert fake.events[:2] == ["window ends", "reduce"]


def test_rank_0s_speed_factors_go_on_where_a_resume_continues_the_last_plan(tmp_path):
    plan = _plan([(2, 1), (3, 2)])
    engine, fake = _watched(plan)
    monitor = engine.rebalancer.monitor
    monitor.rank_scales, monitor.streaks = [4.0, 1.0], [0, 1]  # rank 0 drifted, then rank 1 once off
    engine.save_checkpoint(tmp_path, tag="t")
    for job_plan, scales, streaks in ((plan, [4.0, 1.0], [0, 1]), (_plan([(1, 2), (3, 2)]), [1.0, 1.0], [0, 0])):
        resumed, resumed_fake = _watched(job_plan)
        resumed_fake.saved = fake.saved
        resumed.load_checkpoint(tmp_path, tag="t")
        assert (resumed.rebalancer.monitor.rank_scales, resumed.rebalancer.monitor.streaks) == (scales, streaks)


def test_latest_names_a_checkpoint_only_after_every_rank_wrote_its_part(tmp_path, monkeypatch):
    from poplar_ext import collectives

    engine, fake = _engine(_plan([(3, 2), (1, 3)]))
    monkeypatch.setattr(collectives, "barrier", lambda: fake.events.append(("barrier", (tmp_path / "latest").exists())))
    # the last two collectives gather each rank's outcome (its files, the swap): they also wait for every rank
    monkeypatch.setattr(
        collectives,
        "gather_objects",
        lambda obj: fake.events.append(("gather", (tmp_path / "latest").exists())) or [obj],
    )
    engine.save_checkpoint(tmp_path, tag="t")
    saved = ("save", {"save_latest": False})
    # the first gathers the save's id from rank 0: it also waits for every rank before any writes; the next
    # three: every rank's files, every storage's state file (before any swap), every storage's swap
    assert fake.events == [("gather", False), saved, ("gather", False), ("gather", False), ("gather", True)]
    assert (tmp_path / "latest").read_text() == "t"
    fake.events.clear()
    engine.save_checkpoint(tmp_path, tag="u", save_latest=False)
    assert fake.events == [("gather", True), saved, ("gather", True), ("gather", True), ("gather", True)]
    assert (tmp_path / "latest").read_text() == "t"


def test_a_save_into_a_tag_that_fails_leaves_the_earlier_checkpoint_whole(tmp_path):
    # A re-save into a fixed tag ("last") whose DeepSpeed part fails (a peer lost): the earlier files and
    # state stay, so a restart resumes them.
    engine, fake = _engine(_plan([(2, 1)]))
    engine.save_checkpoint(tmp_path, tag="last")
    shard = tmp_path / "last" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_text("the optimizer shard of the first save")
    before = sorted(p.name for p in (tmp_path / "last").iterdir())
    state = (tmp_path / "last" / "poplar_state.json").read_text()

    def lost(*args, **kwargs):
        raise RuntimeError("a peer was lost")

    fake.save_checkpoint = lost
    with pytest.raises(RuntimeError, match="a peer was lost"):
        engine.save_checkpoint(tmp_path, tag="last")
    assert sorted(p.name for p in (tmp_path / "last").iterdir()) == before
    assert (tmp_path / "last" / "poplar_state.json").read_text() == state
    assert (tmp_path / "latest").read_text() == "last"


def test_an_asynchronous_checkpoint_writer_has_written_the_tag_before_it_takes_its_place(tmp_path):
    # DeepSpeed's decoupled writers (checkpoint.writer.decoupled, DataStates) queue the files and write them at
    # the next step's commit: by then the folder they were queued for was renamed, and the tag held none.
    engine, fake = _engine(_plan([(2, 1)]))
    queued = []

    class DecoupledWriter:
        def is_decoupled(self):
            return True

        def save(self, state_dict, path):  # DeepSpeed's writers' (this fake engine's save queues instead)
            raise AssertionError("not called")

    def queue(save_dir, tag=None, client_state=None, **kwargs):
        queued.append((save_dir, tag))

    def commit():
        while queued:
            write_model_states(*queued.pop())

    fake.checkpoint_engine, fake.save_checkpoint, fake._commit_decoupled_checkpoint = DecoupledWriter(), queue, commit
    engine.save_checkpoint(tmp_path, tag="c")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["mp_rank_00_model_states.pt", STATE_FILE]
    assert (tmp_path / "latest").read_text() == "c"


def test_a_save_into_a_tag_keeps_only_what_it_wrote(tmp_path):
    # An earlier save on more ranks, in bf16, at ZeRO 3, left files this save does not write (a load may read
    # them as its own), and a resharded copy of itself; only this save's files stay.
    engine, _ = _engine(_plan([(2, 1)]))
    folder = tmp_path / "last"
    folder.mkdir()
    for rank in range(3):
        for prefix in ("zero", "bf16_zero"):
            (folder / f"{prefix}_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("old")
        (folder / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").write_text("old")
    (tmp_path / "last_universal").mkdir()
    engine.save_checkpoint(tmp_path, tag="last")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_model_states.pt", STATE_FILE]


def _saved_then_left_between_renames(tmp_path):
    """One iteration of 3 x 2 samples saved into "last", which a save stopped between its two renames left in
    last.replaced (the earlier checkpoint, whole)."""
    engine, fake = _engine(_plan([(3, 2)]))
    for _ in range(2):
        engine.backward(engine(torch.ones(3)))
        engine.step()
    engine.save_checkpoint(tmp_path, tag="last")
    (tmp_path / "last").rename(tmp_path / "last.replaced")
    return engine, fake


def _resuming(fake):
    """A new job's engine of the same plan, whose DeepSpeed part loads what `fake` saved."""
    resumed, resumed_fake = _engine(_plan([(3, 2)]))
    resumed_fake.saved = fake.saved
    return resumed


def test_a_tag_the_storage_rank_left_between_its_renames_is_restored_and_loads(tmp_path, caplog):
    # The storage rank stopped after renaming "last" to last.replaced and before last.saving became "last":
    # last.replaced is the earlier checkpoint, whole; a load restores it with a warning and loads it.
    engine, fake = _saved_then_left_between_renames(tmp_path)
    write_model_states(tmp_path, "last.saving")  # the save that stopped: whole but not named in latest
    resumed = _resuming(fake)
    with caplog.at_level(logging.WARNING, logger="poplar_ext"):
        resumed.load_checkpoint(tmp_path)  # latest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "last.saving", "latest"]
    assert resumed.consumed_samples == 6  # one iteration of 3 x 2 samples
    assert any(
        "last.replaced holds the checkpoint a save into it was replacing" in r.getMessage() for r in caplog.records
    )


def test_a_save_into_a_tag_left_between_renames_keeps_the_earlier_checkpoint_until_its_own_is_in_place(
    tmp_path, monkeypatch
):
    # "last" was left in last.replaced (a save stopped between its renames); the next save into "last" stops
    # before its own folder takes the tag's place: the earlier checkpoint must still be there to restore.
    engine, fake = _saved_then_left_between_renames(tmp_path)
    rename = Path.rename

    def stopped(self, target):
        if self.name == "last.saving":
            raise OSError("the storage rank stopped")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped)
    with pytest.raises(RuntimeError, match="rank 0 failed: OSError: the storage rank stopped"):  # as on every rank
        engine.save_checkpoint(tmp_path, tag="last")
    monkeypatch.setattr(Path, "rename", rename)
    resumed = _resuming(fake)
    resumed.load_checkpoint(tmp_path)
    assert resumed.consumed_samples == 6


def test_a_save_stopped_between_renames_after_its_state_file_loads_as_the_newest_whole_checkpoint(
    tmp_path, monkeypatch
):
    # The storage rank stopped after the state file of a second save (its every rank saved) and "last" ->
    # last.replaced: last.saving is whole and newer than last.replaced; a load takes it.
    engine, fake = _saved_then_left_between_renames(tmp_path)
    (tmp_path / "last.replaced").rename(tmp_path / "last")
    for _ in range(2):  # a second iteration
        engine.backward(engine(torch.ones(3)))
        engine.step()
    rename = Path.rename  # the storage rank stops at the second rename, last.saving -> "last"
    monkeypatch.setattr(Path, "rename", lambda self, target: rename(self, target) if self.name == "last" else 1 / 0)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        engine.save_checkpoint(tmp_path, tag="last")
    monkeypatch.setattr(Path, "rename", rename)
    resumed = _resuming(fake)
    resumed.load_checkpoint(tmp_path)
    assert resumed.consumed_samples == 12  # two iterations of 3 x 2 samples
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "latest"]


def test_the_folders_a_save_writes_beside_a_tag_are_never_loaded_nor_saved_into(tmp_path):
    # A save that failed left last.saving with DeepSpeed's files in it: not whole, never a checkpoint to load;
    # a save into "x.saving" would be emptied by the next save into "x".
    engine, fake = _engine(_plan([(2, 1)]))
    engine.save_checkpoint(tmp_path, tag="last")
    write_model_states(tmp_path, "last.saving")
    for tag in ("last.saving", "last.replaced"):
        with pytest.raises(ValueError, match=f"load_checkpoint: tag '{tag}': expected a tag not ending in"):
            engine.load_checkpoint(tmp_path, tag=tag)
    (tmp_path / "latest").write_text("last.saving")
    with pytest.raises(ValueError, match="latest names tag 'last.saving': expected a tag not ending in '.saving'"):
        engine.load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="save_checkpoint: tag 'x.saving': .*beside tag 'x' while a save replaces"):
        engine.save_checkpoint(tmp_path, tag="x.saving")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "last.saving", "latest"]


def _nodes_as_threads(tmp_path, monkeypatch):
    """2 nodes of 2 ranks on DeepSpeed's node-local storage (checkpoint.use_node_local_storage: each node saves
    into its own folder, its local rank 0 writing what rank 0 writes on shared storage), as threads meeting at
    the collectives. Returns the engines by rank name and a function running work(engine, fake, folder) on
    every rank, each rank's result or exception."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from poplar_ext import collectives

    ranks = {"0": (0, 0), "1": (0, 1), "2": (1, 0), "3": (1, 1)}  # global rank: (node, local rank)
    engines, boxes = {}, {}
    for name, (node, local_rank) in ranks.items():
        engine, fake = _engine(_plan([(2, 1)] * 4), rank=int(name))
        fake.global_rank, fake.local_rank, fake.use_node_local_storage = int(name), local_rank, lambda: True
        fake.save_checkpoint = lambda save_dir, tag, name=name, **_: write_model_states(save_dir, tag, name)
        engines[name] = engine, fake, tmp_path / f"node{node}"
    meeting = threading.Barrier(len(ranks), timeout=10)

    def gather(obj):
        boxes[threading.current_thread().name] = obj
        meeting.wait()
        gathered = [boxes[name] for name in ranks]
        meeting.wait()
        return gathered

    monkeypatch.setattr(collectives, "barrier", meeting.wait)
    monkeypatch.setattr(collectives, "gather_objects", gather)

    def outcome(work, name):
        threading.current_thread().name = name
        try:
            return work(*engines[name])
        except Exception as exc:  # noqa: BLE001 - the test reads each rank's
            return exc

    def on_every_rank(work):
        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(lambda name: outcome(work, name), ranks))

    return engines, on_every_rank


def test_on_node_local_storage_each_nodes_first_rank_swaps_the_tag_in_and_writes_latest(tmp_path, monkeypatch):
    import threading

    from poplar_ext.runtime import checkpoint

    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    writers = []
    write_state = checkpoint.write_state
    monkeypatch.setattr(
        checkpoint, "write_state", lambda *a: writers.append(threading.current_thread().name) or write_state(*a)
    )
    assert on_every_rank(lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")) == [None] * 4
    assert sorted(writers) == ["0", "2"]
    for node, names in (("node0", ["0", "1"]), ("node1", ["2", "3"])):
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["latest", "t"]
        assert sorted(p.name for p in (tmp_path / node / "t").iterdir()) == [*names, STATE_FILE]
        assert (tmp_path / node / "latest").read_text() == "t"
        (tmp_path / node / "t").rename(tmp_path / node / "t.replaced")  # stopped between the two renames
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    assert on_every_rank(load) == ["t"] * 4
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["latest", "t"]


def test_node_local_storage_that_the_nodes_share_is_refused_on_every_rank_before_any_write(tmp_path, monkeypatch):
    _, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    shared = tmp_path / "shared"
    errors = on_every_rank(lambda engine, fake, folder: engine.save_checkpoint(shared, tag="t"))
    assert all(isinstance(error, ValueError) for error in errors), errors
    message = str(errors[0])
    assert message.startswith(f"save_checkpoint: {shared} is one storage for several nodes: rank 0 sees the file ")
    assert "checkpoint.use_node_local_storage is true" in message and "set it false for shared storage" in message
    assert all(str(error) == message for error in errors), "every rank raises the same"
    assert list(shared.iterdir()) == [], "nothing written, no marker left"


def test_a_storage_rank_that_cannot_look_for_the_other_nodes_marker_still_meets_the_others(tmp_path, monkeypatch):
    # Path.exists raises on EACCES: a rank raising there would skip the agreement the others wait in.
    _, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    exists = Path.exists

    def denied(self):
        if self.name.startswith(".poplar-storage-rank"):
            raise PermissionError(13, "Permission denied", str(self))
        return exists(self)

    monkeypatch.setattr(Path, "exists", denied)
    assert on_every_rank(lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")) == [None] * 4


def test_on_node_local_storage_a_node_stopped_between_renames_loads_the_save_the_other_node_swapped_in(
    tmp_path, monkeypatch
):
    # Node 0 swapped the second save into "t"; node 1's storage rank stopped between its renames (t.replaced
    # the first save, t.saving the second, whole: its state file is written once every rank saved). Restoring
    # t.replaced would have the nodes load different checkpoints.
    from poplar_ext.runtime import checkpoint

    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    save = lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")  # noqa: E731
    assert on_every_rank(save) == [None] * 4
    for node in ("node0", "node1"):
        (tmp_path / node / "t" / "first_save").touch()
    rename = Path.rename

    def stopped(self, target):
        if self == tmp_path / "node1" / "t.saving":
            raise OSError("the storage rank stopped")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped)
    assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    monkeypatch.setattr(Path, "rename", rename)
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    assert on_every_rank(load) == ["t"] * 4
    for node, names in (("node0", ["0", "1"]), ("node1", ["2", "3"])):
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["latest", "t"]
        assert sorted(p.name for p in (tmp_path / node / "t").iterdir()) == [*names, STATE_FILE]


def _two_saves_on_two_nodes(tmp_path, monkeypatch, stop):
    """Two saves into tag "t" on 2 nodes, the second with `stop(path)` raising OSError where it says (node 1's
    storage rank stopping); the first save's files are marked ``first_save``. Returns `on_every_rank`."""
    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    save = lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")  # noqa: E731
    assert on_every_rank(save) == [None] * 4
    for node in ("node0", "node1"):
        (tmp_path / node / "t" / "first_save").touch()
    with monkeypatch.context() as patched:
        stop(patched)
        assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    return on_every_rank


def test_on_node_local_storage_a_node_stopped_before_its_swap_loads_the_save_the_other_node_swapped_in(
    tmp_path, monkeypatch
):
    # Node 1's storage rank wrote the second save's state file into t.saving (every rank's files were written)
    # and stopped before its first rename: its "t" is still the first save while node 0's is the second.
    from poplar_ext.runtime import checkpoint

    rename = Path.rename

    def stop(patched):
        def stopped(self, target):
            if self == tmp_path / "node1" / "t":
                raise OSError("the storage rank stopped")
            return rename(self, target)

        patched.setattr(Path, "rename", stopped)

    on_every_rank = _two_saves_on_two_nodes(tmp_path, monkeypatch, stop)
    assert (tmp_path / "node1" / "t" / "first_save").exists() and (tmp_path / "node1" / "t.saving").exists()
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    assert on_every_rank(load) == ["t"] * 4
    for node, names in (("node0", ["0", "1"]), ("node1", ["2", "3"])):
        assert sorted(p.name for p in (tmp_path / node).iterdir()) == ["latest", "t"]
        assert sorted(p.name for p in (tmp_path / node / "t").iterdir()) == [*names, STATE_FILE]


def test_on_node_local_storage_nodes_holding_different_saves_under_a_tag_are_refused_on_every_rank(
    tmp_path, monkeypatch
):
    # Folders no save of this version leaves (its swap waits for every storage's state file), as an older
    # version's stopped save or a hand's copy may: node 0's "t" one save, node 1's another at the same data
    # position, neither whole on both nodes; then node 1 without "t" at all. Loading would mix two checkpoints,
    # or fail on node 1's ranks alone.
    import json

    from poplar_ext.runtime import checkpoint

    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    save = lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")  # noqa: E731
    assert on_every_rank(save) == [None] * 4
    state_file = tmp_path / "node1" / "t" / STATE_FILE
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "save_id": "another save"}))
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    for node1_holds in ("rank 2's storage: the save at data position 0 (another ", "rank 2's storage: no folder"):
        if node1_holds.endswith("no folder"):
            (tmp_path / "node1" / "t").rename(tmp_path / "node1" / "elsewhere")
        errors = on_every_rank(load)
        for error in errors:
            assert isinstance(error, ValueError), error
            assert str(error) == str(errors[0])
        assert str(errors[0]).startswith("load_checkpoint: tag 't': expected one save under it on every node's")
        assert "rank 0's storage: the save at data position 0 (" in str(errors[0]) and node1_holds in str(errors[0])
        assert sorted(p.name for p in (tmp_path / "node0" / "t").iterdir()) == ["0", "1", STATE_FILE]  # untouched


def test_on_node_local_storage_no_node_swaps_a_save_in_before_every_node_holds_it_whole(tmp_path, monkeypatch):
    # Node 1's storage rank fails to write the second save's state file: node 0 must not have replaced its "t",
    # which would leave the first save on node 1 alone and the second whole nowhere.
    import threading

    from poplar_ext.runtime import checkpoint

    write_state = checkpoint.write_state

    def stop(patched):
        def no_state(*args):
            if threading.current_thread().name == "2":
                raise OSError("the storage rank stopped")
            return write_state(*args)

        patched.setattr(checkpoint, "write_state", no_state)

    _two_saves_on_two_nodes(tmp_path, monkeypatch, stop)
    for node in ("node0", "node1"):
        assert (tmp_path / node / "t" / "first_save").exists()


def test_on_node_local_storage_an_older_versions_save_is_told_by_its_data_position(tmp_path, monkeypatch):
    # Without save_id each node wrote its own state, whose plan history may name its own paths: one save.
    import json

    from poplar_ext.runtime import checkpoint

    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    assert on_every_rank(lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")) == [None] * 4
    for node in ("node0", "node1"):
        state_file = tmp_path / node / "t" / STATE_FILE
        state = {k: v for k, v in json.loads(state_file.read_text()).items() if k != "save_id"}
        state["plan_history"] = [{**state["plan_history"][0], "reason": f"resumed from /{node}/t"}]
        state_file.write_text(json.dumps(state))
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    assert on_every_rank(load) == ["t"] * 4


def test_on_node_local_storage_a_save_whole_on_no_node_leaves_every_nodes_earlier_save(tmp_path, monkeypatch):
    # Node 0's storage rank stopped before writing the second save's state file, node 1's after writing it but
    # before its first rename: every node's "t" is still the first save, loaded as it is, nothing removed; a
    # t.saving holding only a state file (a removal that stopped) is not taken for a save either.
    import threading

    from poplar_ext.runtime import checkpoint

    write_state, rename = checkpoint.write_state, Path.rename

    def stop(patched):
        def no_state(*args):
            if threading.current_thread().name == "0":
                raise OSError("the storage rank stopped")
            return write_state(*args)

        def stopped(self, target):
            if self == tmp_path / "node1" / "t":
                raise OSError("the storage rank stopped")
            return rename(self, target)

        patched.setattr(checkpoint, "write_state", no_state)
        patched.setattr(Path, "rename", stopped)

    on_every_rank = _two_saves_on_two_nodes(tmp_path, monkeypatch, stop)
    (tmp_path / "node0" / "t.saving" / STATE_FILE).write_text((tmp_path / "node0" / "t" / STATE_FILE).read_text())
    for child in (tmp_path / "node0" / "t.saving").iterdir():
        if child.name != STATE_FILE:
            child.unlink()
    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    assert on_every_rank(load) == ["t"] * 4
    for node, names in (("node0", ["0", "1"]), ("node1", ["2", "3"])):
        assert sorted(p.name for p in (tmp_path / node / "t").iterdir()) == [*names, "first_save", STATE_FILE]


def test_a_load_gives_deepspeed_the_tag_rank_0_resolved(tmp_path):
    # Without it DeepSpeed reads each rank's own ``latest``: on node-local storage a node whose save stopped
    # before its ``latest`` would load an older checkpoint under the newer one's data position.
    engine, fake = _engine(_plan([(2, 1)]))
    engine.save_checkpoint(tmp_path, tag="global_step2")
    asked = []
    load = fake.load_checkpoint
    fake.load_checkpoint = lambda load_dir, tag=None, **kwargs: asked.append(tag) or load(load_dir, tag, **kwargs)
    engine.load_checkpoint(tmp_path)
    assert asked == ["global_step2"]


@pytest.mark.parametrize("failing", ["0", "2"], ids=["rank0", "second-node"])
def test_a_storage_rank_failing_to_swap_a_save_in_fails_the_save_on_every_rank_at_once(tmp_path, monkeypatch, failing):
    # The storage rank of one node fails after every rank saved (its state file: disk full); the others must not
    # wait for it in a collective it never reaches (the group's timeout: minutes), nor return as if saved.
    import threading
    import time

    from poplar_ext.runtime import checkpoint

    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    write_state = checkpoint.write_state

    def full_disk(*args):
        if threading.current_thread().name == failing:
            raise OSError(28, "No space left on device")
        return write_state(*args)

    monkeypatch.setattr(checkpoint, "write_state", full_disk)
    started = time.monotonic()
    errors = on_every_rank(lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t"))
    assert time.monotonic() - started < 5
    for error in errors:
        assert isinstance(error, RuntimeError), error
        assert str(error) == f"rank {failing} failed: OSError: [Errno 28] No space left on device"
    assert isinstance(errors[int(failing)].__cause__, OSError)
    assert not (tmp_path / ("node0" if failing == "0" else "node1") / "latest").exists()


def test_a_checkpoint_of_another_plan_continues_the_stream_and_says_so(tmp_path, caplog):
    engine, fake = _engine(_plan([(3, 2), (1, 3)]))  # B = 9
    for _ in range(2):
        engine.backward(engine(torch.ones(3)))
        engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    other, other_fake = _engine(_plan([(2, 2), (2, 3)]))  # B = 10
    other_fake.saved = fake.saved
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        other.load_checkpoint(tmp_path, tag="t")
    assert other.data_position == 9 and other.consumed_samples == 9
    assert [entry["reason"].split(" (")[0] for entry in other.plan_history] == [
        "the job's plan",
        f"resumed from {tmp_path / 't'} under another plan",
    ]
    assert "global batch 9 then, 10 now" in other.plan_history[-1]["reason"]
    assert any("the data continues at stream position 9 with the new batch" in r.getMessage() for r in caplog.records)


def test_checkpoint_with_another_seed_is_refused_before_deepspeed_loads(tmp_path):
    engine, fake = _engine(_plan([(2, 1)]))
    engine.save_checkpoint(tmp_path, tag="t")
    other, other_fake = _engine(_plan([(2, 1)]), seed=5)
    other_fake.saved = fake.saved
    other_fake.load_checkpoint = lambda *a, **k: pytest.fail(
        "DeepSpeed loaded weights of a checkpoint that cannot resume"
    )
    with pytest.raises(
        ValueError, match=r"saved with poplar.seed 0, shuffle True and drop_last False; this job has 5, True and False"
    ):
        other.load_checkpoint(tmp_path, tag="t")


def test_a_plain_deepspeed_checkpoint_starts_the_data_at_0_with_a_note(tmp_path, caplog):
    engine, fake = _engine(_plan([(2, 1)]))
    fake.saved = {"other": 1}  # no poplar state: saved by plain DeepSpeed
    write_model_states(tmp_path, "t")
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        path, client_state = engine.load_checkpoint(tmp_path, tag="t")
    assert client_state == {"other": 1} and engine.data_position == 0
    assert any(
        "holds no poplar-ext state (a plain DeepSpeed checkpoint): the data starts at position 0" in r.getMessage()
        for r in caplog.records
    )


def test_loading_only_the_weights_starts_the_data_at_0(tmp_path):
    engine, fake = _engine(_plan([(2, 1)]))
    engine.backward(engine(torch.ones(3)))
    engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    other, other_fake = _engine(_plan([(2, 1)]))
    other_fake.saved = fake.saved
    other.load_checkpoint(tmp_path, tag="t", load_module_only=True)
    assert other.data_position == 0 and "loaded for its weights only" in other.plan_history[-1]["reason"]


def test_no_checkpoint_found_passes_through():
    engine, _ = _engine(_plan([(2, 1)]))
    assert engine.load_checkpoint("dir") == (None, None)


def test_initialize_needs_the_poplar_section():
    import poplar_ext

    # {} is enough (the automatic mode, docs/training.md): the message must not ask for more.
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed config: expected a top-level 'poplar' section \(\{\} for the automatic mode, or with "
        r"'plan' or 'profiles'\), found none in <DeepSpeed config dict>",
    ):
        poplar_ext.initialize(model=torch.nn.Linear(1, 1), config={"train_batch_size": 1})


# -- what poplar_ext cannot train is refused before anything starts ------------------------
_SECTION = {"poplar": {"cluster": "c.json", "plan": "p.json"}}


@pytest.mark.parametrize(
    ("kwargs", "config", "message"),
    [
        ({"mpu": object()}, {}, r"expected data parallelism only, found mpu= \(a model-parallel unit"),
        ({"mesh_param": (2, 2)}, {}, r"found mesh_param= \(a device mesh"),
        ({}, {"sequence_parallel_size": 2}, r"found sequence_parallel_size 2 in <DeepSpeed config dict>"),
        ({}, {"tensor_parallel": {"autotp_size": 2}}, r"found tensor_parallel.autotp_size 2"),
    ],
)
def test_other_parallelism_is_refused(kwargs, config, message):
    import poplar_ext

    with pytest.raises(ValueError, match=message):
        poplar_ext.initialize(model=torch.nn.Linear(1, 1), config={**config, **_SECTION}, **kwargs)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"gradient_allreduce_op": "sum"},
            r"<DeepSpeed config dict>: gradient_allreduce_op: expected 'mean' \(the loss weights .*\), found 'sum'",
        ),
        (
            {"managed_gradient_accumulation": False},
            r"<DeepSpeed config dict>: managed_gradient_accumulation: expected true \(.*\), found False",
        ),
        (
            {"torch_autocast": {"enabled": True, "dtype": "float16"}, "zero_optimization": {"stage": 2}},
            r"<DeepSpeed config dict>: gradient_clipping: expected 0 beside torch_autocast.dtype 'float16' at ZeRO "
            r"stage 2 .*, found none \(DeepSpeed's default, 1.0\)",
        ),
    ],
)
def test_deepspeed_modes_the_loss_weights_do_not_hold_under_are_refused(config, message):
    # A sum over the ranks makes every gradient W times the global batch's; without managed accumulation
    # DeepSpeed says no boundary before its step, so no iteration is counted (a resume trains data again).
    import poplar_ext

    with pytest.raises(ValueError, match=message):
        poplar_ext.initialize(model=torch.nn.Linear(1, 1), config={**config, **_SECTION})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"gradient_clipping": 0.0, "gradient_predivide_factor": 4.0},
            r"<DeepSpeed config dict>: gradient_predivide_factor: expected 1.0, or prescale_gradients true, where the "
            r"model has embeddings with sparse gradients \(0\): .*, found 4.0",
        ),
        (
            {},
            r"<DeepSpeed config dict>: gradient_clipping: expected 0 where the model has embeddings with sparse "
            r"gradients \(0\): .*, found none \(DeepSpeed's default, 1.0\)",
        ),
        (
            {"gradient_clipping": 0.3, "prescale_gradients": True, "gradient_predivide_factor": 4.0},
            r"gradient_clipping: expected 0 where .*, found 0.3",
        ),
    ],
)
def test_settings_deepspeed_trains_sparse_gradients_wrong_with_are_refused(config, message):
    # Measured on one plain DeepSpeed process at ZeRO 0 (SGD, 3 steps, against the global batch in torch): an
    # nn.Embedding(sparse=True) with gradient_predivide_factor 4 ended 3.2e-2 off, with gradient_clipping 0.3
    # 5.3e-3 off (unclipped), exact (2e-7) with neither.
    import poplar_ext

    model = torch.nn.Sequential(torch.nn.Embedding(8, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=message):
        poplar_ext.initialize(model=model, config={**config, **_SECTION})


def test_deepspeeds_dataloader_drop_last_unlike_the_poplar_section_is_refused():
    # The plan's sampler ends each epoch by poplar.drop_last: DeepSpeed's own setting would be ignored silently.
    import poplar_ext

    data = torch.utils.data.TensorDataset(torch.zeros(8, 1))
    with pytest.raises(
        ValueError,
        match=r"<DeepSpeed config dict>: dataloader_drop_last: expected false .*poplar.drop_last.*, found True",
    ):
        poplar_ext.initialize(
            model=torch.nn.Linear(1, 1), training_data=data, config={"dataloader_drop_last": True, **_SECTION}
        )


def test_moe_layers_are_refused():
    from deepspeed.moe.layer import MoE

    import poplar_ext

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.moe = MoE.__new__(MoE)  # an MoE layer, without building its expert groups
    torch.nn.Module.__init__(model.moe)
    with pytest.raises(ValueError, match=r"found MoE layers \(expert-parallel groups\)"):
        poplar_ext.initialize(model=model, config=_SECTION)


def test_an_iterable_dataset_is_refused_with_what_to_do():
    import poplar_ext

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(
        ValueError,
        match=r"training_data: expected a map-style dataset .* found Stream, which has no indices to split: "
        r"the plan's sampler cuts range\(len\(dataset\)\) .*; give a map-style Dataset, or pass no training_data",
    ):
        poplar_ext.initialize(model=torch.nn.Linear(1, 1), training_data=Stream(), config=_SECTION)


def test_a_switch_keeps_each_ranks_activation_checkpointing():
    import dataclasses

    plan = _plan([(3, 2), (1, 2)], stage=2)
    engine, _ = _engine(plan)
    swapped = dataclasses.replace(plan, ranks=(plan.ranks[1], plan.ranks[0]))
    swapped = dataclasses.replace(
        swapped, ranks=tuple(dataclasses.replace(r, rank=i) for i, r in enumerate(swapped.ranks))
    )
    engine.check_switch(swapped)  # another split of the same batch: fine
    checkpointed = dataclasses.replace(
        swapped, ranks=(swapped.ranks[0], dataclasses.replace(swapped.ranks[1], activation_checkpointing=True))
    )
    with pytest.raises(ValueError, match="each rank keeps its activation_checkpointing"):
        engine.check_switch(checkpointed)


class _RecordingTimer(ComputeSlowdown):
    """A slowdown that records the key of every window opened."""

    def __init__(self):
        super().__init__(Emulation(slowdown=3.0, memory_capacity_bytes=1))
        self.keys = []

    def start(self, key=None):
        if not self.running:
            self.keys.append(key)
        super().start(key)


def test_a_forward_another_library_calls_opens_the_window_of_the_plans_micro_step(monkeypatch):
    # The Hugging Face Trainer and accelerate call the model, not the engine: the hook must key the window
    # by the micro-batch, or the block is learned as one kind whatever its size and a re-plan changes nothing.
    from poplar_ext.hardware import emulation
    from poplar_ext.zero.initialize import time_training_forwards

    monkeypatch.setattr(emulation.time, "sleep", lambda s: None)
    timer = _RecordingTimer()
    engine, _ = _engine(_plan([(5, 1)]), slowdown=timer)
    model = torch.nn.Linear(2, 1)
    time_training_forwards(model, engine)
    engine.backward(model(torch.ones(5, 2)).sum())
    model.eval()
    model(torch.ones(5, 2))
    assert timer.keys == [emulation.micro_step_key(5)]


def test_a_resumed_rank_runs_at_its_drift_schedules_slowdown_from_the_first_step(tmp_path):
    plan = _plan([(3, 1)])
    emulation = Emulation(slowdown=2.0, memory_capacity_bytes=10**9, slowdown_schedule=((3, 5.0, None),))
    engine, fake = _engine(plan, slowdown=ComputeSlowdown(emulation))
    for _ in range(4):
        engine.backward(engine(torch.ones(3)))
        engine.step()
    assert engine.emulated_compute.slowdown == 5.0
    engine.save_checkpoint(tmp_path, tag="t")
    resumed, resumed_fake = _engine(plan, slowdown=ComputeSlowdown(emulation))
    resumed_fake.saved, resumed_fake.global_steps = fake.saved, 4  # DeepSpeed restores its step count
    assert resumed.emulated_compute.slowdown == 2.0
    resumed.load_checkpoint(tmp_path, tag="t")
    assert resumed.emulated_compute.slowdown == 5.0, "the drift holds from its step on, also after a resume"


def _saved_once_on_two_nodes(tmp_path, monkeypatch):
    """`_nodes_as_threads`, with one save into tag "t" on every rank; returns `on_every_rank` and that save."""
    engines, on_every_rank = _nodes_as_threads(tmp_path, monkeypatch)
    save = lambda engine, fake, folder: engine.save_checkpoint(folder, tag="t")  # noqa: E731
    assert on_every_rank(save) == [None] * 4
    return on_every_rank, save


def _save_id(folder):
    return json.loads((folder / STATE_FILE).read_text())["save_id"]


def _load_every_rank(on_every_rank):
    from poplar_ext.runtime import checkpoint

    load = lambda engine, fake, folder: checkpoint.tag_for_load(folder, "t", deepspeed_engine=fake, rank=0)  # noqa: E731
    return on_every_rank(load)


def _failing_on(patched, path, *, name="rename", error=None):
    """Path.rename of `path` (or the checkpoint module's write_state into `path`) raising `error`: the storage
    rank of `path`'s node failing there."""
    from poplar_ext.runtime import checkpoint

    error = error or OSError("the storage rank stopped")
    rename, write_state = Path.rename, checkpoint.write_state

    def failing_rename(self, target):
        if self == path:
            raise error
        return rename(self, target)

    def failing_write_state(save_dir, tag, state):
        if Path(save_dir) == path:
            raise error
        return write_state(save_dir, tag, state)

    if name == "rename":
        patched.setattr(Path, "rename", failing_rename)
    else:
        patched.setattr(checkpoint, "write_state", failing_write_state)


def test_on_node_local_storage_a_save_after_a_failed_one_keeps_the_save_every_node_holds(tmp_path, monkeypatch):
    # Save 2 fails on node 1 after node 0 swapped it in (node 1: save 1 in "t", save 2 whole in t.saving); the job
    # goes on and save 3 fails on node 1 before its state file. Emptying node 1's t.saving at the start of save 3
    # would leave save 2 on node 0 alone and save 1 on node 1 alone: no load possible. Save 2 must stay on both.
    on_every_rank, save = _saved_once_on_two_nodes(tmp_path, monkeypatch)
    with monkeypatch.context() as patched:
        _failing_on(patched, tmp_path / "node1" / "t")
        assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    second = _save_id(tmp_path / "node0" / "t")
    with monkeypatch.context() as patched:
        _failing_on(patched, tmp_path / "node1", name="write_state", error=OSError(28, "No space left on device"))
        assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    assert _load_every_rank(on_every_rank) == ["t"] * 4
    for node in ("node0", "node1"):
        assert _save_id(tmp_path / node / "t") == second


def test_on_node_local_storage_a_load_keeps_the_save_every_node_holds_over_a_restored_newer_one(tmp_path, monkeypatch):
    # Save 2 stopped with node 0 before its swap and node 1 between its renames (t.replaced: save 1, t.saving:
    # save 2 whole); then a save 3 emptied node 0's t.saving and stopped. Save 1 is on both nodes (node 0's "t",
    # node 1's t.replaced), save 2 on node 1 alone: restoring node 1's t.saving and dropping t.replaced would
    # leave no save on both.
    on_every_rank, save = _saved_once_on_two_nodes(tmp_path, monkeypatch)
    first = _save_id(tmp_path / "node0" / "t")
    with monkeypatch.context() as patched:
        _failing_on(patched, tmp_path / "node0" / "t")
        _failing_on(patched, tmp_path / "node1" / "t.saving")
        assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    (tmp_path / "node0" / "t.saving" / STATE_FILE).unlink()  # save 3's start, stopped there on node 0
    assert sorted(p.name for p in (tmp_path / "node1").iterdir()) == ["latest", "t.replaced", "t.saving"]
    assert _load_every_rank(on_every_rank) == ["t"] * 4
    for node in ("node0", "node1"):
        assert _save_id(tmp_path / node / "t") == first
        assert not (tmp_path / node / "t.replaced").exists()


def test_on_node_local_storage_a_tag_without_state_file_takes_the_save_the_other_nodes_swapped_in(
    tmp_path, monkeypatch
):
    # "t" held a plain DeepSpeed checkpoint (no state file); the first poplar-ext save into it swapped in on node 1
    # and stopped before node 0's swap: node 0's old files must not load beside node 1's new ones.
    on_every_rank, save = _saved_once_on_two_nodes(tmp_path, monkeypatch)
    for node in ("node0", "node1"):
        (tmp_path / node / "t" / STATE_FILE).unlink()
    with monkeypatch.context() as patched:
        _failing_on(patched, tmp_path / "node0" / "t")
        assert all(isinstance(error, RuntimeError) for error in on_every_rank(save))
    assert _load_every_rank(on_every_rank) == ["t"] * 4
    assert _save_id(tmp_path / "node0" / "t") == _save_id(tmp_path / "node1" / "t")


def test_a_save_stopped_while_removing_the_resharded_tag_leaves_no_part_of_it_under_its_name(tmp_path, monkeypatch):
    # A save into "last" drops last_universal (resharded from the checkpoint it replaces); stopped while deleting
    # that folder, a part of it under its name would later be loaded as a whole resharded checkpoint.
    from poplar_ext.runtime import checkpoint

    engine, fake = _engine(_plan([(2, 1)]))
    engine.save_checkpoint(tmp_path, tag="last")
    universal = tmp_path / "last_universal"
    for name in ("zero", "mp_rank_00_model_states.pt"):
        (universal / name).mkdir(parents=True) if name == "zero" else (universal / name).touch()
    rmtree = checkpoint.shutil.rmtree

    def stopped_midway(path, *args, **kwargs):
        if Path(path).name.startswith("last_universal") and Path(path).exists():
            (Path(path) / "mp_rank_00_model_states.pt").unlink()
            raise OSError("the storage rank stopped")
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", stopped_midway)
    with pytest.raises(RuntimeError, match="the storage rank stopped"):
        engine.save_checkpoint(tmp_path, tag="last")
    assert not universal.exists()


@pytest.mark.parametrize("where", ["restore_replaced", "_save_of"])
def test_on_node_local_storage_a_storage_that_cannot_be_read_fails_the_load_on_every_rank_at_once(
    tmp_path, monkeypatch, where
):
    # A permission or I/O error on one node's first rank (its tag folder unreadable) must not leave the other
    # ranks waiting in the collective that follows.
    import threading
    import time

    from poplar_ext.runtime import checkpoint

    on_every_rank, save = _saved_once_on_two_nodes(tmp_path, monkeypatch)
    original = getattr(checkpoint, where)

    def unreadable(*args, **kwargs):
        if threading.current_thread().name == "2":
            raise PermissionError(13, "Permission denied")
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, where, unreadable)
    started = time.monotonic()
    errors = _load_every_rank(on_every_rank)
    assert time.monotonic() - started < 5
    for error in errors:  # (the threads all pass rank=0 to tag_for_load: the rank named is 0)
        assert isinstance(error, RuntimeError), error
        assert str(error) == "rank 0 failed: PermissionError: [Errno 13] Permission denied"


class _HookedDeepSpeedEngine(FakeDeepSpeedEngine):
    """The fake engine with DeepSpeed 0.19.8's hooks for a backward outside engine.backward: each output tensor
    with a gradient gets its per-tensor prologue, looked up at every forward (ZeRO 1-3)."""

    def __init__(self, gas, model):
        super().__init__(gas)
        self.model = model

    def _backward_prologue_per_tensor(self, grad):
        return grad / self.gas  # DeepSpeed's division by the accumulation count

    def __call__(self, x):
        from deepspeed.runtime.utils import OutputBackwardHookManager

        outputs = self.model(x)
        hooks = OutputBackwardHookManager(lambda: None, self._backward_prologue_per_tensor)
        hooks.register_hooks_on_outputs(outputs)
        self.hooks = hooks  # kept while the outputs live
        return outputs


@pytest.mark.parametrize("outputs", ["loss", "loss and logits"])
def test_a_backward_of_the_loss_itself_is_weighted_once_or_refused(outputs):
    # DeepSpeed hooks every output tensor with a gradient: with the loss and the logits both returned (any Hugging
    # Face model given labels), loss.backward() met the weight at the loss and again at the logits.
    linear = torch.nn.Linear(3, 1, bias=False)

    def model(x):
        logits = linear(x)
        loss = logits.sum()
        return loss if outputs == "loss" else {"loss": loss, "logits": logits}

    plan = _plan([(3, 2), (1, 2)])  # rank 0: 3 x 2 of a global batch of 8
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    fake = _HookedDeepSpeedEngine(2, model)
    engine = PoplarEngine(fake, plan=plan, rank=0, poplar_config=config, device_label="x (real)", slowdown=None)
    result = engine(torch.ones(3, 3))
    loss = result if outputs == "loss" else result["loss"]
    if outputs == "loss":
        loss.backward()
        # The rank's share of the global batch's mean, weighted once: W * b / B = 2 * 3 / 8.
        assert linear.weight.grad == pytest.approx(torch.full((1, 3), 3.0 * 2 * 3 / 8))
    else:
        with pytest.raises(ValueError, match=r"loss.backward\(\): expected the model's forward to return one tensor"):
            loss.backward()


def test_an_evaluation_forward_opens_no_compute_window(monkeypatch):
    # Timed, an evaluation's forwards would count as this rank's training compute until its next backward: a rank
    # that evaluates alone would look slower, and re-balancing would move work off it.
    from poplar_ext.hardware import emulation

    _one_second_of_compute_per_reading(monkeypatch, emulation)
    slowdown = ComputeSlowdown(Emulation(slowdown=3.0, memory_capacity_bytes=1))
    engine, fake = _engine(_plan([(2, 1)]), slowdown=slowdown)
    fake.module = torch.nn.Linear(1, 1).eval()
    engine(torch.ones(2))
    assert not slowdown.running
    fake.module.train()
    engine(torch.ones(2))
    assert slowdown.running


class FakeEngineWithModel(FakeDeepSpeedEngine):
    """A stand-in DeepSpeed engine around a real module, its parameters shaped as `module`'s."""

    def __init__(self, gas, module):
        super().__init__(gas)
        self.module = module
        self.loads = 0

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        self.loads += 1
        return super().load_checkpoint(load_dir, tag, **kwargs)


def _saved_model_states(folder, module, *, zero_stage):
    """DeepSpeed's model states file of `module` as ZeRO `zero_stage` writes it: at stage 0 the module's
    weights; at stage 3 empty partitions, the full shapes in ``param_shapes``."""
    folder.mkdir(parents=True)
    if zero_stage == 3:
        states = {
            "module": {name: torch.empty(0) for name in module.state_dict()},
            "param_shapes": [{name: p.shape for name, p in module.named_parameters()}],
            "frozen_param_shapes": {},
        }
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    else:
        states, name = {"module": module.state_dict(), "param_shapes": None}, "mp_rank_00_model_states.pt"
    torch.save(states, folder / name)
    return folder / name


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_checkpoint_of_another_model_is_refused_naming_the_file_before_any_weight_loads(tmp_path, zero_stage):
    # A ZeRO-3 checkpoint resharded for another number of ranks loaded into a model twice as wide without a word
    # (DeepSpeed pads each saved tensor to the parameter's partition); elsewhere DeepSpeed failed deep in its loader.
    saved = _saved_model_states(tmp_path / "t", torch.nn.Linear(4, 3), zero_stage=zero_stage)
    fake = FakeEngineWithModel(1, torch.nn.Linear(8, 3))
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    engine = PoplarEngine(fake, plan=_plan([(2, 1)]), rank=0, poplar_config=config, device_label="x", slowdown=None)
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(tmp_path, tag="t")
    assert str(refused.value) == (
        f"load_checkpoint: {saved}: expected the parameters of this job's model (2, each shape as the model has "
        "it), found 1 parameters of another shape (weight: expected [3, 8], found [3, 4]): the checkpoint was "
        "saved from another model; build the model it was saved from"
    )
    assert fake.loads == 0


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_a_checkpoint_of_the_same_model_passes_the_shape_check(tmp_path, zero_stage):
    _saved_model_states(tmp_path / "t", torch.nn.Linear(4, 3), zero_stage=zero_stage)
    fake = FakeEngineWithModel(1, torch.nn.Linear(4, 3))
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    engine = PoplarEngine(fake, plan=_plan([(2, 1)]), rank=0, poplar_config=config, device_label="x", slowdown=None)
    engine.load_checkpoint(tmp_path, tag="t")
    assert fake.loads == 1


def test_parameters_missing_from_a_checkpoint_are_refused_unless_the_load_is_not_strict(tmp_path):
    from poplar_ext.runtime.checkpoint import check_parameter_shapes

    _saved_model_states(tmp_path / "t", torch.nn.Linear(4, 3, bias=False), zero_stage=0)
    shapes = {"weight": (3, 4), "bias": (3,)}
    with pytest.raises(ValueError, match=r"found 1 of the model's parameters missing \(bias\)"):
        check_parameter_shapes(tmp_path, "t", shapes)
    check_parameter_shapes(tmp_path, "t", shapes, strict=False)


def test_a_model_states_file_torch_cannot_read_is_refused_naming_it(tmp_path):
    from poplar_ext.runtime.checkpoint import check_parameter_shapes

    saved = _saved_model_states(tmp_path / "t", torch.nn.Linear(4, 3), zero_stage=0)
    saved.write_bytes(saved.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"load_checkpoint: {saved}: expected a model states file that torch can"):
        check_parameter_shapes(tmp_path, "t", {"weight": (3, 4)})


def test_buffers_and_frozen_parameters_left_out_of_a_checkpoint_pass_the_shape_check(tmp_path):
    from poplar_ext.runtime.checkpoint import check_parameter_shapes

    module = torch.nn.BatchNorm1d(3)  # running_mean, running_var, num_batches_tracked: buffers in the state dict
    _saved_model_states(tmp_path / "t", module, zero_stage=0)
    check_parameter_shapes(tmp_path, "t", {"weight": (3,), "bias": (3,)})
    check_parameter_shapes(tmp_path, "t", {"weight": (3,), "bias": (3,), "frozen": (2,)}, frozen=frozenset({"frozen"}))


def test_a_model_states_file_in_torchs_legacy_format_passes_the_shape_check(tmp_path):
    # DeepSpeed writes it under "checkpoint": {"checkpoint_serialization": false}; torch maps only its zip format,
    # and a resume of the same model was refused as "damaged" ("mmap can only be used with files saved with ...").
    from poplar_ext.runtime.checkpoint import check_parameter_shapes

    (tmp_path / "t").mkdir()
    states = {"module": torch.nn.Linear(4, 3).state_dict(), "param_shapes": None}
    saved = tmp_path / "t" / "mp_rank_00_model_states.pt"
    torch.save(states, saved, _use_new_zipfile_serialization=False)
    check_parameter_shapes(tmp_path, "t", {"weight": (3, 4), "bias": (3,)})
    with pytest.raises(ValueError, match=rf"^load_checkpoint: {re.escape(str(saved))}: .*weight: expected \[3, 8\]"):
        check_parameter_shapes(tmp_path, "t", {"weight": (3, 8), "bias": (3,)})


@pytest.mark.parametrize(
    ("stage", "lost"),
    [(1, "zero_pp_rank_2_mp_rank_00_optim_states.pt"), (3, "zero_pp_rank_1_mp_rank_00_model_states.pt")],
)
def test_a_checkpoint_missing_a_ranks_file_is_refused_naming_it_before_deepspeed_loads(tmp_path, stage, lost):
    # Before: at the same number of ranks the rank reading the lost file raised FileNotFoundError while the others
    # died in a collective ("Connection closed by peer"); resharded, rank 0 failed with "RuntimeError: shape
    # '[16, 64]' is invalid for input of size 96".
    plan = _plan([(2, 1), (2, 1), (2, 1)], stage=stage)
    engine, fake = _engine(plan)
    engine.save_checkpoint(tmp_path, tag="t")
    names = ["optim"] + (["model"] if stage == 3 else [])
    for rank in range(3):
        for kind in names:
            (tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").touch()
    (tmp_path / "t" / lost).unlink()
    resumed, resumed_fake = _engine(plan)
    resumed_fake.saved = fake.saved
    pattern = lost.replace("_00_", "_*_")
    with pytest.raises(ValueError) as refused:
        resumed.load_checkpoint(tmp_path, tag="t")
    assert str(refused.value) == (
        f"load_checkpoint: {tmp_path / 't'}: expected the ZeRO stage {stage} files of each of the 3 ranks that "
        f"saved it (poplar_state.json: plan.ranks), found 1 missing (*{pattern}): the checkpoint is incomplete (a "
        "file lost, or not copied); copy the missing files from where it was saved, or load another checkpoint"
    )
    if stage == 1:  # the weights alone read no optimizer file at stages 1-2
        resumed.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_ranks_zero_file_cut_short_is_refused_naming_it_before_deepspeed_loads(tmp_path, stage):
    # Before: on as many ranks as saved it, the rank reading the file failed alone ("PytorchStreamReader failed
    # reading zip archive: failed finding central directory") while rank 0 loaded and went on to train.
    plan = _plan([(2, 1), (2, 1)], stage=stage)
    engine, fake = _engine(plan)
    engine.save_checkpoint(tmp_path, tag="t")
    kinds = ["optim"] + (["model"] if stage == 3 else [])
    for rank in range(2):
        for kind in kinds:
            torch.save({"state": torch.zeros(64)}, tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")
    cut = tmp_path / "t" / f"zero_pp_rank_1_mp_rank_00_{kinds[-1]}_states.pt"
    cut.write_bytes(cut.read_bytes()[:200])
    resumed, resumed_fake = _engine(plan)
    resumed_fake.saved = fake.saved
    with pytest.raises(ValueError) as refused:
        resumed.load_checkpoint(tmp_path, tag="t")
    assert str(refused.value) == (
        f"load_checkpoint: {tmp_path / 't'}: expected whole ZeRO files, found 1 cut short ({cut.name}: a zip file "
        "without its end, which torch cannot read): the checkpoint is damaged (a copy cut short); copy those files "
        "again from where it was saved, or load another checkpoint"
    )


@pytest.mark.parametrize(("stage", "damage"), [(1, "cut"), (1, "lost"), (3, "cut"), (3, "lost")])
def test_a_plain_deepspeed_checkpoint_with_a_ranks_zero_file_damaged_is_refused_before_deepspeed_loads(
    tmp_path, stage, damage
):
    # A checkpoint without poplar_state.json (plain DeepSpeed's) was not checked: on 2 ranks, as it was saved, the
    # rank reading the file failed alone ("PytorchStreamReader failed reading zip archive", FileNotFoundError)
    # while rank 0 loaded and went on to train; resharded on 2 of 3 ranks' files, every rank failed with
    # "RuntimeError: shape '[16, 64]' is invalid for input of size 96". Its ranks: DeepSpeed's dp_world_size.
    module = torch.nn.Linear(4, 3)
    (tmp_path / "t").mkdir()
    if stage == 3:
        states = {"module": {}, "param_shapes": [{n: p.shape for n, p in module.named_parameters()}]}
        model_file, kinds = "zero_pp_rank_0_mp_rank_00_model_states.pt", ["optim", "model"]
    else:
        states = {"module": module.state_dict(), "param_shapes": None}
        model_file, kinds = "mp_rank_00_model_states.pt", ["optim"]
    torch.save({**states, "dp_world_size": 2}, tmp_path / "t" / model_file)
    for rank in range(2):
        for kind in kinds:
            name = f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
            if (tmp_path / "t" / name).exists():
                continue
            torch.save({"state": torch.zeros(64)}, tmp_path / "t" / name)
    damaged = tmp_path / "t" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "cut":
        damaged.write_bytes(damaged.read_bytes()[:200])
    else:
        damaged.unlink()
    fake = FakeEngineWithModel(1, module)
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    plan = _plan([(2, 1), (2, 1)], stage=stage)
    engine = PoplarEngine(fake, plan=plan, rank=0, poplar_config=config, device_label="x", slowdown=None)
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(tmp_path, tag="t")
    if damage == "cut":
        assert str(refused.value).startswith(
            f"load_checkpoint: {tmp_path / 't'}: expected whole ZeRO files, found 1 cut short ({damaged.name}: "
        )
    else:
        assert str(refused.value).startswith(
            f"load_checkpoint: {tmp_path / 't'}: expected the ZeRO stage {3 if stage == 3 else '1-2'} files of each "
            f"of the 2 ranks that saved it ({model_file}: dp_world_size), found 1 missing "
            "(*zero_pp_rank_1_mp_rank_*_optim_states.pt): the checkpoint is incomplete"
        )
    assert fake.loads == 0


@pytest.mark.parametrize("saved_bf16", [False, True])
def test_optimizer_states_of_another_precision_on_as_many_ranks_are_refused_before_deepspeed_loads(
    tmp_path, saved_bf16
):
    # Before: DeepSpeed failed on every rank with a bare FileNotFoundError for
    # '.../bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt' (or the name without bf16_), saying not why.
    plan = _plan([(2, 1), (2, 1)], stage=1)
    engine, fake = _engine(plan)
    engine.save_checkpoint(tmp_path, tag="t")
    prefix = "bf16_" if saved_bf16 else ""
    for rank in range(2):
        (tmp_path / "t" / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    for bf16 in (saved_bf16, not saved_bf16):
        resumed, resumed_fake = _engine(plan)
        resumed_fake.saved = fake.saved
        resumed_fake.bfloat16_enabled = lambda bf16=bf16: bf16
        if bf16 == saved_bf16:
            resumed.load_checkpoint(tmp_path, tag="t")
            continue
        saved, now = ("bf16", "fp32 or fp16") if saved_bf16 else ("fp32 or fp16", "bf16")
        files = ", ".join(f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(2))
        with pytest.raises(ValueError) as refused:
            resumed.load_checkpoint(tmp_path, tag="t")
        assert str(refused.value) == (
            f"load_checkpoint: {tmp_path / 't'}: expected the optimizer states of a {now} job, as this one trains "
            f"(bf16.enabled {str(bf16).lower()}), found those of a {saved} job ({files}), which DeepSpeed cannot "
            f"load in {now} on the number of ranks that saved it: resume it with bf16.enabled "
            f"{str(saved_bf16).lower()}, as it was saved"
        )
        resumed.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)  # the weights alone: any precision


def test_a_plain_deepspeed_checkpoints_optimizer_states_of_another_precision_are_refused_before_it_loads(tmp_path):
    # Without poplar_state.json the check never ran: a plain bf16 ZeRO-1 checkpoint of 2 ranks loaded into an fp32
    # job of 2 failed on every rank with DeepSpeed's bare "FileNotFoundError: ... zero_pp_rank_0_mp_rank_00_optim_
    # states.pt". The ranks that saved it: the dp_world_size DeepSpeed records in the model states file.
    module = torch.nn.Linear(4, 3)
    (tmp_path / "t").mkdir()
    states = {"module": module.state_dict(), "param_shapes": None, "dp_world_size": 2}
    torch.save(states, tmp_path / "t" / "mp_rank_00_model_states.pt")
    files = [f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in range(2)]
    for name in files:
        torch.save({"state": torch.zeros(4)}, tmp_path / "t" / name)
    fake = FakeEngineWithModel(1, module)
    fake.bfloat16_enabled = lambda: False
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    engine = PoplarEngine(
        fake, plan=_plan([(2, 1), (2, 1)]), rank=0, poplar_config=config, device_label="x", slowdown=None
    )
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(tmp_path, tag="t")
    assert str(refused.value) == (
        f"load_checkpoint: {tmp_path / 't'}: expected the optimizer states of a fp32 or fp16 job, as this one trains "
        f"(bf16.enabled false), found those of a bf16 job ({', '.join(files)}), which DeepSpeed cannot load in fp32 "
        "or fp16 on the number of ranks that saved it: resume it with bf16.enabled true, as it was saved"
    )
    assert fake.loads == 0


@pytest.mark.parametrize(("saved_stage", "job_stage"), [(1, 3), (3, 1), (1, 0)])
def test_a_plain_deepspeed_checkpoint_of_a_stage_whose_files_this_job_cannot_load_is_refused(
    tmp_path, saved_stage, job_stage
):
    # Before, DeepSpeed failed on every rank with a bare AssertionError (stages 1 and 3 either way) or
    # "AttributeError: 'NoneType' object has no attribute 'copy'" (a stage-1 checkpoint at stage 0). The saved
    # stage: the ds_config DeepSpeed records in the model states file.
    module = torch.nn.Linear(4, 3)
    (tmp_path / "t").mkdir()
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if saved_stage == 3 else "mp_rank_00_model_states.pt"
    states = {"module": module.state_dict(), "dp_world_size": 2}
    torch.save({**states, "ds_config": {"zero_optimization": {"stage": saved_stage}}}, tmp_path / "t" / model_file)
    for rank in range(2):
        for kind in ["optim", "model"] if saved_stage == 3 else ["optim"]:
            if not (tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt").exists():
                torch.save(
                    {"state": torch.zeros(4)}, tmp_path / "t" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                )
    fake = FakeEngineWithModel(1, module)
    config = poplar_config_from_dict({"cluster": "c.json", "plan": "p.json"}, base_dir=Path("."))
    plan = _plan([(2, 1), (2, 1)], stage=job_stage)
    engine = PoplarEngine(fake, plan=plan, rank=0, poplar_config=config, device_label="x", slowdown=None)
    with pytest.raises(ValueError) as refused:
        engine.load_checkpoint(tmp_path, tag="t")
    assert str(refused.value).startswith(
        f"load_checkpoint: {tmp_path / 't'}: {model_file}: ds_config.zero_optimization.stage: expected a ZeRO stage "
        f"whose files DeepSpeed loads at this job's stage {job_stage} "
    )
    assert f"found {saved_stage}: resume it at ZeRO stage " in str(refused.value)
    assert fake.loads == 0
    if 3 not in (saved_stage, job_stage):  # the weights alone load across stages 0-2
        engine.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)


def test_a_scheduled_drift_is_logged_when_it_starts_and_on_rank_0s_step_lines(caplog):
    # The step lines name the device type's emulated slowdown (2x); after 3 steps rank 0 runs 5x slower.
    emulation = Emulation(slowdown=2.0, memory_capacity_bytes=10**9, slowdown_schedule=((3, 5.0, None),))
    engine, _ = _engine(_plan([(3, 1)]), slowdown=ComputeSlowdown(emulation), log_interval_steps=1)
    engine.device_label = "x (emulated: 2x slower, 1.0 GB)"
    with caplog.at_level(logging.INFO, logger="poplar_ext"):
        for _ in range(4):
            engine.backward(engine(torch.ones(3)))
            engine.step()
    drift = [r.getMessage() for r in caplog.records if "slowdown_schedule says" in r.getMessage()]
    assert drift == [
        "rank 0: emulated compute now 5x slower (was 2x) after 3 optimizer steps, as the cluster's "
        "slowdown_schedule says"
    ]
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("poplar step")]
    assert [line.endswith("(rank 0: x (emulated: 2x slower, 1.0 GB), micro-batch 3 x 1)") for line in steps] == [
        True,
        False,
        False,
    ], "steps 2, 3 (the drift's start), 4"
    assert steps[-1].endswith("micro-batch 3 x 1); rank 0 now 5x slower (the cluster's slowdown_schedule)")


def test_fp16_at_zero_0_with_a_fused_optimizer_starts_as_torch_does(one_rank_group):
    # FP16_Optimizer (fp16 at ZeRO 0 around a fused optimizer: a config's Adam on a GPU is FusedAdam) steps it on
    # zero gradients when built as FP16_UnfusedOptimizer does, on one flat fp32 master per group.
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    from poplar_ext.runtime.engine_core import undo_initial_zero_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    start = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    optimizer = FP16_Optimizer(torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5))
    decayed = optimizer.fp32_groups_flat[0].detach().clone()
    assert not torch.allclose(decayed, start)  # DeepSpeed's zero step decayed the master
    assert undo_initial_zero_step(type("Engine", (), {"optimizer": optimizer})())
    assert torch.equal(optimizer.fp32_groups_flat[0], start)
    assert dict(optimizer.optimizer.state) == {}  # no step counted


def test_fp16_at_zero_0_reports_the_gradient_norm_without_the_loss_scale():
    # DeepSpeed's fp16 optimizers at ZeRO 0 record the norm of the gradients they hold, scaled: with the scale put
    # into the loss (above), the Trainer logged grad_norm 338.9 where ZeRO 1 logged 1.32 (scale 256).
    engine, fake = _engine(_plan([(3, 1), (1, 1)], stage=0), rank=0)
    fake.fp16_enabled = lambda: True
    fake.optimizer = _FP16UnfusedOptimizer(cur_scale=256.0)
    real_step = fake.step

    def step():
        real_step()
        fake._global_grad_norm = 512.0  # the scaled gradients' norm
        fake.optimizer.loss_scale_config.cur_scale = 512.0  # DeepSpeed may raise the scale in its step

    fake.step = step
    engine.step()
    assert fake._global_grad_norm == pytest.approx(2.0)  # divided by the scale the gradients carried
    fake._global_grad_norm = -1  # a skipped step's: left as it is
    from poplar_ext.runtime.engine_core import unscale_reported_grad_norm

    unscale_reported_grad_norm(fake, 256.0)
    assert fake._global_grad_norm == -1


@pytest.mark.parametrize("fused", [False, True])
def test_the_reported_gradient_norm_is_the_true_one_with_deepspeeds_fp16_optimizers(one_rank_group, fused):
    # FP16_UnfusedOptimizer records the norm of the scaled gradients; FP16_Optimizer (around a fused optimizer, a
    # config's Adam on a GPU) records it already divided by the loss scale: dividing it again reported 0.03 for 7.75.
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).half()
    reference = torch.nn.Linear(4, 3)
    reference.load_state_dict({name: value.float() for name, value in model.state_dict().items()})
    reference(torch.ones(2, 4)).sum().backward()
    true_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    wrapper = FP16_Optimizer if fused else FP16_UnfusedOptimizer
    engine, fake = _engine(_plan([(3, 1), (1, 1)], stage=0), rank=0)
    fake.fp16_enabled = lambda: True
    fake.optimizer = wrapper(torch.optim.SGD(model.parameters(), lr=0.0), static_loss_scale=256.0)
    real_step = fake.step

    def step():  # as DeepSpeed's _take_model_step
        real_step()
        fake.optimizer.step()
        fake._global_grad_norm = fake.optimizer._global_grad_norm

    fake.step = step
    (model(torch.ones(2, 4).half()).float().sum() * 256.0).backward()  # the loss scale engine.backward puts in
    engine.step()
    assert float(fake._global_grad_norm) == pytest.approx(true_norm, rel=1e-3)


def test_a_pipeline_optimizer_step_reports_the_gradient_norm_without_the_loss_scale(monkeypatch):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from poplar_ext.pipeline import engine as pipeline_engine

    def take_step(engine, **kwargs):
        engine._global_grad_norm = 768.0

    monkeypatch.setattr(PipelineEngine, "_exec_optimizer_step", take_step)
    engine = type(
        "Engine", (), {"fp16_enabled": lambda self: True, "optimizer": _FP16UnfusedOptimizer(cur_scale=256.0)}
    )()
    pipeline_engine._exec_optimizer_step(engine)
    assert engine._global_grad_norm == pytest.approx(3.0)


def _engine_skipping_a_step(rank, *, fp16, loss_scale):
    """An engine whose next DeepSpeed step is skipped (its first), with the optimizer's loss scale as DeepSpeed's
    fp16 and ZeRO optimizers give it."""
    engine, fake = _engine(_plan([(3, 1), (1, 1)], stage=1), rank=rank)
    fake.optimizer = _FP16UnfusedOptimizer(use_grad_scaling=fp16, cur_scale=loss_scale)
    fake.optimizer.loss_scale = loss_scale
    fake.fp16_enabled = lambda: fp16
    fake.skipped_steps = 1
    fake.was_step_applied = lambda: False
    return engine, fake


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_deepspeed_skips_is_said_on_rank_0(caplog, rank):
    # DeepSpeed's "OVERFLOW! Skipping step" is logged at INFO, below its logger's WARNING: an fp16 overflow
    # skipped a step, its data untrained, while poplar logged the step like any other.
    engine, fake = _engine_skipping_a_step(rank, fp16=True, loss_scale=128.0)
    with caplog.at_level("WARNING", logger="poplar_ext"):
        engine.step()
    said = "poplar step 1: DeepSpeed skipped the optimizer step (gradients not finite: an fp16 overflow)"
    assert (said in caplog.text) == (rank == 0)
    if rank == 0:
        assert "the loss scale now 128; its data is not trained again (1 steps skipped so far)" in caplog.text
    caplog.clear()
    fake.was_step_applied = lambda: True
    with caplog.at_level("WARNING", logger="poplar_ext"):
        engine.step()
    assert "skipped the optimizer step" not in caplog.text


def test_a_step_skipped_outside_fp16_is_not_said_to_be_an_fp16_overflow(caplog):
    # bf16 (and fp32 ZeRO) skip a step whose gradients hold NaN or inf too; their loss scale is 1 and fixed. The
    # warning said "an fp16 overflow, the loss scale now 1" for a bf16 job at ZeRO 0 and 1 (one rank, a NaN loss).
    engine, _ = _engine_skipping_a_step(0, fp16=False, loss_scale=1.0)  # bf16: DeepSpeed's ZeRO scale of 1
    with caplog.at_level("WARNING", logger="poplar_ext"):
        engine.step()
    assert (
        "poplar step 1: DeepSpeed skipped the optimizer step (gradients not finite: NaN or inf); its data is not "
        "trained again (1 steps skipped so far)" in caplog.text
    )
    assert "fp16" not in caplog.text and "loss scale" not in caplog.text


def _deepspeeds_own_io(plan, rank):
    """What DeepSpeed 0.19.8's ``deepspeed_io`` gives for training: an equal share of the data set per rank
    (DistributedSampler) in batches of the rank's configured micro-batch."""

    def deepspeed_io(dataset, batch_size=None, route="train", data_sampler=None, **kwargs):
        sampler = data_sampler or torch.utils.data.DistributedSampler(dataset, num_replicas=plan.world_size, rank=rank)
        batch_size = batch_size or plan.ranks[rank].micro_batch_size
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    return deepspeed_io


def test_deepspeed_io_for_training_gives_the_plans_micro_batches_every_sample_once():
    # A DeepSpeed script that builds its loader with engine.deepspeed_io(dataset) got DeepSpeed's even split: with
    # micro-batches 3 x 1 and 1 x 3 of 20 samples, rank 0 trained 4 batches (the last of 1 sample, weighted as 3)
    # and rank 1 ten, so iterations mixed samples of two epochs and trained some twice (a max parameter
    # difference of 8e-3 from one process after 6 AdamW steps), without an error.
    plan = _plan([(3, 1), (1, 3)])
    data = torch.utils.data.TensorDataset(torch.arange(20))
    loaders = []
    for rank in (0, 1):
        engine, fake = _engine(plan, rank=rank)
        fake.deepspeed_io = _deepspeeds_own_io(plan, rank)
        loaders.append(engine.deepspeed_io(data))
    batches = [[batch[0].tolist() for batch in loader] for loader in loaders]
    assert [len(b) for b in batches[0]] == [3] * len(batches[0])
    assert [len(b) for b in batches[1]] == [1] * len(batches[1])
    assert len(batches[1]) == 3 * len(batches[0])  # the same iterations on both ranks
    first_epoch = sorted(sum(batches[0][:3], []) + sum(batches[1][:9], []))
    assert first_epoch == sorted(set(first_epoch)) and len(first_epoch) == 18  # no sample twice in an epoch
    assert len(engine.batch_samplers) == 1  # the engine's: it follows resumes and re-balancing


def test_deepspeed_io_refuses_what_contradicts_the_plan_and_passes_evaluation_on():
    plan = _plan([(3, 1), (1, 3)])
    engine, fake = _engine(plan, rank=1)
    fake.deepspeed_io = _deepspeeds_own_io(plan, 1)
    data = torch.utils.data.TensorDataset(torch.arange(20))
    with pytest.raises(ValueError, match=r"deepspeed_io: batch_size: expected None or this rank's micro-batch .*\(1\)"):
        engine.deepspeed_io(data, batch_size=3)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1)
    with pytest.raises(ValueError, match="deepspeed_io: data_sampler: expected None for training, found Distributed"):
        engine.deepspeed_io(data, data_sampler=sampler)
    with pytest.raises(ValueError, match=r"deepspeed_io: dataset: num_samples: expected at least the global batch"):
        engine.deepspeed_io(torch.utils.data.TensorDataset(torch.arange(5)))
    assert [len(b[0]) for b in engine.deepspeed_io(data, batch_size=1)] == [1] * len(engine.deepspeed_io(data))
    samplers = len(engine.batch_samplers)
    evaluation = engine.deepspeed_io(data, batch_size=4, route="eval")
    assert [len(b[0]) for b in evaluation] == [4, 4, 2]  # DeepSpeed's own, as asked
    assert len(engine.batch_samplers) == samplers  # evaluation made no training sampler


class _BatchSettingDeepSpeedEngine(FakeDeepSpeedEngine):
    """DeepSpeed 0.19.8's batch setters: a new global batch changes this rank's accumulation count alone."""

    def __init__(self, gas, micro_batch_size, world_size):
        super().__init__(gas)
        self.micro_batch_size, self.world_size = micro_batch_size, world_size

    def set_train_batch_size(self, train_batch_size):
        self.gas = train_batch_size // (self.micro_batch_size * self.world_size)

    def set_train_micro_batch_size(self, micro_batch_size):
        self.micro_batch_size = micro_batch_size


@pytest.mark.parametrize(
    "setter, value, message",
    [
        ("set_train_batch_size", 12, r"set_train_batch_size: expected the plan's global batch \(6\), found 12"),
        ("set_train_micro_batch_size", 2, r"set_train_micro_batch_size: expected this rank's micro-batch in the plan "),
    ],
)
def test_deepspeeds_batch_setters_that_would_leave_the_plan_are_refused(setter, value, message):
    # engine.set_train_batch_size(12) under micro-batches 3 x 1 and 1 x 3 made DeepSpeed accumulate 2 and 6
    # micro-batches on the two ranks while the loss weights stayed those of the plan's batch of 6: every step
    # trained the sum of two global batches' mean gradients (a gradient norm of 2.55 where the mean's was about
    # 1.2), and engine.train_batch_size() still said 6, without an error.
    plan = _plan([(3, 1), (1, 3)])
    engine, _ = _engine(plan, rank=0)
    fake = _BatchSettingDeepSpeedEngine(1, 3, 2)
    engine.deepspeed_engine = fake
    with pytest.raises(ValueError, match=message):
        getattr(engine, setter)(value)
    assert (fake.gas, fake.micro_batch_size) == (1, 3)
    engine.set_train_batch_size(6)  # the plan's: nothing to change
    engine.set_train_micro_batch_size(3)
    assert (fake.gas, fake.micro_batch_size) == (1, 3)


def test_deepspeed_io_for_evaluation_gives_every_rank_as_many_batches():
    # engine.deepspeed_io(eval_set, route="eval") took DeepSpeed's default batch, this rank's micro-batch: with
    # micro-batches 4 and 2 over 13 samples rank 0 evaluated 2 batches and rank 1 four, and at ZeRO stage 3 (every
    # forward gathers the parameters from every rank) the job hung until the launcher's timeout.
    plan = _plan([(4, 1), (2, 1)], stage=3)
    data = torch.utils.data.TensorDataset(torch.arange(13))
    counts = []
    for rank in (0, 1):
        engine, fake = _engine(plan, rank=rank)
        fake.deepspeed_io = _deepspeeds_own_io(plan, rank)
        counts.append([len(batch[0]) for batch in engine.deepspeed_io(data, route="eval")])
    assert counts == [[2, 2, 2, 1]] * 2


def test_the_fp32_zero_0_clip_keeps_the_norm_deepspeed_drops(monkeypatch):
    # DeepSpeed's clip_fp32_gradients computes the norm and drops it: get_global_grad_norm() said None at fp32
    # ZeRO 0 with gradient_clipping on, and the Trainer logged no grad_norm.
    import deepspeed.runtime.utils as ds_utils

    from poplar_ext.zero.engine import keep_fp32_clip_norm

    clipped = []

    def clip_grad_norm_(parameters, max_norm, mpu=None):
        clipped.append((len(list(parameters)), max_norm, mpu))
        return torch.tensor([5.0])

    class Engine:
        module, mpu, _global_grad_norm = torch.nn.Linear(2, 1), None, None

        def gradient_clipping(self):
            return 1.0

        def clip_fp32_gradients(self):  # DeepSpeed's, which returns nothing
            clip_grad_norm_(self.module.parameters(), self.gradient_clipping(), self.mpu)

    monkeypatch.setattr(ds_utils, "clip_grad_norm_", clip_grad_norm_)
    engine = Engine()
    keep_fp32_clip_norm(engine)
    engine.clip_fp32_gradients()
    assert engine._global_grad_norm == 5.0 and clipped == [(2, 1.0, None)]
