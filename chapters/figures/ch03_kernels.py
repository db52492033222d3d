"""Chapter 3's figures: where attention's bytes go, how the Triton kernels cut the work into programs and
tiles, what the flash kernels skip on a real micro-batch, and how they measured.

Everything is drawn from minibert's own code (the model's attention on meta tensors, the softmax kernel's
default tile, flash_tiles.py's block sizes, the dropout hash's plain-torch twin, the data pipeline's sample
index over the default corpus) or from the committed benchmark results (BENCHMARKS.md). No kernel runs."""
import functools
import math
import pathlib
import re

import matplotlib.patches as mpatches
import numpy as np
import torch
from matplotlib.colors import to_rgb
from style import COLORS, figure, save

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

# BERT-large's attention (minibert.config.PRESETS["340m"]: 16 heads of 1024 / 16 = 64) at the benchmarks'
# micro-batch of 32
B, HEADS, S, D = 32, 16, 512, 64
# The H200's measured rates (docs/measuring.md): a large bf16 matmul, and a device copy (read + write)
MATMUL_FLOPS, COPY_BYTES = 790e12, 4.14e12

# The tiles the GPU runs at d <= 64 in 16-bit (flash_tiles.pick_tiles, read here without its interpreter
# branch, so that drawing under TRITON_INTERPRET=1 shows the GPU's tiles too)


def gpu_tiles(seq_len):
    from minibert.kernels.flash_tiles import LONG_FORWARD, LONG_SEQUENCE, TILE_CANDIDATES
    tiles = TILE_CANDIDATES[64]
    forward = LONG_FORWARD[64] if seq_len >= LONG_SEQUENCE else tiles["forward"][0]
    return forward, tiles["dq"][0], tiles["dkdv"][0]


# ---------------------------------------------------------------------------------------------------------
# 1. Bytes moved by one attention forward, per backend
# ---------------------------------------------------------------------------------------------------------
def local_forward_ops():
    """[(aten op, bytes read, bytes written)] of the local backend's forward at BERT-large's shape, counted
    on meta tensors (shapes only, no memory, no math)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from minibert.model.attention import attention

    def nbytes(tree):
        return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))

    class Traffic(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            views = any(r.alias_info for r in func._schema.returns)
            if name not in ("_unsafe_view", "empty_like", "new_empty_strided") and not views:
                self.ops.append((name, nbytes((args, kwargs)), nbytes(out)))
            return out

    q, k, v = (torch.empty(B, HEADS, S, D, device="meta", dtype=torch.bfloat16) for _ in range(3))
    pad = torch.zeros(B, S, device="meta", dtype=torch.bool)
    with Traffic() as traffic:
        attention(q, k, v, pad, backend="local")
    return traffic.ops


def draw_bytes(path):
    ops = local_forward_ops()
    local = sum(r + w for _, r, w in ops)
    matmuls = sum(r + w for name, r, w in ops if name == "bmm")
    scores = B * HEADS * S * S * 2                          # one bf16 s x s tensor
    fused = matmuls + 2 * scores                            # the softmax kernel: read S once, write P once
    flash = 4 * B * HEADS * S * D * 2 + B * HEADS * S * 4   # q, k, v read, out written, one fp32 lse a row
    flops = 4 * B * HEADS * S * S * D
    covered = flops / MATMUL_FLOPS * COPY_BYTES             # bytes a copy moves while the matmuls run

    fig, ax = figure(3.0)
    names = ["local\n(7 PyTorch ops)", "fused\n(matmul, softmax\nkernel, matmul)", "flash\n(one kernel)"]
    values = [local / 1e9, fused / 1e9, flash / 1e9]
    colors = [COLORS["idle"], COLORS["backward"], COLORS["communication"]]
    bars = ax.barh(names[::-1], values[::-1], color=colors[::-1], height=0.55)
    for bar, value in zip(bars, values[::-1]):
        ms = value * 1e9 / COPY_BYTES * 1e3
        ax.text(max(bar.get_width(), covered / 1e9) + 0.08, bar.get_y() + bar.get_height() / 2,
                f"{value:.2f} GB: {ms:.2f} ms at a copy's rate", va="center", fontsize=9)
    ax.axvline(covered / 1e9, color="black", ls="--", lw=1)
    ax.text(covered / 1e9 + 0.08, 2.45, f"{covered / 1e9:.2f} GB: what a copy moves while the two matmuls "
            f"run ({flops / MATMUL_FLOPS * 1e3:.3f} ms at 790 TFLOP/s)", fontsize=9)
    ax.set_xlim(0, 8.2)
    ax.set_ylim(-0.5, 2.75)
    ax.set_xlabel("GB read + written by one attention forward")
    ax.set_title("BERT-large's attention, b32 h16 s512 d64 bf16; rates of an H200 (docs/measuring.md)",
                 fontsize=10)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 2. The Triton programming model, on the softmax kernel
# ---------------------------------------------------------------------------------------------------------
def draw_softmax_tiles(path):
    from minibert.kernels.softmax import default_config
    sk, real = 384, 300                                     # keys per row; keys 300..383 are padding
    config = default_config(sk)                             # rows per program and warps, as the launcher picks
    block = 1 << (sk - 1).bit_length()                      # triton.next_power_of_2(sk)
    programs = 3
    n_rows = programs * config.rows
    fig, ax = figure(3.0)
    for r in range(n_rows):
        ax.add_patch(mpatches.Rectangle((0, r), real, 1, color=COLORS["forward"], alpha=0.55, lw=0))
        ax.add_patch(mpatches.Rectangle((real, r), sk - real, 1, color=COLORS["memory"], alpha=0.45, lw=0))
        ax.add_patch(mpatches.Rectangle((sk, r), block - sk, 1, facecolor="white", edgecolor=COLORS["neutral"],
                                        hatch="///", lw=0))
    for r in range(n_rows):
        ax.plot([0, block], [r, r], color="white", lw=0.8)
    for p in range(programs + 1):
        ax.plot([0, block], [p * config.rows] * 2, color="black", lw=1.6)
    for p in range(programs):
        ax.text(-8, p * config.rows + config.rows / 2, f"program {p}\nrows {p * config.rows}-"
                f"{(p + 1) * config.rows - 1}", ha="right", va="center", fontsize=9)
    ax.axvline(sk, color="black", lw=1, ls=":")
    ax.text(real / 2, -0.55, "real keys: z = x * scale * log2(e)", ha="center", fontsize=9)
    ax.text(real + (sk - real) / 2, -0.55, "padding: -inf", ha="center", fontsize=9)
    ax.text(sk + (block - sk) / 2, -0.55, "cols >= sk: masked", ha="center", fontsize=9)
    ax.set_xlim(-150, block + 4)
    ax.set_ylim(n_rows + 0.2, -1.2)
    ax.set_xticks([0, real, sk, block])
    ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    ax.set_xlabel("key column of the [b*heads*sq, sk] view: cols = tl.arange(0, BLOCK), loaded where cols < sk")
    ax.set_title(f"sk = {sk}: default_config gives one program per [ROWS = {config.rows}, BLOCK = {block}] "
                 f"tile, {config.num_warps} warps each", fontsize=10)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 3. Flash attention's forward: tiles, programs, and the online softmax along one row
# ---------------------------------------------------------------------------------------------------------
def grid_axes(ax, s, title):
    ax.set_xlim(0, s)
    ax.set_ylim(s, 0)
    ax.set_aspect("equal")
    ax.set_xticks([0, s // 2, s])
    ax.set_yticks([0, s])
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    ax.set_title(title, fontsize=10)


def draw_flash_tiling(path):
    tile = gpu_tiles(S)[0]
    bm, bn = tile.block_m, tile.block_n
    fig, (ax, ax_m, ax_l) = figure(3.6, ncols=3, gridspec_kw={"width_ratios": [1.25, 1, 1]})
    grid_axes(ax, S, f"tile {bm} x {bn}: program p owns\nquery rows {bm}p to {bm}p+{bm - 1}")
    shades = [COLORS["forward"], COLORS["backward"], COLORS["communication"], COLORS["memory"]]
    for p in range(S // bm):
        ax.add_patch(mpatches.Rectangle((0, p * bm), S, bm, color=shades[p % 4], alpha=0.22, lw=0))
        ax.text(-14, p * bm + bm / 2, f"p{p}", ha="right", va="center", fontsize=9)
    for x in range(0, S + 1, bn):
        ax.plot([x, x], [0, S], color="white", lw=0.8)
    for y in range(0, S + 1, bm):
        ax.plot([0, S], [y, y], color="black", lw=1.2)
    p = 1                                                   # one program's sweep over the key tiles
    for j in range(S // bn):
        ax.add_patch(mpatches.Rectangle((j * bn + 3, p * bm + 3), bn - 6, bm - 6, facecolor="none",
                                        edgecolor="black", lw=1))
        ax.text(j * bn + bn / 2, p * bm + bm / 2, str(j), ha="center", va="center", fontsize=9)
    ax.annotate("", xy=(S - 8, p * bm - 14), xytext=(8, p * bm - 14),
                arrowprops={"arrowstyle": "->", "lw": 1.3})

    # the running max and sum of one query row as the key tiles go by (base 2, as the kernel keeps them)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(D, generator=g), torch.randn(S, D, generator=g)
    z = (k @ q / math.sqrt(D) * math.log2(math.e)).double()
    m, l, ms, ls = -math.inf, 0.0, [], []
    for j in range(S // bn):
        block = z[j * bn:(j + 1) * bn]
        m_new = max(m, float(block.max()))
        l = l * 2 ** (m - m_new) + float(torch.exp2(block - m_new).sum())
        m = m_new
        ms.append(m)
        ls.append(l)
    tiles = np.arange(S // bn)
    ax_m.step(tiles, ms, where="post", color=COLORS["forward"], marker="o")
    ax_m.axhline(float(z.max()), color="black", ls="--", lw=1)
    ax_m.set_title("row max m so far\n(dashed: the whole row's)", fontsize=10)
    ax_m.set_xlabel(f"key tiles seen ({bn} keys each)")
    ax_l.plot(tiles, ls, color=COLORS["backward"], marker="o")
    ax_l.axhline(float(torch.exp2(z - z.max()).sum()), color="black", ls="--", lw=1)
    ax_l.set_title("l = sum of 2^(z - m) so far\n(dashed: the whole row's)", fontsize=10)
    ax_l.set_xlabel(f"key tiles seen ({bn} keys each)")
    for a in (ax_m, ax_l):
        a.set_xticks(tiles)
    save(fig, path)


def draw_backward_tiles(path):
    _, dq, dkdv = gpu_tiles(S)
    fig, (ax_q, ax_k) = figure(3.9, ncols=2)
    grid_axes(ax_q, S, f"dq kernel, tile {dq.block_m} x {dq.block_n}: a program owns\n"
                       f"{dq.block_m} queries, loops over key tiles")
    grid_axes(ax_k, S, f"dkdv kernel, tile {dkdv.block_m} x {dkdv.block_n}: a program owns\n"
                       f"{dkdv.block_n} keys, loops over query tiles")
    row = 2 * dq.block_m
    ax_q.add_patch(mpatches.Rectangle((0, row), S, dq.block_m, color=COLORS["forward"], alpha=0.45, lw=0))
    for x in range(0, S + 1, dq.block_n):
        ax_q.plot([x, x], [row, row + dq.block_m], color="white", lw=0.8)
    ax_q.annotate("", xy=(S - 8, row - 12), xytext=(8, row - 12), arrowprops={"arrowstyle": "->", "lw": 1.3})
    ax_q.text(S / 2, row + dq.block_m + 40, "writes its dQ rows, once\n(and D = rowsum(dO * O))\n\n"
              "per tile: S = QK^T, dP = dO V^T,\ndQ += dS K (3 matmuls)", ha="center", va="top", fontsize=9)
    col = 3 * dkdv.block_n
    ax_k.add_patch(mpatches.Rectangle((col, 0), dkdv.block_n, S, color=COLORS["backward"], alpha=0.45, lw=0))
    for y in range(0, S + 1, dkdv.block_m):
        ax_k.plot([col, col + dkdv.block_n], [y, y], color="white", lw=0.8)
    ax_k.annotate("", xy=(col - 12, S - 8), xytext=(col - 12, 8), arrowprops={"arrowstyle": "->", "lw": 1.3})
    ax_k.text(col + dkdv.block_n + 12, S / 2, "writes its dK, dV\nrows, once\n\nper tile: S^T, dP^T,\n"
              "dV += P^T dO,\ndK += dS^T Q\n(4 matmuls)", ha="left", va="center", fontsize=9,
              bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.9})
    for a in (ax_q, ax_k):
        for t in range(0, S + 1, 64):
            a.plot([t, t], [0, S], color=COLORS["neutral"], lw=0.3)
            a.plot([0, S], [t, t], color=COLORS["neutral"], lw=0.3)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 4. Padding: what the flash forward computes and skips on a real micro-batch
# ---------------------------------------------------------------------------------------------------------
@functools.cache
def default_corpus_lengths(samples=32, seq_length=512, seed=1234):
    """Real tokens of the first `samples` samples of the train split's index over the default corpus (one
    epoch, --split 969,30,1, the sentence-order head on): the lengths BertMaskedLMDataset gives them, from
    the sentence lengths preprocess.py would write, without writing any file."""
    from minibert.data.corpus import default_corpus_documents
    from minibert.data.sample_index import build_sample_index, split_document_ranges
    from minibert.data.sentence_split import split_sentences
    from minibert.data.tokenizer import build_tokenizer

    documents = default_corpus_documents()
    tokenizer = build_tokenizer("BertWordPieceLowerCase", str(ROOT / "minibert/vocab/bert-base-uncased-vocab.txt"))
    sizes, bounds = [], [0]
    for document in documents:
        sizes += [len(ids) for ids in map(tokenizer.tokenize, split_sentences(document)) if ids]
        bounds.append(len(sizes))
    sizes, bounds = np.array(sizes, dtype=np.int32), np.array(bounds, dtype=np.int64)
    begin, end = split_document_ranges("969,30,1", len(documents))[0]
    rows = build_sample_index(bounds[begin:end + 1], sizes, num_samples=samples, seq_length=seq_length,
                              short_seq_prob=0.1, seed=seed, min_sentences=2)
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    # [CLS] A [SEP] B [SEP]: the sentences' tokens, cut to the row's target, plus 3
    return tuple(int(min(cum[e] - cum[f], target)) + 3 for f, e, target in rows[:samples])


def tile_states(length, s, tile):
    """[query blocks, key blocks] of the forward on one right-padded sample: 0 skipped (never loaded),
    1 computed without the bias, 2 computed with the padding bias (the block that holds the last key)."""
    nm, nn = -(-s // tile.block_m), -(-s // tile.block_n)
    states = np.zeros((nm, nn), dtype=int)
    for i in range(nm):
        if i * tile.block_m >= length:                     # the program writes zeros and returns
            continue
        for j in range(nn):
            if j * tile.block_n < length:                   # the loop runs to kv_len
                states[i, j] = 2 if j * tile.block_n + tile.block_n > length else 1
    return states


def draw_padding_skipped(path):
    lengths = default_corpus_lengths()
    tile = gpu_tiles(S)[0]
    states = [tile_states(n, S, tile) for n in lengths]
    picks = [int(np.argsort(lengths)[len(lengths) // 2]), int(np.argsort(lengths)[-3]), int(np.argmax(lengths))]
    fig = figure(3.0)[0]
    fig.clf()
    grid = fig.add_gridspec(1, 5, width_ratios=[1, 1, 1, 0.08, 1.5])
    cmap = [np.array(to_rgb(c)) for c in ("#EEEEEE", COLORS["forward"], COLORS["backward"])]
    for col, i in enumerate(picks):
        ax = fig.add_subplot(grid[0, col])
        image = np.stack([[cmap[v] for v in row] for row in states[i]])
        ax.imshow(image, extent=(0, S, S, 0), interpolation="nearest")
        for x in range(0, S + 1, tile.block_n):
            ax.plot([x, x], [0, S], color="white", lw=1)
        for y in range(0, S + 1, tile.block_m):
            ax.plot([0, S], [y, y], color="white", lw=2)
        ax.plot([lengths[i]] * 2, [0, S], color="black", lw=1, ls=":")
        ax.plot([0, S], [lengths[i]] * 2, color="black", lw=1, ls=":")
        ax.set_xlim(0, S)
        ax.set_ylim(S, 0)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"sample {i}:\n{lengths[i]} real tokens", fontsize=9)
        ax.set_xlabel("keys", fontsize=9)
        if col == 0:
            ax.set_ylabel("queries", fontsize=9)
    ax = fig.add_subplot(grid[0, 4])
    order = np.argsort(lengths)
    computed = np.array([(states[i] > 0).sum() for i in order])
    biased = np.array([(states[i] == 2).sum() for i in order])
    total = states[0].size
    x = np.arange(len(lengths))
    ax.bar(x, computed - biased, color=COLORS["forward"], label="computed")
    ax.bar(x, biased, bottom=computed - biased, color=COLORS["backward"], label="computed + bias")
    ax.bar([0], [0], color="#EEEEEE", label="skipped")
    done = sum(int((s > 0).sum()) for s in states)
    ax.set_title(f"{len(lengths)} samples, by length:\n{done} of {total * len(lengths)} tiles "
                 f"({done / (total * len(lengths)):.0%})", fontsize=9)
    ax.set_ylabel(f"tiles computed (of {total})")
    ax.set_xticks([])
    ax.set_xlabel("sample")
    ax.set_ylim(0, total)
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 5. Dropout: one mask, whatever the tile
# ---------------------------------------------------------------------------------------------------------
def draw_dropout_mask(path):
    from minibert.kernels.dropout import effective_dropout_p, reference_keep_mask
    s, seed, p = 64, 1234, 0.1
    keep = reference_keep_mask(seed, 0, s, s, p).numpy()   # stream 0: batch 0, head 0
    fig, (ax_f, ax_k) = figure(3.9, ncols=2)
    for ax, mask, (rows, cols), title in (
            (ax_f, keep, (16, 32), "forward and dq: [queries, keys] tiles (16 x 32 here)"),
            (ax_k, keep.T, (32, 16), "dkdv: [keys, queries] tiles, the same bits transposed")):
        ax.imshow(~mask, cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest")
        for y in np.arange(0, s + 1, rows) - 0.5:
            ax.axhline(y, color=COLORS["forward"], lw=1.2)
        for x in np.arange(0, s + 1, cols) - 0.5:
            ax.axvline(x, color=COLORS["forward"], lw=1.2)
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    q, k = (int(v[0]) for v in np.nonzero(~keep[20:, 40:]))   # one dropped element, circled in both
    q, k = q + 20, k + 40
    ax_f.add_patch(mpatches.Circle((k, q), 2.2, fill=False, color=COLORS["idle"], lw=2))
    ax_k.add_patch(mpatches.Circle((q, k), 2.2, fill=False, color=COLORS["idle"], lw=2))
    ax_f.set_ylabel("query")
    ax_f.set_xlabel("key")
    ax_k.set_ylabel("key")
    ax_k.set_xlabel("query")
    fig.suptitle(f"seed {seed}, head 0, p = {p}: dark = dropped ({(~keep).mean():.1%} of {keep.size}; "
                 f"the rate is {effective_dropout_p(p):.10f})", fontsize=10)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 6. Varlen: the same micro-batch, padded and packed
# ---------------------------------------------------------------------------------------------------------
def draw_varlen(path):
    lengths = default_corpus_lengths()[:8]
    fig, (ax_p, ax_v) = figure(3.3, nrows=2, gridspec_kw={"height_ratios": [1.6, 0.55]})
    for i, n in enumerate(lengths):
        ax_p.barh(i, n, color=COLORS["forward"], height=0.8)
        ax_p.barh(i, S - n, left=n, color="#EEEEEE", height=0.8)
        ax_p.text(n + 4, i, str(n), va="center", fontsize=8)
    ax_p.set_ylim(len(lengths) - 0.5, -0.5)
    ax_p.set_xlim(0, S)
    ax_p.set_yticks(range(len(lengths)))
    ax_p.set_ylabel("sample")
    ax_p.set_title(f"padded [b = {len(lengths)}, s = {S}]: {sum(lengths)} real tokens of "
                   f"{len(lengths) * S} positions", fontsize=10)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    shades = [COLORS["forward"], COLORS["communication"]]
    for i in range(len(lengths)):
        ax_v.barh(0, lengths[i], left=cu[i], color=shades[i % 2], height=0.8)
    ax_v.set_xlim(0, S)
    ax_v.set_yticks([])
    ax_v.set_xticks(cu)
    ax_v.tick_params(axis="x", labelsize=8)
    ax_v.set_xlabel(f"packed rows [n = {cu[-1]}, ...]; the ticks are cu_seqlens")
    save(fig, path)


# ---------------------------------------------------------------------------------------------------------
# 7. The benchmark: ours and SDPA, fwd+bwd, from BENCHMARKS.md
# ---------------------------------------------------------------------------------------------------------
def benchmark_rows():
    """{measurement: ms} of the flash attention table in BENCHMARKS.md, and the device line."""
    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    device = re.search(r"^- device: (.+)$", text, re.MULTILINE)[1]
    section = text.split("## Flash attention", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for m in re.finditer(r"^\| (.+?) \| [\d.]+ \| TFLOP/s \| ([\d.]+) ms", section, re.MULTILINE):
        rows[m[1]] = float(m[2])
    return rows, device


def draw_flash_bench(path):
    rows, device = benchmark_rows()
    cases = ["none padded (all 512)", "lengths U[256,512]", "half padded (all 256)"]
    ours = [rows[f"ours, {c}, fwd+bwd"] for c in cases]
    sdpa = [rows[f"sdpa-efficient + mask, {c}, fwd+bwd"] for c in cases]
    fig, ax = figure(3.0)
    x = np.arange(len(cases))
    for offset, values, color, label in ((-0.2, ours, COLORS["communication"], "ours (flash, Triton)"),
                                         (0.2, sdpa, COLORS["idle"], "SDPA memory-efficient + the mask")):
        bars = ax.bar(x + offset, values, width=0.38, color=color, label=label)
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value + 0.02, f"{value:.3f}", ha="center", fontsize=8)
    for name, ls in (("sdpa-cudnn, no mask, fwd+bwd", "--"), ("sdpa-flash, no mask, fwd+bwd", ":")):
        ax.axhline(rows[name], color="black", ls=ls, lw=1)
        ax.text(2.45, rows[name] + 0.02, name.replace(", fwd+bwd", ",\nevery key computed"), fontsize=8,
                va="bottom")
    ax.set_xticks(x)
    ax.set_xticklabels(["every key real", "lengths U[256, 512]", "half padded"])
    ax.set_xlim(-0.5, 3.3)
    ax.set_ylabel("fwd+bwd, ms")
    ax.set_title(f"b32 h16 s512 d64 bf16 on an {device.split(' (')[0]}, CUDA-graph replays (BENCHMARKS.md)",
                 fontsize=10)
    ax.set_ylim(0, max(sdpa) * 1.35)
    ax.legend(loc="upper left", ncol=2, fontsize=8)
    save(fig, path)


FIGURES = {
    "ch03_bytes": draw_bytes,
    "ch03_softmax_tiles": draw_softmax_tiles,
    "ch03_flash_tiling": draw_flash_tiling,
    "ch03_backward_tiles": draw_backward_tiles,
    "ch03_padding_skipped": draw_padding_skipped,
    "ch03_dropout_mask": draw_dropout_mask,
    "ch03_varlen": draw_varlen,
    "ch03_flash_bench": draw_flash_bench,
}
