"""Attention backends: one function, three implementations of softmax(q k^T / sqrt(d) + mask) v.

Every backend computes the same thing for the real (non-padded) query positions:

    scores = q @ k^T * scale                  [b, heads, s, s]    scale = 1 / sqrt(d)
    scores[..., j] = -big  where key j is padding
    probs  = dropout(softmax(scores))         (fp32 softmax)
    out    = probs @ v                        [b, heads, s, d]

They differ in how many times the s x s matrices travel through memory (b*heads*s^2 elements each):

| backend | what runs | passes over s x s (fwd) | `auto` picks it |
|---|---|---|---|
| local   | PyTorch ops: matmul, fp32 cast, scale, mask, softmax, dropout, matmul | ~7 | CPU, fp32, other head dims |
| fused   | matmul, one Triton kernel for scale + mask + softmax, dropout, matmul | ~3 | never (to study the kernel) |
| flash   | one Triton kernel: k, v tiles stream past q with an online softmax | 0 | CUDA, fp16/bf16, d in FLASH_HEAD_DIMS |

local writes the scores with the first matmul, then every elementwise op reads and writes them again, and the
backward keeps several copies. fused (minibert.kernels.softmax) reads the scores once and writes the
probabilities once. flash (minibert.kernels.flash_attention) never stores the matrix: only q, k, v, the
output ([b, heads, s, d]) and one statistic per row touch memory, and the backward recomputes the tiles.

"Memory traffic" is what bounds attention at BERT sizes: the two matmuls are fast, while each elementwise
pass over the s x s scores costs as much time as reading it from HBM. Fusing the softmax removes most
passes; flash attention removes the matrix itself, so memory grows as s, not s^2.

Masking: padding_mask is bool [b, s], True = padding, and masks *keys* only (a padded query still attends
to the real keys; its output is never used by the loss). The plain backends fill masked scores with
finfo.min, not -inf: a row whose keys are all padding then gives a uniform softmax instead of NaN.

Dropout: local/fused drop with torch's RNG, flash with a hash of each element's position inside the
kernel (keyed by a seed from torch's generator). Each is repeatable under torch.manual_seed; across backends
the dropped entries differ, so with dropout on they agree in distribution, not bit for bit.

The Triton kernels are imported only when their backend runs, so a CPU-only install without them
still runs local attention."""
import math

import torch
import torch.nn.functional as F

from minibert.errors import UsageError

BACKENDS = ("auto", "local", "fused", "flash")
FLASH_HEAD_DIMS = range(16, 129, 8)  # what the flash kernel takes: multiples of 8 up to 128 (BERT: 64)


def resolve_backend(name: str, device, dtype=None, head_dim=None) -> str:
    """The backend `attention` should run: `name` unless it is "auto".

    auto -> "flash" on CUDA when the model runs in fp16/bf16 (the kernel's tensor-core path) with a head
    dim in FLASH_HEAD_DIMS; otherwise "local" (always on CPU: Triton needs a GPU outside its interpreter)."""
    if name not in BACKENDS:
        raise UsageError(f"--attention-backend {name!r} is unknown: use one of {', '.join(BACKENDS)}")
    if name != "auto":
        return name
    device = torch.device(device)
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half and head_dim in FLASH_HEAD_DIMS:
        return "flash"
    return "local"



def reads_packed_rows(backend: str) -> bool:
    """True where attention takes packed rows [n, ...] with cu_seqlens (the flash kernels' varlen layout,
    kernels/flash_attention_varlen.py); the other backends need the padded [b, s] layout around them."""
    return backend == "flash"


def attention(q, k, v, padding_mask=None, *, backend="local", dropout_p=0.0):
    """q, k, v [b, heads, s, d] -> [b, heads, s, d]; padding_mask bool [b, s], True = padding key.

    `backend` is a resolved name (see resolve_backend). dropout_p > 0 only while training."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "local":
        return _plain_attention(q, k, v, padding_mask, scale, dropout_p)
    if backend == "fused":
        from minibert.kernels.softmax import fused_scale_mask_softmax
        scores = torch.matmul(q, k.transpose(-2, -1))  # [b, heads, s, d] @ [b, heads, d, s] -> [b, heads, s, s]
        mask = None if padding_mask is None else padding_mask[:, None, None, :]  # [b, s] -> [b, 1, 1, s]
        probs = fused_scale_mask_softmax(scores, mask, scale)  # [b, heads, s, s], dtype of scores
        probs = F.dropout(probs, p=dropout_p) if dropout_p > 0 else probs
        return torch.matmul(probs, v)  # [b, heads, s, s] @ [b, heads, s, d] -> [b, heads, s, d]
    if backend == "flash":
        from minibert.kernels.flash_attention import flash_attention
        # dropout: the kernel's dropout seed is drawn from torch's CPU generator, so torch.manual_seed
        # makes a run repeatable, as with the other backends' dropout (on the device while a CUDA graph
        # is captured: kernels/dropout.py, draw_seed)
        return flash_attention(q, k, v, padding_mask, scale, dropout_p)
    raise ValueError(f"unresolved attention backend {backend!r}: call resolve_backend first")


def attention_qkv(qkv, padding_mask=None, *, backend="local", dropout_p=0.0):
    """The fused projection's output qkv [b, s, heads, 3, d] -> [b, heads, s, d]. The flash backend reads
    and writes the packed buffer directly (kernels/flash_attention_packed.py: no copies in the backward);
    the others take its three views."""
    if backend == "flash":
        from minibert.kernels.flash_attention_packed import flash_attention_qkv
        return flash_attention_qkv(qkv, padding_mask, dropout_p=dropout_p)
    q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x [b, heads, s, d]
    return attention(q, k, v, padding_mask, backend=backend, dropout_p=dropout_p)


def _plain_attention(q, k, v, padding_mask, scale, dropout_p):
    """The reference: every step a separate PyTorch op, softmax in fp32."""
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # [b, heads, s, s] fp32
    if padding_mask is not None:
        key_is_pad = padding_mask[:, None, None, :]  # [b, s] -> [b, 1, 1, s], broadcast over heads, queries
        scores = scores.masked_fill(key_is_pad, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [b, heads, s, s]
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)  # [b, heads, s, s] @ [b, heads, s, d] -> [b, heads, s, d]
