"""Checkpoints in Megatron's legacy directory layout, written atomically, resumed exactly.

    SAVE/
      latest_checkpointed_iteration.txt          "100"  (written last: it points at a complete checkpoint)
      iter_0000100/
        mp_rank_00/model_optim_rng.pt            PP == 1: mp_rank_{tp:02d}
        mp_rank_01_003/model_optim_rng.pt        PP > 1:  mp_rank_{tp:02d}_{pp:03d}
        mp_rank_00/distrib_optim_dp001.pt        ZeRO-1: data-parallel rank 1's optimizer shard

With several processes, data-parallel rank 0 of each (tensor, pipeline) position writes its
model_optim_rng.pt (the replicas hold the same model); with --use-distributed-optimizer every
data-parallel rank also writes its own optimizer shard (Megatron's legacy format gathers the shards into
one distrib_optim.pt on one rank; one file per rank means no rank ever holds the whole optimizer). Then
all ranks meet at a barrier, and only then does global rank 0 write the tracker: a kill between two
ranks' writes leaves the tracker on the previous, complete checkpoint.

Each file is one dict: iteration, checkpoint_version, model (minibert's own parameter names: a stage's
layers keep their full-model names), optimizer (by parameter name: Adam moments, fp32 masters, the fp16
loss scaler), opt_param_scheduler, rng_state (python, numpy, torch, cuda), consumed_train_samples,
consumed_valid_samples, data_stream (what shapes the sample stream) and args (the Config as a dict). Everything in it is a tensor, number, string, list or dict, so it loads with
torch.load(weights_only=True): opening a checkpoint never runs code from the file.

Exact resume needs all of it: the weights and Adam state, the LR step, the loss scale, where the data
iterators stand (consumed samples) and the random generators that drive dropout.

Atomic writes (minibert.atomic): each file goes to a temporary name in the same directory, is flushed to
disk (fsync) and renamed over the final name (os.replace is atomic on POSIX); the new directories are
synced before the tracker is written. A crash mid-save leaves the old tracker pointing at the old,
complete checkpoint."""
import dataclasses
import glob
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

from minibert.atomic import atomic_write
from minibert.errors import UsageError
from minibert.manifest import HashingWriter, verify, write_manifest

CHECKPOINT_VERSION = 3.0          # Megatron's current legacy-format version number
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"               # Megatron's tracker word for released weights (no training state)
MODEL_SHAPE_ARGS = ["num_layers", "hidden_size", "num_attention_heads", "ffn_size", "max_positions",
                    "vocab_size", "post_ln", "bert_no_binary_head", "layernorm_epsilon"]


def tracker_path(checkpoints_dir: str) -> str:
    return os.path.join(checkpoints_dir, TRACKER_FILENAME)


def distrib_optim_path(model_path: str, dp_rank: int) -> str:
    return os.path.join(os.path.dirname(model_path), f"distrib_optim_dp{dp_rank:03d}.pt")


def checkpoint_path(checkpoints_dir: str, iteration, tp_rank=0, pp_rank=0, pp_size=1) -> str:
    """SAVE/iter_0000100/mp_rank_00/model_optim_rng.pt, or mp_rank_TT_PPP when pipelining;
    SAVE/release/mp_rank_00/... for released weights (iteration == RELEASE)."""
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    iter_dir = RELEASE if iteration == RELEASE else f"iter_{iteration:07d}"
    return os.path.join(checkpoints_dir, iter_dir, rank_dir, "model_optim_rng.pt")


# ---- random generators as plain data ----
def get_rng_state() -> dict:
    """Python, numpy, torch CPU and CUDA generator states as lists/tensors (weights_only-safe)."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached_gauss = np.random.get_state()
    return {"random_rng_state": [version, list(words), gauss],
            "np_rng_state": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                             "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gauss)},
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state: dict):
    version, words, gauss = state["random_rng_state"]
    random.setstate((version, tuple(words), gauss))
    np_state = state["np_rng_state"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_rng_state"])
    if state["cuda_rng_state"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


# ---- save ----
def write_file(path: str, obj) -> dict:
    """torch.save(obj) to `path` atomically; returns its manifest entry (sha256, bytes)."""
    entry = {}

    def write(f):
        writer = HashingWriter(f)
        torch.save(obj, writer)
        entry.update(writer.entry())
    atomic_write(path, write, make_dirs=True)
    return entry


def iteration_dir(checkpoints_dir: str, iteration) -> str:
    return os.path.dirname(os.path.dirname(checkpoint_path(checkpoints_dir, iteration)))


def save_checkpoint(checkpoints_dir: str, iteration: int, state: dict, *, tp_rank=0, pp_rank=0,
                    pp_size=1, write_tracker=True):
    """Write one process's file, its manifest, then the tracker (one process; save() for many)."""
    path = checkpoint_path(checkpoints_dir, iteration, tp_rank, pp_rank, pp_size)
    entry = write_file(path, state)
    directory = iteration_dir(checkpoints_dir, iteration)
    write_manifest(directory, {os.path.relpath(path, directory): entry})
    if write_tracker:
        atomic_write(tracker_path(checkpoints_dir), lambda f: f.write(f"{iteration}".encode()))
    return path


def merged_state_dict(model_chunks) -> dict:
    """One dict for this rank's model chunks (their names are the full model's, so they never clash)."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return {k: v for chunk in chunks for k, v in chunk.state_dict().items()}


def training_state(cfg, iteration, model, optimizer, scheduler, consumed_train_samples,
                   consumed_valid_samples, data_stream=None, rng_state=None) -> dict:
    """The dict stored in model_optim_rng.pt. `model`: a model or this rank's list of chunks."""
    return {"iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "model": merged_state_dict(model),
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": [rng_state or get_rng_state()],  # the data-parallel replicas' generators are equal
            "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "data_stream": data_stream,
            "sharding": sharding(model),
            "args": model_args(cfg)}


def sharding(model) -> dict:
    """name -> [dim, count] for every tensor-parallel shard in this rank's file (the converter's map)."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return {name: [p.partition_dim, p.partition_count] for chunk in chunks
            for name, p in chunk.named_parameters() if hasattr(p, "partition_dim")}


def save(checkpoints_dir, iteration, state, rank_state: dict, distributed_optimizer=False) -> str:
    """Every rank calls this with its training_state: the files of the module docstring, a barrier, the
    tracker. Returns the path of this rank's model file."""
    path = checkpoint_path(checkpoints_dir, iteration, state.tp_rank, state.pp_rank, state.pp)
    directory = iteration_dir(checkpoints_dir, iteration)
    written = {}  # this rank's files -> manifest entries
    if distributed_optimizer:  # each DP rank's shard in its own file; the model file keeps a marker
        shard = rank_state["optimizer"]
        shard_path = distrib_optim_path(path, state.dp_rank)
        written[os.path.relpath(shard_path, directory)] = write_file(shard_path, shard)
        rank_state = {**rank_state, "optimizer": {"distributed": True, "step": shard["step"],
                                                  "grad_scaler": shard["grad_scaler"]}}
    if state.dp_rank == 0:
        written[os.path.relpath(path, directory)] = write_file(path, rank_state)
    everyone = [written]
    if state.world_size > 1:  # every rank's files are in place once this returns ...
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, written)
    if state.rank == 0:  # ... then the manifest, and the tracker last
        write_manifest(directory, {k: v for files in everyone for k, v in files.items()})
        atomic_write(tracker_path(checkpoints_dir), lambda f: f.write(f"{iteration}".encode()))
    state.barrier()
    return path


# ---- load ----
def read_tracker(checkpoints_dir: str):
    """The iteration named by the tracker file, or None (with a warning) when there is none."""
    path = tracker_path(checkpoints_dir)
    if not os.path.isfile(path):
        print(f"warning: no checkpoint tracker {path}; starting from scratch", file=sys.stderr, flush=True)
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    try:
        iteration = int(text)
    except ValueError:
        raise UsageError(f"checkpoint tracker {path} holds {text[:40]!r}, not an iteration number: "
                         "fix or delete it")
    if iteration < 0:
        raise UsageError(f"checkpoint tracker {path} holds a negative iteration {iteration}: fix or delete it")
    return iteration


REQUIRED_KEYS = ["iteration", "model", "optimizer", "opt_param_scheduler", "rng_state",
                 "consumed_train_samples", "consumed_valid_samples", "args"]
RELEASE_KEYS = ["model", "args"]  # released weights carry no training state


def read_file(path: str):
    """torch.load(weights_only=True) of one checkpoint file; any failure is a bad file (UsageError)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read this file is a bad file, not a bug
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"checkpoint {path} is corrupt or not a minibert checkpoint ({type(e).__name__}: "
                         f"{reason}): delete it or point --load elsewhere")


def load_checkpoint(checkpoints_dir: str, *, tp_rank=0, pp_rank=0, pp_size=1):
    """The dict of the latest checkpoint in `checkpoints_dir` for this (tp, pp) position, or None when
    there is no tracker. A checkpoint written with the distributed optimizer gets every DP rank's shard
    under state["optimizer"]["shards"] (a list, any number)."""
    iteration = read_tracker(checkpoints_dir)
    if iteration is None:
        return None
    path = checkpoint_path(checkpoints_dir, iteration, tp_rank, pp_rank, pp_size)
    if not os.path.isfile(path):
        others = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(path)), "mp_rank_*")))
        if others and not os.path.isdir(os.path.dirname(path)):
            raise UsageError(f"{checkpoints_dir} was written with another tensor/pipeline layout "
                             f"({', '.join(os.path.basename(o) for o in others)}): " + CONVERT_HINT)
        raise UsageError(f"{tracker_path(checkpoints_dir)} points at {path}, which does not exist: "
                         "restore that file or fix the tracker")
    directory = iteration_dir(checkpoints_dir, iteration)
    verify(path, directory)
    state = read_file(path)
    required = RELEASE_KEYS if iteration == RELEASE else REQUIRED_KEYS
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path} is not a minibert checkpoint (missing {', '.join(missing)}): "
                         "point --load at a directory written by minibert's --save")
    if isinstance(state.get("optimizer"), dict) and state["optimizer"].get("distributed"):
        shards = sorted(glob.glob(os.path.join(os.path.dirname(path), "distrib_optim_dp*.pt")))
        if not shards:
            raise UsageError(f"checkpoint {path} was saved with --use-distributed-optimizer but its "
                             "distrib_optim_dp*.pt files are missing: restore them")
        for shard in shards:
            verify(shard, directory)
        state["optimizer"]["shards"] = [read_file(f) for f in shards]
    state["release"] = iteration == RELEASE
    return state


CONVERT_HINT = ("convert it with python -m minibert.checkpoint convert --load DIR --save NEW_DIR "
                "--target-tensor-parallel-size T --target-pipeline-model-parallel-size P, or resume with the "
                "checkpoint's layout")
LAYOUT_ARGS = ["tensor_model_parallel_size", "pipeline_model_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers"]


def check_layout(saved_args: dict, cfg):
    """Each rank's file holds its tensor/pipeline shard: another layout needs the converter."""
    from minibert.config import Config
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    differ = [f"--{k.replace('_', '-')} {saved_args.get(k, defaults[k])} (now {getattr(cfg, k)})"
              for k in LAYOUT_ARGS if saved_args.get(k, defaults[k]) != getattr(cfg, k)]
    if differ:
        raise UsageError("the checkpoint was written with another parallel layout: " + ", ".join(differ)
                         + "; " + CONVERT_HINT)


def check_data_stream(saved, current, warn):
    """Resume only into the same sample stream (batches.data_stream): another seed, data, split, ...
    would make consumed_samples point into a different index. A changed --train-iters or evaluation
    setting is normal when continuing a run: Megatron then rebuilds the index for the new number of
    samples, which can reorder the rows still to come; warn once."""
    if saved is None:
        return
    names = [k for k in current if k != "num_samples" and saved.get(k) != current[k]]
    if names:
        raise UsageError("the checkpoint's sample stream differs from these flags: "
                         + ", ".join(f"--{k.replace('_', '-')}" for k in names)
                         + " (the data, seed, sequence length, split, masking and vocab must stay as in the "
                         "run being resumed; micro-batch and data-parallel sizes may change)")
    changed = [k for k, v in current["num_samples"].items() if saved.get("num_samples", {}).get(k) != v]
    if changed:
        warn(f"{', '.join('--' + k.replace('_', '-') for k in changed)} changed since the checkpoint: Megatron's "
             "sample counts change with them, so the remaining samples come from the rebuilt index")


SHAPE_FLAGS = {"ffn_size": "--ffn-hidden-size", "max_positions": "--max-position-embeddings",
               "vocab_size": "vocab size (--vocab-file)"}


def check_model_args(saved_args: dict, cfg):
    differ = [f"{SHAPE_FLAGS.get(k, '--' + k.replace('_', '-'))} {saved_args.get(k)} (now {getattr(cfg, k)})"
              for k in MODEL_SHAPE_ARGS if saved_args.get(k) != getattr(cfg, k)]
    if differ:
        raise UsageError("the checkpoint's model differs from the flags: it was saved with "
                         + ", ".join(differ) + "; use the checkpoint's values (or --use-checkpoint-args) "
                         "or another --load")


def restore_training_state(state: dict, cfg, model, optimizer, scheduler, data_stream=None, warn=None):
    """Put a loaded checkpoint back into the model (a model or this rank's chunks), optimizer and
    scheduler. Returns (iteration, consumed_train_samples, consumed_valid_samples). With --finetune or
    released weights only the weights are loaded and training starts at iteration 0 with a fresh
    optimizer; --no-load-optim keeps the iteration but not the Adam state. The random generators are the
    caller's to restore (set_rng_state(state["rng_state"][0])) once nothing else will draw before the
    next step, unless --no-load-rng."""
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
    check_model_args(state["args"], cfg)
    check_layout(state["args"], cfg)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    try:
        for chunk in chunks:
            chunk.load_state_dict({k: state["model"][k] for k in chunk.state_dict()})
        if state.get("release") or cfg.finetune:
            optimizer.reload_masters()
            return 0, 0, 0
        check_data_stream(state.get("data_stream"), data_stream, warn) if data_stream else None
        if cfg.no_load_optim:
            optimizer.reload_masters()
        else:
            saved = state["optimizer"]
            optimizer.load_state_dict(saved["shards"] if saved.get("distributed") else saved)
    except (RuntimeError, KeyError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"the checkpoint does not fit this model/optimizer ({reason}): "
                         "point --load at a checkpoint of the same configuration")
    changed = scheduler.load_state_dict(state["opt_param_scheduler"])
    if changed:
        warn(f"the LR schedule differs from the checkpoint's ({', '.join(changed)}); using the command line's")
    return state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"]


def read_args(checkpoints_dir: str):
    """The args stored in the latest checkpoint of a directory (for --use-checkpoint-args), or None."""
    iteration = read_tracker(checkpoints_dir)
    if iteration is None:
        return None
    iter_dir = os.path.dirname(os.path.dirname(checkpoint_path(checkpoints_dir, iteration)))
    files = sorted(glob.glob(os.path.join(iter_dir, "mp_rank_*", "model_optim_rng.pt")))
    if not files:
        raise UsageError(f"{tracker_path(checkpoints_dir)} points at {iter_dir}, which holds no "
                         "model_optim_rng.pt: restore it or fix the tracker")
    state = read_file(files[0])
    if not isinstance(state, dict) or "args" not in state:
        raise UsageError(f"checkpoint {files[0]} is not a minibert checkpoint (no args)")
    return state["args"]


# ---- weights only: Megatron's "release" checkpoints ----
def model_args(cfg) -> dict:
    """The Config as a plain dict, with the derived model shape too (what a checkpoint's args hold)."""
    args = dataclasses.asdict(cfg)
    args.update({name: getattr(cfg, name) for name in MODEL_SHAPE_ARGS})
    return args


def config_from_args(args: dict):
    """A checkpoint's args -> Config (derived entries such as ffn_size are dropped: they follow)."""
    from minibert.config import Config
    names = {f.name for f in dataclasses.fields(Config)}
    return Config(**{k: v for k, v in args.items() if k in names})


def save_weights(checkpoints_dir: str, model, cfg) -> str:
    """SAVE/release/mp_rank_00/model_optim_rng.pt (the model and its args) and the tracker "release":
    what `train.py --load SAVE --finetune` starts from and what fill_mask / convert read."""
    state = {"iteration": 0, "checkpoint_version": CHECKPOINT_VERSION,
             "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "args": model_args(cfg)}
    return save_checkpoint(checkpoints_dir, RELEASE, state)


def load_model(checkpoints_dir: str, **overrides):
    """The BertModel (fp32, CPU, eval mode) stored in a checkpoint directory (a training checkpoint of any
    parallel layout, or released weights), with its Config. `overrides` set Config fields, e.g.
    attention_backend="local"."""
    from minibert.model import BertModel
    from minibert.reshard import load_full_state
    state = load_full_state(checkpoints_dir)  # every rank's file gathered into one model (TP 1 x PP 1)
    if state is None:
        raise UsageError(f"{checkpoints_dir} holds no checkpoint (no {TRACKER_FILENAME}): pass a directory "
                         "written by train.py --save or by python -m minibert.convert from-hf --save")
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


# ---- the command line: python -m minibert.checkpoint convert ... (the work is in minibert/reshard.py) ----
def main(argv=None):
    """Parse `convert --load DIR --save DIR2 --target-...` and call minibert.reshard.convert."""
    from minibert import reshard
    from minibert.errors import OneLineArgumentParser, exit_on_usage_error
    parser = OneLineArgumentParser(prog="python -m minibert.checkpoint", allow_abbrev=False,
                                   description="Tools for minibert checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", allow_abbrev=False, help="reshard a checkpoint to another "
                                  "tensor/pipeline layout (weights, fp32 masters, Adam moments, training state)")
    convert.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory to read (its latest "
                         "iteration)")
    convert.add_argument("--save", required=True, metavar="DIR2", help="new (or empty) directory to write")
    convert.add_argument("--target-tensor-parallel-size", type=int, required=True, metavar="T",
                         help="TP of the new layout")
    convert.add_argument("--target-pipeline-model-parallel-size", type=int, required=True, metavar="P",
                         help="PP of the new layout")
    for name in ("num-layers-per-virtual-pipeline-stage", "decoder-first-pipeline-num-layers",
                 "decoder-last-pipeline-num-layers"):
        convert.add_argument(f"--target-{name}", type=int, default=None, metavar="N",
                             help=f"--{name} of the new layout")

    def run():
        args = vars(parser.parse_args(argv))
        del args["command"]
        paths = reshard.convert(**args)
        print(f"wrote {len(paths)} files under {args['save']}, the tracker last: TP "
              f"{args['target_tensor_parallel_size']} x PP {args['target_pipeline_model_parallel_size']}")
    exit_on_usage_error(run)()


if __name__ == "__main__":
    main()
