"""FP8 against bf16, one Linear at a time (forward and backward), at the shapes of BERT-large, the 4B and the
20B layers, on one GPU: where do FP8's matrix units pay for the casts around them?

Each row times one Linear y = x W^T of a transformer layer (QKV [h -> 3h], attention output [h -> h], fc1
[h -> 4h], fc2 [4h -> h]; the 20B's as its tensor-parallel-4 shards) over `tokens` rows, forward + both
backward products, for four peers:

    bf16              nn.Linear in bf16: the plain twin
    fp8 products      the three torch._scaled_mm calls alone, on operands cast beforehand: the ceiling
    fp8, torch casts  minibert's FP8 linear with its casts written as plain PyTorch ops (amax, scale, cast,
                      transpose: a pass over the tensor each)
    fp8               minibert's FP8 linear as training runs it (the delayed recipe; one-pass casts on a GPU)

and the ratio bf16 / fp8 (above 1: FP8 is faster). A second table sweeps the hidden size at fc1's shape to
find where FP8 starts to pay. Times are medians of triton.testing.do_bench.

    python bench/fp8_bench.py [--tokens 16384] [--output PATH]

`run()` returns rows {name, value, unit, notes} for bench/run.py."""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from minibert.fast import fp8  # noqa: E402

# (name, hidden, TP): the layer shapes of the three presets (the 20B as run: 4-way tensor parallel)
MODELS = [("BERT-large", 1024, 1), ("4B", 2560, 1), ("20B, TP 4", 6144, 4)]
SWEEP = [512, 768, 1024, 1536, 2048, 2560, 4096, 6144]


def linears(hidden, tp):
    """(name, in_features, out_features) of a layer's four Linears on one tensor-parallel rank."""
    return [("QKV", hidden, 3 * hidden // tp), ("attn out", hidden // tp, hidden),
            ("fc1", hidden, 4 * hidden // tp), ("fc2", 4 * hidden // tp, hidden)]


def bench(fn):
    import triton  # the GPU's timer; imported here so that --help runs anywhere
    return triton.testing.do_bench(fn, warmup=10, rep=60)


def fp8_linear(k, n, recipe, plain_casts):
    """An FP8 twin of nn.Linear(k, n), its delayed scales set from one step (as after a training step)."""
    torch.manual_seed(0)
    module = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    module.__class__ = fp8.FP8Linear
    module.fp8_setup(recipe)
    module.fp8_plain_casts = plain_casts
    return module


def peers(m, k, n):
    """{peer: a function running one forward and backward} for a Linear [m, k] -> [m, n]."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    plain = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)

    def step(module):
        def go():
            x.grad = None
            module.weight.grad = module.bias.grad = None
            module(x).backward(grad)
        return go

    recipe = fp8.Recipe("hybrid", "delayed")
    twins = {name: fp8_linear(k, n, recipe, plain_casts) for name, plain_casts in
             (("fp8, torch casts", True), ("fp8", False))}
    for module in twins.values():  # one step records the amaxes; fp8_step turns them into scales
        step(module)()
        fp8.fp8_step([module])

    e4m3, e5m2 = fp8.E4M3, fp8.E5M2
    x8 = x.detach().to(e4m3)
    w8 = plain.weight.detach().to(e4m3)
    w8_t = w8.t().contiguous()
    g8 = grad.to(e5m2)
    g8_t = g8.t().contiguous()
    x8_columns = x8.t().contiguous().t()
    one = torch.ones((), device="cuda")

    def products():
        torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(g8, w8_t.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        torch._scaled_mm(g8_t, x8_columns, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return {"bf16": step(plain), "fp8 products": products, **{name: step(t) for name, t in twins.items()}}


def time_row(m, k, n):
    ms = {name: bench(fn) for name, fn in peers(m, k, n).items()}
    return ms, 6 * m * k * n  # FLOPs: three products of 2 m k n


def gemm_table(tokens):
    lines = [f"### One Linear, forward + backward, {tokens} tokens (ms; ratio = bf16 / peer)", "",
             ("| layer | Linear | [k -> n] | bf16 | fp8 products | fp8, torch casts | fp8 | bf16/products | "
              "bf16/torch casts | bf16/fp8 | bf16 TFLOP/s | fp8 TFLOP/s |"), "|" + "---|" * 12]
    rows = []
    for model, hidden, tp in MODELS:
        for name, k, n in linears(hidden, tp):
            ms, flops = time_row(tokens, k, n)
            b = ms["bf16"]
            lines.append(f"| {model} | {name} | [{k} -> {n}] | {b:.3f} | {ms['fp8 products']:.3f} | "
                         f"{ms['fp8, torch casts']:.3f} | {ms['fp8']:.3f} | {b / ms['fp8 products']:.2f} | "
                         f"{b / ms['fp8, torch casts']:.2f} | {b / ms['fp8']:.2f} | {flops / b / 1e9:.0f} | "
                         f"{flops / ms['fp8'] / 1e9:.0f} |")
            rows.append((model, name, b, ms["fp8"]))
    per_model = {}
    for model, _, b, f in rows:
        per_model.setdefault(model, [0.0, 0.0])
        per_model[model][0] += b
        per_model[model][1] += f
    lines += ["", "A layer's four Linears together: " + "; ".join(
        f"{model} {b / f:.2f}x" for model, (b, f) in per_model.items())]
    return lines, per_model


def sweep_table(tokens):
    lines = [f"### fc1 [h -> 4h] over {tokens} tokens, by hidden size h (ms)", "",
             "| h | bf16 | fp8 products | fp8, torch casts | fp8 | bf16/fp8 |", "|" + "---|" * 6]
    for h in SWEEP:
        ms, _ = time_row(tokens, h, 4 * h)
        lines.append(f"| {h} | {ms['bf16']:.3f} | {ms['fp8 products']:.3f} | {ms['fp8, torch casts']:.3f} | "
                     f"{ms['fp8']:.3f} | {ms['bf16'] / ms['fp8']:.2f} |")
    return lines


def run(tokens=16384):
    _, per_model = gemm_table(tokens)
    return [{"name": f"FP8 / bf16, a {model} layer's four Linears (fwd + bwd)", "value": b / f, "unit": "x",
             "notes": f"{tokens} tokens, delayed scaling, hybrid"} for model, (b, f) in per_model.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="rows of the activation (micro-batch x seq)")
    parser.add_argument("--output", help="also append the tables to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fp8_bench.py needs a GPU with FP8 matrix units (compute capability 8.9 or newer)")
    for table in (lambda: gemm_table(args.tokens)[0], lambda: [""] + sweep_table(args.tokens)):
        text = "\n".join(table())
        print(text, flush=True)
        if args.output:
            with open(args.output, "a") as f:
                f.write(text + "\n")


if __name__ == "__main__":
    main()
