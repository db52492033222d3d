"""minibert/kernels/bias_gelu.py under the Triton interpreter (fp32, float64 references): the fused bias +
GeLU forward, its input gradient and its bias gradient against the plain twin F.gelu(y + b), over shapes
that end in partial row and column blocks; and the MLP with --bias-gelu-fusion against the plain MLP.
tests/gpu/test_gpu.py checks bf16 and fp16 on CUDA."""
import pytest
import torch

from minibert.kernels.bias_gelu import _tiles, bias_gelu, bias_gelu_reference


def run(fn, y, b, grad):
    y, b = y.clone().requires_grad_(), b.clone().requires_grad_()
    out = fn(y, b)
    out.backward(grad)
    return out.detach(), y.grad, b.grad


@pytest.mark.parametrize("shape", [(3, 5, 40), (37, 33), (1, 7)])
def test_forward_and_both_gradients_match_the_plain_twin(shape):
    block_m, block_n, _ = _tiles()
    g = torch.Generator().manual_seed(0)
    y = torch.randn(*shape, generator=g) * 3          # well into both tails of the GeLU
    b = torch.randn(shape[-1], generator=g)
    grad = torch.randn(*shape, generator=g)
    ours = run(bias_gelu, y, b, grad)
    expected = run(bias_gelu_reference, y.double(), b.double(), grad.double())
    for a, e, name in zip(ours, expected, ("out", "dy", "dbias")):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-5, msg=name)
    rows = y.numel() // shape[-1]
    assert rows % block_m or shape[-1] % block_n   # every shape crosses a block edge somewhere


def test_bad_inputs_name_the_shapes():
    with pytest.raises(ValueError, match=r"\[\.\.\., F\] and bias \[F\]"):
        bias_gelu(torch.zeros(2, 8), torch.zeros(7))
    with pytest.raises(ValueError, match="one dtype"):
        bias_gelu(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float64))


def test_mlp_with_the_fusion_equals_the_plain_mlp(monkeypatch):
    """The model's MLP with --bias-gelu-fusion (its GPU condition, fused_kernels_apply, forced on: the
    interpreter runs the kernel on the CPU) against the plain MLP with the same weights: output, input
    gradient and every parameter's gradient, the first dense's bias included."""
    import minibert.kernels.bias_gelu as kernel_module
    import minibert.model as model_module
    from minibert.config import Config
    cfg = Config(num_layers=1, hidden_size=24, num_attention_heads=2, ffn_hidden_size=40)
    calls = []
    monkeypatch.setattr(kernel_module, "bias_gelu", lambda y, b: calls.append(y.shape) or bias_gelu(y, b))
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        mlp = model_module.MLP(Config(**{**vars(cfg), "bias_gelu_fusion": fused}))
        monkeypatch.setattr(model_module, "fused_kernels_apply", lambda x: True)
        x = torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = mlp(x)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), x.grad] + [p.grad for p in mlp.parameters()])
    assert calls == [(3, 7, 40)]                     # the fused run, and only it, took the kernel
    assert len(results[1]) == 6 and all(g is not None for g in results[1])
    for plain, ours in zip(*results):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)


def test_another_tile_gives_the_same_numbers():
    """The launchers take the tile (bench/bias_gelu_bench.py --sweep times others): one with a single row a
    program, and one whose column block is wider than F, give the default tile's output and gradients."""
    from minibert.kernels.bias_gelu import backward_2d, forward_2d
    g = torch.Generator().manual_seed(0)
    y, da = torch.randn(37, 40, generator=g), torch.randn(37, 40, generator=g)
    b = torch.randn(40, generator=g)
    expected = [forward_2d(y, b, _tiles()), *backward_2d(y, b, da, _tiles())]
    for tile in ((1, 16, 1), (8, 64, 1)):
        for got, want in zip([forward_2d(y, b, tile), *backward_2d(y, b, da, tile)], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
