"""Emulated device types: which rank is emulated, the slowdown arithmetic, the memory check."""

from __future__ import annotations

import pytest

from poplar_ext.hardware import emulation as emu
from poplar_ext.plan.formats import Emulation, cluster_from_dict

SLOW = Emulation(slowdown=3.0, memory_capacity_bytes=2_000_000_000)


def _cluster():
    return cluster_from_dict(
        {
            "schema_version": 1,
            "nodes": [
                {"name": "n0", "devices": [{"device_type": "cpu-fast", "count": 1}]},
                {"name": "n1", "devices": [{"device_type": "cpu-slow", "count": 2}]},
            ],
            "device_types": {"cpu-slow": {"emulation": {"slowdown": 3.0, "memory_capacity_bytes": 2_000_000_000}}},
        }
    )


def test_emulation_for_rank_follows_node_order():
    cluster = _cluster()
    assert emu.emulation_for_rank(cluster, 0) is None
    assert emu.emulation_for_rank(cluster, 1) == SLOW
    assert emu.emulation_for_rank(cluster, 2) == SLOW


def test_emulation_for_rank_outside_the_cluster():
    with pytest.raises(ValueError, match=r"rank: expected a rank of the cluster description \(0..2\), found 3"):
        emu.emulation_for_rank(_cluster(), 3)


def test_device_label_says_real_or_emulated():
    assert emu.device_label("a100", None) == "a100 (real)"
    assert emu.device_label("cpu-slow", SLOW) == "cpu-slow (emulated: 3x slower, 2.0 GB)"


def test_memory_within_capacity_passes():
    emu.check_emulated_memory(SLOW, 2_000_000_000)
    emu.check_emulated_memory(None, 10**15)


def test_memory_over_capacity_raises():
    with pytest.raises(emu.EmulatedOutOfMemoryError, match="cpu-slow out of memory: peak 2000000001 bytes"):
        emu.check_emulated_memory(SLOW, 2_000_000_001, device_type="cpu-slow")


def test_emulated_oom_is_a_runtime_error():
    assert issubclass(emu.EmulatedOutOfMemoryError, RuntimeError)


class _FakeClock:
    """Thread CPU time and wall time that advance only when told, and a sleep that records."""

    def __init__(self) -> None:
        self.now = 100.0
        self.wall = 500.0
        self.slept: list[float] = []

    def compute(self, seconds: float) -> None:
        """A block of compute on a core of its own: CPU time and wall time advance alike."""
        self.now += seconds
        self.wall += seconds

    def thread_time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.wall

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture
def clock(monkeypatch):
    fake = _FakeClock()
    monkeypatch.setattr(emu.time, "thread_time", fake.thread_time)
    monkeypatch.setattr(emu.time, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(emu.time, "sleep", fake.sleep)
    return fake


def test_slowdown_sleeps_the_extra_time_of_cpu_time(clock):
    slowdown = emu.ComputeSlowdown(SLOW)
    with slowdown:
        clock.compute(0.5)
    assert clock.slept == [pytest.approx(1.0)]
    assert slowdown.compute_time_s == pytest.approx(0.5)
    assert slowdown.delay_s == pytest.approx(1.0)


@pytest.mark.parametrize("waited_s, expected_sleep_s", [(0.7, 0.3), (1.0, 0.0), (5.0, 0.0)])
def test_wall_time_lost_waiting_counts_towards_the_emulated_duration(clock, waited_s, expected_sleep_s):
    # 0.5 s of compute, slowdown 3: the block must last 1.5 s of wall time. Time it
    # already lost waiting (for a core, or in a collective) is not slept again.
    slowdown = emu.ComputeSlowdown(SLOW)
    with slowdown:
        clock.compute(0.5)
        clock.wall += waited_s
    assert clock.slept == ([pytest.approx(expected_sleep_s)] if expected_sleep_s else [])
    assert slowdown.delay_s == pytest.approx(expected_sleep_s)


def test_real_device_measures_without_sleeping(clock):
    slowdown = emu.ComputeSlowdown(None)
    slowdown.start()
    clock.compute(0.25)
    assert slowdown.stop() == 0.0
    assert clock.slept == []
    assert slowdown.compute_time_s == pytest.approx(0.25)


def test_second_start_keeps_the_first(clock):
    slowdown = emu.ComputeSlowdown(SLOW)
    slowdown.start()
    clock.compute(1.0)
    slowdown.start()
    clock.compute(1.0)
    slowdown.stop()
    assert slowdown.compute_time_s == pytest.approx(2.0)
    assert not slowdown.running


def test_stop_without_start_does_nothing(clock):
    assert emu.ComputeSlowdown(SLOW).stop() == 0.0
    assert clock.slept == []


def test_slowdown_below_one_never_sleeps(clock):
    slowdown = emu.ComputeSlowdown(Emulation(slowdown=0.5, memory_capacity_bytes=1))
    with slowdown:
        clock.compute(1.0)
    assert clock.slept == []
    assert slowdown.delay_s == 0.0


def test_unknown_clock():
    with pytest.raises(ValueError, match="clock: expected 'thread' or 'cuda', found 'wall'"):
        emu.ComputeSlowdown(None, clock="wall")


def _emulated_cluster(slowdowns_by_node):
    types = {}
    nodes = []
    for node, slowdowns in slowdowns_by_node.items():
        devices = []
        for index, slowdown in enumerate(slowdowns):
            name = f"{node}-t{index}"
            types[name] = {"emulation": {"slowdown": slowdown, "memory_capacity_bytes": 10**9}}
            devices.append({"device_type": name, "count": 1})
        nodes.append({"name": node, "devices": devices})
    return cluster_from_dict({"schema_version": 1, "nodes": nodes, "device_types": types})


def test_the_emulation_range_is_the_sum_of_one_over_slowdown_against_the_cores(recwarn, caplog):
    import logging

    cluster = _emulated_cluster({"a": [2.0, 4.0, 4.0], "b": [1.2, 1.2, 2.0]})
    with caplog.at_level(logging.WARNING, logger="poplar_ext.hardware.emulation"):
        demands = emu.check_emulation_range(cluster, cores=2, load_average=0.0)
    assert demands == pytest.approx({"a": 1.0, "b": 2 / 1.2 + 1 / 2.0})
    (warning,) = [w for w in recwarn.list if issubclass(w.category, emu.EmulationRangeWarning)]
    assert "emulated devices on b: the ranks keep 2.17 cores busy" in str(warning.message)
    assert "machine has 2" in str(warning.message)
    assert caplog.records == []
    # Within the cores, but not with the machine's load on top: logged, not warned.
    recwarn.clear()
    with caplog.at_level(logging.WARNING, logger="poplar_ext.hardware.emulation"):
        emu.check_emulation_range(_emulated_cluster({"a": [2.0, 4.0, 4.0]}), cores=2, load_average=1.5)
    assert not [w for w in recwarn.list if issubclass(w.category, emu.EmulationRangeWarning)]
    assert "load average is 1.5 on 2 cores" in caplog.text


def _block(slowdown, clock, compute_s: float, *, key=None, waited_s: float = 0.0) -> float:
    """One block of `compute_s` of compute (plus `waited_s` of wall time not computing): the time slept."""
    before = len(clock.slept)
    slowdown.start(key) if key is not None else slowdown.start()
    clock.compute(compute_s)
    clock.wall += waited_s
    slowdown.stop()
    return sum(clock.slept[before:])


def test_a_block_lasts_its_steady_time_once_learned_whatever_its_compute_took(clock):
    # Slowdown 3. The first blocks' compute (0.4, 0.5, 0.6 s) is learned: median 0.5 s, so every later
    # block lasts 1.5 s, whether its real compute took 0.3 s or 0.7 s (another rank on the core, a cache).
    slowdown = emu.ComputeSlowdown(SLOW)
    for compute_s in (0.4, 0.6, 0.5):
        _block(slowdown, clock, compute_s)
    assert _block(slowdown, clock, 0.3) == pytest.approx(1.2)
    assert _block(slowdown, clock, 0.7) == pytest.approx(0.8)
    assert slowdown.busy_time_s == pytest.approx(3 * (0.4 + 0.6 + 0.5) + 2 * 1.5)


def test_each_kind_of_block_learns_its_own_time(clock):
    slowdown = emu.ComputeSlowdown(SLOW)
    for _ in range(emu.LEARNED_BLOCKS):
        _block(slowdown, clock, 0.5, key=emu.micro_step_key(4))
        _block(slowdown, clock, 0.1, key=emu.OPTIMIZER_STEP_KEY)
    assert _block(slowdown, clock, 0.2, key=emu.micro_step_key(4)) == pytest.approx(1.3)
    assert _block(slowdown, clock, 0.2, key=emu.OPTIMIZER_STEP_KEY) == pytest.approx(0.1)


def test_micro_steps_take_the_profile_time_from_the_first_and_follow_drift(clock):
    # The profile was measured at slowdown 3: 0.6 s at micro-batch 8 is 0.2 s of real compute.
    reference = emu.SteadyReference(
        block_time_s=lambda key: 0.075 * key[1] if key[1] <= 16 else None, profile_slowdown=3.0, source="test"
    )
    slowdown = emu.ComputeSlowdown(SLOW, reference=reference)
    assert _block(slowdown, clock, 0.25, key=emu.micro_step_key(8)) == pytest.approx(0.35)
    slowdown.slowdown = 6.0  # the emulation's schedule made the device slower
    assert _block(slowdown, clock, 0.25, key=emu.micro_step_key(8)) == pytest.approx(0.95)
    # Beyond what the profile says, the size is learned like any other block.
    assert _block(slowdown, clock, 0.25, key=emu.micro_step_key(32)) == pytest.approx(6 * 0.25 - 0.25)


def test_a_block_past_its_steady_time_is_counted_and_warned_about(clock, caplog):
    reference = emu.SteadyReference(block_time_s=lambda key: 0.3, profile_slowdown=3.0, source="test")
    slowdown = emu.ComputeSlowdown(SLOW, reference=reference)
    assert _block(slowdown, clock, 0.1, key=emu.micro_step_key(1)) == pytest.approx(0.2)
    assert not emu.warn_on_overrun(slowdown, rank=2)
    # Its compute waited 0.5 s for a core: the block lasted 0.6 s where its steady time is 0.3 s.
    assert _block(slowdown, clock, 0.1, key=emu.micro_step_key(1), waited_s=0.5) == 0.0
    assert slowdown.overrun_s == pytest.approx(0.3)
    assert slowdown.overrun_blocks == 1 and slowdown.blocks == 2
    assert slowdown.overrun_report()["overrun_share"] == pytest.approx(0.3 / 0.6)
    with caplog.at_level("WARNING", logger=emu.__name__):
        assert emu.warn_on_overrun(slowdown, rank=2)
    assert "rank 2: emulated compute ran 50.0% over its steady time (1 of 2 blocks" in caplog.text


def test_waits_in_a_window_with_collectives_are_no_overrun(clock):
    reference = emu.SteadyReference(block_time_s=lambda key: 0.3, profile_slowdown=3.0, source="test")
    slowdown = emu.ComputeSlowdown(SLOW, reference=reference, window_waits=True)
    _block(slowdown, clock, 0.1, key=emu.micro_step_key(1), waited_s=0.5)
    assert slowdown.overrun_s == 0.0
    _block(slowdown, clock, 0.4, key=emu.micro_step_key(1))
    assert slowdown.overrun_s == pytest.approx(0.1)


def test_a_real_device_is_measured_block_by_block_never_made_steady(clock):
    timer = emu.ComputeSlowdown(None)
    for compute_s in (0.1, 0.1, 0.1, 0.4):
        _block(timer, clock, compute_s)
    assert timer.busy_time_s == pytest.approx(0.7)
    assert clock.slept == [] and timer.overrun_s == 0.0


def test_a_pipeline_stage_is_steady_at_its_layer_profiles_forward_a_third_of_the_micro_batch(clock):
    reference = emu.pipeline_reference(stage_compute_s=0.9, optimizer_step_s=0.3, profile_slowdown=3.0, source="t")
    slowdown = emu.ComputeSlowdown(SLOW, reference=reference)
    assert _block(slowdown, clock, 0.05, key=emu.PIPELINE_FORWARD_KEY) == pytest.approx(0.3 - 0.05)
    assert _block(slowdown, clock, 0.1, key=emu.PIPELINE_BACKWARD_KEY) == pytest.approx(0.6 - 0.1)
    assert _block(slowdown, clock, 0.1, key=emu.PIPELINE_OPTIMIZER_KEY) == pytest.approx(0.3 - 0.1)
    assert _block(slowdown, clock, 0.1, key="_exec_send_activations") == pytest.approx(3 * 0.1 - 0.1)  # learned


def test_waits_in_the_blocks_named_as_holding_collectives_are_no_overrun(clock):
    reference = emu.pipeline_reference(stage_compute_s=0.9, optimizer_step_s=0.3, profile_slowdown=3.0, source="t")
    slowdown = emu.ComputeSlowdown(SLOW, reference=reference, window_waits=(emu.PIPELINE_OPTIMIZER_KEY,))
    _block(slowdown, clock, 0.05, key=emu.PIPELINE_OPTIMIZER_KEY, waited_s=1.0)  # waiting for other stages
    assert slowdown.overrun_s == 0.0
    _block(slowdown, clock, 0.05, key=emu.PIPELINE_FORWARD_KEY, waited_s=1.0)  # a forward waits for a core
    assert slowdown.overrun_s == pytest.approx(0.05 + 1.0 - 0.3)
