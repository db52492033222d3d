"""The fast sample index (the numpy walk of sample_walk.py, fisher_yates.py, mersenne.py) against its
plain twins, row for row, and against megatron-core's C++ build_mapping at a scale where its fast paths
all run."""
import warnings

import numpy as np
import pytest

from minibert.data import sample_walk
from minibert.data.fisher_yates import (
    megatron_order,
    shuffled_order,
    shuffled_order_plain,
)
from minibert.data.mersenne import MT19937_64
from minibert.data.sample_index import build_sample_index, plain_sample_index
from minibert.errors import UsageError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Apex / Transformer Engine are missing
    from megatron.core.datasets import helpers_cpp


def random_structure(rng, documents):
    """Document boundaries and sentence lengths with every awkward case: empty documents, one-sentence
    documents, zero-length sentences, sentences over 512 tokens, long documents."""
    counts = rng.integers(0, 12, size=documents)
    counts[rng.random(documents) < 0.1] = 0
    counts[rng.random(documents) < 0.05] = int(rng.integers(40, 200))  # many rows in one document
    counts[-1] = max(counts[-1], 3)
    sizes = rng.integers(0, 90, size=int(counts.sum())).astype(np.int32)
    sizes[rng.random(len(sizes)) < 0.01] = int(rng.integers(513, 3000))
    sizes[-3:] = rng.integers(1, 90, size=3)  # the last document can always make a row
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return bounds[int(rng.integers(0, documents // 2)):], sizes  # a split: documents [k, D)


@pytest.mark.parametrize("short_seq_prob", [0.0, 0.1, 0.4, 1.0])
@pytest.mark.parametrize("min_sentences", [1, 2], ids=["no-binary-head", "binary-head"])
@pytest.mark.parametrize("path", ["lockstep", "python"])
def test_fast_paths_equal_plain(monkeypatch, short_seq_prob, min_sentences, path):
    """Random structures, seeds next to 2**31 - 1 (where seed + 1 wraps in C), several epochs. The numpy
    walk in groups of 3 documents (several lockstep groups), or every document walked by its Python tail."""
    monkeypatch.setattr(sample_walk, "GROUP", 3 if path == "lockstep" else 1 << 14)
    monkeypatch.setattr(sample_walk, "LOCKSTEP_MIN_DOCUMENTS", 1 if path == "lockstep" else 10**9)
    rng = np.random.default_rng(int(short_seq_prob * 10) + 100 * min_sentences)
    for trial in range(12):
        bounds, sizes = random_structure(rng, int(rng.integers(2, 60)))
        settings = dict(num_samples=int(rng.choice([0, 1, 50, 400, 3000])),
                        seq_length=int(rng.choice([5, 6, 16, 64, 128, 512, 1024])),
                        short_seq_prob=short_seq_prob, seed=int(rng.choice([2**31 - 1, 2**31 - 2, 0, 1234])),
                        min_sentences=min_sentences)
        try:
            expected = plain_sample_index(bounds, sizes, **settings)
        except UsageError as e:  # no usable document: both must say the same
            with pytest.raises(UsageError, match="split"):
                build_sample_index(bounds, sizes, **settings)
            assert "split" in str(e)
            continue
        got = build_sample_index(bounds, sizes, **settings)
        assert got.dtype == expected.dtype == np.uint32 and got.shape == expected.shape, (trial, settings)
        np.testing.assert_array_equal(got, expected, err_msg=f"trial {trial}: {settings}")


def test_equals_megatron_at_scale():
    """200K sentences: thousands of lockstep documents per group, ~10K detours, a 6-digit shuffle."""
    rng = np.random.default_rng(5)
    counts = rng.geometric(1 / 30, size=8000)
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = np.clip(rng.lognormal(3.0, 0.6, size=int(counts.sum())), 1, 2000).astype(np.int32)
    for seq_length, short_seq_prob, min_sentences in [(128, 0.1, 2), (512, 0.4, 1), (64, 1.0, 2)]:
        ours = build_sample_index(bounds, sizes, num_samples=50_000, seq_length=seq_length,
                                  short_seq_prob=short_seq_prob, seed=2**31 - 1, min_sentences=min_sentences)
        ref = helpers_cpp.build_mapping(bounds, sizes, 2**31 - 2, 50_000, seq_length - 3, short_seq_prob,
                                        2**31 - 1, False, min_sentences)
        assert ours.shape == ref.shape and len(ref) >= 50_000
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 64, 1000, 4097])
def test_vectorised_fisher_yates_equals_the_loop(n):
    rng = np.random.default_rng(n)
    steps = np.arange(n - 1, 0, -1)
    for trial in range(6):
        targets = (rng.integers(0, 2**62, size=max(n - 1, 0)) % (steps + 1)).astype(np.uint64)
        if trial == 1:
            targets = np.minimum(targets, np.uint64(2))  # long chains: everything lands on 0, 1, 2
        if trial == 2:
            targets = steps.astype(np.uint64)  # every step swaps a row with itself
        if n >= 1:
            np.testing.assert_array_equal(shuffled_order(targets), shuffled_order_plain(targets))
    for seed in (0, 2**31 - 1):
        np.testing.assert_array_equal(megatron_order(n, seed), megatron_order(n, seed, plain=True))


def test_mt19937_64_in_pieces_equals_one_stream():
    """Words handed out across the 311-word steps and the 312-word states in any split."""
    rng = np.random.default_rng(3)
    whole = MT19937_64(2**64 - 2**31).random_raw(20_000)
    stream = MT19937_64(2**64 - 2**31)
    pieces, total = [], 0
    while total < 20_000:
        pieces.append(stream.random_raw(min(int(rng.choice([1, 155, 156, 311, 312, 313, 2000])), 20_000 - total)))
        total += len(pieces[-1])
    np.testing.assert_array_equal(np.concatenate(pieces), whole)

