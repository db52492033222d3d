"""minibert: a minimal, readable re-implementation of Megatron-LM's BERT pretraining.

One concept per module; see chapters/ for the course that teaches each one."""
