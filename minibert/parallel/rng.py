"""Random numbers under tensor parallelism: Megatron's rule for dropout.

Outside the tensor-parallel region every TP rank holds the same activations (the residual stream, the
embeddings) and must drop the same entries, or the replicas would drift apart: they share the default
generator, seeded alike. Inside the region each rank holds different heads (attention probabilities)
or, with sequence parallelism, different positions: drawing the same numbers there would correlate
entries that should be independent, so each rank switches to a generator of its own,

    seed + 2718 + tp_rank        (Megatron's offset, and + 100 x pipeline stage like the default seed)

for the duration of `with tracker.fork(): ...` (Megatron: get_cuda_rng_tracker().fork()). The flash
attention kernel draws its dropout seed inside that fork, so its dropout follows the same rule. Both
generators' states go into every checkpoint, so a resumed run drops exactly what the unbroken one would.

Under CUDA graph capture (--cuda-graph-impl local, tensor-parallel size 1) fork() swaps nothing: a
generator's state cannot be set while a graph is recorded, and with one TP rank there is no other rank's
stream to stay apart from. The graph's draws come from torch's CUDA generator (minibert/fast/cuda_graphs.py).

What production does: Megatron's tracker holds several named CUDA states (one per expert group, ...); we
need one, for the CPU and the GPU generator alike. Its graph-safe variant registers each state with the
graph instead of swapping it."""
import contextlib

import torch

TENSOR_PARALLEL_SEED_OFFSET = 2718


class TensorParallelRNG:
    def __init__(self, seed: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.cpu_state = torch.Generator().manual_seed(seed).get_state()
        self.cuda_state = None
        if self.cuda:
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            self.cuda_state = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self):
        """Swap this rank's generator in for the default one (CPU and CUDA), and back afterwards."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            yield  # a CUDA graph is being captured (TP = 1 only): nothing may be swapped
            return
        cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state() if self.cuda else None
        torch.set_rng_state(self.cpu_state)
        if self.cuda:
            torch.cuda.set_rng_state(self.cuda_state)
        try:
            yield
        finally:
            self.cpu_state = torch.get_rng_state()
            torch.set_rng_state(cpu)
            if self.cuda:
                self.cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(cuda)

    def state_dict(self) -> dict:
        return {"cpu": self.cpu_state, "cuda": self.cuda_state}

    def load_state_dict(self, state: dict):
        self.cpu_state = state["cpu"]
        if self.cuda and state.get("cuda") is not None:
            self.cuda_state = state["cuda"]
