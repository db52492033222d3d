"""BERT training samples, identical to megatron-core's BERTMaskedWordPieceDataset, row for row.

One sample, from a row (first sentence, end sentence, target) of the sample index (sample_index.py):

    sentences     s0 s1 s2 s3                         a run of whole sentences from one document
    split         A = s0 s1 | B = s2 s3               at a random pivot (binary head; else all A)
    SOP swap      B A  (is_random = 1, half the time) the sentence-order prediction label
    truncate      trim the longer part, front or back at random, until len(A) + len(B) <= target
    join          [CLS] A [SEP] B [SEP]   types 0 ... 0 1 ... 1
    mask          ~15%, as whole words in 1-3 word n-grams: 80% [MASK], 10% a random token, 10% kept
    pad           to seq_length with [PAD]; labels -1 except at the selected positions

Every random choice of sample i comes from its own np.random.RandomState(seed + i), in Megatron's order,
so sample i never depends on which samples were read before it (any DataLoader worker can make any row).
The order of the draws is the contract: docs/formats.md ("BERT samples") lists it step by step.

Splits: `--split 969,30,1` cuts the *documents* into train/valid/test ranges; each range gets its own
sample index (same seed, its own num_samples). CLI: python -m minibert.data.masked_lm --help.
"""
import bisect
import os
import sys

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np

from minibert.atomic import atomic_write
from minibert.data.blended_dataset import blend_splits, parse_data_path
from minibert.data.indexed_dataset import IndexedDataset
from minibert.data.sample_index import (
    SPLIT_NAMES,
    cached_sample_index,
    check_seed,
    split_document_ranges,  # noqa: F401 (re-export)
    split_num_samples,  # noqa: F401 (re-export)
)
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error

MAX_NGRAM = 3  # whole-word n-grams of 1, 2 or 3 words, as Megatron's pretrain_bert.py configures
# P(n) proportional to 1/n: [6/11, 3/11, 2/11]. Megatron normalises twice (once when building the table,
# once per draw), which can move the last bit, so we do it too. rng.choice([1, 2, 3], p=NGRAM_P) draws one
# rng.random() and looks it up in the cumulative table below; we do the same lookup ourselves, which costs
# far less than a choice() call per draw (bench/notes/sample-index.md).
_P = 1.0 / np.arange(1, MAX_NGRAM + 1)
_P = _P / _P.sum()
NGRAM_P = _P / _P.sum()
NGRAM_CDF = (NGRAM_P.cumsum() / NGRAM_P.cumsum()[-1]).tolist()  # what choice() searches, side="right"


class BertMaskedLMDataset:
    """Map-style dataset of BERT samples (works with torch's DataLoader; torch-free itself).

    ds[i] -> dict of np.int64: text, types, labels, padding_mask, loss_mask [seq_length]; is_random,
    truncated (0-d). len(ds) = rows of the sample index (>= num_samples: whole epochs are kept)."""

    def __init__(self, indexed_dataset, tokenizer, *, seq_length, num_samples, seed, binary_head=True,
                 masked_lm_prob=0.15, short_seq_prob=0.1, document_range=None, cache_dir=None):
        if not 0 < masked_lm_prob < 1:
            raise UsageError(f"--mask-prob {masked_lm_prob} must be between 0 and 1 (BERT uses 0.15)")
        if not 0 <= short_seq_prob <= 1:
            raise UsageError(f"--short-seq-prob {short_seq_prob} must be between 0 and 1 (BERT uses 0.1)")
        check_seed(seed)
        if not np.issubdtype(indexed_dataset.dtype, np.integer):
            raise UsageError(f"{indexed_dataset.path_prefix}.bin holds {np.dtype(indexed_dataset.dtype)} "
                             "values, not token ids: pass a pair written by minibert/preprocess.py")
        self.sentences = indexed_dataset
        self.seq_length, self.seed, self.binary_head = seq_length, seed, binary_head
        self.masked_lm_prob = masked_lm_prob
        self.cls, self.sep, self.mask, self.pad = tokenizer.cls, tokenizer.sep, tokenizer.mask, tokenizer.pad
        # Random replacements draw from all vocab ids, in inv_vocab's order (Megatron's token_lookup).
        self.token_lookup = list(tokenizer.inv_vocab.keys())
        self.is_subword = np.zeros(max(self.token_lookup) + 1, dtype=bool)  # "##ing": continues a word
        for token_id, token in tokenizer.inv_vocab.items():
            self.is_subword[token_id] = token.startswith("##")

        num_documents = len(indexed_dataset.document_indices) - 1
        begin, end = document_range if document_range is not None else (0, num_documents)
        if not 0 <= begin < end <= num_documents:
            raise UsageError(f"document range [{begin}, {end}) selects no documents out of {num_documents}")
        index_args = dict(num_samples=num_samples, seq_length=seq_length, short_seq_prob=short_seq_prob,
                          seed=seed, min_sentences=2 if binary_head else 1)  # the binary head needs A and B
        bounds = indexed_dataset.document_indices[begin:end + 1]
        self.sample_index = cached_sample_index(cache_dir, bounds, indexed_dataset.sequence_lengths,
                                                **index_args)

    def __len__(self):
        return len(self.sample_index)

    def __getitem__(self, idx):
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        first, end, target = (int(v) for v in self.sample_index[idx])
        rng = np.random.RandomState((self.seed + idx) % 2**32)
        sentences = [self.sentences[i].astype(np.int64) for i in range(first, end)]  # from uint16

        # A | B at a random pivot; with probability 1/2 swap them (sentence-order prediction).
        pivot, is_random = len(sentences), False
        if self.binary_head:
            pivot = 1 if len(sentences) < 3 else rng.randint(1, len(sentences))
            is_random = rng.random() < 0.5
        a, b = _join(sentences[:pivot]), _join(sentences[pivot:])
        if is_random:
            a, b = b, a

        # Trim the longer part (B on a tie) from the front or the back until both fit in the target.
        truncated = len(a) + len(b) > target
        while len(a) + len(b) > target:
            front = rng.random() < 0.5
            if len(a) > len(b):
                a = a[1:] if front else a[:-1]
            else:
                b = b[1:] if front else b[:-1]

        # [CLS] A [SEP] B [SEP]; token types 0 for the first part, 1 for the second.
        parts = [[self.cls], a, [self.sep]] + ([b, [self.sep]] if len(b) else [])
        tokens = np.concatenate(parts).astype(np.int64)                 # [n]
        types = np.zeros(len(tokens), dtype=np.int64)
        types[len(a) + 2:] = 1

        masked, positions = self.mask_tokens(tokens, target, rng)
        return self._pad(tokens, masked, types, positions, is_random, truncated)

    def mask_tokens(self, tokens, target, rng):
        """Megatron's n-gram whole-word masking. Returns (masked tokens [n], sorted selected positions).

        Worked example: [CLS] the un ##aff ##able cat [SEP] -> words [1] [2 3 4] [5]; a 2-gram from the
        second word covers positions 2 3 4 5. n_mask = min(0.15 * target, max(1, round(0.15 * n)))."""
        if tokens.max() >= len(self.is_subword) or tokens.min() < 0:
            bad = tokens.max() if tokens.max() >= len(self.is_subword) else tokens.min()
            raise UsageError(f"token id {bad} is not in the vocab ({len(self.is_subword)} ids): the "
                             "data was tokenized with another vocab; pass that --vocab-file")
        # Words: positions other than [CLS]/[SEP]; a "##" piece joins the word before it (even across a
        # [SEP]), except at the very first candidate, which always starts a word.
        candidates = np.flatnonzero((tokens != self.cls) & (tokens != self.sep))
        starts_word = ~self.is_subword[tokens[candidates]]
        starts_word[:1] = True
        word_begin = np.flatnonzero(starts_word).tolist()           # into candidates; [words]
        word_end = word_begin[1:] + [len(candidates)]
        num_words = len(word_begin)
        n_mask = min(self.masked_lm_prob * target, max(1, int(round(len(tokens) * self.masked_lm_prob))))

        order = np.arange(num_words)
        rng.shuffle(order)  # the order in which words are tried as the start of an n-gram
        masked, selected = tokens.copy(), np.zeros(len(tokens), dtype=bool)
        num_selected = 0
        for w in order.tolist():
            if n_mask - num_selected < 1:  # see below: Megatron goes on, but nothing more can change
                break
            n = 1 + bisect.bisect_right(NGRAM_CDF, rng.random())  # = rng.choice([1, 2, 3], p=NGRAM_P)
            while True:  # shrink the n-gram until it fits in what is left of n_mask
                span = candidates[word_begin[w]:word_end[min(w + n, num_words) - 1]]
                n -= 1
                if num_selected + len(span) <= n_mask or n == 0:
                    break
            if num_selected + len(span) > n_mask or selected[span].any():
                continue  # even one word is too many, or it overlaps an earlier n-gram
            for p in span.tolist():
                selected[p] = True
                num_selected += 1
                if rng.random() < 0.8:
                    masked[p] = self.mask                                           # 80%: [MASK]
                elif rng.random() >= 0.5:
                    masked[p] = self.token_lookup[rng.randint(0, len(self.token_lookup))]  # 10%: random
                # else 10%: keep the token (it is still predicted)
        # Megatron stops only when num_selected >= n_mask, and n_mask is often fractional (0.15 * 509 =
        # 76.35): then it draws an n for every remaining word, finds nothing fits, and afterwards shuffles
        # the words again (for a permutation option BERT leaves off). Those draws change no output (the
        # RandomState is dropped with the sample), so we stop as soon as no word can fit.
        return masked, np.flatnonzero(selected)

    def _pad(self, tokens, masked, types, positions, is_random, truncated):
        """Pad to seq_length with the pad id P and build the label and mask arrays (Megatron's step 7)."""
        s, n, pad = self.seq_length, len(tokens), self.pad
        text = np.full(s, pad, dtype=np.int64)
        text[:n] = masked
        token_types = np.full(s, pad, dtype=np.int64)
        token_types[:n] = types
        padding_mask = np.where(text == pad, pad, 1)  # after masking: a random [PAD] mid-text counts too
        labels = np.full(s, -1, dtype=np.int64)
        labels[positions] = tokens[positions]         # the original id, even where it was kept
        loss_mask = np.zeros(s, dtype=np.int64)
        loss_mask[positions] = 1
        text[text == pad] = 0      # no-ops for BERT's vocab ([PAD] = 0); Megatron maps the pad id to 0
        labels[labels == pad] = 0  # for the embedding, and so do we for other vocabs
        return {"text": text, "types": token_types, "labels": labels, "is_random": np.int64(is_random),
                "padding_mask": padding_mask.astype(np.int64), "loss_mask": loss_mask,
                "truncated": np.int64(truncated)}


def _join(sentences):
    return np.concatenate(sentences) if sentences else np.zeros(0, dtype=np.int64)


def open_data_prefix(data_prefix):
    """IndexedDataset(data_prefix), with a hint when the prefix lacks preprocess's suffix."""
    if not IndexedDataset.exists(data_prefix):
        hint = "pass the prefix of a .bin/.idx pair written by minibert/preprocess.py, without the extension"
        written = [data_prefix + suffix for suffix in ("_text_sentence", "_text_document")
                   if IndexedDataset.exists(data_prefix + suffix)]
        if written:
            hint = f"did you mean --data-path {written[0]}? (preprocess adds _text_sentence/_text_document)"
        raise UsageError(f"no {data_prefix}.bin/.idx: {hint}")
    return IndexedDataset(data_prefix)


def build_train_valid_test_datasets(data_prefix, tokenizer, *, split, num_samples, seq_length, seed,
                                    binary_head, masked_lm_prob=0.15, short_seq_prob=0.1, cache_dir=None):
    """(train, valid, test) BertMaskedLMDatasets over one data prefix; None for a split of weight 0.
    num_samples: (train, valid, test) counts, e.g. from split_num_samples()."""
    sentences = open_data_prefix(data_prefix)
    ranges = split_document_ranges(split, len(sentences.document_indices) - 1)
    datasets = []
    for name, document_range, count in zip(SPLIT_NAMES, ranges, num_samples):
        if document_range is None:
            datasets.append(None)
            continue
        try:
            datasets.append(BertMaskedLMDataset(
                sentences, tokenizer, seq_length=seq_length, num_samples=count, seed=seed,
                binary_head=binary_head, masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob,
                document_range=document_range, cache_dir=cache_dir))
        except UsageError as e:
            raise UsageError(f"{data_prefix}, {name} split: {e}") from None
    return tuple(datasets)


def build_blended_train_valid_test_datasets(data_path_list, tokenizer, split, num_samples, seq_length, seed,
                                            binary_head, masked_lm_prob=0.15, short_seq_prob=0.1,
                                            cache_dir=None):
    """(train, valid, test) for --data-path as Megatron parses it: one prefix -> the BertMaskedLMDatasets of
    build_train_valid_test_datasets, exactly; weights and prefixes alternating -> a BlendedDataset per
    split (blended_dataset.py) over each corpus's BertMaskedLMDatasets. None for a split of weight 0;
    num_samples: (train, valid, test), e.g. from split_num_samples()."""
    settings = dict(split=split, seq_length=seq_length, seed=seed, binary_head=binary_head,
                    masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob, cache_dir=cache_dir)
    prefixes, weights = parse_data_path(data_path_list)
    if weights is None:
        return build_train_valid_test_datasets(prefixes[0], tokenizer, num_samples=num_samples, **settings)

    def build_corpus(prefix, counts):
        return build_train_valid_test_datasets(prefix, tokenizer, num_samples=counts, **settings)

    return blend_splits(prefixes, weights, num_samples, build_corpus, cache_dir)


def stack_samples(dataset):
    """All rows of a dataset as {key: int64 [rows, seq_length] (scalars such as is_random: [rows])}."""
    samples = [dataset[i] for i in range(len(dataset))]
    keys = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")
    if not samples:
        return {key: np.zeros((0, dataset.seq_length) if key not in ("is_random", "truncated") else 0,
                              dtype=np.int64) for key in keys}
    return {key: np.stack([sample[key] for sample in samples]) for key in samples[0]}  # + dataset_id


def sample_lengths(dataset, limit=None):
    """Real tokens per sample ([CLS] ... [SEP] included, padding not) of the first `limit` rows (all by
    default; the index is shuffled, so any first rows are a fair draw): int64 [rows]."""
    rows = range(min(len(dataset), len(dataset) if limit is None else limit))
    return np.array([np.flatnonzero(dataset[i]["padding_mask"])[-1] + 1 for i in rows], dtype=np.int64)


def length_histogram(lengths, seq_length, bins=8, width=40):
    """A text histogram of sample lengths over [0, seq_length], with the median and the share of full
    samples: how much of each batch is real text rather than padding."""
    lengths = np.asarray(lengths)
    counts, edges = np.histogram(lengths, bins=bins, range=(0, seq_length))
    lines = [f"{len(lengths)} samples of {seq_length} positions: median {np.median(lengths):.0f} real tokens, "
             f"mean {lengths.mean():.0f} ({lengths.mean() / seq_length:.0%} of the batch is text), "
             f"{(lengths == seq_length).mean():.0%} full"]
    for count, lo, hi in zip(counts, edges[:-1], edges[1:]):
        bar = "#" * int(round(width * count / max(counts.max(), 1)))
        lines.append(f"  {lo:4.0f}-{hi:4.0f} {count:7d} {bar}")
    return "\n".join(lines)


def show_sample(i, sample, tokenizer):
    """Sample i decoded: the tokens as the model sees them, then each labelled position as
    position:original (kept) or position:original->shown ([MASK] or a random token)."""
    n = int(np.flatnonzero(sample["padding_mask"] == 1)[-1]) + 1  # up to the last real token
    tokens = tokenizer.convert_ids_to_tokens(sample["text"][:n])
    labelled = []
    for p in np.flatnonzero(sample["loss_mask"]).tolist():
        original = tokenizer.convert_ids_to_tokens([sample["labels"][p]])[0]
        labelled.append(f"{p}:{original}" if tokens[p] == original else f"{p}:{original}->{tokens[p]}")
    source = f", dataset_id={int(sample['dataset_id'])}" if "dataset_id" in sample else ""  # a blend's
    return "\n".join([f"sample {i}: {n} tokens, is_random={int(sample['is_random'])}, "
                      f"truncated={int(sample['truncated'])}{source}",
                      "  " + " ".join(tokens), "  labels: " + " ".join(labelled)])


def _save_npz(path, arrays):
    """np.savez to a temporary name in the same directory, then rename (no half-written file)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--save-npz {path}: directory {directory} does not exist; create it first")
    atomic_write(path, lambda f: np.savez(f, **arrays))


@exit_on_usage_error
def main(argv=None):
    from minibert.data.tokenizer import (
        build_tokenizer,  # tokenizer is only needed by the CLI
    )
    parser = OneLineArgumentParser(
        prog="python -m minibert.data.masked_lm",
        description="Build Megatron-exact BERT samples (the train split) and show or save them.")
    parser.add_argument("--data-path", required=True, nargs="+", metavar="[WEIGHT] PREFIX",
                        help="prefix of the .bin/.idx pair, or a blend: weights and prefixes alternating")
    parser.add_argument("--vocab-file", default=None, help="vocab.txt (default: the bundled bert-base-uncased)")
    parser.add_argument("--tokenizer-type", default="BertWordPieceLowerCase")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--seed", type=int, default=1234, help="Megatron's default")
    parser.add_argument("--num-samples", type=int, required=True, help="samples asked of the train split")
    parser.add_argument("--split", default="969,30,1", help="train,valid,test weights over the documents")
    parser.add_argument("--bert-no-binary-head", action="store_true", help="no sentence-order task")
    parser.add_argument("--masked-lm-prob", "--mask-prob", dest="mask_prob", type=float, default=0.15,
                        help="BERT's 15%%")
    parser.add_argument("--short-seq-prob", type=float, default=0.1, help="BERT's 10%% of shorter samples")
    parser.add_argument("--data-cache-path", default=None, help="keep sample indices here (default: rebuild)")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print the first N samples decoded")
    parser.add_argument("--lengths", action="store_true", help="print how many real tokens the samples hold")
    parser.add_argument("--save-npz", default=None, metavar="F", help="write all rows to F (.npz)")
    args = parser.parse_args(argv)

    prefixes, weights = parse_data_path(args.data_path)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file)
    train, _, _ = build_blended_train_valid_test_datasets(
        args.data_path, tokenizer, args.split, (args.num_samples, 0, 0), args.seq_length, args.seed,
        not args.bert_no_binary_head, args.mask_prob, args.short_seq_prob, cache_dir=args.data_cache_path)
    if train is None:
        raise UsageError(f"--split {args.split} gives the train split weight 0: there is nothing to build")
    if weights is None:
        print(f"train split: {len(train)} samples of {args.seq_length} tokens "
              f"(asked for {args.num_samples}; whole epochs are kept)")
    else:
        taken = np.bincount(train.dataset_index, minlength=len(prefixes))
        shares = ", ".join(f"{n} from {p} ({w:.3g})" for n, p, w in zip(taken, prefixes, train.weights))
        print(f"train split: a blend of {len(train)} samples of {args.seq_length} tokens "
              f"(asked for {args.num_samples}): {shares}")
    for i in range(min(args.show, len(train))):
        print(show_sample(i, train[i], tokenizer))
    if args.lengths:
        print(length_histogram(sample_lengths(train), args.seq_length))
    if args.save_npz:
        _save_npz(args.save_npz, stack_samples(train))
        print(f"wrote {args.save_npz}")


if __name__ == "__main__":
    main()
