"""Chapter 6's pictures: a model cut into pipeline stages, and the schedules that run micro-batches through
them. Every timeline is minibert's own: `simulate` in minibert/parallel/schedules.py places each rank's
action list (`schedule`) in time (a stage's forward takes 1 unit, its backward 2), and the exchange plan
comes from minibert/parallel/p2p_plan.py. The model's numbers (parameters per stage, FLOPs of a layer and
of the LM head) come from the planner's functions (minibert/tools/plan_memory.py, plan_time.py) for
BERT-large, Megatron's 340M."""
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from style import COLORS, figure, save

from minibert.config import Config
from minibert.parallel import p2p_plan
from minibert.parallel.schedules import layer_ranges, num_warmup_micro_batches, simulate
from minibert.tools import plan_memory, plan_time
from minibert.validate import validate

P, M = 4, 8  # the chapter's running example: 4 stages, 8 micro-batches
IDLE = "#F4D6D6"  # the bubble: a light shade of COLORS["idle"]
CHUNK_B = {"forward": "#9DB5DA", "backward": "#EDB991"}  # the second model chunk, lighter
STAGE_COLORS = [COLORS["forward"], COLORS["backward"], COLORS["communication"], COLORS["memory"]]


def bert_large(**overrides):
    """BERT-large (--preset 340m) on 4 pipeline stages, micro-batches of 4, bf16: the chapter's example."""
    cfg = Config(preset="340m", pipeline_model_parallel_size=P, micro_batch_size=4, global_batch_size=4 * M,
                 train_iters=1, lr=1e-4, bf16=True, **overrides)
    return validate(cfg, world_size=P, warn=None)


def pct(fraction):
    return f"{100 * float(fraction):.1f}%"


def timeline_axes(ax, timeline, labels=True, chunk_shades=False, spacing=1.0):
    """One row per stage (stage 0 on top, rows `spacing` apart): each action a coloured box, idle time
    shaded IDLE."""
    vp = timeline.vp
    total = float(timeline.total_time)
    for rank, entries in enumerate(timeline.entries):
        y = (timeline.pp_size - 1 - rank) * spacing
        ax.add_patch(Rectangle((0, y - 0.4), total, 0.8, facecolor=IDLE, edgecolor="none"))
        for start, end, action in entries:
            kind = "forward" if action.op == "F" else "backward"
            color = CHUNK_B[kind] if chunk_shades and action.chunk == 1 else COLORS[kind]
            ax.add_patch(Rectangle((float(start), y - 0.4), float(end - start), 0.8, facecolor=color,
                                   edgecolor="white", lw=0.8))
            if labels:
                text = p2p_plan.action_label(action, vp) if vp == 1 else str(action.micro_batch)
                ax.text(float(start + end) / 2, y, text, ha="center", va="center", fontsize=7 if vp == 1 else 6,
                        color="white" if not (chunk_shades and action.chunk == 1) else "black")
    ax.set_xlim(0, total)
    ax.set_ylim(-0.6, (timeline.pp_size - 1) * spacing + 0.6)
    ax.set_yticks([r * spacing for r in range(timeline.pp_size)])
    ax.set_yticklabels([f"stage {r}" for r in reversed(range(timeline.pp_size))])
    ax.tick_params(axis="y", length=0)
    ax.spines["left"].set_visible(False)


def legend(ax, chunks=False, **kwargs):
    handles = [Patch(color=COLORS["forward"], label="forward (1 unit)"),
               Patch(color=COLORS["backward"], label="backward (2 units)")]
    if chunks:
        handles = [Patch(color=COLORS["forward"], label="forward, chunk a"),
                   Patch(color=CHUNK_B["forward"], label="forward, chunk b"),
                   Patch(color=COLORS["backward"], label="backward, chunk a"),
                   Patch(color=CHUNK_B["backward"], label="backward, chunk b")]
    handles.append(Patch(color=IDLE, label="idle (the bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.33), ncol=len(handles), frameon=False,
              fontsize=8, **kwargs)


def title_of(timeline, name):
    p, m, v = timeline.pp_size, timeline.num_micro_batches, timeline.vp
    formula = f"(p-1)/(v m) = {p - 1}/{v * m}" if v > 1 else f"(p-1)/m = {p - 1}/{m}"
    return (f"{name}, p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "") +
            f": bubble {formula} = {pct(timeline.bubble)} of the compute time; "
            f"step {float(timeline.total_time):g} units")


def draw_one_batch(path):
    """The same batch run as one piece (its forward takes m units on each stage) and as m micro-batches."""
    fig, axes = figure(4.0, nrows=2, sharex=True)
    whole = simulate("afab", P, 1, forward_time=M, backward_time=2 * M)
    cut = simulate("afab", P, M)
    timeline_axes(axes[0], whole)
    axes[0].set_title(f"the batch as one piece: each stage works {float(whole.ideal_compute):g} of "
                      f"{float(whole.total_time):g} units, idle 3/4 of the time", fontsize=9, loc="left")
    timeline_axes(axes[1], cut, labels=False)
    axes[1].set_title(f"the same batch as m = {M} micro-batches (AFAB): the step takes {float(cut.total_time):g} "
                      f"units, idle {pct(cut.bubble)} of the compute time", fontsize=9, loc="left")
    axes[1].set_xlim(0, float(whole.total_time))
    axes[1].set_xlabel("time (units: one micro-batch's forward through one stage = 1)")
    legend(axes[1])
    save(fig, path)


def draw_afab(path):
    fig, ax = figure(2.7)
    timeline = simulate("afab", P, M)
    timeline_axes(ax, timeline)
    ax.set_title(title_of(timeline, "AFAB"), fontsize=9, loc="left")
    ax.set_xlabel("time (units)")
    legend(ax)
    save(fig, path)


def draw_1f1b(path):
    fig, ax = figure(2.9)
    timeline = simulate("1f1b", P, M)
    timeline_axes(ax, timeline)
    ax.set_title(title_of(timeline, "1F1B"), fontsize=9, loc="left")
    # the three phases of stage 0, as schedule() builds them: warm-up forwards, 1F1B pairs, cool-down backwards
    entries, warmup = timeline.entries[0], num_warmup_micro_batches("1f1b", P, 0, M)
    steady_end = warmup + 2 * (M - warmup)  # index of the first cool-down backward
    marks = [(0, float(entries[warmup - 1][1]), f"warm-up: {warmup} F"),
             (float(entries[warmup][0]), float(entries[steady_end - 1][1]),
              f"stage 0 steady state: {M - warmup} pairs F, B"),
             (float(entries[steady_end][0]), float(entries[-1][1]), f"cool-down: {warmup} B")]
    for x0, x1, text in marks:
        ax.annotate("", (x0, P - 0.45 + 0.55), (x1, P - 0.45 + 0.55),
                    arrowprops={"arrowstyle": "<->", "color": "black", "lw": 0.8}, annotation_clip=False)
        ax.text((x0 + x1) / 2, P + 0.2, text, ha="center", va="bottom", fontsize=7)
    ax.set_ylim(-0.6, P + 0.3)
    ax.set_title(title_of(timeline, "1F1B"), fontsize=9, loc="left", pad=14)
    ax.set_xlabel("time (units)")
    legend(ax)
    save(fig, path)


def in_flight_curve(entries):
    """(times, micro-batches whose activations are held): +1 when a forward starts, -1 when its backward ends
    (events at the same time are netted: a backward's end frees what the next forward takes)."""
    change = {}
    for start, end, action in entries:
        t, step = (float(start), 1) if action.op == "F" else (float(end), -1)
        change[t] = change.get(t, 0) + step
    times, counts = [0.0], [0]
    for t in sorted(change):
        times.append(t)
        counts.append(counts[-1] + change[t])
    return times, counts


def draw_in_flight(path):
    fig, axes = figure(3.0, ncols=2, sharey=True)
    for ax, kind in zip(axes, ("afab", "1f1b")):
        timeline = simulate(kind, P, M)
        for rank, entries in enumerate(timeline.entries):
            times, counts = in_flight_curve(entries)
            ax.step(times, counts, where="post", color=STAGE_COLORS[rank], lw=1.6,
                    label=f"stage {rank} (peak {timeline.peak_in_flight[rank]})")
        ax.set_title(f"{kind.upper()}, p = {P}, m = {M}: peaks {timeline.peak_in_flight}", fontsize=9)
        ax.set_xlabel("time (units)")
        ax.set_xlim(0, float(timeline.total_time))
        ax.legend(fontsize=7, frameon=False, loc="upper right")
    axes[0].set_ylabel("micro-batches whose\nactivations are held")
    axes[0].set_yticks(range(0, M + 1, 2))
    save(fig, path)


def draw_interleaved(path):
    fig, ax = figure(2.7)
    timeline = simulate("interleaved", P, M, 2)
    timeline_axes(ax, timeline, chunk_shades=True)
    ax.set_title(title_of(timeline, "interleaved 1F1B"), fontsize=9, loc="left")
    ax.set_xlabel("time (units: a chunk's forward takes 1/2, its backward 1)")
    legend(ax, chunks=True)
    save(fig, path)


def message_arrows(kind, p, m, vp, rule):
    """[(send time, sender, time the receive is posted, receiver, Message)] for one plan, on the ideal
    timeline: a send leaves when its action ends; batch i of a rank is posted when its action i-1 ends."""
    timeline = simulate(kind, p, m, vp)
    actions = [[a for _, _, a in entries] for entries in timeline.entries]
    plan = (p2p_plan.plan_exchanges(timeline.entries, p, vp) if rule == "timeline"
            else p2p_plan.plain_exchanges(actions, p, vp))
    posted = [[0.0] + [float(e) for _, e, _ in entries] for entries in timeline.entries]
    sent, received = {}, {}
    for rank, batches in enumerate(plan):
        for i, batch in enumerate(batches):
            for x in batch:
                (sent if x.op == "send" else received)[x.message] = (rank, posted[rank][i])
    return timeline, [(sent[msg][1], sent[msg][0], received[msg][1], received[msg][0], msg) for msg in sent]


# the two sends of section 3's deadlock under the plain rule (check_communication names them)
DEADLOCK = {p2p_plan.Message("gradient", 0, 1), p2p_plan.Message("gradient", 1, 2)}


def draw_exchanges(path):
    """Interleaved p = 2, m = 4, v = 2: where each message's receive is posted, under the two rules."""
    fig, axes = figure(5.0, nrows=2, sharex=True)
    gap = 2.2  # rank 0's row at y = gap, rank 1's at 0: room for the arrows between them
    for ax, rule, name in zip(axes, ("plain", "timeline"), ("the plain rule (receive just before the action)",
                                                            "minibert's rule (receive when it is sent)")):
        timeline, arrows = message_arrows("interleaved", 2, 4, 2, rule)
        timeline_axes(ax, timeline, chunk_shades=True, spacing=gap)
        late = 0
        for t_send, sender, t_recv, receiver, message in arrows:
            y0, y1 = (gap - 0.4, 0.4) if sender == 0 else (0.4, gap - 0.4)
            waits = t_recv > t_send
            late += waits
            cycle = rule == "plain" and message in DEADLOCK
            color = "black" if cycle else COLORS["idle"] if waits else COLORS["communication"]
            ax.add_patch(FancyArrowPatch((t_send, y0), (t_recv, y1), arrowstyle="-|>", color=color,
                                         mutation_scale=10 if cycle else 8, lw=2.2 if cycle else 1.3 if waits else 0.9))
        ax.set_title(f"{name}: {late} of {len(arrows)} sends wait for a receive posted later", fontsize=9,
                     loc="left")
        ax.set_yticklabels(["rank 1", "rank 0"])
    axes[1].set_xlabel("time on the ideal timeline (units); an arrow runs from a send to the posting of its receive")
    handles = [Line2D([], [], color=COLORS["communication"], label="receive already posted"),
               Line2D([], [], color=COLORS["idle"], lw=1.3, label="send waits for a later receive"),
               Line2D([], [], color="black", lw=2.2, label="the two sends that wait for each other")]
    axes[1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False, fontsize=8,
                   handlelength=1.5, columnspacing=1.0)
    save(fig, path)


def stage_work(cfg):
    """[(layers, FLOPs of the layers, FLOPs of the LM head)] per stage, one micro-batch, forward + backward."""
    ranges = layer_ranges(cfg.num_layers, P, 1, cfg.decoder_first_pipeline_num_layers,
                          cfg.decoder_last_pipeline_num_layers)
    layer, head = plan_time.layer_flops(cfg), plan_time.head_flops(cfg)
    return [(len(r[0]), len(r[0]) * layer, head if rank == P - 1 else 0) for rank, r in enumerate(ranges)]


def draw_uneven(path):
    fig, axes = figure(3.0, ncols=2, sharey=True)
    for ax, overrides, name in zip(axes, ({}, {"decoder_last_pipeline_num_layers": 3}),
                                   ("even split", "last stage 3 layers")):
        cfg = bert_large(**overrides)
        work = stage_work(cfg)
        layers = [w[1] / 1e12 for w in work]
        head = [w[2] / 1e12 for w in work]
        ax.bar(range(P), layers, color=COLORS["forward"], label="transformer layers")
        ax.bar(range(P), head, bottom=layers, color=COLORS["highlight"], label="LM head (tied decoder)")
        for rank, (n, lf, hf) in enumerate(work):
            ax.text(rank, (lf + hf) / 1e12 + 0.03, f"{n} layers", ha="center", va="bottom", fontsize=8)
        slowest = max(lf + hf for _, lf, hf in work) / 1e12
        ax.axhline(slowest, color=COLORS["idle"], lw=1, ls="--")
        ax.set_title(f"{name}: the slowest stage {slowest:.2f} TFLOP", fontsize=9)
        ax.set_xticks(range(P))
        ax.set_xticklabels([f"stage {r}" for r in range(P)])
    axes[0].set_ylabel("TFLOP per micro-batch\n(forward + backward)")
    axes[0].set_ylim(0, 1.9)
    axes[0].legend(fontsize=8, frameon=False, loc="upper left")
    save(fig, path)


def draw_stages(path):
    """BERT-large's 24 layers on 4 stages: what each GPU holds, and what crosses between them."""
    cfg = bert_large()
    stages = plan_memory.stages(cfg)
    ranges = layer_ranges(cfg.num_layers, P)
    fig, ax = figure(3.6)
    row, layer_x = 1.0, 3.2  # layer_x: where the layers start, leaving room on the left for the tied link
    for stage, r in zip(stages, ranges):
        y = (P - 1 - stage.rank) * row
        x = 0.0
        layers = r[0]
        if stage.first:
            ax.add_patch(Rectangle((x, y), 1.6, 0.6, facecolor=COLORS["data"], edgecolor="black", lw=0.6))
            ax.text(x + 0.8, y + 0.3, "embedding\n(word table)", ha="center", va="center", fontsize=7,
                    color="white")
        x = layer_x
        for layer in layers:
            ax.add_patch(Rectangle((x, y), 0.55, 0.6, facecolor=STAGE_COLORS[stage.rank], edgecolor="white"))
            ax.text(x + 0.275, y + 0.3, str(layer), ha="center", va="center", fontsize=7, color="white")
            x += 0.6
        x += 0.2
        if stage.last:
            ax.add_patch(Rectangle((x, y), 2.2, 0.6, facecolor=COLORS["highlight"], edgecolor="black", lw=0.6))
            ax.text(x + 1.1, y + 0.3, "final LN, LM head,\npooler, SOP head", ha="center", va="center",
                    fontsize=7)
            ax.add_patch(Rectangle((0, y), 1.6, 0.6, facecolor=COLORS["data"], edgecolor="black", lw=1.0,
                                   linestyle="--"))
            ax.text(0.8, y + 0.3, "word-table\ncopy", ha="center", va="center", fontsize=7, color="white")
        ax.text(-0.2, y + 0.3, f"GPU {stage.rank}\nstage {stage.rank}", ha="right", va="center", fontsize=8)
        ax.text(layer_x + 8.6, y + 0.3, f"{stage.parameters / 1e6:.1f}M parameters", ha="left", va="center", fontsize=8)
        if stage.rank < P - 1:
            ax.add_patch(FancyArrowPatch((layer_x + 2.8, y - 0.02), (layer_x + 2.8, y - 0.38), arrowstyle="-|>",
                                         mutation_scale=9, color=COLORS["forward"]))
            ax.add_patch(FancyArrowPatch((layer_x + 3.3, y - 0.38), (layer_x + 3.3, y - 0.02), arrowstyle="-|>",
                                         mutation_scale=9, color=COLORS["backward"]))
            ax.text(layer_x + 3.5, y - 0.2, "activation [b, s, h] down, its gradient up", ha="left", va="center",
                    fontsize=7)
    # the tied table's two copies (stage 0's and the last stage's), their gradients summed after every backward
    ax.add_patch(FancyArrowPatch((0.8, (P - 1) * row - 0.02), (0.8, 0.62), arrowstyle="<|-|>", mutation_scale=9,
                                 color=COLORS["communication"], ls="--", lw=1.2))
    ax.text(0.9, (P - 1) * row / 2 + 0.3, "the two copies'\ngradients summed\nevery step\n(finalize_model_grads)",
            ha="left", va="center", fontsize=7, color=COLORS["communication"])
    ax.set_xlim(-1.6, layer_x + 10.6)
    ax.set_ylim(-0.3, P * row)
    ax.axis("off")
    ax.set_title(f"BERT-large ({cfg.num_layers} layers) on {P} pipeline stages (layer_ranges)", fontsize=9)
    save(fig, path)


FIGURES = {
    "ch06_stages": draw_stages,
    "ch06_one_batch": draw_one_batch,
    "ch06_afab": draw_afab,
    "ch06_1f1b": draw_1f1b,
    "ch06_in_flight": draw_in_flight,
    "ch06_interleaved": draw_interleaved,
    "ch06_exchanges": draw_exchanges,
    "ch06_uneven": draw_uneven,
}
