"""Single process, interleaved: engine A's micro-step CPU time when A runs alone vs when B and C run in between."""

import os
import statistics
import time

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29612", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed

from poplar_bench.demo_config import DemoSettings, deepspeed_config
from poplar_bench.demo_worker import _batch, _make_model
from poplar_ext.hardware.cpu_process import limit_cpu_threads
from poplar_ext.hardware.memory import steady_cpu_allocator

limit_cpu_threads()
steady_cpu_allocator()
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
s = DemoSettings()


def build(b):
    cfg = deepspeed_config(s)
    cfg.pop("train_batch_size")
    cfg["train_micro_batch_size_per_gpu"] = b
    cfg["gradient_accumulation_steps"] = 1000
    m = _make_model(s)
    e, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
    return e, _batch(s, b)


engines = {"A": build(16), "B": build(48), "C": build(32)}


def step(name):
    e, batch = engines[name]
    e.set_gradient_accumulation_boundary(False)
    t = time.thread_time()
    loss = e(batch)
    e.backward(loss, scale_wrt_gas=False)
    e.step()
    return time.thread_time() - t


for n in engines:
    for _ in range(3):
        step(n)
alone, first_after_switch, later_after_switch = [], [], []
for _round in range(25):
    for _ in range(4):
        alone.append(step("A"))
    step("B")
    step("B")
    step("C")
    step("C")
    first_after_switch.append(step("A"))
    for _ in range(3):
        later_after_switch.append(step("A"))
    step("B")
    step("C")
m = statistics.median
print(
    f"A alone {m(alone) * 1000:.1f} ms; first after B,C {m(first_after_switch) * 1000:.1f} ms; 2nd-4th after "
    f"{m(later_after_switch) * 1000:.1f} ms"
)
