"""`make test-gpu`: the fused dropout + add + LayerNorm kernel on a CUDA GPU, in bf16 and fp16 at BERT shapes
(the CPU suite runs it in the interpreter, which rounds bf16 toward zero). Skipped without a GPU.

The yardstick is eager PyTorch itself: dropout_add_layer_norm_reference (F.layer_norm etc., with the
kernel's own keep mask) in fp32 on the same half-precision inputs is the truth, and the same reference run
in bf16 / fp16 is what a model without the fused op computes. The fused op rounds once per output (eager
rounds the dropout output, the sum and each gradient), so it must be at least as close to fp32 as eager is,
and within one ulp of the dtype in any case."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16]
NAMES = ("x", "normed", "grad_residual", "grad_y", "grad_weight", "grad_bias")
# Relative error (norm of the difference / norm of the fp32 truth) allowed in any case: one ulp at 1.0
# (bf16 2^-7, fp16 2^-10). Rounding to nearest gives ~0.2 ulp; measured on an H200 (2026-12, triton 3.6):
# fused bf16 1.6e-3 (x) to 2.5e-3 (grad_weight), eager 1.9e-3 to 2.5e-3; fp16 2.0e-4 to 3.0e-4, eager
# 2.3e-4 to 3.3e-4. grad_bias is the same sum in both (a column sum of grad_normed), equal errors.
ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}
EPS, P, SEED = 1e-12, 0.1, 77


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def run_all(fn, leaves, grads):
    """Forward and backward of fn(residual, y, weight, bias) -> the six tensors, in NAMES order."""
    leaves = [t.detach().requires_grad_() for t in leaves]
    x, normed = fn(*leaves)
    return [x.detach(), normed.detach()] + list(torch.autograd.grad((x, normed), leaves, grads))


def inputs(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *s, scale=1.0: (torch.randn(s, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    h = shape[-1]
    leaves = [make(*shape, scale=2.0) + 0.5, make(*shape), 1 + make(h, scale=0.3), make(h, scale=0.2)]
    return leaves, (make(*shape), make(*shape))


@pytest.mark.parametrize("shape", [(16384, 1024), (8, 512, 768)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_fused_is_as_close_to_fp32_as_eager(dtype, shape):
    from minibert.fast.layer_norm import (
        dropout_add_layer_norm,
        dropout_add_layer_norm_reference,
        hidden_dropout_keep_mask,
    )
    leaves, grads = inputs(shape, dtype)
    h = shape[-1]
    keep = hidden_dropout_keep_mask(leaves[0].numel() // h, h, SEED, P, device="cuda").view(shape)
    ref = lambda *t: dropout_add_layer_norm_reference(*t, EPS, keep, P)  # noqa: E731
    fused = run_all(lambda *t: dropout_add_layer_norm(*t, EPS, P, SEED), leaves, grads)
    eager = run_all(ref, leaves, grads)
    truth = run_all(ref, [t.float() for t in leaves], [g.float() for g in grads])
    for name, ours, theirs, true in zip(NAMES, fused, eager, truth):
        assert ours.dtype == dtype and ours.shape == true.shape, name
        ours_err, eager_err = rel(ours, true), rel(theirs, true)
        assert ours_err < ULP[dtype], (name, ours_err)
        assert ours_err <= 1.1 * eager_err + 1e-6, (name, ours_err, eager_err)


def test_backward_is_deterministic():
    """No atomics: the weight gradient is summed in a fixed order, the same bits every run."""
    from minibert.fast.layer_norm import dropout_add_layer_norm
    leaves, grads = inputs((16384, 1024), torch.bfloat16)
    first = run_all(lambda *t: dropout_add_layer_norm(*t, EPS, P, SEED), leaves, grads)
    second = run_all(lambda *t: dropout_add_layer_norm(*t, EPS, P, SEED), leaves, grads)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_gpu_mask_is_attention_dropout_with_one_stream():
    """On the GPU too, the mask is attention dropout's draw with bh = 0, seq_len = h (the CPU suite checks the
    same in the interpreter, the same integer hash), and its rate is 1 - p on a BERT-large
    tensor (6 binomial sigmas)."""
    from minibert.fast.layer_norm import hidden_dropout_keep_mask
    from minibert.kernels.dropout import dropout_mask, effective_dropout_p
    assert torch.equal(hidden_dropout_keep_mask(300, 1024, SEED, P, device="cuda"),
                       dropout_mask(1, 1, 1024, SEED, P, device="cuda")[0, 0, :300])
    keep = hidden_dropout_keep_mask(16384, 1024, SEED, P, device="cuda")
    q = 1 - effective_dropout_p(P)
    assert abs(keep.double().mean().item() - q) < 6 * (q * (1 - q) / keep.numel()) ** 0.5
