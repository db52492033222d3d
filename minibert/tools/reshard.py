"""Resharding a checkpoint: from the layout it was saved in to any other (TP, PP, interleaved chunks).

    python -m minibert.tools.reshard convert --load DIR --save NEW_DIR --target-tensor-parallel-size T \\
        --target-pipeline-model-parallel-size P

(the interleaved and uneven stages have --target-* flags too: --help lists them). load_model below reads
a checkpoint of any layout as one process's BertModel, for fill_mask and `convert to-hf`.

A checkpoint holds one file per (tensor, pipeline) rank, each with that rank's shards (docs/formats.md).
To resume at another layout, the converter never needs to know how the schedule ran, because every
tensor is stored under its full-model name (layers.7.mlp..., whatever stage held layer 7):

    source files (TP 2 x PP 2)                     full tensors (TP 1 x PP 1)        target files (TP T x PP P)
    mp_rank_00_000  layers 0-1 | embedding  \\                                      / mp_rank_00_000 ...
    mp_rank_01_000  (other half of each)     >-- gather by name --> re-pad vocab --> split by name
    mp_rank_00_001  layers 2-3 | heads      /                                      \\ mp_rank_TT_PPP ...
    mp_rank_01_001

Gather. A tensor-parallel shard is joined with its siblings along the dimension its file records
("sharding": {name: [dim, count]}: column-parallel rows, row-parallel columns, vocab rows); a replicated
tensor (a LayerNorm, a row-parallel bias) is taken from TP rank 0. The optimizer state is stored by name
too, as pieces of each rank's *flattened local* tensor ({"range": [a, b], "exp_avg", "exp_avg_sq",
"master"}); with ZeRO-1 the pieces lie in the distrib_optim_dpRRR.pt files of all data-parallel ranks.
The pieces are first put back together into the rank's local tensor, then gathered like the weights.
Interleaved chunks need nothing special: their names are global. The pipeline's copy of the tied word
table (the last stage's embedding.word_embeddings.weight) equals the first stage's; the first is used.

Re-pad. The word table and the LM head's bias have padded_vocab_size rows, a multiple of 128 x TP
(config.py): 1505 real tokens are 1536 rows at TP 1 and 2, 2048 at TP 4. The real rows are kept, the
padding rows (zero: they are never looked up and get no gradient) are cut and re-made for the target;
the Adam moments and fp32 masters of those two tensors alike.

Split. The target's ranks hold what build_model would build there (the same BertModel, built on the
meta device: names and shapes, no memory), cut along the dimension that tensor_parallel.PLAN gives each
module. The optimizer state is written in the non-distributed form (one piece per tensor, the full
range): it loads at any data-parallel size, with or without --use-distributed-optimizer.

Carried over unchanged: iteration, LR scheduler, consumed samples, data_stream, fp16 loss scaler, and the
random generators. Not carried: FP8 scaling state (--fp8-format's amax histories and scales, which are not
weights): a resumed FP8 run starts it afresh (minibert/training/resume.py), and load_model leaves it out.
What cannot be carried exactly: the tensor-parallel generators (attention dropout;
with sequence parallelism also hidden dropout) are one per TP rank, and a new TP size has other ranks
drawing over other heads: they restart from their seeds (seed + 2718 + tp_rank, minibert.parallel.rng).
The default generators are TP rank 0's (they are equal on every TP rank); a pipeline stage the source did
not have gets the source's last stage's. A converted run therefore logs the unbroken run's losses exactly
only with dropout off; with dropout on it is an equally valid run that draws other masks.

Memory: the whole model and its optimizer state are held on the CPU, twice at the peak (the source's
shards and the full tensors): fine up to a few billion parameters. What production does: Megatron's
tools/checkpoint streams the model layer by layer from a loader process to a saver process (weights
only: it drops the optimizer), and torch.distributed.checkpoint reshards at load time, each rank reading
just the byte ranges it needs, so that no machine ever holds the whole model."""
import dataclasses
import fnmatch
import os
import sys

import torch

from minibert.atomic import atomic_write, atomic_write_bytes, require_new_directory
from minibert.config import Config
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error
from minibert.model.bert import BertModel
from minibert.parallel.rng import TENSOR_PARALLEL_SEED_OFFSET, TensorParallelRNG
from minibert.parallel.schedules import layer_ranges
from minibert.parallel.tensor_parallel import PLAN
from minibert.training import checkpoint
from minibert.training.manifest import write_manifest
from minibert.training.optim import _cut
from minibert.training.resume import is_fp8_state
from minibert.validate import validate

OPTIMIZER_KINDS = ("exp_avg", "exp_avg_sq", "master")  # per parameter, beside the weights ("model")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "lm_head.bias")  # padded_vocab_size rows
SPLIT_DIMS = {"vocab": {"weight": 0}, "column": {"weight": 0, "bias": 0}, "row": {"weight": 1}}
REBUILT = ("model", "optimizer", "rng_state", "sharding", "args", "release")  # the rest is carried over
TARGET_FLAGS = {"tensor_model_parallel_size": "--target-tensor-parallel-size",
                "pipeline_model_parallel_size": "--target-pipeline-model-parallel-size",
                "num_layers_per_virtual_pipeline_stage": "--target-num-layers-per-virtual-pipeline-stage",
                "decoder_first_pipeline_num_layers": "--target-decoder-first-pipeline-num-layers",
                "decoder_last_pipeline_num_layers": "--target-decoder-last-pipeline-num-layers"}


def split_dim(name: str):
    """The dimension tensor parallelism cuts `name` along (tensor_parallel.PLAN), or None: replicated."""
    if name == "lm_head.bias":
        return 0  # the vocab-parallel decoder's bias: one block of the vocab per rank
    module, _, leaf = name.rpartition(".")
    kind = next((k for pattern, k in PLAN.items() if fnmatch.fnmatchcase(module, pattern)), None)
    return SPLIT_DIMS.get(kind, {}).get(leaf)


# ---------------------------------------------------------------- read and gather
@dataclasses.dataclass
class Source:
    iteration: object  # an int, or checkpoint.RELEASE
    args: dict
    tp: int
    pp: int
    files: dict        # (tp_rank, pp_rank) -> that file's dict (as load_checkpoint returns it: shards included)


def read_source(directory: str) -> Source:
    """Every file of the latest checkpoint in `directory`, or a UsageError naming what is missing/corrupt."""
    if not os.path.isfile(checkpoint.tracker_path(directory)):
        raise UsageError(f"{directory} holds no checkpoint (no {checkpoint.TRACKER_FILENAME}): pass --load a "
                         "directory written by train.py --save")
    iteration = checkpoint.read_tracker(directory)
    args = checkpoint.read_args(directory)
    tp, pp = args.get("tensor_model_parallel_size", 1), args.get("pipeline_model_parallel_size", 1)
    expected = [(t, p) for p in range(pp) for t in range(tp)]
    missing = [checkpoint.checkpoint_path(directory, iteration, t, p, pp) for t, p in expected
               if not os.path.isfile(checkpoint.checkpoint_path(directory, iteration, t, p, pp))]
    if missing:
        raise UsageError(f"{directory}: the checkpoint of iteration {iteration} was saved at TP {tp} x PP {pp} "
                         f"({len(expected)} files) but {len(missing)} are missing, e.g. {missing[0]}: restore them")
    files = {(t, p): checkpoint.load_checkpoint(directory, tp_rank=t, pp_rank=p, pp_size=pp) for t, p in expected}
    for (t, p), state in files.items():
        shards = (state.get("optimizer") or {}).get("shards")
        if shards is not None and len(shards) != args["data_parallel_size"]:
            folder = os.path.dirname(checkpoint.checkpoint_path(directory, iteration, t, p, pp))
            raise UsageError(f"{folder} has {len(shards)} distrib_optim_dp*.pt files but the run had data-parallel "
                             f"size {args['data_parallel_size']}: restore the missing ones")
    return Source(iteration, args, tp, pp, files)


def local_tensors(state: dict) -> dict:
    """kind -> name -> this rank's tensor: "model" its weights; "exp_avg", "exp_avg_sq", "master" its
    optimizer state, each put back together from its pieces into the shape of the rank's weight."""
    tensors = {"model": {k: v for k, v in state["model"].items() if not is_fp8_state(k)}}  # the weights
    optimizer = state.get("optimizer")
    if not optimizer:  # released weights
        return tensors
    saved = optimizer["shards"] if optimizer.get("distributed") else [optimizer]
    for name, weight in tensors["model"].items():
        entries = [s["params"][name] for s in saved if name in s["params"]]
        if not entries:
            raise UsageError(f"the checkpoint's optimizer has no state for {name}: a file is missing or foreign")
        for kind in OPTIMIZER_KINDS:
            if all(kind in e for e in entries):  # no moments before the first step; masters only in 16-bit runs
                try:
                    full = _cut(entries, kind, 0, weight.numel())  # elements [0, numel) of the flattened shard
                except KeyError as e:
                    raise UsageError(f"{name}: {e.args[0]}") from None
                tensors.setdefault(kind, {})[name] = full.view(weight.shape)
    return tensors


def gather(source: Source) -> dict:
    """kind -> name -> the full tensor (TP 1 x PP 1; the vocab rows still padded as the source had them)."""
    full = {}
    for p in range(source.pp):
        ranks = [source.files[(t, p)] for t in range(source.tp)]
        shards = [local_tensors(state) for state in ranks]
        sharding = ranks[0].get("sharding", {})
        for kind, tensors in shards[0].items():
            for name in tensors:
                if name in full.setdefault(kind, {}):
                    continue  # the last stage's copy of the tied word table: the first stage's is used
                parts = [s[kind][name] for s in shards]
                dim = sharding[name][0] if name in sharding else None
                full[kind][name] = parts[0] if dim is None else torch.cat(parts, dim)
    return full


def repad_vocab(full: dict, vocab_size: int, padded_vocab_size: int):
    """In place: the vocab-sized tensors get the real rows [0, vocab_size) and zero rows up to padded_vocab_size."""
    for tensors in full.values():
        for name in VOCAB_ROWS:
            if name in tensors:
                real = tensors[name][:vocab_size]
                tensors[name] = torch.cat([real, real.new_zeros((padded_vocab_size - vocab_size,) + real.shape[1:])])


# ---------------------------------------------------------------- the target layout
def config_from_args(args: dict) -> Config:
    """A checkpoint's args -> Config (derived entries such as ffn_size are dropped: they follow).
    The inverse of checkpoint.model_args."""
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in names})


def target_args(args: dict, tp, pp, vp_layers=None, first=None, last=None) -> dict:
    """The source's args with the target layout (the resumed run checks these: resume.check_layout)."""
    layout = dict(zip(TARGET_FLAGS, (tp, pp, vp_layers, first, last)))
    return {**args, **layout, "sequence_parallel": args.get("sequence_parallel", False) and tp > 1}


def check_target(args: dict):
    """validate() for a world of T x P processes: the target must divide the heads, hidden and FFN
    sizes and the layers. Released weights carry no training flags: placeholders, which no layout check reads."""
    pp = args["pipeline_model_parallel_size"]
    placeholders = {"micro_batch_size": 1, "global_batch_size": pp, "train_iters": 1, "lr": 0.0}
    # the layout check reads neither the vocab (the bundled one stands in) nor the writing run's directories
    cfg = config_from_args({**args, **{k: v for k, v in placeholders.items() if args.get(k) is None},
                            "vocab_file": None, "save": None, "load": None})
    try:
        validate(cfg, cfg.tensor_model_parallel_size * cfg.pipeline_model_parallel_size, "cpu", warn=None)
    except UsageError as e:
        message = str(e)
        for name, flag in TARGET_FLAGS.items():
            message = message.replace("--" + name.replace("_", "-"), flag)
        raise UsageError(f"the target layout does not fit the model: {message}") from None


def stage_shapes(cfg, pp_rank) -> dict:
    """name -> full shape of what pipeline rank `pp_rank` holds: the model chunks build.build_model
    builds there, built here on the meta device (names and shapes, no memory)."""
    vp, pp = cfg.virtual_pipeline_size, cfg.pipeline_model_parallel_size
    ranges = layer_ranges(cfg.num_layers, pp, vp, cfg.decoder_first_pipeline_num_layers,
                          cfg.decoder_last_pipeline_num_layers)[pp_rank]
    shapes = {}
    for c, layers in enumerate(ranges):
        with torch.device("meta"):
            chunk = BertModel(cfg, layer_numbers=layers, pre_process=pp_rank == 0 and c == 0,
                              post_process=pp_rank == pp - 1 and c == vp - 1, init=False)
        shapes.update({name: tuple(t.shape) for name, t in chunk.state_dict().items()})
    return shapes


def check_shapes(full: dict, cfg, directory):
    """Every gathered tensor is one of the model's, at its full shape, and every one of the model's is there."""
    expected = {}
    for p in range(cfg.pipeline_model_parallel_size):
        expected.update(stage_shapes(cfg, p))
    got = {name: tuple(t.shape) for name, t in full["model"].items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or [n for n in expected if got[n] != expected[n]]
        raise UsageError(f"the checkpoint in {directory} does not hold the model of its own args (first "
                         f"mismatch: {wrong[0]}): it was not written by this version of minibert")


def shard(tensor, name, tp, tp_rank):
    """This TP rank's block of a full tensor (a copy: torch.save of a view would save the whole storage)."""
    dim = split_dim(name) if tp > 1 else None
    if dim is None:
        return tensor
    return tensor.chunk(tp, dim)[tp_rank].clone(memory_format=torch.contiguous_format)


def target_rng(source: Source, tp, tp_rank, pp_rank, seed) -> dict:
    """The generators of target rank (tp_rank, pp_rank): see the module docstring."""
    p = min(pp_rank, source.pp - 1)
    rng = dict(source.files[(0, p)]["rng_state"][0])  # python, numpy, torch, cuda: equal on every TP rank
    if tp == source.tp:
        rng["tensor_parallel"] = source.files[(tp_rank, p)]["rng_state"][0]["tensor_parallel"]
    else:  # restarted from its seed, as build.set_random_seed seeds it
        seed = seed + 100 * pp_rank + TENSOR_PARALLEL_SEED_OFFSET + tp_rank
        rng["tensor_parallel"] = TensorParallelRNG(seed, torch.device("cpu")).state_dict()
    return rng


def target_file(source, full, carried, cfg, tp_rank, pp_rank) -> dict:
    """The dict of target rank (tp_rank, pp_rank)'s model_optim_rng.pt."""
    tp = cfg.tensor_model_parallel_size
    names = stage_shapes(cfg, pp_rank)
    state = {**carried, "model": {n: shard(full["model"][n], n, tp, tp_rank) for n in names},
             "sharding": {n: [split_dim(n), tp] for n in names if tp > 1 and split_dim(n) is not None},
             "args": checkpoint.model_args(cfg)}
    if source.iteration == checkpoint.RELEASE:
        return state
    optimizer = source.files[(0, 0)]["optimizer"]  # (ZeRO-1: the marker, which keeps step and scaler too)
    params = {}
    for n in names:
        params[n] = {"range": [0, state["model"][n].numel()]}  # one piece: the whole local tensor
        params[n].update({kind: shard(full[kind][n], n, tp, tp_rank).reshape(-1)
                          for kind in OPTIMIZER_KINDS if n in full.get(kind, {})})
    state["optimizer"] = {"step": optimizer["step"], "params": params, "grad_scaler": optimizer["grad_scaler"]}
    state["rng_state"] = [target_rng(source, tp, tp_rank, pp_rank, cfg.seed)]
    return state


# ---------------------------------------------------------------- the entry points
def load_full_state(directory: str):
    """The whole model of a checkpoint directory of any layout, as one process holds it:
    {"model": the full state dict, "args": its args at TP 1 x PP 1}, or None when there is no tracker.
    What load_model (and so fill_mask and `python -m minibert.tools.convert to-hf`) reads."""
    if not os.path.isfile(checkpoint.tracker_path(directory)):
        return None
    source = read_source(directory)
    for state in source.files.values():
        state.pop("optimizer", None)  # the weights only
    full = gather(source)
    cfg = config_from_args(target_args(source.args, 1, 1))
    repad_vocab(full, cfg.vocab_size, cfg.padded_vocab_size)
    check_shapes(full, cfg, directory)
    return {"model": full["model"], "args": checkpoint.model_args(cfg)}


def load_model(checkpoints_dir: str, **overrides):
    """The BertModel (fp32, CPU, eval mode) stored in a checkpoint directory (a training checkpoint of any
    parallel layout, or released weights), with its Config. `overrides` set Config fields, e.g.
    attention_backend="local"."""
    state = load_full_state(checkpoints_dir)  # every rank's file gathered into one model (TP 1 x PP 1)
    if state is None:
        raise UsageError(f"{checkpoints_dir} holds no checkpoint (no {checkpoint.TRACKER_FILENAME}): pass a "
                         "directory written by train.py --save or by python -m minibert.tools.convert from-hf --save")
    cfg = config_from_args(state["args"])
    for key, value in overrides.items():
        setattr(cfg, key, value)
    model = BertModel(cfg)
    try:
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()})
    except RuntimeError as e:
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"the checkpoint in {checkpoints_dir} does not fit its own args ({reason}): "
                         "it was not written by this version of minibert")
    return model.eval(), cfg


def convert(load, save, target_tensor_parallel_size, target_pipeline_model_parallel_size,
            target_num_layers_per_virtual_pipeline_stage=None, target_decoder_first_pipeline_num_layers=None,
            target_decoder_last_pipeline_num_layers=None, warn=None) -> list:
    """`python -m minibert.tools.reshard convert`: the latest checkpoint in `load`, resharded into the new
    directory `save`. Every check runs before the first write; the files are written atomically and the
    tracker last. Returns the paths written."""
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
    require_new_directory(save, "--save")  # the converter never writes over a checkpoint
    source = read_source(load)
    args = target_args(source.args, target_tensor_parallel_size, target_pipeline_model_parallel_size,
                       target_num_layers_per_virtual_pipeline_stage, target_decoder_first_pipeline_num_layers,
                       target_decoder_last_pipeline_num_layers)
    check_target(args)
    cfg = config_from_args(args)
    full = gather(source)
    repad_vocab(full, cfg.vocab_size, cfg.padded_vocab_size)
    check_shapes(full, cfg, load)
    carried = {k: v for k, v in source.files[(0, 0)].items() if k not in REBUILT}
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if any(is_fp8_state(k) for state in source.files.values() for k in state["model"]):
        warn("the FP8 scaling state (amax histories and scales) is not converted: a resumed --fp8-format run "
             "starts it afresh")
    if tp != source.tp and source.iteration != checkpoint.RELEASE:
        warn(f"the tensor-parallel dropout generators cannot be carried from TP {source.tp} to TP {tp}: they "
             "restart from their seeds, so a resumed run repeats the unbroken run's losses only with dropout off")
    paths, entries = [], {}
    directory = checkpoint.iteration_dir(save, source.iteration)
    for p in range(pp):
        for t in range(tp):  # one file at a time: only the full tensors and one rank's shards are in memory
            state = target_file(source, full, carried, cfg, t, p)
            path = checkpoint.checkpoint_path(save, source.iteration, t, p, pp)
            entries[os.path.relpath(path, directory)] = checkpoint.write_file(path, state)
            paths.append(path)
    write_manifest(directory, entries)  # before the tracker, as train.py's saves
    vocab = os.path.join(load, "vocab.txt")  # from-hf's vocabulary travels with its weights
    if os.path.isfile(vocab):
        with open(vocab, "rb") as f:
            paths.append(atomic_write_bytes(os.path.join(save, "vocab.txt"), [f.read()]))
    paths.append(atomic_write(checkpoint.tracker_path(save), lambda f: f.write(f"{source.iteration}".encode())))
    return paths


# ---------------------------------------------------------------- the command line
@exit_on_usage_error
def main(argv=None):
    """`python -m minibert.tools.reshard convert --load DIR --save DIR2 --target-...`: convert() above."""
    parser = OneLineArgumentParser(prog="python -m minibert.tools.reshard", allow_abbrev=False,
                                   description="Reshard minibert checkpoints between parallel layouts.")
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("convert", allow_abbrev=False, help="reshard a checkpoint to another "
                                  "tensor/pipeline layout (weights, fp32 masters, Adam moments, training state)")
    command.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory to read (its latest "
                         "iteration)")
    command.add_argument("--save", required=True, metavar="DIR2", help="new (or empty) directory to write")
    command.add_argument("--target-tensor-parallel-size", type=int, required=True, metavar="T",
                         help="TP of the new layout")
    command.add_argument("--target-pipeline-model-parallel-size", type=int, required=True, metavar="P",
                         help="PP of the new layout")
    for name in ("num-layers-per-virtual-pipeline-stage", "decoder-first-pipeline-num-layers",
                 "decoder-last-pipeline-num-layers"):
        command.add_argument(f"--target-{name}", type=int, default=None, metavar="N",
                             help=f"--{name} of the new layout")
    args = vars(parser.parse_args(argv))
    del args["command"]
    paths = convert(**args)
    print(f"wrote {len(paths)} files under {args['save']}, the tracker last: TP "
          f"{args['target_tensor_parallel_size']} x PP {args['target_pipeline_model_parallel_size']}")


if __name__ == "__main__":
    main()
