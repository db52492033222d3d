"""Flash attention (ours, Triton) next to PyTorch SDPA on one GPU, same data, same run.

FLOPs use the FlashAttention convention: forward = 4*b*h*s^2*d, backward = 2.5x, forward+backward = 3.5x,
counting ALL s x s positions even when keys are padded (so skipping padding shows up as speed).
Shape b32 h16 s512 d64 bf16 (BERT-large attention); key lengths: uniform in [256, 512] (seeded), none
padded (all 512), half padded (all 256). Our output and gradients are checked against fp32 SDPA-math at
real query rows before any timing; a mismatch raises. Times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph: GPU time, Python launch overhead left out, for ours and SDPA alike);
two "eager timing" rows show one Python call each, overhead included.

    python bench/attention_bench.py            # the table (about 2 minutes, mostly compiling)
    python bench/attention_bench.py --sweep    # time every candidate tile per kernel; prints the best
    python bench/attention_bench.py --sweep --head-dims 64,128
    python bench/attention_bench.py --sweep --dropout 0.1   # the tiles with attention dropout 0.1
    python bench/attention_bench.py --sweep --lengths none   # the same with every key real (training's)
    python bench/attention_bench.py --sweep-short [--dropout 0.1]  # the short backward's tiles, BERT-base

BERT-base's shape (b256 h12 s128 d64, no padding) gets rows of its own: there one program holds all 128
keys, so the backward is one kernel (flash_attention_bwd.launch_short); the rows time it next to the
dq + dkdv pair it replaces and next to cuDNN, with and without dropout.

run() returns rows as bench/run.py wants them: {"name", "value", "unit", "notes"} (timings also carry "ms").
"""
import argparse
import contextlib
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from minibert.errors import UsageError, exit_on_usage_error  # noqa: E402

B, H, S, D = 32, 16, 512, 64
CASES = {"lengths U[256,512]": "mixed", "none padded (all 512)": "none", "half padded (all 256)": "half"}


def forward_flops(b, h, s, d):
    return 4 * b * h * s * s * d


def make_inputs(b=B, h=H, s=S, d=D, lengths="mixed", seed=0):
    """q, k, v, dO bf16 [b, h, s, d] and padding_mask bool [b, s] (True = padding, right-padded)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    if lengths == "mixed":
        lens = torch.randint(s // 2, s + 1, (b,), device="cuda", generator=g)
    else:
        lens = torch.full((b,), s if lengths == "none" else s // 2, device="cuda")
    pad = torch.arange(s, device="cuda")[None, :] >= lens[:, None]
    return q, k, v, do.masked_fill(pad[:, None, :, None], 0.0), pad


def bench_ms(fn):
    """Eager timing: what one Python call costs, launch overhead included (median of do_bench)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_ms(fn):
    """GPU time: the calls are captured in a CUDA graph and replayed, so the Python side of launching is
    left out, for ours and SDPA alike (on the H200 at a tiny, CPU-bound shape one fwd+bwd call cost
    ~0.83 ms of Python for ours, ~0.28 ms for SDPA). Inside a training step of a large model the
    launches overlap with GPU work, so this is the number that adds up to step time."""
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def time_passes(attend, q, k, v, do, passes=("fwd", "bwd", "fwd+bwd"), timer=graph_ms):
    """{pass: ms} for attend(q, k, v) -> out, all passes measured the same way for every implementation.
    Under graph_ms the backward alone cannot be captured (autograd runs it on the stream of a forward made
    outside the graph), so bwd = (fwd+bwd) - fwd there; eagerly it is timed on its own."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    times = {}
    if "fwd" in passes or ("bwd" in passes and timer is graph_ms):
        with torch.no_grad():
            times["fwd"] = timer(lambda: attend(q, k, v))
    if "fwd+bwd" in passes or ("bwd" in passes and timer is graph_ms):
        times["fwd+bwd"] = timer(lambda: torch.autograd.grad(attend(qg, kg, vg), (qg, kg, vg), do))
    if "bwd" in passes:
        if timer is graph_ms:
            times["bwd"] = times["fwd+bwd"] - times["fwd"]
        else:
            out = attend(qg, kg, vg)
            times["bwd"] = timer(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
    return {p: times[p] for p in passes}


def sdpa(backend, mask, dropout_p=0.0):
    """attend(q, k, v) with one SDPA backend; mask bool [b, s] True = padding, or None."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention
    keep = None if mask is None else ~mask[:, None, None, :]                # SDPA: True = attend

    def attend(q, k, v):
        with sdpa_kernel([backend]):
            return scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p)
    return attend


BASE = (256, 12, 128, 64)  # BERT-base's attention at micro-batch 256: b, heads, s, d


@contextlib.contextmanager
def two_kernel_backward():
    """A context in which flash_attention's backward runs the dq and dkdv kernels even where the short
    one applies (the pick_tiles it imported, without its short tile), to time the pair against it."""
    import minibert.kernels.flash_attention as fa
    original = fa.pick_tiles
    fa.pick_tiles = lambda d, dtype, seq_len=0: original(d, dtype, seq_len)[:3] + (None,)
    try:
        yield
    finally:
        fa.pick_tiles = original


def base_shape_rows():
    """BERT-base's attention, no padding: the short backward, the two kernels, cuDNN; dropout 0 and 0.1."""
    from torch.nn.attention import SDPBackend
    q, k, v, do, _ = make_inputs(*BASE, lengths="none")
    flops, rows, ms = forward_flops(*BASE), [], {}
    for p in (0.0, 0.1):
        tag = f"BERT-base b256 h12 s128, dropout {p}:"
        kwargs = {"dropout_p": p, "seed": 1234} if p else {}
        rows += timing_rows(f"{tag} ours (short backward)", time_passes(ours(None, **kwargs), q, k, v, do), flops)
        with two_kernel_backward():
            rows += timing_rows(f"{tag} ours (dq + dkdv kernels)", time_passes(ours(None, **kwargs), q, k, v, do),
                                flops)
        try:
            rows += timing_rows(f"{tag} sdpa-cudnn", time_passes(sdpa(SDPBackend.CUDNN_ATTENTION, None, p),
                                                                 q, k, v, do), flops)
        except RuntimeError as e:
            print(f"{tag} sdpa-cudnn skipped: {str(e)[:100]}")
        ms.update({r["name"]: r["ms"] for r in rows if "ms" in r})
        rows.append(ratio_row(f"{tag} backward, short over dq + dkdv",
                              ms[f"{tag} ours (dq + dkdv kernels) bwd"] / ms[f"{tag} ours (short backward) bwd"]))
        if f"{tag} sdpa-cudnn fwd+bwd" in ms:
            rows.append(ratio_row(f"{tag} fwd+bwd, ours over sdpa-cudnn",
                                  ms[f"{tag} sdpa-cudnn fwd+bwd"] / ms[f"{tag} ours (short backward) fwd+bwd"]))
    return rows


def ours(mask, **kwargs):
    from minibert.kernels.flash_attention import flash_attention
    return lambda q, k, v: flash_attention(q, k, v, padding_mask=mask, **kwargs)


def check_against_math(q, k, v, do, pad):
    """Ours and SDPA memory-efficient (bf16) vs fp32 SDPA-math; raises if ours is clearly worse."""
    from torch.nn.attention import SDPBackend
    real = (~pad)[:, None, :, None]

    def run(attend, dtype):
        ins = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
        out = attend(*ins)
        grads = torch.autograd.grad(out, ins, do.to(dtype))
        return [out.float() * real, *(g.float() for g in grads)]

    ref = run(sdpa(SDPBackend.MATH, pad), torch.float32)
    report = []
    for name, attend in [("ours", ours(pad)), ("sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION, pad))]:
        got = run(attend, torch.bfloat16)
        report.append([((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)])
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        ours_err, sdpa_err = report[0][i], report[1][i]
        print(f"check {what}: max error / max |ref|: ours {ours_err:.2e}, sdpa-efficient {sdpa_err:.2e}")
        if not ours_err <= max(2 * sdpa_err, 1e-2):
            raise RuntimeError(f"flash attention {what} disagrees with SDPA math: {ours_err:.2e} "
                               f"(sdpa-efficient: {sdpa_err:.2e})")


def timing_rows(label, times, flops):
    scale = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    return [{"name": f"{label} {p}", "value": scale[p] * flops / ms / 1e9, "unit": "TFLOP/s",
             "notes": f"{ms:.3f} ms", "ms": ms} for p, ms in times.items()]


def ratio_row(name, ratio, notes=""):
    return {"name": name, "value": ratio, "unit": "x", "notes": notes}


def run(head_dims=(32, 80, 128)):
    """The comparison table as a list of rows (see the module docstring)."""
    from torch.nn.attention import SDPBackend
    if not torch.cuda.is_available():
        raise UsageError("bench/attention_bench.py needs a CUDA GPU")
    flops = forward_flops(B, H, S, D)
    rows = []
    q, k, v, do, pad = make_inputs(lengths="mixed")
    check_against_math(q, k, v, do, pad)
    for case, lengths in CASES.items():
        q, k, v, do, pad = make_inputs(lengths=lengths)
        rows += timing_rows(f"ours, {case},", time_passes(ours(pad), q, k, v, do), flops)
        rows += timing_rows(f"sdpa-efficient + mask, {case},",
                            time_passes(sdpa(SDPBackend.EFFICIENT_ATTENTION, pad), q, k, v, do, ("fwd+bwd",)), flops)
    for name, backend in [("sdpa-cudnn, no mask,", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash, no mask,", SDPBackend.FLASH_ATTENTION)]:
        try:
            rows += timing_rows(name, time_passes(sdpa(backend, None), q, k, v, do, ("fwd+bwd",)), flops)
        except RuntimeError as e:                           # backend not available in this build
            print(f"{name} skipped: {str(e)[:100]}")
    # equal work with dropout, as in training: every position real, attention dropout 0.1 on both sides
    q, k, v, do, pad = make_inputs(lengths="none")
    rows += timing_rows("ours + dropout 0.1, none padded (all 512),",
                        time_passes(ours(pad, dropout_p=0.1, seed=1234), q, k, v, do, ("fwd+bwd",)), flops)
    try:
        rows += timing_rows("sdpa-cudnn + dropout 0.1, no mask,", time_passes(
            sdpa(SDPBackend.CUDNN_ATTENTION, None, 0.1), q, k, v, do, ("fwd+bwd",)), flops)
    except RuntimeError as e:
        print(f"sdpa-cudnn + dropout skipped: {str(e)[:100]}")
    q, k, v, do, pad = make_inputs(lengths="mixed")
    rows += timing_rows("ours + dropout 0.1, lengths U[256,512],",
                        time_passes(ours(pad, dropout_p=0.1, seed=1234), q, k, v, do, ("fwd+bwd",)), flops)
    # the same calls timed eagerly (one Python call each, launch overhead included): see graph_ms
    rows += timing_rows("eager timing: ours, lengths U[256,512],",
                        time_passes(ours(pad), q, k, v, do, ("fwd+bwd",), timer=bench_ms), flops)
    rows += timing_rows("eager timing: sdpa-cudnn, no mask,",
                        time_passes(sdpa(SDPBackend.CUDNN_ATTENTION, None), q, k, v, do, ("fwd+bwd",),
                                    timer=bench_ms), flops)
    ms = {r["name"]: r["ms"] for r in rows}
    mine = ms["ours, lengths U[256,512], fwd+bwd"]
    rows.append(ratio_row("ours fwd+bwd: half padded speed-up over none padded",
                          ms["ours, none padded (all 512), fwd+bwd"] / ms["ours, half padded (all 256), fwd+bwd"],
                          "target >= 1.6"))
    for peer in ["sdpa-efficient + mask, lengths U[256,512], fwd+bwd", "sdpa-cudnn, no mask, fwd+bwd",
                 "sdpa-flash, no mask, fwd+bwd"]:
        if peer in ms:
            rows.append(ratio_row(f"speed-up of ours (U[256,512]) over {peer}", ms[peer] / mine))
    for tag, peer, mine in [("", "sdpa-cudnn, no mask, fwd+bwd", "ours, none padded (all 512), fwd+bwd"),
                            (" + dropout 0.1", "sdpa-cudnn + dropout 0.1, no mask, fwd+bwd",
                             "ours + dropout 0.1, none padded (all 512), fwd+bwd")]:
        if peer in ms:
            rows.append(ratio_row(f"equal work (all 512, none padded){tag}: ours over sdpa-cudnn, fwd+bwd",
                                  ms[peer] / ms[mine], "> 1: ours is faster" + ("; target >= 1" if not tag else "")))
    for d in head_dims:
        q, k, v, do, pad = make_inputs(d=d, lengths="mixed")
        rows += timing_rows(f"d{d}: ours, lengths U[256,512],",
                            time_passes(ours(pad), q, k, v, do, ("fwd", "fwd+bwd")), forward_flops(B, H, S, d))
        rows += timing_rows(f"d{d}: sdpa-efficient + mask,", time_passes(
            sdpa(SDPBackend.EFFICIENT_ATTENTION, pad), q, k, v, do, ("fwd+bwd",)), forward_flops(B, H, S, d))
    return rows + base_shape_rows()


def sweep_short(dropout_p=0.0):
    """Time every short-backward tile at BERT-base's shape (no padding) next to the dq + dkdv pair."""
    from minibert.kernels.flash_attention import attention_forward
    from minibert.kernels.flash_attention_bwd import backward_into, launch_short
    from minibert.kernels.flash_tiles import TILE_CANDIDATES, pick_tiles
    if not torch.cuda.is_available():
        raise UsageError("bench/attention_bench.py --sweep-short needs a CUDA GPU")
    q, k, v, do, _ = make_inputs(*BASE, lengths="none")
    tiles, scale, seed = pick_tiles(BASE[3], q.dtype), BASE[3] ** -0.5, 1234
    out, lse = attention_forward(q, k, v, None, None, scale, dropout_p, seed, tiles[0])
    grads = [torch.empty_like(q) for _ in range(3)]
    pair = (*tiles[:3], None)
    backward_into(do, q, k, v, out, lse, *grads, None, None, scale, dropout_p, seed, pair)
    expected = [g.clone() for g in grads]
    pair_ms = graph_ms(lambda: backward_into(do, q, k, v, out, lse, *grads, None, None, scale, dropout_p, seed, pair))
    print(f"b256 h12 s128 d64 dropout {dropout_p}: dq + dkdv kernels {pair_ms * 1e3:7.1f} us")
    for tile in TILE_CANDIDATES[64]["short"]:
        try:
            for g in grads:
                g.zero_()
            launch_short(do, q, k, v, out, lse, *grads, None, None, scale, dropout_p, seed, tile)
            err = max(((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
                      for g, e in zip(grads, expected))
            ms = graph_ms(lambda: launch_short(do, q, k, v, out, lse, *grads, None, None, scale, dropout_p, seed, tile))
        except Exception as e:  # e.g. out of shared memory on this GPU
            print(f"  short {tuple(tile)}: failed: {type(e).__name__}: {str(e)[:80]}")
            continue
        flag = "" if err < 2e-2 else f"  WRONG (error {err:.1e})"
        print(f"  short {tuple(tile)}: {ms * 1e3:7.1f} us ({pair_ms / ms:.2f}x the pair){flag}", flush=True)


def sweep(head_dims=(64,), dropout_p=0.0, lengths="mixed"):
    """Time every candidate tile of each kernel alone (lengths U[256,512], or all 512 with lengths="none");
    print the best per kernel. With dropout_p > 0 every kernel draws the dropout mask (one seed)."""
    from minibert.kernels.flash_attention import attention_forward, prepare_padding
    from minibert.kernels.flash_attention_bwd import launch_dkdv, launch_dq
    from minibert.kernels.flash_tiles import TILE_CANDIDATES, head_dim_block, pick_tiles
    if not torch.cuda.is_available():
        raise UsageError("bench/attention_bench.py --sweep needs a CUDA GPU")
    for d in head_dims:
        q, k, v, do, pad = make_inputs(d=d, lengths=lengths)
        bias, kv_len = prepare_padding(pad)
        scale = d ** -0.5
        default_fwd, default_dq, default_dkdv, _ = pick_tiles(d, q.dtype, S)
        p, seed = dropout_p, 1234
        out, lse = attention_forward(q, k, v, bias, kv_len, scale, p, seed, default_fwd)
        delta = torch.empty_like(lse)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        launch_dq(do, q, k, v, out, lse, delta, dq, bias, kv_len, scale, p, seed, default_dq)
        launch_dkdv(do, q, k, v, lse, delta, dk, dv, bias, kv_len, scale, p, seed, default_dkdv)
        o2 = torch.empty_like(out)                            # the sweep's forward writes here
        real = (~pad)[:, None, :, None]                       # compare real query (and key) rows only
        kernels = {  # name: (launch(tile), the tensors it writes, their values with the default tiles)
            "forward": (lambda t: attention_forward(q, k, v, bias, kv_len, scale, p, seed, t, out=o2),
                        [o2], [out.clone()]),
            "dq": (lambda t: launch_dq(do, q, k, v, out, lse, delta, dq, bias, kv_len, scale, p, seed, t),
                   [dq], [dq.clone()]),
            "dkdv": (lambda t: launch_dkdv(do, q, k, v, lse, delta, dk, dv, bias, kv_len, scale, p, seed, t),
                     [dk, dv], [dk.clone(), dv.clone()]),
        }
        best = {}
        for kernel, (launch, outputs, expected) in kernels.items():
            results = []
            for tile in TILE_CANDIDATES[max(64, head_dim_block(d))][kernel]:
                try:
                    for t in outputs:
                        t.zero_()
                    launch(tile)
                    err = max(((t.float() - e.float()) * real).abs().max().item()   # padded rows are
                              / (e.float() * real).abs().max().item()              # unspecified
                              for t, e in zip(outputs, expected))
                    ms = graph_ms(lambda: launch(tile))
                except Exception as e:                        # e.g. out of shared memory on this GPU
                    print(f"d{d} {kernel:8s} {tuple(tile)}: failed: {type(e).__name__}: {str(e)[:80]}")
                    continue
                flag = "" if err < 2e-2 else f"  WRONG (error {err:.1e})"
                print(f"d{d} {kernel:8s} {tuple(tile)}: {ms * 1e3:7.1f} us{flag}", flush=True)
                if not flag:
                    results.append((ms, tile))
            best[kernel] = min(results)
        total = sum(ms for ms, _ in best.values())
        print(f"d{d} dropout {p} best: "
              + ", ".join(f"{k}={tuple(t)} {ms * 1e3:.1f} us" for k, (ms, t) in best.items())
              + f"; the three kernels {total:.3f} ms = "
              f"{3.5 * forward_flops(B, H, S, d) / total / 1e9:.0f} TFLOP/s (FA convention, padding counted)")
        print(f"  -> put these first in TILE_CANDIDATES[{max(64, head_dim_block(d))}] in "
              f"minibert/kernels/flash_tiles.py")


def print_table(rows):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}; "
          f"b{B} h{H} s{S} d{D} bf16, FA FLOP convention (padding counted); targets: ours fwd+bwd at "
          f"U[256,512] >= 230 TFLOP/s (<= 0.52 ms), half/none padded >= 1.6x")
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        if r["unit"] == "x":
            print(f"{r['name']:<{width}}  {r['value']:6.2f}x  {r['notes']}")
        else:
            print(f"{r['name']:<{width}}  {r['value']:6.1f} TFLOP/s  {r['ms']:7.3f} ms")


@exit_on_usage_error
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile per kernel")
    parser.add_argument("--sweep-short", action="store_true", help="time every short-backward tile (BERT-base)")
    parser.add_argument("--dropout", type=float, default=0.0, help="attention dropout for --sweep(-short)")
    parser.add_argument("--lengths", choices=("mixed", "none"), default="mixed",
                        help="--sweep's key lengths: U[256, 512] (mixed) or all 512 (none padded)")
    parser.add_argument("--head-dims", default=None,
                        help="comma-separated head dims (default: 64 for --sweep; 32,80,128 extra rows otherwise)")
    args = parser.parse_args(argv)
    dims = tuple(int(x) for x in args.head_dims.split(",")) if args.head_dims else None
    if args.sweep_short:
        sweep_short(args.dropout)
    elif args.sweep:
        sweep(dims or (64,), args.dropout, args.lengths)
    else:
        print_table(run(dims if dims is not None else (32, 80, 128)))


if __name__ == "__main__":
    main()
