"""Chapter 4's pictures: which ranks are neighbours in the rank grid, which rows each data-parallel rank
reads, how gradient buckets are sent while the backward still runs, and which part of each bucket a
rank updates under ZeRO-1. Every layout comes from minibert itself: the grid from
minibert.parallel.state.coordinates, the rows from minibert.data.batches.MicroBatchSampler, the buckets
and shards from minibert.parallel.data_parallel.DataParallelGrads on models built on the meta device
(shapes only: nothing is allocated or computed)."""
import torch
from matplotlib.patches import FancyBboxPatch, Rectangle
from style import COLORS, figure, save

from minibert.config import Config
from minibert.data.batches import MicroBatchSampler
from minibert.model.bert import BertModel
from minibert.parallel.data_parallel import DataParallelGrads
from minibert.parallel.state import ParallelState, coordinates, rank_grid
from minibert.validate import validate

RANKS = [COLORS["forward"], COLORS["backward"], COLORS["communication"], COLORS["highlight"],
         COLORS["memory"], COLORS["data"], COLORS["idle"], COLORS["neutral"]]  # one colour per rank or group


def chapter_model(dp=1, **overrides):
    """The chapter's MODEL (2 layers, hidden 64, 4 heads, sequences of 64, micro 2, global 8), on meta."""
    cfg = validate(Config(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                          max_position_embeddings=64, micro_batch_size=2, global_batch_size=8, train_iters=20,
                          lr=1e-3, **overrides), world_size=dp, warn=None)
    with torch.device("meta"):
        return BertModel(cfg, init=False)


def bert_large():
    cfg = validate(Config(preset="340m", micro_batch_size=8, train_iters=1, lr=1e-4), warn=None)
    with torch.device("meta"):
        return BertModel(cfg, init=False).to(torch.bfloat16)


# ---------------------------------------------------------------- the rank grid
def draw_rank_grid(path, tp=2, dp=4, pp=2, gpus_per_node=8):
    """16 ranks on 2 nodes of 8 GPUs, TP 2 x DP 4 x PP 2: the same GPUs three times, coloured by the
    tensor-, data- and pipeline-parallel group each belongs to."""
    world = tp * dp * pp
    nodes = world // gpus_per_node
    groups = rank_grid(tp, dp, pp)
    kinds = [("tensor", "tensor-parallel groups (TP 2): talk inside every layer"),
             ("data", "data-parallel groups (DP 4): average the gradients once per step"),
             ("pipeline", "pipeline groups (PP 2): pass activations between stages")]
    fig, axes = figure(7.0, nrows=3)
    for ax, (kind, title) in zip(axes, kinds):
        color_of = {r: i for i, g in enumerate(groups[kind]) for r in g}
        for node in range(nodes):
            y = nodes - 1 - node
            ax.add_patch(FancyBboxPatch((-0.15, y - 0.42), gpus_per_node - 0.08, 0.84,
                                        boxstyle="round,pad=0.02", fc="#F2F2F2", ec="#BBBBBB"))
            ax.text(-0.35, y, f"node {node}", ha="right", va="center", fontsize=9)
            for slot in range(gpus_per_node):
                rank = node * gpus_per_node + slot  # torchrun numbers ranks node by node
                t, d, p = coordinates(rank, tp, dp)
                ax.add_patch(Rectangle((slot, y - 0.33), 0.62, 0.66, fc=RANKS[color_of[rank] % len(RANKS)],
                                       ec="white", alpha=0.9))
                ax.text(slot + 0.31, y + 0.1, f"{rank}", ha="center", va="center", fontsize=10, color="white",
                        weight="bold")
                ax.text(slot + 0.31, y - 0.17, f"t{t} d{d} p{p}", ha="center", va="center", fontsize=7,
                        color="white")
        listed = "  ".join("[" + " ".join(map(str, g)) + "]" for g in groups[kind])
        ax.set_title(f"{title}\n{listed}", fontsize=9, loc="left")
        ax.set_xlim(-1.4, gpus_per_node + 0.05)
        ax.set_ylim(-0.55, nodes - 0.45)
        ax.axis("off")
    fig.suptitle("rank = tp + 2 x (dp + 4 x pp)   (t, d, p under each rank)", fontsize=10, y=0.995)
    save(fig, path)


# ---------------------------------------------------------------- the sampler
def draw_sampler(path, global_batch=8, micro=2, steps=2):
    """Rows 0 .. 15 (two steps of 8) and the rank that reads each, at DP 1, 2 and 4."""
    sizes = (1, 2, 4)
    fig, ax = figure(2.9)
    rows = global_batch * steps
    for line, dp in enumerate(sizes):
        y = len(sizes) - 1 - line
        for rank in range(dp):
            sampler = iter(MicroBatchSampler(rows, 0, micro, rank, dp))
            per_step = global_batch // (micro * dp)
            for k, batch in enumerate(sampler):
                x0 = batch[0]
                ax.add_patch(Rectangle((x0 + 0.05, y - 0.32), micro - 0.1, 0.64, fc=RANKS[rank], ec="white"))
                label = f"r{rank} mb{k % per_step}"
                ax.text(x0 + micro / 2, y + 0.12, label, ha="center", va="center", fontsize=8, color="white",
                        weight="bold")
                ax.text(x0 + micro / 2, y - 0.15, f"{batch[0]},{batch[1]}", ha="center", va="center",
                        fontsize=7, color="white")
        ax.text(-0.3, y, f"DP {dp}\n{global_batch // (micro * dp)} micro-batches\nper rank per step",
                ha="right", va="center", fontsize=8)
    for s in range(1, steps):
        ax.axvline(s * global_batch, color="black", lw=1.2, ls="--")
    for s in range(steps):
        ax.text(s * global_batch + global_batch / 2, len(sizes) - 0.45, f"step {s + 1}: rows "
                f"{s * global_batch}-{(s + 1) * global_batch - 1}", ha="center", va="bottom", fontsize=9)
    ax.set_xlim(-4.2, rows + 0.1)
    ax.set_ylim(-0.5, len(sizes) - 0.1)
    ax.axis("off")
    ax.set_title("r1 mb0 = rank 1's micro-batch 0 of the step, above the rows it holds (global batch 8, micro-batch 2)",
                 fontsize=9)
    save(fig, path)


# ---------------------------------------------------------------- buckets and overlap
def backward_costs(model, tokens=4096):
    """(name, forward cost, backward cost) per parameter in backward order (the buckets' order): a weight
    matrix costs 2 x tokens x elements forward and twice that backward; the word table is used twice, by
    the tied LM-head decoder (a matmul at the start of the backward) and by the lookup (the very end)."""
    out = []
    for name, p in reversed(list(model.named_parameters())):
        matmul = p.ndim == 2 and "embeddings" not in name
        out.append((name, 2 * tokens * p.numel() if matmul else 0, 4 * tokens * p.numel() if matmul else 0))
    word = model.embedding.word_embeddings.weight.numel()
    out.insert(0, ("lm-head decoder (tied)", 2 * tokens * word, 4 * tokens * word))
    return out


def overlap_timeline(model, bucket_size=None, network_share=0.6, optimizer_share=0.06):
    """The times of one step of 2 micro-batches, in units of the last backward's length. Compute follows
    the matmul FLOPs (backward_costs); each bucket's all-reduce takes a time proportional to its bytes,
    all of them together `network_share` of one backward (a ratio chosen for the picture, not measured)."""
    grads = DataParallelGrads(model, ParallelState(), bucket_size=bucket_size)
    costs = backward_costs(model)
    total_backward = sum(b for _, _, b in costs)
    forward = sum(f for _, f, _ in costs) / total_backward
    ready, clock = {}, 0.0  # when each parameter's gradient of the last micro-batch is complete
    for name, _, b in costs:
        clock += b / total_backward
        ready[name] = clock
    bucket_ready = [max(ready[n] for n in bucket.names) for bucket in grads.buckets]
    sizes = [bucket.grad_data.numel() for bucket in grads.buckets]
    comm = [network_share * s / sum(sizes) for s in sizes]
    return forward, bucket_ready, comm, optimizer_share


def draw_buckets_overlap(path, earlier=0.45):
    """BERT-large, Megatron's default buckets (40M elements: 8 of them), the last micro-batch of a step on
    one rank, without and with --overlap-grad-reduce. The earlier micro-batches are one short grey block
    (not to scale): they send nothing."""
    model = bert_large()
    forward, bucket_ready, comm, optimizer = overlap_timeline(model)
    fig, ax = figure(3.5)
    height = 0.34
    lanes = {("off", "compute"): 3.3, ("off", "network"): 2.88, ("on", "compute"): 1.55, ("on", "network"): 1.13}
    finish = {}
    for mode in ("off", "on"):
        y_c, y_n = lanes[(mode, "compute")], lanes[(mode, "network")]
        ax.add_patch(Rectangle((-earlier, y_c - height / 2), earlier, height, fc="#D9D9D9", ec="white",
                               hatch="//"))
        ax.text(-earlier / 2, y_c, "micro-batch 1:\nnothing sent", ha="center", va="center", fontsize=7)
        ax.add_patch(Rectangle((0, y_c - height / 2), forward, height, fc=COLORS["forward"], ec="white"))
        ax.text(forward / 2, y_c, "forward 2 (the last)", ha="center", va="center", fontsize=8, color="white")
        start = forward
        edges = [0.0] + bucket_ready
        for b, (a, z) in enumerate(zip(edges[:-1], edges[1:])):
            ax.add_patch(Rectangle((start + a, y_c - height / 2), z - a, height, fc=COLORS["backward"],
                                   ec="white", alpha=1.0 if b % 2 == 0 else 0.7))
            if z - a > 0.05:
                ax.text(start + (a + z) / 2, y_c, f"b{b}", ha="center", va="center", fontsize=8)
        end_backward = start + 1.0
        net = None
        for b, (r, c) in enumerate(zip(bucket_ready, comm)):
            ready = start + r if mode == "on" else end_backward
            begin = ready if net is None else max(net, ready)
            ax.add_patch(Rectangle((begin, y_n - height / 2), c, height, fc=COLORS["communication"], ec="white"))
            ax.text(begin + c / 2, y_n, f"b{b}", ha="center", va="center", fontsize=7, color="white")
            net = begin + c
        ax.add_patch(Rectangle((net, y_c - height / 2), optimizer, height, fc=COLORS["memory"], ec="white"))
        ax.text(net + optimizer + 0.02, y_c, "AdamW", ha="left", va="center", fontsize=8)
        finish[mode] = net + optimizer
        ax.text(-earlier - 0.04, y_c, "compute", ha="right", va="center", fontsize=8)
        ax.text(-earlier - 0.04, y_n, "network", ha="right", va="center", fontsize=8)
    ax.text(-earlier, 3.62, "without --overlap-grad-reduce: finish() starts every bucket's all-reduce after "
            "the backward", fontsize=9, va="bottom")
    ax.text(-earlier, 1.87, "with --overlap-grad-reduce: a bucket's all-reduce starts once its last gradient "
            "is in", fontsize=9, va="bottom")
    for mode, top in (("off", 3.5), ("on", 1.75)):
        ax.plot([finish[mode]] * 2, [0.55, top], color=COLORS["idle"], lw=1, ls=":")
    ax.annotate("", xy=(finish["on"], 0.62), xytext=(finish["off"], 0.62),
                arrowprops=dict(arrowstyle="<->", color=COLORS["idle"]))
    ax.text((finish["on"] + finish["off"]) / 2, 0.7, "saved", ha="center", fontsize=8, color=COLORS["idle"])
    ax.text(-earlier, 0.45, "b7 holds the word embedding, whose gradient is complete only when the backward "
            "ends: b7 is never hidden", fontsize=8, va="center")
    ax.set_xlim(-earlier - 0.3, max(finish.values()) + 0.25)
    ax.set_ylim(0.25, 3.95)
    ax.set_xticks([x / 2 for x in range(int(2 * max(finish.values())) + 1)])
    ax.set_xlabel("time from the last forward's start, in lengths of one backward\n(compute drawn from the "
                  "matmul FLOPs; the network's speed is chosen for the picture, not measured)", fontsize=8)
    ax.spines["left"].set_visible(False)
    ax.set_yticks([])
    save(fig, path)


# ---------------------------------------------------------------- ZeRO-1
def short_name(name):
    """layers.1.mlp.dense_h_to_4h.weight -> L1 mlp h_to_4h (labels that fit above a shard)."""
    name = name.replace("embedding.word_embeddings.weight", "the word embedding (tied with the LM head)")
    return name.replace("layers.", "L").replace(".mlp.dense_", " mlp ").replace(".weight", "")


def draw_zero1_shards(path, dp=4, bucket_size=100_000):
    """Top: the chapter's model at DP 4 with --ddp-bucket-size 100000, each bucket cut in 4 shards (the
    rank that updates each); bottom: BERT-large's bytes per GPU, without ZeRO-1 and with it."""
    fig, (top, bottom) = figure(5.6, nrows=2, gridspec_kw={"height_ratios": [1.0, 1.25]})
    model = chapter_model(dp)
    buckets = DataParallelGrads(model, ParallelState(dp=dp), bucket_size=bucket_size,
                                distributed_optimizer=True).buckets
    held = [0] * dp  # parameter elements each rank's optimizer holds
    for i, bucket in enumerate(buckets):
        y = len(buckets) - 1 - i
        total = bucket.grad_data.numel()
        size = total // dp
        for r in range(dp):
            lo, hi = r * size, (r + 1) * size
            top.add_patch(Rectangle((lo / total, y - 0.3), size / total, 0.6, fc=RANKS[r], ec="white", lw=2))
            inside = sum(max(0, min(b, hi) - max(a, lo)) for a, b in bucket.ranges)
            held[r] += inside
            top.text((lo + size / 2) / total, y + 0.12, f"rank {r}", ha="center", va="center", fontsize=8,
                     color="white", weight="bold")
            top.text((lo + size / 2) / total, y - 0.14, f"[{lo:,}, {hi:,})", ha="center", va="center", fontsize=7,
                     color="white")
        for (a, b), name in zip(bucket.ranges, bucket.names):
            if (b - a) / total > 0.14:  # name the parameters wide enough to see
                top.annotate("", xy=(a / total, y + 0.36), xytext=(b / total, y + 0.36),
                             arrowprops=dict(arrowstyle="<->", color="black", lw=0.8))
                top.text((a + b) / 2 / total, y + 0.42, short_name(name), ha="center", va="bottom", fontsize=7)
        top.text(-0.01, y, f"bucket {i}\n{len(bucket.params)} parameters\n{total:,} elements", ha="right",
                 va="center", fontsize=8)
    top.set_xlim(-0.2, 1.0)
    top.set_ylim(-0.45, len(buckets) - 0.2)
    top.axis("off")
    top.set_title(f"the chapter's model, DP {dp}, --ddp-bucket-size {bucket_size}: rank r updates shard r of "
                  f"every bucket\nparameter elements per rank: {', '.join(f'{h:,}' for h in held)} "
                  "(x 8 bytes of Adam moments in fp32)", fontsize=9, loc="left")

    n = sum(p.numel() for p in bert_large().parameters())
    columns = [("without ZeRO-1\n(any DP)", 1), ("ZeRO-1\nDP 2", 2), ("ZeRO-1\nDP 4", 4), ("ZeRO-1\nDP 8", 8),
               ("ZeRO-1\nDP 64", 64)]
    parts = [("16-bit parameters: 2 bytes", lambda d: 2, COLORS["forward"]),
             ("fp32 gradients (main_grad): 4 bytes", lambda d: 4, COLORS["backward"]),
             ("fp32 masters + Adam m, v: 12 bytes / DP", lambda d: 12 / d, COLORS["memory"])]
    base = [0.0] * len(columns)
    for label, per, color in parts:
        values = [n * per(d) / 1e9 for _, d in columns]
        bottom.bar(range(len(columns)), values, 0.55, bottom=base, color=color, label=label, ec="white")
        base = [b + v for b, v in zip(base, values)]
    for x, b in enumerate(base):
        bottom.text(x, b + 0.08, f"{b:.2f} GB", ha="center", fontsize=8)
    bottom.set_xticks(range(len(columns)), [c for c, _ in columns], fontsize=8)
    bottom.set_ylabel("GB per GPU")
    bottom.set_ylim(0, 7.0)
    bottom.legend(fontsize=8, loc="upper right", frameon=False)
    bottom.set_title(f"BERT-large ({n:,} parameters) in bf16: what each GPU holds before activations",
                     fontsize=9, loc="left")
    save(fig, path)


FIGURES = {
    "ch04_rank_grid": draw_rank_grid,
    "ch04_sampler": draw_sampler,
    "ch04_buckets_overlap": draw_buckets_overlap,
    "ch04_zero1_shards": draw_zero1_shards,
}
