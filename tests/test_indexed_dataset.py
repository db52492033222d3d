"""minibert.data.indexed_dataset against megatron-core 0.16.1's IndexedDataset/IndexedDatasetBuilder (the
oracle), the worked example of docs/formats.md written out by hand, and every way a pair can be broken."""
import os
import pickle
import struct
import warnings

import numpy as np
import pytest
import torch

from minibert.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
)
from minibert.errors import UsageError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import indexed_dataset as megatron


def read(path):
    with open(path, "rb") as f:
        return f.read()


def random_corpus(seed, high, n_docs=60):
    """Documents as lists of sentences; some documents empty, some sentences one token long."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n_sent = rng.choice([0, 0, 1, 2, 5])
        docs.append([rng.integers(0, high, rng.integers(1, 40)).tolist() for _ in range(n_sent)])
    docs[0] = []  # an empty first document
    docs[-1] = []  # and an empty last one
    return docs


def write_ours(prefix, docs, dtype, per_item):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        if per_item:
            for sentence in doc:
                builder.add_item(sentence)
            builder.end_document()
        else:
            builder.add_document(sum(doc, []), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


def write_megatron(prefix, docs, dtype, per_item):
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        if per_item:
            for sentence in doc:
                builder.add_item(torch.tensor(sentence, dtype=torch.int64))
            builder.end_document()
        else:
            builder.add_document(sum(doc, []), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


def test_worked_example_of_formats_md_byte_for_byte(tmp_path):
    prefix = str(tmp_path / "ex")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document([101, 7592, 2088], [2, 1])
    builder.add_document([1037, 1038, 1039], [3])
    builder.finalize(prefix + ".idx")
    # the table of docs/formats.md, field by field
    expected_idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                    + struct.pack("<QQ", 3, 3) + struct.pack("<3i", 2, 1, 3)
                    + struct.pack("<3q", 0, 4, 6) + struct.pack("<3q", 0, 2, 3))
    assert len(expected_idx) == 94
    assert read(prefix + ".idx") == expected_idx
    assert read(prefix + ".bin") == bytes.fromhex("65 00 a8 1d 28 08 0d 04 0e 04 0f 04")
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[101, 7592], [2088], [1037, 1038, 1039]]
    assert ds.document_indices.tolist() == [0, 2, 3]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 30522), (np.int32, 250_000)])
@pytest.mark.parametrize("per_item", [False, True], ids=["add_document", "add_item"])
def test_same_bytes_as_megatron_and_each_reads_the_other(tmp_path, dtype, high, per_item):
    docs = random_corpus(seed=high + per_item, high=high)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write_ours(ours, docs, dtype, per_item)
    write_megatron(theirs, docs, dtype, per_item)
    assert read(ours + ".bin") == read(theirs + ".bin")
    assert read(ours + ".idx") == read(theirs + ".idx")

    sentences = [s for doc in docs for s in doc]
    for_ours, for_theirs = IndexedDataset(theirs), megatron.IndexedDataset(ours)  # crossed
    assert len(for_ours) == len(for_theirs) == len(sentences)
    assert for_ours.dtype == for_theirs.index.dtype == dtype
    assert np.array_equal(for_ours.document_indices, for_theirs.document_indices)
    assert np.array_equal(for_ours.sequence_lengths, for_theirs.sequence_lengths)
    assert np.array_equal(for_ours.sequence_pointers, for_theirs.index.sequence_pointers)
    assert len(for_ours.document_indices) == len(docs) + 1
    for i, sentence in enumerate(sentences):
        assert for_ours[i].dtype == dtype
        assert for_ours[i].tolist() == for_theirs[i].tolist() == sentence
    for i, offset, length in [(0, 0, 1), (1, 1, None), (len(sentences) - 1, 0, None), (2, 0, 0)]:
        assert for_ours.get(i, offset, length).tolist() == for_theirs.get(i, offset, length).tolist()
    assert [s.tolist() for s in for_ours[3:7]] == [s.tolist() for s in for_theirs[3:7]]


def test_only_empty_documents(tmp_path):
    prefix = str(tmp_path / "empty")
    write_ours(prefix, [[], [], []], np.uint16, per_item=False)
    write_megatron(str(tmp_path / "m"), [[], [], []], np.uint16, per_item=False)
    assert read(prefix + ".idx") == read(str(tmp_path / "m.idx"))
    assert os.path.getsize(prefix + ".bin") == 0
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0, 0, 0, 0]


def test_indexing_pickling_and_exists(tmp_path):
    prefix = str(tmp_path / "d")
    write_ours(prefix, [[[5, 6], [7]], [], [[8, 9, 10]]], np.uint16, per_item=True)
    ds = IndexedDataset(prefix)
    assert ds[-1].tolist() == [8, 9, 10] and ds[np.int64(1)].tolist() == [7]
    with pytest.raises(IndexError):
        ds[3]
    again = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert len(pickle.dumps(ds)) < 200  # the prefix, not the arrays
    assert [again[i].tolist() for i in range(3)] == [[5, 6], [7], [8, 9, 10]]
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_best_dtype_agrees_with_megatron():
    for vocab_size in [2, 30522, 65499, 65500, 65536, 250_000]:
        assert best_dtype(vocab_size) == megatron.DType.optimal_dtype(vocab_size)


def test_builder_refuses_ids_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="range"):
        builder.add_item([1, 70000])
    with pytest.raises(ValueError, match="lengths"):
        builder.add_document([1, 2, 3], [2])
    builder.abort()
    assert os.listdir(tmp_path) == []


def test_nothing_under_final_names_until_finalize(tmp_path):
    prefix = str(tmp_path / "a")
    builder = IndexedDatasetBuilder(prefix + ".bin")
    builder.add_document([1, 2], [2])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    builder.finalize(prefix + ".idx")
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]
    with pytest.raises(RuntimeError):  # an error inside the with block removes the temporary files
        with IndexedDatasetBuilder(str(tmp_path / "b.bin")) as b:
            b.add_document([3], [1])
            raise RuntimeError("preprocessing failed")
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]


def test_builder_into_missing_directory(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        IndexedDatasetBuilder(str(tmp_path / "nope" / "x.bin"))


# ---- broken files: one UsageError each, naming the file ----

def good_pair(tmp_path):
    prefix = str(tmp_path / "good")
    write_ours(prefix, [[[1, 2, 3], [4]], [], [[5, 6]]], np.uint16, per_item=False)
    return prefix


def patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


BREAKAGES = {
    # name: (how to break the pair, which file the message must name, words in the message)
    "wrong magic": (lambda p: patch(p + ".idx", 0, b"NOTANIDX!"), ".idx", "not a Megatron index"),
    "wrong version": (lambda p: patch(p + ".idx", 9, struct.pack("<Q", 2)), ".idx", "version 2"),
    "unknown dtype": (lambda p: patch(p + ".idx", 17, bytes([9])), ".idx", "dtype code 9"),
    "header cut": (lambda p: cut(p + ".idx", 20), ".idx", "truncated"),
    "body cut": (lambda p: cut(p + ".idx", os.path.getsize(p + ".idx") - 8), ".idx", "truncated"),
    "extra bytes": (lambda p: patch(p + ".idx", os.path.getsize(p + ".idx"), b"\0" * 5), ".idx",
                    "longer than its header"),
    "sequence count": (lambda p: patch(p + ".idx", 18, struct.pack("<Q", 10**15)), ".idx", "truncated"),
    "document indices": (lambda p: patch(p + ".idx", os.path.getsize(p + ".idx") - 8,
                                         struct.pack("<q", 7)), ".idx", "document indices"),
    "pointers": (lambda p: patch(p + ".idx", 34 + 4 * 3 + 8, struct.pack("<q", 3)), ".idx",
                 "pointers"),
    "bin short": (lambda p: cut(p + ".bin", 6), ".bin", "shorter than its index"),
    "bin long": (lambda p: patch(p + ".bin", 12, b"\0\0"), ".bin", "longer than its index"),
    "idx missing": (lambda p: os.remove(p + ".idx"), ".idx", "does not exist"),
    "bin missing": (lambda p: os.remove(p + ".bin"), ".bin", "does not exist"),
    "idx empty": (lambda p: cut(p + ".idx", 0), ".idx", "truncated"),
}


@pytest.mark.parametrize("name", list(BREAKAGES))
def test_broken_pair_is_one_clear_usage_error(tmp_path, name):
    prefix = good_pair(tmp_path)
    IndexedDataset(prefix)  # fine before
    breakage, culprit, words = BREAKAGES[name]
    breakage(prefix)
    with pytest.raises(UsageError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert prefix + culprit in message and words in message
    assert "\n" not in message


def test_missing_files_suggest_the_right_prefix(tmp_path):
    prefix = good_pair(tmp_path)
    with pytest.raises(UsageError, match="drop the extension"):
        IndexedDataset(prefix + ".bin")
    os.rename(prefix + ".bin", prefix + "_text_sentence.bin")
    os.rename(prefix + ".idx", prefix + "_text_sentence.idx")
    with pytest.raises(UsageError, match="did you mean .*good_text_sentence"):
        IndexedDataset(prefix)
