"""Chapter 8's FP8 pictures: what e4m3 and e5m2 can hold and why each tensor gets a scale, and where FP8
pays by GEMM size.

Drawn from torch's own FP8 types (every one of the 256 bit patterns, decoded), minibert.fast.fp8's scale
rule, and the committed bench/results/fp8_sweep_* (bench/fp8_bench.py). Nothing here needs a GPU."""
import pathlib

import numpy as np
import torch
from style import COLORS, figure, save

from minibert.fast.fp8 import E4M3, E5M2, FP8_MAX, quantize, scale_from_amax

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def positive_values(dtype):
    """Every finite positive value of an FP8 type, ascending."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return np.unique(values[torch.isfinite(values) & (values > 0)].numpy())


def powers_of_two_axis(ax, xlim, ylim, ticks):
    """An x axis of log2 magnitudes labelled 2^k at `ticks`, and no y axis."""
    ax.set_yticks([])
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"2^{k}" for k in ticks])


def draw_formats(path):
    """Top: each format's positive values on a log2 axis (one tick per value; normal and subnormal
    apart). Bottom: a weight tensor (~0.02) and a gradient tensor (~1e-6) without and with their scales."""
    fig, (top, bottom) = figure(4.8, nrows=2, gridspec_kw={"height_ratios": [1, 1.2]})
    for row, (dtype, name, color) in enumerate([(E4M3, "e4m3", COLORS["forward"]), (E5M2, "e5m2", COLORS["backward"])]):
        values = positive_values(dtype)
        smallest_normal = torch.finfo(dtype).smallest_normal
        y = 1.2 * (1 - row)
        for v in values:
            top.plot([np.log2(v)] * 2, [y - 0.3, y + 0.3], color=color, lw=0.8,
                     alpha=1.0 if v >= smallest_normal else 0.45)
        steps = len(values[(values >= 1) & (values < 2)])
        top.text(-17.5, y + 0.42, f"{name}: up to {FP8_MAX[dtype]:g}, {steps} values per power of 2, "
                 f"down to 2^{int(np.log2(values[0]))}", fontsize=9)
    powers_of_two_axis(top, (-18, 18), (-0.4, 2.0), range(-16, 17, 4))
    top.set_title("The positive values of the two FP8 formats (faint: subnormals, with fewer steps)", fontsize=10)

    g = torch.Generator().manual_seed(0)
    tensors = [("weights (~0.02)", 0.02 * torch.randn(20000, generator=g)),
               ("output gradients (~1e-6)", 1e-6 * torch.randn(20000, generator=g))]
    for row, (name, t) in enumerate(tensors):
        dtype = E4M3 if row == 0 else E5M2
        lost_plain = float((quantize(t, dtype, torch.tensor(1.0)) == 0).float().mean())
        scale = scale_from_amax(t.abs().amax(), dtype)
        lost_scaled = float((quantize(t, dtype, scale) == 0).float().mean())
        magnitudes = np.log2(t.abs().numpy() + 1e-30)
        y = 1.2 * (1 - row)
        low = np.log2(positive_values(dtype)[0])
        bottom.fill_between([low, np.log2(FP8_MAX[dtype])], y, y + 0.5, alpha=0.12,
                            color=COLORS["forward"] if row == 0 else COLORS["backward"], lw=0)
        for shift, color in ((0.0, COLORS["neutral"]), (float(torch.log2(scale)), COLORS["communication"])):
            counts, edges = np.histogram(magnitudes + shift, bins=100, range=(-34, 18))
            bottom.bar(edges[:-1], 0.5 * counts / counts.max(), width=edges[1] - edges[0], bottom=y, align="edge",
                       color=color, alpha=0.75)
        bottom.text(-33.5, y + 0.62, f"{name} in {'e4m3' if row == 0 else 'e5m2'}: unscaled (grey) "
                    f"{100 * lost_plain:.0f}% become 0; times the scale {float(scale):.3g} (green): "
                    f"{100 * lost_scaled:.1f}%", fontsize=9)
    powers_of_two_axis(bottom, (-34, 18), (-0.1, 2.05), range(-32, 17, 8))
    bottom.set_xlabel("|value| (shaded band: what the format holds)")
    save(fig, path)


def result(prefix):
    """The committed bench/results file whose name starts with `prefix` (the newest by name)."""
    found = sorted((ROOT / "bench" / "results").glob(prefix + "*"))
    if not found:
        raise FileNotFoundError(f"no bench/results/{prefix}* file")
    return found[-1]


def sweep_rows():
    """(h, bf16 ms, fp8 products ms, fp8 torch casts ms, fp8 ms) of the fc1 sweep of bench/fp8_bench.py."""
    rows, inside = [], False
    for line in result("fp8_sweep_").read_text(encoding="utf-8").splitlines():
        if line.startswith("###"):  # the first fc1 table only (16,384 tokens)
            inside = line.startswith("### fc1") and not rows
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if inside and len(cells) == 6 and cells[0].isdigit():
            rows.append((int(cells[0]), *map(float, cells[1:5])))
    return rows


HOST_BOUND_MS = 0.7  # launched one call at a time, the FP8 Linear costs the host about this much


def draw_sweep(path):
    """bf16 time / FP8 time of fc1 [h -> 4h] over 16,384 tokens, forward + backward, by hidden size: the
    products alone, with PyTorch casts, with the one-pass casts."""
    rows = sweep_rows()
    h = [r[0] for r in rows]
    fig, ax = figure(3.3)
    for index, label, color in ((2, "FP8 products alone (casts done beforehand)", COLORS["neutral"]),
                                (3, "FP8 with PyTorch casts", COLORS["idle"]),
                                (4, "FP8 with the one-pass casts (minibert)", COLORS["forward"])):
        ax.plot(h, [r[1] / r[index] for r in rows], "-", color=color, label=label)
        for r in rows:  # hollow: an FP8 row under HOST_BOUND_MS times the host's launches, not the GPU
            hollow = index > 2 and r[index] < HOST_BOUND_MS
            ax.plot(r[0], r[1] / r[index], "o", color=color, markerfacecolor="white" if hollow else color)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.text(h[-1], 1.03, "FP8 faster above, slower below", fontsize=8, ha="right")
    ax.set_ylim(0, 3.0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(h)
    ax.set_xticklabels([str(x) for x in h])
    ax.set_xlabel("hidden size h (fc1: [tokens, h] x [h, 4h], forward and backward)")
    ax.set_ylabel("bf16 time / FP8 time")
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncol=2,
              title=f"hollow: an FP8 time under {HOST_BOUND_MS} ms (the host's launches, not the GPU)",
              title_fontsize=8)
    save(fig, path)


def numerics_runs():
    """{run name: (iterations, lm loss, lm acc)} of the committed bench/results/fp8_numerics_* (bench/fp8_steps.py
    numerics): each run's curve is a '### NAME' heading followed by lines 'iteration loss acc'."""
    runs, name = {}, None
    for line in result("fp8_numerics_").read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            name = line[4:].strip()
            runs[name] = ([], [], [])
        elif name and line and line[0].isdigit():
            for series, value in zip(runs[name], line.split()):
                series.append(float(value))
    return runs


def draw_curves(path):
    """lm loss (left) and lm acc (right) of BERT-large over the iterations: bf16 from two seeds (their gap is
    the noise floor), FP8 with each recipe and the broken control, these three from the first seed."""
    runs = numerics_runs()
    styles = {"bf16": (COLORS["neutral"], "-"), "bf16, seed 4321": (COLORS["neutral"], "--"),
              "fp8 delayed": (COLORS["forward"], "-"), "fp8 tensorwise": (COLORS["backward"], "-")}
    fig, (loss_ax, acc_ax) = figure(3.4, ncols=2)
    for name, (iters, loss, acc) in runs.items():
        color, style = styles.get(name, (COLORS["idle"], ":"))  # the control
        loss_ax.plot(iters, loss, style, color=color, lw=1.0, label=name)
        acc_ax.plot(iters, acc, style, color=color, lw=1.0, label=name)
    loss_ax.set_ylabel("lm loss (from 10.3 at the start)")
    loss_ax.set_ylim(4.5, 7.0)
    acc_ax.set_ylabel("lm acc (masked tokens predicted)")
    fig.suptitle("BERT-large, 1,500 iterations of 128 sequences: FP8 ends between the two bf16 seeds,\n"
                 "the broken control stays on the plateau (bench/results/fp8_numerics_*)", fontsize=9)
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("iteration")
    loss_ax.legend(fontsize=8, frameon=False, loc="lower left")
    save(fig, path)


FIGURES = {"ch08_fp8_formats": draw_formats, "ch08_fp8_sweep": draw_sweep, "ch08_fp8_curves": draw_curves}
