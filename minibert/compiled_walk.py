"""Megatron's sample index from one compiled loop (compiled_walk.c), built on first use.

Megatron builds the index in C++ (helpers.cpp, compiled by `make` when megatron.core.datasets is first
used). minibert has the same rule three ways, all giving the same array (tests/test_sample_index.py):

    plain_sample_index   sample_index.py   one Python step per row: the one to read          ~6-8 s *
    the numpy walk       sample_walk.py    whole-array steps, Python only for the short draws  ~0.4-1.3 s *
    compiled_walk        compiled_walk.c   one C loop over the sentences, then the shuffle     ~0.1-0.2 s *

    * 20M sentences, 2 CPU cores (bench/notes-sample-index.md)

build_sample_index uses the compiled loop when this module can build it, else the numpy walk. Building
needs a C compiler (`cc`, or the one named by $CC): this file runs `cc -O2 -shared -fPIC` once and keeps
the library under $MINIBERT_CACHE (default ~/.cache/minibert), named by a hash of the source, the
compiler and the machine, written to a temporary name and renamed (ranks that build at once are safe).
Without a compiler, or with MINIBERT_NO_COMPILE=1, nothing is built and the numpy walk runs: the rows
are the same, only slower.
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys

import numpy as np

from minibert.atomic import commit, discard, makedirs_durable, temporary_path

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled_walk.c")
_library = None  # this process's loaded library; False once building it has failed


def cache_dir():
    """Where the built library is kept: $MINIBERT_CACHE, else ~/.cache/minibert (or $XDG_CACHE_HOME's)."""
    if os.environ.get("MINIBERT_CACHE"):
        return os.environ["MINIBERT_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minibert")


def library():
    """The compiled helper (ctypes.CDLL), built on the first call; None where it cannot be built."""
    global _library
    if _library is None:
        _library = _build_and_load() or False
    return _library or None


def _build_and_load():
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if os.environ.get("MINIBERT_NO_COMPILE") or compiler is None:
        return None
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read())
    key.update(f"{compiler} {sys.platform} {platform.machine()}".encode())
    path = os.path.join(cache_dir(), f"compiled_walk_{key.hexdigest()[:16]}.so")
    if not os.path.isfile(path):
        tmp = None
        try:
            makedirs_durable(os.path.dirname(path))
            tmp = temporary_path(path)  # the compiler writes here; the rename makes it the library
            subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, SOURCE], check=True,
                           capture_output=True, timeout=120)
            commit(tmp, path)
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            discard(tmp)
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    i64, u32, u64 = ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64
    lib.compiled_walk.restype = i64
    lib.compiled_walk.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64, i64, i64, i64, u32,
                                  u32, u64, ctypes.POINTER(ctypes.POINTER(u32))]
    lib.compiled_walk_free.argtypes = [ctypes.POINTER(u32)]
    return lib


def shuffle_seed(seed):
    """std::mt19937_64's seed in helpers.cpp: seed + 1 in a C int (2**31 - 1 + 1 wraps to -2**31), which
    the engine takes mod 2**64."""
    return ((seed + 1 + 2**31) % 2**32 - 2**31) % 2**64


def sample_rows(sizes, first, last, *, num_samples, max_seq, min_sentences, seed, ratio):
    """The shuffled index, uint32 [rows, 3] (global sentence numbers), of the usable documents
    [first[d], last[d]); sizes: every sentence's length in the file. Needs library()."""
    lib = library()
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)  # (the .idx's own array: no copy)
    first = np.ascontiguousarray(first, dtype=np.int64)
    last = np.ascontiguousarray(last, dtype=np.int64)
    out = ctypes.POINTER(ctypes.c_uint32)()
    rows = lib.compiled_walk(sizes.ctypes.data, first.ctypes.data, last.ctypes.data, len(first), num_samples,
                             max_seq, min_sentences, seed, ratio, shuffle_seed(seed), ctypes.byref(out))
    if rows < 0:
        raise MemoryError("the sample index does not fit in memory: ask for fewer samples")
    try:
        return np.ctypeslib.as_array(out, shape=(rows, 3)).copy() if rows else np.zeros((0, 3), np.uint32)
    finally:
        lib.compiled_walk_free(out)
