"""Device abstraction: run frameworks that assume CUDA on other devices (the CPU here)."""
