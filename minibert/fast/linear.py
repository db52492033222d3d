"""The Linear layer with its backward written out, so that the bias gradient is a matrix product.

    y = x W^T + b          x [..., in], W [out, in], b [out]
    dx = dy W              dW = dy^T x             db = sum of dy over every row

Autograd's own backward of F.linear computes the same three, the bias gradient with a reduction kernel
(`dy.sum(0)`). That sum is the one part of the three that is not a matmul, and it is slow for BERT's
shapes: the same sum written as a matrix-vector product with a vector of ones, db = dy^T 1, runs as a
cuBLAS GEMV, which was faster at every width of BERT-large's and BERT-base's gradients (chapter 8 and
bench/notes/training.md, "After alignment"). Both accumulate in fp32 and round once to bf16.

apply(chunk) swaps, from outside, every module of a built model whose forward is a plain linear (the
model's nn.Linear layers, the tied LM decoder, and their tensor-parallel twins) for a subclass whose
forward calls `linear` below. `linear` takes the written-out backward on CUDA tensors in fp16/bf16 with
autocast off (a custom autograd Function would have to handle autocast itself), and is F.linear
everywhere else, the CPU included: the plain twin. tests/test_linear.py checks that the two give the
same gradients."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from minibert.model.bert import TiedDecoder
from minibert.parallel.layers import ColumnParallelLinear, VocabParallelDecoder
from minibert.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
)


def bias_grad(grad_2d):
    """[rows, out] -> [out]: the sum over rows, as the product grad^T @ ones (a GEMV)."""
    return torch.mv(grad_2d.t(), grad_2d.new_ones(grad_2d.shape[0]))


class LinearFunction(torch.autograd.Function):
    """F.linear, with the backward above. Saves x and W, as autograd's F.linear does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)  # the bias is added in the matmul's epilogue

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [rows, out]
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = grad_2d.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = bias_grad(grad_2d) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def written_out_backward(x, weight) -> bool:
    """Where `linear` uses LinearFunction: CUDA tensors in fp16/bf16, one dtype, autocast off."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and not torch.is_autocast_enabled("cuda"))


def linear(x, weight, bias=None):
    """y = x W^T + b, as F.linear; on the GPU in 16-bit its bias gradient is a GEMV."""
    if written_out_backward(x, weight):
        return LinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Decoder(TiedDecoder):
    def forward(self, x, weight, bias):
        logits = linear(x.reshape(-1, x.shape[-1]), weight, bias)
        return logits.view(*x.shape[:-1], -1)[..., :self.vocab_size]


class ColumnLinear(ColumnParallelLinear):
    """Without sequence parallelism (whose gather has a backward of its own): f, then `linear`."""

    def forward(self, x):
        if self.sequence_parallel and self.group is not None:
            return super().forward(x)
        y = linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class VocabDecoder(VocabParallelDecoder):
    def forward(self, x, weight, bias):
        return linear(copy_to_tensor_parallel_region(x, self.group), weight, bias)


SWAPS = {nn.Linear: Linear, TiedDecoder: Decoder, ColumnParallelLinear: ColumnLinear,
         VocabParallelDecoder: VocabDecoder}


def apply(chunk):
    """Every plain linear module of a built model chunk -> its twin above (parameters and names kept)."""
    for module in chunk.modules():
        swap = SWAPS.get(type(module))
        if swap is not None:
            module.__class__ = swap
    return chunk
