"""Emulation under load (issue 27, item 2): a toy-GPT micro-step's thread CPU time and wall time,
profiling-like (back to back, CPU time) against training-like (padded to slowdown x CPU time by
`ComputeSlowdown`, wall clock), with one forked rank per slowdown running at once.

    python load_experiment.py MICRO_BATCH SLOWDOWNS [SLOWDOWNS ...]   # e.g. 8 3,6,12 2,3

Prints one JSON line per rank and mix (see README.md beside it). Emulated CPU ranks only.
"""

import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from poplar_ext.hardware.emulation import ComputeSlowdown
from poplar_ext.models.toy_gpt import GPT, GPTConfig
from poplar_search.formats import Emulation

STEPS = 8
"""Timed micro-steps per rank and way (after 2 warm-ups)."""


def rank(slowdown, training_like, queue, barrier, micro_batch):
    torch.set_num_threads(1)
    model = GPT(GPTConfig(vocab_size=256, sequence_length=64, num_layers=4, num_heads=4, hidden_size=128), seed=0)
    tokens = torch.randint(0, 256, (micro_batch, 65))
    for _ in range(2):
        model(tokens).backward()
    barrier.wait()
    emulation = Emulation(slowdown=slowdown, memory_capacity_bytes=1 << 30) if training_like else None
    padded = ComputeSlowdown(emulation)  # without an emulation it only times CPU time
    cpu_s, wall_s = [], []
    for _ in range(STEPS):
        started = time.perf_counter()
        with padded:
            model.zero_grad(set_to_none=True)
            model(tokens).backward()
        wall_s.append(time.perf_counter() - started)
        cpu_s.append(padded.compute_time_s)
    queue.put((slowdown, statistics.median(cpu_s), statistics.median(wall_s)))


def run(slowdowns, training_like, micro_batch):
    context = mp.get_context("fork")
    queue, barrier = context.Queue(), context.Barrier(len(slowdowns))
    processes = [context.Process(target=rank, args=(s, training_like, queue, barrier, micro_batch)) for s in slowdowns]
    for process in processes:
        process.start()
    results = sorted(queue.get() for _ in processes)
    for process in processes:
        process.join()
    return results


def main():
    micro_batch = int(sys.argv[1])
    for text in sys.argv[2:]:
        slowdowns = [float(v) for v in text.split(",")]
        profiling, training = run(slowdowns, False, micro_batch), run(slowdowns, True, micro_batch)
        load = os.getloadavg()[0]
        for (slowdown, profile_cpu, _), (_, train_cpu, train_wall) in zip(profiling, training):
            row = {
                "slowdowns": slowdowns,
                "duty": round(sum(1 / v for v in slowdowns), 2),
                "slowdown": slowdown,
                "load1": round(load, 2),
                "profile_cpu_s": round(profile_cpu, 4),
                "train_cpu_s": round(train_cpu, 4),
                "train_wall_s": round(train_wall, 4),
                "cpu_ratio": round(train_cpu / profile_cpu, 3),
                "wall_over_predicted": round(train_wall / (slowdown * profile_cpu), 3),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
