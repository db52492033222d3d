"""Tensor-parallel layers: one matrix split over the p ranks of a tensor-parallel group.

    ColumnParallelLinear   Y = X A,  A = [A_1 ... A_p] (output features split)     rank r: Y_r = X A_r
    RowParallelLinear      Y = X A,  A = [A_1; ...; A_p] (input features split)    rank r: X_r A_r, then sum
    VocabParallelEmbedding the word table split by rows: rank r looks up the ids in its block, zeros
                           elsewhere, and the sum over ranks is the embedding
    VocabParallelDecoder   logits for this rank's block of the vocab (the tied LM head)
    vocab_parallel_cross_entropy   the loss from those blocks, never gathering the full logits

A column-parallel matrix followed by a row-parallel one needs no communication in between: rank r's
Y_r is exactly the input block the row-parallel matrix wants. That is why the MLP is (column, row) and
attention is (QKV column-parallel by heads, output projection row-parallel): one all-reduce each.

Each weight remembers which block of the full tensor it is (partition_dim, partition_index,
partition_count, full_shape: Megatron's tensor_model_parallel / partition_dim attributes), so the init
draws the full tensor from its seed and keeps the block (minibert.model.init_weights.init_parameters), and checkpoint
conversion can reassemble it. A parameter that every rank holds whole (a LayerNorm, a row-parallel bias)
carries no such mark.

Sequence parallelism: a column-parallel layer receives [b, s/p, h] and all-gathers the sequence before
its matmul; in the backward it gathers the input *again* instead of having kept the gathered copy (the
activation memory is what sequence parallelism saves), and reduce-scatters the input gradient. A
row-parallel layer reduce-scatters its output instead of all-reducing it."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minibert.parallel.mappings import (
    _gather_seq,
    _rank,
    _reduce_scatter_seq,
    _size,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def mark_sharded(param, dim, group, full_shape):
    """Record that `param` is block `rank` of `size` of a tensor of `full_shape`, cut along `dim`."""
    param.partition_dim, param.partition_index, param.partition_count = dim, _rank(group), _size(group)
    param.full_shape = tuple(full_shape)


class _LinearWithSequenceGather(torch.autograd.Function):
    """Y = all_gather_seq(X) W^T + b, storing only X (this rank's s/p positions); backward re-gathers X
    for dW and reduce-scatters dX (Megatron's LinearWithGradAccumulationAndAsyncCommunication)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_gather_seq(x, group), weight, bias)  # [b, s, h] @ [h, n/p] -> [b, s, n/p]

    @staticmethod
    def backward(ctx, grad):  # grad [b, s, n/p]
        x, weight = ctx.saved_tensors
        total = _gather_seq(x, ctx.group)  # gathered again, not kept from the forward
        grad_input = _reduce_scatter_seq(grad.matmul(weight), ctx.group)  # [b, s, h] partial -> [b, s/p, h]
        grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None


class ColumnParallelLinear(nn.Module):
    """[..., in] -> [..., out / p]: this rank's output features (gather_output=True: all of them)."""

    def __init__(self, in_features, out_features, group, bias=True, gather_output=False,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        p = _size(group)
        if out_features % p:
            raise ValueError(f"{out_features} output features do not split over {p} tensor-parallel ranks")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // p, in_features, device=device, dtype=dtype))
        mark_sharded(self.weight, 0, group, (out_features, in_features))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // p, device=device, dtype=dtype))
            mark_sharded(self.bias, 0, group, (out_features,))

    def forward(self, x):
        if self.sequence_parallel and self.group is not None:
            y = _LinearWithSequenceGather.apply(x, self.weight, self.bias, self.group)
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)  # f, then X A_r
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.group)
        return y


class RowParallelLinear(nn.Module):
    """[..., in / p] (this rank's input features, as a column-parallel layer leaves them) -> [..., out],
    summed over the ranks (g); with sequence parallelism reduce-scattered to [b, s/p, out]. The bias is
    whole on every rank and added once, after the sum."""

    def __init__(self, in_features, out_features, group, bias=True, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        p = _size(group)
        if in_features % p:
            raise ValueError(f"{in_features} input features do not split over {p} tensor-parallel ranks")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // p, device=device, dtype=dtype))
        mark_sharded(self.weight, 1, group, (out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # each rank adds it on its own positions: grads summed over TP

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)  # X_r A_r
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.group)  # g: sum over the ranks
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """tokens [b, s] -> [b, s, h]. Rank r holds rows [r V/p, (r+1) V/p) of the (padded) table: it looks
    up the tokens in its range, writes zeros for the others, and the all-reduce (g) adds the ranks up:
    exactly one rank contributes each token's row."""

    def __init__(self, num_embeddings, embedding_dim, group, device=None, dtype=None):
        super().__init__()
        p = _size(group)
        if num_embeddings % p:
            raise ValueError(f"a vocab of {num_embeddings} rows does not split over {p} ranks")
        self.group = group
        self.num_embeddings = num_embeddings
        rows = num_embeddings // p
        self.vocab_start = _rank(group) * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        mark_sharded(self.weight, 0, group, (num_embeddings, embedding_dim))

    def forward(self, tokens):
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # another rank's tokens
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h]
        x = x.masked_fill(outside[..., None], 0.0)
        return reduce_from_tensor_parallel_region(x, self.group)


class VocabParallelDecoder(nn.Module):
    """The tied LM head under TP: x [..., h] @ (this rank's block of the word table)^T + its bias block
    -> logits [..., V_padded / p]. f on the input: each rank's dL/dx covers only its vocab block, and the
    backward sums them. Padded vocab rows are masked in vocab_parallel_cross_entropy."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x, weight, bias):
        x = copy_to_tensor_parallel_region(x, self.group)
        return F.linear(x, weight, bias)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """CE from logits split by vocab blocks, with two small all-reduces of [n] numbers (MAX, then SUM):

        m = max_v z_v                 all-reduce MAX   (for stability: exp(z - m) <= 1)
        S = sum_v exp(z_v - m)        one all-reduce SUM of S and t, stacked [2, n]
        t = z_label - m                 (only the rank holding the label's column adds its t; the others 0)
        loss = log S - t
        correct = (t == 0)            the label's logit is the global max: no collective of its own

    Three numbers per token, in two calls. t is exactly 0 when z_label == m and nonzero otherwise (fp32
    subtraction of two different numbers is never 0), and the sum over ranks adds only zeros to it, so
    every rank gets the one-process answer of label_is_max. Returns (loss, correct); correct has no gradient.
    backward: dL/dz_v = softmax_v - [v == label], each rank for its own block, no communication."""

    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size):
        z = logits.float()  # [n, V/p]
        columns = vocab_start + torch.arange(z.shape[-1], device=z.device)
        z = z.masked_fill(columns >= vocab_size, float("-inf"))  # Megatron's padding rows never count
        m = z.max(dim=-1).values  # [n]
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m[:, None]
        local = labels - vocab_start
        mine = (local >= 0) & (local < z.shape[-1])  # labels in this rank's block (never -1)
        target = torch.where(mine, z.gather(1, local.clamp(0, z.shape[-1] - 1)[:, None]).squeeze(1),
                             torch.zeros_like(m))
        exp = z.exp()
        total = exp.sum(dim=-1)
        if group is not None:
            stats = torch.stack([total, target])  # one all-reduce for both sums
            dist.all_reduce(stats, group=group)
            total, target = stats[0], stats[1]
        valid = labels != -1
        loss = torch.where(valid, total.log() - target, torch.zeros_like(total))
        correct = valid & (target == 0)  # z_label == m: the label is the argmax
        ctx.save_for_backward(exp.div_(total[:, None]), local, mine, valid)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad, grad_correct):  # grad [n]
        softmax, local, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.nonzero(mine, as_tuple=True)[0]
        g[rows, local[rows]] -= 1.0
        g.mul_((grad * valid)[:, None])
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits, labels, group, vocab_start, vocab_size, with_correct=False):
    """logits [n, V_padded / p] (this rank's vocab block), labels [n] (-1: ignored) -> loss [n] (fp32),
    the same on every rank of the group; equal to F.cross_entropy over the real vocab. with_correct=True:
    -> (loss, correct bool [n]), correct = the label's logit is the largest of the real vocab
    (minibert.model.loss.label_is_max on the whole logits), from the max the loss all-reduces anyway."""
    loss, correct = _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size)
    return (loss, correct) if with_correct else loss
