"""BERT samples against the real thing: megatron-core 0.16.1's BERTMaskedWordPieceDataset (CPU, one-process
gloo group), its C++ build_mapping, and its split arithmetic. Every sample of every split is compared on
every key; the sample index rows too."""
import logging
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from minibert.data.indexed_dataset import IndexedDatasetBuilder
from minibert.data.masked_lm import (
    BertMaskedLMDataset,
    build_train_valid_test_datasets,
    split_num_samples,
)
from minibert.data.mersenne import MT19937_64, mt19937_words
from minibert.data.sample_index import (
    build_sample_index,
    cached_sample_index,
    split_document_ranges,
)
from minibert.data.sentence_split import split_sentences
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask", "truncated")

with warnings.catch_warnings():  # megatron-core warns that Apex/Transformer Engine are missing
    warnings.simplefilter("ignore")
    from megatron.core.datasets import helpers_cpp
    from megatron.core.datasets.bert_dataset import (
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
logging.getLogger("megatron").setLevel(logging.ERROR)


class MegatronSideTokenizer(MegatronLegacyTokenizer):
    """Our tokenizer behind Megatron's tokenizer interface (what its dataset config expects)."""

    def __init__(self, tokenizer):
        super().__init__("minibert-vocab")
        self.t = tokenizer

    def tokenize(self, text):
        return self.t.tokenize(text)

    vocab = property(lambda self: self.t.vocab)
    inv_vocab = property(lambda self: self.t.inv_vocab)
    vocab_size = property(lambda self: self.t.vocab_size)
    cls = property(lambda self: self.t.cls)
    sep = property(lambda self: self.t.sep)
    mask = property(lambda self: self.t.mask)
    pad = property(lambda self: self.t.pad)


@pytest.fixture(scope="module")
def tokenizer():
    return BertWordPieceTokenizer()


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """Megatron's dataset builder needs torch.distributed: one CPU process."""
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def write_documents(prefix, documents):
    """documents: list of lists of sentences (token id lists) -> prefix.bin/.idx with our builder."""
    builder = IndexedDatasetBuilder(prefix + ".bin")
    for document in documents:
        for sentence in document:
            builder.add_item(np.array(sentence, dtype=np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def english(tmp_path_factory, tokenizer):
    """Real English (the Python docs' topics shipped with Python), one sentence per sequence: paragraphs as
    documents (many one-sentence ones), whole topics as long documents, and a few empty documents."""
    from pydoc_data.topics import topics

    def sentences(text):
        return [ids for ids in map(tokenizer.tokenize, split_sentences(" ".join(text.split()))) if ids]

    names = sorted(topics)
    documents = [sentences(p) for name in names[:40] for p in topics[name].split("\n\n")]
    documents += [sentences(topics[name]) for name in names[40:70]]
    documents[5:5] = [[], []]
    return write_documents(str(tmp_path_factory.mktemp("english") / "docs_text_sentence"), documents)


@pytest.fixture(scope="module")
def awkward(tmp_path_factory):
    """Random ids (a fifth are '##' pieces) with [PAD] (0), [CLS] and [SEP] inside the text, empty
    documents and sentences, one-sentence documents, and sentences longer than 512 tokens."""
    rng = np.random.default_rng(7)

    def sentence(n):
        ids = rng.integers(999, 30522, size=n)
        ids[rng.random(n) < 0.02] = rng.choice([0, 101, 102], size=1)[0]
        return ids.tolist()

    documents = []
    for d in range(160):
        kind = d % 8
        if kind == 0:
            documents.append([])
        elif kind == 1:
            documents.append([sentence(int(rng.integers(1, 40)))])
        elif kind == 2:  # a long sentence: Megatron skips the document when it has other sentences
            documents.append([sentence(600)] + [sentence(20) for _ in range(int(rng.integers(0, 3)))])
        elif kind == 3:
            documents.append([sentence(5), [], sentence(7)])
        else:
            documents.append([sentence(int(rng.integers(1, 60))) for _ in range(int(rng.integers(2, 30)))])
    return write_documents(str(tmp_path_factory.mktemp("awkward") / "awk"), documents)


def megatron_splits(prefix, tokenizer, cache, *, split, sizes, seq_length, seed, binary_head,
                    short_seq_prob, mask_prob=0.15):
    config = BERTMaskedWordPieceDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split=split,
        path_to_cache=str(cache), tokenizer=MegatronSideTokenizer(tokenizer), masking_probability=mask_prob,
        short_sequence_probability=short_seq_prob, masking_max_ngram=3, masking_do_full_word=True,
        masking_do_permutation=False, masking_use_longer_ngrams=False,  # pretrain_bert.py's settings
        masking_use_geometric_distribution=False, classification_head=binary_head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, list(sizes), lambda: True,
                                             config).build()


def assert_same_samples(ours, theirs):
    assert ours.sample_index.dtype == theirs.sample_index.dtype == np.uint32
    np.testing.assert_array_equal(ours.sample_index, theirs.sample_index)
    assert len(ours) == len(theirs)
    for i in range(len(theirs)):
        mine, ref = ours[i], theirs[i]
        for key in KEYS:
            assert np.asarray(mine[key]).dtype == np.int64, key
            np.testing.assert_array_equal(mine[key], ref[key], err_msg=f"sample {i}, {key}")


CONFIGS = [  # seq_length, seed, short_seq_prob, binary_head, split, sizes (train, valid, test)
    (128, 1234, 0.1, True, "969,30,1", (300, 100, 60)),
    (64, 7, 0.4, False, "8,1,1", (500, 200, 100)),
    (512, 2**31 - 1, 0.0, True, "1,1,1", (100, 100, 100)),
    (32, 0, 0.1, True, "80,20,0", (400, 50, 0)),
    (512, 5, 0.4, False, "6,3,1", (120, 40, 40)),
    (64, 31337, 0.0, True, "0,1,1", (0, 150, 150)),
]


@pytest.mark.parametrize("seq_length, seed, short_seq_prob, binary_head, split, sizes", CONFIGS)
def test_english_samples_equal_megatron(process_group, tokenizer, english, tmp_path, seq_length, seed,
                                        short_seq_prob, binary_head, split, sizes):
    settings = dict(split=split, seq_length=seq_length, seed=seed, binary_head=binary_head,
                    short_seq_prob=short_seq_prob)
    theirs = megatron_splits(english, tokenizer, tmp_path, sizes=sizes, **settings)
    ours = build_train_valid_test_datasets(english, tokenizer, num_samples=sizes, **settings)
    for name, mine, ref in zip(("train", "valid", "test"), ours, theirs):
        assert (mine is None) == (ref is None), name
        if ref is not None:
            assert len(ref) >= ref.num_samples
            assert_same_samples(mine, ref)


@pytest.mark.parametrize("seq_length, binary_head, short_seq_prob, mask_prob",
                         [(48, True, 0.1, 0.15), (1024, False, 0.4, 0.3), (16, False, 1.0, 0.15)])
def test_awkward_data_equals_megatron(process_group, tokenizer, awkward, tmp_path, seq_length, binary_head,
                                      short_seq_prob, mask_prob):
    """Empty documents/sentences, [PAD]/[CLS]/[SEP] ids in the text (padding_mask is 0 at a [PAD] inside the
    text), '##' pieces at sentence starts (a word joins across [SEP]), > 512-token sentences (skipped in
    multi-sentence documents; used whole without the binary head in one-sentence documents)."""
    settings = dict(split="7,2,1", seq_length=seq_length, seed=99, binary_head=binary_head,
                    short_seq_prob=short_seq_prob)
    sizes = (250, 60, 30)
    theirs = megatron_splits(awkward, tokenizer, tmp_path, sizes=sizes, mask_prob=mask_prob, **settings)
    ours = build_train_valid_test_datasets(awkward, tokenizer, num_samples=sizes, masked_lm_prob=mask_prob,
                                           **settings)
    for mine, ref in zip(ours, theirs):
        assert_same_samples(mine, ref)
    rows = np.stack([ours[0][i]["padding_mask"] for i in range(len(ours[0]))])
    assert (np.diff(rows, axis=1) > 0).any()  # a [PAD] from the data sits inside a sample


class TinyTokenizer:
    """An 8-token vocab, so random replacements often draw [PAD] (padding_mask must be 0 there, mid-text)
    and '##' pieces are everywhere. `pad_id` moves [PAD] away from id 0 to exercise Megatron's pad rules."""

    def __init__(self, pad_id=0):
        tokens = ["[CLS]", "[SEP]", "[MASK]", "a", "##b", "c", "##d"]
        tokens.insert(pad_id, "[PAD]")
        self.inv_vocab = dict(enumerate(tokens))
        self.vocab = {t: i for i, t in self.inv_vocab.items()}
        self.vocab_size = len(tokens)
        self.cls, self.sep, self.mask, self.pad = (self.vocab[t] for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"))


@pytest.mark.parametrize("pad_id", [0, 4])
def test_tiny_vocab_pad_rules_equal_megatron(process_group, tmp_path, pad_id):
    tiny = TinyTokenizer(pad_id)
    words = [i for t, i in tiny.vocab.items() if not t.startswith("[")]
    rng = np.random.default_rng(pad_id)
    documents = [[rng.choice(words, size=int(rng.integers(1, 12))).tolist() for _ in range(int(rng.integers(2, 6)))]
                 for _ in range(60)]
    prefix = write_documents(str(tmp_path / "tiny"), documents)
    settings = dict(split="1", seq_length=40, seed=8, binary_head=True, short_seq_prob=0.1)
    theirs = megatron_splits(prefix, tiny, tmp_path, sizes=(200, 0, 0), mask_prob=0.5, **settings)
    ours = build_train_valid_test_datasets(prefix, tiny, num_samples=(200, 0, 0), masked_lm_prob=0.5, **settings)
    assert_same_samples(ours[0], theirs[0])
    is_pad = np.stack([ours[0][i]["padding_mask"] != 1 for i in range(len(ours[0]))]).astype(int)
    assert (np.diff(is_pad, axis=1) < 0).any()  # a replacement drew [PAD]: marked as padding mid-text


def test_sample_index_equals_build_mapping():
    """Our index vs Megatron's C++ on random documents: every boundary of the walk, seeds 0 and 2**31 - 1
    (mt19937_64(seed + 1) wraps to 2**64 - 2**31), ratios from C's round(1 / p) (0.4 -> 3, Python says 2)."""
    rng = np.random.default_rng(0)
    for trial in range(80):
        counts = rng.integers(0, 12, size=int(rng.integers(2, 40)))
        counts[-1] = 3  # the last document is usable by every setting (so Megatron terminates) ...
        sizes = rng.integers(0, 90, size=int(counts.sum())).astype(np.int32)
        sizes[-3:] = rng.integers(1, 90, size=3)
        if trial % 4 == 0:  # ... while a long sentence makes another one unusable
            sizes[rng.integers(0, len(sizes) - 3)] = 513
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        bounds = bounds[int(rng.integers(0, len(counts))):]  # a split: documents [k, D)
        seq_length = int(rng.choice([5, 8, 32, 128, 512]))
        short_seq_prob = float(rng.choice([0.0, 0.1, 0.4, 1 / 3, 1.0]))
        seed = int(rng.choice([0, 1, 1234, 2**31 - 1]))
        min_sentences = int(rng.integers(1, 3))
        num_samples = int(rng.integers(0, 400))
        ours = build_sample_index(bounds, sizes, num_samples=num_samples, seq_length=seq_length,
                                  short_seq_prob=short_seq_prob, seed=seed, min_sentences=min_sentences)
        ref = helpers_cpp.build_mapping(bounds, sizes, 2**31 - 2, num_samples, seq_length - 3,
                                        short_seq_prob, seed, False, min_sentences)
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, trial
        np.testing.assert_array_equal(ours, ref, err_msg=f"trial {trial}")


def test_mersenne_twisters_match_the_cpp_standard():
    # [rand.predef]: the 10000th invocation of a default-constructed engine (seed 5489) produces these.
    assert mt19937_words(5489, 10000)[-1] == 4123659995
    assert MT19937_64(5489).random_raw(10000)[-1] == 9981545732273789042
    stream = MT19937_64(42)
    np.testing.assert_array_equal(np.concatenate([stream.random_raw(5), stream.random_raw(700)]),
                                  MT19937_64(42).random_raw(705))


@pytest.mark.parametrize("documents, binary_head, fix", [
    ([[[2023, 2003]], [[1037]], []], True, "--bert-no-binary-head"),  # Megatron: 2**31 empty epochs
    ([[], []], False, "empty"),
    ([[[2023] * 600, [1037, 2003]], [[2023] * 513, [7]]], False, "--split-sentences"),
])
def test_no_usable_document_is_a_usage_error(tmp_path, tokenizer, documents, binary_head, fix):
    """Where no document can make a sample, Megatron's build_mapping loops for 2**31 epochs (so it is not
    run here); we stop with a message naming the fix."""
    prefix = write_documents(str(tmp_path / "bad"), documents)
    with pytest.raises(UsageError, match=fix):
        build_train_valid_test_datasets(prefix, tokenizer, split="1", num_samples=(10, 0, 0), seq_length=32,
                                        seed=1, binary_head=binary_head)


def test_one_sentence_documents_without_binary_head(process_group, tokenizer, tmp_path):
    documents = [[tokenizer.tokenize(f"Sentence number {i} talks about tokenization and embeddings.")]
                 for i in range(40)]
    prefix = write_documents(str(tmp_path / "single"), documents)
    settings = dict(split="1", seq_length=16, seed=3, binary_head=False, short_seq_prob=0.1)
    theirs = megatron_splits(prefix, tokenizer, tmp_path, sizes=(90, 0, 0), **settings)
    ours = build_train_valid_test_datasets(prefix, tokenizer, num_samples=(90, 0, 0), **settings)
    assert_same_samples(ours[0], theirs[0])


def test_split_ranges_equal_megatron():
    for split in ["969,30,1", "949,50,1", "1,1,1", "98,2,0", "3,0,1", "0,0,1", "2,1", "1", "0.7,0.2,0.1"]:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in [3, 7, 10, 99, 1000, 12345]:
            expected = [None if m is None else (int(round(m[0] * float(n))), int(round(m[1] * float(n))))
                        for m in matrix]
            if any(r is not None and r[0] == r[1] for r in expected):  # Megatron: IndexError later
                with pytest.raises(UsageError, match="gets none of the"):
                    split_document_ranges(split, n)
            else:
                assert split_document_ranges(split, n) == expected, (split, n)


def test_split_num_samples():
    # Megatron: train = iters * batch; valid = (iters // interval + 1) * eval_iters * batch; test = eval_iters * batch
    assert split_num_samples(200, 50, 10, 16) == (3200, 800, 160)
    assert split_num_samples(100, 1000, 100, 8) == (800, 800, 800)


def test_cache_is_keyed_by_the_data(tmp_path):
    sizes = np.array([30, 40, 50, 60, 70, 80], dtype=np.int32)
    bounds = np.array([0, 3, 6])
    args = dict(num_samples=20, seq_length=64, short_seq_prob=0.1, seed=5, min_sentences=2)
    built = cached_sample_index(tmp_path / "cache", bounds, sizes, **args)
    (cached_file,) = os.listdir(tmp_path / "cache")
    np.testing.assert_array_equal(cached_sample_index(tmp_path / "cache", bounds, sizes, **args), built)
    changed = sizes.copy()
    changed[0] = 500  # rewritten data: a new key, never the stale index
    np.testing.assert_array_equal(cached_sample_index(tmp_path / "cache", bounds, changed, **args),
                                  build_sample_index(bounds, changed, **args))
    assert len(os.listdir(tmp_path / "cache")) == 2 and cached_file in os.listdir(tmp_path / "cache")


def test_works_with_a_dataloader(tokenizer, english):
    from minibert.data.indexed_dataset import IndexedDataset
    ds = BertMaskedLMDataset(IndexedDataset(english), tokenizer, seq_length=32, num_samples=10, seed=1)
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch["text"].shape == (4, 32) and batch["is_random"].shape == (4,)
    assert torch.equal(batch["labels"][1], torch.from_numpy(ds[1]["labels"]))
    with pytest.raises(IndexError):
        ds[len(ds)]


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "minibert.data.masked_lm", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_show_and_save_equal_megatron(process_group, tokenizer, english, tmp_path):
    out = tmp_path / "rows.npz"
    common = ["--data-path", english, "--seq-length", "64", "--seed", "11", "--num-samples", "150"]
    result = run_cli(*common, "--show", "3", "--save-npz", str(out))
    assert result.returncode == 0, result.stderr
    assert "[MASK]" in result.stdout and "[CLS]" in result.stdout and "labels:" in result.stdout
    theirs = megatron_splits(english, tokenizer, tmp_path, split="969,30,1", sizes=(150, 0, 0),
                             seq_length=64, seed=11, binary_head=True, short_seq_prob=0.1)[0]
    saved = np.load(out)
    assert sorted(saved.files) == sorted(KEYS)
    for key in KEYS:
        expected = np.stack([np.asarray(theirs[i][key], dtype=np.int64) for i in range(len(theirs))])
        assert saved[key].dtype == np.int64
        np.testing.assert_array_equal(saved[key], expected, err_msg=key)


def test_cli_bad_prefix_suggests_the_preprocessed_name(english):
    bare = english[:-len("_text_sentence")]
    result = run_cli("--data-path", bare, "--seq-length", "64", "--num-samples", "10")
    assert result.returncode == 2
    assert english in result.stderr and len(result.stderr.strip().splitlines()) == 1
