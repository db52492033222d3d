"""minibert/fast/linear.py: the written-out backward (bias gradient as a GEMV) against autograd's F.linear.

On the CPU `linear` is F.linear itself, so these tests call LinearFunction directly, in float64 (a
matmul against a sum differs only by rounding there); tests/gpu/test_gpu.py checks it in bf16 on CUDA
through the model."""
import pytest
import torch
import torch.nn.functional as F

import minibert.fast.linear as linear_module
from minibert.fast.linear import (
    Decoder,
    Linear,
    LinearFunction,
    apply,
    bias_grad,
    written_out_backward,
)


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


def test_apply_swaps_every_plain_linear_and_keeps_the_models_numbers(monkeypatch):
    """apply() gives every nn.Linear and the tied decoder their twins (names and parameters kept). On the CPU
    `linear` is F.linear itself; forced onto LinearFunction (as a GPU in 16-bit is), the model's loss and
    gradients equal the plain model's up to rounding: the swap wires every layer right."""
    from minibert.config import Config
    from minibert.model.bert import BertModel, TiedDecoder

    def loss_and_grads(model):
        g = torch.Generator().manual_seed(3)
        text = torch.randint(0, 100, (2, 16), generator=g)
        out = model(text, padding_mask=torch.zeros(2, 16, dtype=torch.bool))
        (out.lm_logits.pow(2).mean() + out.binary_logits.sum()).backward()
        return {n: p.grad for n, p in model.named_parameters()}

    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                 hidden_dropout=0.0, attention_dropout=0.0, attention_backend="local")
    plain, fast = BertModel(cfg).double(), BertModel(cfg).double()
    x = torch.randn(2, 7)
    assert not written_out_backward(x, torch.randn(4, 7))  # CPU: F.linear itself
    apply(fast)
    linears = [m for m in fast.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Linear for m in linears) and type(fast.lm_head.decoder) is Decoder
    assert isinstance(fast.lm_head.decoder, TiedDecoder) and list(fast.state_dict()) == list(plain.state_dict())
    taken = []
    monkeypatch.setattr(linear_module, "written_out_backward", lambda x, w: taken.append(1) or True)
    expected, grads = loss_and_grads(plain), loss_and_grads(fast)
    assert len(taken) == len(linears) + 1  # every linear and the decoder took LinearFunction
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-10, atol=1e-12, msg=name)
