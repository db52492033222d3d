"""One typed config for model and training, with Megatron-LM's flag names.

Every field is a command-line flag: `num_layers` is `--num-layers`. Defaults are Megatron's, each with
the reason beside it. `parse_args(argv)` builds a Config from the command line and `validate(cfg, ...)`
(minibert/validate.py, importable from here too) is the one place that checks a config, fills the
values derived from it (global batch, vocab size, data-parallel size, the CPU fallbacks) and says what
to change when it is wrong. Nothing else changes a Config.

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
                                   choices=["auto", "local", "fused", "flash"])
    sparse_mlm: bool = _flag(False, "send only masked positions through the LM head (faster; "
                                    "off for Megatron parity)")
    pack_tokens: bool = _flag(True, "run each micro-batch's real tokens packed ([n, h]) through everything but "
                                    "attention, trimmed to its longest sample (exact; off: the padded twin; "
                                    "pipeline and sequence parallelism use the padded layout)",
                              action=argparse.BooleanOptionalAction)
    bias_dropout_fusion: bool = _flag(True, "on a GPU in fp16/bf16, activations of >= 4M elements: dropout + "
                                            "residual add + the next LayerNorm in one Triton kernel "
                                            "(minibert.fast.layer_norm; Megatron's flag name, the bias stays "
                                            "in the matmul); off: the plain ops",
                                      action=argparse.BooleanOptionalAction)
    residual_layernorm_fusion: bool = _flag(True, "pre-LN: the residual add that ends each layer also computes the "
                                                  "next layer's LN1 (the last layer's: the final LayerNorm), in "
                                                  "the kernel of --bias-dropout-fusion on a GPU; the same math, "
                                                  "one launch and one pass fewer per layer (timed in whole "
                                                  "steps: bench/notes/training.md, chapter 8, section 9); no "
                                                  "effect with --post-ln, whose LayerNorms already follow the "
                                                  "add; off: each layer runs its own LN1",
                                            action=argparse.BooleanOptionalAction)
    cross_entropy_loss_fusion: bool = _flag(True, "on a GPU in fp16/bf16: the LM loss in one Triton kernel that "
                                                  "reads the logits once (minibert.fast.cross_entropy; "
                                                  "Megatron's flag, there off by default); off: fp32 cast + "
                                                  "F.cross_entropy",
                                            action=argparse.BooleanOptionalAction)
    adam_fusion: bool = _flag(True, "on a GPU: AdamW and the copy of the updated fp32 masters into the 16-bit "
                                    "weights in one Triton pass (minibert/fast/adamw.py, 30 bytes a "
                                    "parameter); off: PyTorch's fused AdamW, then the copy (38 bytes)",
                              action=argparse.BooleanOptionalAction)
    cuda_graph_impl: str = _flag("none", "local: capture each micro-batch's forward + backward as one CUDA graph "
                                         "per shape and replay it (minibert/fast/cuda_graphs.py; packed rows rounded "
                                         "up to a multiple of --seq-length; TP = PP = 1); none: launch every "
                                         "kernel from Python",
                                 choices=["none", "local", "transformer_engine"])
    preset: str = _flag(None, "fill the model flags of a known size (flags given explicitly win)",
                        choices=["340m", "4b", "20b"])
    # ---- activation recompute ----
    recompute_activations: bool = _flag(False, "selective recompute: redo the attention core in the backward "
                                               "instead of storing its s x s activations")
    recompute_granularity: str = _flag(None, "full: recompute whole layers; selective: as "
                                             "--recompute-activations", choices=["full", "selective"])
    recompute_method: str = _flag(None, "full recompute: uniform (every group of --recompute-num-layers) or "
                                        "block (the first --recompute-num-layers layers of each stage)",
                                  choices=["uniform", "block"])
    recompute_num_layers: int = _flag(None, "layers per recompute group (uniform) or recomputed (block)")
    # ---- parallelism ----
    tensor_model_parallel_size: int = _flag(1, "TP: split each layer's matrices over this many GPUs")
    pipeline_model_parallel_size: int = _flag(1, "PP: split the layers into this many stages")
    sequence_parallel: bool = _flag(False, "with TP: LayerNorm/dropout/residual on a 1/TP slice of the sequence")
    num_layers_per_virtual_pipeline_stage: int = _flag(None, "interleaved 1F1B: layers per model chunk "
                                                             "(each stage holds several chunks)")
    pipeline_schedule: str = _flag("1f1b", "with --pipeline-model-parallel-size > 1 and no virtual stages: "
                                           "1f1b (Megatron's) or afab (all forwards, then all backwards: the "
                                           "simple contrast; minibert's flag)", choices=["1f1b", "afab"])
    decoder_first_pipeline_num_layers: int = _flag(None, "uneven pipeline: layers on the first stage")
    decoder_last_pipeline_num_layers: int = _flag(None, "uneven pipeline: layers on the last stage "
                                                        "(it also runs the LM head)")
    distributed_backend: str = _flag(None, "torch.distributed backend (default: nccl on GPUs, gloo on CPU)",
                                     choices=["nccl", "gloo"])
    distributed_timeout_minutes: float = _flag(10.0, "a collective waiting longer than this fails the run "
                                                      "(a fraction works: 0.1 = 6 s)")
    use_distributed_optimizer: bool = _flag(False, "ZeRO-1: shard fp32 master weights and Adam moments over "
                                                   "data-parallel ranks")
    ddp_bucket_size: int = _flag(None, "gradient elements per all-reduce bucket "
                                       "(default: max(40M, 1M x DP), as Megatron)")
    overlap_grad_reduce: bool = _flag(False, "all-reduce each bucket during the last micro-batch's backward, "
                                             "as soon as its gradients are ready")
    data_parallel_size: int = field(default=1, metadata=dict(help=None))  # world / (TP x PP), set by validate
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
    fp8_format: str = _flag(None, "with --bf16: each transformer layer's four matrix products in FP8 "
                                  "(minibert/fast/fp8.py): e4m3 for every operand, or hybrid (e4m3 for "
                                  "activations and weights, e5m2 for the output gradients); default: off",
                            choices=["e4m3", "hybrid"])
    fp8_recipe: str = _flag("delayed", "FP8 scaling: delayed (each tensor's scale from its amax history of the "
                                       "previous steps) or tensorwise (from the tensor's own amax, computed "
                                       "now)", choices=["delayed", "tensorwise"])
    fp8_amax_history_len: int = _flag(1, "delayed FP8 scaling: steps of amax history kept per tensor")
    fp8_amax_compute_algo: str = _flag("most_recent", "delayed FP8 scaling: the amax a scale is computed from: "
                                                      "the history's max, or its most recent entry",
                                       choices=["max", "most_recent"])
    fp8_margin: int = _flag(0, "FP8 scaling margin: scale = FP8 max / amax / 2^margin")
    seed: int = _flag(1234, "seeds data sampling, masking, init and dropout")
    check_for_nan_in_loss_and_grad: bool = _flag(True, "stop at a non-finite loss or grad norm (off: skip "
                                                       "the update and count a nan iteration)",
                                                 action=argparse.BooleanOptionalAction)
    # ---- data ----
    data_path: list = _flag(None, "prefix of the .bin/.idx pair (e.g. corpus_text_sentence), or a blend: "
                                  "weight prefix weight prefix ...", nargs="+")
    data_cache_path: str = _flag(None, "where the sample indexes are cached (default: beside the data)")
    split: str = _flag("969, 30, 1", "train, valid, test weights over the documents")
    vocab_file: str = _flag(None, "WordPiece vocab.txt (default: the bundled bert-base-uncased)")
    tokenizer_type: str = _flag("BertWordPieceLowerCase", "tokenizer",
                                choices=["BertWordPieceLowerCase", "BertWordPieceCase"])
    mask_prob: float = _flag(0.15, "fraction of tokens selected for the masked-LM loss")
    short_seq_prob: float = _flag(0.1, "probability of a shorter target length for a sample")
    num_workers: int = _flag(None, "DataLoader worker processes (default: 2 on a GPU, 0 on the CPU)")
    # ---- checkpoints, evaluation, logging ----
    save: str = _flag(None, "directory for checkpoints")
    load: str = _flag(None, "directory to resume from")
    overwrite_save: bool = _flag(False, "start over in a --save directory that holds another run's checkpoints: "
                                 "delete them first (without it such a run exits 2 before training)")
    save_interval: int = _flag(None, "save every this many iterations (and at the end)")
    exit_interval: int = _flag(None, "stop (after saving) when iteration % this == 0")
    eval_interval: int = _flag(1000, "evaluate on the validation split every this many iterations")
    eval_iters: int = _flag(100, "validation batches per evaluation")
    log_interval: int = _flag(100, "print a log line every this many iterations")
    tensorboard_dir: str = _flag(None, "write TensorBoard scalars here")
    finetune: bool = _flag(False, "--load only the weights; start at iteration 0 with a fresh optimizer")
    no_load_optim: bool = _flag(False, "--load without the optimizer state (fresh Adam moments)")
    no_load_rng: bool = _flag(False, "--load without the random generators' states")
    use_checkpoint_args: bool = _flag(False, "take the model shape flags from the --load checkpoint")
    exit_signal_handler: bool = _flag(False, "on SIGTERM/SIGINT: save at the end of the iteration, exit 0")
    # ---- tools ----
    profile: bool = _flag(False, "write a torch profiler trace of iterations [--profile-step-start, end) "
                                 "into --tensorboard-dir (else profile/) and print its top kernels")
    profile_step_start: int = _flag(10, "first profiled iteration")
    profile_step_end: int = _flag(12, "profiling stops before this iteration")
    pipeline_trace: bool = _flag(False, "print every pipeline send/receive, in order, per rank")

    # ---- derived values (not flags) ----
    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step (gradient accumulation)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def virtual_pipeline_size(self) -> int:
        """Model chunks per pipeline stage (1 without the interleaved schedule)."""
        if self.num_layers_per_virtual_pipeline_stage is None:
            return 1
        return self.num_layers // (self.pipeline_model_parallel_size * self.num_layers_per_virtual_pipeline_stage)

    @property
    def recompute(self) -> str:
        """None, "selective" or "full": what the layers recompute in the backward."""
        return "selective" if self.recompute_activations else self.recompute_granularity

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
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or \
            not 0 < sum(weights) < math.inf:
        raise UsageError(f"--split {split!r}: give up to three non-negative weights with a positive sum, "
                         "e.g. --split 969,30,1")
    return weights + [0.0] * (3 - len(weights))


PRESETS = {  # the three sizes of Megatron's BERT example (BERT-large is its "340M")
    "340m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=512, max_position_embeddings=512),
    "4b": dict(num_layers=48, hidden_size=2560, num_attention_heads=32, seq_length=512, max_position_embeddings=512),
    "20b": dict(num_layers=48, hidden_size=6144, num_attention_heads=96, seq_length=512, max_position_embeddings=512),
}

def compute_dtype(cfg):
    """The dtype the model's weights and activations are in: float16 (--fp16), bfloat16 (--bf16), else float32."""
    import torch  # here, not at the top: the config (and --help) load without torch
    return torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(description="minibert: Megatron-style BERT pretraining",
                                   allow_abbrev=False)
    for f in dataclasses.fields(Config):
        if f.metadata.get("help") is None:
            continue
        flag = _flag_name(f.name)
        extra = {k: v for k, v in f.metadata.items() if k != "help"}
        help_text = f.metadata["help"].replace("%", "%%")  # argparse treats % as a format character
        if f.type is bool or f.type == "bool":
            extra.setdefault("action", "store_true")
            parser.add_argument(flag, default=f.default, help=help_text, **extra)
        else:
            kind = {"int": int, "float": float, "str": str, "list": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=kind, default=f.default, help=help_text, **extra)
    return parser


def parse_args(argv=None) -> Config:
    """Command line -> Config (not yet validated: the trainer validates once it knows the world size)."""
    namespace = build_parser().parse_args(argv)
    return Config(**vars(namespace))

