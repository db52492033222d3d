"""Fused dropout + residual add + LayerNorm vs eager PyTorch on one GPU, forward + backward.

Shapes: bf16 [16384, 1024] (BERT-large, b32 s512) and [32768, 768] (BERT-base, b256 s128), dropout 0.1,
used as pre-LN uses it: both outputs get a gradient. Eager is what TransformerLayer runs today:
    x = residual + F.dropout(y, 0.1);  normed = F.layer_norm(x, [h], weight, bias, eps)
Bandwidth counts the bytes a perfect kernel moves (docs/measuring.md), T = one [rows, h] tensor: forward
reads residual, y and writes x, normed (4 T); backward reads grad_x, grad_normed, x and writes
grad_residual, grad_y (5 T). Weights and the [rows] mean/rstd are not counted. The ceiling is a device copy.
Two clocks: the GPU time of a CUDA-graph replay (what the op costs inside a training step, where kernels
queue behind the matmuls; no L2 flush between replays), and do_bench of calls launched from Python, which
adds the host's launch overhead wherever it exceeds the GPU time (here: two to three Triton launches and
autograd bookkeeping, ~0.2 ms of CPU per fwd+bwd on the gVisor H200 host).

    python bench/layer_norm_bench.py          # the rows (about a minute)
    python bench/layer_norm_bench.py --sweep  # and every tile of sweep_tiles, each checked then timed

`run()` returns rows {name, value, unit, notes} for bench/run.py; `run(sweep=True)` adds one row per tile.
Before anything is timed, the fused op is checked against eager at dropout 0 (where both are deterministic).
"""
import argparse
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from minibert.fast import layer_norm as fused  # noqa: E402

SHAPES = {"BERT-large b32 s512": (16384, 1024), "BERT-base b256 s128": (32768, 768)}
DROPOUT = 0.1                # BERT's hidden dropout
EPS = 1e-12                  # BERT's layernorm epsilon
WARMUP_MS, REP_MS = 25, 200  # do_bench: median over many runs of ~0.05-0.3 ms each


def _eager(residual, y, weight, bias, p):
    x = residual + F.dropout(y, p, training=True)
    return x, F.layer_norm(x, x.shape[-1:], weight, bias, EPS)


def _fused(residual, y, weight, bias, p, tiles=None):
    if tiles is None:
        return fused.dropout_add_layer_norm(residual, y, weight, bias, EPS, p, 1234)
    return fused._DropoutAddLayerNorm.apply(residual, y, weight, bias, EPS, p, 1234, tiles)


def _inputs(rows, h):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape, scale=1.0: (torch.randn(shape, device="cuda", generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    residual, y = make(rows, h, scale=2.0), make(rows, h)
    weight, bias = 1 + make(h, scale=0.1), make(h, scale=0.1)
    grads = (make(rows, h), make(rows, h))                     # grad_x, grad_normed
    return [t.requires_grad_() for t in (residual, y, weight, bias)], grads


def _step(forward, leaves, grads):
    """One forward + backward; autograd.grad, so no .grad accumulation kernels are timed."""
    def go():
        outs = forward(*leaves)
        return torch.autograd.grad(outs, leaves, grads)
    return go


def _backward_only(forward, leaves, grads):
    outs = forward(*leaves)
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


NAMES = ("x", "normed", "grad_residual", "grad_y", "grad_weight", "grad_bias")


def _check(name, actual, expected, tol=2e-2, names=NAMES):
    """max |actual - expected| relative to max |expected|; bf16 holds ~3 digits."""
    for a, e, what in zip(actual, expected, names):
        err = ((a.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30)).item()
        if not math.isfinite(err) or err > tol:
            raise AssertionError(f"{name} {what}: max error {err:.3g} (relative to max |expected|) exceeds {tol}")


def _time_ms(fn, graph=True):
    """graph=True: replay fn from a CUDA graph, the GPU time alone (what the op costs when the GPU is busy,
    as in training, where kernels queue behind the matmuls); False: launched one by one from Python, which
    adds the host's launch overhead whenever it exceeds the GPU time (a few small ops in a row)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median")
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def _tbps(n_bytes, ms):
    return n_bytes / (ms * 1e-3) / 1e12


def _measure(label, rows, h):
    leaves, grads = _inputs(rows, h)
    t = rows * h * 2                                            # bytes of one bf16 [rows, h] tensor
    # Check at p = 0, where eager and fused must agree up to rounding.
    eager_out = _eager(*leaves, 0.0)
    fused_out = _fused(*leaves, 0.0)
    _check(f"{label} fused vs eager (p = 0)",
           list(fused_out) + list(torch.autograd.grad(fused_out, leaves, grads)),
           list(eager_out) + list(torch.autograd.grad(eager_out, leaves, grads)))
    del eager_out, fused_out
    ms = {"copy": _time_ms(lambda: leaves[0].detach().clone(), graph=False)}
    for name, forward in (("eager", _eager), ("fused", _fused)):
        fwd = lambda *a, f=forward: f(*a, DROPOUT)               # noqa: E731
        for graph, tag in ((True, ""), (False, " python")):
            with torch.no_grad():
                ms[f"{name} fwd{tag}"] = _time_ms(lambda: fwd(*leaves), graph)
            ms[f"{name} fwd+bwd{tag}"] = _time_ms(_step(fwd, leaves, grads), graph)
            # A graph cannot capture a backward alone (autograd runs it on the forward's stream): subtract.
            ms[f"{name} bwd{tag}"] = (_time_ms(_backward_only(fwd, leaves, grads), graph) if not graph
                                      else ms[f"{name} fwd+bwd"] - ms[f"{name} fwd"])
    where = f"bf16 [{rows}, {h}] ({label}), dropout {DROPOUT}"
    copy = _tbps(2 * t, ms["copy"])
    out = [dict(name=f"[{rows}, {h}] device copy (ceiling)", value=copy, unit="TB/s",
                notes=f"read + write, {ms['copy']:.3f} ms")]
    for name in ("eager", "fused"):
        out.append(dict(name=f"[{rows}, {h}] {name} fwd+bwd (GPU time, CUDA graph)", value=ms[f"{name} fwd+bwd"],
                        unit="ms", notes=f"fwd {ms[f'{name} fwd']:.3f} ms, bwd {ms[f'{name} bwd']:.3f} ms; {where}"))
    for tag, how in (("", "GPU time, CUDA graph"), (" python", "launched from Python, do_bench")):
        eager_ms, fused_ms = ms[f"eager fwd+bwd{tag}"], ms[f"fused fwd+bwd{tag}"]
        out.append(dict(name=f"[{rows}, {h}] fused speed-up over eager ({how})", value=eager_ms / fused_ms,
                        unit="x", notes=f"fwd+bwd {eager_ms:.3f} -> {fused_ms:.3f} ms; fwd "
                                        f"{ms[f'eager fwd{tag}']:.3f} -> {ms[f'fused fwd{tag}']:.3f}, bwd "
                                        f"{ms[f'eager bwd{tag}']:.3f} -> {ms[f'fused bwd{tag}']:.3f}"))
    for what, n_bytes, key in (("fwd+bwd", 9 * t, "fused fwd+bwd"), ("fwd", 4 * t, "fused fwd"),
                               ("bwd", 5 * t, "fused bwd")):
        tbps = _tbps(n_bytes, ms[key])
        out.append(dict(name=f"[{rows}, {h}] fused {what} effective bandwidth", value=tbps, unit="TB/s",
                        notes=f"{n_bytes / 1e6:.0f} MB in {ms[key]:.3f} ms (CUDA graph); {tbps / copy:.0%} of copy"))
    return out


def sweep_tiles(h):
    """Forward: 1-32 rows per block with 4-64 values per thread. Backward: 1-16 rows with 4-32 values per
    thread (it holds more tensors), on grids of 1, 2, 4 or 8 programs per SM."""
    block_n = fused._block_n(h)
    tiles = [(m, w) for m in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8, 16)]
    forward = [fused.Tile(m, w) for m, w in tiles if 4 <= m * block_n // (32 * w) <= 64]
    backward = [fused.Tile(m, w, k) for m, w in tiles for k in (1, 2, 4, 8)
                if m <= 16 and 4 <= m * block_n // (32 * w) <= 32]
    return forward, backward


def _sweep(rows, h):
    """Each tile's kernels alone (the launchers, no autograd), checked against the default tile, then timed."""
    (residual, y, weight, bias), (grad_x, grad_normed) = [[t.detach() for t in ts] for ts in _inputs(rows, h)]
    t = rows * h * 2
    default_fwd, default_bwd = fused.pick_tiles(h)
    forward_tiles, backward_tiles = sweep_tiles(h)
    x, normed, stats = fused._forward(residual, y, weight, bias, EPS, DROPOUT, 1234, default_fwd)
    expected = fused._backward(x, weight, stats, grad_x, grad_normed, DROPOUT, 1234, default_bwd, True)
    out = []
    for tile in forward_tiles:
        run_fwd = lambda: fused._forward(residual, y, weight, bias, EPS, DROPOUT, 1234, tile)  # noqa: E731
        got = run_fwd()
        if not torch.equal(got[0], x):                                 # the mask must not depend on the tile
            raise AssertionError(f"forward {tile}: x differs from the default tile's")
        _check(f"forward {tile}", got[1:2], (normed,), tol=1e-2, names=("normed",))
        ms = _time_ms(run_fwd)
        tag = " (default)" if tile == default_fwd else ""
        out.append(dict(name=f"sweep [{rows}, {h}] fwd rows={tile.block_m} warps={tile.num_warps}{tag}",
                        value=_tbps(4 * t, ms), unit="TB/s", notes=f"{ms:.4f} ms"))
    for tile in backward_tiles:
        run_bwd = lambda: fused._backward(x, weight, stats, grad_x, grad_normed, DROPOUT, 1234, tile, True)  # noqa: E731
        got = run_bwd()
        _check(f"backward {tile}", [got[0], got[1], got[2][0], got[2][1]],
               [expected[0], expected[1], expected[2][0], expected[2][1]], tol=1e-2, names=NAMES[2:])
        ms = _time_ms(run_bwd)
        tag = " (default)" if tile == default_bwd else ""
        out.append(dict(name=f"sweep [{rows}, {h}] bwd rows={tile.block_m} warps={tile.num_warps} "
                             f"programs/SM={tile.programs_per_sm}{tag}",
                        value=_tbps(5 * t, ms), unit="TB/s", notes=f"{ms:.4f} ms"))
    return out


def run(sweep=False):
    if not torch.cuda.is_available():
        raise RuntimeError("bench/layer_norm_bench.py measures GPU kernels: run it on a machine with a CUDA GPU")
    rows = []
    for label, (n, h) in SHAPES.items():
        rows += _measure(label, n, h)
        if sweep:
            rows += _sweep(n, h)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every tile (minutes: one compile each)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/layer_norm_bench.py measures GPU kernels; run it on a machine with a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    rows = run(sweep=args.sweep)
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['value']:7.3f} {r['unit']:<5} {r['notes']}")
    for shape in SHAPES.values() if args.sweep else ():
        for direction in ("fwd", "bwd"):
            prefix = f"sweep [{shape[0]}, {shape[1]}] {direction}"
            best = max((r for r in rows if r["name"].startswith(prefix)), key=lambda r: r["value"])
            print(f"best {prefix[6:]}: {best['name'][len(prefix) + 1:]}  {best['value']:.3f} TB/s")


if __name__ == "__main__":
    main()
