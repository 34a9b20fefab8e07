"""Synthetic checkpoints (random weights, real formats) for tests and benchmarks."""
