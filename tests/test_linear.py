"""minibert/linear.py: the written-out backward (bias gradient as a GEMV) against autograd's F.linear.

On the CPU `linear` is F.linear itself, so these tests call LinearFunction directly, in float64 (a
matmul against a sum differs only by rounding there); tests/gpu/test_gpu.py checks it in bf16 on CUDA
through the model."""
import pytest
import torch
import torch.nn.functional as F

from minibert.linear import Linear, LinearFunction, bias_grad, linear, written_out_backward


def grads(fn, x, w, b, dy):
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(*leaves, *([] if b is not None else [None]))
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape,bias", [((3, 5, 7), True), ((11, 7), True), ((2, 3, 7), False)])
def test_linear_function_matches_autograd(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(4, 7, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(*shape[:-1], 4, generator=g, dtype=torch.float64)
    ours = grads(LinearFunction.apply, x, w, b, dy)
    theirs = grads(F.linear, x, w, b, dy)
    assert len(ours) == len(theirs) == (4 if bias else 3)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_bias_grad_is_the_row_sum():
    dy = torch.randn(300, 9, dtype=torch.float64)
    torch.testing.assert_close(bias_grad(dy), dy.sum(0), rtol=1e-12, atol=1e-12)


def test_only_input_gradient_when_parameters_are_frozen():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    LinearFunction.apply(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 7))


def test_plain_on_the_cpu_and_the_module_keeps_nn_linear_names():
    x = torch.randn(2, 7)
    layer = Linear(7, 4)
    assert not written_out_backward(x, layer.weight)              # CPU: F.linear itself
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))
