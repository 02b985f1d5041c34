"""The devices a rank runs on: what they are, how much memory they have, and emulated ones.

* `devices`: the one table that turns the name the hardware reports into a device type;
* `memory`: peak memory of a block of work, the memory a rank may use, the CPU allocator;
* `emulation`: emulated device types (a compute slowdown and a memory capacity);
* `cpu_process`: process-wide settings for CPU ranks, applied only when asked.
"""
