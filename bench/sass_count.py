"""Count the machine instructions of the attention kernels, with and without dropout, on any machine.

Triton compiles for a GPU it does not need to see: given a target (sm_90, the H100/H200) it runs the
whole pipeline, Triton IR -> PTX -> cubin (with ptxas), and the cubin's SASS (the GPU's own instruction
set) can be listed with cuobjdump. Both tools come with the triton wheel. So a CPU-only machine can ask
what a change does to a kernel before any GPU time is spent: how many instructions, how many registers,
whether it spills, and how much shared memory traffic (STS/LDS) it adds.

    python bench/sass_count.py                 # the three attention kernels, d64, default tiles
    python bench/sass_count.py --kernels forward

The counts are static: each instruction of the listing counted once, a loop body once, however many
times it runs. Compare variants of one kernel, not kernels with each other. They depend on the triton
version (chapter 3 quotes triton 3.6, the GPU image's). The arguments are declared as a real launch sees
them: pointers and strides divisible by 16 (which is what lets Triton vectorise loads).
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from minibert.kernels.flash_tiles import register_cap  # noqa: E402

FLOAT_ARGS = {"qk_scale", "sm_scale", "out_scale", "keep_scale"}
FLOAT_POINTERS = {"LSE", "DELTA", "BIAS"}
COUNTED = ("IMAD", "LOP3", "SHF", "STS", "LDS", "STL", "LDL")


def signature(kernel, constants):
    """Triton's types for each argument of one of our attention kernels, and the divisibility hints."""
    sig, hints = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            sig[name] = "constexpr"
        elif name.isupper():                                 # tensors are named in capitals
            sig[name] = "*fp32" if name in FLOAT_POINTERS else ("*i32" if name == "KV_LEN" else "*bf16")
            hints[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        elif name == "seed":
            sig[name] = "i64"
        elif name == "threshold":
            sig[name] = "i32"
        else:                                                # strides, n_heads, seq_len
            sig[name] = "i32"
            hints[(i,)] = [["tt.divisibility", 16]]
    return sig, hints


def compile_for_sm90(kernel, constants, tile):
    sig, hints = signature(kernel, constants)
    source = ASTSource(fn=kernel, signature=sig, constexprs=constants, attrs=hints)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tile.num_warps, num_stages=tile.num_stages,
                                       **register_cap(tile)))


def sass_stats(compiled):
    """(instructions, {opcode: count}, registers, spilled bytes) of a compiled kernel."""
    from triton.backends.nvidia.compiler import get_ptxas
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        listing = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], check=True,
                                 capture_output=True, text=True).stdout
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                                check=True, capture_output=True, text=True).stderr   # the ptxas triton used
    lines = [line for line in listing.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]
    # "/*0a70*/   @!P0 IMAD.WIDE R2, ..." -> "IMAD"
    opcodes = collections.Counter(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0]
                                  for line in lines)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    return len(lines), opcodes, registers, spilled


def run(kernels=("forward", "dq", "dkdv"), head_dim=64):
    from minibert.kernels import flash_attention as fa
    from minibert.kernels import flash_attention_bwd as fb
    from minibert.kernels import flash_tiles
    functions = {"forward": fa._attention_forward_kernel, "dq": fb._attention_backward_dq_kernel,
                 "dkdv": fb._attention_backward_dkdv_kernel}
    tiles = dict(zip(("forward", "dq", "dkdv"), flash_tiles.pick_tiles(head_dim, None)))
    rows = []
    for name in kernels:
        tile = tiles[name]
        for dropout in (False, True):
            constants = dict(HEAD_DIM=head_dim, D_BLOCK=flash_tiles.head_dim_block(head_dim), BLOCK_M=tile.block_m,
                             BLOCK_N=tile.block_n, HAS_PAD=True, DROPOUT=dropout, VARLEN=False,
                             SEED_IN_MEMORY=False)
            count, opcodes, registers, spilled = sass_stats(compile_for_sm90(functions[name], constants, tile))
            rows.append(dict(kernel=name, dropout=dropout, tile=tile, instructions=count, opcodes=opcodes,
                             registers=registers, spilled=spilled))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=["forward", "dq", "dkdv"], choices=["forward", "dq", "dkdv"])
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90, head dim {args.head_dim}, static SASS counts")
    base = {}
    for row in run(args.kernels, args.head_dim):
        t = row["tile"]
        extra = "" if not row["dropout"] else f" (+{row['instructions'] - base[row['kernel']]} for dropout)"
        base.setdefault(row["kernel"], row["instructions"])
        counted = " ".join(f"{op} {row['opcodes'].get(op, 0)}" for op in COUNTED)
        print(f"{row['kernel']:8s} dropout={str(row['dropout']):5s} tile {t.block_m}x{t.block_n}, {t.num_warps} warps, "
              f"{t.num_stages} stages: {row['instructions']} instructions{extra}; {row['registers']} registers, "
              f"{row['spilled']} bytes spilled; {counted}", flush=True)


if __name__ == "__main__":
    main()
