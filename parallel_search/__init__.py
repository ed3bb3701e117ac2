"""Parallel-plan search: memory and cost models, candidate space, profiling-driven ranking."""
