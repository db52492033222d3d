"""Packed micro-batches: only the real tokens go through the model, only attention sees the padding.

A BERT micro-batch is [b, s] with every sample padded to s. On real corpora most of it is padding (short
documents give samples far below s), and every token-wise operation - the embeddings, each Linear,
LayerNorm, GeLU, dropout, the LM head - computes results for padded positions that nothing reads. So the
real tokens are packed into rows [n, h], n = the number of real tokens, and only attention, which needs each
sample's tokens together, needs to know where each sample's rows are. The flash backend reads the packed
rows directly (minibert/kernels/flash_attention_varlen.py), told where each sample starts by cu_seqlens;
the other backends work in the [b, s] layout: the packed QKV rows are scattered into a zeroed [b, s, 3h]
buffer before attention, and its output gathered back after it.

    [b, s] tokens:      sample 0: [CLS] a  b  [SEP] .  .        packed rows:  0  1  2  3 | 4  5  6
                        sample 1: [CLS] c  [SEP] .  .  .                      (sample 0)  (sample 1)
    index  (flat positions b*s + j of the real tokens, in order):  [0 1 2 3 6 7 8]
    cls_rows (packed row of each sample's [CLS], for the pooler):  [0 4]
    cu_seqlens (where each sample's rows start, then the end):      [0 4 7]

The micro-batch is also trimmed to its longest sample (rounded up to a multiple of 64, a size the
kernels tile well): the attention then works on [b, s'] with s' <= s. Both are exact: attention masks
padded keys, and the loss never reads padded positions.

With the scatter and gather, a micro-batch that is nearly all real tokens is not packed (worth_packing,
packing_threshold): there they cost more than the few padded positions they skip; it is only trimmed.

The indices are computed on the CPU from the batch as it arrives (no device synchronisation: a boolean
mask on the GPU would make the host wait for the count), then copied to the device with the batch.
The padded layout stays as the plain twin (--no-pack-tokens); pipeline and sequence parallelism need fixed
shapes and use it."""
from collections import namedtuple

import torch

# index, cls_rows: int64 tensors; cu_seqlens: int32 [b + 1], where each sample's rows start (and the end)
Packing = namedtuple("Packing", ["index", "cls_rows", "cu_seqlens", "batch", "seq"])
TRIM_MULTIPLE = 64
PACK_BELOW = 0.85  # share of real tokens under which a micro-batch is packed: where packing paid when it
                   # was measured (bench/notes/packing.md)
PACK_BELOW_VARLEN = 1.0  # the same when attention reads the packed rows (varlen flash): any padding


def packing_threshold(varlen: bool) -> float:
    """The share of real tokens under which get_batch packs a micro-batch. With the varlen flash kernel
    (attention on the packed rows, minibert/kernels/flash_attention_varlen.py) packing costs one gather
    of the embeddings, so any padding is worth skipping; the other backends pay a scatter and a gather
    around every attention, which the padding must outweigh (bench/notes/packing.md)."""
    return PACK_BELOW_VARLEN if varlen else PACK_BELOW


def worth_packing(is_pad, threshold=PACK_BELOW) -> bool:
    """Pack a micro-batch whose share of real tokens is under `threshold` (packing_threshold)."""
    return float((~is_pad).float().mean()) < threshold


def trimmed_length(is_pad, multiple=TRIM_MULTIPLE) -> int:
    """The shortest s' <= s, a multiple of `multiple` (or s), that keeps every real token of [b, s]."""
    s = is_pad.shape[1]
    real = (~is_pad).any(dim=0).nonzero()
    longest = int(real[-1]) + 1 if len(real) else 1
    return min(s, -(-longest // multiple) * multiple)


def make_packing(is_pad, bucket=None) -> Packing:
    """CPU bool [b, s] (True = padding) -> the packing of its real tokens (CPU tensors).

    bucket (<= s; CUDA graphs, minibert/fast/cuda_graphs.py, which replay fixed shapes): the n real rows are
    followed by filler rows up to a multiple of `bucket` (at most b * s), so a micro-batch has one of
    b * s / bucket row counts instead of any. The fillers are the first padding positions (distinct, so
    a scatter back to [b, s] writes each once), they form one more sample of their own in cu_seqlens
    (fewer than bucket <= s rows: the varlen kernel attends among them and nothing else), and the loss
    reads them at padding, where loss_mask is 0: no real row and no gradient sees them."""
    b, s = is_pad.shape
    real = ~is_pad.reshape(-1)
    index = real.nonzero().squeeze(1)                        # [n] flat positions
    counts = (~is_pad).sum(dim=1)                            # [b] real tokens per sample
    ends = torch.cumsum(counts, 0)
    cls_rows = ends - counts                                 # packed row of each sample's first token
    cu_seqlens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)   # [0, end of sample 0, ...]
    if bucket is not None:
        n = len(index)
        rows = bucketed(n, bucket, b * s)
        if rows > n:
            fillers = (~real).nonzero().squeeze(1)[:rows - n]           # the first padding positions
            index = torch.cat([index, fillers])
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([rows])])
    return Packing(index, cls_rows, cu_seqlens, b, s)


def fill_rows(positions, free, bucket, limit):
    """--sparse-mlm under CUDA graphs: the masked positions [n] followed by copies of free[0] up to a
    multiple of bucket (at most limit, the rows there are). free: positions with an LM row whose loss_mask
    is 0 (there is one whenever a filler is needed: n < rows <= limit). Their label is -1 and their weight
    in the loss 0, so they add nothing to the loss or to any gradient; a graph then serves every count of
    masked positions in the same bucket, as make_packing's fillers do for the packed rows."""
    n = len(positions)
    rows = bucketed(n, bucket, limit)
    return torch.cat([positions, free[:1].expand(rows - n)]) if rows > n else positions


def bucketed(n, bucket, limit):
    """n rows rounded up to a multiple of bucket (at least one bucket), but never past limit."""
    return min(limit, -(-max(n, 1) // bucket) * bucket)


def to_device(packing, device) -> Packing:
    return packing._replace(index=packing.index.to(device, non_blocking=True),
                            cls_rows=packing.cls_rows.to(device, non_blocking=True),
                            cu_seqlens=packing.cu_seqlens.to(device, non_blocking=True))


def gather_rows(x, packing):
    """[b, s, f] -> [n, f]: the real positions, packed."""
    return x.reshape(packing.batch * packing.seq, -1).index_select(0, packing.index)


def scatter_rows(x, packing):
    """[n, f] -> [b, s, f]: packed rows back to their positions, zeros at padding."""
    out = x.new_zeros(packing.batch * packing.seq, x.shape[-1])
    return out.index_copy(0, packing.index, x).view(packing.batch, packing.seq, -1)
