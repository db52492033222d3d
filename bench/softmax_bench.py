"""Fused scale-mask-softmax vs PyTorch on one GPU: effective bandwidth, forward and backward.

Shape: BERT-large attention scores at s=512, b=32: bf16 [32, 16, 512, 512] (268 MB), key-padding mask
[32, 1, 1, 512] with each sequence's length drawn uniformly from [256, 512]. Bandwidth counts the bytes a
perfect kernel must move (docs/measuring.md): forward = read x + write y, backward = read y + read dy + write dx; the
mask is not counted. The ceiling is a device copy (x.clone(): read + write).

    python bench/softmax_bench.py        # the table below, plus the sweep over SoftmaxConfig variants

`run()` returns rows {name, value, unit, notes} for bench/run.py (BENCHMARKS.md); `run(sweep=True)` adds
one row per config and direction. Every variant is checked against the eager chain before it is timed.
"""
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from minibert.kernels import softmax as fused  # noqa: E402

SHAPE = (32, 16, 512, 512)   # [b, heads, sq, sk]: BERT-large, s = 512, micro-batch 32
HEAD_DIM = 64                # scale = 1/sqrt(64), as BERT-large (1024 hidden / 16 heads)
DEVICE = "cuda"              # the GPU being measured (a CPU dry run patches it)
WARMUP_MS, REP_MS = 25, 200  # do_bench: median over ~1000 runs of ~0.1-0.4 ms each


def sweep_configs(sk=SHAPE[-1]):
    """Tiles of 1-32 rows with 8-32 elements per thread, one program per tile; and persistent grids
    (half or full thread occupancy of an SM) with and without a 3-stage prefetch of the next tile."""
    block = triton.next_power_of_2(sk)
    configs = []
    for rows in (1, 2, 4, 8, 16, 32):
        for num_warps in (1, 2, 4, 8, 16):
            if 8 <= rows * block // (32 * num_warps) <= 32:
                configs.append(fused.SoftmaxConfig(rows=rows, num_warps=num_warps))
    for rows, num_warps in ((2, 2), (4, 4), (8, 8), (4, 2), (8, 4)):
        for programs_per_sm in (1024 // (32 * num_warps), 2048 // (32 * num_warps)):
            for loop_stages in (1, 3):
                configs.append(fused.SoftmaxConfig(rows=rows, num_warps=num_warps,
                                                   programs_per_sm=programs_per_sm, loop_stages=loop_stages))
    return configs


def _eager_chain(x, mask, scale):
    """What a model without fusion runs (the 'eager' row of BENCHMARKS.md): three kernels."""
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def _check(name, actual, expected, tol=2e-2):
    """Fail loudly: max abs error relative to the largest expected magnitude (bf16 has ~3 digits)."""
    err = ((actual.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    if not math.isfinite(err) or err > tol:
        raise AssertionError(f"{name}: max error {err:.3g} (relative to max |expected|) exceeds {tol}")


def _time_ms(fn):
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _tbps(n_bytes, ms):
    return n_bytes / (ms * 1e-3) / 1e12


def run(sweep=False):
    if not torch.cuda.is_available():
        raise RuntimeError("bench/softmax_bench.py measures GPU kernels: run it on a machine with a CUDA GPU")
    torch.manual_seed(0)
    dev = DEVICE
    b, heads, sq, sk = SHAPE
    scale = 1.0 / math.sqrt(HEAD_DIM)
    x = torch.randn(SHAPE, device=dev, dtype=torch.bfloat16) * 4                 # logits of a few units
    dy = torch.randn(SHAPE, device=dev, dtype=torch.bfloat16)
    lengths = torch.randint(sk // 2, sk + 1, (b,), device=dev)                   # keys kept per sequence
    mask = (torch.arange(sk, device=dev)[None, :] >= lengths[:, None])[:, None, None, :]  # [b, 1, 1, sk]
    n = x.numel() * x.element_size()
    fwd_bytes, bwd_bytes = 2 * n, 3 * n

    # The oracle, in fp32 on the bf16 inputs: y and dx = dL/dx for L = sum(y * dy).
    x32 = x.float().requires_grad_()
    y_ref = fused.softmax_reference(x32, mask, scale)
    (dx_ref,) = torch.autograd.grad(y_ref, x32, dy.float())
    y_ref = y_ref.detach()
    del x32

    def grad_of(forward):  # backward-only timing: the graph is built once, replayed with retain_graph
        xg = x.detach().requires_grad_()
        y = forward(xg)
        return y, lambda: torch.autograd.grad(y, xg, dy, retain_graph=True)[0]

    ms = {}
    # Ceiling and peers.
    ms["copy"] = _time_ms(lambda: x.clone())
    y, bwd = grad_of(lambda t: torch.softmax(t, dim=-1))
    ms["torch fwd"] = _time_ms(lambda: torch.softmax(x, dim=-1))
    ms["torch bwd"] = _time_ms(bwd)
    y, bwd = grad_of(lambda t: _eager_chain(t, mask, scale))
    _check("eager forward", y, y_ref)
    _check("eager backward", bwd(), dx_ref)
    ms["eager fwd"] = _time_ms(lambda: _eager_chain(x, mask, scale))
    ms["eager bwd"] = _time_ms(bwd)
    # Ours, default config, through the public function and autograd (what the model runs).
    y, bwd = grad_of(lambda t: fused.fused_scale_mask_softmax(t, mask, scale))
    _check("fused forward (default config)", y, y_ref)
    _check("fused backward (default config)", bwd(), dx_ref)
    ms["ours fwd"] = _time_ms(lambda: fused.fused_scale_mask_softmax(x, mask, scale))
    ms["ours bwd"] = _time_ms(bwd)
    y_ours = y.detach()
    ms["ours no mask fwd"] = _time_ms(lambda: fused.fused_scale_mask_softmax(x, None, scale))
    # The same public call replayed from a CUDA graph: the GPU time alone. do_bench times each call between
    # two GPU events, so when the Python before a launch outlasts the queued work, the GPU idles inside the
    # timed interval; a replay has no Python in it. (Forward only: autograd's backward cannot be captured
    # on its own.)
    ms["ours graph fwd"] = triton.testing.do_bench_cudagraph(
        lambda: fused.fused_scale_mask_softmax(x, mask, scale), rep=REP_MS, return_mode="median")
    del y, bwd

    shape = f"bf16 {list(SHAPE)}, mask [{b},1,1,{sk}], lengths U[{sk // 2},{sk}]"
    copy_tbps = _tbps(fwd_bytes, ms["copy"])
    rows = [dict(name="device copy x.clone() (ceiling)", value=copy_tbps, unit="TB/s",
                 notes=f"read + write, {ms['copy']:.3f} ms")]
    variants = (("torch", "torch.softmax alone (no scale, no mask)"),
                ("eager", "eager scale -> masked_fill -> softmax"),
                ("ours", "minibert fused_scale_mask_softmax"),
                ("ours no mask", "minibert fused, mask=None (what the mask costs)"),
                ("ours graph", "minibert fused, replayed from a CUDA graph (no host time)"))
    for direction, n_bytes, what in (("fwd", fwd_bytes, "read x + write y"),
                                     ("bwd", bwd_bytes, "read y, dy + write dx")):
        torch_tbps = _tbps(n_bytes, ms[f"torch {direction}"])
        for key, label in variants:
            if f"{key} {direction}" not in ms:
                continue
            t = ms[f"{key} {direction}"]
            tbps = _tbps(n_bytes, t)
            rows.append(dict(name=f"softmax {direction}: {label}", value=tbps, unit="TB/s",
                             notes=f"{what}; {t:.3f} ms; {tbps / torch_tbps:.2f}x torch.softmax; "
                                   f"{tbps / copy_tbps:.0%} of copy; {shape}"))
    if sweep:
        rows += _sweep(x, dy, mask, scale, y_ours, y_ref, dx_ref, fwd_bytes, bwd_bytes)
    return rows


def _sweep(x, dy, mask, scale, y_ours, y_ref, dx_ref, fwd_bytes, bwd_bytes):
    """Each config's forward and backward kernels alone (no autograd), checked, then timed."""
    rows = []
    defaults = {"fwd": fused.default_config(x.shape[-1], "forward"),
                "bwd": fused.default_config(x.shape[-1], "backward")}
    for config in sweep_configs(x.shape[-1]):
        y = fused._forward(x, mask, scale, config)
        _check(f"forward {config}", y, y_ref)
        dx = fused._backward(y_ours, dy, scale, config)
        _check(f"backward {config}", dx, dx_ref)
        del y, dx
        label = (f"rows={config.rows} warps={config.num_warps} "
                 + (f"persistent {config.programs_per_sm}/SM stages={config.loop_stages}"
                    if config.programs_per_sm else "grid=tiles"))
        t_fwd = _time_ms(lambda: fused._forward(x, mask, scale, config))
        t_bwd = _time_ms(lambda: fused._backward(y_ours, dy, scale, config))
        for direction, n_bytes, t in (("fwd", fwd_bytes, t_fwd), ("bwd", bwd_bytes, t_bwd)):
            tag = " (default)" if config == defaults[direction] else ""
            rows.append(dict(name=f"sweep {direction} {label}{tag}", value=_tbps(n_bytes, t), unit="TB/s",
                             notes=f"{t:.3f} ms"))
    return rows


def main():
    if not torch.cuda.is_available():
        sys.exit("error: bench/softmax_bench.py measures GPU kernels; run it on a machine with a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    rows = run(sweep=True)
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['value']:6.3f} {r['unit']:<5} {r['notes']}")
    for direction in ("fwd", "bwd"):
        best = max((r for r in rows if r["name"].startswith(f"sweep {direction}")), key=lambda r: r["value"])
        print(f"best {direction}: {best['name'][len('sweep fwd '):]}  {best['value']:.3f} TB/s")


if __name__ == "__main__":
    main()
