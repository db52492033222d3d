"""Chapter 7's figures: where one GPU's memory goes, drawn from the planner's own functions
(minibert/tools/plan_memory.py, plan_time.py) for the launch recipes' flags as they launch.

A recipe (examples/bert_*.sh) is read by running it with TORCHRUN=echo: it then prints its torchrun
command instead of starting it (examples/launch.sh), and the flags after minibert/train.py are parsed by
the planner's parser, as `python -m minibert.tools.plan` would. Arithmetic only: no GPU, no data."""
import dataclasses
import os
import subprocess

from style import COLORS, figure, save

from minibert.config import Config
from minibert.tools import plan_memory as pm
from minibert.tools.plan import apply_preset, build_plan_parser
from minibert.tools.plan_time import HARDWARE, estimate
from minibert.training.build import backend_for
from minibert.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = os.path.join(ROOT, "minibert", "vocab", "bert-base-uncased-vocab.txt")
PARTS = [("weights", "weights (bf16)", COLORS["forward"]), ("grads", "gradients (fp32)", COLORS["communication"]),
         ("optimizer", "optimizer (fp32 master, m, v)", COLORS["idle"]),
         ("activations", "activations", COLORS["memory"])]
GPU_GIB = HARDWARE["gpu_memory_gib"][0]
HW = {name: default for name, (default, _) in HARDWARE.items()}


def recipe_flags(recipe, **env):
    """(the trainer's flags, GPUs) of `bash examples/RECIPE.sh` with TORCHRUN=echo and the given environment."""
    clean = {"PATH": os.environ["PATH"], "TORCHRUN": "echo", **{k: str(v) for k, v in env.items()}}
    words = subprocess.run(["bash", f"examples/{recipe}.sh", "CKPT", "TB", VOCAB, "DATA_text_sentence"], cwd=ROOT,
                           env=clean, capture_output=True, text=True, check=True).stdout.split()
    train = next(i for i, word in enumerate(words) if word.endswith("minibert/train.py"))
    launcher = words[:train]
    gpus = int(launcher[launcher.index("--nproc_per_node") + 1]) * int(launcher[launcher.index("--nnodes") + 1])
    return words[train + 1:], gpus


def config(flags, gpus):
    """The planner's Config for these trainer flags on `gpus` GPUs, checked as the trainer checks it."""
    args = vars(build_plan_parser().parse_args(flags))
    for name in ["nnodes", "nproc_per_node", *HARDWARE]:
        args.pop(name)
    cfg = Config(**args)
    apply_preset(cfg)
    validate(cfg, world_size=gpus, device_type="cuda", warn=None)
    return cfg


def most_loaded(cfg):
    """{part: GiB} of the pipeline stage that holds the most, as the planner's "this run" line sums it."""
    backend = backend_for(cfg, "cuda")
    rows = []
    for stage in pm.stages(cfg):
        parts = pm.state_bytes(stage.parameters, cfg, cfg.use_distributed_optimizer)
        parts["activations"] = pm.stage_activations(cfg, stage, backend, cfg.recompute)
        rows.append({part: parts[part] / pm.GiB for part, _, _ in PARTS})
    return max(rows, key=lambda parts: sum(parts.values()))


def stacked(ax, labels, rows, horizontal=False, fmt="{:.1f}"):
    """Stacked bars of {part: GiB}, one per label, each with its total written at its end."""
    start = [0.0] * len(labels)
    for part, name, color in PARTS:
        values = [row[part] for row in rows]
        if horizontal:
            ax.barh(labels, values, left=start, color=color, label=name, height=0.6)
        else:
            ax.bar(labels, values, bottom=start, color=color, label=name, width=0.6)
        start = [s + v for s, v in zip(start, values)]
    for i, total in enumerate(start):
        if horizontal:
            ax.text(total + 1, i, fmt.format(total), va="center", fontsize=9)
        else:
            ax.text(i, total + 1.5, fmt.format(total), ha="center", va="bottom", fontsize=9)


# ---------------------------------------------------------------- the three recipes as they launch
def draw_recipes(path):
    cases = [("340M\n8 GPUs: DP 8", "bert_340m", {}),
             ("4B\n1 GPU", "bert_4b", {"GPUS_PER_NODE": 1}),
             ("4B\n8 GPUs: DP 8, ZeRO-1", "bert_4b", {}),
             ("20B\n16 GPUs: TP 4 x PP 4, SP\n(stage 0)", "bert_20b", {})]
    rows = [most_loaded(config(*recipe_flags(recipe, **env))) for _, recipe, env in cases]
    fig, ax = figure(4.2)
    stacked(ax, [label for label, _, _ in cases], rows, fmt="{:.2f} GiB")
    ax.axhline(GPU_GIB, color=COLORS["neutral"], linestyle="--", linewidth=1)
    ax.text(3.3, GPU_GIB - 2, f"one H200: {GPU_GIB:g} GiB", ha="right", va="top", fontsize=9,
            color=COLORS["neutral"])
    ax.set_ylim(0, GPU_GIB * 1.05)
    ax.set_ylabel("GiB on the most loaded GPU")
    ax.set_title("The recipes as they launch (examples/bert_*.sh, bf16, micro-batch 4; 20B: 2)", fontsize=10)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], names[::-1], loc="upper left", bbox_to_anchor=(0.0, 0.93), fontsize=9, frameon=False)
    save(fig, path)


# ---------------------------------------------------------------- one BERT-large layer's activations
LAYER_PARTS = [("outside", "LayerNorm inputs, dropout masks", COLORS["forward"]),
               ("inside", "q, k, v, attention output, MLP", COLORS["communication"]),
               ("core", "attention core (s x s with local)", COLORS["idle"])]


def draw_layer(path):
    flags, gpus = recipe_flags("bert_340m")
    base = config(flags, gpus)
    cases = []
    for tp, sp, name in ((1, False, "TP 1"), (2, False, "TP 2"), (2, True, "TP 2 + SP")):
        cfg = dataclasses.replace(base, tensor_model_parallel_size=tp, sequence_parallel=sp)
        for backend in ("local", "flash"):
            cases.append((f"{name}, {backend}", pm.layer_activations(cfg, backend)))
        cases.append((f"{name}, full recompute", pm.layer_activations(cfg, "flash", "full")))
    cases.reverse()  # the first case at the top
    fig, ax = figure(4.0)
    labels = [label for label, _ in cases]
    left = [0.0] * len(cases)
    for part, name, color in LAYER_PARTS:
        values = [getattr(acts, part) / 2 ** 20 for _, acts in cases]
        ax.barh(labels, values, left=left, color=color, label=name, height=0.6)
        left = [x + v for x, v in zip(left, values)]
    for i, (_, acts) in enumerate(cases):
        ax.text(acts.total / 2 ** 20 + 2, i, f"{acts.total / 2 ** 20:.1f}", va="center", fontsize=9)
    ax.set_xlabel("MiB kept for the backward, per GPU (LayerNorm statistics: < 0.1 MiB, not visible)")
    ax.set_title("One BERT-large layer, micro-batch 4 x 512 tokens, bf16: what the backward needs", fontsize=10)
    ax.set_xlim(0, 205)
    ax.legend(loc="lower right", fontsize=9, frameon=False)
    save(fig, path)


# ---------------------------------------------------------------- the 4B on 8 GPUs, layout by layout
def draw_4b_layouts(path):
    flags, _ = recipe_flags("bert_4b")  # the recipe: ZeRO-1, overlapped gradient reduce, micro 4, global 32
    no_zero1 = [f for f in flags if f != "--use-distributed-optimizer"]
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    tp = lambda n: ["--tensor-model-parallel-size", str(n)]  # noqa: E731  (a later flag wins)
    pp = lambda n: ["--pipeline-model-parallel-size", str(n)]  # noqa: E731
    cases = [("DP 8", no_zero1), ("DP 8 + ZeRO-1 (the recipe)", flags), ("... + full recompute", flags + full),
             ("TP 2 x DP 4 + ZeRO-1", flags + tp(2)), ("TP 8 (DP 1)", flags + tp(8)),
             ("PP 2 x DP 4 + ZeRO-1: bubble 1/2", flags + pp(2)), ("PP 8 (DP 1): bubble 7/8", flags + pp(8))]
    rows, steps = [], []
    for _, case_flags in cases:
        cfg = config(case_flags, 8)
        rows.append(most_loaded(cfg))
        steps.append(estimate(cfg, HW, pm.stages(cfg), 8)["step"] * 1e3)
    labels = [label for label, _ in cases][::-1]
    fig, (left, right) = figure(4.0, gridspec_kw={"width_ratios": [3, 2]}, ncols=2, sharey=True)
    stacked(left, labels, rows[::-1], horizontal=True)
    left.set_xlim(0, 120)
    left.set_xlabel("GiB on the most loaded GPU")
    handles, names = left.get_legend_handles_labels()
    left.legend(handles[::-1], [name.split(" (")[0] for name in names[::-1]], loc="center right", fontsize=8,
                frameon=False)
    right.barh(labels, steps[::-1], color=COLORS["neutral"], height=0.6)
    for i, ms in enumerate(steps[::-1]):
        right.text(ms + 5, i, f"{ms:.0f}", va="center", fontsize=9)
    right.set_xlim(0, 400)
    right.set_xlabel("planned step time, ms")
    fig.suptitle("The 4B on one node of 8 GPUs, global batch 32 of micro-batches of 4: memory, then speed",
                 fontsize=10)
    save(fig, path)


FIGURES = {"ch07_recipes_memory": draw_recipes, "ch07_layer_activations": draw_layer,
           "ch07_4b_layouts": draw_4b_layouts}
