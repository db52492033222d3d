"""Chapter 8, the speed levers: fused kernels, CUDA graphs and the written-out Linear backward. Each has a
plain twin in the core and is applied from outside, where a run is assembled (minibert/train.py calls
minibert.fast.levers.apply_levers); no core module imports this package."""
