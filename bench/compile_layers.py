"""--compile-layers, measured on the layers alone: BERT-large's transformer layers (b32 s512 bf16, the
padded layout with a mask of real keys) forward + backward, eager with minibert's fused kernels, eager with
the plain ops, and each layer through torch.compile (Inductor fusing the plain ops; the attention core
outside the graphs). Prints, per variant: ms per layer, the largest gradient difference from the plain
eager run with dropout off, and the kernels that took the most GPU time.

    python bench/compile_layers.py [--layers 4] [--variant compiled]   (one variant per process: a failed
                                                                        kernel can poison the CUDA context)
"""
import argparse
import os
import statistics
import sys
import traceback

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.kernel_table import kernel_ms  # noqa: E402
from minibert.build import build_model_and_optimizer  # noqa: E402
from minibert.config import Config  # noqa: E402
from minibert.validate import validate  # noqa: E402

VARIANTS = {  # name -> config overrides
    "eager fused": {},
    "eager plain": {"bias_dropout_fusion": False},
    "compiled": {"compile_layers": True},
}


def build(variant, layers, dropout):
    cfg = Config(num_layers=layers, hidden_size=1024, num_attention_heads=16, seq_length=512,
                 max_position_embeddings=512, micro_batch_size=32, global_batch_size=32, train_iters=10, lr=1e-4,
                 bf16=True, seed=1234, split="100,0,0", num_workers=0, eval_iters=0, hidden_dropout=dropout,
                 attention_dropout=dropout, **VARIANTS[variant])
    model = build_model_and_optimizer(validate(cfg, 1, "cuda", warn=None), torch.device("cuda"))[0]
    return model.train()


def step(model, x, mask, grad):
    """One forward + backward of the layers (and the final LayerNorm, as encode runs them)."""
    x.grad = None
    for p in model.parameters():
        p.grad = None
    model.encode(x, mask).backward(grad)


def gradients(model, x):
    return {"x": x.grad.float(), **{n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variant", choices=list(VARIANTS), required=True)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(32, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x) * 1e-2
    mask = torch.zeros(32, 512, dtype=torch.bool, device="cuda")  # the trainer passes one: no key is padding
    print(f"== {args.variant}, {args.layers} layers, torch {torch.__version__}, {torch.cuda.get_device_name()}",
          flush=True)
    try:
        # parity, dropout off: this variant's gradients against the plain eager ones
        reference = build("eager plain", args.layers, 0.0)
        step(reference, x, mask, grad)
        expected = gradients(reference, x)
        del reference
        model = build(args.variant, args.layers, 0.0)
        step(model, x, mask, grad)
        step(model, x, mask, grad)
        got = gradients(model, x)
        worst = max(((got[n] - expected[n]).abs().max() / expected[n].abs().max().clamp_min(1e-30)).item()
                    for n in expected)
        print(f"largest gradient difference from eager plain, relative to the tensor's largest value: {worst:.3e}")
        del model
        # timing, dropout 0.1 (training)
        model = build(args.variant, args.layers, 0.1)
        for _ in range(3):
            step(model, x, mask, grad)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iterations):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model, x, mask, grad)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        per_layer = statistics.median(times) / args.layers
        print(f"forward + backward: {per_layer:.3f} ms per layer (median of {args.iterations}; "
              f"min {min(times) / args.layers:.3f})", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                step(model, x, mask, grad)
            torch.cuda.synchronize()
        kernels = kernel_ms(prof, per=2 * args.layers)
        print(f"kernels: {sum(ms for ms, _ in kernels.values()):.3f} ms per layer")
        for name, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  {ms:7.3f} ms {count:5.1f}x  {name[:200]}")
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
