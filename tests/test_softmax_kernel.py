"""The fused scale-mask-softmax kernel against PyTorch, on CPU through the Triton interpreter (conftest).

The oracle is written here, in float64 on the upcast inputs, as explicit exp-and-normalise (not the
module's own reference): y = exp(z - max) * keep / sum(exp(z - max) * keep), z = x * scale, and 0 on rows
with every key masked. Its gradient comes from float64 autograd."""
import warnings

import pytest
import torch

from minibert.kernels.softmax import (
    MAX_ONE_PASS_BLOCK,
    SoftmaxConfig,
    default_config,
    fused_scale_mask_softmax,
    softmax_reference,
)
from tests.conftest import run_without_interpreter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Forward: the output is rounded once to its dtype (half an ulp: 2^-24, 2^-11, 2^-8 relative).
Y_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=1e-3, atol=1e-6),
         torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}
# Backward: dx = scale * y * (dy - sum(y dy)) uses y rounded to its dtype, so errors scale with max |dx|.
DX_TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def oracle(x, mask, scale):
    """float64 softmax over the last dim of x * scale with masked keys dropped; 0 on fully masked rows."""
    z = x.double() * scale
    keep = torch.ones_like(z) if mask is None else (~mask).double().expand_as(z)
    z_max = z.masked_fill(keep == 0, float("-inf")).amax(dim=-1, keepdim=True)
    z_max = torch.where(torch.isinf(z_max), torch.zeros_like(z_max), z_max).detach()  # any shift is exact
    e = torch.exp(z - z_max) * keep
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def make_mask(kind, b, heads, sq, sk, generator):
    """key: [b,1,1,sk] padding (each sequence keeps a random prefix of >= 1 key); query: [b,1,sq,sk];
    full: [b,heads,sq,sk]; none: None."""
    if kind == "none":
        return None
    if kind == "key":
        lengths = torch.randint(1, sk + 1, (b,), generator=generator)
        return (torch.arange(sk)[None, :] >= lengths[:, None])[:, None, None, :]
    shape = (b, 1, sq, sk) if kind == "query" else (b, heads, sq, sk)
    return torch.rand(shape, generator=generator) < 0.4


def check(x, mask, scale, dtype, config=None, dy=None):
    """Forward and backward of the kernel vs the float64 oracle on the same (rounded) inputs."""
    x = x.detach().requires_grad_()
    y = fused_scale_mask_softmax(x, mask, scale, config=config)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    x64 = x.detach().double().requires_grad_()
    y64 = oracle(x64, mask, scale)
    torch.testing.assert_close(y.double(), y64, **Y_TOL[dtype])
    if dy is None:
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y.backward(dy)
    y64.backward(dy.double())
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    tol = DX_TOL[dtype] * x64.grad.abs().max().item() + 1e-30
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=DX_TOL[dtype], atol=tol)
    return y, x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk", [1, 7, 100, 384, 513])
@pytest.mark.parametrize("mask_kind", ["key", "query", "full", "none"])
def test_matches_float64_oracle(dtype, sk, mask_kind):
    g = torch.Generator().manual_seed(sk)
    b, heads, sq = 2, 3, 3   # heads * sq = 9: the default tile never divides it, so tiles straddle batches
    x = (torch.randn(b, heads, sq, sk, generator=g) * 3).to(dtype)
    check(x, make_mask(mask_kind, b, heads, sq, sk, g), 0.37, dtype)


@pytest.mark.parametrize("config", [
    SoftmaxConfig(rows=2, num_warps=1),                       # 2 divides heads*sq = 6: one mask row per tile
    SoftmaxConfig(rows=4, num_warps=2),                       # 4 does not: tiles straddle batches
    SoftmaxConfig(rows=2, num_warps=1, block=32),             # long-row path: 4 chunks of 32 for sk = 100
    SoftmaxConfig(rows=4, num_warps=1, block=16),             # chunks + straddling tiles
    SoftmaxConfig(rows=1, num_warps=1, programs_per_sm=1),    # persistent grid: 2 programs loop over tiles
    SoftmaxConfig(rows=2, num_warps=1, block=32, programs_per_sm=2, loop_stages=2),
], ids=str)
@pytest.mark.parametrize("mask_kind", ["key", "query"])
def test_configs(config, mask_kind):
    """Every code path the configs select: tile sizes, per-batch vs per-row mask, chunked rows, persistence."""
    g = torch.Generator().manual_seed(0)
    b, heads, sq, sk = 3, 2, 3, 100
    x = torch.randn(b, heads, sq, sk, generator=g) * 3
    mask = make_mask(mask_kind, b, heads, sq, sk, g)
    mask[1] = True                                             # one batch fully masked
    y, dx = check(x, mask, 0.5, torch.float32, config=config)
    assert (y[1] == 0).all() and (dx[1] == 0).all()


def test_long_rows_loop_over_chunks():
    """A row longer than the largest single block goes through the chunked two-pass kernels by default."""
    sk = MAX_ONE_PASS_BLOCK + 1000
    assert default_config(sk).block < sk
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 1, sk, generator=g) * 5
    mask = torch.rand(1, 1, 1, sk, generator=g) < 0.5
    check(x, mask, 0.8, torch.float32)
    check(x.to(torch.bfloat16), mask, 0.8, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_give_zero_not_nan(dtype):
    b, heads, sq, sk = 2, 2, 4, 7
    x = torch.randn(b, heads, sq, sk).to(dtype)
    mask = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    mask[0, :, 1] = True                                       # query 1 of batch 0 sees no key
    mask[1] = True                                             # batch 1 sees nothing at all
    y, dx = check(x, mask, 1.0, dtype)
    assert (y[0, :, 1] == 0).all() and (y[1] == 0).all() and (dx[1] == 0).all()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[0, :, 0].float().sum(-1), torch.ones(heads), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("scale", [1.0, 0.125, 3.0, -0.5, 0.0])
def test_scales(scale):
    x = torch.randn(2, 2, 3, 50) * 4
    mask = torch.rand(2, 1, 1, 50) < 0.3
    check(x, mask, scale, torch.float32)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(0)
    mask = make_mask("key", 2, 2, 5, 40, g)
    # Rows contiguous, tensor not (every other head of a wider tensor): read in place through strides.
    wide = torch.randn(2, 4, 5, 40, generator=g)
    check(wide[:, ::2], mask, 0.3, torch.float32)
    # Rows not contiguous (a transposed view): copied first, same result.
    transposed = torch.randn(2, 2, 40, 5, generator=g).transpose(-1, -2)
    assert transposed.stride(-1) != 1
    check(transposed, mask, 0.3, torch.float32)
    # A non-contiguous incoming gradient and a mask that is an expanded view.
    dy = torch.randn(2, 2, 40, 5, generator=g).transpose(-1, -2)
    check(torch.randn(2, 2, 5, 40, generator=g), mask.expand(2, 2, 5, 40), 0.3, torch.float32, dy=dy)
    dy_strided = torch.randn(2, 4, 5, 40, generator=g)[:, 1::2]
    check(torch.randn(2, 2, 5, 40, generator=g), mask, 0.3, torch.float32, dy=dy_strided)


def test_gradcheck_fp32():
    """Finite differences of the kernel's own forward vs its backward (fp32, so loose tolerances)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 3, 7, generator=g, requires_grad=True)
    mask = torch.rand(1, 1, 3, 7, generator=g) < 0.3
    mask[0, 0, 2] = True
    with warnings.catch_warnings():  # gradcheck warns that the input is not float64: the kernel's widest is fp32
        warnings.simplefilter("ignore", UserWarning)
        assert torch.autograd.gradcheck(lambda t: fused_scale_mask_softmax(t, mask, 0.7), (x,),
                                        eps=1e-3, atol=1e-3, rtol=1e-2)


def test_lesson_reference_matches_oracle():
    """softmax_reference (the lesson's eager chain, also the benchmark's oracle) is right, also when fully masked."""
    x = torch.randn(2, 2, 3, 9, dtype=torch.float64)
    mask = torch.rand(2, 1, 3, 9) < 0.4
    mask[1, :, 0] = True
    torch.testing.assert_close(softmax_reference(x, mask, 0.6), oracle(x, mask, 0.6))
    torch.testing.assert_close(softmax_reference(x, None, 0.6), oracle(x, None, 0.6))


def test_empty_and_dtype_preserved():
    x = torch.randn(2, 2, 0, 8, dtype=torch.float16, requires_grad=True)
    y = fused_scale_mask_softmax(x, None, 1.0)
    assert y.shape == x.shape and y.dtype == torch.float16
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("scores, mask, scale, error, words", [
    (torch.zeros(1, 1, 2, 4, dtype=torch.int64), None, 1.0, TypeError, "float32, float16 or bfloat16"),
    (torch.zeros(1, 1, 2, 4, dtype=torch.float64), None, 1.0, TypeError, "float32, float16 or bfloat16"),
    (torch.zeros(2, 4), None, 1.0, ValueError, "4-D [b, heads, sq, sk]"),
    (torch.zeros(2, 3, 4, 5), torch.zeros(2, 1, 1, 5, dtype=torch.int32), 1.0, TypeError, "bool tensor"),
    (torch.zeros(2, 3, 4, 5), torch.zeros(2, 1, 1, 6, dtype=torch.bool), 1.0, ValueError, "[2,1,1,5] (key padding)"),
    (torch.zeros(2, 3, 4, 5), torch.zeros(3, 1, 1, 5, dtype=torch.bool), 1.0, ValueError, "does not broadcast"),
    (torch.zeros(2, 3, 4, 5), torch.zeros(1, 2, 3, 4, 5, dtype=torch.bool), 1.0, ValueError, "does not broadcast"),
    (torch.zeros(2, 3, 4, 5), None, torch.tensor(1.0), TypeError, "scale must be a Python float"),
], ids=["int", "float64", "2d", "int-mask", "mask-sk", "mask-batch", "mask-5d", "tensor-scale"])
def test_unsupported_inputs_raise_one_clear_error(scores, mask, scale, error, words):
    with pytest.raises(error) as info:
        fused_scale_mask_softmax(scores, mask, scale)
    assert words in str(info.value)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="powers of 2"):
        fused_scale_mask_softmax(torch.zeros(1, 1, 2, 4), None, 1.0, config=SoftmaxConfig(rows=3, num_warps=1))


def test_cpu_without_interpreter_names_the_fix():
    """Without TRITON_INTERPRET a CPU tensor cannot run a Triton kernel: say where it can run."""
    code = ("from minibert.kernels.softmax import fused_scale_mask_softmax\n"
            "try:\n    fused_scale_mask_softmax(torch.zeros(1, 1, 2, 4), None, 1.0)\n"
            "except ValueError as e:\n    print(e)\n")
    out = run_without_interpreter(code)
    assert "runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr
