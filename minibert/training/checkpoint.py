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
layers keep their full-model names; a file written before a rename is read under today's names,
rename_old_keys), optimizer (by parameter name: Adam moments, fp32 masters, the fp16
loss scaler), opt_param_scheduler, rng_state (python, numpy, torch, cuda), consumed_train_samples,
consumed_valid_samples, data_stream (what shapes the sample stream) and args (the Config as a dict). Everything in it is a tensor, number, string, list or dict, so it loads with
torch.load(weights_only=True): opening a checkpoint never runs code from the file.

Exact resume needs all of it: the weights and Adam state, the LR step, the loss scale, where the data
iterators stand (consumed samples) and the random generators that drive dropout.

Atomic writes (minibert.atomic): each file goes to a temporary name in the same directory, is flushed to
disk (fsync) and renamed over the final name (os.replace is atomic on POSIX); the new directories are
synced before the tracker is written. A crash mid-save leaves the old tracker pointing at the old,
complete checkpoint.

What a resume checks against the flags, and how the state goes back into the run: minibert/training/resume.py.
This module is the file format alone (it builds no model); a whole model from a checkpoint of any layout
(load_model) and the converter between layouts (`python -m minibert.tools.reshard convert`): minibert/tools/reshard.py.
Which run may write into a --save directory (its lock, --overwrite-save): minibert/training/save_lock.py."""
import dataclasses
import glob
import os
import re
import shutil
import sys

import torch
import torch.distributed as dist

from minibert.atomic import atomic_write
from minibert.errors import UsageError
from minibert.training.manifest import HashingWriter, verify, write_manifest
from minibert.training.resume import CONVERT_HINT, MODEL_SHAPE_ARGS, get_rng_state

CHECKPOINT_VERSION = 3.0          # Megatron's current legacy-format version number
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"               # Megatron's tracker word for released weights (no training state)


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


# ---- save ----
def write_file(path: str, obj) -> dict:
    """torch.save(obj) to `path` atomically; returns its manifest entry (sha256, bytes)."""
    entry = {}

    def write(f):
        writer = HashingWriter(f)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:  # the disk's own reason (full, over quota), not the zip writer's
                raise writer.error
            raise
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
    """Every rank calls this with its training_state: the files of the module docstring, then the tracker.
    Returns the path of this rank's model file. A write that fails on any rank (a full disk, a quota) fails
    the save on every rank: the iteration's directory is removed, the tracker keeps naming the last complete
    checkpoint, and each rank raises the same one-line UsageError."""
    path = checkpoint_path(checkpoints_dir, iteration, state.tp_rank, state.pp_rank, state.pp)
    directory = iteration_dir(checkpoints_dir, iteration)
    written, failure = {}, None  # this rank's files -> manifest entries; why this rank's writes failed
    try:
        if distributed_optimizer:  # each DP rank's shard in its own file; the model file keeps a marker
            shard = rank_state["optimizer"]
            shard_path = distrib_optim_path(path, state.dp_rank)
            written[os.path.relpath(shard_path, directory)] = write_file(shard_path, shard)
            rank_state = {**rank_state, "optimizer": {"distributed": True, "step": shard["step"],
                                                      "grad_scaler": shard["grad_scaler"]}}
        if state.dp_rank == 0:
            written[os.path.relpath(path, directory)] = write_file(path, rank_state)
    except OSError as e:
        failure = f"rank {state.rank}: {e.strerror or e}"
    everyone = [(written, failure)]
    if state.world_size > 1:  # every rank's files are in place (or failed) once this returns ...
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, (written, failure))
    failures = [f for _, f in everyone if f]
    if state.rank == 0:  # ... then the manifest, and the tracker last
        try:
            if not failures:
                write_manifest(directory, {k: v for files, _ in everyone for k, v in files.items()})
                atomic_write(tracker_path(checkpoints_dir), lambda f: f.write(f"{iteration}".encode()))
        except OSError as e:
            failures.append(f"rank 0: {e.strerror or e}")
        if failures:
            shutil.rmtree(directory, ignore_errors=True)  # never the tracker's: this iteration is new
    if state.world_size > 1:  # rank 0's verdict, which is also the barrier the tracker needs
        verdict = [failures[:1]]
        dist.broadcast_object_list(verdict, src=0)
        failures = verdict[0]
    if failures:
        raise UsageError(f"saving iteration {iteration} into {checkpoints_dir} failed ({failures[0]}); its partial "
                         "files are removed and the tracker still names the last complete checkpoint: free space "
                         "or point --save elsewhere")
    return path


# ---- load ----
def read_tracker(checkpoints_dir: str):
    """The iteration named by the tracker file, or None (with a warning) when there is none: the directory is
    missing, empty, or holds only what a first save cut short leaves (iter_* folders, hidden temporary
    files), as Megatron's `--save X --load X` first launch expects. Any other file there means --load names
    something that is not a checkpoint directory: UsageError, rather than a run that trains from scratch."""
    path = tracker_path(checkpoints_dir)
    if not os.path.isfile(path):
        entries = sorted(os.listdir(checkpoints_dir)) if os.path.isdir(checkpoints_dir) else []
        foreign = [e for e in entries if not (e.startswith(".") or e == RELEASE or e == "vocab.txt"
                                              or (e.startswith("iter_") and e[5:].isdigit()))]
        if foreign:
            raise UsageError(f"{checkpoints_dir} holds files but no checkpoint (no {TRACKER_FILENAME}; it holds "
                             f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}): point --load at a "
                             "directory written by --save, or at a missing or empty one to start from scratch")
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
    rename_old_keys(state)
    state["release"] = iteration == RELEASE
    return state


# ---- parameter names of older checkpoints ----
# A checkpoint keeps the names it was written with, so every rename of a parameter stays here for good, as
# (pattern, today's name). load_checkpoint applies them to each file it reads, so every loader (the
# trainer's resume, minibert.tools.reshard's converter and load_model, and through it fill_mask and convert to-hf)
# sees today's names only.
RENAMED_KEYS = [
    # after commit 9d2e13f, TransformerLayer's two LayerNorms took megatron-core's names
    (re.compile(r"^(layers\.\d+\.)attention_layernorm\."), r"\1input_layernorm."),
    (re.compile(r"^(layers\.\d+\.)mlp_layernorm\."), r"\1pre_mlp_layernorm."),
]


def new_key(name: str) -> str:
    """Today's name of a parameter saved as `name` (`name` itself when it was never renamed)."""
    for pattern, replacement in RENAMED_KEYS:
        name = pattern.sub(replacement, name)
    return name


def rename_old_keys(state: dict) -> dict:
    """In place: the parameter names of a loaded checkpoint file brought to today's (RENAMED_KEYS) wherever
    names are keys: state["model"], state["sharding"], and the optimizer's per-parameter entries
    (state["optimizer"]["params"], or each ZeRO-1 shard's under state["optimizer"]["shards"]). A table that
    holds no old name is left as it is. Returns `state`."""
    def renamed(table):
        if not isinstance(table, dict):
            return table
        names = {k: new_key(k) if isinstance(k, str) else k for k in table}
        return table if all(k == n for k, n in names.items()) else {names[k]: v for k, v in table.items()}

    for key in ("model", "sharding"):
        if key in state:
            state[key] = renamed(state[key])
    optimizer = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else {}
    for entries in [optimizer] + [s for s in optimizer.get("shards") or [] if isinstance(s, dict)]:
        if "params" in entries:
            entries["params"] = renamed(entries["params"])
    return state


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


def save_weights(checkpoints_dir: str, model, cfg) -> str:
    """SAVE/release/mp_rank_00/model_optim_rng.pt (the model and its args) and the tracker "release":
    what `train.py --load SAVE --finetune` starts from and what fill_mask / convert read."""
    state = {"iteration": 0, "checkpoint_version": CHECKPOINT_VERSION,
             "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "args": model_args(cfg)}
    return save_checkpoint(checkpoints_dir, RELEASE, state)

