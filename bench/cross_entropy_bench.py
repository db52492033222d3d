"""Fused cross entropy vs the eager masked-LM loss on one GPU: time and peak memory of forward + backward.

Shapes: the LM logits of one micro-batch, bf16 [n, 30592] (BERT's vocab padded to a multiple of 128), read
as the view [:, :30524] the model passes to the loss (padded_vocab_size - 68 columns: never copied):
    BERT-large, micro-batch 32 x s 512:  n = 16384   (1.0 GB of logits)
    BERT-base,  batch 256 x s 128:       n = 32768   (2.0 GB)
Eager is minibert.model.loss.lm_cross_entropy (logits.float() + F.cross_entropy, reduction none); fused is
minibert.fast.cross_entropy.fused_cross_entropy. Both are timed as loss -> torch.autograd.grad with the
gradient of a masked mean (mask / count), i.e. what pretraining_loss runs. Two label patterns:
    all labelled     every row is a masked position (the model's --sparse-mlm path: only those rows exist)
    15% labelled     dense MLM: 85% of rows are ignore_index, which the fused kernels do not read
Peak memory is torch.cuda.max_memory_allocated during one forward + backward, minus what was allocated
before (the logits themselves). Every fused result is checked against eager before it is timed.

    python bench/cross_entropy_bench.py           # the rows below
    python bench/cross_entropy_bench.py --sweep   # plus chunk widths and warps of each kernel
    TRITON_INTERPRET=1 python bench/cross_entropy_bench.py --device cpu --tiny   # a dry run of this script

`run()` returns rows {name, value, unit, notes} for bench/run.py (BENCHMARKS.md). On an H200 (2026-12-01,
torch 2.11, triton 3.6), BERT-large shape: eager 6.23 ms, +5724 MB; fused 0.88 ms (7.1x; 3.43 TB/s over
3 passes, the copy ceiling is 4.24), +954 MB; at 15% labelled 0.53 ms (11.8x). BERT-base: 12.43 vs 1.73 ms.
"""
import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from minibert.fast import cross_entropy as ce  # noqa: E402
from minibert.model.loss import lm_cross_entropy  # noqa: E402

PADDED_VOCAB, VOCAB = 30592, 30524
SHAPES = {"BERT-large mb32 x s512": 16384, "BERT-base b256 x s128": 32768}
TINY_SHAPES = {"tiny": 64}                   # --tiny: rows of [64, 1024] viewed to 1000 columns
TINY_VOCAB = (1024, 1000)
LABELLED = {"all labelled": 1.0, "15% labelled": 0.15}
WARMUP_MS, REP_MS = 25, 200                  # do_bench: median of ~50-200 runs of 1-10 ms
SWEEP_BLOCKS, SWEEP_WARPS = (1024, 2048, 4096, 8192, 16384), (1, 2, 4, 8, 16)


def _time_ms(fn, device):
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")
    fn()                                     # CPU dry run: the interpreter, so only a sanity number
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _peak_mb(fn, device):
    """Extra memory at the peak of one call, beyond what was allocated before it (MB)."""
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


def _problem(n, padded, vocab, labelled, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    full = (torch.randn(n, padded, device=device, generator=g) * 4).to(torch.bfloat16)  # logits of a few units
    labels = torch.randint(0, vocab, (n,), device=device, generator=g)
    labels = torch.where(torch.rand(n, device=device, generator=g) < labelled, labels, -1)
    mask = (labels != -1).float()
    grad_loss = mask / mask.sum().clamp(min=1)                        # d(masked mean) / d ce_i
    view = full[:, :vocab].requires_grad_()  # a leaf view here; in the model, the LM head output's slice
    return view, labels, grad_loss


def _fwd_bwd(loss_fn, x, labels, grad_loss):
    def step():
        loss = loss_fn(x, labels)
        (grad,) = torch.autograd.grad(loss, x, grad_loss)
        return loss, grad
    return step


def _check(name, ours, eager):
    (loss_a, grad_a), (loss_b, grad_b) = ours, eager
    loss_err = ((loss_a - loss_b).abs().max() / loss_b.abs().max().clamp(min=1e-30)).item()
    grad_err = ((grad_a.float() - grad_b.float()).norm() / grad_b.float().norm().clamp(min=1e-30)).item()
    if not (loss_err < 1e-5 and grad_err < 1e-2):
        raise AssertionError(f"{name}: fused vs eager loss error {loss_err:.3g}, grad error {grad_err:.3g}")


def run(sweep=False, device="cuda", tiny=False):
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench/cross_entropy_bench.py measures GPU kernels: run it on a machine with a CUDA GPU "
                           "(or --device cpu --tiny with TRITON_INTERPRET=1 for a dry run)")
    shapes, (padded, vocab) = (TINY_SHAPES, TINY_VOCAB) if tiny else (SHAPES, (PADDED_VOCAB, VOCAB))
    rows = []
    for shape_name, n in shapes.items():
        dense = torch.empty(n, vocab, dtype=torch.bfloat16, device=device)   # the view's bytes, contiguous
        t = _time_ms(lambda: dense.clone(), device)                     # read + write: 2 passes
        rows.append(dict(name=f"device copy of the logits (ceiling): {shape_name}", unit="TB/s",
                         value=2 * dense.numel() * 2 / (t * 1e-3) / 1e12, notes=f"clone of [{n}, {vocab}] bf16, "
                                                                                f"{t:.3f} ms"))
        del dense
        for label_name, labelled in LABELLED.items():
            x, labels, grad_loss = _problem(n, padded, vocab, labelled, device)
            eager = _fwd_bwd(lm_cross_entropy, x, labels, grad_loss)
            fused = _fwd_bwd(ce.fused_cross_entropy, x, labels, grad_loss)
            what = f"{shape_name}, {label_name}"
            _check(what, fused(), eager())
            ms = {"eager": _time_ms(eager, device), "fused": _time_ms(fused, device)}
            mem = {"eager": _peak_mb(eager, device), "fused": _peak_mb(fused, device)}
            logits_gb = n * padded * 2 / 1e9
            shape = f"bf16 [{n}, {padded}] viewed [:, :{vocab}] ({logits_gb:.2f} GB)"
            fused_tbps = 3 * n * vocab * 2 / (ms["fused"] * 1e-3) / 1e12  # read L, read L + write L, all rows
            rows += [
                dict(name=f"CE fwd+bwd eager (fp32 cast + F.cross_entropy): {what}", value=ms["eager"], unit="ms",
                     notes=f"peak +{mem['eager']:.0f} MB; {shape}"),
                dict(name=f"CE fwd+bwd fused: {what}", value=ms["fused"], unit="ms",
                     notes=f"peak +{mem['fused']:.0f} MB; {ms['eager'] / ms['fused']:.2f}x eager; "
                           + (f"{fused_tbps:.2f} TB/s for 3 passes over the logits; " if labelled == 1 else "")
                           + shape),
                dict(name=f"CE fused speed-up: {what}", value=ms["eager"] / ms["fused"], unit="x",
                     notes=f"peak memory {mem['eager'] / max(mem['fused'], 1e-9):.1f}x less"
                     if device == "cuda" else "CPU dry run: interpreter times, meaningless"),
            ]
            del x, labels, grad_loss, eager, fused
    if sweep:
        rows += _sweep(device, tiny)
    return rows


def _sweep(device, tiny):
    """Each kernel alone with other chunk shapes (all rows labelled, the first shape), checked, then timed."""
    n = next(iter((TINY_SHAPES if tiny else SHAPES).values()))
    padded, vocab = TINY_VOCAB if tiny else (PADDED_VOCAB, VOCAB)
    x, labels, grad_loss = _problem(n, padded, vocab, 1.0, device)
    x = x.detach()
    loss_ref, m_ref, s_ref, _ = ce._forward(x, labels, -1)
    grad_ref = ce._backward(x, labels, m_ref, s_ref, grad_loss, -1)
    rows = []
    for block_v in ((64, 256) if tiny else SWEEP_BLOCKS):
        for num_warps in ((1, 2) if tiny else SWEEP_WARPS):
            if not tiny and not 4 <= block_v // (32 * num_warps) <= 128:   # elements per thread per chunk
                continue
            config = ce.CrossEntropyConfig(block_v=block_v, num_warps=num_warps)
            loss, _, _, _ = ce._forward(x, labels, -1, config)
            grad = ce._backward(x, labels, m_ref, s_ref, grad_loss, -1, config)
            _check(f"sweep {config}", (loss, grad), (loss_ref, grad_ref))
            t_fwd = _time_ms(lambda: ce._forward(x, labels, -1, config), device)
            t_bwd = _time_ms(lambda: ce._backward(x, labels, m_ref, s_ref, grad_loss, -1, config), device)
            for direction, t, passes in (("fwd", t_fwd, 1), ("bwd", t_bwd, 2)):
                default = ce.kernel_config(vocab, "forward" if direction == "fwd" else "backward")
                tag = " (default)" if config == default else ""
                rows.append(dict(name=f"sweep {direction} block_v={block_v} warps={num_warps}{tag}",
                                 value=passes * n * vocab * 2 / (t * 1e-3) / 1e12, unit="TB/s",
                                 notes=f"{t:.3f} ms"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other chunk widths and warp counts")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run of this script through the Triton interpreter (set TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", action="store_true", help="small shapes ([64, 1024] -> 1000 columns)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: bench/cross_entropy_bench.py measures GPU kernels; run it on a machine with a CUDA GPU "
                 "(or --device cpu --tiny with TRITON_INTERPRET=1)")
    if args.device == "cpu" and not args.tiny:
        sys.exit("error: --device cpu runs the kernels in the Triton interpreter: add --tiny")
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
              f"triton {triton.__version__}")
    rows = run(sweep=args.sweep, device=args.device, tiny=args.tiny)
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['value']:8.3f} {r['unit']:<5} {r['notes']}")


if __name__ == "__main__":
    main()
