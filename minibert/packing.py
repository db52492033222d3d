"""Packed micro-batches: only the real tokens go through the model, only attention sees the padding.

A BERT micro-batch is [b, s] with every sample padded to s. On real corpora most of it is padding (short
documents give samples far below s), and every token-wise operation - the embeddings, each Linear,
LayerNorm, GeLU, dropout, the LM head - computes results for padded positions that nothing reads. So the
real tokens are packed into rows [n, h], n = the number of real tokens, and only attention, which needs each
sample's tokens together, works in the [b, s] layout: the packed QKV rows are scattered into a zeroed
[b, s, 3h] buffer before it, and its output gathered back after it (the kernels skip the padded blocks).

    [b, s] tokens:      sample 0: [CLS] a  b  [SEP] .  .        packed rows:  0  1  2  3 | 4  5  6
                        sample 1: [CLS] c  [SEP] .  .  .                      (sample 0)  (sample 1)
    index  (flat positions b*s + j of the real tokens, in order):  [0 1 2 3 6 7 8]
    cls_rows (packed row of each sample's [CLS], for the pooler):  [0 4]

The micro-batch is also trimmed to its longest sample (rounded up to a multiple of 64, a size the
kernels tile well): the attention then works on [b, s'] with s' <= s. Both are exact: attention masks
padded keys, and the loss never reads padded positions.

A micro-batch that is nearly all real tokens is not packed (worth_packing): there the scatters and
gathers around attention cost more than the few padded positions they skip; it is only trimmed.

The indices are computed on the CPU from the batch as it arrives (no device synchronisation: a boolean
mask on the GPU would make the host wait for the count), then copied to the device with the batch.
The padded layout stays as the plain twin (--no-pack-tokens); pipeline and sequence parallelism need fixed
shapes and use it."""
from collections import namedtuple

import torch

Packing = namedtuple("Packing", ["index", "cls_rows", "batch", "seq"])  # index, cls_rows: int64 tensors
TRIM_MULTIPLE = 64
PACK_BELOW = 0.85  # share of real tokens under which a micro-batch is packed (measured on an H200)


def worth_packing(is_pad, threshold=PACK_BELOW) -> bool:
    """Pack only a micro-batch that is mostly padding: the gathers and scatters around every attention
    cost about as much as the padding they skip once a batch is ~85% real tokens (bench/notes-packing.md)."""
    return float((~is_pad).float().mean()) < threshold


def trimmed_length(is_pad, multiple=TRIM_MULTIPLE) -> int:
    """The shortest s' <= s, a multiple of `multiple` (or s), that keeps every real token of [b, s]."""
    s = is_pad.shape[1]
    real = (~is_pad).any(dim=0).nonzero()
    longest = int(real[-1]) + 1 if len(real) else 1
    return min(s, -(-longest // multiple) * multiple)


def make_packing(is_pad) -> Packing:
    """CPU bool [b, s] (True = padding) -> the packing of its real tokens (CPU tensors)."""
    b, s = is_pad.shape
    real = ~is_pad.reshape(-1)
    index = real.nonzero().squeeze(1)                        # [n] flat positions
    counts = (~is_pad).sum(dim=1)                            # [b] real tokens per sample
    cls_rows = torch.cumsum(counts, 0) - counts              # packed row of each sample's first token
    return Packing(index, cls_rows, b, s)


def to_device(packing, device) -> Packing:
    return packing._replace(index=packing.index.to(device, non_blocking=True),
                            cls_rows=packing.cls_rows.to(device, non_blocking=True))


def gather_rows(x, packing):
    """[b, s, f] -> [n, f]: the real positions, packed."""
    return x.reshape(packing.batch * packing.seq, -1).index_select(0, packing.index)


def scatter_rows(x, packing):
    """[n, f] -> [b, s, f]: packed rows back to their positions, zeros at padding."""
    out = x.new_zeros(packing.batch * packing.seq, x.shape[-1])
    return out.index_copy(0, packing.index, x).view(packing.batch, packing.seq, -1)
