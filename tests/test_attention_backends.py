"""The attention backends are interchangeable: with dropout off, the whole model gives the same loss, the same
outputs at real positions and the same parameter gradients with local, fused and flash (Triton
kernels under TRITON_INTERPRET=1 on CPU); with dropout on, each backend is repeatable under torch.manual_seed.
The plain backend itself is checked against PyTorch's scaled_dot_product_attention."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from minibert.config import Config
from minibert.errors import UsageError
from minibert.model.attention import attention, resolve_backend
from minibert.model.bert import BertModel
from minibert.model.loss import pretraining_loss

VOCAB = 100


def _missing(module):
    """The reason to skip while a kernel module is not written yet (ImportError only), else None."""
    try:
        importlib.import_module(module)
        return None
    except ImportError as e:
        return f"{module} not available yet ({e}); remove this skip once the kernels land"


KERNEL_OF = {"fused": "minibert.kernels.softmax", "flash": "minibert.kernels.flash_attention"}


def backend_param(name):
    reason = _missing(KERNEL_OF[name]) if name in KERNEL_OF else None
    return pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=reason or ""))


ALL_BACKENDS = [backend_param(name) for name in ("local", "fused", "flash")]


def build(backend, attention_dropout=0.0, seed=0):
    # h 64 with 2 heads: head dim 32, which every backend takes
    torch.manual_seed(seed)
    config = Config(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=48, vocab_size=VOCAB,
                    hidden_dropout=0.0, attention_dropout=attention_dropout, attention_backend=backend)
    return BertModel(config).train()


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 48), generator=g)
    padding_mask = torch.zeros(2, 48, dtype=torch.bool)
    padding_mask[1, 11:] = True  # row 1: 11 real tokens, 37 padding
    loss_mask = (torch.rand(2, 48, generator=g) < 0.3) & ~padding_mask
    loss_mask[:, 2] = True
    labels = torch.where(loss_mask, torch.randint(0, VOCAB, (2, 48), generator=g), -1)
    types = torch.zeros(2, 48, dtype=torch.long)
    types[:, 6:] = 1
    return dict(tokens=tokens, types=types, padding_mask=padding_mask, loss_mask=loss_mask.long(),
                labels=labels, is_random=torch.tensor([0, 1]))


def loss_and_grads(model, data):
    out = model(data["tokens"], data["types"], data["padding_mask"])
    loss, _, _ = pretraining_loss(out, data["labels"], data["loss_mask"], data["is_random"])
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out, loss.detach(), grads


def test_auto_resolution():
    assert resolve_backend("auto", "cpu", torch.bfloat16, 64) == "local"  # CPU: always local
    assert resolve_backend("auto", "cpu", torch.float32, 64) == "local"
    assert resolve_backend("auto", "cuda", torch.bfloat16, 64) == "flash"
    assert resolve_backend("auto", "cuda", torch.float16, 128) == "flash"
    assert resolve_backend("auto", "cuda", torch.float32, 64) == "local"  # fp32: the exact reference
    assert resolve_backend("auto", "cuda", torch.bfloat16, 160) == "local"  # head dim the kernel lacks
    for name in ("local", "fused", "flash"):
        assert resolve_backend(name, "cpu", torch.float32, 64) == name  # explicit choices are honoured
    for name in ("xformers", "unfused"):  # unfused: Megatron's other name for local, not taken
        with pytest.raises(UsageError, match="attention-backend"):
            resolve_backend(name, "cpu")
    assert build("auto").attention_backend(torch.device("cpu")) == "local"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_backend_matches_torch_sdpa(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 20, 16, generator=g).to(dtype) for _ in range(3))
    padding_mask = torch.zeros(2, 20, dtype=torch.bool)
    padding_mask[0, 13:] = True
    ours = attention(q, k, v, padding_mask, backend="local")
    theirs = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                            attn_mask=~padding_mask[:, None, None, :])  # True = attend
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours.float(), theirs, **tol)
    everything_padded = torch.ones(2, 20, dtype=torch.bool)  # a degenerate row stays finite, never NaN
    assert torch.isfinite(attention(q, k, v, everything_padded, backend="local")).all()


@pytest.mark.parametrize("backend", [p for p in ALL_BACKENDS if p.values[0] != "local"])
def test_backends_give_the_same_loss_outputs_and_gradients(backend):
    data = batch()
    ref_out, ref_loss, ref_grads = loss_and_grads(build("local"), data)
    out, loss, grads = loss_and_grads(build(backend), data)
    real = ~data["padding_mask"]
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, **tol)
    torch.testing.assert_close(out.hidden[real], ref_out.hidden[real], **tol)
    torch.testing.assert_close(out.lm_logits[real], ref_out.lm_logits[real], **tol)
    torch.testing.assert_close(out.binary_logits, ref_out.binary_logits, **tol)
    assert torch.isfinite(out.hidden).all()  # padded rows may differ between backends, but stay finite
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_dropout_is_repeatable_under_a_seed(backend):
    model, data = build(backend, attention_dropout=0.1), batch()  # only the backend's own dropout
    losses, grads = [], []
    for seed in (7, 7, 8):
        model.zero_grad()
        torch.manual_seed(seed)
        _, loss, g = loss_and_grads(model, data)
        losses.append(loss)
        grads.append(g)
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    model.eval()  # dropout off: a different loss than the dropped-out one
    assert not torch.equal(loss_and_grads(model, data)[1], losses[0])
