"""migrate: move a distributed training job to another cluster and prove nothing changed."""
__version__ = "0.1.0"
