"""Chapters 2 and 4, the loop's parts: the run's assembly, the optimizer, loss scaling, the LR schedule,
checkpoints and exact resume, and the training log."""
