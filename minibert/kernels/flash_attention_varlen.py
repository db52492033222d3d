"""Flash attention over packed rows ("varlen"): the real tokens only, no [b, s] buffer around attention.

A packed micro-batch (minibert/data/packing.py) keeps its real tokens as rows [n, h], sample after sample.
Before this kernel, attention still wanted the padded layout: the QKV rows were scattered into a zeroed
[b, s, 3h] buffer, attention ran there (skipping padded key blocks), and its output was gathered back,
three passes over activation-sized tensors per layer and direction that the padding does not justify.

Here the kernels read the packed rows themselves. The only extra input is where each sample's rows start,
cu_seqlens ("cumulative sequence lengths", FlashAttention's name), int32 [b + 1]:

    packed rows      | s0 s0 s0 s0 | s1 s1 s1 | s2 s2 s2 s2 s2 |
    cu_seqlens       0             4          7                12          sample i: rows cu[i] .. cu[i+1]-1

A program still owns one (sample, head, block of rows) as in flash_attention.py; it finds its sample's
first row as cu[i] instead of i * (batch stride), and its length, cu[i+1] - cu[i], plays the part of the
padded kernels' kv_len (1 + last real key): flash_common.py's helpers read either layout. Rows at or past that length are never loaded or stored: they
belong to the next sample. The three kernels are the padded ones, compiled with VARLEN=True.

The grid, the saved log-sum-exp and the dropout counters are laid out for max_len, the micro-batch's
trimmed length s' (>= every sample's length): with right-padded samples a token's row within its sample is
its position in the padded [b, s'] batch, so the kernels draw the same dropout mask as the padded kernels
on [b, s'], and the two layouts give the same numbers (tests/test_flash_varlen.py).

qkv arrives as the fused projection made it, [n, heads, 3, d] (rows ordered [heads, 3, d], as in
flash_attention_packed.py), and its gradient is written into one buffer of that layout: no stack, no copy.
The output is [n, heads, d], which the output projection reads as [n, heads * d] without a copy. The kernels
address every tensor through its strides, so q, k, v are plain [n, heads, d] views into qkv (the varlen
layout has no batch stride) and dq, dk, dv views into the gradient's buffer."""
import torch

from minibert.errors import UsageError
from minibert.kernels import interpreting
from minibert.kernels.dropout import kernel_seed
from minibert.kernels.flash_attention import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    attention_forward,
    softmax_scale,
)
from minibert.kernels.flash_attention_bwd import backward_into
from minibert.kernels.flash_common import Varlen
from minibert.kernels.flash_tiles import pick_tiles


class FlashAttentionVarlen(torch.autograd.Function):
    """Every view here is one op on the packed buffers: on small batches the host's time per call, not
    the GPU's, is what a layer waits for (chapter 8, section 6)."""

    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_len, scale, dropout_p, seed):
        q, k, v = qkv.unbind(2)                                   # 3 x [n, heads, d] views
        varlen = Varlen(cu_seqlens, cu_seqlens.numel() - 1, max_len)
        tiles = pick_tiles(qkv.shape[-1], qkv.dtype, max_len)
        out, lse = attention_forward(q, k, v, None, None, scale, dropout_p, seed, tiles[0], varlen=varlen)
        ctx.save_for_backward(qkv, out, lse)
        ctx.varlen, ctx.scale, ctx.dropout_p, ctx.seed, ctx.tiles = varlen, scale, dropout_p, seed, tiles
        return out                                                # [n, heads, d]

    @staticmethod
    def backward(ctx, grad_out):
        qkv, out, lse = ctx.saved_tensors
        q, k, v = qkv.unbind(2)
        dqkv = torch.empty_like(qkv)  # [n, heads, 3, d]: the kernels write into its three views
        dq, dk, dv = dqkv.unbind(2)
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        backward_into(grad_out, q, k, v, out, lse, dq, dk, dv, None, None, ctx.scale, ctx.dropout_p, ctx.seed,
                      ctx.tiles, varlen=ctx.varlen)
        return dqkv, None, None, None, None, None


def check_inputs(qkv, cu_seqlens, dropout_p):
    """One clear UsageError for anything the kernels do not support (a few attribute reads per call)."""
    if qkv.dim() != 4 or qkv.shape[2] != 3 or qkv.shape[0] == 0:
        raise UsageError(f"flash_attention_varlen needs qkv [n, heads, 3, d] with n > 0; got {tuple(qkv.shape)}")
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise UsageError(f"flash_attention_varlen supports float16, bfloat16 and float32; got {qkv.dtype}")
    d = qkv.shape[-1]
    if d % 8 or not 16 <= d <= MAX_HEAD_DIM:
        raise UsageError(f"flash_attention_varlen supports head dims that are multiples of 8 from 16 to "
                         f"{MAX_HEAD_DIM}; got {d}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.device != qkv.device:
        raise UsageError(f"flash_attention_varlen needs cu_seqlens int32 [b + 1] on {qkv.device}; got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)} on {cu_seqlens.device}")
    if qkv.device.type != "cuda" and not interpreting():
        raise UsageError("flash_attention_varlen runs on CUDA (or on CPU with TRITON_INTERPRET=1)")
    if not 0.0 <= dropout_p < 1.0:
        raise UsageError(f"flash_attention_varlen: dropout_p must be in [0, 1); got {dropout_p}")


def flash_attention_varlen(qkv, cu_seqlens, max_len, scale=None, dropout_p=0.0, seed=None):
    """qkv [n, heads, 3, d] packed rows (as the fused projection makes them), cu_seqlens int32 [b + 1] on
    qkv's device (sample i is rows cu_seqlens[i] .. cu_seqlens[i + 1] - 1), max_len >= every sample's
    length (Python int; not checked, which would make the host wait for the device: rows past max_len
    would be left unwritten) -> out [n, heads, d]. Each sample attends to its own rows only. Otherwise as
    minibert.kernels.flash_attention.flash_attention (dropout: the mask of the padded kernels on
    [b, max_len] when the rows are right-padded samples)."""
    check_inputs(qkv, cu_seqlens, dropout_p)
    scale = softmax_scale(scale, qkv.shape[-1])
    seed = kernel_seed(seed, dropout_p, qkv.device)
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    return FlashAttentionVarlen.apply(qkv, cu_seqlens, int(max_len), scale, float(dropout_p), seed)
