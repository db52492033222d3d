"""Checking a Config: the one place that says what is wrong with a command line, and how to fix it.

`validate(cfg, world_size, device_type)` checks a config for a run of that many processes on that
device, fills the values derived from it (the preset's sizes, the global batch, the data-parallel size,
the LR decay length, the vocab size, the CPU fallbacks) and raises a UsageError naming the fix for the
first problem it finds. It needs no process group, so every rank checks its flags before the first
collective, and a bad layout exits 2 instead of hanging. minibert.plan lists every layout problem at
once and then asks this function about the rest (it refuses exactly what this refuses). Megatron-LM's
counterpart is `validate_args` in megatron/training/arguments.py, one assert at a time."""
import sys

from minibert.config import PRESETS, Config, _flag_name, parse_split
from minibert.errors import UsageError


def _warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


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
    for name in ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "log_interval", "eval_interval"]:
        if getattr(cfg, name) <= 0:
            raise UsageError(f"{_flag_name(name)} must be positive")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise UsageError(f"--hidden-size {cfg.hidden_size} must be divisible by "
                         f"--num-attention-heads {cfg.num_attention_heads}")
    if cfg.seq_length > cfg.max_positions:
        raise UsageError(f"--seq-length {cfg.seq_length} is larger than --max-position-embeddings "
                         f"{cfg.max_positions}: raise --max-position-embeddings or lower --seq-length")
    if cfg.fp16 and cfg.bf16:
        raise UsageError("--fp16 and --bf16 are exclusive: pick one")
    if cfg.lr_warmup_fraction is not None and cfg.lr_warmup_iters:
        raise UsageError("--lr-warmup-fraction and --lr-warmup-iters are exclusive: pick one")
    parse_split(cfg.split)
    if cfg.data_path is not None:
        from minibert.blended_dataset import parse_data_path  # one prefix, or weights and prefixes
        parse_data_path(cfg.data_path)
    _validate_layout(cfg, world_size, warn)
    if cfg.recompute_granularity == "full" and cfg.recompute_method is None:
        raise UsageError("--recompute-granularity full needs --recompute-method uniform or block "
                         "(and --recompute-num-layers, default 1)")
    if cfg.recompute_num_layers is not None and cfg.recompute_num_layers <= 0:
        raise UsageError(f"--recompute-num-layers {cfg.recompute_num_layers} must be positive")
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
    if cfg.distributed_timeout_minutes <= 0:
        raise UsageError(f"--distributed-timeout-minutes {cfg.distributed_timeout_minutes} must be positive "
                         "(e.g. 10, or 0.1 for 6 seconds)")
    if cfg.ddp_bucket_size is not None and cfg.ddp_bucket_size <= 0:
        raise UsageError(f"--ddp-bucket-size {cfg.ddp_bucket_size} must be positive (gradient elements)")
    if cfg.compile_layers and cfg.tensor_model_parallel_size > 1:
        raise UsageError("--compile-layers compiles one rank's whole layers; tensor-parallel layers communicate "
                         "inside them: use it with --tensor-model-parallel-size 1")
    _validate_for_device(cfg, device_type, warn)
    _validate_cuda_graph(cfg, device_type, warn)
    from minibert.tokenizer import build_tokenizer  # the vocab's size sizes the embedding
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
        # measured on 2 cores: 1.3 s per train-small iteration with samples built in this process,
        # 4-10 s with 2 worker processes competing with training for the cores
        warn(f"--num-workers {cfg.num_workers} -> 0 on the CPU: worker processes would compete with "
             "training for the cores")
    cfg.num_workers = 0


def _validate_cuda_graph(cfg: Config, device_type: str, warn):
    """--cuda-graph-impl local: what a captured micro-batch needs (minibert/cuda_graphs.py says why)."""
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
