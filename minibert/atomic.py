"""Atomic file writes: a reader sees the old file or the whole new one, never a part of it.

Every file minibert writes (checkpoints, .bin/.idx, sample indexes, corpora, HF exports, benchmark
reports) goes through this module:

    write to   DIR/.NAME.tmp-HOST-PID-RANDOM   a name unique across processes *and* machines: two nodes
                                               sharing a filesystem may have the same pid
    flush and fsync the file                   its bytes are on disk before anyone can see the name
    os.replace(tmp, DIR/NAME)                  the rename is atomic on POSIX: NAME is old or new, never half
    fsync DIR (and new parents)                the rename itself survives a power cut

If anything fails before the rename, the temporary file is removed and NAME is untouched.
"""
import os
import socket
import uuid

from minibert.errors import UsageError


def require_new_directory(path: str, flag: str):
    """Every tool that writes a directory of files starts from a missing or empty one: files an earlier run
    left there would mix with the new ones (a stale tokenizer.json is what transformers loads, a stale tracker
    is what the trainer resumes from). UsageError otherwise, before anything is read or written."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise UsageError(f"{flag} {path} exists and is not empty: give a new directory (or remove this one "
                         "first; nothing was written)")


def temporary_path(path: str) -> str:
    """A fresh name next to `path`, hidden (leading dot) and unique to this host and process."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(directory: str):
    """Make a directory's entries (a rename, a new file) durable. Some filesystems refuse: the rename is
    still atomic there, only its durability is up to them."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def makedirs_durable(directory: str):
    """os.makedirs, then fsync every directory it created and the existing one above them, so a later
    rename inside `directory` cannot outlive a crash that loses the directories themselves."""
    directory = os.path.abspath(directory)
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for d in reversed(missing):
        os.makedirs(d, exist_ok=True)
    for d in missing + [directory]:  # the new ones, deepest first, then the existing parent
        fsync_dir(d)


def commit(tmp: str, path: str):
    """fsync `tmp` (already closed), rename it to `path`, fsync the directory."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def discard(tmp: str):
    if tmp and os.path.exists(tmp):
        os.remove(tmp)


def atomic_write(path: str, write, *, text: bool = False, make_dirs: bool = False) -> str:
    """Call write(f) on a temporary file next to `path`, then commit it to `path`. Returns `path`.

    text=True opens the file as UTF-8 text with '\\n' newlines; make_dirs=True creates the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    if make_dirs:
        makedirs_durable(directory)
    tmp = temporary_path(path)
    try:
        with (open(tmp, "w", encoding="utf-8", newline="\n") if text else open(tmp, "wb")) as f:
            write(f)
        commit(tmp, path)
    finally:
        discard(tmp)  # gone already after a successful commit
    return path


def atomic_write_bytes(path: str, chunks, **kwargs) -> str:
    """atomic_write for data already in memory: an iterable of bytes objects."""
    def write(f):
        for chunk in chunks:
            f.write(chunk)
    return atomic_write(path, write, **kwargs)
