"""Checkpoints in Megatron's legacy directory layout, written atomically, resumed exactly.

    SAVE/
      latest_checkpointed_iteration.txt          "100"  (written last: it points at a complete file)
      iter_0000100/
        mp_rank_00/model_optim_rng.pt            PP == 1: mp_rank_{tp:02d}
        mp_rank_01_003/model_optim_rng.pt        PP > 1:  mp_rank_{tp:02d}_{pp:03d}

Each file is one dict: iteration, checkpoint_version, model (minibert's own parameter names), optimizer
(Adam moments, fp32 master weights, the fp16 loss scaler), opt_param_scheduler, rng_state (python,
numpy, torch, cuda), consumed_train_samples, consumed_valid_samples and args (the Config as a plain
dict). Everything in it is a tensor, number, string, list or dict, so it loads with
torch.load(weights_only=True): opening a checkpoint never runs code from the file.

Exact resume needs all of it: the weights and Adam state, the LR step, the loss scale, where the data
iterators stand (consumed samples) and the random generators that drive dropout.

Atomic writes (minibert.atomic): each file goes to a temporary name in the same directory, is flushed to
disk (fsync) and renamed over the final name (os.replace is atomic on POSIX); the new directories are
synced before the tracker is written. A crash mid-save leaves the old tracker pointing at the old,
complete checkpoint."""
import dataclasses
import os
import random
import sys

import numpy as np
import torch

from minibert.atomic import atomic_write
from minibert.errors import UsageError

CHECKPOINT_VERSION = 3.0          # Megatron's current legacy-format version number
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"               # Megatron's tracker word for released weights (no training state)
MODEL_SHAPE_ARGS = ["num_layers", "hidden_size", "num_attention_heads", "ffn_size", "max_positions",
                    "vocab_size", "post_ln", "bert_no_binary_head", "layernorm_epsilon"]


def tracker_path(checkpoints_dir: str) -> str:
    return os.path.join(checkpoints_dir, TRACKER_FILENAME)


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
def save_checkpoint(checkpoints_dir: str, iteration: int, state: dict, *, tp_rank=0, pp_rank=0,
                    pp_size=1, write_tracker=True):
    """Write one rank's file, then (rank 0, after every rank's file exists) the tracker."""
    path = checkpoint_path(checkpoints_dir, iteration, tp_rank, pp_rank, pp_size)
    atomic_write(path, lambda f: torch.save(state, f), make_dirs=True)
    if write_tracker:
        atomic_write(tracker_path(checkpoints_dir), lambda f: f.write(f"{iteration}".encode()))
    return path


def training_state(cfg, iteration, model, optimizer, scheduler, consumed_train_samples,
                   consumed_valid_samples) -> dict:
    """The dict stored in model_optim_rng.pt."""
    return {"iteration": iteration,
            "checkpoint_version": CHECKPOINT_VERSION,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "opt_param_scheduler": scheduler.state_dict(),
            "rng_state": [get_rng_state()],  # one entry per data-parallel rank (one today)
            "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "args": model_args(cfg)}


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


def load_checkpoint(checkpoints_dir: str, *, tp_rank=0, pp_rank=0, pp_size=1):
    """The dict of the latest checkpoint in `checkpoints_dir`, or None when there is no tracker."""
    iteration = read_tracker(checkpoints_dir)
    if iteration is None:
        return None
    path = checkpoint_path(checkpoints_dir, iteration, tp_rank, pp_rank, pp_size)
    if not os.path.isfile(path):
        raise UsageError(f"{tracker_path(checkpoints_dir)} points at {path}, which does not exist: "
                         "restore that file or fix the tracker")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read this file is a bad file, not a bug
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"checkpoint {path} is corrupt or not a minibert checkpoint ({type(e).__name__}: "
                         f"{reason}): delete it or point --load elsewhere")
    required = RELEASE_KEYS if iteration == RELEASE else REQUIRED_KEYS
    missing = [k for k in required if not isinstance(state, dict) or k not in state]
    if missing:
        raise UsageError(f"checkpoint {path} is not a minibert checkpoint (missing {', '.join(missing)}): "
                         "point --load at a directory written by minibert's --save")
    return state


def restore_training_state(state: dict, cfg, model, optimizer, scheduler):
    """Put a loaded checkpoint back into the model, optimizer and scheduler. Returns (iteration,
    consumed_train_samples, consumed_valid_samples). The random generators are the caller's to restore
    (set_rng_state(state["rng_state"][0])) once nothing else will draw before the next step."""
    saved = state["args"]
    differ = [f"--{k.replace('_', '-')} {saved.get(k)} (now {getattr(cfg, k)})"
              for k in MODEL_SHAPE_ARGS if saved.get(k) != getattr(cfg, k)]
    if differ:
        raise UsageError("the checkpoint's model differs from the flags: it was saved with "
                         + ", ".join(differ) + "; use the checkpoint's values or another --load")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        reason = " ".join(str(e).split())[:200]
        raise UsageError(f"the checkpoint does not fit this model/optimizer ({reason}): "
                         "point --load at a checkpoint of the same configuration")
    changed = scheduler.load_state_dict(state["opt_param_scheduler"])
    if changed:
        print(f"warning: the LR schedule differs from the checkpoint's ({', '.join(changed)}); "
              "using the command line's", file=sys.stderr, flush=True)
    return state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"]


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
    """The BertModel (fp32, CPU, eval mode) stored in a checkpoint directory (a training checkpoint or
    released weights), with its Config. `overrides` set Config fields, e.g. attention_backend="local"."""
    from minibert.model import BertModel
    state = load_checkpoint(checkpoints_dir)
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
