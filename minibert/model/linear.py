"""The Linear layer with its backward written out, so that the bias gradient is a matrix product.

    y = x W^T + b          x [..., in], W [out, in], b [out]
    dx = dy W              dW = dy^T x             db = sum of dy over every row

Autograd's own backward of F.linear computes the same three, the bias gradient with a reduction kernel
(`dy.sum(0)`). That sum is the one part of the three that is not a matmul, and it is slow for these
shapes: the same sum written as a matrix-vector product with a vector of ones, db = dy^T 1, which cuBLAS
runs as a GEMV, was faster at every width of BERT-large's and BERT-base's gradients (timed alone, and in
BERT-base steps: bench/notes-training.md, "After alignment"). Both accumulate in fp32 and round once to
bf16.

The product with ones runs where the fused kernels do (fused_kernels_apply: CUDA, fp16/bf16, and no
autocast, which a custom autograd Function would have to handle): everywhere else, the CPU included,
`linear` is plain F.linear, and tests/test_linear.py checks that the two give the same gradients.

Gradient-accumulation fusion (--gradient-accumulation-fusion, Megatron's flag; off by default here: in
whole steps it measured no gain above the run-to-run spread, bench/notes-training.md and chapter 8,
section 4.15). The trainer keeps each parameter's gradient in an fp32 `main_grad`
(minibert/parallel/data_parallel.py), and after every micro-batch adds the 16-bit `.grad` autograd made
into it: a pass over every parameter. With the fusion the weight gradient's matmul adds its product into
`main_grad` itself, in fp32 (`accumulate_weight_grad`), and returns no `.grad` at all; timed alone it ran
as fast as the plain bf16 matmul. The data-parallel buffers switch it on per parameter
(`weight.main_grad_added`, the callback that also counts the gradient as arrived for
--overlap-grad-reduce); a weight used twice in one step, the tied word embedding, is never fused
(`fuse_weight_grad=False`: its two gradients would be counted twice). Where a weight is marked,
`linear` takes LinearFunction on any device, the CPU included, so the CPU tests run this path too."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def fuses_weight_grad(weight) -> bool:
    """Does LinearFunction add this weight's gradient into its main_grad (see the module's docstring)?"""
    return getattr(weight, "main_grad_added", None) is not None


def accumulate_weight_grad(main_grad, grad_2d, x_2d):
    """main_grad += grad_2d^T x_2d in main_grad's dtype (fp32): the 16-bit product is never stored."""
    if main_grad.dtype == grad_2d.dtype:
        main_grad.addmm_(grad_2d.t(), x_2d)
    elif main_grad.is_cuda:  # bf16/fp16 inputs, fp32 accumulator and output: one cuBLAS call, in place
        torch.addmm(main_grad, grad_2d.t(), x_2d, out_dtype=main_grad.dtype, out=main_grad)
    else:                    # the CPU has no mixed-dtype addmm
        main_grad.add_(grad_2d.t().matmul(x_2d))


def bias_grad(grad_2d):
    """[rows, out] -> [out]: the sum over rows, as the product grad^T @ ones (a GEMV)."""
    return torch.mv(grad_2d.t(), grad_2d.new_ones(grad_2d.shape[0]))


class LinearFunction(torch.autograd.Function):
    """F.linear, with the backward above. Saves x and W, as autograd's F.linear does. fuse: may the weight
    gradient go straight into weight.main_grad (where the weight is marked for it)?"""

    @staticmethod
    def forward(ctx, x, weight, bias, fuse=False):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.fuse = bias is not None, fuse
        return F.linear(x, weight, bias)  # the bias is added in the matmul's epilogue

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [rows, out]
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            x_2d = x.reshape(-1, x.shape[-1])
            if ctx.fuse:
                accumulate_weight_grad(weight.main_grad, grad_2d, x_2d)
                weight.main_grad_added(weight)   # no .grad: the buffers count this gradient as arrived
            else:
                grad_w = grad_2d.t().matmul(x_2d)
        grad_b = bias_grad(grad_2d) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def written_out_backward(x, weight) -> bool:
    """Where `linear` uses LinearFunction: CUDA tensors in fp16/bf16, one dtype, autocast off."""
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and not torch.is_autocast_enabled("cuda"))


def linear(x, weight, bias=None, fuse_weight_grad=True):
    """y = x W^T + b, as F.linear; on the GPU in 16-bit its bias gradient is a GEMV, and where the weight
    is marked (and fuse_weight_grad) its gradient goes into its main_grad (see above)."""
    fuse = fuse_weight_grad and fuses_weight_grad(weight)
    if fuse or written_out_backward(x, weight):
        return LinearFunction.apply(x, weight, bias, fuse)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and init) whose forward is `linear`."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)
