"""The parts of an FP8 step at the 4B layer's shapes, on one GPU: what each cast costs against a plain copy
of the same tensor, and what each product costs in bf16 and in FP8, with and without fast accumulation.
bench/fp8_steps.py times whole steps; this says where their time goes.

    python bench/fp8_parts.py [--tokens 2048,8192] [--output PATH]

Casts: minibert/fast/fp8_cast.py on a bf16 [tokens, k] tensor (k = 2560, 7680, 10240: the inputs and the
output gradients of a 4B layer's Linears), alone and with its transposed copy, against a bf16 clone (one
read, one write: the bandwidth ceiling) and the same cast as PyTorch ops. GB/s counts the bytes each
moves (clone: 4 per element; cast: 3; cast and transpose: 4).

Products: the four forward GEMMs of a 4B layer ([tokens, k] x [k, n]) in bf16 and with torch._scaled_mm
on e4m3 operands; the backward's two products per Linear have the same FLOPs. Times are medians of
triton.testing.do_bench."""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

E4M3 = torch.float8_e4m3fn
HIDDEN = 2560
PRODUCTS = [("QKV", HIDDEN, 3 * HIDDEN), ("attn out", HIDDEN, HIDDEN), ("fc1", HIDDEN, 4 * HIDDEN),
            ("fc2", 4 * HIDDEN, HIDDEN)]


def bench(fn):
    import triton  # the GPU's timer; imported here so that --help runs anywhere
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def cast_rows(tokens):
    from minibert.fast import fp8_cast
    rows = []
    for k in (HIDDEN, 3 * HIDDEN, 4 * HIDDEN):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
        times = {"bf16 clone": (bench(lambda: x.clone()), 4),
                 "cast": (bench(lambda: fp8_cast.cast(x, E4M3, scale, 448.0, amax)), 3),
                 "cast + transposed copy": (bench(lambda: fp8_cast.cast(x, E4M3, scale, 448.0, amax, None, True)), 4),
                 "cast as PyTorch ops": (bench(lambda: x.float().mul(scale).clamp(-448, 448).to(E4M3)), 3)}
        for name, (ms, per_element) in times.items():
            rows.append(f"| [{tokens}, {k}] | {name} | {1e3 * ms:.1f} | {per_element * x.numel() / ms / 1e6:,.0f} |")
    return rows


def product_rows(tokens):
    one = torch.ones((), device="cuda")
    rows = []
    for name, k, n in PRODUCTS:
        a16 = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        a8, b8 = a16.to(E4M3), b16.t().contiguous().to(E4M3).t()  # the second operand column-major
        bf16 = bench(lambda: a16 @ b16)
        fp8 = bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        fast = bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                              use_fast_accum=True))
        flops = 2 * tokens * k * n
        rows.append(f"| {name} [{tokens}, {k}] x [{k}, {n}] | {1e3 * bf16:.1f} ({flops / bf16 / 1e9:,.0f}) | "
                    f"{1e3 * fp8:.1f} ({flops / fp8 / 1e9:,.0f}) | {1e3 * fast:.1f} ({flops / fast / 1e9:,.0f}) | "
                    f"{bf16 / fp8:.2f} | {bf16 / fast:.2f} |")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192", help="token counts (micro-batch x seq), comma-separated")
    parser.add_argument("--output", help="also append the tables to this file")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    lines = ["### Casts", "", "| tensor | operation | us | GB/s |", "|---|---|---|---|"]
    for t in tokens:
        lines += cast_rows(t)
    lines += ["", "### Forward products (us, and TFLOP/s in brackets)", "",
              "| product | bf16 | fp8 | fp8, fast accumulation | bf16 / fp8 | bf16 / fp8 fast |", "|---|---|---|---|---|---|"]
    for t in tokens:
        lines += product_rows(t)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.output:
        with open(args.output, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
