"""The batches bench/train_bench.py trains on, built before any timing, as the trainer's DataLoader gives them.

Every batch is a dict of int64 CPU tensors (pinned on a GPU run), keys text, types, labels, padding_mask,
loss_mask [b, s] and is_random [b], with Megatron's conventions: padding_mask 1 at real tokens and 0 (the
[PAD] id) at padding, text and types 0 there, labels -1 off the masked positions.

    prepare_corpus     the default or long-document corpus as a .bin/.idx prefix (preprocessed here)
    stream_batches     windows of the corpus's token stream, [CLS] A [SEP] B [SEP], of chosen lengths
                       (all s: full-length batches, no padding at all)
    megatron_batches   Megatron's samples (minibert.data.masked_lm) through build_datasets + the DataLoader"""
import os

import numpy as np
import torch

import minibert.data.corpus
from minibert.config import Config
from minibert.data.batches import BATCH_KEYS, build_data_iterator, build_datasets
from minibert.data.tokenizer import build_tokenizer

SEED = 1234
TINY_DOCUMENTS = 300  # --tiny: the first documents of a corpus (the CPU test preprocesses them in ~1 s)


def prepare_corpus(kind, given, work_dir, tiny):
    """-> (.bin/.idx prefix, note) of the "default" or "long" corpus. `given`: a prefix (used as is) or a
    text file, one document per line (preprocessed); None: the corpus is written from minibert.data.corpus (the
    long one where this checkout has minibert.data.corpus.long_corpus_documents, else the default corpus stands
    in) and kept in work_dir as {kind}[-tiny]_text_sentence, which a later run in the same work_dir reuses."""
    if given is not None and os.path.isfile(given + ".idx"):
        return given, given
    out = os.path.join(work_dir, kind + ("-tiny" if tiny else ""))
    if given is not None:
        return preprocess_text(given, out, tiny), given
    has_long = hasattr(minibert.data.corpus, "long_corpus_documents")  # python -m minibert.data.corpus --long-documents
    if kind == "long" and has_long:
        note = "minibert.data.corpus --long-documents"
    elif kind == "long":
        note = "no --long-documents corpus in this checkout: the default corpus stands in (pass --long-corpus)"
    else:
        note = "minibert.data.corpus, default"
    if os.path.isfile(out + "_text_sentence.idx"):  # written by an earlier run in this work_dir
        return out + "_text_sentence", note
    documents = (minibert.data.corpus.long_corpus_documents() if kind == "long" and has_long
                 else minibert.data.corpus.default_corpus_documents())
    if tiny:
        documents = documents[:TINY_DOCUMENTS]
    with open(out + ".txt", "w", encoding="utf-8") as f:
        f.write("".join(d + "\n" for d in documents))
    return preprocess_text(out + ".txt", out, tiny), note


def preprocess_text(path, out, tiny):
    from minibert.preprocess import preprocess
    workers = 1 if tiny else max(1, min(8, (os.cpu_count() or 2) - 1))
    return preprocess(path, out, build_tokenizer("BertWordPieceLowerCase"), split_sentences=True,
                      workers=workers, progress=False)[0]


def pinned(batch, device):
    """Page-locked copies on a GPU run, as the trainer's data iterator (build_data_iterator) hands them to get_batch."""
    return {k: v.pin_memory() for k, v in batch.items()} if device.type == "cuda" else batch


def stream_batches(prefix, count, micro, seq, device, lengths=None):
    """`count` batches of `micro` samples cut from the corpus's token stream, one after the other (reused
    from its start when it runs out). Sample i holds lengths[i] real tokens (default: seq, so no padding):

        [CLS] A [SEP] B [SEP] [PAD] ...      A | B split at a random point; types 0 ... 0 1 ... 1 0 ...

    15% of the positions of A and B are masked token by token: 80% [MASK], 10% a random non-special id,
    10% kept (Megatron masks whole-word n-grams; for speed only the count matters). is_random is drawn
    but the parts are not swapped: the sentence order changes no work."""
    from minibert.data.indexed_dataset import IndexedDataset
    tok = build_tokenizer("BertWordPieceLowerCase")
    data = IndexedDataset(prefix)
    n = count * micro
    lengths = np.full(n, seq) if lengths is None else np.asarray(lengths)
    stream = np.memmap(data.bin_path, dtype=data.dtype, mode="r")
    stream = np.asarray(stream[:int(lengths.sum())], dtype=np.int64)  # no more than the samples take
    rng = np.random.default_rng(SEED)
    first_word = max(tok.pad, tok.unk, tok.cls, tok.sep, tok.mask) + 1  # random replacements: no special id
    keys = {k: np.zeros((n, seq), dtype=np.int64) for k in ("text", "types", "padding_mask", "loss_mask")}
    keys["labels"] = np.full((n, seq), -1, dtype=np.int64)
    keys["is_random"] = (rng.random(n) < 0.5).astype(np.int64)
    start = 0
    for i, length in enumerate(lengths.tolist()):
        words = length - 3                                        # [CLS] A [SEP] B [SEP]
        if start + words > len(stream):
            start = 0
        piece, start = stream[start:start + words], start + words
        pivot = int(rng.integers(1, words))                       # len(A)
        tokens = np.concatenate([[tok.cls], piece[:pivot], [tok.sep], piece[pivot:], [tok.sep]])
        words_at = np.r_[1:pivot + 1, pivot + 2:length - 1]       # positions of A and B
        chosen = rng.choice(words_at, size=max(1, round(0.15 * length)), replace=False)
        draw = rng.random(len(chosen))
        shown = tokens.copy()
        shown[chosen[draw < 0.8]] = tok.mask
        randomised = chosen[draw >= 0.9]
        shown[randomised] = rng.integers(first_word, tok.vocab_size, len(randomised))
        keys["text"][i, :length] = shown
        keys["types"][i, pivot + 2:length] = 1
        keys["padding_mask"][i, :length] = 1
        keys["labels"][i, chosen] = tokens[chosen]
        keys["loss_mask"][i, chosen] = 1
    return [pinned({k: torch.from_numpy(v[j * micro:(j + 1) * micro]) for k, v in keys.items()}, device)
            for j in range(count)]


def megatron_batches(prefix, count, cfg, device):
    """The first `count` micro-batches the trainer's DataLoader gives over Megatron's samples of `prefix` at
    cfg's sequence length and seed. Made here with 0 workers before the clock starts: in training, the
    DataLoader's workers make samples in the background, and this bench times the steps."""
    steps = -(-count // cfg.num_micro_batches)  # train_iters x global batch samples: enough for `count`
    cfg = Config(**{**vars(cfg), "data_path": [prefix], "train_iters": steps, "num_workers": 0})
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    iterator = build_data_iterator(train_ds, 0, cfg, device)
    return [{k: b[k] for k in BATCH_KEYS} for b in (next(iterator) for _ in range(count))]


def mean_real_tokens(batches):
    """Real tokens per sample, averaged over the batches' samples."""
    return float(np.mean([float((b["padding_mask"] == 1).sum(1).double().mean()) for b in batches]))


def length_histogram_notes(batches, seq_length, bins=8):
    """The real tokens per sample of the batches as (median, "0-64: n, 64-128: n, ...; x% full"): the
    length histogram in one table cell (minibert.data.masked_lm.length_histogram draws the same as bars)."""
    lengths = np.concatenate([(b["padding_mask"] == 1).sum(1).numpy() for b in batches])
    counts, edges = np.histogram(lengths, bins=bins, range=(0, seq_length))
    cells = ", ".join(f"{lo:.0f}-{hi:.0f}: {n}" for n, lo, hi in zip(counts, edges[:-1], edges[1:]))
    return float(np.median(lengths)), f"{cells}; {(lengths == seq_length).mean():.0%} full, {len(lengths)} samples"

