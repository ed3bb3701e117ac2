"""Readers and writers of the checkpoint formats the converter supports."""
