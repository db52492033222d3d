"""Blending corpora: Megatron's `--data-path 0.3 A 0.7 B`, sample for sample as megatron-core builds it.

A blend trains on several preprocessed corpora at once, each taking a fixed share of the samples:

    --data-path 0.3 wiki_text_sentence 0.7 books_text_sentence        (weights and prefixes alternate)

    weights      w = [0.3, 0.7] / (0.3 + 0.7)                 normalised in float64 (twice, as Megatron)
    per corpus   its own BERT dataset per split, same --split, same --seed, asked for
                 ceil(ceil(n * w_i) * 1.005) samples          (n = the split's samples; a 0.5% surplus)
    the blend    n_blend = sum_i ceil(n * w_i) samples; sample t comes from the corpus furthest below
                 its share so far:
                     i(t) = argmax_i  w_i * max(t, 1) - taken_i(t)        (the first i on a tie)
                 and is that corpus's next unused sample:  blend[t] = corpus_i(t)[taken_i(t)]

    t        0   1   2   3   4   5   6   7   8   9                 w = [0.3, 0.7]
    corpus   B   A   B   B   A   B   B   A   B   B        A gets 3 of 10, B 7: each stays within one
    sample   0   0   1   2   1   3   4   2   5   6        sample of its share at every t

This is megatron-core's BlendedMegatronDatasetBuilder + BlendedDataset (the greedy is helpers.cpp's
build_blending_indices). Each sample is the corpus's sample plus `dataset_id`, the corpus it came from.
Like megatron-core's builder, which is handed the dataset class, this module knows no BERT sample:
blend_splits is handed the function that builds one corpus's datasets. masked_lm's
build_blended_train_valid_test_datasets reads --data-path and hands it BERT's: a single prefix
(`--data-path P`) is no blend, masked_lm.build_train_valid_test_datasets, unchanged. A weighted list of
one prefix (`--data-path 1 P`) is a blend of one, as in Megatron: its dataset is asked for the 0.5%
surplus, so its rows differ from `--data-path P`'s.

What production does that we leave out: Megatron also blends by dataset sizes when no weights are
given, and takes a separate blend per split (--train-data-path ...); we refuse an unweighted list.
The greedy is a Python loop here, once per run, slower than Megatron's C++ (bench/notes/sample-index.md).
"""
import hashlib
import math
import os

import numpy as np

from minibert.atomic import atomic_write
from minibert.data.sample_index import SPLIT_NAMES
from minibert.errors import UsageError

SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus: each corpus builds 0.5% more than its share
FORM = "--data-path takes one prefix, or weights and prefixes alternating: --data-path 0.3 A 0.7 B"


def parse_data_path(data_path):
    """['P'] -> (['P'], None); ['0.3', 'A', '0.7', 'B'] -> (['A', 'B'], [0.3, 0.7]); else UsageError."""
    items = [str(item) for item in ([data_path] if isinstance(data_path, str) else data_path)]
    if len(items) == 1:
        return [items[0].strip()], None
    if len(items) % 2:
        raise UsageError(f"{FORM} (got {len(items)} items: an odd number, so a weight or a prefix is missing)")
    weights, prefixes = [], []
    for weight, prefix in zip(items[::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise UsageError(f"{FORM} (got {weight!r} where a weight belongs: weights come before their "
                             "prefixes; an unweighted list of prefixes is not supported)") from None
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{FORM} (weight {weight} for {prefix}: weights must be positive numbers; "
                             "leave a corpus out instead of giving it weight 0)")
        weights.append(value)
        prefixes.append(prefix.strip())
    if not math.isfinite(sum(weights)):  # they are normalized by their sum
        raise UsageError(f"{FORM} (the weights {' '.join(items[::2])} add up to more than a float holds: "
                         "give them on a smaller scale, e.g. fractions that add up to 1)")
    return prefixes, weights


def normalize(weights):
    """w / sum(w) in float64, as megatron.core.datasets.utils.normalize."""
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def corpus_num_samples(weights, num_samples, surplus=0.0):
    """How many samples each corpus is asked for, per split: ceil(ceil(n * w_i) * (1 + surplus)), as
    megatron-core's _get_size_per_split_per_dataset. [corpus][split]."""
    return [[int(math.ceil(math.ceil(n * w) * (1 + surplus))) for n in num_samples] for w in weights]


def blending_indices(weights, size):
    """helpers.cpp build_blending_indices: (dataset_index int16 [size], dataset_sample_index int64
    [size]). Sample t goes to the corpus i with the largest error w_i * max(t, 1) - taken_i (the first
    i on a tie), in float64 exactly as the C++ computes it."""
    weights = [float(w) for w in weights]
    taken = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    for t in range(size):
        at = float(max(t, 1))
        best, best_error = 0, weights[0] * at - taken[0]
        for i in range(1, len(weights)):
            error = weights[i] * at - taken[i]
            if error > best_error:
                best, best_error = i, error
        dataset_index[t], sample_index[t] = best, taken[best]
        taken[best] += 1
    return dataset_index, sample_index


def cached_blending_indices(cache_dir, weights, size):
    """blending_indices, kept in cache_dir (None: no cache). They depend on the weights and the size
    only, so those are the whole key."""
    if cache_dir is None:
        return blending_indices(weights, size)
    key = hashlib.sha256(repr((list(map(float.hex, weights)), size)).encode()).hexdigest()[:32]
    path = os.path.join(cache_dir, f"blending_indices_{key}.npz")
    if os.path.isfile(path):
        with np.load(path) as saved:
            return saved["dataset_index"], saved["dataset_sample_index"]
    dataset_index, sample_index = blending_indices(weights, size)
    atomic_write(path, lambda f: np.savez(f, dataset_index=dataset_index, dataset_sample_index=sample_index),
                 make_dirs=True)
    return dataset_index, sample_index


class BlendedDataset:
    """Map-style dataset over several datasets: ds[t] = datasets[i][k] plus dataset_id = i, with
    (i, k) from the blending indices. len(ds) = size."""

    def __init__(self, datasets, weights, size, cache_dir=None):
        self.datasets = list(datasets)
        self.weights = normalize(weights)  # megatron-core normalises again here
        self.seq_length = self.datasets[0].seq_length
        self.dataset_index, self.dataset_sample_index = cached_blending_indices(cache_dir, self.weights, size)
        taken = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (count, dataset) in enumerate(zip(taken, self.datasets)):
            if count > len(dataset):  # never with whole epochs; megatron-core raises IndexError here
                raise RuntimeError(f"the blend takes {count} samples of dataset {i}, which has {len(dataset)}")

    def __len__(self):
        return len(self.dataset_index)

    def __getitem__(self, idx):
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.dataset_index[idx])
        return {"dataset_id": np.int64(i), **self.datasets[i][int(self.dataset_sample_index[idx])]}


def blend_splits(prefixes, weights, num_samples, build_corpus, cache_dir=None):
    """(train, valid, test) BlendedDatasets over the corpora at `prefixes`, in shares `weights`; None for a
    split of weight 0 (the same --split for every corpus: all None or none). num_samples: the blend's
    (train, valid, test) counts. build_corpus(prefix, counts) -> that corpus's (train, valid, test)
    datasets, asked for counts = corpus_num_samples with the surplus (masked_lm passes BERT's builder)."""
    weights = normalize(weights)
    targets = corpus_num_samples(weights, num_samples)             # what the blend takes of each
    asked = corpus_num_samples(weights, num_samples, SURPLUS)       # what each corpus builds
    per_corpus = [build_corpus(prefix, counts) for prefix, counts in zip(prefixes, asked)]  # [corpus][split]
    blends = []
    for s in range(len(SPLIT_NAMES)):
        if per_corpus[0][s] is None:
            blends.append(None)
            continue
        size = sum(counts[s] for counts in targets)
        blends.append(BlendedDataset([datasets[s] for datasets in per_corpus], weights, size, cache_dir))
    return tuple(blends)
