"""Checkpoint state conversion: readers, pure planner, streaming executor, writers."""
