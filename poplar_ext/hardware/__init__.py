"""The devices a rank runs on: device types, discovery, memory, compute clocks, emulation (DEVELOPING.md)."""
