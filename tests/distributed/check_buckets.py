"""Run by tests/test_data_parallel.py under torchrun (2 processes, gloo): minibert's bucketed gradient
reduction against the plain way, an all-reduce of each parameter's autograd gradient divided by DP."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minibert.parallel.data_parallel import DataParallelGrads  # noqa: E402
from minibert.parallel.state import ParallelState  # noqa: E402

torch.set_num_threads(1)
state = ParallelState.from_environment(backend="gloo", timeout_minutes=0.5)
torch.manual_seed(0)  # the same model on every rank
model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3), torch.nn.LayerNorm(3))
MICRO_BATCHES = 3

for distributed in (False, True):
    for overlap in (False, True):
        ours, plain = copy.deepcopy(model), copy.deepcopy(model)
        grads = DataParallelGrads(ours, state, bucket_size=5, distributed_optimizer=distributed, overlap=overlap)
        assert len(grads.buckets) == 4, [len(b.params) for b in grads.buckets]  # [2, 2, 1, 1] parameters
        started_during_backward = []
        original_start = grads._start

        def start(bucket, original_start=original_start):  # record when each bucket's collective starts
            if bucket.handle is None:
                started_during_backward.append(grads.sync_now)
            original_start(bucket)
        grads._start = start
        inputs = [torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * state.rank + k))
                  for k in range(MICRO_BATCHES)]  # each rank its own micro-batches
        for k, x in enumerate(inputs):
            grads.set_last_micro_batch(k == MICRO_BATCHES - 1)
            (ours(x).pow(2).sum() / MICRO_BATCHES).backward()
            if k < MICRO_BATCHES - 1:
                assert not started_during_backward, "an earlier micro-batch communicated"
        grads.finish()
        assert started_during_backward == [overlap] * 4, started_during_backward
        for x in inputs:
            (plain(x).pow(2).sum() / MICRO_BATCHES).backward()
        for p, q in zip(ours.parameters(), plain.parameters()):
            dist.all_reduce(q.grad)
            q.grad /= state.dp
            assert p.grad is None
        for bucket in grads.buckets:
            lo, hi = bucket.shard if distributed else (0, bucket.grad_data.numel())
            for p_ours, (a, b) in zip(bucket.params, bucket.ranges):
                q = dict(zip(map(id, ours.parameters()), plain.parameters()))[id(p_ours)]
                x, y = max(a, lo), min(b, hi)  # ZeRO-1: only this rank's shard is reduced
                if x < y:
                    torch.testing.assert_close(bucket.grad_data[x:y], q.grad.reshape(-1)[x - a:y - a],
                                               rtol=1e-6, atol=1e-7)
        if distributed:  # the all-gather after an update: every rank's shard reaches every rank
            for bucket in grads.buckets:
                lo, hi = bucket.shard
                bucket.param_data[lo:hi] = state.rank + 1.0
            grads.gather_params()
            for bucket in grads.buckets:
                size = bucket.param_data.numel() // state.dp
                assert all(torch.all(bucket.param_data[r * size:(r + 1) * size] == r + 1.0) for r in range(state.dp))
        print(f"rank {state.rank}: distributed={distributed} overlap={overlap} ok", flush=True)
state.destroy()
