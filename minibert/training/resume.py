"""Resuming: what a loaded checkpoint must agree with, and how it is put back into a run.

A checkpoint (minibert.training.checkpoint) is only resumed into the run it came from. Before anything is loaded
the saved arguments are compared with the flags:

    model shape     --num-layers, --hidden-size, ... the vocab   another shape cannot hold these weights
    parallel layout TP, PP, the virtual and uneven stage flags   each file is one shard: convert first
    sample stream   data, seed, seq length, split, masking, vocab consumed_samples must point into the
                                                                 same sample index

A mismatch is one line naming the flag, its saved value and the fix. Then the weights, the optimizer
(or not: --finetune, --no-load-optim), the LR step, the loss scale and the random generators are put
back, so the next step is the step the interrupted run would have taken.

FP8 scaling state (--fp8-format with the delayed recipe: each FP8 linear's amax histories and scales,
buffers named fp8_*, minibert/fast/fp8.py) is part of the checkpoint of such a run and comes back with the
weights. It is not a weight: a checkpoint without it (a bf16 run's, a tensorwise run's) loads into an FP8
run, whose histories then start empty, and a run without FP8 ignores a checkpoint's; each with one warning."""
import dataclasses
import random
import sys

import numpy as np
import torch

from minibert.errors import UsageError

FP8_STATE = "fp8_"  # the FP8 state's names end in fp8_...: layers.0.mlp.dense_h_to_4h.fp8_scale


def is_fp8_state(name: str) -> bool:
    """An entry of a model's state dict that is FP8 scaling state, not a weight."""
    return name.rpartition(".")[2].startswith(FP8_STATE)


MODEL_SHAPE_ARGS = ["num_layers", "hidden_size", "num_attention_heads", "ffn_size", "max_positions",
                    "vocab_size", "post_ln", "bert_no_binary_head", "layernorm_epsilon"]


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


# ---- what must agree ----
CONVERT_HINT = ("convert it with python -m minibert.tools.reshard convert --load DIR --save NEW_DIR "
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


def load_model_state(chunks, saved: dict, warn):
    """Each chunk's state from a checkpoint's model dict: every weight must be there (KeyError); FP8 scaling
    state is taken where both have it (see the module docstring)."""
    fresh, own = False, set()
    for chunk in chunks:
        current = chunk.state_dict()
        own.update(current)
        missing = {k for k in current if is_fp8_state(k) and k not in saved}  # kept as they are: fresh
        fresh = fresh or bool(missing)
        chunk.load_state_dict({k: v if k in missing else saved[k] for k, v in current.items()})
    if fresh:
        warn("the checkpoint holds no FP8 scaling state (saved without --fp8-format, with --fp8-recipe tensorwise, "
             "or converted): the amax histories start empty, and each tensor's first scale comes from its own amax")
    if any(is_fp8_state(k) and k not in own for k in saved):
        warn("the checkpoint's FP8 scaling state (amax histories and scales) is not used: this run has no "
             "--fp8-format with the delayed recipe")


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
        load_model_state(chunks, state["model"], warn)
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
