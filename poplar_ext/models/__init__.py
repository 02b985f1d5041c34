"""Models that ship with poplar-ext, for the demo, the examples, the tests and `poplar-profile` (nothing is
downloaded); not part of the runtime: poplar-ext trains whatever model the user gives it. See docs/profiling.md."""
