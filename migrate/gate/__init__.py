"""Orchestrator side of the convergence gate: metric sources that need W&B, source specs."""
