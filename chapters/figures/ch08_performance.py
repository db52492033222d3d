"""Chapter 8's pictures: where a training step's work and time go, and what each speed lever changes.

Drawn from minibert's own code (the FLOP formula of minibert/training/training_log.py, the data pipeline
and packing of minibert/data/, the byte counts in the docstrings of minibert/fast/cross_entropy.py and
minibert/fast/adamw.py) and from committed results: BENCHMARKS.md (`make bench` on one H200) and
bench/results/profile_steps_hash_h200_2026-12-02.md (a BERT-large step's kernels by family). Nothing here needs a GPU."""
import os
import pathlib
import re
import tempfile

import numpy as np
import torch
from matplotlib.patches import Rectangle
from style import COLORS, figure, save

from minibert.config import Config
from minibert.training.training_log import model_flops

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
VOCAB = "minibert/vocab/bert-base-uncased-vocab.txt"
SHAPES = {"BERT-base, s = 128": dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=128),
          "BERT-large, s = 512": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512)}
LIGHT = "#E6E6E6"


def config(shape):
    return Config(**shape, max_position_embeddings=512, vocab_file=str(ROOT / VOCAB))


def benchmarks_row(name):
    """(value, notes) of the row of BENCHMARKS.md whose measurement is `name`."""
    for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").split("\n"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] == name:
            return float(cells[1].replace(",", "")), cells[3]
    raise KeyError(f"BENCHMARKS.md has no row {name!r}")


def ms_per_step(name):
    """The ms per step BENCHMARKS.md notes beside a throughput row ('96.0 ms/step, ...')."""
    return float(re.search(r"([\d.]+) ms/step", benchmarks_row(name)[1])[1])


# ---------------------------------------------------------------------------------------------------
def draw_flops(path):
    """Model FLOPs per token, term by term, for BERT-base at s = 128 and BERT-large at s = 512."""
    terms = [("Linears of the layers, 72·l·h²", COLORS["forward"]),
             ("attention scores and sums, 12·l·s·h", COLORS["highlight"]),
             ("LM head, 6·(h·V + h²)", COLORS["backward"])]
    fig, ax = figure(2.2)
    for y, (name, shape) in enumerate(SHAPES.items()):
        cfg = config(shape)
        l, h, s, v = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.padded_vocab_size
        values = [72 * l * h * h, 12 * l * s * h, 6 * (h * v + h * h)]
        one = torch.full((1,), float(s), dtype=torch.float64)  # one full-length sample: the same sum
        assert abs(sum(values) * s - model_flops(cfg, one, head_positions=float(s))) < 1e-6 * sum(values) * s
        left = 0.0
        for value, (label, color) in zip(values, terms):
            gflop = value / 1e9
            ax.barh(y, gflop, left=left, color=color, edgecolor="white", label=label if y == 0 else None)
            if gflop / (sum(values) / 1e9) > 0.05:
                ax.text(left + gflop / 2, y, f"{value / sum(values):.0%}", ha="center", va="center",
                        color="white", fontsize=9)
            left += gflop
        ax.text(left + 0.02, y, f"{left:.2f} GFLOP per token", va="center", fontsize=9)
    ax.set_yticks(range(len(SHAPES)), list(SHAPES))
    ax.set_xlabel("GFLOP per token, forward + backward (docs/measuring.md's formula)")
    ax.set_xlim(0, 2.8)
    ax.legend(loc="lower right", frameon=False, fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------
PROFILE = ROOT / "bench" / "results" / "profile_steps_hash_h200_2026-12-02.md"
FAMILIES = [("matrix multiplies", ("matrix multiplies",), COLORS["forward"]),
            ("attention", ("attention", "softmax"), COLORS["highlight"]),
            ("GeLU, adds, dropout (Inductor's fused kernels in HF compiled)",
             ("elementwise", "compiled (Inductor's Triton kernels)"), COLORS["backward"]),
            ("LayerNorm", ("LayerNorm",), COLORS["memory"]),
            ("optimizer", ("optimizer (AdamW, grad norm)",), COLORS["communication"]),
            ("copies, reductions, loss, other", ("copies and indexing", "reductions", "cross entropy", "other"),
             COLORS["neutral"])]


def profile_table():
    """{column: {row: ms}} of the BERT-large table of bench/results/profile_steps_hash_h200_2026-12-02.md."""
    lines = PROFILE.read_text(encoding="utf-8").split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| ms per step"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    table = {column: {} for column in header[1:]}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for column, cell in zip(header[1:], cells[1:]):
            table[column][cells[0]] = float(cell)
    return table


def draw_step_time(path):
    """A BERT-large step's kernel time by family: minibert (eager), HF eager, HF compiled."""
    table = profile_table()
    contenders = ["minibert", "HF eager", "HF compiled"]
    fig, ax = figure(3.3)
    for y, name in enumerate(contenders):
        column, left = table[name], 0.0
        for label, rows, color in FAMILIES:
            ms = sum(column[r] for r in rows)
            ax.barh(y, ms, left=left, color=color, edgecolor="white", label=label if y == 0 else None)
            if ms > 5:
                ax.text(left + ms / 2, y, f"{ms:.1f}", ha="center", va="center", color="white", fontsize=8)
            left += ms
        ax.plot([column["wall clock"]] * 2, [y - 0.4, y + 0.4], color="black", lw=1.5)
        ax.text(column["wall clock"] + 1, y, f"kernels {column['all kernels']:.1f} ms, step {column['wall clock']:.1f} ms",
                va="center", fontsize=8)
    ax.set_yticks(range(len(contenders)), contenders)
    ax.invert_yaxis()
    ax.set_xlim(0, 150)
    ax.set_xlabel("ms per step (BERT-large s512, micro-batch 32, bf16, one H200); black tick: the whole step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3, frameon=False, fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------
def default_corpus_lengths(micro_batch=32, seq=512):
    """Real tokens of the first micro-batch of Megatron's samples from the default corpus, as the trainer
    builds them (minibert.data: the corpus, preprocess, the masked-LM dataset; seed 1234)."""
    from minibert.data import corpus
    from minibert.data.masked_lm import build_train_valid_test_datasets, sample_lengths
    from minibert.data.tokenizer import build_tokenizer
    from minibert.preprocess import preprocess
    with tempfile.TemporaryDirectory() as work:
        text = os.path.join(work, "corpus.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write("".join(d + "\n" for d in corpus.default_corpus_documents()))
        tokenizer = build_tokenizer("BertWordPieceLowerCase")
        prefix = preprocess(text, os.path.join(work, "corpus"), tokenizer, split_sentences=True, workers=1,
                            progress=False)[0]
        train, _, _ = build_train_valid_test_datasets(prefix, tokenizer, split=(969, 30, 1),
                                                      num_samples=(micro_batch, 0, 0), seq_length=seq,
                                                      seed=1234, binary_head=True)
        return sample_lengths(train, micro_batch)


def draw_packing(path):
    """One micro-batch [32, 512] of the default corpus: padded, then packed into rows with cu_seqlens."""
    from minibert.data.packing import make_packing, trimmed_length
    lengths = default_corpus_lengths()
    b, s = len(lengths), 512
    is_pad = torch.arange(s)[None, :] >= torch.as_tensor(lengths)[:, None]
    packing = make_packing(is_pad)
    n, cu = packing.index.numel(), packing.cu_seqlens.tolist()
    fig, (top, bottom) = figure(4.6, gridspec_kw={"height_ratios": [4, 1]}, nrows=2)
    for i, length in enumerate(lengths):
        top.add_patch(Rectangle((0, i), s, 0.85, facecolor=LIGHT, edgecolor="none"))
        top.add_patch(Rectangle((0, i), length, 0.85, facecolor=COLORS["forward"], edgecolor="none"))
    trimmed = trimmed_length(is_pad)
    top.set_xlim(0, s)
    top.set_ylim(b, 0)
    top.set_ylabel("sample")
    top.set_xlabel(f"position (real tokens blue, padding grey; the longest sample keeps all {trimmed})")
    top.set_title(f"padded: [{b}, {s}] = {b * s:,} positions through every Linear, of which "
                  f"{n:,} ({n / (b * s):.0%}) are real tokens", fontsize=10)
    for i in range(b):
        bottom.add_patch(Rectangle((cu[i], 0), cu[i + 1] - cu[i], 1,
                                   facecolor=COLORS["forward"] if i % 2 == 0 else COLORS["data"], edgecolor="none"))
    bottom.add_patch(Rectangle((n, 0), b * s - n, 1, facecolor="none", edgecolor=COLORS["neutral"], ls=":"))
    bottom.text(n + (b * s - n) / 2, 0.5, "no longer computed", ha="center", va="center", color=COLORS["neutral"])
    bottom.set_xlim(0, b * s)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    bottom.set_xlabel(f"packed row (samples alternate colours; cu_seqlens = {cu[:4]} ... {cu[-1]})")
    bottom.set_title(f"packed: [{n:,}, h] rows, sample after sample", fontsize=10)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------
GRAPH_ROWS = [  # (label, eager row, graphs row) of BENCHMARKS.md, each with its ms per step
    ("train-small (l4 h128), fp32",
     "train-small (l4 h128 s128, micro 4, global 16), fp32: ms per iteration, pre-built batches",
     "train-small (l4 h128 s128, micro 4, global 16), --cuda-graph-impl local, fp32: ms per iteration, "
     "pre-built batches"),
    ("BERT-large, default corpus\n(packed, ~2.6k real tokens)",
     "BERT-large s512 b32, Megatron samples, default corpus: minibert packed, real tokens/s",
     "BERT-large s512 b32, Megatron samples, default corpus: minibert packed, CUDA graphs, real tokens/s"),
    ("BERT-base s128 b256", "BERT-base s128 b256 full-length: minibert, seq/s",
     "BERT-base s128 b256 full-length: minibert, CUDA graphs, seq/s"),
    ("BERT-large s512 b32", "BERT-large s512 b32 full-length: minibert, seq/s",
     "BERT-large s512 b32 full-length: minibert, CUDA graphs, seq/s"),
]


def draw_graphs(path):
    """Eager against CUDA graphs, ms per step, from BENCHMARKS.md: the less GPU work a step has, the more
    of it was the host's."""
    fig, ax = figure(3.4)
    for y, (label, eager_row, graph_row) in enumerate(GRAPH_ROWS):
        if "ms per iteration" in eager_row:
            eager, graphs = benchmarks_row(eager_row)[0], benchmarks_row(graph_row)[0]
        else:
            eager, graphs = ms_per_step(eager_row), ms_per_step(graph_row)
        ax.barh(y - 0.2, eager, height=0.38, color=COLORS["idle"], label="eager" if y == 0 else None)
        ax.barh(y + 0.2, graphs, height=0.38, color=COLORS["forward"], label="CUDA graphs" if y == 0 else None)
        ax.text(eager + 1, y - 0.2, f"{eager:.1f} ms", va="center", fontsize=8)
        ax.text(graphs + 1, y + 0.2, f"{graphs:.1f} ms  ({eager / graphs:.2f}x)", va="center", fontsize=8)
    ax.set_yticks(range(len(GRAPH_ROWS)), [r[0] for r in GRAPH_ROWS], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 125)
    ax.set_xlabel("ms per training step (BENCHMARKS.md, one H200)")
    ax.legend(loc="upper right", frameon=False)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------
def stacked(ax, y, parts, total_label):
    left = 0.0
    for width, label, color in parts:
        ax.barh(y, width, left=left, color=color, edgecolor="white")
        if label:
            ax.text(left + width / 2, y, label, ha="center", va="center", color="white", fontsize=8)
        left += width
    ax.text(left + 0.2, y, total_label, va="center", fontsize=9)


def draw_loss_bytes(path):
    """Bytes the LM loss moves for BERT-large's logits [16384, 30592] bf16 (L = 1 GB), plain against fused:
    the counts of minibert/fast/cross_entropy.py's docstring, one segment per operation."""
    cfg = config(SHAPES["BERT-large, s = 512"])
    gb = 32 * cfg.seq_length * cfg.padded_vocab_size * 2 / 1e9  # L: the bf16 logits of one micro-batch
    fwd, bwd = COLORS["forward"], COLORS["backward"]
    plain = [(3, "cast\n3L", fwd), (4, "log_softmax\n4L", fwd), (2, "nll\n2L", bwd),
             (6, "log_softmax\nbackward 6L", bwd), (3, "cast\n3L", bwd)]
    fused = [(1, "1L", fwd), (2, "2L", bwd)]
    fig, ax = figure(2.5)
    stacked(ax, 0, [(w * gb, t, c) for w, t, c in plain], f"18 L = {18 * gb:.0f} GB")
    stacked(ax, 1, [(w * gb, t, c) for w, t, c in fused], f"3 L = {3 * gb:.0f} GB")
    ax.barh(0, 0, color=fwd, label="forward")
    ax.barh(0, 0, color=bwd, label="backward")
    ax.set_yticks([0, 1], ["plain: .float(),\nF.cross_entropy", "fused: one kernel\neach way"])
    ax.invert_yaxis()
    ax.set_xlim(0, 22 * gb)
    ax.set_xlabel(f"GB read and written per micro-batch (L = the bf16 logits, {gb:.2f} GB)")
    ax.legend(loc="lower right", frameon=False, fontsize=8)
    save(fig, path)


def draw_adamw_bytes(path):
    """Bytes per parameter of one optimizer step: PyTorch's fused AdamW + the copy back, against one kernel
    (the table of minibert/fast/adamw.py's docstring)."""
    read, write = COLORS["forward"], COLORS["backward"]
    plain = [(16, "read p, g, m, v", read), (12, "write p, m, v", write), (4, "g", write),
             (4, "p", read), (2, "", write)]
    fused = [(16, "read p, g, m, v", read), (12, "write p, m, v", write), (2, "", write)]
    fig, ax = figure(2.7)
    stacked(ax, 0, plain, "38 bytes")
    stacked(ax, 1, fused, "30 bytes")
    ax.plot([32, 32, 38, 38], [-0.42, -0.5, -0.5, -0.42], color="black", lw=0.8)
    ax.text(35, -0.56, "the copy back: read p, write the bf16 weight", ha="center", va="bottom", fontsize=8)
    ax.plot([28, 28, 30, 30], [1.42, 1.5, 1.5, 1.42], color="black", lw=0.8)
    ax.text(29, 1.56, "the bf16 weight, written on the way out", ha="center", va="top", fontsize=8)
    ax.barh(0, 0, color=read, label="read")
    ax.barh(0, 0, color=write, label="written")
    ax.set_yticks([0, 1], ["plain: AdamW(fused=True)\n+ copy back", "fused:\nminibert/fast/adamw.py"])
    ax.set_ylim(2.0, -1.0)
    ax.set_xlim(0, 48)
    ax.set_xlabel("bytes per parameter per step (p: fp32 master weight, g: gradient, m, v: moments)")
    ax.legend(loc="lower right", frameon=False, fontsize=8)
    save(fig, path)


# ---------------------------------------------------------------------------------------------------
def draw_residual(path):
    """The kernels around one pre-LN layer's two matmul blocks: plain, fused, and chained into the next layer."""
    rows = [("plain", ["LN1", "@attention", "dropout", "add", "LN2", "@MLP", "dropout", "add", "|", "LN1"]),
            ("--bias-dropout-fusion", ["LN1", "@attention", "dropout\n+ add\n+ LN2", "@MLP", "dropout\n+ add",
                                       "|", "LN1"]),
            ("--bias-dropout-fusion\n--residual-layernorm-\nfusion (the defaults)",
             ["@attention", "dropout\n+ add\n+ LN2", "@MLP", "dropout\n+ add\n+ next LN1", "|"])]
    fig, ax = figure(3.2)
    for y, (label, steps) in enumerate(rows):
        x, memory, next_layer = 0.0, 0, False
        for step in steps:
            if step == "|":  # the layer's edge: what follows is the next layer's
                ax.plot([x + 0.1, x + 0.1], [y - 0.45, y + 0.45], color="black", lw=1, ls="--")
                if y == 0:
                    ax.text(x + 0.3, y - 0.47, "next layer", fontsize=8, va="bottom")
                x, next_layer = x + 0.3, True
                continue
            matmul = step.startswith("@")
            width = 1.7 if matmul else max(1.25, 0.165 * max(len(line) for line in step.split("\n")))
            color = LIGHT if matmul else COLORS["backward"]
            memory += 0 if matmul or next_layer else 1
            ax.add_patch(Rectangle((x, y - 0.36), width, 0.72, facecolor=color, edgecolor="black", lw=0.6))
            ax.text(x + width / 2, y, step.lstrip("@"), ha="center", va="center", fontsize=7.5,
                    color="black" if matmul else "white")
            x += width + 0.12
        ax.text(14.6, y, f"{memory} memory-bound\nkernels per layer", va="center", fontsize=8)
    ax.set_xlim(-0.1, 16.8)
    ax.set_ylim(len(rows) - 0.5, -0.7)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_xticks([])
    ax.set_xlabel("one layer's forward, left to right (grey: matmul blocks; orange: memory-bound kernels)")
    ax.spines["bottom"].set_visible(False)
    save(fig, path)


FIGURES = {"ch08_flops": draw_flops, "ch08_step_time": draw_step_time, "ch08_packing": draw_packing,
           "ch08_graphs": draw_graphs, "ch08_loss_bytes": draw_loss_bytes, "ch08_adamw_bytes": draw_adamw_bytes,
           "ch08_residual": draw_residual}
