"""Flash attention straight from the fused QKV projection, its gradient written back into one buffer.

The model's query_key_value Linear produces qkv [b, s, heads, 3, d] (rows ordered [heads, 3, d]: see
minibert.model.bert.SelfAttention). The plain route unbinds it into three strided views q, k, v, and autograd
then pays for that in the backward: the three gradients come back as separate [b, heads, s, d] tensors,
which the backward of unbind stacks into a new [3, b, heads, s, d] tensor and the backward of the permute
copies again into the [b, s, heads, 3, d] layout the Linear's backward wants: two extra passes over 3x the
activations per layer.

The kernels already address every tensor through its strides, so this function hands them the views
into qkv for the forward, and views into one empty [b, s, heads, 3, d] buffer for dq, dk, dv: the
gradient arrives in the Linear's own layout, no stack, no copy. Same kernels, same numbers."""
import torch

from minibert.kernels.dropout import kernel_seed
from minibert.kernels.flash_attention import (
    attention_forward,
    check_inputs,
    prepare_padding,
    softmax_scale,
)
from minibert.kernels.flash_attention_bwd import backward_into
from minibert.kernels.flash_tiles import pick_tiles


def _views(qkv):
    """qkv [b, s, heads, 3, d] -> q, k, v as [b, heads, s, d] strided views (no copy)."""
    return [t.transpose(1, 2) for t in qkv.unbind(3)]


class FlashAttentionQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, padding_mask, scale, dropout_p, seed):
        q, k, v = _views(qkv)
        bias, kv_len = prepare_padding(padding_mask) if padding_mask is not None else (None, None)
        tiles = pick_tiles(q.shape[-1], q.dtype, q.shape[2])
        out, lse = attention_forward(q, k, v, bias, kv_len, scale, dropout_p, seed, tiles[0])
        ctx.save_for_backward(qkv, out, lse, bias, kv_len)
        ctx.scale, ctx.dropout_p, ctx.seed, ctx.tiles = scale, dropout_p, seed, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, out, lse, bias, kv_len = ctx.saved_tensors
        q, k, v = _views(qkv)
        dqkv = torch.empty_like(qkv)  # [b, s, heads, 3, d]: the kernels write into its three views
        dq, dk, dv = _views(dqkv)
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        backward_into(grad_out, q, k, v, out, lse, dq, dk, dv, bias, kv_len, ctx.scale, ctx.dropout_p, ctx.seed,
                      ctx.tiles)
        return dqkv, None, None, None, None


def flash_attention_qkv(qkv, padding_mask=None, scale=None, dropout_p=0.0, seed=None):
    """qkv [b, s, heads, 3, d] (contiguous, as the fused projection makes it) -> out [b, heads, s, d];
    otherwise as minibert.kernels.flash_attention.flash_attention."""
    q, k, v = _views(qkv)
    check_inputs(q, k, v, padding_mask, dropout_p)
    scale = softmax_scale(scale, q.shape[-1])
    seed = kernel_seed(seed, dropout_p, qkv.device)
    return FlashAttentionQKV.apply(qkv.contiguous(), padding_mask, scale, float(dropout_p), seed)
