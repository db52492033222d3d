"""The fused dropout + add + LayerNorm kernel against a float64 oracle, on CPU through the Triton interpreter
(conftest sets TRITON_INTERPRET=1).

The oracle is written here, not taken from the module: x = r + y * keep / (1 - p) in float64, rounded to the
kernel's dtype (the kernel stores x rounded and normalises that), then mean, biased variance and
(x - mean) / sqrt(var + eps) * w + b spelled out. Gradients come from float64 autograd; the rounding of x
passes gradients straight through, as the kernel's backward does. The keep mask is the kernel's own
(hidden_dropout_keep_mask); separate tests check that mask: its rate, its seeds, its counters.

bf16 under the interpreter: there is no dot in this kernel (the interpreter's bf16 dot is what is broken),
but Triton's interpreter casts fp32 -> bf16 by truncation (round toward zero), where a GPU rounds to
nearest. `BF16_TRUNCATES` probes that with a one-line cast kernel, and the oracle rounds x the same way.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from minibert.errors import UsageError
from minibert.fast.layer_norm import (
    Tile,
    _DropoutAddLayerNorm,
    dropout_add_layer_norm,
    dropout_add_layer_norm_reference,
    hidden_dropout_keep_mask,
)
from minibert.kernels.dropout import (
    dropout_mask,
    effective_dropout_p,
    reference_keep_mask,
)

EPS = 1e-5
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(3, 5, 32), (7, 100), (2, 768)]        # h = 32, 100, 768: powers of two and not
# (rtol, atol as a fraction of the largest expected value). Every output is computed in fp32 and rounded
# once to its dtype: under one ulp, i.e. 2^-7 relative for bf16 (8 significant bits, also when truncating)
# and 2^-10 for fp16. atol covers what fp32 arithmetic leaves on values that cancel (a gradient element near
# 0 is a difference of O(max) terms) and an x whose fp32 sum lands on the other side of a rounding boundary
# than the float64 one (its normed then moves by one ulp of x). fp32 itself: a few fp32 roundings, ~1e-7
# relative each (measured: at most 1.5e-7 of the 1e-6 allowed; bf16 60% of its tolerance, fp16 30%).
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (2 ** -7, 2 ** -8), torch.float16: (2 ** -10, 2 ** -11)}


@triton.jit
def _cast_kernel(SRC, DST):
    offsets = tl.arange(0, 2)
    tl.store(DST + offsets, tl.load(SRC + offsets).to(DST.dtype.element_ty))


def _bf16_truncates():
    """1 + 3/512 lies between the bf16 numbers 1 and 1 + 1/128, nearer the second."""
    src = torch.tensor([1 + 3 * 2 ** -9, -(1 + 3 * 2 ** -9)])
    dst = torch.empty(2, dtype=torch.bfloat16)
    _cast_kernel[(1,)](src, dst)
    return abs(dst[0].item()) == 1.0


BF16_TRUNCATES = _bf16_truncates()


def round_like_kernel(x64, dtype):
    x32 = x64.float()                                                    # the kernel's fp32 sum
    if dtype == torch.bfloat16 and BF16_TRUNCATES:
        return (x32.view(torch.int32) & -65536).view(torch.float32).double()   # keep the top 16 bits
    return x32.to(dtype).double()


def oracle(residual, y, weight, bias, keep, p, dtype):
    """float64 (x, normed); keep a bool mask of y's shape; x rounded to dtype, with an identity gradient."""
    x = residual + y * keep / (1 - effective_dropout_p(p))
    x = x + (round_like_kernel(x.detach(), dtype) - x.detach())
    if weight is None:
        return x, None
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return x, (x - mean) / torch.sqrt(var + EPS) * weight + bias


def make_inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    residual = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)     # a mean of 0.5: centring matters
    y = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)
    bias = (0.2 * torch.randn(h, generator=g)).to(dtype)
    return residual, y, weight, bias


def close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.double(), expected, rtol=rtol,
                               atol=atol * expected.abs().max().item() + 1e-30)


def check(shape, dtype, p, seed=3, ln=True, upstream=("x", "normed"), needs_grad=(True,) * 4, tiles=None):
    """Kernel forward and backward vs the oracle; upstream: which outputs get a random gradient."""
    residual, y, weight, bias = make_inputs(shape, dtype)
    if not ln:
        weight = bias = None
    leaves = [t if t is None else t.detach().requires_grad_(need) for t, need in
              zip((residual, y, weight, bias), needs_grad)]
    if tiles is None:
        x, normed = dropout_add_layer_norm(*leaves, EPS, p, seed)
    else:
        x, normed = _DropoutAddLayerNorm.apply(*leaves, EPS, p, seed, tiles)
    rows = residual.numel() // shape[-1]
    keep = hidden_dropout_keep_mask(rows, shape[-1], seed, p).view(shape)
    leaves64 = [t if t is None else t.detach().double().requires_grad_(need) for t, need in
                zip((residual, y, weight, bias), needs_grad)]
    x64, normed64 = oracle(*leaves64, keep, p, dtype)
    close(x, x64, dtype)
    assert (normed is None) == (not ln)
    if ln:
        close(normed, normed64, dtype)
    g = torch.Generator().manual_seed(1)
    outs, outs64, grads = [], [], []
    for name, out, out64 in (("x", x, x64), ("normed", normed, normed64)):
        if name in upstream and out64.requires_grad:                     # x needs residual or y
            grad = torch.randn(shape, generator=g).to(dtype)
            outs, outs64, grads = outs + [out], outs64 + [out64], grads + [grad]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(outs64, [grad.double() for grad in grads])
    for leaf, leaf64 in zip(leaves, leaves64):
        if leaf is not None and leaf.requires_grad and leaf64.grad is not None:
            close(leaf.grad, leaf64.grad, dtype)
        elif leaf is not None:
            assert leaf.grad is None
    return (x, normed), leaves


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(dtype, shape, p):
    """Pre-LN use: both outputs feed the loss; all four gradients."""
    check(shape, dtype, p)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_sees_the_rounded_x(dtype):
    """x = 64 + noise of std 0.5: one ulp of x is 0.5 in bf16 (1/16 in fp16), so normalising the fp32 sum
    instead of the stored x would move normed by up to half its std. p = 0: the sum of two bf16/fp16
    numbers is exact in fp32, so kernel and oracle round the very same value."""
    residual = torch.full((7, 100), 64.0, dtype=dtype)
    y = (0.5 * torch.randn(7, 100, generator=torch.Generator().manual_seed(0))).to(dtype)
    x, normed = dropout_add_layer_norm(residual, y, torch.ones(100, dtype=dtype), torch.zeros(100, dtype=dtype),
                                       EPS, 0.0, 0)
    x64, normed64 = oracle(residual.double(), y.double(), 1.0, 0.0, torch.ones(7, 100), 0.0, dtype)
    assert torch.equal(x.double(), x64)
    close(normed, normed64, dtype)


def test_widest_row():
    check((2, 8192), torch.float32, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_post_ln_grad_x_is_none(dtype):
    """Post-LN: only normed reaches the loss, so the backward gets grad_x = None."""
    check((7, 100), dtype, 0.1, upstream=("normed",))


def test_only_x_used_leaves_weight_grad_none():
    """grad_normed = None: d_total is grad_x, weight and bias get no gradient."""
    _, (residual, y, weight, bias) = check((7, 100), torch.float32, 0.1, upstream=("x",))
    assert weight.grad is None and bias.grad is None and residual.grad is not None


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_weight_none_is_dropout_add_only(p):
    check((3, 5, 32), torch.float32, p, ln=False, upstream=("x",))


@pytest.mark.parametrize("needs_grad", [(False, True, True, True), (True, False, True, True),
                                        (True, True, False, False), (False, False, True, False)], ids=str)
def test_inputs_that_need_no_grad(needs_grad):
    check((7, 100), torch.float32, 0.5, needs_grad=needs_grad)


def test_packed_rows_equal_leading_dims():
    """The mask and the math see [..., h] as flat rows: [3, 5, 32] gives the [15, 32] result, bit for bit."""
    (x, normed), leaves = check((3, 5, 32), torch.float32, 0.5)
    (x_flat, normed_flat), flat_leaves = check((15, 32), torch.float32, 0.5)
    assert torch.equal(x.view(15, 32), x_flat) and torch.equal(normed.view(15, 32), normed_flat)
    for leaf, flat in zip(leaves, flat_leaves):
        assert torch.equal(leaf.grad.reshape(flat.grad.shape), flat.grad)


def test_mask_does_not_depend_on_tiles():
    """Two tilings (rows per block, backward grid) draw the same mask: x and the input gradients are the same
    bits; the weight gradient is summed in another order, so only close."""
    small = (Tile(1, 1), Tile(1, 1, programs_per_sm=1))
    large = (Tile(8, 2), Tile(4, 1, programs_per_sm=3))
    (x_a, normed_a), leaves_a = check((13, 100), torch.float32, 0.5, tiles=small)
    (x_b, normed_b), leaves_b = check((13, 100), torch.float32, 0.5, tiles=large)
    assert torch.equal(x_a, x_b) and torch.equal(normed_a, normed_b)
    assert torch.equal(leaves_a[0].grad, leaves_b[0].grad) and torch.equal(leaves_a[1].grad, leaves_b[1].grad)
    torch.testing.assert_close(leaves_a[2].grad, leaves_b[2].grad, rtol=1e-6, atol=1e-6)


def test_mask_is_attention_dropout_with_one_stream():
    """Row r, column c uses attention dropout's counter with stream 0 and width h: the first rows of the
    [1, 1, h, h] attention mask, and reference_keep_mask's plain-torch decisions."""
    for h, rows in ((40, 17), (100, 100)):
        assert torch.equal(hidden_dropout_keep_mask(rows, h, 11, 0.3), dropout_mask(1, 1, h, 11, 0.3)[0, 0, :rows])
        assert torch.equal(hidden_dropout_keep_mask(rows, h, 11, 0.3), reference_keep_mask(11, 0, rows, h, 0.3))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_is_binomial(p):
    rows, width = 256, 1024
    keep = hidden_dropout_keep_mask(rows, width, 5, p)
    n = rows * width
    q = 1 - effective_dropout_p(p)
    assert abs(keep.double().mean().item() - q) < 6 * math.sqrt(q * (1 - q) / n)   # 6 sigma


def test_seeds():
    a = hidden_dropout_keep_mask(64, 100, 1, 0.5)
    assert torch.equal(a, hidden_dropout_keep_mask(64, 100, 1, 0.5))
    differ = (a != hidden_dropout_keep_mask(64, 100, 2, 0.5)).double().mean().item()
    assert abs(differ - 0.5) < 0.05                                     # independent masks differ half the time
    residual, y, weight, bias = make_inputs((7, 100), torch.float32)
    torch.manual_seed(0)
    first = dropout_add_layer_norm(residual, y, weight, bias, EPS, 0.5, None)[0]
    second = dropout_add_layer_norm(residual, y, weight, bias, EPS, 0.5, None)[0]
    torch.manual_seed(0)
    again = dropout_add_layer_norm(residual, y, weight, bias, EPS, 0.5, None)[0]
    assert torch.equal(first, again) and not torch.equal(first, second)  # seed=None follows torch's generator


def test_no_repeated_counters():
    """Rows are distinct, and neither the next row nor the next group of 8 columns repeats the bits (shifted
    or not): at p = 0.5 any two different counters agree on about half of their decisions."""
    keep = hidden_dropout_keep_mask(128, 256, 9, 0.5)
    assert torch.unique(keep, dim=0).shape[0] == 128
    for row_shift, col_shift in ((1, 0), (1, 8), (1, -8), (0, 8), (0, 16), (2, 0)):
        a = keep[row_shift:, max(col_shift, 0): 256 + min(col_shift, 0)]
        b = keep[:128 - row_shift, max(-col_shift, 0): 256 + min(-col_shift, 0)]
        agree = (a == b).double().mean().item()
        assert abs(agree - 0.5) < 6 * math.sqrt(0.25 / a.numel()), (row_shift, col_shift, agree)


def test_reference_twin_matches_oracle():
    """The module's eager twin (used by the GPU tests and the bench) is the oracle in float64."""
    residual, y, weight, bias = (t.double() for t in make_inputs((7, 100), torch.float32))
    keep = hidden_dropout_keep_mask(7, 100, 4, 0.1)
    x, normed = dropout_add_layer_norm_reference(residual, y, weight, bias, EPS, keep, 0.1)
    x64, normed64 = oracle(residual, y, weight, bias, keep, 0.1, torch.float64)
    torch.testing.assert_close(x, x64)
    torch.testing.assert_close(normed, normed64)


def test_empty_rows():
    residual = torch.zeros(0, 32, requires_grad=True)
    weight = torch.ones(32, requires_grad=True)
    x, normed = dropout_add_layer_norm(residual, torch.zeros(0, 32), weight, torch.zeros(32), EPS, 0.1, 1)
    (x.sum() + normed.sum()).backward()
    assert x.shape == (0, 32) and residual.grad.shape == (0, 32) and torch.equal(weight.grad, torch.zeros(32))


def _args(**change):
    args = dict(residual=torch.zeros(4, 32), y=torch.zeros(4, 32), weight=torch.ones(32), bias=torch.zeros(32),
                eps=EPS, dropout_p=0.1, seed=0)
    args.update(change)
    return args


@pytest.mark.parametrize("args, words", [
    (_args(residual=torch.zeros(4, 32, dtype=torch.float64), y=torch.zeros(4, 32, dtype=torch.float64)),
     "float32, float16 and bfloat16"),
    (_args(y=torch.zeros(4, 32, dtype=torch.float16)), "float32, float16 and bfloat16"),
    (_args(y=torch.zeros(4, 33)), "one shape"),
    (_args(residual=torch.zeros(2, 8200), y=torch.zeros(2, 8200)), "widths h from 1 to 8192"),
    (_args(weight=torch.ones(31)), "weight must be torch.float32 [32]"),
    (_args(bias=None), "both"),
    (_args(dropout_p=1.0), "dropout_p must be in [0, 1)"),
    (_args(eps=0.0), "eps must be a positive"),
], ids=["float64", "mixed", "shape", "too-wide", "weight-shape", "no-bias", "p=1", "eps"])
def test_unsupported_inputs_raise_one_clear_error(args, words):
    with pytest.raises(UsageError) as info:
        dropout_add_layer_norm(**args)
    assert words in str(info.value)
