"""The fused cross-entropy kernel against float64 and against its plain twin, on CPU through the Triton
interpreter (conftest sets TRITON_INTERPRET=1).

The oracle is written here, in float64 on the upcast inputs, as explicit max-shifted logsumexp minus the
gathered target (not the module's code); its gradient comes from float64 autograd. The plain twin is
minibert.model.loss.lm_cross_entropy (fp32 cast + F.cross_entropy), which the model runs without the kernel."""
import math

import pytest
import torch

from minibert.fast.cross_entropy import (
    INTERPRETER_CONFIG,
    _FusedCrossEntropy,
    fused_cross_entropy,
)
from minibert.model.loss import lm_cross_entropy
from tests.autograd_graph import backward_nodes
from tests.conftest import run_without_interpreter

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = INTERPRETER_CONFIG.block_v  # 256: the V below give one partial chunk, exact chunks, partial last chunks
VOCABS = (7, 2 * BLOCK, 1000, 1531)
# Loss: fp32 arithmetic on exactly representable inputs, so ~1e-7 relative to the logsumexp; logits ~ N(0, 3^2).
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
# Gradient: the fp32 value is rounded once to the dtype. fp16 rounds to nearest (2^-11) and has subnormals
# below 6e-8; the interpreter's fp32 -> bf16 cast truncates (1 ulp = 2^-7; a GPU rounds, 2^-8).
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.float16: dict(rtol=2 ** -11 + 1e-5, atol=1e-7),
            torch.bfloat16: dict(rtol=2 ** -7 + 1e-5, atol=1e-7)}


def oracle(logits, labels, ignore_index=-1):
    """float64 loss per row: log(sum exp(x - max)) - (x[label] - max); 0 where label == ignore_index.
    (Subtracting max from the target before adding the log keeps log(sum) when |x| ~ 1e38, where even
    float64's max + log(sum) would round it away.)"""
    x = logits.double()
    keep = labels != ignore_index
    shift = x.amax(dim=1, keepdim=True).detach()                                   # any shift is exact
    log_sum = (x - shift).exp().sum(dim=1).log()
    target = x.gather(1, torch.where(keep, labels, 0)[:, None]) - shift
    return torch.where(keep, log_sum - target[:, 0], torch.zeros_like(log_sum))


def make_labels(n, vocab, generator, ignored_fraction=0.3, ignore_index=-1):
    labels = torch.randint(0, vocab, (n,), generator=generator)
    return torch.where(torch.rand(n, generator=generator) < ignored_fraction, ignore_index, labels)


def check(logits, labels, dtype, grad_loss=None, ignore_index=-1, loss_tol=LOSS_TOL, grad_atol=None):
    """Forward and backward of the kernel vs the float64 oracle on the same (rounded) logits."""
    x = logits.detach().requires_grad_()
    loss = fused_cross_entropy(x, labels, ignore_index)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    x64 = x.detach().double().requires_grad_()
    loss64 = oracle(x64, labels, ignore_index)
    torch.testing.assert_close(loss.double(), loss64, **loss_tol)
    if grad_loss is None:  # random, non-uniform, of both signs
        grad_loss = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    loss.backward(grad_loss)
    loss64.backward(grad_loss.double())
    assert x.grad.dtype == dtype and x.grad.shape == x.shape and x.grad.is_contiguous()
    tol = dict(GRAD_TOL[dtype])
    if grad_atol is not None:
        tol["atol"] = grad_atol
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_float64_oracle(dtype, vocab):
    assert VOCABS[0] < BLOCK and VOCABS[1] % BLOCK == 0 and all(v % BLOCK for v in VOCABS[2:])
    g = torch.Generator().manual_seed(vocab)
    n = 6
    logits = (torch.randn(n, vocab, generator=g) * 3).to(dtype)
    labels = make_labels(n, vocab, g)
    labels[0], labels[1] = vocab - 1, -1                            # the last column; at least one ignored row
    loss, grad = check(logits, labels, dtype)
    assert (loss[1] == 0) and (grad[1] == 0).all() and (loss[0] > 0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_matches_plain_twin_lm_cross_entropy(dtype):
    """The model's eager loss, forward and backward, up to fp32 summation order (and one bf16 rounding),
    and the same correct flags (the label's logit is the row's max; what lm acc counts), bit for bit:
    right rows, a tie for the max (right), wrong rows, ignored rows (never right)."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 1000, generator=g) * 4).to(dtype)
    labels = make_labels(8, 1000, g)
    labels[:3] = logits[:3].float().argmax(dim=1)                   # predicted right
    logits[3, 10] = logits[3, 600] = logits[3].max()                # a tie for the max...
    labels[3] = 10                                                  # ...at the label: right
    labels[4], labels[7] = (int(logits[4].float().argmax()) + 1) % 1000, -1  # a wrong row, an ignored row
    grad_loss = torch.rand(8, generator=g) + 0.5
    ours = logits.clone().requires_grad_()
    plain = logits.clone().requires_grad_()
    (loss_ours, right_ours), (loss_plain, right_plain) = (fused_cross_entropy(ours, labels, with_correct=True),
                                                          lm_cross_entropy(plain, labels, with_correct=True))
    assert right_ours.dtype == torch.bool and torch.equal(right_ours, right_plain)
    assert right_ours[:4].all() and not right_ours[4] and not right_ours[7]
    torch.testing.assert_close(loss_ours, loss_plain, rtol=1e-6, atol=1e-5)
    loss_ours.backward(grad_loss)
    loss_plain.backward(grad_loss)
    assert ours.grad.dtype == plain.grad.dtype == dtype
    torch.testing.assert_close(ours.grad, plain.grad, **GRAD_TOL[dtype])


def test_column_slice_view_is_read_in_place():
    """logits_full[:, :V] (row stride 1024 > V = 1000): saved as the view itself, the padding never read."""
    g = torch.Generator().manual_seed(2)
    full = (torch.randn(5, 1024, generator=g) * 3).to(torch.bfloat16)
    full[:, 1000:] = float("nan")                                   # a kernel that reads past V turns NaN
    view = full[:, :1000]
    labels = torch.tensor([3, 999, -1, 0, 512])
    x = view.detach().requires_grad_()
    loss = fused_cross_entropy(x, labels)
    saved = loss.grad_fn.saved_tensors[0]
    assert saved.data_ptr() == full.data_ptr() and saved.stride() == (1024, 1)   # no copy was saved
    torch.testing.assert_close(loss.double(), oracle(view.contiguous(), labels), **LOSS_TOL)
    check(view, labels, torch.bfloat16)


def node_names(grad_fn, stop):
    return [type(node).__name__ for node in backward_nodes(grad_fn, stop)]


def test_a_column_slice_of_padded_logits_gets_its_gradient_without_autograds_copy():
    """As the LM head does it: logits computed over a padded width (here 1024 columns), the loss over the
    first V = 1000 through a view. The Function takes the padded tensor itself, so the gradient arrives
    there directly (zeros in the padded columns) and autograd runs no slice backward (which would fill a
    padded zero tensor and copy the gradient into it); loss and gradient equal the plain twin's."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(1024, 16, generator=g).requires_grad_()
    hidden = torch.randn(2, 3, 16, generator=g)
    labels = torch.tensor([3, 999, -1, 0, 512, 7])

    def loss_of(fused):
        logits = (hidden @ weight.t())[..., :1000]                  # [2, 3, 1000]: a view of [2, 3, 1024]
        flat = logits.reshape(-1, 1000)
        loss = fused_cross_entropy(flat, labels) if fused else lm_cross_entropy(flat, labels)
        return loss, logits._base
    loss, padded = loss_of(True)
    assert not any("Slice" in name for name in node_names(loss.grad_fn, padded.grad_fn))
    plain, _ = loss_of(False)
    torch.testing.assert_close(loss, plain, **LOSS_TOL)
    grad_loss = torch.rand(6, generator=g) + 0.5
    (grad,) = torch.autograd.grad(loss, weight, grad_loss)
    (plain_grad,) = torch.autograd.grad(plain, weight, grad_loss)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)
    assert (grad[1000:] == 0).all()                                 # the padded columns: no gradient
    loss, padded = loss_of(True)
    (padded_grad,) = torch.autograd.grad(loss, padded, grad_loss)
    assert padded_grad.shape[-1] == 1024 and (padded_grad[..., 1000:] == 0).all()


@pytest.mark.parametrize("written_out", (False, True), ids=("F.linear", "LinearFunction"))
def test_the_lm_heads_decoder_hands_the_loss_its_padded_logits(monkeypatch, written_out):
    """The LM head's decoder on [b, s, h], through either path: the core's TiedDecoder (F.linear, as on the
    CPU) and the GEMV lever's Decoder taking LinearFunction (what the GPU runs in 16-bit; chosen here on the
    CPU by its device check). A 3-D product made inside LinearFunction is a view autograd does not track,
    which would leave the slice backward (a fill and a copy of the whole gradient) in place: the decoder
    multiplies 2-D rows so that either way the loss's graph has no slice node."""
    import minibert.fast.linear as linear_module
    from minibert.model.bert import TiedDecoder
    monkeypatch.setattr(linear_module, "written_out_backward", lambda x, weight: written_out)
    g = torch.Generator().manual_seed(5)
    table = torch.randn(1024, 16, generator=g).requires_grad_()          # padded vocab 1024, real 1000
    bias = torch.zeros(1024, requires_grad=True)
    hidden = torch.randn(2, 3, 16, generator=g)
    labels = torch.tensor([3, 999, -1, 0, 512, 7])
    decoder = linear_module.Decoder(1000) if written_out else TiedDecoder(1000)
    logits = decoder(hidden, table, bias)                                 # [2, 3, 1000]
    assert logits.shape == (2, 3, 1000)
    assert (type(logits._base.grad_fn).__name__ == "LinearFunctionBackward") == written_out
    loss = fused_cross_entropy(logits.reshape(-1, 1000), labels)
    assert not any("Slice" in name for name in node_names(loss.grad_fn, logits._base.grad_fn))
    plain = lm_cross_entropy((hidden @ table.t() + bias)[..., :1000].reshape(-1, 1000), labels)
    torch.testing.assert_close(loss, plain, **LOSS_TOL)
    (grad,) = torch.autograd.grad(loss.sum(), table)
    (plain_grad,) = torch.autograd.grad(plain.sum(), table)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-5, atol=1e-6)


def test_ignored_rows_give_zero_whatever_their_logits_and_grad():
    """Ignored rows are not read: NaN logits there and NaN grad_loss there still give loss 0 and grad 0.
    (Eager F.cross_entropy gives NaN gradients on a NaN row even when it is ignored: log_softmax sees it.)"""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=g)
    labels = torch.tensor([-1, 5, -1, 299])
    logits[0] = float("nan")
    grad_loss = torch.tensor([float("nan"), 0.7, float("inf"), -1.3])
    x = logits.requires_grad_()
    loss = fused_cross_entropy(x, labels)
    loss.backward(grad_loss)
    assert loss[0] == 0 and loss[2] == 0 and (x.grad[0] == 0).all() and (x.grad[2] == 0).all()
    torch.testing.assert_close(loss[[1, 3]].double(), oracle(logits[[1, 3]].detach(), labels[[1, 3]]), **LOSS_TOL)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_all_rows_ignored(dtype):
    logits = torch.randn(3, 700).to(dtype)
    loss, grad = check(logits, torch.full((3,), -1), dtype)
    assert (loss == 0).all() and (grad == 0).all()


def test_other_ignore_index():
    """ignore_index=-100 (PyTorch's default): -100 rows ignored, -1 would be a bad label."""
    g = torch.Generator().manual_seed(4)
    labels = make_labels(5, 600, g, ignore_index=-100)
    labels[2] = -100
    check(torch.randn(5, 600, generator=g), labels, torch.float32, ignore_index=-100)
    labels[2] = -1
    with pytest.raises(ValueError, match="label -1 at row 2"):
        fused_cross_entropy(torch.randn(5, 600), labels, ignore_index=-100)


@pytest.mark.parametrize("vocab", (1, 7, 1000))
def test_single_row(vocab):
    logits = torch.randn(1, vocab) * 2
    check(logits, torch.tensor([vocab - 1]), torch.float32)


def test_empty_batch():
    x = torch.randn(0, 50, requires_grad=True)
    loss = fused_cross_entropy(x, torch.zeros(0, dtype=torch.int64))
    loss.sum().backward()
    assert loss.shape == (0,) and x.grad.shape == (0, 50)


def test_extreme_fp32_logits():
    """|x| ~ 1e4: exp overflows without the running max, and lse = max + log(sum) would round log(sum) to
    ulp(4e4) = 4e-3. The kernel keeps max and log(sum) apart, so loss and softmax keep fp32 accuracy."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1000, generator=g) * 1e4
    logits[1, :10] = logits[1].max()                                 # ties for the max: softmax 1/10 each
    labels = make_labels(6, 1000, g, ignored_fraction=0.0)
    labels[0] = int(logits[0].argmax())                              # a near-zero loss on a 1e4 scale
    labels[1] = 3
    loss, grad = check(logits, labels, torch.float32, grad_loss=torch.ones(6),
                       loss_tol=dict(rtol=1e-6, atol=1e-5), grad_atol=1e-6)
    assert torch.isfinite(loss).all() and loss[0] < 1e-5
    assert abs(loss[1].item() - math.log(10)) < 1e-5                 # the label is one of 10 ties
    expected = torch.full((10,), 0.1)
    expected[3] = -0.9                                               # softmax - one-hot
    torch.testing.assert_close(grad[1, :10], expected, rtol=0, atol=1e-6)


def test_logits_near_bf16_max():
    """bf16 logits up to +-1.6e38 (bf16 max 3.4e38): x * log2(e) would overflow fp32; x - max does not."""
    g = torch.Generator().manual_seed(6)
    logits = ((torch.rand(4, 600, generator=g) * 2 - 1) * 1.6e38).to(torch.bfloat16)
    labels = torch.tensor([0, int(logits[1].float().argmax()), 599, -1])
    loss, grad = check(logits, labels, torch.bfloat16, grad_loss=torch.ones(4), loss_tol=dict(rtol=1e-6, atol=1e-6))
    ties = int((logits[1] == logits[1].max()).sum())                 # bf16 is coarse: the max repeats
    assert torch.isfinite(loss).all() and loss[0] > 1e37 and ties > 1
    assert abs(loss[1].item() - math.log(ties)) < 1e-6               # lost if lse = max + log(sum) were stored
    assert abs(grad[1, labels[1]].float().item() - (1 / ties - 1)) < 1e-2  # softmax 1/ties, not exp(0) = 1


def test_sum_backward_reads_an_expanded_grad():
    """loss.sum().backward() hands the backward a stride-0 grad_loss; a strided one works too."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 1000, generator=g).to(torch.bfloat16)
    labels = make_labels(6, 1000, g)
    strides = []
    x = logits.clone().requires_grad_()
    loss = fused_cross_entropy(x, labels)
    loss.register_hook(lambda grad: strides.append(grad.stride()))
    loss.sum().backward()
    x64 = logits.double().requires_grad_()
    oracle(x64, labels).sum().backward()
    assert strides == [(0,)]
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[torch.bfloat16])
    strided = torch.randn(12, generator=g)[::2]
    assert strided.stride() == (2,)
    check(logits, labels, torch.bfloat16, grad_loss=strided)


@pytest.mark.parametrize("bad", [1000, 5000, -2])
def test_bad_label_raises_on_cpu(bad):
    labels = torch.tensor([1, -1, bad, 4])
    with pytest.raises(ValueError, match=f"label {bad} at row 2 is outside \\[0, 1000\\)"):
        fused_cross_entropy(torch.randn(4, 1000), labels)


def test_kernel_alone_never_reads_out_of_range_and_gives_nan():
    """What CUDA does (no host check there): the bad row's loss and gradient are NaN, the others exact."""
    logits = torch.randn(3, 100, requires_grad=True)
    labels = torch.tensor([4, 100, -1])
    loss, correct = _FusedCrossEntropy.apply(logits, labels, -1, 100)
    loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isnan(logits.grad[1]).all() and loss[2] == 0
    assert not correct[1] and not correct[2]                         # a bad label is never a right prediction
    torch.testing.assert_close(loss[0].double(), oracle(logits[:1].detach(), labels[:1])[0], **LOSS_TOL)
    assert torch.isfinite(logits.grad[[0, 2]]).all()


@pytest.mark.parametrize("logits, labels, error, words", [
    (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), TypeError, "float32, float16"),
    (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.int64), TypeError, "float32, float16"),
    (torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.int64), ValueError, "2-D [n, V]"),
    (torch.zeros(4, 2).t(), torch.zeros(2, dtype=torch.int64), ValueError, "stride(1) == 1"),
    (torch.zeros(2, 4), torch.zeros(2, dtype=torch.int32), TypeError, "int64"),
    (torch.zeros(2, 4), torch.zeros(3, dtype=torch.int64), ValueError, "one per row"),
], ids=["int", "float64", "3d", "transposed", "int32-labels", "labels-shape"])
def test_unsupported_inputs_raise_one_clear_error(logits, labels, error, words):
    with pytest.raises(error) as info:
        fused_cross_entropy(logits, labels)
    assert words in str(info.value)


def test_cpu_without_interpreter_names_the_fix():
    """Without TRITON_INTERPRET a CPU tensor cannot run a Triton kernel: say where it can run."""
    code = ("from minibert.fast.cross_entropy import fused_cross_entropy\n"
            "try:\n    fused_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64))\n"
            "except ValueError as e:\n    print(e)\n")
    out = run_without_interpreter(code)
    assert "runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr
