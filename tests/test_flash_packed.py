"""The packed-QKV flash attention (gradients written into one [b, s, heads, 3, d] buffer) against the plain
flash attention on the unbound views: the same outputs and gradients, bit for bit (same kernels), with
padding and dropout. Runs in the Triton interpreter on CPU."""
import torch

from minibert.kernels.flash_attention import flash_attention
from minibert.kernels.flash_attention_packed import flash_attention_qkv


def test_packed_equals_plain_with_padding_and_dropout():
    g = torch.Generator().manual_seed(0)
    b, s, heads, d = 2, 40, 2, 16
    qkv = torch.randn(b, s, heads, 3, d, generator=g).requires_grad_()
    padding = torch.arange(s)[None, :] >= torch.tensor([40, 23])[:, None]
    grad = torch.randn(b, heads, s, d, generator=g)
    out = flash_attention_qkv(qkv, padding, dropout_p=0.2, seed=5)
    out.backward(grad)
    plain_qkv = qkv.detach().clone().requires_grad_()
    q, k, v = plain_qkv.permute(3, 0, 2, 1, 4).unbind(0)
    reference = flash_attention(q, k, v, padding, dropout_p=0.2, seed=5)
    reference.backward(grad)
    assert torch.equal(out, reference)
    assert torch.equal(qkv.grad, plain_qkv.grad) and qkv.grad.shape == (b, s, heads, 3, d)
