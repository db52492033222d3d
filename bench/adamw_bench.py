"""The optimizer's update (--adam-fusion) against its plain twin, on one GPU, over a real model's buffers.

The model is BERT-large (or BERT-base) in bf16 with the trainer's own optimizer (minibert.training.optim.build_optimizer:
its gradient buckets, fp32 masters and moments); the optimizer's `update` is timed alone, as
    plain   MixedPrecisionOptimizer.update: PyTorch's fused AdamW (grad_scale, found_inf), then the copy
            of each shard's masters to bf16
    fused   FusedAdamW.update (minibert/fast/adamw.py; apply(optimizer) makes the trainer's optimizer one):
            AdamW and the copy in one pass per bucket shard
Bytes a parameter: plain 38 (AdamW reads p, g, m, v and writes p, m, v and the divided g; the copy reads p
and writes 2 bytes), fused 30. Times are medians of triton.testing.do_bench (each update launched from
Python, as in training; at these sizes the GPU, not the host, sets the pace); the ceiling is a device copy.
First both kernels take one step from the same state and their masters and bf16 weights are compared.

    python bench/adamw_bench.py            # both models (about half a minute)
    python bench/adamw_bench.py --sweep    # and six (block, warps) choices at BERT-large

`run()` returns rows {name, value, unit, notes} for bench/run.py."""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from minibert.config import Config  # noqa: E402
from minibert.fast import adamw as adamw_kernel  # noqa: E402
from minibert.model.bert import BertModel  # noqa: E402
from minibert.training.build import build_grad_buffers  # noqa: E402
from minibert.training.optim import MixedPrecisionOptimizer, build_optimizer  # noqa: E402
from minibert.validate import validate  # noqa: E402

MODELS = {"BERT-large": (24, 1024, 16), "BERT-base": (12, 768, 12)}
BYTES = {"plain": 38, "fused": 30}
UPDATES = {"plain": MixedPrecisionOptimizer.update, "fused": adamw_kernel.FusedAdamW.update}  # the two twins


def _update(optimizer, kind, divisor, found_inf):
    """One update of `optimizer` (a MixedPrecisionOptimizer) by the plain twin or the fused one."""
    UPDATES[kind](optimizer, divisor, found_inf)
SWEEP = [(256, 2), (256, 4), (512, 2), (512, 4), (1024, 4), (4096, 8)]


def _optimizer(layers, hidden, heads):
    cfg = validate(Config(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=512,
                          max_position_embeddings=512, micro_batch_size=1, global_batch_size=1, train_iters=10,
                          lr=1e-4, bf16=True), device_type="cuda", warn=None)
    torch.manual_seed(0)
    model = BertModel(cfg).to(device="cuda", dtype=torch.bfloat16)
    optimizer = build_optimizer(build_grad_buffers(model, cfg), cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    for shard in optimizer.shards:  # gradients of a plausible size, and moments after some steps
        shard.grad.copy_(torch.randn(shard.grad.shape, device="cuda", generator=g) * 1e-3)
        shard.exp_avg.copy_(shard.grad * 0.5)
        shard.exp_avg_sq.copy_(shard.grad.square() * 0.5)
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    return model, optimizer


def _state(optimizer):
    return [t.clone() for sh in optimizer.shards for t in (sh.master, sh.grad, sh.exp_avg, sh.exp_avg_sq)]


def _restore(optimizer, saved):
    tensors = [t for sh in optimizer.shards for t in (sh.master, sh.grad, sh.exp_avg, sh.exp_avg_sq)]
    for t, s in zip(tensors, saved):
        t.copy_(s)
    for pc in optimizer.pieces:
        pc.step.zero_()


def _check(optimizer, divisor, found_inf):
    """One step from the same state with each kernel: the masters agree to fp32 rounding, and each kernel's
    bf16 weights are its masters rounded to nearest, bit for bit."""
    saved, results = _state(optimizer), {}
    for kernel in ("plain", "fused"):
        _restore(optimizer, saved)
        _update(optimizer, kernel, divisor, found_inf)
        results[kernel] = [sh.master.clone() for sh in optimizer.shards]
        if not all(torch.equal(sh.model_values, sh.master.to(torch.bfloat16)) for sh in optimizer.shards):
            raise AssertionError(f"adamw ({kernel}): the bf16 weights are not the masters rounded to nearest")
    _restore(optimizer, saved)
    for a, b in zip(results["plain"], results["fused"]):
        err = float((a - b).norm() / b.norm())
        if err > 1e-6:
            raise AssertionError(f"adamw: masters differ between the kernels by {err:.3g} (relative)")


def _time_ms(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def _tbps(n_bytes, ms):
    return n_bytes / (ms * 1e-3) / 1e12


def _measure(label, layers, hidden, heads, sweep, echo):
    _, optimizer = _optimizer(layers, hidden, heads)
    n = sum(sh.master.numel() for sh in optimizer.shards)
    divisor, found_inf = torch.tensor(1.5, device="cuda"), torch.tensor(0.0, device="cuda")
    _check(optimizer, divisor, found_inf)
    flat = torch.empty(n, dtype=torch.float32, device="cuda")
    ms = {"copy": _time_ms(lambda: flat.clone())}
    for kernel in ("plain", "fused"):
        ms[kernel] = _time_ms(lambda: _update(optimizer, kernel, divisor, found_inf))
    copy = _tbps(8 * n, ms["copy"])
    where = f"{label}, {n / 1e6:.1f}M parameters in {len(optimizer.shards)} buckets, bf16 weights"
    rows = [dict(name=f"{label} device copy of the fp32 masters (ceiling)", value=copy, unit="TB/s",
                 notes=f"read + write, {ms['copy']:.3f} ms")]
    for kernel, what in (("plain", "plain: PyTorch's fused AdamW + copy back"), ("fused", "fused: one pass")):
        speed = _tbps(BYTES[kernel] * n, ms[kernel])
        rows.append(dict(name=f"{label} update, {what}", value=ms[kernel], unit="ms",
                         notes=f"{BYTES[kernel]} bytes a parameter, {speed:.2f} TB/s ({speed / copy:.0%} of copy)"))
    rows.append(dict(name=f"{label} update: fused speed-up over plain", value=ms["plain"] / ms["fused"], unit="x",
                     notes=f"{ms['plain']:.3f} -> {ms['fused']:.3f} ms; {where}"))
    for row in rows:
        echo(row)
    if sweep:
        for block, warps in SWEEP:
            tables = [adamw_kernel.program_table([(pc.lo, pc.hi) for pc in sh.pieces], [True] * len(sh.pieces),
                                                 block, "cuda") for sh in optimizer.shards]

            def update():
                for sh, table in zip(optimizer.shards, tables):
                    adamw_kernel.adamw_(sh.master, sh.grad, sh.exp_avg, sh.exp_avg_sq, table, divisor=divisor,
                                        found_inf=found_inf, lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999),
                                        eps=1e-8, step=1, model_copy=sh.model_values, block=block, warps=warps)
            t = _time_ms(update)
            tag = " (default)" if (block, warps) == (adamw_kernel.BLOCK, adamw_kernel.WARPS) else ""
            rows.append(dict(name=f"sweep {label} block={block} warps={warps}{tag}", value=t, unit="ms",
                             notes=f"{_tbps(30 * n, t):.2f} TB/s"))
            echo(rows[-1])
    return rows


def run(sweep=False, echo=lambda row: None):
    """The rows; echo(row) is called as each is measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench/adamw_bench.py measures GPU kernels: run it on a machine with a CUDA GPU")
    rows = []
    for label, shape in MODELS.items():
        rows += _measure(label, *shape, sweep and label == "BERT-large", echo)
        torch.cuda.empty_cache()
    return rows


def _print(row):
    print(f"{row['name']:<72}  {row['value']:8.3f} {row['unit']:<5} {row['notes']}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time six (block, warps) choices at BERT-large")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/adamw_bench.py measures GPU kernels; run it on a machine with a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    run(sweep=args.sweep, echo=_print)


if __name__ == "__main__":
    main()
