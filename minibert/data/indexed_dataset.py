"""Megatron's indexed dataset: token sequences in a `.bin`, their boundaries in a `.idx`.

A corpus of D documents, each a list of sequences (sentences, or one whole document), is stored as

    .bin   every token of every sequence, back to back, no header          (one long token array)
           | 101 7592 | 2088 | 1037 1038 1039 |
             seq 0      seq 1  seq 2
    .idx   header | sequence lengths | sequence pointers | document indices
           lengths  [2, 1, 3]            int32, tokens per sequence
           pointers [0, 4, 6]            int64, byte offset of each sequence in the .bin
           documents [0, 2, 3]           int64, document d = sequences [di[d], di[d+1])

so sequence i is `bin[pointers[i] : pointers[i] + lengths[i] * itemsize]` and reading it is one slice
of a memory-mapped file: nothing is loaded until it is used, which is how Megatron trains on corpora
far larger than RAM. The byte layout (docs/formats.md) is Megatron-LM's, byte for byte, so files written
here train in Megatron and files Megatron wrote load here.

The .idx header (34 bytes, little-endian, packed):

    offset 0   9 bytes  magic b"MMIDIDX\\x00\\x00"
    offset 9   u64      version = 1
    offset 17  u8       dtype code (8 = uint16: BERT's 30522 ids fit; 4 = int32 for big vocabularies)
    offset 18  u64      S, the number of sequences
    offset 26  u64      D + 1, the length of document_indices

An empty document is legal: it has no sequences, so its index repeats (e.g. [0, 2, 2, 3]).

What production does that we leave out: Megatron can also read from S3 or with plain file reads
instead of mmap, and can store a per-sequence "mode" byte for multimodal data (we read such files and
ignore the modes). We keep the one path every BERT run uses."""
import glob
import os
import struct

import numpy as np

from minibert.atomic import commit, discard, temporary_path
from minibert.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D + 1: 34 bytes, no padding
DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_OF_CODE.items()}
REBUILD = "re-run minibert/preprocess.py to rebuild the pair"


def best_dtype(vocab_size):
    """The smallest token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def _missing_file_error(path, prefix):
    hint = "pass the path prefix of a .bin/.idx pair, without the extension"
    if prefix.endswith((".bin", ".idx")):
        hint = f"drop the extension: use {prefix[:-4]}"
    else:
        nearby = sorted(p[:-4] for p in glob.glob(glob.escape(prefix) + "_*.idx"))
        if nearby:
            hint = "did you mean " + " or ".join(nearby[:3]) + "?"
    return UsageError(f"{path} does not exist: {hint}")


class IndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair. `ds[i]` is sequence i as a numpy array (file dtype).

    ds = IndexedDataset("data/corpus_text_sentence")
    len(ds)                 number of sequences S
    ds[i], ds.get(i, 1, 5)  sequence i; its tokens [1, 6)
    ds.document_indices     [D + 1], document d = sequences [di[d], di[d+1])"""

    def __init__(self, path_prefix):
        self.path_prefix = path_prefix
        self.idx_path, self.bin_path = path_prefix + ".idx", path_prefix + ".bin"
        for path in (self.idx_path, self.bin_path):
            if not os.path.isfile(path):
                raise _missing_file_error(path, path_prefix)
        try:
            self._read_index()
            self._map_tokens()
        except OSError as e:  # unreadable (permissions, I/O error), or gone while we opened it
            raise UsageError(f"cannot read {e.filename or path_prefix}: {e.strerror}: check the files "
                             "and their permissions") from None

    def _read_index(self):
        size = os.path.getsize(self.idx_path)
        if size < HEADER.size:
            raise UsageError(f"{self.idx_path} is truncated ({size} bytes, shorter than the "
                             f"{HEADER.size}-byte header): {REBUILD}")
        with open(self.idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc_idx = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise UsageError(f"{self.idx_path} is not a Megatron index file (starts with {magic!r}, "
                             f"expected {MAGIC!r}): pass the .idx written by preprocess, or {REBUILD}")
        if version != VERSION:
            raise UsageError(f"{self.idx_path} has index version {version}, only version {VERSION} "
                             f"exists: {REBUILD}")
        if code not in DTYPE_OF_CODE:
            raise UsageError(f"{self.idx_path} has an unknown dtype code {code}: {REBUILD}")
        self.dtype = DTYPE_OF_CODE[code]
        # lengths int32 [S], pointers int64 [S], document indices int64 [D+1] (+ modes int8 [S])
        expected = HEADER.size + 12 * n_seq + 8 * n_doc_idx
        if size not in (expected, expected + n_seq):
            what = "truncated" if size < expected else "longer than its header says"
            raise UsageError(f"{self.idx_path} is {what} ({size} bytes; its header promises "
                             f"{n_seq} sequences and {n_doc_idx} document indices = {expected} "
                             f"bytes): {REBUILD}")
        raw = np.memmap(self.idx_path, dtype=np.uint8, mode="r")  # nothing read until touched
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(raw, np.int32, n_seq, offset)
        offset += 4 * n_seq
        self.sequence_pointers = np.frombuffer(raw, np.int64, n_seq, offset)
        offset += 8 * n_seq
        self.document_indices = np.frombuffer(raw, np.int64, n_doc_idx, offset)
        self._check_index()

    def _check_index(self):
        """Cheap O(S) consistency checks, so a corrupt index fails here and not mid-training."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = np.dtype(self.dtype).itemsize
        # pointers must be the running byte offsets of the lengths: [0, l0, l0+l1, ...] * itemsize
        starts = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        problems = [
            (len(docs) == 0, "it has no document indices (even an empty dataset has [0])"),
            (len(docs) > 0 and (docs[0] != 0 or docs[-1] != len(lengths)),
             f"its document indices must run from 0 to {len(lengths)}"),
            (np.any(np.diff(docs) < 0), "its document indices decrease"),
            (np.any(lengths < 0), "it has negative sequence lengths"),
            (not np.array_equal(pointers, starts * itemsize), "its sequence pointers do not "
             "match its sequence lengths"),
        ]
        for bad, why in problems:
            if bad:
                raise UsageError(f"{self.idx_path} is corrupt ({why}): {REBUILD}")

    def _map_tokens(self):
        itemsize = np.dtype(self.dtype).itemsize
        n_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        size = os.path.getsize(self.bin_path)
        if size != n_tokens * itemsize:
            what = "shorter" if size < n_tokens * itemsize else "longer"
            raise UsageError(f"{self.bin_path} is {what} than its index says ({size} bytes, "
                             f"{self.idx_path} promises {n_tokens} tokens x {itemsize} bytes): the "
                             f"pair comes from different runs or a write was cut short; {REBUILD}")
        if n_tokens == 0:  # mmap refuses empty files; a corpus of empty documents is still legal
            self._tokens = np.zeros(0, self.dtype)
        else:  # the whole .bin as one token array, paged in by the OS on demand
            self._tokens = np.asarray(np.memmap(self.bin_path, dtype=self.dtype, mode="r"))
        self._starts = self.sequence_pointers // itemsize  # token offset of each sequence

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        if isinstance(i, slice):  # contiguous slices only, as Megatron: a list of sequences
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            return [self.get(j) for j in range(start, stop)]
        return self.get(i)

    def get(self, i, offset=0, length=None):
        """Tokens [offset, offset + length) of sequence i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        i = int(i) % n
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        start = int(self._starts[i]) + offset
        return self._tokens[start:start + length]

    def __getstate__(self):  # DataLoader workers re-open the files instead of copying the arrays
        return self.path_prefix

    def __setstate__(self, path_prefix):
        self.__init__(path_prefix)

    @staticmethod
    def exists(path_prefix):
        return os.path.isfile(path_prefix + ".idx") and os.path.isfile(path_prefix + ".bin")


class IndexedDatasetBuilder:
    """Write a `.bin`/`.idx` pair one sequence or one document at a time.

    builder = IndexedDatasetBuilder("out_text_sentence.bin", dtype=best_dtype(tok.vocab_size))
    builder.add_document(tokens_of_the_document, lengths_of_its_sentences)   # per document
    builder.finalize("out_text_sentence.idx")

    Tokens go to a temporary file next to the .bin as they come; only the lengths stay in memory
    (as int32/int64 arrays). `add_documents` takes many documents at once, packed in arrays: what the
    preprocessing workers send back. `finalize` writes the index and renames both files into place,
    so a crash never leaves a half-written pair under the final names (`abort()` or leaving a `with`
    block by an exception deletes the temporary files)."""

    def __init__(self, bin_path, dtype=np.uint16):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        out_dir = os.path.dirname(os.path.abspath(bin_path))
        if not os.path.isdir(out_dir):
            raise UsageError(f"output directory {out_dir} does not exist: create it or change "
                             "--output-prefix")
        self._tmp_bin = temporary_path(bin_path)
        self._tmp_idx = None
        self._file = open(self._tmp_bin, "wb")
        self._lengths, self._documents = [], [np.zeros(1, dtype=np.int64)]  # arrays, in order
        self._new_lengths, self._new_documents = [], []  # one at a time, not yet in an array
        self.num_sequences = 0

    def _write_tokens(self, tokens):
        values = np.asarray(tokens)
        if values.size and not values.dtype == self.dtype:  # refuse silent wrap-around (e.g. 70000 in uint16)
            info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else np.finfo(self.dtype)
            if values.min() < info.min or values.max() > info.max:
                raise ValueError(f"token ids outside {self.dtype}'s range [{info.min}, {info.max}]")
        values = values.astype(self.dtype.newbyteorder("<"), copy=False).reshape(-1)
        self._file.write(values.tobytes())
        return values.size

    def add_item(self, tokens):
        """One sequence (a sentence); call `end_document()` after a document's last sentence."""
        self._new_lengths.append(self._write_tokens(tokens))
        self.num_sequences += 1

    def add_document(self, tokens, lengths):
        """A whole document: its tokens back to back, and the length of each of its sequences.
        `lengths == []` (with no tokens) adds an empty document."""
        n = self._write_tokens(tokens)
        if n != sum(lengths):
            raise ValueError(f"document has {n} tokens but its lengths add up to {sum(lengths)}")
        self._new_lengths.extend(int(x) for x in lengths)
        self.num_sequences += len(lengths)
        self.end_document()

    def add_documents(self, tokens, lengths, sequences_per_document):
        """Many documents at once: all their tokens back to back, every sequence's length (int [S]),
        and how many sequences each document has (int [D]; 0 for an empty document)."""
        lengths = np.asarray(lengths, dtype=np.int32)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        n = self._write_tokens(tokens)
        if n != lengths.sum(dtype=np.int64) or counts.sum() != len(lengths):
            raise ValueError(f"{n} tokens, {len(lengths)} lengths adding up to {lengths.sum()}, and "
                             f"{counts.sum()} sequences in the documents: they must agree")
        self._flush()
        self._lengths.append(lengths)
        self._documents.append(self.num_sequences + np.cumsum(counts))
        self.num_sequences += len(lengths)

    def end_document(self):
        self._new_documents.append(self.num_sequences)

    def _flush(self):
        """Move what add_item / add_document collected one by one into arrays, keeping the order."""
        if self._new_lengths:
            self._lengths.append(np.array(self._new_lengths, dtype=np.int32))
        if self._new_documents:
            self._documents.append(np.array(self._new_documents, dtype=np.int64))
        self._new_lengths, self._new_documents = [], []

    def finalize(self, idx_path):
        """Write the index next to the tokens, then rename both into place (.bin first)."""
        self._file.close()
        self._flush()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize  # byte offsets, as Megatron stores them
        documents = np.concatenate(self._documents)
        self._tmp_idx = temporary_path(idx_path)
        with open(self._tmp_idx, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(documents)))
            for array in (lengths, pointers, documents):
                f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        commit(self._tmp_bin, self.bin_path)  # the tokens first: an .idx never names a missing .bin
        commit(self._tmp_idx, idx_path)

    def abort(self):
        """Drop everything written so far (used when preprocessing fails half way)."""
        self._file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            discard(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
