"""Interleaved, single process: profiler-style micro-step vs the same followed by an idle sleep."""

import os
import statistics
import time

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29611")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed

from poplar_bench.demo_config import DemoSettings, deepspeed_config
from poplar_bench.demo_worker import _batch, _make_model
from poplar_ext.hardware.cpu_process import limit_cpu_threads
from poplar_ext.hardware.memory import steady_cpu_allocator

limit_cpu_threads()
steady_cpu_allocator()
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
s = DemoSettings()
cfg = deepspeed_config(s)
cfg.pop("train_batch_size")
cfg["train_micro_batch_size_per_gpu"] = 16
cfg["gradient_accumulation_steps"] = 1000
model = _make_model(s)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
batch = _batch(s, 16)


def step():
    engine.set_gradient_accumulation_boundary(False)
    t = time.thread_time()
    loss = engine(batch)
    engine.backward(loss, scale_wrt_gas=False)
    engine.step()
    return time.thread_time() - t


for _ in range(3):
    step()
cont, idle = [], []
for _round in range(30):
    for _ in range(3):
        cont.append(step())
    for _ in range(3):
        c = step()
        idle.append(c)
        time.sleep(5 * c)
print(
    f"continuous median {statistics.median(cont) * 1000:.1f} ms; after idle sleeps median "
    f"{statistics.median(idle) * 1000:.1f} ms; ratio {statistics.median(idle) / statistics.median(cont):.3f}"
)
