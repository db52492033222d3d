"""Data parallelism: DP replicas of the model, each on its own micro-batches, averaging their gradients.

Why an average is enough: the loss of a global batch of G samples is the mean of its micro-batch losses,
and a gradient is linear, so

    grad( mean over the G samples )  =  mean over DP replicas of ( mean over that replica's micro-batches )

Every replica starts from the same weights, takes the same averaged gradient and runs the same AdamW, so
the replicas stay identical without ever exchanging weights.

Gradient buffers. Each parameter's gradient lives in one flat fp32 buffer per *bucket* (a run of
parameters, ~--ddp-bucket-size elements) as a view `param.main_grad`; after each micro-batch's backward,
accumulate() folds every (16-bit or fp32) `param.grad` into it with one multi-tensor call and frees them.
The step's first fold copies (main_grad = grad), the later ones add (main_grad += grad), so zero() has
nothing to write: a memset and an add read and write 4 + 10 bytes an element, a converting copy 6
(timed in whole steps: bench/results/main_grad_fold_h200_2026-12-02.md, bench/notes/training.md). Parameters are laid out in
reverse order of registration, which is roughly the order the backward produces their gradients:

    backward ->   | bucket 0: layers 23..20 | bucket 1: layers 19..16 | ... | bucket k: embedding |
                  grads of the last layers are ready first, the embedding's last

One all-reduce per bucket, not per parameter: a collective has a fixed cost (~tens of microseconds),
so a few large messages beat hundreds of small ones.

Overlap (--overlap-grad-reduce). Gradient accumulation means only the *last* micro-batch's backward
completes the gradients; earlier micro-batches communicate nothing. During that last backward, as soon
as every parameter of a bucket has its gradient, the bucket's all-reduce starts asynchronously, while the
backward carries on with the earlier layers:

    compute:  | backward layers 23..20 | backward 19..16 | backward 15..12 | ... | embedding |
    network:                            | all-reduce b0  | all-reduce b1   | ... | b_k | wait -> optimizer

Without overlap every bucket is reduced after the backward (the same numbers, later). finish() launches
what has not started and waits for every handle before the optimizer reads the gradients.

Averaging: each bucket is multiplied by 1/DP, then summed by the collective (Megatron's default; its
--ddp-average-in-collective asks the collective to average instead: the same result).

ZeRO-1 (--use-distributed-optimizer). Every bucket is padded to a multiple of DP and cut in DP equal
shards; rank r owns shard r. The all-reduce becomes a reduce-scatter (rank r receives only the sum of
shard r: half the bytes of an all-reduce), rank r updates only its shard of the fp32 master weights and
Adam moments (minibert.training.optim), and an all-gather of the parameter buffer gives every rank the whole
updated model:

    bytes per parameter:  16-bit param 2 + fp32 grad 4 + fp32 master 4 + Adam m 4 + Adam v 4  = 18
    with ZeRO-1:          2 + 4 + 12 / DP                     (master and moments are divided by DP)

The parameters themselves live in a flat buffer per bucket too (`param.data` becomes a view of it), so
that all-gather writes the model in place.

What production does: Megatron's DistributedDataParallel wraps the module and also shards gradients
(ZeRO-2, --overlap-param-gather, FSDP); we keep ZeRO-1, its --use-distributed-optimizer."""
import math

import torch
import torch.distributed as dist

DEFAULT_BUCKET_SIZE = 40_000_000  # elements; Megatron's default is max(40M, 1M x DP)
# torch 2.13 renames the flat-tensor collectives (the old names warn); torch 2.11 has only the old ones
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


# Each parameter starts at a multiple of 64 elements of its bucket (128 bytes in bf16), as in Megatron's
# buffers. Packed back to back, a 2-element bias would leave every later weight 4 bytes off a 16-byte
# boundary, and cuBLAS then takes slow matmul kernels for it: before this alignment most of BERT-base's
# matmul time went to them (the profile: bench/results/profile_steps_h200_2026-12-01.md, bench/notes/training.md).
ALIGN = 64


def aligned(offset, multiple=ALIGN):
    """offset rounded up to a multiple of `multiple` (ALIGN elements by default)."""
    return math.ceil(offset / multiple) * multiple


class Bucket:
    """A run of parameters whose gradients (fp32) and values (model dtype) share two flat buffers, each
    parameter starting at a multiple of ALIGN elements, the whole padded to a multiple of `shards` x ALIGN
    elements so that DP ranks own equal shards, each starting aligned too."""

    def __init__(self, named_params, shards: int, shard_index: int):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        starts = [0]
        for p in self.params:
            starts.append(aligned(starts[-1] + p.numel()))
        padded = aligned(starts[-1], shards * ALIGN)  # the shards start aligned too
        first = self.params[0]
        self.param_data = torch.zeros(padded, dtype=first.dtype, device=first.device)
        self.grad_data = torch.zeros(padded, dtype=torch.float32, device=first.device)
        self.ranges = []  # (start, end) of each parameter in the flat buffers
        with torch.no_grad():
            for p, offset in zip(self.params, starts):
                n = p.numel()
                self.param_data[offset:offset + n].copy_(p.data.reshape(-1))
                p.data = self.param_data[offset:offset + n].view_as(p)  # the parameter *is* the buffer slice
                p.main_grad = self.grad_data[offset:offset + n].view_as(p)
                self.ranges.append((offset, offset + n))
        size = padded // shards
        self.shard = (shard_index * size, (shard_index + 1) * size)  # this DP rank's [start, end)
        self.handle = None   # the async collective in flight, if any
        self.waiting = 0     # parameters whose last-micro-batch gradient has not arrived yet


class DataParallelGrads:
    """The gradient buffers of one model chunk and their reduction over the data-parallel group.

    Use per step: zero(); for each micro-batch: set_last_micro_batch(k == last); backward; accumulate();
    then finish() (all buckets reduced, handles waited on); with ZeRO-1 the optimizer calls
    gather_params() after its update."""

    def __init__(self, model, state, *, bucket_size=None, distributed_optimizer=False, overlap=False,
                 separate=()):
        self.group = state.group("data")
        self.dp = state.dp
        self.distributed_optimizer = distributed_optimizer
        self.overlap = overlap and self.dp > 1
        bucket_size = bucket_size or max(DEFAULT_BUCKET_SIZE, 1_000_000 * self.dp)
        shards, index = (self.dp, state.dp_rank) if distributed_optimizer else (1, 0)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]  # the model's order
        self.buckets, run, run_size = [], [], 0
        for name, p in reversed(named):  # backward order
            if name in separate:  # e.g. the tied word embedding under pipelining: a bucket of its own
                self.buckets.append(Bucket([(name, p)], shards, index))
                continue
            run.append((name, p))
            run_size += p.numel()
            if run_size >= bucket_size:
                self.buckets.append(Bucket(run, shards, index))
                run, run_size = [], 0
        if run:
            self.buckets.append(Bucket(run, shards, index))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.sync_now = False
        if self.overlap:  # only then must a gradient be seen the moment it is ready
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._ready)
        # Where the overlap hook adds into main_grad before accumulate() runs, the buffers are zeroed
        # eagerly; otherwise the first fold copies (see above).
        self.copy_first = not self.overlap
        self.fresh = False  # True from zero() to the step's first fold: main_grad holds stale values

    def _ready(self, param):
        """--overlap-grad-reduce, last micro-batch: autograd has just made this parameter's gradient."""
        if not self.sync_now or param.grad is None:
            return  # accumulate() adds it after the backward
        param.main_grad.add_(param.grad)  # fp32 += 16-bit (or fp32)
        param.grad = None
        self._arrived(param)

    def _arrived(self, param):
        """The last micro-batch's gradient of `param` is in main_grad: start its bucket once all are."""
        bucket = self.bucket_of[id(param)]
        bucket.waiting -= 1
        if bucket.waiting == 0:  # every gradient of this bucket is final: send it now
            self._start(bucket)

    def accumulate(self):
        """After a micro-batch's backward: main_grad += grad for every parameter (main_grad = grad at the
        step's first), one multi-tensor call, not one Python hook per parameter (each a host call and a
        launch, which small models feel: bench/notes/training.md)."""
        pending = [p for p in self.params if p.grad is not None]
        if not pending:
            return  # e.g. scale_loss() before the step's first backward: nothing to fold yet
        if self.fresh:
            torch._foreach_copy_([p.main_grad for p in pending], [p.grad for p in pending])
            absent = [p.main_grad for p in self.params if p.grad is None]  # no gradient this time: zero it
            if absent:
                torch._foreach_zero_(absent)
            self.fresh = False
        else:
            torch._foreach_add_([p.main_grad for p in pending], [p.grad for p in pending])
        for p in pending:
            p.grad = None

    def set_last_micro_batch(self, is_last: bool):
        """Before a backward: is it the last micro-batch's (the one whose gradients are reduced)?"""
        self.sync_now = is_last and self.overlap
        if self.sync_now:
            for b in self.buckets:
                b.waiting = len(b.params)

    def _start(self, bucket):
        if self.group is None or bucket.handle is not None:
            return
        bucket.grad_data.mul_(1.0 / self.dp)  # then sum = mean over the replicas
        if self.distributed_optimizer:
            lo, hi = bucket.shard
            bucket.handle = reduce_scatter_single(bucket.grad_data[lo:hi], bucket.grad_data,
                                                       group=self.group, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad_data, group=self.group, async_op=True)

    def finish(self):
        """Reduce every bucket not yet started, then wait for all: the gradients are final after this."""
        self.accumulate()  # a backward the schedule did not fold in yet
        if self.fresh:  # no gradient arrived this step: the buffers must read as zeros
            for b in self.buckets:
                b.grad_data.zero_()
            self.fresh = False
        for b in self.buckets:
            self._start(b)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
        self.sync_now = False

    def zero(self):
        """Start a step's gradients: the buffers read as zeros once the first accumulate() has run."""
        if self.copy_first:
            self.fresh = True
            return
        for b in self.buckets:
            b.grad_data.zero_()

    def gather_params(self):
        """ZeRO-1, after the update: every rank's shard of the parameters -> the whole buffer, everywhere."""
        if self.group is None or not self.distributed_optimizer:
            return
        handles = [all_gather_single(b.param_data, b.param_data[b.shard[0]:b.shard[1]],
                                               group=self.group, async_op=True) for b in self.buckets]
        for h in handles:
            h.wait()


def finalize_model_grads(all_grads, state, shared_embedding=None):
    """After the backward of a step, before the optimizer, on every rank (Megatron's name):
    1. the data-parallel reduction of each model chunk;
    2. sequence parallelism: the parameters every tensor-parallel rank holds whole but applied to its own
       slice of the sequence (LayerNorms, row-parallel biases) got only that slice's gradient: sum them
       over the tensor-parallel group;
    3. pipelining: the tied word embedding's two copies (first and last stage) summed over the embedding
       group, so both take the same step and stay equal."""
    for grads in all_grads:
        grads.finish()
    tp_group = state.group("tensor")
    sliced = [p.main_grad for g in all_grads for p in g.params if getattr(p, "sequence_parallel", False)]
    if tp_group is not None and sliced:
        flat = torch.cat([t.reshape(-1) for t in sliced])  # one all-reduce for all of them
        dist.all_reduce(flat, group=tp_group)
        offset = 0
        for t in sliced:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    group = state.group("embedding")
    if shared_embedding is not None and group is not None:
        dist.all_reduce(shared_embedding.main_grad, group=group)
