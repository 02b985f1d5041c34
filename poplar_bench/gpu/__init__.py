"""`poplar-bench gpu`: the CUDA path checked in one offline run (the GPU test tier, bf16 profiles with the real
out-of-memory probe, the policy comparison on one GPU), or its dry run on CPU (docs/gpu.md)."""
