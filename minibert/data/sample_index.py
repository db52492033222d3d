"""The BERT sample index: which sentences make up each training sample, exactly as Megatron chooses them.

A BERT sample is a run of whole consecutive sentences from one document, grown until it reaches a target
length. Megatron decides all of them before training, in C++ (helpers.cpp `build_mapping`), and stores one
row per sample:

    row = (first sentence, end sentence (exclusive), target length)         uint32 [rows, 3]

    document:  | s0 (40 tokens) | s1 (90) | s2 (300) | s3 (200) | s4 (60) | s5 (30) |
    target 509:  s0 + s1 + s2 + s3 = 630 >= 509, and 2 sentences remain -> row (0, 4, 509)
    next target: s4 + s5, the end of the document                        -> row (4, 6, target)

The rule, per document (sentences [first, last)), with min_sent = 2 when the sentence-order (binary) head
needs an A and a B part, else 1:
- skip the document (no random draw) if it has fewer than min_sent sentences, or if it has more than one
  sentence and any of them is longer than 512 tokens (always 512, whatever --seq-length is);
- draw a target; walk the sentences; emit a row when (tokens >= target and more than one sentence remains and
  the row has >= min_sent sentences) or at the document's last sentence; draw a new target after every row,
  the last one included (a document with k rows uses k + 1 draws).
- target: max_seq = seq_length - 3 (room for [CLS] A [SEP] B [SEP]); with probability about short_seq_prob
  a short one instead. The draw is a word r of std::mt19937(seed): short when r % ratio == 0, ratio =
  C's round(1 / short_seq_prob), and then the target is 2 + r % (max_seq - 1).

Whole epochs over the documents are walked until there are at least num_samples rows (checked only when an
epoch starts; every row is kept, so len(index) can exceed num_samples), then the rows are shuffled by
Fisher-Yates with std::mt19937_64(seed + 1). Both generators come from minibert.data.mersenne.

Two implementations, one result: `plain_sample_index` below is the walk written as the rule reads, one
Python step per row (the one to read first); `build_sample_index`, the one every dataset uses, gets the
same rows from whole-array numpy operations (the numpy walk: minibert/data/sample_walk.py,
minibert/data/fisher_yates.py), with Python only where a short target changes the rows. Tests check that the
two give the same array, and the same as Megatron's C++.

Also here: how --split cuts the documents into train/valid/test ranges (each range gets its own index, with
the same seed and its own num_samples), and how many samples Megatron asks of each split.

Caching: Megatron caches the index under PREFIX/cache/ with a key that leaves the data out, so after the data
is rewritten it reuses a stale index. `cached_sample_index` keeps indices in a directory under a hash of the
split's sentence lengths and document boundaries themselves (everything the index depends on), so a stale
one can never match.
"""
import hashlib
import os
from array import array

import numpy as np

from minibert.atomic import atomic_write
from minibert.config import parse_split
from minibert.data.fisher_yates import megatron_order
from minibert.data.sample_walk import walk
from minibert.errors import UsageError

SPLIT_NAMES = ("train", "valid", "test")
LONG_SENTENCE_LEN = 512  # helpers.cpp's constant: a document with a longer sentence is skipped
_DRAW_BLOCK = 1 << 16    # how many mt19937 words plain_sample_index draws at a time


def check_seed(seed):
    """Megatron passes --seed to C++ as an int32 (and numpy refuses negative seeds)."""
    if not 0 <= seed < 2**31:
        raise UsageError(f"--seed {seed} is out of range: use 0 <= seed < 2**31 (Megatron's C++ index "
                         "builder takes it as a 32-bit int)")


def short_seq_ratio(short_seq_prob):
    """1 / short_seq_prob rounded as C's round() does (halves away from zero: 1/0.4 = 2.5 -> 3, where
    Python's round gives 2); 0 means "never short"."""
    if short_seq_prob <= 0:
        return 0
    return int(np.floor(1.0 / short_seq_prob + 0.5))


def _targets(seed, ratio, max_seq):
    """Yield helpers.cpp's get_target_sample_len() values, one per call, forever."""
    if ratio == 0:  # no draw at all: every target is the maximum
        while True:
            yield max_seq
    bits = np.random.MT19937()
    bits._legacy_seeding(seed)  # == std::mt19937(seed); mt19937_words() says why
    while True:
        r = bits.random_raw(_DRAW_BLOCK)
        yield from np.where(r % ratio == 0, 2 + r % (max_seq - 1), max_seq).tolist()


def _why_no_rows(num_sentences, has_long, min_sent):
    """A UsageError naming the fix, for documents none of which can make a row (Megatron loops forever)."""
    if num_sentences.max(initial=0) == 0:
        return UsageError("every document in this split is empty: check the data prefix, or regenerate "
                          "the .bin/.idx with minibert/preprocess.py")
    one_sentence = (num_sentences == 1).any()
    if min_sent == 2 and not (num_sentences >= 2).any():
        return UsageError("every document in this split has at most one sentence, but the sentence-order "
                          "(binary) head needs two per document: train with --bert-no-binary-head (or give "
                          "the text sentence punctuation and preprocess it with --split-sentences)")
    fix = " (or train with --bert-no-binary-head, which can use the one-sentence documents)" \
        if min_sent == 2 and one_sentence else ""
    return UsageError(f"every document of this split with several sentences has one longer than "
                      f"{LONG_SENTENCE_LEN} tokens, and Megatron skips such documents: cut the text into "
                      f"shorter sentences (minibert/preprocess.py --split-sentences){fix}")


def _max_seq(seq_length):
    max_seq = seq_length - 3  # room for [CLS] A [SEP] B [SEP]
    if max_seq < 2:
        raise UsageError(f"--seq-length {seq_length} is too short: a BERT sample needs at least 5 "
                         "positions ([CLS] A [SEP] B [SEP])")
    return max_seq


def build_sample_index(document_indices, sequence_lengths, *, num_samples, seq_length, short_seq_prob,
                       seed, min_sentences):
    """Megatron's build_mapping over the documents in `document_indices` (global sentence boundaries,
    int64 [D + 1]), with `sequence_lengths` the lengths of all sentences of the file (int32 [S]).

    Returns np.uint32 [rows, 3] of (first sentence, end sentence, target length); rows >= num_samples.
    Where Megatron would loop forever (an epoch that yields no row), raises UsageError instead.
    The same array as plain_sample_index, from whole-array operations (minibert/data/sample_walk.py)."""
    check_seed(seed)
    max_seq = _max_seq(seq_length)
    bounds = np.asarray(document_indices, dtype=np.int64)
    base, top = int(bounds[0]), int(bounds[-1])            # this split's sentences: [base, top)
    sizes = np.asarray(sequence_lengths)[base:top]
    first, last = bounds[:-1] - base, bounds[1:] - base     # each document's local sentences  [D]

    num_sentences = last - first
    has_long = np.zeros(len(first), dtype=bool)             # a sentence over 512 tokens (rare: find them)
    has_long[np.searchsorted(last, np.flatnonzero(sizes > LONG_SENTENCE_LEN), side="right")] = True
    usable = (num_sentences >= min_sentences) & ~((num_sentences > 1) & has_long)
    if num_samples > 0 and not usable.any():
        raise _why_no_rows(num_sentences, has_long, min_sentences)
    total = int(sizes.sum(dtype=np.int64))
    cum = np.zeros(top - base + 1, dtype=np.int32 if total + max_seq < 2**31 else np.int64)
    np.cumsum(sizes, out=cum[1:], dtype=cum.dtype)          # tokens before local sentence i  [S + 1]
    starts, ends, targets = walk(cum, first[usable], last[usable], num_samples=num_samples,
                                 max_seq=max_seq, min_sentences=min_sentences, seed=seed,
                                 ratio=short_seq_ratio(short_seq_prob))
    order = megatron_order(len(starts), seed)              # row p of the index = walk row order[p]
    rows = np.empty((len(starts), 3), dtype=np.uint32)
    base = np.int64(base)                                   # (local numbers may be int32: no wrap)
    rows[:, 0], rows[:, 1], rows[:, 2] = starts[order] + base, ends[order] + base, targets[order]
    return rows


def plain_sample_index(document_indices, sequence_lengths, *, num_samples, seq_length, short_seq_prob,
                       seed, min_sentences):
    """build_sample_index written as the rule reads: one Python step per row (the readable twin)."""
    check_seed(seed)
    max_seq = _max_seq(seq_length)
    bounds = np.asarray(document_indices, dtype=np.int64)
    sizes = np.asarray(sequence_lengths).astype(np.int64)  # cast before summing: no int32 overflow
    cumulative = np.concatenate([[0], np.cumsum(sizes)])   # tokens before sentence i; int64 [S + 1]
    first, last = bounds[:-1], bounds[1:]                   # each document's sentences; int64 [D]

    num_sentences = last - first
    long_before = np.concatenate([[0], np.cumsum(sizes > LONG_SENTENCE_LEN)])
    has_long = long_before[last] > long_before[first]
    usable = (num_sentences >= min_sentences) & ~((num_sentences > 1) & has_long)
    documents = np.stack([first[usable], last[usable]], axis=1).tolist()  # [(first, last), ...]
    if num_samples > 0 and not documents:
        raise _why_no_rows(num_sentences, has_long, min_sentences)

    # Where a row starting at sentence s ends when the target is max_seq (the common case), for every s
    # of these documents at once: the first j with tokens(s..j) >= max_seq is searchsorted(...) - 1.
    base = int(bounds[0])
    starts = cumulative[base:int(bounds[-1])]
    end_at_max = (np.searchsorted(cumulative, starts + max_seq) - 1).tolist()  # [sentences here]
    targets = _targets(seed, short_seq_ratio(short_seq_prob), max_seq)
    rows = array("I")  # flat (first, end, target) triples, 4 bytes each: compact for millions of rows
    while len(rows) < 3 * num_samples:  # one epoch per pass; never stops mid-epoch
        for start, stop in documents:
            while start < stop:
                target = next(targets)
                if target == max_seq:
                    end = end_at_max[start - base]
                else:
                    end = int(np.searchsorted(cumulative, cumulative[start] + target)) - 1
                end = max(end, start + min_sentences - 1)  # the row needs min_sentences sentences
                if end > stop - 3:  # an early cut must leave >= 2 sentences, else take them all
                    end = stop - 1
                rows.extend((start, end + 1, target))
                start = end + 1
            next(targets)  # Megatron draws a target after the document's last row too, and drops it

    return _shuffle(np.frombuffer(rows, dtype=np.uint32).reshape(-1, 3), seed)  # [rows, 3]


def _shuffle(rows, seed):
    """Fisher-Yates as helpers.cpp does it: for i = n-1 .. 1, swap rows i and rand64() % (i + 1)."""
    return rows[megatron_order(len(rows), seed, plain=True)]  # a new, writable array


def cached_sample_index(cache_dir, bounds, sizes, **kwargs):
    """build_sample_index(bounds, sizes, **kwargs), kept in cache_dir (None: no cache) under a hash of all
    it depends on: the documents' boundaries, the lengths of their sentences and the arguments. Written to
    a temporary name, then renamed, so readers see all of it or nothing; ranks that build at once write
    equal files."""
    if cache_dir is None:
        return build_sample_index(bounds, sizes, **kwargs)
    bounds = np.ascontiguousarray(bounds, dtype=np.int64)
    key = hashlib.sha256(repr(sorted(kwargs.items())).encode())
    key.update(bounds.tobytes())
    if len(bounds):  # only this split's sentences matter (the others may change freely)
        key.update(np.ascontiguousarray(np.asarray(sizes)[bounds[0]:bounds[-1]], dtype=np.int32))
    path = os.path.join(cache_dir, f"bert_sample_index_{key.hexdigest()[:32]}.npy")
    if os.path.isfile(path):
        return np.load(path)
    index = build_sample_index(bounds, sizes, **kwargs)
    atomic_write(path, lambda f: np.save(f, index), make_dirs=True)
    return index


def split_num_samples(train_iters, eval_interval, eval_iters, global_batch_size):
    """How many samples Megatron asks of each split: training takes train_iters batches; validation runs
    eval_iters batches every eval_interval iterations (and once more at the end) without ever rewinding;
    the test set is evaluated once."""
    train = train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size
    return train, valid, eval_iters * global_batch_size


def split_document_ranges(split, num_documents):
    """--split weights -> [(begin, end) or None] per split, over documents, exactly as Megatron rounds:

        969,30,1 -> w = [0.969, 0.030, 0.001] (float64) -> bounds 0, w0, w0 + w1, w0 + w1 + w2
        split i = documents [round(b_i * N), round(b_(i+1) * N))  (Python's round, successive additions)

    A split of weight 0 is None (not built)."""
    given = parse_split(split if isinstance(split, str) else ",".join(map(str, split)))
    weights = (np.array(given) / np.sum(given)).tolist()  # float64, as Megatron's normalize()
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    ranges = []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi <= lo:
            ranges.append(None)
            continue
        begin, end = int(round(lo * float(num_documents))), int(round(hi * float(num_documents)))
        if begin == end:  # Megatron crashes here (IndexError); say what to change instead
            skip = ",".join(f"{0 if j == i else w:g}" for j, w in enumerate(given))
            raise UsageError(f"the {SPLIT_NAMES[i]} split gets none of the {num_documents} documents (its "
                             f"share {weights[i]:.4g} rounds to 0): give it a larger --split weight, skip it "
                             f"with --split {skip}, or use more data")
        ranges.append((begin, end))
    return ranges
