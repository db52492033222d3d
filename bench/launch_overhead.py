"""What one call costs the host: microseconds of CPU per launch, at shapes so small the GPU is never the limit.

A training step is host-bound when Python, autograd and the kernel launches take longer than the GPU's
work (bench/packed_steps.py measures that per step). This script splits the host's cost per call: an
empty Triton kernel, a torch operator, our kernels launched directly, and the same through their
autograd Functions, forward alone and forward + backward. Each case runs N calls back to back without
synchronising (the GPU finishes each tiny kernel long before the next launch), timed with
time.perf_counter between two torch.cuda.synchronize(); best of 5 repeats.

    python bench/launch_overhead.py --output launch.md      (on a GPU)
"""
import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from minibert.fast.layer_norm import dropout_add_layer_norm  # noqa: E402
from minibert.kernels.flash_attention import attention_forward  # noqa: E402
from minibert.kernels.flash_attention_varlen import flash_attention_varlen  # noqa: E402
from minibert.kernels.flash_common import Varlen  # noqa: E402
from minibert.kernels.flash_tiles import pick_tiles  # noqa: E402

CALLS, REPEATS = 200, 5


@triton.jit
def _empty_kernel(X):
    pass


@triton.jit
def _add_one_kernel(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n) + 1, mask=offs < n)


def host_us(fn):
    """Best-of-REPEATS host microseconds per call of fn()."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        best = min(best, elapsed)
    return 1e6 * best / CALLS


def cases(device):
    x = torch.zeros(1024, device=device)
    h, n, heads, d = 1024, 64, 16, 64
    rows = torch.randn(n, heads, 3, d, device=device, dtype=torch.bfloat16)
    rows_grad = rows.clone().requires_grad_()
    cu = torch.tensor([0, 40, 64], dtype=torch.int32, device=device)
    grad_out = torch.randn(n, heads, d, device=device, dtype=torch.bfloat16)
    q, k, v = rows.unbind(2)  # [n, heads, d] views, as FlashAttentionVarlen launches them
    tile = pick_tiles(d, torch.bfloat16)[0]
    varlen = Varlen(cu, 2, 64)
    res = torch.randn(n, h, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, h, device=device, dtype=torch.bfloat16)
    w = torch.ones(h, device=device, dtype=torch.bfloat16)
    b = torch.zeros(h, device=device, dtype=torch.bfloat16)
    res_g, y_g = res.clone().requires_grad_(), y.clone().requires_grad_()
    w_g, b_g = w.clone().requires_grad_(), b.clone().requires_grad_()
    ones = torch.ones(n, h, device=device, dtype=torch.bfloat16)

    def fused_ln_fwd_bwd():
        x_out, normed = dropout_add_layer_norm(res_g, y_g, w_g, b_g, 1e-5, 0.1)
        torch.autograd.backward([x_out, normed], [ones, ones])

    def plain_ln_fwd_bwd():
        x_out = res_g + F.dropout(y_g, 0.1)
        normed = F.layer_norm(x_out, (h,), w_g, b_g, 1e-5)
        torch.autograd.backward([x_out, normed], [ones, ones])

    def varlen_fwd_bwd():
        flash_attention_varlen(rows_grad, cu, 64, dropout_p=0.1).backward(grad_out)

    return {
        "torch op: x.add_(1)": lambda: x.add_(1.0),
        "Triton: empty kernel, 1 argument": lambda: _empty_kernel[(1,)](x),
        "Triton: add-one kernel, 2 arguments + 1 constexpr": lambda: _add_one_kernel[(1,)](x, 1024, BLOCK=1024),
        "Triton: the flash forward kernel launched directly (25 arguments + 7 constexpr)":
            lambda: attention_forward(q, k, v, None, None, 0.125, 0.1, 1, tile, varlen=varlen),
        "flash_attention_varlen forward (autograd Function, no grad)":
            lambda: flash_attention_varlen(rows, cu, 64, dropout_p=0.1),
        "flash_attention_varlen forward + backward": varlen_fwd_bwd,
        "torch: F.layer_norm forward": lambda: F.layer_norm(res, (h,), w, b, 1e-5),
        "torch: dropout + add + F.layer_norm, forward + backward": plain_ln_fwd_bwd,
        "dropout_add_layer_norm forward (autograd Function, no grad)":
            lambda: dropout_add_layer_norm(res, y, w, b, 1e-5, 0.1),
        "dropout_add_layer_norm forward + backward": fused_ln_fwd_bwd,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/launch_overhead.py times kernel launches on a CUDA GPU")
    device = torch.device("cuda")
    lines = [f"host time per call, {CALLS} calls back to back, best of {REPEATS} "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})", "",
             "| call | host us per call |", "|---|---|"]
    for name, fn in cases(device).items():
        lines.append(f"| {name} | {host_us(fn):.1f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
