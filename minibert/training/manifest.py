"""Checksums of every checkpoint file, so a damaged file is refused instead of loaded.

torch.load notices a truncated file, but not a flipped bit inside a tensor's bytes or a block of zeros
where a disk lost data: the weights would load, silently wrong. So every checkpoint directory carries

    iter_0000100/manifest.json    {"files": {"mp_rank_00/model_optim_rng.pt": {"sha256": "...", "bytes": N},
                                             ...every rank's files...}}

written by global rank 0 after every rank has written its files (their digests computed while writing,
at no extra read) and *before* the tracker: a tracker never names a directory without a manifest. At
load, each rank hashes the files it reads and compares: a mismatch or a missing entry exits 2 naming
the file."""
import hashlib
import json
import os

from minibert.atomic import atomic_write
from minibert.errors import UsageError

MANIFEST = "manifest.json"


class HashingWriter:
    """A file wrapper that hashes every byte written through it (torch.save only calls write/flush)."""

    def __init__(self, f):
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0
        self.error = None  # the OSError of a failed write (torch.save reports it as a RuntimeError of its own)

    def write(self, data):
        self.sha256.update(data)
        self.bytes += len(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()

    def entry(self) -> dict:
        return {"sha256": self.sha256.hexdigest(), "bytes": self.bytes}


def file_digest(path) -> dict:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            n += len(block)
    return {"sha256": h.hexdigest(), "bytes": n}


def write_manifest(iteration_dir, entries: dict):
    """entries: path relative to iteration_dir -> {"sha256", "bytes"}."""
    text = json.dumps({"files": dict(sorted(entries.items()))}, indent=1) + "\n"
    atomic_write(os.path.join(iteration_dir, MANIFEST), lambda f: f.write(text), text=True)


def verify(path, iteration_dir):
    """Raise UsageError unless `path` (inside iteration_dir) matches its manifest entry."""
    manifest_path = os.path.join(iteration_dir, MANIFEST)
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        raise UsageError(f"{iteration_dir} has no {MANIFEST}: the checkpoint was never completed or was not "
                         "written by minibert; point the tracker at an earlier iteration") from None
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{manifest_path} is damaged ({e}): restore it or point the tracker at an earlier "
                         "iteration") from None
    name = os.path.relpath(path, iteration_dir)
    if name not in files:
        raise UsageError(f"{path} is not listed in {manifest_path}: the checkpoint is incomplete or mixed with "
                         "another run's files")
    if file_digest(path) != files[name]:
        raise UsageError(f"checkpoint file {path} is damaged (truncated, bit-flipped or partly zeroed: its "
                         f"checksum differs from {MANIFEST}): restore it, or point the tracker at an earlier "
                         "iteration")
