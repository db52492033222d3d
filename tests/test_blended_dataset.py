"""Blends (--data-path 0.3 A 0.7 B) against megatron-core 0.16.1's BlendedMegatronDatasetBuilder and
BlendedDataset over BERTMaskedWordPieceDataset: the blending indices, each corpus's sample count, and
every key of every sample of every split; the --data-path forms; the command line."""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch.distributed as dist
from test_masked_lm import KEYS, MegatronSideTokenizer, write_documents

from minibert.data.blended_dataset import (
    BlendedDataset,
    blending_indices,
    corpus_num_samples,
    normalize,
    parse_data_path,
)
from minibert.data.masked_lm import (
    BertMaskedLMDataset,
    build_blended_train_valid_test_datasets,
    build_train_valid_test_datasets,
)
from minibert.data.sentence_split import split_sentences
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.errors import UsageError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
        _get_size_per_split_per_dataset,
    )

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    return BertWordPieceTokenizer()


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}",
                                rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, tokenizer):
    """Three corpora of different sizes and shapes: the Python docs' topics in two halves (paragraphs as
    documents; whole topics as long documents), and a small one of one-line documents."""
    from pydoc_data.topics import topics
    directory = tmp_path_factory.mktemp("corpora")

    def sentences(text):
        return [ids for ids in map(tokenizer.tokenize, split_sentences(" ".join(text.split()))) if ids]

    names = sorted(topics)
    paragraphs = [sentences(p) for name in names[:30] for p in topics[name].split("\n\n")]
    whole = [[]] + [sentences(topics[name]) for name in names[30:60]]
    short = [[tokenizer.tokenize(f"Document {i} is short."), tokenizer.tokenize("It has two sentences.")]
             for i in range(50)]
    return [write_documents(str(directory / name), docs)
            for name, docs in (("paragraphs", paragraphs), ("whole", whole), ("short", short))]


def megatron_blend(prefixes, weights, tokenizer, cache, *, split, sizes, seq_length, seed, binary_head,
                   short_seq_prob=0.1, mask_prob=0.15):
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(prefixes), weights), split=split,
        path_to_cache=str(cache), tokenizer=MegatronSideTokenizer(tokenizer), masking_probability=mask_prob,
        short_sequence_probability=short_seq_prob, masking_max_ngram=3, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False, classification_head=binary_head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, list(sizes), lambda: True,
                                             config).build()


def assert_same_blend(ours, theirs):
    assert isinstance(ours, BlendedDataset) and len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.dataset_index, theirs.dataset_index)
    np.testing.assert_array_equal(ours.dataset_sample_index, theirs.dataset_sample_index)
    for mine, ref in zip(ours.datasets, theirs.datasets):  # each corpus asked for its share + 0.5%
        np.testing.assert_array_equal(mine.sample_index, ref.sample_index)
    for t in range(len(theirs)):
        mine, ref = ours[t], theirs[t]
        assert sorted(mine) == sorted(ref) == sorted(KEYS + ("dataset_id",))
        for key in mine:
            assert np.asarray(mine[key]).dtype == np.int64, key
            np.testing.assert_array_equal(mine[key], ref[key], err_msg=f"sample {t}, {key}")


BLENDS = [  # which corpora, their weights (as typed), split, sizes, seq_length, seed, binary head
    ((0, 1), ["0.3", "0.7"], "90,7,3", (200, 60, 30), 128, 1234, True),
    ((0, 1, 2), ["1", "2", "5"], "8,1,1", (150, 50, 30), 64, 2**31 - 1, False),
    ((2, 0), ["30", "70"], "80,20,0", (250, 40, 0), 32, 7, True),
    ((1,), ["1.0"], "1", (100, 0, 0), 512, 3, True),  # a weighted list of one prefix: a blend of one
]


@pytest.mark.parametrize("which, weights, split, sizes, seq_length, seed, binary_head", BLENDS)
def test_blend_equals_megatron(process_group, tokenizer, corpora, tmp_path, which, weights, split, sizes,
                               seq_length, seed, binary_head):
    prefixes = [corpora[i] for i in which]
    data_path = [item for pair in zip(weights, prefixes) for item in pair]
    settings = dict(split=split, sizes=sizes, seq_length=seq_length, seed=seed, binary_head=binary_head)
    theirs = megatron_blend(prefixes, list(map(float, weights)), tokenizer, tmp_path / "m", **settings)
    ours = build_blended_train_valid_test_datasets(data_path, tokenizer, split, sizes, seq_length, seed,
                                                   binary_head, 0.15, 0.1, cache_dir=str(tmp_path / "ours"))
    for mine, ref in zip(ours, theirs):
        assert (mine is None) == (ref is None)
        if ref is not None:
            assert_same_blend(mine, ref)


def test_single_prefix_is_todays_datasets(tokenizer, corpora):
    settings = dict(split="8,1,1", num_samples=(200, 50, 20), seq_length=64, seed=5, binary_head=True)
    todays = build_train_valid_test_datasets(corpora[0], tokenizer, **settings)
    for data_path in ([corpora[0]], corpora[0]):
        blended = build_blended_train_valid_test_datasets(data_path, tokenizer, settings["split"],
                                                          settings["num_samples"], 64, 5, True, 0.15, 0.1)
        for a, b in zip(blended, todays):
            assert isinstance(a, BertMaskedLMDataset)
            np.testing.assert_array_equal(a.sample_index, b.sample_index)
            for key in KEYS:
                np.testing.assert_array_equal(a[3][key], b[3][key])


def test_sample_counts_and_indices_equal_megatron():
    """ceil(ceil(n * w) * 1.005) per corpus (megatron-core's formula, not ceil(n * w * 1.005)), and the
    greedy of helpers.cpp, on random weights (ties included: equal weights)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        k = int(rng.integers(1, 6))
        weights = normalize(rng.random(k) ** 3 + 1e-4) if trial % 4 else normalize([1.0] * k)
        sizes = [int(rng.integers(0, 5000)) for _ in range(3)]
        for surplus in (0.0, 0.005):
            assert corpus_num_samples(weights, sizes, surplus) == _get_size_per_split_per_dataset(
                weights, sizes, surplus)
        size = sizes[0]
        index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
        helpers_cpp.build_blending_indices(index, sample, np.array(normalize(weights)), k, size, False)
        ours = blending_indices(normalize(weights), size)
        np.testing.assert_array_equal(ours[0], index)
        np.testing.assert_array_equal(ours[1], sample)


@pytest.mark.parametrize("data_path, words", [
    (["0.3", "A", "0.7"], "odd number"),
    (["A", "B"], "'A' where a weight belongs"),
    (["0.3", "A", "x", "B"], "'x' where a weight belongs"),
    (["0", "A", "1", "B"], "weight 0 for A"),
    (["-1", "A", "2", "B"], "weight -1 for A"),
    (["nan", "A", "1", "B"], "weights must be positive"),
])
def test_bad_forms_name_the_form(data_path, words):
    with pytest.raises(UsageError, match="--data-path 0.3 A 0.7 B") as error:
        parse_data_path(data_path)
    assert words in str(error.value)
    assert parse_data_path(["30", " A ", "70", "B"]) == (["A", "B"], [30.0, 70.0])
    assert parse_data_path(["P"]) == (["P"], None)


def test_missing_prefix_in_a_blend(tokenizer, corpora, tmp_path):
    with pytest.raises(UsageError, match="no .*nowhere.bin"):
        build_blended_train_valid_test_datasets(["0.5", corpora[0], "0.5", str(tmp_path / "nowhere")],
                                                tokenizer, "1", (10, 0, 0), 64, 1, True)


def test_blend_cache_is_reused(tokenizer, corpora, tmp_path):
    args = (["0.4", corpora[0], "0.6", corpora[2]], tokenizer, "1", (300, 0, 0), 64, 9, True, 0.15, 0.1)
    first = build_blended_train_valid_test_datasets(*args, cache_dir=str(tmp_path / "cache"))[0]
    files = sorted(os.listdir(tmp_path / "cache"))
    assert sum(f.startswith("blending_indices_") for f in files) == 1
    assert sum(f.startswith("bert_sample_index_") for f in files) == 2  # one per corpus (split "1")
    again = build_blended_train_valid_test_datasets(*args, cache_dir=str(tmp_path / "cache"))[0]
    assert sorted(os.listdir(tmp_path / "cache")) == files
    np.testing.assert_array_equal(again.dataset_index, first.dataset_index)
    np.testing.assert_array_equal(again[17]["text"], first[17]["text"])


def test_cli_blend_saves_megatrons_rows(process_group, tokenizer, corpora, tmp_path):
    out = tmp_path / "rows.npz"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "minibert.data.masked_lm", "--data-path", "0.3", corpora[0],
                             "0.7", corpora[1], "--seq-length", "64", "--seed", "11", "--num-samples", "150",
                             "--split", "98,2,0", "--show", "2", "--lengths", "--save-npz", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "a blend of 150 samples" in result.stdout and "45 from" in result.stdout and "dataset_id=" in result.stdout
    assert "median" in result.stdout
    theirs = megatron_blend(corpora[:2], [0.3, 0.7], tokenizer, tmp_path / "m", split="98,2,0",
                            sizes=(150, 0, 0), seq_length=64, seed=11, binary_head=True)[0]
    saved = np.load(out)
    assert sorted(saved.files) == sorted(KEYS + ("dataset_id",))
    for key in saved.files:
        expected = np.stack([np.asarray(theirs[t][key], dtype=np.int64) for t in range(len(theirs))])
        np.testing.assert_array_equal(saved[key], expected, err_msg=key)
