"""Chapter 8's FP8 picture: what e4m3 and e5m2 can hold, and why each tensor gets a scale.

Drawn from torch's own FP8 types (every one of the 256 bit patterns, decoded) and minibert.fast.fp8's
scale rule; nothing here needs a GPU."""
import numpy as np
import torch
from style import COLORS, figure, save

from minibert.fast.fp8 import E4M3, E5M2, FP8_MAX, quantize, scale_from_amax


def positive_values(dtype):
    """Every finite positive value of an FP8 type, ascending."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    return np.unique(values[torch.isfinite(values) & (values > 0)].numpy())


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
    top.set_yticks([])
    top.set_ylim(-0.4, 2.0)
    top.set_xlim(-18, 18)
    top.set_xticks(range(-16, 17, 4))
    top.set_xticklabels([f"2^{k}" for k in range(-16, 17, 4)])
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
    bottom.set_yticks([])
    bottom.set_xlim(-34, 18)
    bottom.set_ylim(-0.1, 2.05)
    bottom.set_xticks(range(-32, 17, 8))
    bottom.set_xticklabels([f"2^{k}" for k in range(-32, 17, 8)])
    bottom.set_xlabel("|value| (shaded band: what the format holds)")
    save(fig, path)


FIGURES = {"ch08_fp8_formats": draw_formats}
