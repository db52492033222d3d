"""Checking a Config: the one place that says what is wrong with a command line, and how to fix it.

`validate(cfg, world_size, device_type)` checks a config for a run of that many processes on that
device, fills the values derived from it (the preset's sizes, the global batch, the data-parallel size,
the LR decay length, the vocab size, the CPU fallbacks) and raises a UsageError naming the fix for the
first problem it finds. It needs no process group, so every rank checks its flags before the first
collective, and a bad layout exits 2 instead of hanging. minibert.tools.plan lists every layout problem at
once and then asks this function about the rest (it refuses exactly what this refuses). Megatron-LM's
counterpart is `validate_args` in megatron/training/arguments.py, one assert at a time."""
import math
import os
import sys

from minibert.config import PRESETS, Config, _flag_name, parse_split
from minibert.errors import UsageError
from minibert.training.save_lock import check_save_owner


def _warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


# Every numeric flag and the values it may take, checked once, first: (lowest, highest, "[" or "(" for
# each end: included or not); None = no bound. A flag left at None (not given, no default) is not checked.
POSITIVE, AT_LEAST_0 = (0, None, "(", ")"), (0, None, "[", ")")
PROBABILITY, BELOW_1 = (0, 1, "[", "]"), (0, 1, "[", ")")
RANGES = {
    **dict.fromkeys(["num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
                     "ffn_hidden_size", "make_vocab_size_divisible_by", "layernorm_epsilon", "init_method_std",
                     "recompute_num_layers", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
                     "decoder_last_pipeline_num_layers", "distributed_timeout_minutes", "ddp_bucket_size",
                     "micro_batch_size", "global_batch_size", "train_iters", "lr_decay_iters", "adam_eps",
                     "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "save_interval",
                     "exit_interval", "eval_interval", "log_interval", "profile_step_end",
                     "fp8_amax_history_len"], POSITIVE),
    **dict.fromkeys(["lr", "min_lr", "lr_warmup_iters", "weight_decay", "clip_grad", "eval_iters", "num_workers",
                     "profile_step_start", "fp8_margin"], AT_LEAST_0),  # --clip-grad 0: no clipping
    **dict.fromkeys(["hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2"], BELOW_1),
    **dict.fromkeys(["lr_warmup_fraction", "short_seq_prob", "mask_prob"], PROBABILITY),
    "seed": (0, 2 ** 32 - 1, "[", "]"),  # numpy's generators take seeds in [0, 2^32)
}


def check_ranges(cfg: Config):
    """UsageError for the first numeric flag outside its range (RANGES), NaN and infinities included."""
    for name, (low, high, left, right) in RANGES.items():
        value = getattr(cfg, name)
        if value is None:
            continue
        inside = math.isfinite(value) and (low is None or value > low or (left == "[" and value == low)) and \
            (high is None or value < high or (right == "]" and value == high))
        if inside:
            continue
        if (low, high, left) == (0, None, "("):
            rule = "must be positive"
        elif high is None:
            rule = f"must be at least {low}"
        else:
            rule = f"must be in {left}{low}, {high}{right}"
        raise UsageError(f"{_flag_name(name)} {value} {rule}" +
                         (" (0 disables clipping)" if name == "clip_grad" else ""))


def validate(cfg: Config, world_size: int = 1, device_type: str = "cpu", warn=_warn) -> Config:
    """Check a config for a run of `world_size` processes on `device_type`, fill every derived value in
    place (the one place that does), and return it. Raises UsageError naming the fix. `warn(message)` is
    called for each change made for this machine (None: silently). Needs no process group, so every
    rank checks its flags before the first collective and a bad layout exits instead of hanging."""
    warn = warn or (lambda message: None)
    if cfg.preset is not None:  # explicit flags win over the preset's
        for name, value in PRESETS[cfg.preset].items():
            if getattr(cfg, name) is None:
                setattr(cfg, name, value)
    for name in ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "lr"]:
        if getattr(cfg, name) is None:
            raise UsageError(f"{_flag_name(name)} is required")
    check_ranges(cfg)
    if cfg.hidden_size % cfg.num_attention_heads:
        raise UsageError(f"--hidden-size {cfg.hidden_size} must be divisible by "
                         f"--num-attention-heads {cfg.num_attention_heads}")
    if cfg.seq_length > cfg.max_positions:
        raise UsageError(f"--seq-length {cfg.seq_length} is larger than --max-position-embeddings "
                         f"{cfg.max_positions}: raise --max-position-embeddings or lower --seq-length")
    if cfg.fp16 and cfg.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive: pick one")
    if cfg.min_lr > cfg.lr:
        raise UsageError(f"--min-lr {cfg.min_lr} must be at most --lr {cfg.lr} (the LR decays to it)")
    if cfg.min_loss_scale > cfg.initial_loss_scale:
        raise UsageError(f"--min-loss-scale {cfg.min_loss_scale} must be at most --initial-loss-scale "
                         f"{cfg.initial_loss_scale}")
    if cfg.lr_warmup_fraction is not None and cfg.lr_warmup_iters:
        raise UsageError("--lr-warmup-fraction and --lr-warmup-iters are exclusive: pick one")
    parse_split(cfg.split)
    if cfg.data_path is not None:
        from minibert.data.blended_dataset import (
            parse_data_path,  # one prefix, or weights and prefixes
        )
        parse_data_path(cfg.data_path)
    _validate_layout(cfg, world_size, warn)
    if cfg.recompute_granularity == "full" and cfg.recompute_method is None:
        raise UsageError("--recompute-granularity full needs --recompute-method uniform or block "
                         "(and --recompute-num-layers, default 1)")
    if cfg.global_batch_size is None:
        cfg.global_batch_size = cfg.micro_batch_size * cfg.data_parallel_size
    if cfg.global_batch_size % (cfg.micro_batch_size * cfg.data_parallel_size):
        raise UsageError(f"--global-batch-size {cfg.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x data-parallel size = {cfg.micro_batch_size} x "
                         f"{cfg.data_parallel_size}")
    if cfg.virtual_pipeline_size > 1 and cfg.num_micro_batches % cfg.pipeline_model_parallel_size:
        raise UsageError(f"the interleaved schedule needs the micro-batches per step ({cfg.num_micro_batches}) "
                         f"to be a multiple of --pipeline-model-parallel-size {cfg.pipeline_model_parallel_size}: "
                         "change --global-batch-size or --micro-batch-size")
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = cfg.train_iters
    warmup_iters = (cfg.lr_warmup_fraction * cfg.lr_decay_iters if cfg.lr_warmup_fraction is not None
                    else cfg.lr_warmup_iters)
    if cfg.lr_decay_iters <= 0 or warmup_iters >= cfg.lr_decay_iters:
        raise UsageError(f"the LR warmup ({warmup_iters:g} iterations) must be shorter than --lr-decay-iters "
                         f"{cfg.lr_decay_iters}: lower --lr-warmup-iters / --lr-warmup-fraction or raise "
                         "--lr-decay-iters")
    _validate_save(cfg)
    _validate_for_device(cfg, device_type, warn)
    _validate_fp8(cfg, device_type)
    _validate_cuda_graph(cfg, device_type, warn)
    from minibert.data.tokenizer import (
        build_tokenizer,  # the vocab's size sizes the embedding
    )
    cfg.vocab_size = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file).vocab_size
    return cfg


def _validate_layout(cfg: Config, world_size: int, warn):
    """TP x PP x DP: the sizes divide the world, the layers and the matrices (Megatron's checks)."""
    from minibert.parallel.state import check_sizes
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    cfg.data_parallel_size = check_sizes(world_size, tp, pp)
    if cfg.sequence_parallel and tp == 1:  # as Megatron: nothing to split the sequence over
        warn("--sequence-parallel needs --tensor-model-parallel-size > 1; running without it")
        cfg.sequence_parallel = False
    if cfg.pack_tokens and (pp > 1 or cfg.sequence_parallel):
        warn("packed micro-batches are off: pipeline and sequence parallelism need fixed [micro batch, "
             "sequence] shapes (the padded layout runs; --no-pack-tokens silences this)")
        cfg.pack_tokens = False
    if cfg.sequence_parallel and cfg.seq_length % tp:
        raise UsageError(f"--sequence-parallel: --seq-length {cfg.seq_length} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")
    lps = cfg.num_layers_per_virtual_pipeline_stage
    if lps is not None and cfg.pipeline_schedule == "afab":
        raise UsageError("--pipeline-schedule afab has no interleaved form: drop "
                         "--num-layers-per-virtual-pipeline-stage or use the default 1f1b")
    if lps is not None and (pp < 2 or lps <= 0 or cfg.num_layers % (pp * lps)):
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {lps}: the interleaved schedule needs "
                         f"--pipeline-model-parallel-size >= 2 and --num-layers {cfg.num_layers} divisible by "
                         f"PP x {lps}")
    from minibert.parallel.schedules import layer_ranges
    try:
        layer_ranges(cfg.num_layers, pp, cfg.virtual_pipeline_size, cfg.decoder_first_pipeline_num_layers,
                     cfg.decoder_last_pipeline_num_layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for name in ("num_attention_heads", "hidden_size", "ffn_size"):
        if getattr(cfg, name) % tp:
            flag = "--ffn-hidden-size" if name == "ffn_size" else _flag_name(name)
            raise UsageError(f"{flag} {getattr(cfg, name)} must be divisible by --tensor-model-parallel-size {tp}")


def _validate_save(cfg: Config):
    """--save must be a directory this process can create or write, known before any training time is spent."""
    if cfg.save is None:
        return
    if os.path.exists(cfg.save) and not os.path.isdir(cfg.save):
        raise UsageError(f"--save {cfg.save} is a file, not a directory: name a directory for the checkpoints")
    existing = os.path.abspath(cfg.save)
    while not os.path.exists(existing):  # the nearest folder that exists: the checkpoints go under it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--save {cfg.save}: cannot write under {existing}: name a directory you can write")
    check_save_owner(cfg.save, cfg.load, cfg.finetune, cfg.overwrite_save)


def _validate_for_device(cfg: Config, device_type: str, warn):
    """The defaults that depend on the machine, and the flags it cannot honour (warned, then changed)."""
    if device_type == "cuda":
        cfg.distributed_backend = cfg.distributed_backend or "nccl"
        cfg.num_workers = 2 if cfg.num_workers is None else cfg.num_workers
        return
    if cfg.fp16:
        warn("--fp16 needs a GPU; running in fp32 on the CPU")
        cfg.fp16 = False
    if cfg.distributed_backend == "nccl":
        warn("--distributed-backend nccl needs GPUs; using gloo on the CPU")
    cfg.distributed_backend = "gloo"
    if cfg.num_workers:
        # on a 2-core machine worker processes made a train-small iteration several times slower
        # (bench/notes/cpu-train-small.md)
        warn(f"--num-workers {cfg.num_workers} -> 0 on the CPU: worker processes would compete with "
             "training for the cores")
    cfg.num_workers = 0


def _validate_cuda_graph(cfg: Config, device_type: str, warn):
    """--cuda-graph-impl local: what a captured micro-batch needs (minibert/fast/cuda_graphs.py says why)."""
    if cfg.cuda_graph_impl == "transformer_engine":
        raise UsageError("--cuda-graph-impl transformer_engine needs NVIDIA Transformer Engine, which minibert "
                         "does not use: pass --cuda-graph-impl local")
    if cfg.cuda_graph_impl != "local":
        return
    if device_type != "cuda":
        raise UsageError("--cuda-graph-impl local needs a CUDA GPU (graphs are a CUDA feature): drop the flag "
                         "on this machine")
    if cfg.tensor_model_parallel_size > 1 or cfg.pipeline_model_parallel_size > 1:
        raise UsageError("--cuda-graph-impl local captures whole micro-batches on one rank's model: use it with "
                         "--tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1 (data parallelism "
                         "is allowed)")
    if cfg.recompute is not None:
        raise UsageError("--cuda-graph-impl local cannot capture activation recompute (it saves and restores "
                         "random-generator states on the host): drop --recompute-* or the graph")
    if cfg.overlap_grad_reduce and cfg.data_parallel_size > 1:
        warn("--overlap-grad-reduce is off with --cuda-graph-impl local: the gradients are reduced after the "
             "last micro-batch's graph")
        cfg.overlap_grad_reduce = False


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 matrix units


def _validate_fp8(cfg: Config, device_type: str):
    """--fp8-format: a bf16 model whose layer matrices the FP8 matrix products can take (minibert/fast/fp8.py),
    on a GPU with FP8 matrix units; on the CPU torch._scaled_mm runs it too (slowly: for tests)."""
    if cfg.fp8_format is None:
        return
    if not cfg.bf16:
        raise UsageError(f"--fp8-format {cfg.fp8_format} runs the layers' matrix products in FP8 inside a bf16 model: "
                         "add --bf16")
    tp = cfg.tensor_model_parallel_size
    for flag, size in (("--hidden-size", cfg.hidden_size), ("--ffn-hidden-size", cfg.ffn_size)):
        if size % (16 * tp):
            raise UsageError(f"--fp8-format: {flag} {size} must be a multiple of 16 x --tensor-model-parallel-size "
                             f"{tp} = {16 * tp} (an FP8 matrix product takes its dimensions in multiples of 16, on "
                             "each tensor-parallel rank)")
    if device_type == "cuda":
        import torch  # here: the config checks load without torch
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
            major, minor = torch.cuda.get_device_capability()
            raise UsageError(f"--fp8-format needs a GPU with FP8 matrix units (compute capability 8.9 or newer: "
                             f"Ada, Hopper); this one has {major}.{minor}: drop --fp8-format")
