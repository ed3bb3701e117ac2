"""The orchestrator side of the parallel-plan search: job mapping, real-step profilers, `measure`."""
