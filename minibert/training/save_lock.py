"""Which run may write into a --save directory: one run at a time, and never over another run's checkpoints.

A run can damage checkpoints that are not its own in two ways:

- it trains from scratch, or from another --load, into a --save that already holds checkpoints: it writes
  its iter_* folders over theirs as it reaches their numbers, and rewinds the tracker;
- two live runs are given the same --save and write into it at the same time.

check_save_owner refuses the first when the flags are validated, before anything is built. Against the
second, the trainer's claim takes a lock file, SAVE/.minibert.lock, for the whole run. Its life:

    launch     rank 0: lock_directory creates the file, holding "HOST PID"; O_EXCL makes the creation
               fail if the file exists, so of two launches at the same moment exactly one gets it;
               then, under the lock: --overwrite-save's start_over, remove_stale_temporaries
    training   the file stays; a second launch finds it and reads it:
                   this host, the process lives       stop: "in use by process PID of this host"
                   this host, the process has ended   one warning, and the lock is taken over
                                                      (the run was killed: kill -9, a lost shell)
                   another host, or unreadable        stop, naming the file to delete once that job is
                                                      known to be gone (this host cannot see another
                                                      host's processes)
    end        unlock_directory removes it, if it still names this process

What the directory holds, and how it is written, is minibert/training/checkpoint.py's business; this module
decides only who writes there."""
import contextlib
import os
import shutil
import socket
import sys

import torch.distributed as dist

from minibert.errors import UsageError
from minibert.parallel.faults import _alive
from minibert.training.checkpoint import RELEASE, TRACKER_FILENAME, tracker_path

LOCK_FILENAME = ".minibert.lock"   # "HOST PID" of the run that writes this directory now


def existing_checkpoints(checkpoints_dir: str) -> list:
    """The tracker and iter_* / release folders in a directory: what a run could overwrite there."""
    if not os.path.isdir(checkpoints_dir):
        return []
    return sorted(e for e in os.listdir(checkpoints_dir)
                  if e == TRACKER_FILENAME or e == RELEASE or (e.startswith("iter_") and e[5:].isdigit()))


def check_save_owner(save, load, finetune=False, overwrite_save=False):
    """A run writes into a --save directory that holds checkpoints only when it resumes from them (--load is
    the same directory): anything else would overwrite another run's iterations as it reaches them. Megatron's
    first launch, --save X --load X with X missing or empty, is a run that owns X. UsageError otherwise."""
    found = existing_checkpoints(save)
    resumes_here = bool(load) and os.path.abspath(load) == os.path.abspath(save)
    if overwrite_save and resumes_here:
        raise UsageError(f"--overwrite-save would delete the checkpoints --load {load} reads: give --save "
                         "another directory, or drop --overwrite-save to resume")
    if not found or overwrite_save or (resumes_here and not finetune):
        return
    why = ("--finetune starts again at iteration 0" if resumes_here else
           f"this run loads {load}" if load else "this run does not --load it")
    listed = ", ".join(found[:2]) + (", ..." if len(found) > 2 else "")
    raise UsageError(f"--save {save} holds another run's checkpoints ({listed}) and {why}: resume with --load "
                     f"{save}, give a new --save, or add --overwrite-save to delete them and start over")


def _lock_holder(path: str):
    """(host, pid) from a lock file, or None when it cannot be read as one."""
    try:
        with open(path) as f:
            host, pid = f.read().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None




def lock_directory(checkpoints_dir: str) -> str:
    """Create SAVE/.minibert.lock holding this host and pid, so two live runs never share a --save
    directory. A lock left by a dead process of this host is taken over with one line; a live one, or one
    from another host (whose processes this host cannot see), is a UsageError saying what to do."""
    os.makedirs(checkpoints_dir, exist_ok=True)
    path, host = os.path.join(checkpoints_dir, LOCK_FILENAME), socket.gethostname()
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # fails if the file exists
        except FileExistsError:
            holder = _lock_holder(path)
            if holder and holder[0] == host and not _alive(holder[1]):
                print(f"warning: {path} was left by process {holder[1]}, which has ended; taking it over",
                      file=sys.stderr, flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            if holder and holder[0] == host:
                raise UsageError(f"--save {checkpoints_dir} is in use by process {holder[1]} of this host: wait "
                                 "for that run to end, or give another --save")
            who = f"process {holder[1]} on host {holder[0]}" if holder else "an unreadable lock"
            raise UsageError(f"--save {checkpoints_dir} is locked by {who}: if no run uses the directory any "
                             f"more, delete {path} and launch again")
        with os.fdopen(fd, "w") as f:
            f.write(f"{host} {os.getpid()}\n")
        return path
    raise UsageError(f"--save {checkpoints_dir}: another run took {path} at the same time; launch again")


def unlock_directory(path) -> None:
    """Remove the lock this process took (if it is still this process's)."""
    if path and _lock_holder(path) == (socket.gethostname(), os.getpid()):
        os.remove(path)


def start_over(checkpoints_dir: str) -> list:
    """--overwrite-save: delete the tracker first (a crash midway leaves no checkpoint to resume by
    mistake), then the iter_* and release folders. Returns what was deleted."""
    found = existing_checkpoints(checkpoints_dir)
    with contextlib.suppress(FileNotFoundError):
        os.remove(tracker_path(checkpoints_dir))
    for name in found:
        shutil.rmtree(os.path.join(checkpoints_dir, name), ignore_errors=True)
    return found


def remove_stale_temporaries(checkpoints_dir: str) -> int:
    """Delete the hidden temporary files (minibert.atomic) of saves that were killed midway: under the
    lock no other writer is alive, so every one of them is stale. Returns the bytes freed."""
    freed = 0
    for root, _, files in os.walk(checkpoints_dir):
        for name in files:
            if name.startswith(".") and ".tmp-" in name:
                path = os.path.join(root, name)
                with contextlib.suppress(FileNotFoundError):
                    freed += os.path.getsize(path)
                    os.remove(path)
    return freed


def claim(cfg, state):
    """Before training, rank 0 takes the --save directory: the lock, then --overwrite-save's deletion and
    the cleanup of dead saves' temporary files. Every rank learns the outcome, so a refusal is the same
    UsageError everywhere. Returns the lock's path (for unlock_directory) or None without --save."""
    if not cfg.save:
        return None
    lock, problem = None, None
    if state.rank == 0:
        try:
            lock = lock_directory(cfg.save)
            if cfg.overwrite_save and (gone := start_over(cfg.save)):
                print(f"--overwrite-save: deleted {', '.join(gone)} from {cfg.save}", flush=True)
            if freed := remove_stale_temporaries(cfg.save):
                print(f"removed {freed / 1e6:.1f} MB of temporary files left in {cfg.save} by a save that was "
                      "killed", flush=True)
        except UsageError as e:
            problem = str(e)
    if state.world_size > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        unlock_directory(lock)
        raise UsageError(problem)
    return lock


