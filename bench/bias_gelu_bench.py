"""Fused bias + GeLU (--bias-gelu-fusion) against the ops it replaces, on one GPU, each direction alone.

Shapes: bf16 [16384, 4096] (BERT-large's fc1 output at b32 s512) and [32768, 3072] (BERT-base, b256 s128).
The plain path is what the MLP runs without the flag, the bias already added by fc1's matmul epilogue:
    forward   a = F.gelu(z)
    backward  dz = gelu_backward(da, z);  dbias = dz^T . 1  (the GEMV of minibert/linear.py)
The fused path takes y = z - b (fc1 without its bias) and runs minibert.kernels.bias_gelu's two kernels.
Bandwidth counts the bytes a perfect kernel moves, T = one [rows, F] bf16 tensor: forward 2 T (read y,
write a), backward 3 T (read da, y; write dz). Times are GPU time of a CUDA-graph replay (as inside a
training step); the ceiling is a device copy.

    python bench/bias_gelu_bench.py          # the rows (half a minute)
    python bench/bias_gelu_bench.py --sweep  # and each tile of sweep_tiles at BERT-large (about a minute)

`run()` returns rows {name, value, unit, notes} for bench/run.py; `run(sweep=True)` adds one row per tile.
"""
import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from bench.layer_norm_bench import _check, _tbps, _time_ms  # noqa: E402
from minibert.kernels import bias_gelu as fused  # noqa: E402

SHAPES = {"BERT-large b32 s512": (16384, 4096), "BERT-base b256 s128": (32768, 3072)}


def _inputs(rows, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    y, bias, da = make(rows, n), make(n), make(rows, n)
    return y, bias, (y.float() + bias.float()).to(torch.bfloat16), da


def _plain_backward(z, da, ones):
    dz = torch.ops.aten.gelu_backward(da, z)
    return dz, torch.mv(dz.t(), ones)


def _measure(label, rows, n):
    y, bias, z, da = _inputs(rows, n)
    ones = torch.ones(rows, device="cuda", dtype=torch.bfloat16)
    tiles, tiles_bwd = fused._tiles("forward"), fused._tiles("backward")
    expected = [F.gelu(z), *_plain_backward(z, da, ones)]
    _check(f"{label} fused vs plain", [fused.forward_2d(y, bias, tiles), *fused.backward_2d(y, bias, da, tiles_bwd)],
           expected, names=("a", "dy", "dbias"))
    t = rows * n * 2
    ms = {"copy": _time_ms(lambda: y.clone()),
          "plain fwd": _time_ms(lambda: F.gelu(z)), "plain bwd": _time_ms(lambda: _plain_backward(z, da, ones)),
          "fused fwd": _time_ms(lambda: fused.forward_2d(y, bias, tiles)),
          "fused bwd": _time_ms(lambda: fused.backward_2d(y, bias, da, tiles_bwd))}
    copy = _tbps(2 * t, ms["copy"])
    where = f"bf16 [{rows}, {n}] ({label}); GPU time, CUDA graph"
    out = [dict(name=f"[{rows}, {n}] device copy (ceiling)", value=copy, unit="TB/s",
                notes=f"read + write, {ms['copy']:.3f} ms")]
    for direction, passes in (("fwd", 2), ("bwd", 3)):
        plain, ours = ms[f"plain {direction}"], ms[f"fused {direction}"]
        out.append(dict(name=f"[{rows}, {n}] {direction}: fused speed-up over plain", value=plain / ours, unit="x",
                        notes=f"{plain:.4f} -> {ours:.4f} ms; fused {_tbps(passes * t, ours):.2f} TB/s "
                              f"({_tbps(passes * t, ours) / copy:.0%} of copy); {where}"))
    return out


def sweep_tiles():
    """Twelve tiles around the default: rows 4-64 a program, columns 256-1024, 4-16 warps, 16 to 64 values
    per thread (each costs two compiles, a second or two apiece on the H200's host)."""
    return [(4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 8), (16, 1024, 16),
            (32, 256, 8), (32, 256, 16), (32, 512, 16), (64, 256, 16), (64, 256, 8), (32, 256, 4)]


def _sweep(rows, n, echo):
    y, bias, _, da = _inputs(rows, n)
    default = fused._tiles()
    expected = [fused.forward_2d(y, bias, default), *fused.backward_2d(y, bias, da, default)]
    defaults = {"fwd": fused._tiles("forward"), "bwd": fused._tiles("backward")}
    t = rows * n * 2
    out = []
    for tile in sweep_tiles():
        _check(f"tile {tile}", [fused.forward_2d(y, bias, tile), *fused.backward_2d(y, bias, da, tile)], expected,
               tol=1e-2, names=("a", "dy", "dbias"))
        for direction, passes, fn in (("fwd", 2, lambda: fused.forward_2d(y, bias, tile)),
                                      ("bwd", 3, lambda: fused.backward_2d(y, bias, da, tile))):
            ms = _time_ms(fn)
            tag = " (default)" if tile == defaults[direction] else ""
            out.append(dict(name=f"sweep [{rows}, {n}] {direction} rows={tile[0]} cols={tile[1]} warps={tile[2]}{tag}",
                            value=_tbps(passes * t, ms), unit="TB/s", notes=f"{ms:.4f} ms"))
            echo(out[-1])
    return out


def _print(row):
    print(f"{row['name']:<64}  {row['value']:7.3f} {row['unit']:<5} {row['notes']}", flush=True)


def run(sweep=False, echo=lambda row: None):
    """The rows; echo(row) is called as each is measured (main prints them: a slow sweep shows progress)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench/bias_gelu_bench.py measures GPU kernels: run it on a machine with a CUDA GPU")
    rows = []
    for label, (n_rows, n) in SHAPES.items():
        rows += _measure(label, n_rows, n)
        for row in rows[-3:]:
            echo(row)
    if sweep:
        rows += _sweep(*SHAPES["BERT-large b32 s512"], echo)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every tile (a minute or two: one compile each)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/bias_gelu_bench.py measures GPU kernels; run it on a machine with a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    rows = run(sweep=args.sweep, echo=_print)
    for direction in ("fwd", "bwd") if args.sweep else ():
        prefix = f"sweep [16384, 4096] {direction}"
        best = max((r for r in rows if r["name"].startswith(prefix)), key=lambda r: r["value"])
        print(f"best {direction}: {best['name'][len(prefix) + 1:]}  {best['value']:.3f} TB/s")


if __name__ == "__main__":
    main()
