"""Training throughput: minibert's trainer next to HF BertForPreTraining, one process, same data, bf16.
(On the CPU, --tiny, every contender runs in fp32: most processors emulate bf16 matmuls, several times
slower, and the CPU run checks that each contender runs through, not how fast; section 4 keeps its bf16 rows.)

Every contender trains on the same CPU batches, in the same order, for the same steps: `warm-up` steps
(compilation, autotuning, the allocator's first sizes), then `steps` timed ones between two
torch.cuda.synchronize() calls. Each contender gets a fresh model and a fresh peak-memory count
(torch.cuda.max_memory_allocated, reset after the last one is freed).

    minibert     build_model_and_optimizer + apply_levers + train_step (the trainer's path: the levers
                 its flags turn on, then get_batch copies a CPU batch dict shaped like the DataLoader's,
                 packs it unless --no-pack-tokens; bf16 weights, fp32 masters, AdamW (fused), grad-norm
                 clipping and the non-finite check, Megatron's pre-LN)
    HF eager     BertForPreTraining (sdpa attention), fp32 weights under autocast bf16, fused AdamW, as
                 the peer setup of docs/measuring.md (no clipping); vocab = minibert's padded vocab, so both run the same matmuls
    HF compiled  the same, forward through torch.compile(model) (skipped on the CPU)
    minibert, CUDA graphs   minibert with --cuda-graph-impl local (minibert/fast/cuda_graphs.py): each
                 micro-batch one graph replay; the graphs (one per row count) are captured in a first
                 pass over the timed batches, before the warm-up, a one-time cost like compiling (GPU only)
    minibert, CUDA graphs, --sparse-mlm   the same with the LM head on the masked positions only (sections
                 1 and 3): the same loss, less work than its peers compute, so its ratios say so

Sections (--sections picks them):
    1  BERT-large s512 b32, full-length batches: every position real, cut from the default corpus's token
       stream as [CLS] A [SEP] B [SEP] windows, 15% of the tokens masked (80% [MASK], 10% random, 10% kept;
       token by token, not Megatron's whole-word n-grams: only the count matters for speed)
    2  BERT-large s512 b32 on padded batches: Megatron's samples (minibert.data.masked_lm) from the long-document
       corpus and from the default corpus, and synthetic lengths U[128, 512] (padding after the length);
       minibert packed (the default), minibert padded (--no-pack-tokens), minibert packed with CUDA graphs,
       HF eager with the attention mask; then the default corpus again, minibert packed only, at the
       micro-batch that holds the full-length run's real tokens, and at micro-batch 32 with ACCUMULATION
       micro-batches per optimizer step against the full-length run with the same accumulation (with
       graphs on a GPU; eager where no graphed contender runs).
       --contenders picks the padded contenders; their full-length references are measured as needed
    3  BERT-base s128 b256, full-length batches (as section 1)
    4  make train-small's model (4 layers, 128 hidden, 8 heads, s128, micro 4, global 16) on Megatron
       samples of the default corpus: ms per train_step, fp32 and bf16, eager and, on a GPU, with
       --cuda-graph-impl local (each micro-batch one CUDA graph replay)
    5  the fused kernels' gains: sections 1 and 3's minibert with --no-bias-dropout-fusion, with
       --no-cross-entropy-loss-fusion, with both, and with --no-residual-layernorm-fusion; and
       --no-residual-layernorm-fusion and --no-adam-fusion again with --cuda-graph-impl local
       (skipped on the CPU, where the plain ops run)

Model FLOPs (docs/measuring.md): F = 72 l h^2 + 12 l s h + 6 r (h V + h^2) per token, r = 1, V = the padded vocab,
with padding only real tokens count and sum(L_i^2) replaces s^2 (minibert.training.training_log.model_flops: the
same count for every contender, since they compute the same model). MFU = model FLOP/s / 790e12.

    python bench/train_bench.py                      # all sections on the GPU
    python bench/train_bench.py --quick --sections 1,2 --output train.md
    python bench/train_bench.py --device cpu --tiny  # tiny shapes, 1 + 1 steps (tests/test_train_bench.py)
    python bench/train_bench.py --quick --sections 1 --contenders "minibert, CUDA graphs;HF compiled"

The batches are built before any timing (bench/train_bench_data.py). run() returns rows {name, value,
unit, notes} for bench/run.py (BENCHMARKS.md); bench/notes/training.md says how to read them."""
import gc
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.train_bench_data import (  # noqa: E402
    SEED,
    length_histogram_notes,
    mean_real_tokens,
    megatron_batches,
    pinned,
    prepare_corpus,
    stream_batches,
)
from minibert.config import Config  # noqa: E402
from minibert.data.batches import (  # noqa: E402
    PrefetchingBatches,
    build_data_iterator,
    build_datasets,
)
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error  # noqa: E402
from minibert.fast.levers import apply_levers  # noqa: E402
from minibert.train import build_model_and_optimizer, train_step  # noqa: E402
from minibert.training.training_log import PEAK_FLOPS, batch_flops  # noqa: E402
from minibert.validate import validate  # noqa: E402

DATASHEET_FLOPS = 989e12  # H200 bf16 dense, the datasheet's figure (docs/measuring.md reports both)
STEPS = {"full": (5, 20), "quick": (3, 8), "tiny": (1, 1)}  # (warm-up, timed) steps; compile needs >= 3 warm-up
# (layers, hidden, heads, seq, micro batch): the measured shape, and the --tiny one for the CPU test
SHAPES = {"large": ((24, 1024, 16, 512, 32), (2, 64, 4, 64, 4)),
          "base": ((12, 768, 12, 128, 256), (2, 48, 4, 32, 8)),
          "small": ((4, 128, 8, 128, 4), (4, 128, 8, 128, 4))}
SMALL_GLOBAL_BATCH = 16  # make train-small's --global-batch-size (4 micro-batches per step)
ACCUMULATION = 8  # section 2's last rows: micro-batches per optimizer step (BERT-large: global batch 256)
TITLES = {1: "BERT-large s512 b32, full-length batches", 2: "BERT-large s512 b32, padded batches",
          3: "BERT-base s128 b256, full-length batches", 4: "make train-small's model, ms per iteration",
          5: "the fused kernels, each turned off"}


@dataclass
class Settings:
    device: torch.device
    tiny: bool
    warmup: int
    steps: int
    corpus: str = None          # the default corpus: a .bin/.idx prefix or a text file (None: write it)
    long_corpus: str = None     # the long-document corpus, likewise
    work_dir: str = None
    prefixes: dict = field(default_factory=dict)     # corpus kind -> (data prefix, note)
    full_length: dict = field(default_factory=dict)  # contender -> real tokens/s of section 1
    only: tuple = None          # --contenders: run only these (None: all)


@dataclass
class Measurement:
    seconds: float  # the timed steps, wall clock
    steps: int
    samples: int
    tokens: int     # real tokens of the timed steps
    flops: float    # their model FLOPs
    peak_bytes: int  # None on the CPU
    loss: float     # the last step's loss (a sanity check: finite)

    @property
    def tokens_per_s(self):
        return self.tokens / self.seconds

    @property
    def tflops(self):
        return self.flops / self.seconds / 1e12


def shape(name, settings):
    return SHAPES[name][1 if settings.tiny else 0]


def model_label(name, settings):
    layers, hidden, heads, seq, micro = shape(name, settings)
    model = f"tiny l{layers} h{hidden}" if settings.tiny else {"large": "BERT-large", "base": "BERT-base"}[name]
    return f"{model} s{seq} b{micro}"


def minibert_config(name, settings, **overrides) -> Config:
    layers, hidden, heads, seq, micro = shape(name, settings)
    values = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                  max_position_embeddings=512, micro_batch_size=micro, global_batch_size=micro, train_iters=1000,
                  lr=1e-4, bf16=settings.device.type == "cuda", seed=SEED, split="100,0,0", num_workers=0,
                  eval_iters=0)  # fp32 on the CPU (the module's docstring)
    values.update(overrides)
    return validate(Config(**values), 1, settings.device.type, warn=None)


def corpus_prefix(kind, settings):
    """-> (.bin/.idx prefix, note) of the "default" or "long" corpus, prepared once per run."""
    if kind not in settings.prefixes:
        given = settings.corpus if kind == "default" else settings.long_corpus
        settings.prefixes[kind] = prepare_corpus(kind, given, settings.work_dir, settings.tiny)
    return settings.prefixes[kind]


# ---------------------------------------------------------------- contenders
def build_as_trainer(cfg, device):
    """-> (model, optimizer, scheduler) as minibert/train.py trains them: built plain, then the levers cfg
    turns on (apply_levers: its flags, so a contender's overrides such as bias_dropout_fusion=False count)."""
    model, optimizer, scheduler = build_model_and_optimizer(cfg, device)
    apply_levers(model, optimizer, cfg)
    return model, optimizer, scheduler


def minibert_stepper(cfg, batches, device):
    """-> step(): one train_step over the next micro-batches (the trainer's own path)."""
    model, optimizer, scheduler = build_as_trainer(cfg, device)
    model.train()
    iterator = PrefetchingBatches(iter(batches))  # as the trainer's: the next step's batches built early

    def step():
        return train_step(model, optimizer, scheduler, iterator, cfg, device).losses["lm loss"]
    return step


def hf_inputs(batch):
    """A minibert batch as BertForPreTraining's arguments (labels -100 where no loss is taken)."""
    return {"input_ids": batch["text"], "token_type_ids": batch["types"],
            "attention_mask": (batch["padding_mask"] == 1).long(),
            "labels": torch.where(batch["loss_mask"] == 1, batch["labels"], -100),
            "next_sentence_label": batch["is_random"]}


def hf_stepper(cfg, batches, device, compiled=False):
    """-> step(): HF BertForPreTraining, fp32 weights, autocast bf16, fused AdamW (the peer setup of docs/measuring.md)."""
    from transformers import BertConfig, BertForPreTraining
    config = BertConfig(vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size,
                        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                        intermediate_size=cfg.ffn_size, max_position_embeddings=cfg.max_positions,
                        attn_implementation="sdpa")
    with torch.device(device):  # the weights are drawn on the device (faster than on the CPU, then copied)
        model = BertForPreTraining(config).train()
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                  fused=device.type == "cuda")
    iterator = iter([pinned(hf_inputs(b), device) for b in batches])  # converted before timing

    def step():
        inputs = {k: v.to(device, non_blocking=True) for k, v in next(iterator).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):  # as minibert's
            loss = forward(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step


SPARSE = "minibert, CUDA graphs, --sparse-mlm"  # the LM head on the masked positions only: not equal work
SPARSE_NOTE = ("not equal work: the LM head computes the masked positions only (the same loss and gradients), "
               "HF all of them")
CONTENDERS = {  # name -> (build(cfg, batches, device) -> step, config overrides)
    "minibert": (minibert_stepper, {}),
    "minibert packed": (minibert_stepper, {}),
    "minibert padded": (minibert_stepper, {"pack_tokens": False}),
    "minibert, CUDA graphs": (minibert_stepper, {"cuda_graph_impl": "local"}),
    "minibert packed, CUDA graphs": (minibert_stepper, {"cuda_graph_impl": "local"}),
    SPARSE: (minibert_stepper, {"cuda_graph_impl": "local", "sparse_mlm": True}),
    "HF eager": (hf_stepper, {}),
    "HF compiled": (lambda cfg, batches, device: hf_stepper(cfg, batches, device, compiled=True), {}),
}


def attempt(graphed, label, measurement):
    """-> (measurement(), no rows). A --cuda-graph-impl local contender (graphed) that raises gives (None, a
    row saying how it failed) instead: the graphs were first written without a GPU at hand, so their first
    runs may fail, and the bench then goes on with the other contenders. Any other failure raises."""
    try:
        return measurement(), []
    except Exception as error:
        if not graphed:
            raise
        message = " ".join(str(error).split())[:400]
        return None, print_rows([row(f"{label}: failed", "failed", "", f"{type(error).__name__}: {message}")])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(contender, cfg, batches, settings) -> Measurement:
    """Warm-up steps, then the timed ones, over batches[0:], cfg.num_micro_batches per step."""
    device, m = settings.device, cfg.num_micro_batches
    build, overrides = CONTENDERS[contender]
    cfg = Config(**{**vars(cfg), **overrides})
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(SEED)
    timed = batches[settings.warmup * m:(settings.warmup + settings.steps) * m]
    # --cuda-graph-impl local captures one graph per micro-batch shape, the first time it meets it (a
    # one-time cost, like compiling): a first pass over the timed batches meets every shape they have.
    # The largest first: the graphs share one memory pool, and a graph captured after a larger one fits
    # in the blocks that one freed, where one captured before it would leave a smaller hole behind
    prime = sorted(timed, key=lambda b: int((b["padding_mask"] == 1).sum()), reverse=True) \
        if cfg.cuda_graph_impl == "local" else []
    step = build(cfg, prime + list(batches), device)
    for _ in range(len(prime) // m + settings.warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(settings.steps):
        loss = step()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    loss = float(loss)
    if not np.isfinite(loss):
        raise RuntimeError(f"{contender}: the loss is {loss} after {settings.warmup + settings.steps} steps")
    lengths = [(b["padding_mask"] == 1).sum(dim=1) for b in timed]  # [b] real tokens per sample
    flops = sum(batch_flops(cfg, real, int(b["loss_mask"].sum())) for b, real in zip(timed, lengths))
    del step
    if contender == "HF compiled":
        torch.compiler.reset()  # drop the compiled graphs (and the model they hold)
    return Measurement(seconds, settings.steps, sum(len(b["text"]) for b in timed),
                       sum(int(real.sum()) for real in lengths), flops, peak, loss)


def contenders_for(names, settings):
    if settings.only is not None:
        names = [n for n in names if n in settings.only]
    if settings.device.type == "cpu":
        print("  HF compiled: skipped on the CPU", flush=True)
        names = [n for n in names if "compiled" not in n]
        print("  minibert with CUDA graphs: skipped on the CPU", flush=True)
        names = [n for n in names if "CUDA graphs" not in n]
    return names


def batches_needed(cfg, settings):
    return (settings.warmup + settings.steps) * cfg.num_micro_batches


# ---------------------------------------------------------------- rows
def row(name, value, unit, notes=""):
    return {"name": name, "value": value, "unit": unit, "notes": notes}


def throughput_rows(label, contender, result: Measurement, settings, full=True):
    ms = 1e3 * result.seconds / result.steps
    how = f"{ms:.1f} ms/step, {result.steps} timed steps after {settings.warmup} warm-up; loss {result.loss:.3f}"
    if contender == "minibert":
        how += "; packed micro-batches (the trainer's default)"
    elif "CUDA graphs" in contender:
        how += "; --cuda-graph-impl local: one graph replay per micro-batch, captured before the timed steps"
    rows = [row(f"{label}: {contender}, seq/s", result.samples / result.seconds, "seq/s", how)]
    if full:
        mfu = result.tflops * 1e12 / PEAK_FLOPS
        rows += [row(f"{label}: {contender}, real tokens/s", result.tokens_per_s, "tok/s"),
                 row(f"{label}: {contender}, model TFLOP/s", result.tflops, "TFLOP/s",
                     "docs/measuring.md formula, r = " + ("the masked share, the work done" if contender == SPARSE
                                                          else "1")),
                 row(f"{label}: {contender}, MFU", 100 * mfu, "%",
                     f"of 790e12 (bf16 matmul measured on the H200); {100 * mfu * PEAK_FLOPS / DATASHEET_FLOPS:.1f}% "
                     "of the 989e12 datasheet")]
    if result.peak_bytes is not None:
        rows.append(row(f"{label}: {contender}, peak memory", result.peak_bytes / 2 ** 30, "GiB",
                        "torch.cuda.max_memory_allocated, reset per contender"))
    return rows


def ratio_rows(label, results, mine="minibert"):
    rows = []
    if mine not in results:  # not run (--contenders) or failed
        return rows
    for peer in ("HF eager", "HF compiled"):
        if peer in results:
            ratio = results[mine].samples / results[mine].seconds / (results[peer].samples / results[peer].seconds)
            rows.append(row(f"{label}: {mine} / {peer}", ratio, "x", "seq/s ratio (> 1: minibert is faster)"
                            + ("; " + SPARSE_NOTE if mine == SPARSE else "")))
    return rows


# ---------------------------------------------------------------- sections
def full_length_section(name, settings, full=True):
    cfg = minibert_config(name, settings)
    layers, hidden, heads, seq, micro = shape(name, settings)
    label = f"{model_label(name, settings)} full-length"
    prefix, _ = corpus_prefix("default", settings)
    batches = stream_batches(prefix, batches_needed(cfg, settings), micro, seq, settings.device)
    results, rows = {}, []
    for contender in contenders_for(["minibert", "minibert, CUDA graphs", SPARSE, "HF eager", "HF compiled"],
                                    settings):
        result, failed = attempt("CUDA graphs" in contender, f"{label}: {contender}",
                                 lambda: measure(contender, cfg, batches, settings))
        rows += failed
        if result is None:
            continue
        results[contender] = result
        rows += print_rows(throughput_rows(label, contender, results[contender], settings, full))
    for mine in ("minibert", "minibert, CUDA graphs", SPARSE):
        rows += print_rows(ratio_rows(label, results, mine=mine))
    if SPARSE in results and "minibert, CUDA graphs" in results:
        sparse, dense = (results[n].samples / results[n].seconds for n in (SPARSE, "minibert, CUDA graphs"))
        rows += print_rows([row(f"{label}: --sparse-mlm's gain with graphs", sparse / dense, "x",
                                "seq/s ratio, the same batches")])
    return rows, results


def section_1(settings):
    rows, results = full_length_section("large", settings)
    settings.full_length.update({name: r.tokens_per_s for name, r in results.items()})
    return rows


def share_rows(label, reference, cfg, batches, settings):
    """For each contender (reference: contender -> its family's full-length run): its real tokens/s on
    these batches, and that as a share of the full-length run's (the eager one where the graphed failed)."""
    rows = []
    for contender, full_length in reference.items():
        result, failed = attempt("CUDA graphs" in contender, f"{label}: {contender}",
                                 lambda: measure(contender.replace(" + mask", ""), cfg, batches, settings))
        rows += failed
        if result is None:
            continue
        ms = 1e3 * result.seconds / result.steps
        rows += print_rows([row(f"{label}: {contender}, real tokens/s", result.tokens_per_s, "tok/s",
                                f"{ms:.1f} ms/step; loss {result.loss:.3f}")])
        if full_length not in settings.full_length:
            full_length = "minibert"  # the graphed full-length run failed: the eager one instead
        rows += print_rows([
            row(f"{label}: {contender}, real tokens/s vs full-length",
                100 * result.tokens_per_s / settings.full_length[full_length], "%",
                f"of {full_length}'s real tokens/s on full-length batches"
                + ("; target >= 90%" if contender.startswith("minibert packed") else ""))])
    return rows


def full_length_rows(contenders, label, cfg, settings, into, note):
    """Each contender on full-length batches (section 1's) at cfg: its real tokens/s goes into `into`
    (contender -> tok/s), the reference of section 2's shares; -> its rows (note(result): their notes)."""
    layers, hidden, heads, seq, micro = shape("large", settings)
    default_prefix, _ = corpus_prefix("default", settings)
    count, rows = batches_needed(cfg, settings), []
    for contender in contenders:
        result, failed = attempt("CUDA graphs" in contender, f"{label}: {contender}",
                                 lambda: measure(contender, cfg, stream_batches(default_prefix, count, micro, seq,
                                                                                settings.device), settings))
        rows += failed
        if result is None:
            continue
        into[contender] = result.tokens_per_s
        rows += print_rows([row(f"{label}: {contender}, real tokens/s", result.tokens_per_s, "tok/s",
                                note(result))])
    return rows


def section_2(settings):
    """Padded batches; each contender's real tokens/s against its family's full-length run (section 1's,
    or measured here on the same full-length batches when section 1 is not run): eager against eager,
    graphed against graphed."""
    cfg = minibert_config("large", settings)
    layers, hidden, heads, seq, micro = shape("large", settings)
    count, model, device = batches_needed(cfg, settings), model_label("large", settings), settings.device
    default_prefix, _ = corpus_prefix("default", settings)
    rows = []
    # each contender against its own family's full-length run: the graphed one against the graphed run,
    # so that a host that slows the eager steps does not inflate the graphed shares
    reference = {"minibert packed": "minibert", "minibert padded": "minibert", "HF eager + mask": "HF eager",
                 "minibert packed, CUDA graphs": "minibert, CUDA graphs"}
    named = contenders_for([c.replace(" + mask", "") for c in reference], settings)  # --contenders, the CPU
    reference = {c: full for c, full in reference.items() if c.replace(" + mask", "") in named}
    missing = [c for c in dict.fromkeys(reference.values()) if c not in settings.full_length]  # no section 1
    rows += full_length_rows(missing, f"{model} full-length reference", cfg, settings, settings.full_length,
                             lambda result: "section 1's batches, measured here")
    long_prefix, long_note = corpus_prefix("long", settings)
    low = seq // 4  # U[128, 512] at s512
    lengths = np.random.default_rng(SEED + 1).integers(low, seq + 1, count * micro)
    datasets = [("Megatron samples, long-document corpus", megatron_batches(long_prefix, count, cfg, device),
                 long_note),
                ("Megatron samples, default corpus", megatron_batches(default_prefix, count, cfg, device), ""),
                (f"synthetic lengths U[{low},{seq}]", stream_batches(default_prefix, count, micro, seq, device,
                                                                   lengths), "padding after the length")]
    for what, batches, note in datasets:
        label = f"{model}, {what}"
        real = mean_real_tokens(batches)
        median, histogram = length_histogram_notes(batches, seq)
        rows += print_rows([row(f"{label}: mean real tokens per sample", real, "tokens",
                                f"{real / seq:.0%} of the {seq} positions" + (f"; {note}" if note else "")),
                            row(f"{label}: length histogram, median real tokens per sample", median, "tokens",
                                histogram)])
        rows += share_rows(label, reference, cfg, batches, settings)
    packed = {contender: full for contender, full in reference.items() if contender.startswith("minibert packed")}
    rows += equal_tokens_rows(settings, mean_real_tokens(datasets[1][1]), packed) if packed else []
    # with accumulation: the graphed contender where it runs (the eager step is host-paced at the default
    # corpus's size, chapter 8, section 6); else the eager one (the CPU)
    accumulating = {c: full for c, full in packed.items() if "CUDA graphs" in c} or packed
    return rows + (accumulated_rows(settings, accumulating) if accumulating else [])


def equal_tokens_rows(settings, real, references):
    """The default corpus again, its micro-batch raised so that it holds about the full-length run's real
    tokens (seq x micro): what a user of packing would do with short documents. At micro-batch 32 the
    default corpus's step is ~2.6k real tokens, too little work to fill the GPU, whatever the padding.
    real: the default corpus's mean real tokens per sample; references: section 2's packed contenders."""
    layers, hidden, heads, seq, micro = shape("large", settings)
    equal = max(micro, int(round(micro * seq / real)))
    cfg = minibert_config("large", settings, micro_batch_size=equal, global_batch_size=equal)
    default_prefix, _ = corpus_prefix("default", settings)
    batches = megatron_batches(default_prefix, batches_needed(cfg, settings), cfg, settings.device)
    label = f"{model_label('large', settings).rsplit(' b', 1)[0]} b{equal}, Megatron samples, default corpus"
    real_tokens = np.mean([float((b["padding_mask"] == 1).sum()) for b in batches])
    rows = print_rows([row(f"{label}: real tokens per micro-batch", real_tokens, "tokens",
                           f"micro-batch {equal} = {micro} x {seq} / {real:.1f} mean real tokens per sample, "
                           f"against {micro * seq} in the full-length run")])
    return rows + share_rows(label, references, cfg, batches, settings)


def accumulated_rows(settings, references):
    """The default corpus at micro-batch 32 again, with ACCUMULATION micro-batches per optimizer step (global
    batch 256, the original BERT's), against the full-length run with the same accumulation: how a real
    pretraining run spreads the optimizer's fixed cost over its micro-batches, on both sides of the ratio.
    references: section 2's packed contenders -> their full-length families."""
    layers, hidden, heads, seq, micro = shape("large", settings)
    accumulation = 2 if settings.tiny else ACCUMULATION  # the CPU test: the rows, not the numbers
    cfg = minibert_config("large", settings, global_batch_size=micro * accumulation)
    count, device = batches_needed(cfg, settings), settings.device
    default_prefix, _ = corpus_prefix("default", settings)
    label = f"{model_label('large', settings)} x{accumulation} micro-batches per step"
    accumulated = replace(settings, full_length={})  # the full-length references at this global batch
    rows = full_length_rows(dict.fromkeys(references.values()), f"{label}, full-length", cfg, settings,
                            accumulated.full_length, lambda result: f"{1e3 * result.seconds / result.steps:.1f} "
                                                                    f"ms/step; global batch {cfg.global_batch_size}")
    batches = megatron_batches(default_prefix, count, cfg, device)
    return rows + share_rows(f"{label}, Megatron samples, default corpus", references, cfg, batches, accumulated)


def section_3(settings):
    return full_length_section("base", settings, full=False)[0]


def section_4(settings):
    """make train-small: the trainer's step on Megatron's seq-128 samples; fp32 as the Makefile, then bf16."""
    layers, hidden, heads, seq, micro = shape("small", settings)
    global_batch = micro if settings.tiny else SMALL_GLOBAL_BATCH  # tiny: one micro-batch per step
    base = dict(global_batch_size=global_batch, lr=1e-4, min_lr=1e-5, lr_warmup_fraction=0.1, train_iters=200,
                lr_decay_iters=100, bf16=False)
    label = f"train-small (l{layers} h{hidden} s{seq}, micro {micro}, global {global_batch})"
    prefix, _ = corpus_prefix("default", settings)
    graphs = [False, True] if settings.device.type == "cuda" else [False]  # CUDA graphs need a GPU
    rows = []
    for graphed in graphs:
        how = {"cuda_graph_impl": "local"} if graphed else {}
        name = ", --cuda-graph-impl local" if graphed else ""
        for precision in ("fp32", "bf16"):
            cfg = minibert_config("small", settings, **{**base, **how, "bf16": precision == "bf16"})
            batches = megatron_batches(prefix, batches_needed(cfg, settings), cfg, settings.device)
            result, failed = attempt(graphed, f"{label}{name}, {precision}",
                                     lambda: measure("minibert", cfg, batches, settings))
            rows += failed
            if result is None:
                continue
            target = "; target <= 15 ms on the H200" if precision == "fp32" else ""
            layout = ("packed micro-batches, rows rounded up to a multiple of 128, one graph replay each" if graphed
                      else "packed micro-batches")
            rows += print_rows([row(f"{label}{name}, {precision}: ms per iteration, pre-built batches",
                                    1e3 * result.seconds / result.steps, "ms",
                                    f"train_step only; {layout}; {result.tokens_per_s:,.0f} real tokens/s{target}")])
    # the same fp32 step fed by the trainer's DataLoader (worker processes making Megatron's samples)
    for graphed in graphs:
        how = {"cuda_graph_impl": "local"} if graphed else {}
        name = ", --cuda-graph-impl local" if graphed else ""
        cfg = minibert_config("small", settings, **{**base, **how, "num_workers": None, "data_path": [prefix]})
        ms, failed = attempt(graphed, f"{label}{name}, fp32, through the DataLoader",
                             lambda: dataloader_ms_per_iteration(cfg, prefix, settings, graphed))
        rows += failed
        if ms is None:
            continue
        rows += print_rows([row(f"{label}{name}, fp32: ms per iteration, through the DataLoader", ms, "ms",
                                f"{cfg.num_workers} DataLoader worker processes (the trainer's default on "
                                f"this device, as make train-small)")])
    return rows


def dataloader_ms_per_iteration(cfg, prefix, settings, graphed):
    """ms per train_step fed by the trainer's own DataLoader (its worker processes make the samples)."""
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    loader = PrefetchingBatches(build_data_iterator(train_ds, 0, cfg, settings.device))
    model, optimizer, scheduler = build_as_trainer(cfg, settings.device)
    for _ in range(settings.warmup + (settings.steps if graphed else 0)):  # graphs: meet the row counts
        train_step(model, optimizer, scheduler, loader, cfg, settings.device)
    synchronize(settings.device)
    start = time.perf_counter()
    for _ in range(settings.steps):
        train_step(model, optimizer, scheduler, loader, cfg, settings.device)
    synchronize(settings.device)
    return 1e3 * (time.perf_counter() - start) / settings.steps


# Section 5: what each fused kernel buys, the trainer with it and without it (its plain twin), same batches.
LEVERS = {  # contender -> the flags it turns off
    "minibert (all fusions)": {},
    "minibert --no-bias-dropout-fusion": {"bias_dropout_fusion": False},
    "minibert --no-cross-entropy-loss-fusion": {"cross_entropy_loss_fusion": False},
    "minibert, both off (the plain twins)": {"bias_dropout_fusion": False, "cross_entropy_loss_fusion": False},
    "minibert --no-residual-layernorm-fusion": {"residual_layernorm_fusion": False},
}
LEVERS_GRAPHED = {  # the same with CUDA graphs, where the host's launch cost is gone
    "minibert, CUDA graphs": {},
    "minibert, CUDA graphs --no-residual-layernorm-fusion": {"residual_layernorm_fusion": False},
    "minibert, CUDA graphs --no-adam-fusion": {"adam_fusion": False},
}


def section_5(settings):
    """BERT-large and BERT-base full-length: seq/s with every lever, without each, without both."""
    if settings.device.type == "cpu":  # the fused kernels run on a GPU only: on the CPU all four are one path
        print("  levers: skipped on the CPU (the fused kernels run only on a GPU in fp16/bf16)", flush=True)
        return []
    rows = []
    for name in ("large", "base"):
        cfg = minibert_config(name, settings)
        layers, hidden, heads, seq, micro = shape(name, settings)
        label = f"{model_label(name, settings)} full-length"
        prefix, _ = corpus_prefix("default", settings)
        batches = stream_batches(prefix, batches_needed(cfg, settings), micro, seq, settings.device)
        speed = {}
        graphed = {lever: {"cuda_graph_impl": "local", **flags} for lever, flags in LEVERS_GRAPHED.items()}
        for lever, flags in {**LEVERS, **graphed}.items():
            result = measure("minibert", Config(**{**vars(cfg), **flags}), batches, settings)
            speed[lever] = result.samples / result.seconds
            ms = 1e3 * result.seconds / result.steps
            rows += print_rows([row(f"{label}: {lever}, seq/s", speed[lever], "seq/s",
                                    f"{ms:.1f} ms/step; loss {result.loss:.3f}; peak "
                                    f"{result.peak_bytes / 2 ** 30:.1f} GiB")])
        full = speed["minibert (all fusions)"]
        for lever in list(LEVERS)[1:]:
            rows += print_rows([row(f"{label}: all fusions / {lever.replace('minibert ', '')}", full / speed[lever],
                                    "x", "seq/s ratio: the gain of what that contender turns off")])
        base = "minibert, CUDA graphs"
        for lever in list(LEVERS_GRAPHED)[1:]:
            flag = lever.replace(base + " ", "")
            rows += print_rows([row(f"{label}: all fusions / {flag}, both with CUDA graphs",
                                    speed[base] / speed[lever], "x", "seq/s ratio: the gain of what that "
                                    "contender turns off, host launch cost gone")])
    return rows


SECTIONS = {1: section_1, 2: section_2, 3: section_3, 4: section_4, 5: section_5}


# ---------------------------------------------------------------- entry points
def versions():
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return (f"torch {torch.__version__}, transformers {transformers.__version__}, triton {triton_version}, "
            f"CUDA {torch.version.cuda}, Python {platform.python_version()}")


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"


def print_rows(rows):
    """Print each row as bench/run.py does ("  name | value | unit | notes") and return them."""
    for r in rows:
        print("  " + " | ".join([r["name"], format_value(r["value"]), r["unit"], r["notes"]]), flush=True)
    return rows


def format_value(value):  # as bench/run.py writes its tables
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def run(sections=(1, 2, 3, 4, 5), quick=False, device="cuda", tiny=False, corpus=None, long_corpus=None,
        work_dir=None, command="make bench (bench/run.py)", only=None):
    """The rows of the chosen sections; the first row records the versions, the device and the command.
    only: the contenders to run (names of CONTENDERS; None: every one a section has)."""
    unknown = sorted(set(only or ()) - set(CONTENDERS))
    if unknown:
        raise UsageError(f"--contenders: no contender {unknown[0]!r}; the names are: " + "; ".join(CONTENDERS))
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("bench/train_bench.py needs a CUDA GPU; on the CPU run --device cpu --tiny")
    if device.type == "cpu" and not tiny:
        raise UsageError("--device cpu runs only the --tiny shapes (BERT-large would take hours)")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # as train.setup: fp32 matmuls on tensor cores (section 4)
        torch.backends.cudnn.allow_tf32 = True
    for path in (corpus, long_corpus):
        if path is not None and not (os.path.isfile(path + ".idx") or os.path.isfile(path)):
            raise UsageError(f"{path}: neither a .bin/.idx prefix nor a text file (one document per line)")
    warmup, steps = STEPS["tiny" if tiny else "quick" if quick else "full"]
    keep = work_dir is not None
    work_dir = work_dir or tempfile.mkdtemp(prefix="train_bench_")
    os.makedirs(work_dir, exist_ok=True)
    settings = Settings(device, tiny, warmup, steps, corpus, long_corpus, work_dir,
                        only=tuple(only) if only is not None else None)
    rows = print_rows([row("setup", versions(), "", f"{device_name(device)}; command: {command}")])
    try:
        for number in sorted(sections):
            print(f"== section {number}: {TITLES[number]}" + (" (tiny shapes)" if tiny else ""), flush=True)
            rows += SECTIONS[number](settings)
    finally:
        if not keep:
            shutil.rmtree(work_dir, ignore_errors=True)
    return rows


def markdown(rows, title="Training throughput (bench/train_bench.py)"):
    lines = [f"## {title}", "", f"- {rows[0]['value']}", f"- {rows[0]['notes']}",
             f"- date: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC", "",
             "| measurement | value | unit | notes |", "|---|---|---|---|"]
    lines += ["| " + " | ".join([r["name"], format_value(r["value"]), r["unit"], r["notes"]]) + " |"
              for r in rows[1:]]
    return "\n".join(lines) + "\n"


@exit_on_usage_error
def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--sections", default="1,2,3,4,5", help="comma-separated section numbers (1-5)")
    parser.add_argument("--quick", action="store_true", help=f"{STEPS['quick'][0]} warm-up + {STEPS['quick'][1]} "
                        f"timed steps per contender instead of {STEPS['full'][0]} + {STEPS['full'][1]}")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny only)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, 1 warm-up + 1 timed step (the CPU test)")
    parser.add_argument("--corpus", default=None, help="the default corpus: a .bin/.idx prefix or a text file, "
                        "one document per line (default: python -m minibert.data.corpus, preprocessed here)")
    parser.add_argument("--long-corpus", default=None, help="the long-document corpus, likewise (default: "
                        "minibert.data.corpus --long-documents where this checkout has it, else the default corpus)")
    parser.add_argument("--work-dir", default=None, help="keep the preprocessed corpora here and reuse them "
                        "(default: a temporary directory, removed at the end)")
    parser.add_argument("--output", default=None, help="also write the rows as a markdown section to this file")
    parser.add_argument("--contenders", default=None, help="run only these contenders, names separated by ';' "
                        "(e.g. 'minibert, CUDA graphs;HF compiled': a short GPU call; default: all)")
    args = parser.parse_args(argv)
    try:
        sections = sorted({int(s) for s in args.sections.split(",")})
    except ValueError:
        raise UsageError(f"--sections {args.sections!r}: give numbers from 1 to 5, e.g. --sections 1,3") from None
    if not set(sections) <= set(SECTIONS):
        raise UsageError(f"--sections {args.sections!r}: the sections are 1, 2, 3, 4 and 5")
    command = "python bench/train_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    only = [n.strip() for n in args.contenders.split(";")] if args.contenders else None
    rows = run(sections, args.quick, args.device, args.tiny, args.corpus, args.long_corpus, args.work_dir,
               command.strip(), only)
    if args.output:
        from minibert.atomic import atomic_write
        text = markdown(rows)
        atomic_write(args.output, lambda f: f.write(text), text=True, make_dirs=True)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
