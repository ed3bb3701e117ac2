"""Real training workloads (DeepSpeed, Megatron-Core, FSDP2, external commands) on the runtime's worker groups."""
