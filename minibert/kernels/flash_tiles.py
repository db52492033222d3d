"""Tiles: the block sizes each flash attention kernel runs with, and how they were chosen.

A Triton kernel is written for a block of the problem: the forward and the dq kernel each own BLOCK_M query
rows and step through the keys BLOCK_N at a time; the dkdv kernel owns BLOCK_N keys and steps through the
queries. Those two numbers, with the warps per program and the pipeline stages of the loads, are a `Tile`.
They do not change what a kernel computes (the tests run several and compare), only how fast it runs and
whether its blocks fit in registers, so they are picked by timing: `python bench/attention_bench.py --sweep`
times every candidate below on the GPU, and the first of each list (the default) is the winner of the sweep
its comment names; the results file or chapter it points to holds the device, date, shape and times.

The kernels live in flash_attention.py (forward) and flash_attention_bwd.py (backward); the autograd
Functions that launch them (flash_attention.py, flash_attention_packed.py, flash_attention_varlen.py)
call `pick_tiles` once per call for its four tiles: (forward, dq, dkdv, short).
"""
import functools
from typing import NamedTuple, Optional

import torch
import triton

from minibert.kernels import interpreting


class Tile(NamedTuple):
    """block_m query rows x block_n keys per step. The forward and dq kernels own block_m rows and loop
    over keys; the dk/dv kernel owns block_n keys and loops over queries; the short backward (sequences
    of at most block_n keys) holds them all and loops over queries. Warps and stages go to Triton, and
    so does maxnreg where a tile sets it: a cap on the registers of each thread (None: ptxas chooses)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    maxnreg: Optional[int] = None


# Candidates per head-dim block (16/32/64 use the 64 list) and kernel, for the GPU sweep
# (bench/attention_bench.py --sweep); the FIRST of each list is the default. All compile for sm_90 with
# triton 3.6 without register spills (ptxas -v); 128-wide heads need fewer rows per warp. The d64 defaults
# do not spill with dropout either (`python bench/sass_count.py` compiles them on a CPU and counts registers
# and spills; its counts: bench/notes/attention-one-kernel.md).
TILE_CANDIDATES = {
    # d <= 64: the first of each list won `bench/attention_bench.py --sweep` at b32 h16 s512 d64 bf16, key
    # lengths U[256, 512] (the times: chapter 3, appendix A).
    64: {"forward": [Tile(64, 128, 4, 3), Tile(128, 64, 4, 2), Tile(128, 64, 8, 3), Tile(128, 64, 4, 3),
                     Tile(128, 64, 4, 4), Tile(128, 32, 4, 3), Tile(128, 32, 4, 4), Tile(128, 128, 8, 2),
                     Tile(64, 64, 4, 3)],
         "dq": [Tile(64, 32, 4, 3), Tile(64, 32, 4, 4), Tile(64, 32, 4, 5), Tile(64, 64, 4, 3),
                Tile(64, 64, 4, 4), Tile(128, 32, 4, 4), Tile(128, 64, 8, 3), Tile(32, 32, 4, 4)],
         "dkdv": [Tile(64, 64, 4, 2), Tile(64, 64, 4, 4), Tile(64, 64, 4, 3), Tile(32, 64, 4, 4),
                  Tile(32, 64, 4, 3), Tile(16, 128, 4, 5), Tile(64, 128, 8, 3), Tile(32, 128, 8, 4)],
         # the short backward (s <= 128): picked by `bench/attention_bench.py --sweep-short` at b256 h12
         # s128, faster than the dq + dkdv pair with and without dropout, results in
         # bench/results/attention_short_h200_2026-12-03.md; (64, 128, 8, 1) was a little faster still there and is the next
         # one to try in whole steps
         "short": [Tile(64, 128, 8, 2), Tile(64, 128, 8, 1), Tile(64, 128, 4, 2), Tile(32, 128, 4, 2),
                   Tile(32, 128, 8, 2), Tile(16, 128, 4, 2)]},
    128: {"forward": [Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(128, 32, 8, 3), Tile(64, 64, 4, 3),
                      Tile(64, 64, 4, 2), Tile(64, 32, 4, 3), Tile(128, 128, 8, 1)],
          "dq": [Tile(128, 64, 8, 2), Tile(128, 64, 8, 3), Tile(128, 32, 8, 4), Tile(64, 64, 4, 3),
                 Tile(64, 32, 4, 4)],
          "dkdv": [Tile(64, 64, 8, 3), Tile(32, 64, 8, 4), Tile(16, 64, 4, 4), Tile(16, 128, 8, 4),
                   Tile(32, 128, 8, 4)],
          "short": []},  # 128 keys x 128-wide heads: dK and dV alone would fill the registers
}
# The forward's tile for sequences of 512 and more keys (16-bit, d <= 64): with every row block long,
# 128 query rows per program beat the list's first (64, 128), which wins on shorter and mixed lengths, where
# a 128-row block wastes more rows past a sample's end. Picked by a sweep of the forward tiles at b32 h16
# s512 d64 bf16, every key real, the varlen layout of training, with and without dropout; results in
# bench/results/attention_one_kernel_h100_2026-12-05.txt, read in bench/notes/attention-one-kernel.md.
# Its register cap: two programs of 256 threads fit a multiprocessor's 65,536 registers at 128 per thread.
# Every variant of this kernel compiles to at most 128 a thread without a cap but one, the padded layout
# with dropout and no mask, which took more and so ran one program per multiprocessor, slower. With the
# cap it runs as fast as the packed layout, the other variants' times stay within the run's noise and
# every output is the same bit for bit: register counts and times in bench/results/fwd_pad_check_h200_2026-12-05.txt and
# bench/results/fwd_cap_h100_2026-12-05.txt.
LONG_FORWARD = {64: Tile(128, 64, 8, 3, maxnreg=128)}
LONG_SEQUENCE = 512
# fp32 tiles are twice the bytes; no short backward (its dK, dV and K, V blocks would not fit)
FP32_TILES = (Tile(64, 32, 4, 2), Tile(64, 32, 8, 2), Tile(32, 32, 4, 2), None)
# The CPU interpreter runs one program at a time in numpy: small tiles, and different block sizes per
# kernel so the tests cross every kernel's block boundaries differently; sequences up to 64 take the
# short backward, longer ones the dq and dkdv kernels, so the tests' shapes run both.
INTERPRETER_TILES = (Tile(32, 16, 1, 1), Tile(16, 32, 1, 1), Tile(16, 32, 1, 1), Tile(16, 64, 1, 1))


def register_cap(tile):
    """The launch options a tile's maxnreg becomes: {"maxnreg": n}, or none (ptxas chooses)."""
    return {} if tile.maxnreg is None else {"maxnreg": tile.maxnreg}


def head_dim_block(d):
    """The power-of-two block the head dim runs in (80 -> 128: the extra lanes are masked)."""
    return max(16, triton.next_power_of_2(d))


# With dropout the defaults stay: `bench/attention_bench.py --sweep --dropout 0.1` (b32 h16 s512 d64,
# lengths U[256,512]) found the same three tiles fastest, since the dropout hash adds no registers to move
# bits between threads; results in bench/notes/training.md. (With the earlier Philox draw, shared by 8
# keys, the forward spilled and dq wanted 128x32.)
@functools.lru_cache(maxsize=None)
def pick_tiles(head_dim, dtype, seq_len=0):
    """(forward, dq, dkdv, short) tiles for this head dim and dtype, with or without dropout; short is None
    where no short backward fits (flash_attention_bwd.backward_into then always runs dq and dkdv). seq_len
    (the grid's s) picks LONG_FORWARD at LONG_SEQUENCE keys and more."""
    if interpreting():
        return INTERPRETER_TILES
    if dtype == torch.float32:
        return FP32_TILES
    width = max(64, head_dim_block(head_dim))
    tiles = TILE_CANDIDATES[width]
    forward = tiles["forward"][0]
    if seq_len >= LONG_SEQUENCE:
        forward = LONG_FORWARD.get(width, forward)
    return forward, tiles["dq"][0], tiles["dkdv"][0], (tiles["short"] or [None])[0]
