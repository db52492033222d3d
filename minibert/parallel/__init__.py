"""Parallelism: the rank grid, tensor-, pipeline- and data-parallel pieces, each in its own file."""
