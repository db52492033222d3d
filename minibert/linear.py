"""The Linear layer with its backward written out, so that the bias gradient is a matrix product.

    y = x W^T + b          x [..., in], W [out, in], b [out]
    dx = dy W              dW = dy^T x             db = sum of dy over every row

Autograd's own backward of F.linear computes the same three, the bias gradient with a reduction kernel
(`dy.sum(0)`). That sum is the one part of the three that is not a matmul, and on the H200 it is slow
for these shapes: summing a [16384, 4096] bf16 gradient (BERT-large's MLP, b32 s512) took 47.0 us, and
the same sum written as a matrix-vector product with a vector of ones, db = dy^T 1, which cuBLAS runs as
a GEMV, took 35.7 us; at 1024 columns 27.3 against 9.7 us, at 3072 40.6 against 28.3 (CUDA-graph timing,
2026-12-02 01:18 UTC; bench/notes-training.md). Both accumulate in fp32 and round once to bf16.
Per BERT-large step (4 biases in each of 24 layers) that is about 3.4 ms against 2.0.

The product with ones runs where the fused kernels do (fused_kernels_apply: CUDA, fp16/bf16, and no
autocast, which a custom autograd Function would have to handle): everywhere else, the CPU included,
`linear` is plain F.linear, and tests/test_linear.py checks that the two give the same gradients."""
import torch
import torch.nn as nn
import torch.nn.functional as F


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
    """y = x W^T + b, as F.linear; on the GPU in 16-bit its bias gradient is a GEMV (see above)."""
    if written_out_backward(x, weight):
        return LinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and init) whose forward is `linear`."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
