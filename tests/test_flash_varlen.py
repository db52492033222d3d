"""The varlen flash attention (packed rows + cu_seqlens) against its plain twin, the padded flash attention
on the same samples: the same outputs and gradients bit for bit (the same kernels, the same dropout mask),
then the whole model through it (packed micro-batches on the flash backend against the padded run).
Runs in the Triton interpreter on CPU; tests/gpu/test_gpu.py repeats the kernel check in bf16 and fp16."""
import dataclasses

import pytest
import torch

import minibert.kernels.flash_attention_varlen as varlen_module
from minibert.config import Config
from minibert.data.packing import PACK_BELOW, make_packing
from minibert.errors import UsageError
from minibert.kernels.flash_attention import attention_reference
from minibert.kernels.flash_attention_packed import flash_attention_qkv
from minibert.kernels.flash_attention_varlen import flash_attention_varlen
from minibert.train import get_batch
from tests.test_packing import packed_and_padded_runs


def padded_and_packed(lengths, s, heads, d, seed=0):
    """Right-padded qkv [b, s, heads, 3, d] (zeros at padding) and its packed rows [n, heads, 3, d]."""
    g = torch.Generator().manual_seed(seed)
    is_pad = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]
    qkv = torch.randn(len(lengths), s, heads, 3, d, generator=g, dtype=torch.float64).float()
    qkv = qkv.masked_fill(is_pad[:, :, None, None, None], 0.0)
    packing = make_packing(is_pad)
    rows = qkv.reshape(-1, heads, 3, d).index_select(0, packing.index)
    return qkv, rows, is_pad, packing


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("lengths,s", [([40, 23, 1], 40), ([7, 33, 64, 18], 64), ([50, 50], 50)])
def test_varlen_equals_padded_flash_bit_for_bit(lengths, s, dropout_p):
    heads, d = 2, 16
    qkv, rows, is_pad, packing = padded_and_packed(lengths, s, heads, d)
    qkv.requires_grad_()
    rows.requires_grad_()
    grad = torch.randn(len(lengths), heads, s, d, generator=torch.Generator().manual_seed(1))

    padded = flash_attention_qkv(qkv, is_pad, dropout_p=dropout_p, seed=11)          # [b, heads, s, d]
    padded.backward(grad)
    packed = flash_attention_varlen(rows, packing.cu_seqlens, s, dropout_p=dropout_p, seed=11)  # [n, heads, d]
    packed.backward(grad.transpose(1, 2).reshape(-1, heads, d).index_select(0, packing.index))

    assert packed.shape == (sum(lengths), heads, d)
    expected = padded.transpose(1, 2).reshape(-1, heads, d).index_select(0, packing.index)
    assert torch.equal(packed, expected)
    assert torch.equal(rows.grad, qkv.grad.reshape(-1, heads, 3, d).index_select(0, packing.index))


def test_varlen_against_float64_reference_per_sample():
    """Each sample attends to its own rows only: compare with plain attention run sample by sample."""
    lengths, s, heads, d = [13, 40, 5], 40, 2, 32
    _, rows, _, packing = padded_and_packed(lengths, s, heads, d, seed=3)
    out = flash_attention_varlen(rows, packing.cu_seqlens, s)
    start = 0
    for n in lengths:
        q, k, v = (t.double().transpose(0, 1)[None] for t in rows[start:start + n].unbind(2))
        expected = attention_reference(q, k, v)[0].transpose(0, 1)                    # [n, heads, d]
        torch.testing.assert_close(out[start:start + n].double(), expected, rtol=1e-4, atol=1e-5)
        start += n


def test_varlen_refuses_bad_inputs():
    _, rows, _, packing = padded_and_packed([4, 3], 8, 2, 16)
    with pytest.raises(UsageError, match="cu_seqlens int32"):
        flash_attention_varlen(rows, packing.cu_seqlens.long(), 8)
    with pytest.raises(UsageError, match=r"qkv \[n, heads, 3, d\]"):
        flash_attention_varlen(rows[:, :, :2], packing.cu_seqlens, 8)


@pytest.mark.parametrize("post_ln", [False, True])
def test_packed_model_on_flash_equals_padded(tiny_data, post_ln, monkeypatch):
    """The whole model on the flash backend: packed micro-batches (attention through the varlen kernel,
    counted) give the padded run's loss and gradients; and with flash every micro-batch with padding is
    packed, also those over the scatter route's 85% rule."""
    calls = []
    real = varlen_module.flash_attention_varlen

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(varlen_module, "flash_attention_varlen", counting)
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=128, micro_batch_size=2,
                 global_batch_size=2, train_iters=2, lr=1e-3, data_path=[tiny_data["prefix"]],
                 vocab_file=tiny_data["vocab"], split="90,5,5", hidden_dropout=0.0, attention_dropout=0.0,
                 post_ln=post_ln, eval_iters=0, attention_backend="flash")
    results = packed_and_padded_runs(cfg)
    assert results[True][2] is not None                      # the packed run did pack
    assert len(calls) == 2  # one varlen call per layer, packed run only
    (loss_p, grads_p, _, _), (loss_u, grads_u, _, _) = results[True], results[False]
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=0)
    for name, grad in grads_u.items():
        error = (grads_p[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-4, (name, float(error))

    # a micro-batch of 90% real tokens: packed with flash, not with the scatter route (local backend)
    device = torch.device("cpu")
    is_pad = torch.zeros(2, 64, dtype=torch.bool)
    is_pad[1, 52:] = True
    assert PACK_BELOW < float((~is_pad).float().mean()) < 1.0
    iterator = iter([{"text": torch.ones(2, 64, dtype=torch.long), "types": torch.zeros(2, 64, dtype=torch.long),
                      "labels": torch.ones(2, 64, dtype=torch.long), "loss_mask": torch.ones(2, 64, dtype=torch.long),
                      "padding_mask": (~is_pad).long(), "is_random": torch.zeros(2, dtype=torch.long)}] * 2)
    assert get_batch(iterator, device, dataclasses.replace(cfg, seq_length=64))["packing"] is not None
    local = dataclasses.replace(cfg, seq_length=64, attention_backend="local")
    assert get_batch(iterator, device, local)["packing"] is None
