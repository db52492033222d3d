"""Chapter 5's pictures: how tensor parallelism cuts the matrices of one layer, and where sequence
parallelism cuts the activations. Every shape comes from minibert itself: the chapter's small model
(2 layers, hidden 64, 4 heads, sequences of 64, micro-batch 2) built on the meta device, and the PLAN table
of minibert/parallel/tensor_parallel.py, which says which of its modules is split which way; TP 2."""
import fnmatch

import torch
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, figure, save

from minibert.config import Config
from minibert.model.bert import BertModel
from minibert.parallel.tensor_parallel import PLAN

TP = 2
RANK = [COLORS["forward"], COLORS["backward"], COLORS["memory"], COLORS["data"]]  # rank 0 blue, rank 1 orange, ...
WHOLE = "#D9D9D9"  # a tensor every rank holds whole (replicated)
COMM = COLORS["communication"]
# The dim of nn.Linear's weight [out, in] that each kind of PLAN entry cuts (mark_sharded in
# minibert/parallel/layers.py): column-parallel the output features (rows of W, columns of A = W^T),
# row-parallel the input features.
SPLIT_DIM = {"column": 0, "row": 1, "vocab": 0}


def small_config():
    return Config(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  global_batch_size=8, train_iters=1, lr=1.0, vocab_size=30524, tensor_model_parallel_size=TP)


def planned_shapes():
    """{module name: (PLAN kind, full weight shape, this rank's shard shape)} for layer 0 of the small model."""
    cfg = small_config()
    with torch.device("meta"):
        model = BertModel(cfg, init=False)
    shapes = {}
    for name, module in model.named_modules():
        kind = next((k for pattern, k in PLAN.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if kind in SPLIT_DIM and not name.startswith("layers.1"):
            full = tuple(module.weight.shape)
            shard = list(full)
            shard[SPLIT_DIM[kind]] //= TP
            shapes[name.replace("layers.0.", "")] = (kind, full, tuple(shard))
    return cfg, shapes


def box(ax, x, y, w, h, color, text=None, edge="black", hatch=None, ls="-", alpha=1.0, fontsize=9, tcolor="white"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, hatch=hatch, linestyle=ls, lw=0.8,
                           alpha=alpha))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=tcolor)


def arrow(ax, x0, x1, y, color="black", text=None, below=None):
    ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=10, color=color, lw=1.2))
    if text:
        ax.text((x0 + x1) / 2, y + 0.35, text, ha="center", va="bottom", fontsize=9, color=color)
    if below:
        ax.text((x0 + x1) / 2, y - 0.35, below, ha="center", va="top", fontsize=8, color=color)


def draw_mlp_split(path):
    """Z = GeLU(X A) B at TP 2: A cut by columns, B by rows, f before and g after."""
    cfg, shapes = planned_shapes()
    tokens, h = cfg.micro_batch_size * cfg.seq_length, cfg.hidden_size  # X is [b*s, h]
    _, (ffn, _), (ffn_r, _) = shapes["mlp.dense_h_to_4h"]  # W [4h, h]: A = W^T is [h, 4h]
    u = 40.0  # numbers per drawing unit
    gap = 2.0
    fig, ax = figure(3.2)

    def matrix(x, rows, cols, split=None, name="", label="", sub=""):
        """A rows x cols matrix at x, centred on 0; split "cols"/"rows" colours rank r's block name_r."""
        w, hgt = cols / u, rows / u
        if split is None:
            box(ax, x, -hgt / 2, w, hgt, WHOLE)
        for r in range(TP if split else 0):
            if split == "cols":
                box(ax, x + r * w / TP, -hgt / 2, w / TP, hgt, RANK[r], f"${name}_{r}$")
            else:
                box(ax, x, -hgt / 2 + (TP - 1 - r) * hgt / TP, w, hgt / TP, RANK[r], f"${name}_{r}$")
        ax.text(x + w / 2, hgt / 2 + 0.12, label, ha="center", va="bottom", fontsize=9)
        ax.text(x + w / 2, -hgt / 2 - 0.12, sub, ha="center", va="top", fontsize=8)
        return x + w

    def step(x, text, color="black"):
        arrow(ax, x + 0.2, x + gap - 0.2, 0, color)
        ax.text(x + gap / 2, 0.12, text, ha="center", va="bottom", fontsize=10 if color == COMM else 9,
                color=color, weight="bold" if color == COMM else "normal")
        return x + gap

    x = matrix(0.0, tokens, h, label="X", sub=f"[{tokens}, {h}]\nwhole on\nevery rank")
    x = matrix(step(x, "f", COMM), h, ffn, "cols", "A", "A = dense_h_to_4h.weightᵀ",
               f"[{h}, {ffn}]\nrank r holds $A_r$ [{h}, {ffn_r}]")
    x = matrix(step(x, "GeLU"), tokens, ffn, "cols", "Y", "Y = GeLU(X A)",
               f"[{tokens}, {ffn}]\nrank r computes\n$Y_r$ = GeLU(X $A_r$) [{tokens}, {ffn_r}]")
    x = matrix(step(x, "× B"), ffn, h, "rows", "B", "B = dense_4h_to_h.weightᵀ",
               f"[{ffn}, {h}]\nrank r holds\n$B_r$ [{ffn_r}, {h}]")
    x = step(x, "=")
    w, hgt = h / u, tokens / u  # the partial products, one per rank, stacked
    for r in range(TP):
        box(ax, x, 0.08 if r == 0 else -0.08 - hgt / 2, w, hgt / 2, RANK[r], f"$Y_{r}B_{r}$", fontsize=8)
    ax.text(x + w / 2, hgt / 2 + 0.2, "partial\nsums", ha="center", va="bottom", fontsize=9)
    ax.text(x + w / 2, -hgt / 2 - 0.2, f"[{tokens}, {h}]\neach", ha="center", va="top", fontsize=8)
    x = matrix(step(x + w, "g", COMM), tokens, h, label="Z", sub=f"[{tokens}, {h}]\nwhole on\nevery rank")
    ax.text(x / 2, -ffn / u / 2 - 1.9, "f: forward identity, backward all-reduce        "
            "g: forward all-reduce (the sum over ranks), backward identity", ha="center", va="top",
            fontsize=9, color=COMM)
    ax.set_xlim(-0.3, x + 0.3)
    ax.set_ylim(-ffn / u / 2 - 2.5, ffn / u / 2 + 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"The MLP at TP {TP} (hidden {h}, FFN {ffn}, {cfg.micro_batch_size} × {cfg.seq_length} "
                 "tokens): nothing crosses between A and B", fontsize=10)
    save(fig, path)


def draw_attention_heads(path):
    """The fused QKV weight's rows in minibert's [heads, 3, d] layout, cut into TP blocks; the output
    projection's columns, cut by heads; and, for contrast, the [3, heads, d] layout cut the same way."""
    cfg, shapes = planned_shapes()
    heads, d = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    _, (rows, h), (rows_r, _) = shapes["self_attention.query_key_value"]
    _, (out, cols), (_, cols_r) = shapes["self_attention.dense"]
    fig, ax = figure(4.0)
    bar = 1.0

    def strip(y, names, total, block, title, note, note_color="black"):
        """One weight's rows (or columns) left to right, d a segment, coloured by the rank that holds
        them under a plain split into TP contiguous blocks of `block`."""
        for i, name in enumerate(names):
            box(ax, i * d, y, d, bar, RANK[(i * d) // block], name, edge="white", fontsize=8 if len(name) < 4 else 7)
        for r in range(TP):
            ax.plot([r * block + 1, (r + 1) * block - 1], [y - 0.15] * 2, color=RANK[r], lw=2)
            ax.text((r + 0.5) * block, y - 0.25, f"rank {r}: [{block}{', ' + str(h) if total == rows else ''}]"
                    if total == rows else (f"rank {r}" if block >= 2 * d else str(r)), ha="center", va="top", fontsize=8, color=RANK[r])
        ax.text(0, y + bar + 0.12, title, ha="left", va="bottom", fontsize=9)
        ax.text(total + 4, y + bar / 2, note, ha="left", va="center", fontsize=8, color=note_color)

    per_head = [f"{kind}{i}" for i in range(heads) for kind in "qkv"]  # [heads, 3, d]
    stacked = [f"{kind}{i}" for kind in "qkv" for i in range(heads)]   # [3, heads, d]
    strip(6.6, per_head, rows, rows_r, f"query_key_value.weight [{rows}, {h}] (column-parallel): its {rows} "
          f"rows in minibert's [heads, 3, d] order, {heads} heads, d = {d}",
          f"a plain cut of the rows:\n{heads // TP} whole head{'s' if heads // TP > 1 else ''} a rank,\n"
          "q, k and v together")
    ax.text(rows / 2, 5.45, "↓  each rank runs attention on its own heads: no communication  ↓",
            ha="center", va="center", fontsize=9, style="italic")
    strip(3.3, [f"head {i}" for i in range(heads)], cols, cols // TP,
          f"dense.weight [{out}, {cols}] (row-parallel): its {cols} columns take the heads' outputs, in head order",
          f"rank r: columns [{out}, {cols_r}], its heads' outputs; g sums the partial products")
    strip(0.8, stacked, rows, rows_r, "for contrast, the [3, heads, d] order (query, key, value stacked), "
          "cut the same way", f"rank 0 would hold\n{' '.join(stacked[:rows_r // d])}:\nno whole head",
          note_color=COLORS["idle"])
    ax.set_xlim(-2, rows + 62)
    ax.set_ylim(0.2, 8.1)
    ax.axis("off")
    save(fig, path)


def draw_sequence_parallel(path):
    """One layer's activations on the two ranks: TP alone keeps [b, s, h] whole everywhere; with SP the
    part between the blocks holds [b, s/p, h], and the collectives around the blocks change."""
    cfg, _ = planned_shapes()
    b, s, h = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size
    fig, axes = figure(5.2, nrows=2)
    tw, th, gap = 0.7, 1.6, 2.4  # a [b, s, h] tensor, s drawn upwards; the room between two tensors
    lanes = [1.2, -1.2]  # rank 0 above, rank 1 below (the centre of each lane)
    steps = [  # (what runs between two tensors, then its collective under TP, under TP + SP)
        ("LayerNorm", "f (identity)", "all-gather"),
        ("attention\n(QKV, my heads,\ndense)", "g: all-reduce", "reduce-scatter"),
        ("dropout,\n+ residual,\nLayerNorm", "f (identity)", "all-gather"),
        ("MLP\n(h→4h, GeLU,\n4h→h)", "g: all-reduce", "reduce-scatter"),
        ("dropout,\n+ residual", "", ""),
    ]
    for ax, sp in zip(axes, (False, True)):
        # SP alternates this rank's slice of the sequence (between the blocks) and the gathered whole
        kinds = ["slice", "whole", "slice", "whole", "slice", "slice"] if sp else ["whole"] * 6
        xs = [i * (tw + gap) for i in range(len(kinds))]
        for x, kind in zip(xs, kinds):
            for r, yc in enumerate(lanes):
                y0 = yc - th / 2
                if kind == "whole":
                    box(ax, x, y0, tw, th, WHOLE)
                else:  # my s/p positions filled, the other rank's as an empty outline
                    for q in range(TP):
                        box(ax, x, y0 + (TP - 1 - q) * th / TP, tw, th / TP, RANK[r] if q == r else "white",
                            ls="-" if q == r else ":", edge="black" if q == r else COLORS["neutral"])
            shape = f"[{b}, {s // TP}, {h}]" if kind == "slice" else f"[{b}, {s}, {h}]"
            ax.text(x + tw / 2, lanes[0] + th / 2 + 0.12, shape, ha="center", va="bottom", fontsize=8,
                    weight="bold" if kind == "slice" else "normal")
            if sp and kind == "whole":
                ax.text(x + tw / 2, lanes[1] - th / 2 - 0.1, "gathered,\nnot kept", ha="center", va="top",
                        fontsize=7, color=COLORS["neutral"])
        for i, (op, tp_comm, sp_comm) in enumerate(steps):
            x0, x1 = xs[i] + tw + 0.1, xs[i + 1] - 0.1
            comm = sp_comm if sp else tp_comm
            for yc in lanes:
                ax.add_patch(FancyArrowPatch((x0, yc), (x1, yc), arrowstyle="-|>", mutation_scale=9,
                                             color=COLORS["neutral"], lw=1))
            ax.text((x0 + x1) / 2, 0, op, ha="center", va="center", fontsize=8)
            ax.text((x0 + x1) / 2, lanes[0] + 0.1, comm, ha="center", va="bottom", fontsize=8,
                    color=COLORS["neutral"] if "identity" in comm else COMM)
        for r, yc in enumerate(lanes):
            ax.text(-0.2, yc, f"rank {r}", ha="right", va="center", fontsize=9, color=RANK[r])
        title = (f"TP {TP}: every activation is [b, s, h] = [{b}, {s}, {h}] on both ranks: LayerNorm, dropout "
                 "and the residual run twice") if not sp else (
                 f"TP {TP} + SP: between the blocks each rank keeps its {s // TP} positions, [b, s/p, h]")
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(-1.3, xs[-1] + tw + 0.1)
        ax.set_ylim(lanes[1] - th / 2 - 0.55, lanes[0] + th / 2 + 0.5)
        ax.axis("off")
    save(fig, path)


def draw_vocab_cross_entropy(path):
    """The loss from the vocab blocks of the logits: per token, a max and two sums cross the ranks, never
    the logits."""
    cfg, shapes = planned_shapes()
    n = cfg.micro_batch_size * cfg.seq_length  # the LM head's rows: at most every position of a micro-batch
    _, (vocab, _), (vocab_r, _) = shapes["embedding.word_embeddings"]
    real = cfg.vocab_size
    fig, ax = figure(3.3)
    lanes, th = [1.1, -1.1], 1.6  # the lanes' centres; a [n, ...] tensor's height
    lw, vw, gap = 4.0, 0.3, 2.0  # the logits block's width, a [n] vector's, the room between
    x_m = lw + gap
    x_mm = x_m + vw + gap
    x_st = x_mm + vw + gap
    x_sum = x_st + 2 * vw + gap
    x_loss = x_sum + 2 * vw + gap
    for r, yc in enumerate(lanes):
        y0 = yc - th / 2
        first, last = r * vocab_r, (r + 1) * vocab_r - 1
        pad = max(0, (r + 1) * vocab_r - real) / vocab_r * lw
        box(ax, 0, y0, lw, th, RANK[r], f"rank {r}: logits z [n, {vocab_r}]\nvocab columns {first}-{last}",
            fontsize=8)
        if pad:
            box(ax, lw - max(pad, 0.12), y0, max(pad, 0.12), th, COLORS["idle"], hatch="////")
            ax.annotate(f"{(r + 1) * vocab_r - real} padding columns\n(vocab {real} padded to {vocab}),\nset to −∞", (lw - 0.06, y0),
                        (lw - 0.3, y0 - 0.5), fontsize=7, ha="center", va="top", color=COLORS["idle"],
                        arrowprops=dict(arrowstyle="-", color=COLORS["idle"], lw=0.8))
        box(ax, x_m, y0, vw, th, RANK[r])
        box(ax, x_mm, y0, vw, th, WHOLE)
        box(ax, x_st, y0, vw, th, RANK[r], "S", fontsize=8)
        box(ax, x_st + vw, y0, vw, th, RANK[r], "t", fontsize=8)
        box(ax, x_sum, y0, vw, th, WHOLE, "S", fontsize=8, tcolor="black")
        box(ax, x_sum + vw, y0, vw, th, WHOLE, "t", fontsize=8, tcolor="black")
        box(ax, x_loss, y0, vw, th, WHOLE)
        for a, b in ((lw, x_m), (x_m + vw, x_mm), (x_mm + vw, x_st), (x_st + 2 * vw, x_sum), (x_sum + 2 * vw, x_loss)):
            ax.add_patch(FancyArrowPatch((a + 0.1, yc), (b - 0.1, yc), arrowstyle="-|>", mutation_scale=9,
                                         color=COLORS["neutral"], lw=1))
    top = lanes[0] + th / 2 + 0.1
    ax.text(x_m + vw / 2, top, "my max\n[n]", ha="center", va="bottom", fontsize=8)
    ax.text(x_mm + vw / 2, top, "m", ha="center", va="bottom", fontsize=9)
    ax.text(x_st + vw, top, "my sum of exp(z − m),\nz_label − m if the label is mine", ha="center",
            va="bottom", fontsize=8)
    ax.text(x_loss + vw / 2, top, "loss\n[n]", ha="center", va="bottom", fontsize=8)
    ax.text((x_m + vw + x_mm) / 2, 0, "all-reduce\nMAX", ha="center", va="center", fontsize=8, color=COMM)
    ax.text((x_st + 2 * vw + x_sum) / 2, 0, "one all-reduce\nSUM of [2, n]", ha="center", va="center",
            fontsize=8, color=COMM)
    ax.text((x_sum + 2 * vw + x_loss) / 2, 0, "log S − t", ha="center", va="center", fontsize=8)
    ax.set_title(f"The cross entropy from vocab blocks at TP {TP}, n tokens (up to {n}): 3 numbers a token "
                 f"cross the ranks, not {vocab_r} logits", fontsize=9, loc="left")
    ax.set_xlim(-0.2, x_loss + vw + 0.2)
    ax.set_ylim(lanes[1] - th / 2 - 0.9, lanes[0] + th / 2 + 0.8)
    ax.axis("off")
    save(fig, path)


FIGURES = {
    "ch05_mlp_split": draw_mlp_split,
    "ch05_attention_heads": draw_attention_heads,
    "ch05_vocab_cross_entropy": draw_vocab_cross_entropy,
    "ch05_sequence_parallel": draw_sequence_parallel,
}
