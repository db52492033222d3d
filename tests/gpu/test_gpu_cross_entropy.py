"""`make test-gpu`: the fused cross entropy in bf16 and fp16 at BERT's shapes, against the model's plain twin
minibert.model.loss.lm_cross_entropy (fp32 cast + F.cross_entropy), forward and backward. The CPU suite checks
the same kernel in the interpreter on small shapes; here the compiled kernel, its chunk loop over a 30k
vocabulary, the padded-vocab column view and the memory it does not allocate. Skipped without a GPU.

Tolerances. Both sides compute in fp32 on the same rounded logits; they differ only in summation order and
in exp/log approximations (the GPU's ex2/lg2: ~2 ulp), so the loss agrees to ~1e-6 relative (we allow
1e-5, and 1e-5 absolute for losses near 0). The gradient is that fp32 value rounded once to the dtype on
both sides (round to nearest on a GPU): where the two fp32 values straddle a rounding boundary the results
differ by one ulp of the dtype, at most 2^-7 relative in bf16 and 2^-10 in fp16; fp16 flushes values below
6e-8 to subnormals, spaced 6e-8 apart (the absolute tolerance)."""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16, torch.float16]
N, PADDED_V = 4096, 30592  # 8 sequences of 512; BERT's 30522 WordPieces padded to a multiple of 128 (x 239)
GRAD_TOL = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-9), torch.float16: dict(rtol=2 ** -10, atol=6e-8)}


def bert_logits(dtype, vocab, labelled=0.5, seed=0):
    """A [N, PADDED_V] buffer (the LM head's output), its [:, :vocab] view, and labels with some ignored."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    full = torch.randn(N, PADDED_V, device="cuda", generator=g, dtype=torch.float32).mul_(4).to(dtype)
    labels = torch.randint(0, vocab, (N,), device="cuda", generator=g)
    labels = torch.where(torch.rand(N, device="cuda", generator=g) < labelled, labels, -1)
    labels[0], labels[1], labels[2] = 0, vocab - 1, -1
    return full, full[:, :vocab], labels


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("vocab", [30522, 30524])
def test_matches_lm_cross_entropy_at_bert_shapes(dtype, vocab):
    from minibert.fast.cross_entropy import fused_cross_entropy
    from minibert.model.loss import lm_cross_entropy
    full, view, labels = bert_logits(dtype, vocab)
    assert view.stride() == (PADDED_V, 1)
    labels[3:100] = view[3:100].float().argmax(dim=1)                # right predictions (lm acc counts them)
    grad_loss = torch.rand(N, device="cuda") + 0.5                  # non-uniform, as a masked mean's weights
    ours, plain = view.detach().requires_grad_(), view.detach().requires_grad_()
    (loss_ours, right_ours), (loss_plain, right_plain) = (fused_cross_entropy(ours, labels, with_correct=True),
                                                          lm_cross_entropy(plain, labels, with_correct=True))
    torch.testing.assert_close(loss_ours, loss_plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(right_ours, right_plain) and right_ours[3:100].all() and not right_ours[labels == -1].any()
    assert loss_ours.grad_fn.saved_tensors[0].data_ptr() == full.data_ptr()    # the view, not a copy
    loss_ours.backward(grad_loss)
    loss_plain.backward(grad_loss)
    assert ours.grad.dtype == dtype and ours.grad.shape == (N, vocab)
    torch.testing.assert_close(ours.grad, plain.grad, **GRAD_TOL[dtype])
    assert (ours.grad[labels == -1] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_masked_mean_loss_and_sum_backward(dtype):
    """The way pretraining_loss uses it: sum(ce * mask) / count, and a stride-0 grad from .sum()."""
    from minibert.fast.cross_entropy import fused_cross_entropy
    from minibert.model.loss import lm_cross_entropy
    _, view, labels = bert_logits(dtype, 30522, labelled=0.15, seed=1)
    mask = (labels != -1).float()
    grads = []
    for ce in (fused_cross_entropy, lm_cross_entropy):
        x = view.detach().requires_grad_()
        loss = (ce(x, labels) * mask).sum() / mask.sum()
        loss.backward()
        grads.append((loss.detach(), x.grad))
        x = view.detach().requires_grad_()
        ce(x, labels).sum().backward()
        grads.append((None, x.grad))
    torch.testing.assert_close(grads[0][0], grads[2][0], rtol=1e-5, atol=0)
    torch.testing.assert_close(grads[0][1], grads[2][1], **GRAD_TOL[dtype])
    torch.testing.assert_close(grads[1][1], grads[3][1], **GRAD_TOL[dtype])


def test_forward_allocates_no_logits_sized_buffer():
    """The plain path's fp32 copy and log-probs are 2 x 500 MB here; the fused forward allocates 3 x n fp32
    and the n accuracy flags (bool)."""
    from minibert.fast.cross_entropy import fused_cross_entropy
    _, view, labels = bert_logits(torch.bfloat16, 30522)
    x = view.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fused_cross_entropy(x, labels)
    torch.cuda.synchronize()
    # loss, row max, log sum, correct flags (+ the allocator's rounding to 512 bytes)
    assert torch.cuda.max_memory_allocated() - before <= 3 * N * 4 + N + 4 * 512
    del loss


def test_bad_label_gives_nan_on_cuda_without_reading_out_of_bounds():
    """CUDA skips the host-side label check (a sync); the kernel masks the load and returns NaN instead."""
    from minibert.fast.cross_entropy import fused_cross_entropy
    x = torch.randn(4, 1000, device="cuda", requires_grad=True)
    labels = torch.tensor([3, 1000, -1, -7], device="cuda")
    loss = fused_cross_entropy(x, labels)
    loss.sum().backward()
    torch.cuda.synchronize()                                         # an illegal address would raise here
    assert torch.isfinite(loss[[0, 2]]).all() and torch.isnan(loss[[1, 3]]).all()
    assert torch.isnan(x.grad[[1, 3]]).all() and torch.isfinite(x.grad[[0, 2]]).all()
