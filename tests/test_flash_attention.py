"""Flash attention (Triton, run by the CPU interpreter) against plain float64 PyTorch attention.

Outputs are compared at real query rows only (padded rows are unspecified); dO is zeroed at padded query
rows, as the contract says, so gradients of every input are compared everywhere."""
import itertools
import os

import numpy as np
import pytest
import torch

from minibert.errors import UsageError
from minibert.kernels.dropout import (
    dropout_mask,
    dropout_threshold,
    effective_dropout_p,
    reference_keep_mask,
)
from minibert.kernels.flash_attention import (
    attention_forward,
    attention_reference,
    flash_attention,
    prepare_padding,
)
from minibert.kernels.flash_attention_bwd import attention_backward
from minibert.kernels.flash_common import MASKED
from minibert.kernels.flash_tiles import (
    FP32_TILES,
    INTERPRETER_TILES,
    LONG_FORWARD,
    TILE_CANDIDATES,
    Tile,
)
from tests.conftest import run_without_interpreter


def right_padded(lengths, s):
    """bool [b, s], True = padding, for the given real lengths."""
    return torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]


def make_inputs(b, h, s, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, do


def reference(q, k, v, do, pad, scale=None, dropout_p=0.0, keep=None):
    """(out, dq, dk, dv) of plain attention in the inputs' dtype (float64 in these tests)."""
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*inputs, padding_mask=pad, scale=scale, keep_mask=keep, dropout_p=dropout_p)
    out.backward(do)
    return (out, *(t.grad for t in inputs))


def run_both(q, k, v, do, pad, dtype=torch.float32, scale=None, dropout_p=0.0, seed=None, keep=None):
    """(ours, reference): each a tuple (out, dq, dk, dv); dO is zeroed at padded query rows."""
    if pad is not None:
        do = do.masked_fill(pad[:, None, :, None], 0.0)
    ours_in = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = flash_attention(*ours_in, padding_mask=pad, scale=scale, dropout_p=dropout_p, seed=seed)
    out.backward(do.to(dtype))
    return (out, *(t.grad for t in ours_in)), reference(q, k, v, do, pad, scale, dropout_p, keep)


def assert_matches(ours, ref, pad, atol=1e-4, rtol=1e-4):
    real_rows = torch.ones(ref[0].shape[0], ref[0].shape[2], dtype=torch.bool) if pad is None else ~pad
    assert torch.isfinite(ours[0]).all()
    out, ref_out = ours[0].double(), ref[0]
    torch.testing.assert_close(out[real_rows[:, None, :, None].expand_as(out)],
                               ref_out[real_rows[:, None, :, None].expand_as(ref_out)], atol=atol, rtol=rtol)
    for name, a, e in zip(("dq", "dk", "dv"), ours[1:], ref[1:]):
        torch.testing.assert_close(a.double(), e, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_head_dims_match_reference(d):
    pad = right_padded([100, 61], 100)                  # several blocks; a partial last block
    q, k, v, do = make_inputs(2, 2, 100, d, seed=d)
    ours, ref = run_both(q, k, v, do, pad)
    assert_matches(ours, ref, pad)


@pytest.mark.parametrize("s", [1, 17, 100])
def test_awkward_lengths(s):
    pad = right_padded([s, max(1, s // 3)], s)
    q, k, v, do = make_inputs(2, 2, s, 64, seed=s)
    ours, ref = run_both(q, k, v, do, pad)
    assert_matches(ours, ref, pad)


def test_heavy_and_arbitrary_padding():
    s = 40
    g = torch.Generator().manual_seed(1)
    pad = torch.rand(4, s, generator=g) < 0.85          # row 0: holes everywhere, most keys padded
    pad[0, 5] = False
    pad[1] = True                                       # row 1: a single real key, in the middle
    pad[1, 23] = False
    pad[2] = True                                       # row 2: all padding -> finite, zero gradients
    pad[3] = torch.arange(s) < 30                       # row 3: left padding
    bias, kv_len = prepare_padding(pad)
    assert kv_len[:, 0].tolist() == [max([i + 1 for i in range(s) if not pad[r, i]], default=0) for r in range(4)]
    assert kv_len[:, 1].tolist() == [min([i for i in range(s) if pad[r, i]], default=s) for r in range(4)]
    assert torch.equal(bias, torch.where(pad, MASKED, 0.0))
    q, k, v, do = make_inputs(4, 2, s, 32, seed=2)
    ours, ref = run_both(q, k, v, do, pad)
    assert_matches(ours, ref, pad)
    for t in ours:
        assert torch.isfinite(t).all()
    assert (ours[0][2] == 0).all() and all((g[2] == 0).all() for g in ours[1:])


def test_no_mask_scale_and_strided_inputs():
    b, h, s, d = 2, 3, 45, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, s, 3, h, d, generator=g, dtype=torch.float64)    # a fused QKV projection's layout
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))          # [b, h, s, d] views, d contiguous
    do = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    ours, ref = run_both(q, k, v, do, None, scale=0.3)
    assert_matches(ours, ref, None)
    assert ours[0].transpose(1, 2).is_contiguous()      # stored [b, s, h, d]: merging heads is a free view


INTERPRETER_BF16_DOT_BROKEN = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="Triton's CPU interpreter multiplies bf16 bit patterns as integers in tl.dot (interpreter.py "
           "create_dot); bf16 is checked on the GPU by bench/attention_bench.py before timing")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=INTERPRETER_BF16_DOT_BROKEN)])
def test_half_precision_forward(dtype):
    pad = right_padded([50, 33], 50)
    q, k, v, _ = make_inputs(2, 2, 50, 64, seed=4)
    out = flash_attention(*(t.to(dtype) for t in (q, k, v)), padding_mask=pad)
    assert out.dtype == dtype
    ref = attention_reference(*(t.to(dtype).double() for t in (q, k, v)), padding_mask=pad)
    real = (~pad)[:, None, :, None].expand_as(ref)
    torch.testing.assert_close(out.double()[real], ref[real], atol=2e-2, rtol=2e-2)


def gpu_tile_sets():
    """Every (block_m, block_n) any GPU tile uses, per kernel, grouped into few (forward, dq, dkdv) runs:
    warps, stages and register caps do not change the math, block sizes do. Where two tiles share block
    sizes the later one runs: LONG_FORWARD's, so its register cap goes through the launcher here too."""
    per_kernel = []
    for kernel_index, name in enumerate(("forward", "dq", "dkdv")):
        tiles = [FP32_TILES[kernel_index]] + [t for c in TILE_CANDIDATES.values() for t in c[name]]
        if name == "forward":
            tiles += list(LONG_FORWARD.values())
        per_kernel.append(list({(t.block_m, t.block_n): t for t in tiles}.values()))
    rows = itertools.zip_longest(*per_kernel)
    return [tuple(t or FP32_TILES[i] for i, t in enumerate(row)) for row in rows]


def tile_id(tiles):
    return "-".join(f"{t.block_m}x{t.block_n}" for t in tiles)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("tiles", gpu_tile_sets(), ids=tile_id)
def test_gpu_tiles_are_correct(tiles, dropout_p):
    """The GPU block sizes (those the bench sweeps) cross padding and sequence ends correctly too, and with
    dropout every block size draws the same mask (the one dropout_mask draws in 32 x 32 tiles)."""
    fwd, dq, dkdv = tiles
    s, seed = 199, 11
    pad = right_padded([199, 130, 1], s)
    q, k, v, do = make_inputs(3, 1, s, 64, seed=5)
    do = do.masked_fill(pad[:, None, :, None], 0.0)
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    bias, kv_len = prepare_padding(pad)
    out, lse = attention_forward(q32, k32, v32, bias, kv_len, 0.125, dropout_p, seed, fwd)
    grads = attention_backward(do32, q32, k32, v32, out, lse, bias, kv_len, 0.125, dropout_p, seed,
                               (fwd, dq, dkdv, None))
    keep = dropout_mask(3, 1, s, seed, dropout_p) if dropout_p else None
    expected = reference(q, k, v, do, pad, scale=0.125, dropout_p=effective_dropout_p(dropout_p), keep=keep)
    assert_matches((out, *grads), expected, pad)


def short_and_two_kernel_grads(s, lengths, dropout_p, short, seed=7):
    """(the short backward's (out, dq, dk, dv), the two kernels', the float64 reference) on one input."""
    pad = right_padded(lengths, s) if lengths else None
    if pad is not None:
        pad[0, 5] = True  # a hole: a padded key before the last real one, which only the bias masks
    q, k, v, do = make_inputs(len(lengths or [0, 0]), 2, s, 64, seed=s)
    if pad is not None:
        do = do.masked_fill(pad[:, None, :, None], 0.0)
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    bias, kv_len = prepare_padding(pad) if pad is not None else (None, None)
    fwd, dq, dkdv = FP32_TILES[:3] if short.block_n > 64 else INTERPRETER_TILES[:3]
    out, lse = attention_forward(q32, k32, v32, bias, kv_len, 0.125, dropout_p, seed, fwd)
    one, two = (attention_backward(do32, q32, k32, v32, out, lse, bias, kv_len, 0.125, dropout_p, seed,
                                   (fwd, dq, dkdv, last)) for last in (short, None))
    keep = dropout_mask(q.shape[0], 2, s, seed, dropout_p) if dropout_p else None
    expected = reference(q, k, v, do, pad, scale=0.125, dropout_p=effective_dropout_p(dropout_p), keep=keep)
    return (out, *one), (out, *two), expected, pad


@pytest.mark.parametrize("s, lengths, dropout_p", [(64, [64, 40, 1, 0], 0.0), (64, [64, 40, 1, 0], 0.2),
                                                   (33, None, 0.0), (33, None, 0.2), (17, [9, 17], 0.2)])
def test_short_backward_matches_the_two_kernels_and_the_reference(s, lengths, dropout_p):
    """Where one program holds every key (s <= the short tile's block_n), one kernel makes dQ, dK and dV:
    the same gradients as the dq + dkdv pair (to float32 rounding: dQ is summed in another order) and as
    float64 attention, with padding (a fully padded sample included), without it, and with dropout."""
    one, two, expected, pad = short_and_two_kernel_grads(s, lengths, dropout_p, Tile(16, 64, 1, 1))
    assert_matches(one, expected, pad)
    for a, b in zip(one[1:], two[1:]):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    if lengths and 0 in lengths:
        assert all((g[lengths.index(0)] == 0).all() for g in one[1:])


@pytest.mark.parametrize("tile", list({(t.block_m, t.block_n): t for t in TILE_CANDIDATES[64]["short"]}.values()),
                         ids=lambda t: f"{t.block_m}x{t.block_n}")
def test_short_backward_gpu_tiles_are_correct(tile):
    """Every GPU tile of the short backward (the bench's sweep candidates) at its longest sequence,
    with padding and dropout."""
    one, _, expected, pad = short_and_two_kernel_grads(tile.block_n, [tile.block_n, 70, 1], 0.2, tile)
    assert_matches(one, expected, pad)


def hash_oracle(seed, stream, rows, cols, width, threshold):
    """The keep decision as kernels/dropout.py's docstring writes it, in numpy uint32 arithmetic (which wraps
    mod 2^32), written from the docstring: an oracle independent of reference_keep_mask's int64 code."""
    u = np.uint32
    with np.errstate(over="ignore"):
        def mix(x):
            x = x ^ (x >> u(16)); x = x * u(0x7FEB352D); x = x ^ (x >> u(15)); x = x * u(0x846CA68B)
            return x ^ (x >> u(16))
        k1 = mix(u(seed) ^ mix(u(stream) + u(0x9E3779B9)))
        k2 = mix(k1 + u(0x6A09E667))
        x = (rows.astype(u) * u(width) + cols.astype(u)) * u(0x9E3779B1) + k1
        x = x ^ (x >> u(16))
        x = x * u(0x7FEB352D) + k2
        x = x ^ (x >> u(15))
        x = x * u(0x846CA68B)
    return x >= u(2 * threshold)


@pytest.mark.parametrize("seed", [0, 2**31 - 2])
def test_dropout_mask_is_the_documented_hash(seed):
    """Element (bh, i, j) is kept iff hash(i * s + j; keys of (seed, bh)) >= 2t: a function of (bh, i, j)
    alone, so any tile size (block) draws the same mask; s = 37 is odd, so tiles end part-way."""
    b, h, s, p = 1, 3, 37, 0.3
    i, j = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    expected = torch.stack([torch.from_numpy(hash_oracle(seed, bh, i, j, s, dropout_threshold(p)))
                            for bh in range(b * h)]).view(b, h, s, s)
    assert torch.equal(torch.stack([reference_keep_mask(seed, bh, s, s, p) for bh in range(b * h)]).view(b, h, s, s),
                       expected)
    for block in (16, 32, 64):
        assert torch.equal(dropout_mask(b, h, s, seed, p, block=block), expected), block


def _lag_z(keep, d_row, d_col):
    """z-score of the correlation between keep[r, c] and keep[r + d_row, c + d_col] (0 if independent);
    d_row >= 0, d_col of either sign."""
    k = (keep.double() - keep.double().mean()) / keep.double().std()
    rows, cols = k.shape
    first, width = max(0, -d_col), cols - abs(d_col)  # the columns c whose partner c + d_col exists
    a = k[:rows - d_row, first:first + width]
    b = k[d_row:, first + d_col:first + d_col + width]
    return (a * b).mean().item() * a.numel() ** 0.5


def test_dropout_decisions_are_unbiased_and_uncorrelated():
    """What dropout needs of its generator, measured on 1M decisions per stream (reference_keep_mask, which
    the test above ties to the kernels): the drop rate is p, and a decision says nothing about its
    neighbours along a row, down a column, across a diagonal, or in another head or seed. Each |z| < 5:
    a correlation of 0.005 at this size (the hash is deterministic, so the test is too)."""
    p, n = 0.1, 1024
    base = reference_keep_mask(1234, 5, n, n, p)
    q = 1 - effective_dropout_p(p)
    assert abs(base.double().mean().item() - q) < 5 * (q * (1 - q) / base.numel()) ** 0.5
    for d_row, d_col in [(0, 1), (0, 2), (0, 8), (0, 64), (1, 0), (2, 0), (8, 0), (1, 1), (1, -1), (3, 5)]:
        assert abs(_lag_z(base, d_row, d_col)) < 5, (d_row, d_col)
    for other in (reference_keep_mask(1234, 6, n, n, p), reference_keep_mask(1235, 5, n, n, p),
                  reference_keep_mask(0, 0, n, n, p)):
        k = torch.stack([base.ravel(), other.ravel()]).double()
        assert abs(torch.corrcoef(k)[0, 1].item() * k.shape[1] ** 0.5) < 5


def test_dropout_rate_is_a_multiple_of_2_to_the_minus_31():
    assert dropout_threshold(0.1) == 214748365 and effective_dropout_p(0.1) == 214748365 / 2**31  # .8 rounds up
    assert dropout_threshold(0.25) == 2**29 and effective_dropout_p(0.25) == 0.25
    assert dropout_threshold(0.0) == 0 and dropout_threshold(1 - 1e-12) == 2**31 - 1     # always keeps some


def test_dropout_counter_range_is_checked():
    """A stream's counters are 32-bit: more than 2^32 elements would repeat the mask, so it is refused."""
    q = torch.zeros(1, 1, 65537, 16)
    with pytest.raises(UsageError, match="2\\^32"):
        flash_attention(q, q, q, dropout_p=0.1)


def test_dropout_keep_rate_and_mask_shape():
    keep = dropout_mask(2, 2, 64, seed=123, dropout_p=0.3)
    assert keep.shape == (2, 2, 64, 64) and keep.dtype == torch.bool
    rate = keep.float().mean().item()                   # 16384 draws: sigma = 0.0036
    assert abs(rate - (1 - effective_dropout_p(0.3))) < 0.02, rate
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep, dropout_mask(2, 2, 64, seed=124, dropout_p=0.3))
    assert torch.equal(keep, dropout_mask(2, 2, 64, seed=123, dropout_p=0.3))


def test_dropout_matches_reference_with_kernel_mask():
    """Forward (32 x 16 tiles), dq (16 x 32) and dkdv (16 x 32, transposed) all drop exactly the elements
    dropout_mask shows; s = 37 ends in a partial tile."""
    b, h, s, d, p, seed = 2, 2, 37, 32, 0.25, 77
    pad = right_padded([37, 27], s)
    q, k, v, do = make_inputs(b, h, s, d, seed=6)
    keep = dropout_mask(b, h, s, seed, p)
    ours, ref = run_both(q, k, v, do, pad, dropout_p=effective_dropout_p(p), seed=seed, keep=keep)
    assert_matches(ours, ref, pad)


def test_dropout_is_deterministic_per_seed():
    b, h, s, d = 1, 2, 33, 32
    pad = right_padded([30], s)
    q, k, v, do = make_inputs(b, h, s, d, seed=7)

    def run(seed):
        ours, _ = run_both(q, k, v, do, pad, dropout_p=0.2, seed=seed)
        return ours

    first, again, other = run(5), run(5), run(6)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    torch.manual_seed(0)                                  # seed=None draws from torch's generator
    drawn = run(None)
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(drawn, run(None)))


@pytest.mark.parametrize("change,message", [
    (lambda q, m: (q.double(), m, 0.0), "float16, bfloat16 and float32"),
    (lambda q, m: (q.to(torch.int32), m, 0.0), "float16, bfloat16 and float32"),
    (lambda q, m: (q[..., :12], m, 0.0), "head dims"),
    (lambda q, m: (torch.zeros(1, 1, 4, 256), None, 0.0), "head dims"),
    (lambda q, m: (q[0], m, 0.0), "[batch, heads, seq, head_dim]"),
    (lambda q, m: (q, m.int(), 0.0), "padding_mask must be bool"),
    (lambda q, m: (q, m[:, :3], 0.0), "padding_mask must be bool"),
    (lambda q, m: (q, m, 1.0), "dropout_p"),
])
def test_unsupported_inputs_raise(change, message):
    q, mask, p = change(torch.zeros(1, 2, 8, 32), torch.zeros(1, 8, dtype=torch.bool))
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        flash_attention(q, q, q, padding_mask=mask, dropout_p=p)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("inf"), float("nan")])
def test_a_softmax_scale_that_is_not_positive_raises(scale):
    """The forward takes the running max of the unscaled scores, which is the max of the scaled ones only
    for a positive scale."""
    q = torch.zeros(1, 2, 8, 32)
    with pytest.raises(UsageError, match="positive, finite softmax scale"):
        flash_attention(q, q, q, scale=scale)


def test_cpu_without_interpreter_raises():
    """Without TRITON_INTERPRET (read by triton.jit at import) a CPU tensor cannot run the kernels: the
    error says where they run. A fresh process, since this one imported the kernels interpreted."""
    code = ("from minibert.errors import UsageError\n"
            "from minibert.kernels.flash_attention import flash_attention\n"
            "q = torch.zeros(1, 1, 4, 32)\n"
            "try:\n    flash_attention(q, q, q)\nexcept UsageError as e:\n    print(e)\n")
    out = run_without_interpreter(code)
    assert "flash_attention runs on CUDA (or on CPU with TRITON_INTERPRET=1)" in out.stdout, out.stdout + out.stderr


def test_dropout_moves_no_bits_between_threads():
    """The design claim of the dropout hash, checked on the compiled code: the forward kernel, compiled for
    sm_90 (no GPU needed: bench/sass_count.py), stores to and loads from shared memory exactly as often
    with dropout as without, i.e. each thread hashes the scores it holds and nothing travels. (The Philox
    draw it replaced, shared by 8 keys, routed the keep-mask through shared memory: 9 -> 33 stores.)"""
    code = ("from bench.sass_count import run\n"
            "rows = run(['forward'])\n"
            "print([(r['dropout'], r['opcodes'].get('STS', 0), r['opcodes'].get('LDS', 0)) for r in rows])")
    out = run_without_interpreter(code)
    assert out.returncode == 0, out.stderr[-2000:]
    (_, sts_plain, lds_plain), (_, sts_dropout, lds_dropout) = eval(out.stdout.strip().splitlines()[-1])
    assert sts_plain > 0 and (sts_dropout, lds_dropout) == (sts_plain, lds_plain)
