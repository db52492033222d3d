"""The collectives of tensor parallelism as autograd functions: what each does forward, and backward.

Tensor parallelism (TP) splits one layer's matrices over the p ranks of a tensor-parallel group. Two
functions from the Megatron-LM paper carry a whole MLP (or attention block) across that split:

    X --f--> [X A_1 | ... | X A_p] --GeLU--> [Y_1 ... Y_p] --(Y_r B_r on rank r)--> sum_r --g--> Z

    f = copy_to_tensor_parallel_region       forward: identity       backward: all-reduce (sum)
    g = reduce_from_tensor_parallel_region   forward: all-reduce     backward: identity

f hands every rank the same input, so in the backward each rank holds only its part of dL/dX and the parts
are summed; g sums the partial outputs Y_r B_r, and the gradient of a sum reaches every term unchanged.

Sequence parallelism (--sequence-parallel) keeps the activations *between* the matrices (LayerNorm,
dropout, the residual) split along the sequence: each rank holds s/p positions. g becomes a reduce-scatter
(sum the partial outputs, keep my s/p positions) and f an all-gather (rebuild the whole sequence before
the next matrix), with the roles swapped in the backward. Same bytes on the wire as one all-reduce (an
all-reduce *is* a reduce-scatter followed by an all-gather), but LayerNorm and dropout work on 1/p of the
activations and store 1/p of them.

    gather_from_sequence_parallel_region   forward: all-gather (seq)   backward: reduce-scatter (seq)
    reduce_scatter_to_sequence_parallel    forward: reduce-scatter     backward: all-gather
    scatter_to_sequence_parallel_region    forward: keep my slice      backward: all-gather

A group of None means one rank: every function is then the identity. Tensors are [b, s, h] (Megatron
uses [s, b, h]); the sequence is dim 1, so gathering along it needs a transpose (the collectives work on
the leading dim)."""
import torch
import torch.distributed as dist

from minibert.parallel.data_parallel import all_gather_single, reduce_scatter_single


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x, group):
    if group is not None:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
    return x


def _split_last(x, group):
    """My block of the last dim."""
    return x.chunk(_size(group), dim=-1)[_rank(group)].contiguous()


def _gather_last(x, group):
    """[..., n] on every rank -> [..., p * n], blocks in rank order."""
    p = _size(group)
    if p == 1:
        return x
    out = torch.empty((p * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)  # ranks stacked on dim 0
    all_gather_single(out, x.contiguous(), group=group)
    return torch.movedim(out.view(p, *x.shape), 0, -2).reshape(*x.shape[:-1], p * x.shape[-1])  # [..., p, n] -> [..., p*n]


def _gather_seq(x, group):
    """[b, s/p, h] on every rank -> [b, s, h], the ranks' slices in order."""
    p = _size(group)
    if p == 1:
        return x
    out = torch.empty((p * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)  # ranks stacked on dim 0
    all_gather_single(out, x.contiguous(), group=group)
    return out.view(p, *x.shape).transpose(0, 1).reshape(x.shape[0], p * x.shape[1], *x.shape[2:])  # [b, p, s/p, h] -> [b, s, h]


def _reduce_scatter_seq(x, group):
    """[b, s, h] partial sums on every rank -> [b, s/p, h]: the sum of my slice of the sequence."""
    p = _size(group)
    if p == 1:
        return x
    b, s = x.shape[:2]
    stacked = x.reshape(b, p, s // p, *x.shape[2:]).transpose(0, 1).contiguous()  # [p, b, s/p, h]
    out = torch.empty(stacked.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, stacked.view(p * b, *stacked.shape[2:]), group=group)  # rank r gets block r
    return out


def _split_seq(x, group):
    p = _size(group)
    return x if p == 1 else x.chunk(p, dim=1)[_rank(group)].contiguous()


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity in forward, all-reduce in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep my block of the last dim in forward, all-gather the blocks in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the blocks of the last dim in forward, keep my block of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence in forward. Backward: reduce-scatter, when every rank's use of the whole
    sequence contributed a *part* of the gradient (a column-parallel matrix follows); or just my slice,
    when every rank computed the same thing from it (replicated code follows, e.g. the heads)."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _split_seq(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep my slice of the sequence in forward (every rank has the whole), all-gather in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return x if group is None else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return x if group is None else _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    return x if group is None else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    return x if group is None else _GatherFromTensorParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group, grad_is_partial=True):
    return x if group is None else _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return x if group is None else _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return x if group is None else _ScatterToSequenceParallelRegion.apply(x, group)
