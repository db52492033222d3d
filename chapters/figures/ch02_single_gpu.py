"""Chapter 2's pictures: the model, one layer, one training step, mixed precision, the LR schedule, a
checkpoint's save order, and the loss curves of the committed GPU runs.

Shapes come from minibert itself (the Megatron course's model, 4 layers, hidden 128, 8 heads, built on the
meta device); the loss scale and the LR are minibert's own DynamicLossScaler and OptimizerParamScheduler run
for the course's flags; the curves are read from the logs in chapters/logs/. Nothing is trained."""
import math
import pathlib
import re
from types import SimpleNamespace

import torch
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch
from style import COLORS, figure, save

from minibert.model.bert import BertModel
from minibert.model.config import ModelConfig
from minibert.training.loss_scale import DynamicLossScaler
from minibert.training.lr_schedule import OptimizerParamScheduler

LOGS = pathlib.Path(__file__).resolve().parent.parent / "logs"
VOCAB = 30524  # bert-base-uncased's 30,522 + Megatron's [BOS]/[EOS]
COURSE = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=VOCAB, binary_head=False)
LN_COLOR = COLORS["highlight"]
PALE = "#EDEDED"

TRAIN = re.compile(r"^iteration +(\d+)/ +\d+ \| consumed samples: +(\d+) \|.*?learning rate: (\S+) \|"
                   r"(?:.*? lm loss: (\S+) \|)?.*? loss scale: (\S+) \|")
EVAL = re.compile(r"^validation loss at iteration (\d+)(?: on (validation|test) set)? \| lm loss value: (\S+) \|")


def read_log(name):
    """{"train": [(iteration, samples, lr, lm loss or None, loss scale)], "eval": [(iteration, split, loss)]}."""
    train, evals = [], []
    for line in (LOGS / name).read_text().splitlines():
        if m := TRAIN.match(line):
            train.append((int(m[1]), int(m[2]), float(m[3]), float(m[4]) if m[4] else None, float(m[5])))
        elif m := EVAL.match(line):
            evals.append((int(m[1]), m[2] or "during", float(m[3])))
    return {"train": train, "eval": evals}


# ---------------------------------------------------------------- drawing helpers
def box(ax, x, y, w, h, text, color=PALE, tcolor="black", fontsize=9, edge="black", ls="-"):
    """A rounded box with its lower left corner at (x, y)."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=color,
                                edgecolor=edge, lw=0.8, linestyle=ls))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=tcolor)


def arrow(ax, start, end, color="black", style="-|>", lw=1.1, ls="-", rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=10, color=color, lw=lw,
                                 linestyle=ls, connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0))


def plus(ax, x, y, r=0.16):
    ax.add_patch(Circle((x, y), r, facecolor="white", edgecolor="black", lw=1.0, zorder=3))
    ax.text(x, y, "+", ha="center", va="center", fontsize=10, zorder=4)


# ---------------------------------------------------------------- the model
def draw_model(path):
    """The whole model, with the one word table read twice (tied) and its padded rows; parameters by part."""
    config = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=8, vocab_size=VOCAB)  # train-small's
    with torch.device("meta"):
        model = BertModel(config, init=False)
    parts = {}
    for name, p in model.named_parameters():
        part = "layers" if name.startswith("layers.") else name.split(".")[0]
        parts[part] = parts.get(part, 0) + p.numel()
    total = sum(parts.values())
    share = {part: f"{n:,} ({100 * n / total:.0f}%)" for part, n in parts.items()}
    padded = config.padded_vocab_size
    fig, ax = figure(4.1)
    f = 8
    box(ax, 0.0, 1.5, 1.3, 0.8, "tokens,\ntypes [b, s]", fontsize=f)
    box(ax, 1.7, 1.2, 1.95, 1.4, f"embeddings\nword + position\n+ token type\n{share['embedding']}",
        COLORS["data"], "white", fontsize=f)
    box(ax, 4.05, 1.5, 1.95, 0.8, f"{config.num_layers} × layer\n{share['layers']}", COLORS["forward"],
        "white", fontsize=f)
    box(ax, 6.4, 1.5, 1.2, 0.8, "final\nLayerNorm", LN_COLOR, fontsize=f)
    for x0, x1 in ((1.3, 1.7), (3.65, 4.05), (6.0, 6.4)):
        arrow(ax, (x0, 1.9), (x1, 1.9))
    box(ax, 8.1, 2.5, 2.15, 1.0, f"pooler on [CLS],\nSOP head h → 2\n{parts['pooler'] + parts['binary_head']:,}", COLORS["neutral"], "white", fontsize=f)
    box(ax, 8.1, 0.2, 2.15, 1.0, f"LM head: dense,\nGeLU, LayerNorm,\n× word tableᵀ  {parts['lm_head']:,}",
        COLORS["forward"], "white", fontsize=f)
    arrow(ax, (7.6, 1.9), (8.1, 3.0))
    arrow(ax, (7.6, 1.9), (8.1, 0.7))
    box(ax, 10.65, 2.6, 1.6, 0.8, "SOP logits\n[b, 2]", fontsize=f)
    box(ax, 10.65, 0.3, 1.6, 0.8, f"logits\n[b, s, {VOCAB:,}]", fontsize=f)
    arrow(ax, (10.25, 3.0), (10.65, 3.0))
    arrow(ax, (10.25, 0.7), (10.65, 0.7))
    # the word table, drawn once, read twice
    tx, ty, tw, th, pad = 2.2, -1.45, 0.9, 1.25, 0.14
    ax.add_patch(FancyBboxPatch((tx, ty + pad), tw, th - pad, boxstyle="square,pad=0", facecolor=COLORS["data"],
                                edgecolor="black", lw=0.8))
    ax.add_patch(FancyBboxPatch((tx, ty), tw, pad, boxstyle="square,pad=0", facecolor="white", edgecolor="black",
                                lw=0.8, hatch="////"))
    ax.text(tx + tw / 2, ty + th / 2 + pad / 2, f"word\ntable\n[{padded:,},\n{config.hidden_size}]", ha="center",
            va="center", fontsize=7.5, color="white")
    ax.text(tx - 0.12, ty + pad / 2, f"rows {VOCAB:,}-{padded - 1:,}: padding\n(hatched, not to scale)",
            ha="right", va="center", fontsize=7.5)
    arrow(ax, (tx + tw / 2, ty + th), (tx + tw / 2, 1.2), COLORS["data"], ls="--")
    arrow(ax, (tx + tw, -0.75), (9.175, -0.75), COLORS["data"], ls="--", style="-")
    arrow(ax, (9.175, -0.75), (9.175, 0.2), COLORS["data"], ls="--")
    ax.text(6.1, -0.68, "tied: the LM head multiplies by the same tensor;\nits padded columns are cut off the logits",
            ha="center", va="bottom", fontsize=8, color=COLORS["data"])
    ax.set_title(f"make train-small's BERT ({config.num_layers} layers, hidden {config.hidden_size}, "
                 f"{config.num_attention_heads} heads): {total:,} parameters", fontsize=10)
    ax.set_xlim(-0.1, 12.35)
    ax.set_ylim(-1.55, 3.65)
    ax.axis("off")
    save(fig, path)


def draw_layer(path):
    """One transformer layer, post-LN above, pre-LN below: where the two LayerNorms sit."""
    fig, axes = figure(4.4, nrows=2)
    layouts = {
        "post-LN (original BERT, HF; --post-ln):  x = LN1(x + drop(attn(x))),  x = LN2(x + drop(mlp(x)))":
            [("branch", ["attention", "dropout"]), ("add",), ("stream", "LN1"),
             ("branch", ["MLP", "dropout"]), ("add",), ("stream", "LN2")],
        "pre-LN (Megatron, the default):  x = x + drop(attn(LN1(x))),  x = x + drop(mlp(LN2(x)))":
            [("branch", ["LN1", "attention", "dropout"]), ("add",), ("branch", ["LN2", "MLP", "dropout"]),
             ("add",)],
    }
    bw, bh, gap = 1.08, 0.5, 0.22
    for ax, (title, items) in zip(axes, layouts.items()):
        x = 0.0
        ax.text(x, 0, "x", ha="right", va="center", fontsize=10)
        x += 0.15
        for item in items:
            if item[0] == "branch":
                names = item[1]
                x0 = x + 0.3
                arrow(ax, (x0, 0), (x0, 0.85), style="-")
                arrow(ax, (x0, 0.85), (x0 + 0.35, 0.85))
                bx = x0 + 0.35
                for i, name in enumerate(names):
                    color = LN_COLOR if name.startswith("LN") else (PALE if name == "dropout" else COLORS["forward"])
                    box(ax, bx, 0.85 - bh / 2, bw, bh, name, color, "white" if color == COLORS["forward"] else "black")
                    if i < len(names) - 1:
                        arrow(ax, (bx + bw, 0.85), (bx + bw + gap, 0.85))
                    bx += bw + gap
                end = bx - gap
                arrow(ax, (end, 0.85), (end + 0.35, 0.85), style="-")
                arrow(ax, (end + 0.35, 0.85), (end + 0.35, 0.17))
                arrow(ax, (x, 0), (end + 0.35 - 0.16, 0))  # the residual stream passes underneath
                x = end + 0.35
            elif item[0] == "add":
                plus(ax, x, 0)
                x += 0.16
            else:  # a LayerNorm on the stream itself
                arrow(ax, (x, 0), (x + 0.3, 0))
                box(ax, x + 0.3, -bh / 2, 0.7, bh, item[1], LN_COLOR)
                x += 1.0
        arrow(ax, (x, 0), (x + 0.45, 0))
        ax.text(x + 0.55, 0, "next layer", ha="left", va="center", fontsize=9)
        ax.text(-0.3, 1.55, title, ha="left", va="center", fontsize=9)
        ax.set_xlim(-0.4, 10.6)
        ax.set_ylim(-0.55, 1.8)
        ax.axis("off")
    axes[0].text(0.2, -0.45, "every add is followed by a LayerNorm on the stream: the stream is renormalised; "
                 "the embeddings get a LayerNorm too", fontsize=8, color=COLORS["neutral"])
    axes[1].text(0.2, -0.45, "the LayerNorms sit on the branches: the stream x is only added to; after the last "
                 "layer, one final LayerNorm", fontsize=8, color=COLORS["neutral"])
    save(fig, path)


def draw_qkv_view(path):
    """The fused projection's 3h outputs for one token, and the view [heads, 3, d] that picks q, k, v."""
    heads, h = COURSE.num_attention_heads, COURSE.hidden_size
    d = h // heads
    index = torch.arange(3 * h).view(heads, 3, d)  # what qkv.view(b, s, -1, 3, d) does to one token's outputs
    fig, ax = figure(3.4)
    kinds = {0: ("q", COLORS["forward"]), 1: ("k", COLORS["backward"]), 2: ("v", COLORS["communication"])}
    scale = 10.0 / (3 * h)
    for head in range(heads):
        for kind in range(3):
            lo = int(index[head, kind, 0])
            name, color = kinds[kind]
            ax.add_patch(FancyBboxPatch((lo * scale, 2.3), d * scale, 0.55, boxstyle="square,pad=0",
                                        facecolor=color, edgecolor="white", lw=0.8, alpha=0.35 + 0.65 * (head % 2)))
            ax.text((lo + d / 2) * scale, 2.575, f"{name}{head}", ha="center", va="center", fontsize=7)
    ax.text(0, 3.05, f"query_key_value(x) for one token: {3 * h} numbers = output rows of the "
            f"[{3 * h}, {h}] weight, in blocks of d = {d}", fontsize=9)
    for pos in (0, h, 2 * h, 3 * h):
        ax.text(pos * scale, 2.15, str(pos), ha="center", va="top", fontsize=7, color=COLORS["neutral"])
    # the view, as a grid: row = head, column = q / k / v
    gx, gy, cw, ch = 1.9, -1.9, 0.95, 0.42
    for head in range(heads):
        for kind in range(3):
            name, color = kinds[kind]
            lo = int(index[head, kind, 0])
            ax.add_patch(FancyBboxPatch((gx + kind * cw, gy + (heads - 1 - head) * ch * 0.6), cw, ch * 0.6,
                                        boxstyle="square,pad=0", facecolor=color, edgecolor="white", lw=0.8,
                                        alpha=0.35 + 0.65 * (head % 2)))
            ax.text(gx + kind * cw + cw / 2, gy + (heads - 0.5 - head) * ch * 0.6, f"{lo}-{lo + d - 1}",
                    ha="center", va="center", fontsize=6)
        ax.text(gx - 0.1, gy + (heads - 0.5 - head) * ch * 0.6, f"head {head}", ha="right", va="center", fontsize=7)
    for kind in range(3):
        ax.text(gx + kind * cw + cw / 2, gy + heads * ch * 0.6 + 0.05, kinds[kind][0], ha="center", va="bottom",
                fontsize=9)
    arrow(ax, (3.6, 2.1), (gx + 1.5 * cw, gy + heads * ch * 0.6 + 0.35))
    ax.text(5.2, 0.9, f".view(b, s, -1, 3, d): [b, s, {heads}, 3, {d}]\n"
            "permute + unbind: q, k, v, each [b, heads, s, d]", ha="left", va="center", fontsize=8.5)
    ax.text(5.2, -0.7, "a contiguous block of rows holds whole heads,\n"
            "each with its own q, k and v: tensor parallelism\ncuts the weight by rows and every rank keeps\n"
            "whole heads (chapter 5)", ha="left", va="center", fontsize=8.5, color=COLORS["neutral"])
    ax.set_xlim(-0.1, 10.4)
    ax.set_ylim(-2.05, 3.3)
    ax.axis("off")
    save(fig, path)


# ---------------------------------------------------------------- the step
def draw_train_step(path):
    """One iteration of train_step: the micro-batches, then finalize, the optimizer and the schedule."""
    fig, ax = figure(2.9)
    y, h = 0.6, 0.9
    steps = [("next micro-batch\n[4, 128] rows", COLORS["data"], "white"),
             ("model\nforward", COLORS["forward"], "white"),
             ("loss / 4\n(fp16: × scale)", PALE, "black"),
             ("backward", COLORS["backward"], "white"),
             ("fold .grad into\nfp32 main_grad", COLORS["memory"], "white")]
    x = 0.0
    w = 1.45
    for i, (text, color, tcolor) in enumerate(steps):
        box(ax, x, y, w, h, text, color, tcolor, fontsize=8.5)
        if i < len(steps) - 1:
            arrow(ax, (x + w, y + h / 2), (x + w + 0.25, y + h / 2))
        x += w + 0.25
    loop_end = x - 0.25
    arrow(ax, (loop_end - w / 2, y + h), (w / 2, y + h), COLORS["neutral"], rad=0.12)
    ax.text(loop_end / 2, y + h + 0.5, "× G / m = 16 / 4 = 4 micro-batches: the gradients add up (accumulation)",
            ha="center", fontsize=8.5, color=COLORS["neutral"])
    after = [("finalize_model_grads\n(all-reduce over DP:\nchapter 4)", COLORS["communication"], "white"),
             ("optimizer.step()\ngrad norm, clip, skip?\nAdamW on fp32 masters", COLORS["forward"], "white"),
             ("scheduler.step(16)\nif the update\nhappened", PALE, "black")]
    x2, y2 = 1.2, -0.95
    elbow = y - 0.3
    arrow(ax, (loop_end - w / 2, y), (loop_end - w / 2, elbow), style="-")
    arrow(ax, (loop_end - w / 2, elbow), (x2 + 1.0, elbow), style="-")
    arrow(ax, (x2 + 1.0, elbow), (x2 + 1.0, y2 + h))
    for i, (text, color, tcolor) in enumerate(after):
        box(ax, x2, y2, 2.0, h, text, color, tcolor, fontsize=8.5)
        if i < len(after) - 1:
            arrow(ax, (x2 + 2.0, y2 + h / 2), (x2 + 2.4, y2 + h / 2))
        x2 += 2.4
    ax.text(x2 - 0.2, y2 + h / 2, "log, evaluate,\nsave at their\nintervals", ha="left", va="center", fontsize=8.5)
    ax.set_xlim(-0.1, 9.0)
    ax.set_ylim(-1.05, 2.3)
    ax.axis("off")
    save(fig, path)


# ---------------------------------------------------------------- mixed precision
def draw_bf16_spacing(path):
    """The gap between neighbouring numbers in each format, against an Adam step of lr."""
    fig, ax = figure(3.4)
    w = torch.logspace(-3, 0.5, 400, dtype=torch.float64)
    for dtype, name, color in ((torch.float32, "fp32", COLORS["neutral"]), (torch.float16, "fp16", COLORS["backward"]),
                               (torch.bfloat16, "bf16", COLORS["forward"])):
        x = w.to(dtype)
        gap = (torch.nextafter(x, torch.full_like(x, 100.0)) - x).double()
        ax.step(x.double(), gap, where="post", color=color, label=f"{name}: the next number minus this one")
    for lr, ls in ((1e-4, "--"), (1e-5, ":")):
        ax.axhline(lr, color="black", ls=ls, lw=0.9)
        ax.text(0.13, lr / 1.5, f"an Adam step ≈ lr = {lr:g}", fontsize=8, va="top")
    for value, label in ((0.02, "a matrix entry\n(std 0.02)"), (1.0, "a LayerNorm\nweight")):
        ax.axvline(value, color=COLORS["neutral"], lw=0.6)
        ax.text(value * 1.08, 3e-2, label, fontsize=8, va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|weight|")
    ax.set_ylabel("spacing of representable numbers")
    ax.set_ylim(1e-11, 5e-2)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("An update smaller than half the spacing rounds away: in bf16, most of Adam's steps do",
                 fontsize=10)
    save(fig, path)


def draw_loss_scale(path):
    """DynamicLossScaler with Megatron's defaults, for gradients that overflow above 2^17, next to the scale
    the course's fp16 runs logged."""
    scaler = DynamicLossScaler()
    iterations, scales, skipped = [], [], []
    for it in range(1, 41):
        overflow = scaler.scale > 2.0 ** 17  # this iteration's backward ran at the current scale
        scaler.update(found_inf=overflow)
        scales.append(math.log2(scaler.scale))  # the scale after the iteration: what a log line prints
        iterations.append(it)
        if overflow:
            skipped.append(it)
    logged = [(it, math.log2(scale)) for it, _, _, _, scale in read_log("ch2_prelnlr1e-4.log")["train"][:4]]
    fig, ax = figure(3.2)
    ax.step([0] + iterations, [32] + scales, where="post", color=COLORS["forward"],
            label="DynamicLossScaler(), overflowing above 2¹⁷: the scale after each iteration")
    ax.scatter([it for it in skipped], [16.2] * len(skipped), marker="x", color=COLORS["idle"],
               label=f"skipped: {len(skipped)} iterations (gradient overflow, no update)")
    ax.scatter([it for it, _ in logged], [s for _, s in logged], s=40, facecolor="none", edgecolor="black", zorder=3,
               label="log lines of the course's fp16 run (chapters/logs/ch2_prelnlr1e-4.log)")
    ax.annotate("1st overflow: hysteresis,\nthe scale stays", (1, 32), (4, 30.5), fontsize=8,
                arrowprops={"arrowstyle": "->", "lw": 0.7})
    ax.set_xlabel("iteration")
    ax.set_ylabel("log₂ loss scale")
    ax.set_yticks(range(16, 34, 2))
    ax.set_ylim(15.5, 33.5)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("fp16: the scale starts at 2³², halves on each overflow, settles at 2¹⁷", fontsize=10)
    save(fig, path)


def draw_lr_schedule(path):
    """The course's schedule from OptimizerParamScheduler, for bf16 (every step updates) and fp16 (the first
    16 steps skipped), with the learning rates the logs printed."""
    G = 16
    fig, ax = figure(3.2)
    for name, skips, color in (("bf16 / fp32: every iteration updates", 0, COLORS["forward"]),
                               ("fp16: iterations 1-16 skipped (section 5.1)", 16, COLORS["backward"])):
        opt = SimpleNamespace(param_groups=[{"lr": 0.0}])  # all the scheduler needs of an optimizer
        sched = OptimizerParamScheduler(opt, max_lr=1e-4, min_lr=1e-5, warmup_steps=0.1 * 100 * G,
                                        decay_steps=100 * G, decay_style="linear")
        xs, lrs = [], []
        for it in range(1, 201):
            xs.append(it)
            lrs.append(opt.param_groups[0]["lr"])  # the LR this iteration's update uses
            if it > skips:
                sched.step(G)
        ax.step(xs, lrs, where="post", color=color, label=name)
    for log, marker in (("train_small_bf16_h200.log", "o"), ("ch2_prelnlr1e-4.log", "s")):
        # a log line prints the LR set after its step: the next iteration's
        points = [(it + 1, lr) for it, _, lr, _, _ in read_log(log)["train"] if it < 200]
        ax.scatter(*zip(*points), s=18, marker=marker, facecolor="none", edgecolor="black", zorder=3,
                   label=f"printed by chapters/logs/{log}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("learning rate")
    ax.set_xlim(0, 201)
    ax.legend(fontsize=8)
    ax.set_title("The course's schedule: warmup over 160 samples, linear decay to 1e-5 at 1,600 samples",
                 fontsize=10)
    save(fig, path)


# ---------------------------------------------------------------- checkpoints
def draw_checkpoint_save(path):
    """The order of a save, and what a crash at each point leaves for --load."""
    fig, ax = figure(2.9)
    steps = [("write the file under\na hidden temporary\nname, fsync it", COLORS["memory"], "white"),
             ("rename it to\nmodel_optim_rng.pt\n(atomic)", COLORS["memory"], "white"),
             ("manifest.json:\nsha256 of every\nrank's file", COLORS["data"], "white"),
             ("the tracker file\nlatest_checkpointed_\niteration.txt: 200", COLORS["communication"], "white")]
    crash = ["a stray temporary\nfile (the next run\ndeletes it)", "iter_0000200/\nwithout a manifest",
             "a complete iter_0000200/\nthat the tracker\ndoes not name", "the tracker names\niter_0000200/"]
    w, gap = 1.95, 0.35
    for i, (text, color, tcolor) in enumerate(steps):
        x = i * (w + gap)
        box(ax, x, 0.9, w, 1.0, text, color, tcolor, fontsize=8.5)
        if i < len(steps) - 1:
            arrow(ax, (x + w, 1.4), (x + w + gap, 1.4))
        arrow(ax, (x + w / 2, 0.9), (x + w / 2, 0.6), COLORS["idle"], ls=":")
        ax.text(x + w / 2, 0.5, ("killed here:\n" if i < 3 else "done:\n") + crash[i], ha="center", va="top",
                fontsize=8, color=COLORS["idle"] if i < 3 else COLORS["communication"])
    ax.text(0, 2.2, "one save (each rank writes its own file; rank 0 writes the manifest, then the tracker)",
            fontsize=9)
    ax.text(0, -0.85, "until the tracker is renamed, it still says 100: --load resumes from the complete "
            "iter_0000100/", fontsize=9)
    ax.set_xlim(-0.1, 4 * (w + gap))
    ax.set_ylim(-1.0, 2.4)
    ax.axis("off")
    save(fig, path)


# ---------------------------------------------------------------- the runs
def draw_train_small_loss(path):
    """make train-small's losses (bf16; CUDA graphs and eager) against samples seen, and the same model
    trained 30 times longer (1500 iterations of 64 samples), the lm loss left and the SOP loss right."""
    fig, axes = figure(3.6, ncols=2, gridspec_kw={"width_ratios": [1.6, 1]})
    long_log = (LOGS / "train_small_long_h100.log").read_text()
    long_test = {name: float(re.search(rf"on test set \|.*?{name} value: (\S+) \|", long_log)[1])
                 for name in ("lm loss", "sop loss")}
    for ax, name in zip(axes, ("lm loss", "sop loss")):
        pattern = re.compile(rf"^iteration +(\d+)/.*? global batch size: +(\d+) \|.*? {name}: (\S+) \|")
        for log, label, style, color, width in (
                ("train_small_bf16_eager_h200.log", "make train-small, eager", "-", COLORS["neutral"], 2.2),
                ("train_small_bf16_h200.log", "the same, CUDA graphs", "--", COLORS["forward"], 1.2),
                ("train_small_long_h100.log", "1500 iterations × 64, lr 5e-4", "-", COLORS["communication"], 1.0)):
            points = [(int(m[1]) * int(m[2]), float(m[3]))
                      for m in map(pattern.match, (LOGS / log).read_text().splitlines()) if m]
            ax.plot(*zip(*points), style, color=color, lw=width, label=label)
        ax.scatter([points[-1][0]], [long_test[name]], marker="D", s=24, color=COLORS["backward"], zorder=3,
                   label=f"that run's test set: {long_test[name]:.2f}")
        ax.set_xscale("log")
        ax.set_xlabel("samples consumed (log scale)")
        ax.set_title(name, fontsize=10)
    axes[0].set_ylim(5.6, 10.75)
    axes[0].axhline(math.log(VOCAB), color=COLORS["neutral"], ls=":", lw=0.9)
    axes[0].text(170, math.log(VOCAB) + 0.07, f"ln({VOCAB:,}) = {math.log(VOCAB):.2f}: a uniform guess",
                 fontsize=8, color=COLORS["neutral"])
    axes[0].text(3400, 9.3, "200 iterations × 16",
                 fontsize=8, va="bottom")
    axes[1].axhline(math.log(2), color=COLORS["neutral"], ls=":", lw=0.9)
    axes[1].text(170, math.log(2) + 0.02, "ln 2: chance", fontsize=8, color=COLORS["neutral"])
    axes[0].set_ylabel("loss (a log line: mean of 10 iterations)")
    axes[0].legend(fontsize=7.5, loc="lower left")
    fig.suptitle("The small BERT on Python's docs, bf16: one H200 (200 iterations), one H100 (1500) (chapters/logs/)",
                 fontsize=10)
    save(fig, path)


def draw_course_runs(path):
    """The Megatron course's command on one H200 in fp16: pre-LN against post-LN at two learning rates."""
    fig, ax = figure(3.4)
    ax.axhspan(6, 7, color=COLORS["communication"], alpha=0.12)
    ax.text(203, 6.5, "the course's\n\"6-7 within\n200 steps\"", fontsize=8, va="center", color=COLORS["communication"])
    for layout, ls in (("preln", "-"), ("postln", "--")):
        for lr, color in (("1e-4", COLORS["forward"]), ("2e-4", COLORS["backward"])):
            run = read_log(f"ch2_{layout}lr{lr}.log")
            points = [(it, loss) for it, _, _, loss, _ in run["train"] if loss is not None]
            label = f"{'pre-LN' if layout == 'preln' else 'post-LN'}, lr {lr}: {points[-1][1]:.2f}"
            ax.plot(*zip(*points), ls, color=color, label=label)
    ax.axvspan(0, 16, color=COLORS["idle"], alpha=0.1)
    ax.text(1, 7.9, "fp16: 16\nskipped\niterations", fontsize=8, color=COLORS["idle"])
    ax.set_xlabel("iteration (the first log line, 1-10, has no loss: every step was skipped)")
    ax.set_ylabel("lm loss (mean of 10 iterations)")
    ax.set_xlim(0, 230)
    ax.legend(fontsize=8, title="layer, --lr: loss at 200", title_fontsize=8)
    ax.set_title("The course's command (fp16, 4 layers, its synthetic data) on one H200", fontsize=10)
    save(fig, path)


FIGURES = {
    "ch02_train_small_loss": draw_train_small_loss,
    "ch02_model": draw_model,
    "ch02_layer": draw_layer,
    "ch02_qkv_view": draw_qkv_view,
    "ch02_train_step": draw_train_step,
    "ch02_bf16_spacing": draw_bf16_spacing,
    "ch02_loss_scale": draw_loss_scale,
    "ch02_lr_schedule": draw_lr_schedule,
    "ch02_checkpoint_save": draw_checkpoint_save,
    "ch02_course_runs": draw_course_runs,
}
