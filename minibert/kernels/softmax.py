"""Fused scale-mask-softmax: the attention probabilities in one pass over memory.

What you will learn: why a chain of elementwise ops and a row reduction is limited by memory, not by
arithmetic; how a Triton program handles a [ROWS, BLOCK] tile of rows; how softmax is made safe (max
subtraction, rows with every key masked) and cheap (exp2 with log2(e) folded into the scale); and why the
softmax backward needs only its output y.

Attention turns scores S = Q K^T, one [sq, sk] matrix per (batch, head), into probabilities

    P = softmax(where(mask, -inf, S * scale), dim=-1)          scale = 1/sqrt(head_dim)

    scores [b, heads, sq, sk]        mask [b, 1, 1, sk] (True = padding key), broadcast over heads, queries
    row r = (batch, head, query)     P[r, :] = exp(z - max z) / sum(exp(z - max z)),  z = scaled, masked row

Each output element needs one multiply, a compare and an exp: a few flops per 2-4 bytes moved. A GPU's fp32
units (no tensor cores here) do tens of flops in the time its memory moves those bytes, so the time is the
bytes. Eager PyTorch runs three kernels and each one streams the whole tensor (softmax_reference counts
them: 6 passes forward, 7 backward); the fused kernel reads x once and writes y once (2 passes), and its
backward reads y and dy and writes dx (3). BERT-large at s=512, b=32: 134M scores per layer, 268 MB in bf16.

Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (the tests: the same kernel source, interpreted, slow).
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minibert.kernels import interpreting

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): exp2 is the GPU's native instruction


# --------------------------------------------------------------------------------------------------
# 1. The naive version: three kernels, each a full trip through memory
# --------------------------------------------------------------------------------------------------
def softmax_reference(scores, mask, scale):
    """Eager PyTorch: the baseline the kernel replaces, and the benchmark's oracle.

    Memory traffic, in units of one [b, heads, sq, sk] tensor T (the mask is small and not counted):
        t1 = scores * scale              read T, write T
        t2 = t1.masked_fill(mask, min)   read T, write T
        y  = t2.softmax(-1)              read T, write T       forward: 6 T   (fused: 2 T)
    and backward (autograd replays the chain in reverse):
        softmax backward                 read y, dy, write     3 T
        masked_fill backward             read T, write T       2 T
        mul backward                     read T, write T       2 T   backward: 7 T   (fused: 3 T)
    The mask fills with the dtype's most negative number rather than -inf so that a row with every key
    masked gives a uniform row instead of NaN (0/0); the last line sets such rows to 0, as the kernel does
    (2 T more; the benchmark's eager row times the three-op chain without it).
    """
    x = scores * scale
    if mask is not None:
        x = x.masked_fill(mask, torch.finfo(x.dtype).min)
    y = torch.softmax(x, dim=-1)
    if mask is not None:
        y = y.masked_fill(mask.all(dim=-1, keepdim=True), 0.0)
    return y


# --------------------------------------------------------------------------------------------------
# 2. Tuning knobs and the default choice
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoftmaxConfig:
    """How the rows are cut into programs. bench/softmax_bench.py sweeps these on the GPU."""
    rows: int                 # rows per tile, a power of 2: one 512-wide bf16 row (1 KB) is too little per program
    num_warps: int            # 32 threads each; aim for ~8-32 elements per thread
    block: int = 0            # columns per load, a power of 2; 0 = the whole row (next power of 2 >= sk)
    programs_per_sm: int = 0  # 0 = one program per tile; k > 0 = a persistent grid of k * SMs programs
    loop_stages: int = 1      # software-pipeline depth of the tile loop (prefetch the next tile); 1 = none


MAX_ONE_PASS_BLOCK = 16384  # longest row kept in registers (32 fp32 per thread at 16 warps); longer rows loop
LONG_ROW_BLOCK = 4096       # chunk width when looping over a long row
# Tile shape per direction, picked by `python bench/softmax_bench.py` (its sweep, at bf16 [32,16,512,512]),
# results in bench/results/softmax_h200_2026-12-06.txt: forward at 2048 elements per program and 32 per thread (4 rows x 512,
# 2 warps), backward at 1024 and 8 per thread (2 rows, 4 warps). Short programs with few warps keep many
# tiles in flight per SM, which is what a streaming kernel needs.
TILE_ELEMENTS = {"forward": 2048, "backward": 1024}        # elements per tile
ELEMENTS_PER_THREAD = {"forward": 32, "backward": 8}       # elements each thread holds per input


def default_config(sk, direction="forward"):
    """The tile used when no config is given: ~TILE_ELEMENTS[direction] per program, whole rows."""
    block = triton.next_power_of_2(sk)
    if block > MAX_ONE_PASS_BLOCK:
        return SoftmaxConfig(rows=1, num_warps=16, block=LONG_ROW_BLOCK)
    rows = min(max(TILE_ELEMENTS[direction] // block, 1), 64)  # short rows: many per tile
    num_warps = min(max(rows * block // (32 * ELEMENTS_PER_THREAD[direction]), 1), 16)
    return SoftmaxConfig(rows=rows, num_warps=num_warps)


# --------------------------------------------------------------------------------------------------
# 3. The kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _row_offsets(rows, heads, sq, sk, stride_b, stride_h, stride_q, CONTIGUOUS: tl.constexpr):
    """Element offset where each row starts. Row r of the [b * heads * sq, sk] view is
    (batch, head, query) = (r // (heads*sq), (r // sq) % heads, r % sq). A stride of 0 means the tensor
    is broadcast along that dim (the mask over heads and queries). A contiguous tensor skips the integer
    divisions (tens of instructions each on a GPU). int64: large tensors pass 2^31 elements."""
    if CONTIGUOUS:
        offsets = rows.to(tl.int64) * sk
    else:
        batch_head = rows // sq
        query = rows - batch_head * sq
        batch = batch_head // heads
        head = batch_head - batch * heads
        offsets = batch.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + query.to(tl.int64) * stride_q
    return offsets


@triton.jit
def _scaled_logits(x_rows, mask_rows, cols, ok, sk, mask_stride_k, scale_log2e,
                   MASK_MODE: tl.constexpr, EVICT: tl.constexpr):
    """Load a [ROWS, BLOCK] tile and return z = x * scale * log2(e) in fp32, -inf where masked or out of
    bounds. MASK_MODE 0: no mask; 1: one [BLOCK] mask row shared by the whole tile (key padding);
    2: a mask row per score row."""
    x = tl.load(x_rows[:, None] + cols[None, :], mask=ok, other=0.0, eviction_policy=EVICT)
    drop = ~ok
    if MASK_MODE == 1:
        key_masked = tl.load(mask_rows + cols * mask_stride_k, mask=cols < sk, other=1)  # [BLOCK]
        drop = drop | (key_masked != 0)[None, :]
    if MASK_MODE == 2:
        masked = tl.load(mask_rows[:, None] + cols[None, :] * mask_stride_k, mask=ok, other=1)
        drop = drop | (masked != 0)
    return tl.where(drop, float("-inf"), x.to(tl.float32) * scale_log2e)


@triton.jit
def _softmax_fwd_kernel(x_ptr, y_ptr, mask_ptr, n_rows, heads, sq, sk,
                        x_stride_b, x_stride_h, x_stride_q,
                        mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k, scale_log2e,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, MASK_MODE: tl.constexpr,
                        X_CONTIGUOUS: tl.constexpr, ONE_PASS: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """y = softmax over each row of where(mask, -inf, x * scale), ROWS rows per tile.

        x viewed as [b*heads*sq, sk]            one tile = ROWS rows x BLOCK columns (BLOCK >= sk:
        +----------- sk -----------+..+         padded columns load as masked)
        | tile 0   rows 0..ROWS-1  |  |  -> load [ROWS, BLOCK], max and sum along columns, store y
        | tile 1                   |  |
        | ...                      |  |     long rows (sk > BLOCK): walk the row in BLOCK-wide chunks
        +--------------------------+..+

    The grid is either one program per tile or a persistent grid whose programs stride over tiles:
        program p handles tiles p, p + P, p + 2P, ...    (P = number of programs)
    """
    n_tiles = tl.cdiv(n_rows, ROWS)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)                                  # [ROWS]
        x_rows = x_ptr + _row_offsets(rows, heads, sq, sk, x_stride_b, x_stride_h, x_stride_q, X_CONTIGUOUS)
        y_rows = y_ptr + rows.to(tl.int64) * sk                                  # y is contiguous
        if MASK_MODE == 1:  # every row of the tile is in one batch (the launcher checks): one mask row
            mask_rows = mask_ptr + ((tile * ROWS) // (heads * sq)).to(tl.int64) * mask_stride_b
        else:
            mask_rows = mask_ptr + _row_offsets(rows, heads, sq, sk, mask_stride_b, mask_stride_h, mask_stride_q,
                                                False)
        if ONE_PASS:  # the row fits in registers: read once, write once
            cols = tl.arange(0, BLOCK)
            ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]                # [ROWS, BLOCK]
            z = _scaled_logits(x_rows, mask_rows, cols, ok, sk, mask_stride_k, scale_log2e,
                               MASK_MODE, "evict_first")                         # streamed, never reused
            row_max = tl.max(z, axis=1)
            row_max = tl.where(row_max == float("-inf"), 0.0, row_max)          # all masked: no -inf - -inf
            p = tl.exp2(z - row_max[:, None])                                    # masked -> exp2(-inf) = 0
            denom = tl.sum(p, axis=1)
            inv = 1.0 / tl.where(denom > 0, denom, 1.0)                          # all masked: p = 0, y = 0
            tl.store(y_rows[:, None] + cols[None, :], (p * inv[:, None]).to(y_ptr.dtype.element_ty), mask=ok)
        else:  # long row: an online pass for (max, sum), then a second pass that writes y
            row_max = tl.full([ROWS], float("-inf"), tl.float32)
            denom = tl.zeros([ROWS], tl.float32)
            for start in range(0, sk, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]
                z = _scaled_logits(x_rows, mask_rows, cols, ok, sk, mask_stride_k, scale_log2e,
                                   MASK_MODE, "evict_last")                      # read again in pass 2
                new_max = tl.maximum(row_max, tl.max(z, axis=1))
                safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
                # rescale the running sum to the new max: sum exp2(z - m_old) * exp2(m_old - m_new)
                denom = denom * tl.exp2(row_max - safe_max) + tl.sum(tl.exp2(z - safe_max[:, None]), axis=1)
                row_max = new_max
            safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
            inv = 1.0 / tl.where(denom > 0, denom, 1.0)
            for start in range(0, sk, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]
                z = _scaled_logits(x_rows, mask_rows, cols, ok, sk, mask_stride_k, scale_log2e,
                                   MASK_MODE, "evict_first")
                p = tl.exp2(z - safe_max[:, None]) * inv[:, None]
                tl.store(y_rows[:, None] + cols[None, :], p.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_kernel(y_ptr, dy_ptr, dx_ptr, n_rows, heads, sq, sk,
                        dy_stride_b, dy_stride_h, dy_stride_q, scale,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, DY_CONTIGUOUS: tl.constexpr,
                        ONE_PASS: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """dx = scale * y * (dy - sum(y * dy)) per row.

    Why: y_j = exp(z_j) / sum_k exp(z_k) gives dy_j/dz_i = y_j (delta_ij - y_i), so
    dL/dz_i = sum_j dL/dy_j * y_j (delta_ij - y_i) = y_i (dy_i - sum_j y_j dy_j), and z = x * scale.
    Masked keys have y = 0, so their gradient is 0 with no mask needed: the backward never reads it.
    """
    n_tiles = tl.cdiv(n_rows, ROWS)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=LOOP_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)                                  # [ROWS]
        y_rows = y_ptr + rows.to(tl.int64) * sk                                  # y, dx contiguous
        dx_rows = dx_ptr + rows.to(tl.int64) * sk
        dy_rows = dy_ptr + _row_offsets(rows, heads, sq, sk, dy_stride_b, dy_stride_h, dy_stride_q, DY_CONTIGUOUS)
        if ONE_PASS:
            cols = tl.arange(0, BLOCK)
            ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]
            y = tl.load(y_rows[:, None] + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
            dy = tl.load(dy_rows[:, None] + cols[None, :], mask=ok, other=0.0, eviction_policy="evict_first")
            y, dy = y.to(tl.float32), dy.to(tl.float32)
            dot = tl.sum(y * dy, axis=1)                                         # [ROWS]
            dx = scale * y * (dy - dot[:, None])
            tl.store(dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
        else:  # long row: one pass for the dot product, one for dx
            dot = tl.zeros([ROWS], tl.float32)
            for start in range(0, sk, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]
                y = tl.load(y_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                dot += tl.sum(y * dy, axis=1)
            for start in range(0, sk, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = (rows < n_rows)[:, None] & (cols < sk)[None, :]
                y = tl.load(y_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_rows[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                dx = scale * y * (dy - dot[:, None])
                tl.store(dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)


# --------------------------------------------------------------------------------------------------
# 4. Launchers: check inputs, pick the tile, size the grid
# --------------------------------------------------------------------------------------------------
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_inputs(scores, mask, scale):
    """One clear error per unsupported input, naming what is supported."""
    if not isinstance(scores, torch.Tensor) or scores.dtype not in SUPPORTED_DTYPES:
        got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TypeError(f"fused_scale_mask_softmax: scores must be a float32, float16 or bfloat16 tensor; "
                        f"got {got}")
    if scores.dim() != 4:
        raise ValueError(f"fused_scale_mask_softmax: scores must be 4-D [b, heads, sq, sk]; "
                         f"got shape {tuple(scores.shape)}")
    if scores.device.type != "cuda" and not interpreting():
        raise ValueError(f"fused_scale_mask_softmax runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set "
                         f"before triton is imported); got a tensor on {scores.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"fused_scale_mask_softmax: scale must be a Python float; got {type(scale).__name__}")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"fused_scale_mask_softmax: mask must be a bool tensor (True = masked out) or None; "
                        f"got {got}")
    try:
        broadcasts = torch.broadcast_shapes(mask.shape, scores.shape) == scores.shape
    except RuntimeError:
        broadcasts = False
    if not broadcasts:
        b, h, sq, sk = scores.shape
        raise ValueError(f"fused_scale_mask_softmax: mask of shape {tuple(mask.shape)} does not broadcast to scores "
                         f"{tuple(scores.shape)}; supported: [b,1,1,sk]=[{b},1,1,{sk}] (key padding), "
                         f"[b,1,sq,sk]=[{b},1,{sq},{sk}], [b,heads,sq,sk] or None")
    if mask.device != scores.device:
        raise ValueError(f"fused_scale_mask_softmax: mask is on {mask.device} but scores are on {scores.device}")


def _last_dim_contiguous(t):
    """Rows may sit anywhere (any stride on b, heads, sq) but each row must be contiguous."""
    return t if t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


def _tile(sk, config):
    block = config.block or triton.next_power_of_2(sk)
    if config.rows & (config.rows - 1) or block & (block - 1):
        raise ValueError(f"SoftmaxConfig rows and block must be powers of 2; got {config}")
    return block, block >= sk  # one pass when the block covers the row


def _grid(n_tiles, config, device):
    if config.programs_per_sm == 0:
        return (n_tiles,)
    # On CPU (the interpreter) pretend there are 2 SMs, so tests exercise the persistent loop.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return (min(n_tiles, config.programs_per_sm * sms),)


def _forward(scores, mask, scale, config):
    x = _last_dim_contiguous(scores)
    b, heads, sq, sk = x.shape
    y = torch.empty((b, heads, sq, sk), dtype=x.dtype, device=x.device)        # contiguous output
    if y.numel() == 0:
        return y
    config = config or default_config(sk)
    block, one_pass = _tile(sk, config)
    n_rows = b * heads * sq                                                      # the [b*heads*sq, sk] view
    if mask is None:
        mask_mode, m, mask_strides = 0, x, (0, 0, 0, 0)                          # m: an unused pointer
    else:
        m = mask.view(torch.uint8).expand(b, heads, sq, sk)                      # strides 0 where broadcast
        mask_strides = m.stride()
        per_batch = mask_strides[1] == 0 and mask_strides[2] == 0 and (heads * sq) % config.rows == 0
        mask_mode = 1 if per_batch else 2
    _softmax_fwd_kernel[_grid(triton.cdiv(n_rows, config.rows), config, x.device)](
        x, y, m, n_rows, heads, sq, sk, *x.stride()[:3], *mask_strides, scale * LOG2E,
        ROWS=config.rows, BLOCK=block, MASK_MODE=mask_mode, X_CONTIGUOUS=x.is_contiguous(), ONE_PASS=one_pass,
        LOOP_STAGES=config.loop_stages, num_warps=config.num_warps)
    return y


def _backward(y, dy, scale, config):
    dy = _last_dim_contiguous(dy)
    b, heads, sq, sk = y.shape
    dx = torch.empty_like(y)
    if dx.numel() == 0:
        return dx
    config = config or default_config(sk, "backward")
    block, one_pass = _tile(sk, config)
    n_rows = b * heads * sq
    _softmax_bwd_kernel[_grid(triton.cdiv(n_rows, config.rows), config, y.device)](
        y, dy, dx, n_rows, heads, sq, sk, *dy.stride()[:3], scale,
        ROWS=config.rows, BLOCK=block, DY_CONTIGUOUS=dy.is_contiguous(), ONE_PASS=one_pass,
        LOOP_STAGES=config.loop_stages,
        num_warps=config.num_warps)
    return dx


class _FusedScaleMaskSoftmax(torch.autograd.Function):
    """Forward saves only y: the backward needs nothing else (not x, not the mask)."""

    @staticmethod
    def forward(ctx, scores, mask, scale, config):
        y = _forward(scores, mask, scale, config)
        ctx.save_for_backward(y)
        ctx.scale, ctx.config = scale, config
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _backward(y, dy, ctx.scale, ctx.config), None, None, None


def fused_scale_mask_softmax(scores, mask, scale, *, config=None):
    """softmax(where(mask, -inf, scores * scale), dim=-1), differentiable, in one kernel each way.

    scores: [b, heads, sq, sk] float32/float16/bfloat16 (any sk; rows must be contiguous or are copied).
    mask: bool, True = masked out, broadcastable to scores ([b,1,1,sk], [b,1,sq,sk], [b,heads,sq,sk]) or None.
    Returns a contiguous tensor of scores' dtype (math in fp32). Rows with every key masked give 0.
    config: a SoftmaxConfig for both directions (the benchmark's sweep); None = default_config per direction.
    """
    _check_inputs(scores, mask, scale)
    return _FusedScaleMaskSoftmax.apply(scores, mask, float(scale), config)


# --------------------------------------------------------------------------------------------------
# 5. What production does differently
# --------------------------------------------------------------------------------------------------
# Megatron-LM runs this op as hand-written CUDA (scaled_masked_softmax, and scaled_upper_triang_masked_softmax
# for causal GPT; built from Apex or TransformerEngine, wrapped by megatron/core/fusions/fused_softmax.py).
# Differences worth knowing:
# - A warp per row (or two), the row in registers, templated on power-of-2 lengths; it applies only to fp16/bf16
#   with 16 < sk <= 4096 and sq, sk, b*heads multiples of 4 (is_kernel_available). Any other shape falls
#   back to the eager chain above. Here one kernel takes any sk: a block for short rows, chunks for long ones.
# - It fills masked scores with -10000 instead of -inf, so a fully masked row becomes uniform (1/sk), not
#   0. BERT never has such rows (a sequence always has [CLS]); we return 0, which is also what a kernel that
#   skips padded keys (flash attention) naturally produces.
# - Its backward is the same formula, in place into the incoming gradient to save memory.
# - With flash attention (minibert/kernels/flash_attention.py) the [sq, sk] matrix never reaches memory at
#   all: the softmax is computed tile by tile next to the matmuls. That is the real fix for this traffic;
#   a fused softmax is the step before it, and still what runs when attention needs the probabilities.
