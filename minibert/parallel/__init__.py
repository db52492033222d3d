"""Parallelism applied from outside the model: the rank grid, data / tensor / pipeline parallelism."""
