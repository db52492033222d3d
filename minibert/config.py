"""One typed config for model and training, with Megatron-LM's flag names.

Every field is a command-line flag: `num_layers` is `--num-layers`. Defaults are Megatron's, each with
the reason beside it. `parse_args(argv)` builds a Config from the command line and `validate(cfg)` is
the one place that checks a config and says what to change when it is wrong.

The same object configures the model (the notebook builds `Config(num_layers=4, ...)` by hand) and
the trainer (`python minibert/train.py --num-layers 4 ...`)."""
import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from minibert.errors import OneLineArgumentParser, UsageError


def _flag(default, help, **argparse_kwargs):
    return field(default=default, metadata=dict(help=help, **argparse_kwargs))


@dataclass
class Config:
    # ---- model shape (required on the command line) ----
    num_layers: int = _flag(None, "transformer layers (BERT-base 12, BERT-large 24)")
    hidden_size: int = _flag(None, "width h of the residual stream")
    num_attention_heads: int = _flag(None, "heads; hidden_size must divide by it")
    seq_length: int = _flag(None, "tokens per sample, [CLS] and [SEP]s included")
    max_position_embeddings: int = _flag(None, "rows of the position table (default: seq_length)")
    ffn_hidden_size: int = _flag(None, "MLP width (default: 4 x hidden_size, as in BERT)")
    # ---- model details ----
    vocab_size: int = field(default=30522, metadata=dict(help=None))  # set from the tokenizer, not a flag
    make_vocab_size_divisible_by: int = _flag(128, "pad the vocab to a multiple of this x TP (fast matmuls)")
    layernorm_epsilon: float = _flag(1e-5, "Megatron's LayerNorm eps (HF BERT uses 1e-12)")
    init_method_std: float = _flag(0.02, "std of the normal init (output projections: / sqrt(2L))")
    hidden_dropout: float = _flag(0.1, "dropout after attention/MLP outputs and embeddings")
    attention_dropout: float = _flag(0.1, "dropout on the attention probabilities")
    post_ln: bool = _flag(False, "original BERT/HF post-LN with embedding LayerNorm (default: "
                                 "Megatron's pre-LN with a final LayerNorm)")
    bert_no_binary_head: bool = _flag(False, "drop the pooler + sentence-order (SOP) head and its loss")
    attention_backend: str = _flag("auto", "attention implementation",
                                   choices=["auto", "local", "unfused", "fused", "flash"])
    sparse_mlm: bool = _flag(False, "send only masked positions through the LM head (faster; "
                                    "off for Megatron parity)")
    recompute_activations: bool = _flag(False, "recompute layer activations in the backward (saves memory)")
    # ---- parallelism ----
    tensor_model_parallel_size: int = _flag(1, "TP: split each layer's matrices over this many GPUs")
    pipeline_model_parallel_size: int = _flag(1, "PP: split the layers into this many stages")
    distributed_backend: str = _flag("nccl", "torch.distributed backend (CPU falls back to gloo)",
                                     choices=["nccl", "gloo"])
    # ---- batch and schedule ----
    micro_batch_size: int = _flag(None, "samples per forward/backward on one GPU")
    global_batch_size: int = _flag(None, "samples per optimizer step, all GPUs (default: micro x DP)")
    train_iters: int = _flag(None, "optimizer steps")
    lr: float = _flag(None, "peak learning rate")
    min_lr: float = _flag(0.0, "the LR decays to this and stays")
    lr_decay_iters: int = _flag(None, "steps over which the LR decays (default: train_iters)")
    lr_decay_style: str = _flag("linear", "shape of the decay", choices=["linear", "cosine", "constant"])
    lr_warmup_fraction: float = _flag(None, "warmup steps as a fraction of lr_decay_iters")
    lr_warmup_iters: int = _flag(0, "warmup steps (use this or --lr-warmup-fraction)")
    # ---- optimizer ----
    optimizer: str = _flag("adam", "AdamW (decoupled weight decay), as Megatron's 'adam'", choices=["adam"])
    weight_decay: float = _flag(0.01, "decoupled weight decay; biases and LayerNorm weights are exempt")
    clip_grad: float = _flag(1.0, "clip the global grad norm to this (0: no clipping)")
    adam_beta1: float = _flag(0.9, "Adam first-moment decay")
    adam_beta2: float = _flag(0.999, "Adam second-moment decay")
    adam_eps: float = _flag(1e-8, "Adam denominator epsilon")
    # ---- precision ----
    fp16: bool = _flag(False, "fp16 compute with dynamic loss scaling and fp32 master weights")
    bf16: bool = _flag(False, "bf16 compute with fp32 master weights (no loss scaling needed)")
    initial_loss_scale: float = _flag(2.0 ** 32, "fp16: first loss scale")
    min_loss_scale: float = _flag(1.0, "fp16: the scale never drops below this")
    loss_scale_window: int = _flag(1000, "fp16: double the scale after this many clean steps")
    hysteresis: int = _flag(2, "fp16: overflows tolerated before the scale is halved")
    seed: int = _flag(1234, "seeds data sampling, masking, init and dropout")
    # ---- data ----
    data_path: list = _flag(None, "prefix of the .bin/.idx pair (e.g. corpus_text_sentence)", nargs="+")
    split: str = _flag("969, 30, 1", "train, valid, test weights over the documents")
    vocab_file: str = _flag(None, "WordPiece vocab.txt (default: the bundled bert-base-uncased)")
    tokenizer_type: str = _flag("BertWordPieceLowerCase", "tokenizer",
                                choices=["BertWordPieceLowerCase", "BertWordPieceCase"])
    mask_prob: float = _flag(0.15, "fraction of tokens selected for the masked-LM loss")
    short_seq_prob: float = _flag(0.1, "probability of a shorter target length for a sample")
    num_workers: int = _flag(2, "DataLoader worker processes")
    # ---- checkpoints, evaluation, logging ----
    save: str = _flag(None, "directory for checkpoints")
    load: str = _flag(None, "directory to resume from")
    save_interval: int = _flag(None, "save every this many iterations (and at the end)")
    exit_interval: int = _flag(None, "stop (after saving) when iteration % this == 0")
    eval_interval: int = _flag(1000, "evaluate on the validation split every this many iterations")
    eval_iters: int = _flag(100, "validation batches per evaluation")
    log_interval: int = _flag(100, "print a log line every this many iterations")
    tensorboard_dir: str = _flag(None, "write TensorBoard scalars here")

    # ---- derived values (not flags) ----
    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def binary_head(self) -> bool:
        return not self.bert_no_binary_head

    @property
    def padded_vocab_size(self) -> int:
        """Megatron pads the vocab to a multiple of 128 x TP so every shard's matmul is aligned.
        minibert masks the padded columns out of the softmax (model.py), so they never change the loss."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def split_weights(self) -> list:
        return parse_split(self.split)


def parse_split(split: str) -> list:
    """'969, 30, 1' or '969,30,1' -> [969.0, 30.0, 1.0] (Megatron pads missing entries with 0)."""
    try:
        weights = [float(w) for w in split.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--split {split!r} is not a list of numbers: use e.g. --split 969,30,1")
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UsageError(f"--split {split!r}: give up to three non-negative weights with a positive sum, "
                         "e.g. --split 969,30,1")
    return weights + [0.0] * (3 - len(weights))


# Flags whose feature arrives in a later part of the course: accepted, then refused with this reason.
NOT_SUPPORTED_YET = {
    "tensor_model_parallel_size": (lambda v: v != 1, "tensor parallelism (--tensor-model-parallel-size > 1)"),
    "pipeline_model_parallel_size": (lambda v: v != 1, "pipeline parallelism (--pipeline-model-parallel-size > 1)"),
    "recompute_activations": (lambda v: v, "activation recompute (--recompute-activations)"),
}


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Check a config, fill derived defaults in place, and return it. Raises UsageError naming the fix."""
    for name in ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "lr"]:
        if getattr(cfg, name) is None:
            raise UsageError(f"--{name.replace('_', '-')} is required")
    for name, (is_used, what) in NOT_SUPPORTED_YET.items():
        if is_used(getattr(cfg, name)):
            raise UsageError(f"{what} is not supported yet; run without it")
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
    if cfg.data_path is not None and len(cfg.data_path) != 1:
        raise UsageError("--data-path takes one prefix; weighted blends of several datasets are "
                         "not supported yet")
    for name in ["num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "log_interval", "eval_interval"]:
        if getattr(cfg, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    parse_split(cfg.split)
    model_parallel = cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size
    if world_size % model_parallel:
        raise UsageError(f"{world_size} processes cannot be split into TP x PP = {model_parallel} groups")
    dp = world_size // model_parallel
    if cfg.global_batch_size is None:
        cfg.global_batch_size = cfg.micro_batch_size * dp
    if cfg.global_batch_size % (cfg.micro_batch_size * dp):
        raise UsageError(f"--global-batch-size {cfg.global_batch_size} must be a multiple of "
                         f"--micro-batch-size x data-parallel size = {cfg.micro_batch_size} x {dp}")
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = cfg.train_iters
    warmup_iters = (cfg.lr_warmup_fraction * cfg.lr_decay_iters if cfg.lr_warmup_fraction is not None
                    else cfg.lr_warmup_iters)
    if cfg.lr_decay_iters <= 0 or warmup_iters >= cfg.lr_decay_iters:
        raise UsageError(f"the LR warmup ({warmup_iters:g} iterations) must be shorter than --lr-decay-iters "
                         f"{cfg.lr_decay_iters}: lower --lr-warmup-iters / --lr-warmup-fraction or raise "
                         "--lr-decay-iters")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(description="minibert: Megatron-style BERT pretraining",
                            allow_abbrev=False)
    for f in dataclasses.fields(Config):
        if f.metadata.get("help") is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        help_text = f.metadata["help"].replace("%", "%%")  # argparse treats % as a format character
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str, "list": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=help_text, **extra)
    return parser


def parse_args(argv=None) -> Config:
    """Command line -> Config (not yet validated: the trainer validates once it knows the world size)."""
    namespace = build_parser().parse_args(argv)
    return Config(**vars(namespace))
