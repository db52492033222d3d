"""Fuzzing what reads user files: the .bin/.idx reader (IndexedDataset), the BERT samples built on it, and
the preprocessor. Inputs come from hypothesis and from random damage (truncations, bit flips, junk) done to
a real pair made from the default corpus. The contract, for every input:

    - exactly one outcome: it works, or it raises UsageError (one clear line); never another exception;
    - an IndexedDataset that opens reads every sequence in full (no read past the files' ends later);
    - bounded time: each case finishes in seconds, whatever the header claims;
    - a preprocessing run that fails leaves nothing under the output names.
tests/test_preprocess.py and tests/test_indexed_dataset.py hold the named bad inputs; these go wider."""
import json
import os
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minibert.data.corpus import default_corpus_documents
from minibert.data.indexed_dataset import (
    HEADER,
    MAGIC,
    IndexedDataset,
    IndexedDatasetBuilder,
)
from minibert.data.masked_lm import BertMaskedLMDataset, build_train_valid_test_datasets
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.errors import UsageError
from minibert.preprocess import preprocess

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SECONDS = 5.0  # a case's time limit: no header or line may make a reader loop or allocate without end


@pytest.fixture(scope="module")
def tokenizer():
    return BertWordPieceTokenizer()


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory, tokenizer):
    """(prefix, .idx bytes, .bin bytes) of 300 documents of the default corpus, one sentence a sequence."""
    directory = tmp_path_factory.mktemp("real")
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(d + "\n" for d in default_corpus_documents()[:300]), encoding="utf-8")
    (prefix,) = preprocess(str(corpus), str(directory / "corpus"), tokenizer, split_sentences=True,
                           progress=False)
    with open(prefix + ".idx", "rb") as f, open(prefix + ".bin", "rb") as g:
        return prefix, f.read(), g.read()


def write_pair(directory, name, idx, bin_):
    prefix = os.path.join(directory, name)
    for suffix, data in ((".idx", idx), (".bin", bin_)):
        with open(prefix + suffix, "wb") as f:
            f.write(data)
    return prefix


def open_and_read_all(prefix, tokenizer=None):
    """Open the pair and read every sequence; with a tokenizer also build BERT samples on it. Returns
    "ok" or "usage error"; any other exception fails the test. Checks the time limit."""
    start = time.perf_counter()
    try:
        ds = IndexedDataset(prefix)
    except UsageError as e:
        assert "\n" not in str(e) and str(e)
        return "usage error"
    lengths, pointers, docs = ds.sequence_lengths, ds.sequence_pointers, ds.document_indices
    assert docs[0] == 0 and docs[-1] == len(ds) and (np.diff(docs) >= 0).all()
    itemsize = np.dtype(ds.dtype).itemsize
    size = os.path.getsize(prefix + ".bin")
    for i in range(len(ds)):
        tokens = ds[i]
        assert len(tokens) == lengths[i]  # every sequence whole: inside the .bin
        assert pointers[i] + lengths[i] * itemsize <= size
    outcome = "ok"
    if tokenizer is not None:
        try:
            train, _, _ = build_train_valid_test_datasets(prefix, tokenizer, split="1", num_samples=(40, 0, 0),
                                                          seq_length=64, seed=3, binary_head=False)
            for i in range(min(len(train), 40)):
                train[i]
        except UsageError as e:
            assert "\n" not in str(e)
            outcome = "usage error"
    assert time.perf_counter() - start < SECONDS
    return outcome


# ---- the .idx reader, from arbitrary headers and arrays ----

@st.composite
def index_files(draw):
    """A .bin/.idx pair that is consistent, then maybe broken in one field."""
    code = draw(st.sampled_from([8, 8, 4, 1, 2, 3, 5, 6, 7]))
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
             8: np.uint16}[code]
    lengths = np.array(draw(st.lists(st.integers(0, 40), max_size=30)), dtype=np.int32)
    cuts = sorted(draw(st.lists(st.integers(0, len(lengths)), max_size=8)))
    docs = np.array([0] + cuts + [len(lengths)], dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    pointers[1:] = np.cumsum(lengths)[:-1] * np.dtype(dtype).itemsize
    fields = dict(magic=MAGIC, version=1, code=code, n_seq=len(lengths), n_doc=len(docs))
    n_tokens = int(lengths.sum())
    bin_size = n_tokens * np.dtype(dtype).itemsize
    tail = b""
    damage = draw(st.sampled_from(["none", "magic", "version", "code", "n_seq", "n_doc", "lengths",
                                   "pointers", "docs", "bin size", "modes", "tail"]))
    if damage == "magic":
        fields["magic"] = draw(st.binary(min_size=9, max_size=9))
    elif damage in ("version", "code", "n_seq", "n_doc"):
        key = {"version": "version", "code": "code", "n_seq": "n_seq", "n_doc": "n_doc"}[damage]
        fields[key] = draw(st.integers(0, 255) if key == "code" else
                           st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)))
    elif damage == "lengths" and len(lengths):
        lengths[draw(st.integers(0, len(lengths) - 1))] = draw(st.integers(-2**31, 2**31 - 1))
    elif damage == "pointers" and len(pointers):
        pointers[draw(st.integers(0, len(pointers) - 1))] = draw(st.integers(-2**63, 2**63 - 1))
    elif damage == "docs":
        docs[draw(st.integers(0, len(docs) - 1))] = draw(st.integers(-2**63, 2**63 - 1))
    elif damage == "bin size":
        bin_size = draw(st.integers(0, 2 * bin_size + 8))
    elif damage == "modes":
        tail = bytes(len(lengths))  # a multimodal file's per-sequence modes: legal
    elif damage == "tail":
        tail = draw(st.binary(min_size=1, max_size=40))
    header = HEADER.pack(fields["magic"], fields["version"], fields["code"], fields["n_seq"], fields["n_doc"])
    idx = header + lengths.tobytes() + pointers.tobytes() + docs.tobytes() + tail
    return idx, draw(st.binary(min_size=bin_size, max_size=bin_size)), damage


@FUZZ
@given(index_files())
def test_any_index_file_opens_whole_or_fails_clearly(tmp_path, pair):
    idx, bin_, damage = pair
    outcome = open_and_read_all(write_pair(str(tmp_path), "fuzz", idx, bin_))
    if damage in ("none", "modes"):
        assert outcome == "ok"


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_random_bytes_as_a_pair(tmp_path, idx, bin_):
    open_and_read_all(write_pair(str(tmp_path), "junk", idx, bin_))
    open_and_read_all(write_pair(str(tmp_path), "magic", MAGIC + idx, bin_))


def test_huge_counts_in_the_header_fail_at_once(tmp_path):
    """A header that promises 2**64 - 1 sequences is refused from the file size, allocating nothing."""
    idx = HEADER.pack(MAGIC, 1, 8, 2**64 - 1, 2**64 - 1)
    assert open_and_read_all(write_pair(str(tmp_path), "huge", idx, b"")) == "usage error"


# ---- damage to a real pair ----

def damaged(rng, idx, bin_):
    """One random damage: truncate, flip bits, append junk, or cut one file to the other's length."""
    kind = rng.choice(["truncate idx", "truncate bin", "flip idx", "flip bin", "flip header", "junk",
                       "zero bin"])
    idx, bin_ = bytearray(idx), bytearray(bin_)
    if kind == "truncate idx":
        idx = idx[:int(rng.integers(0, len(idx)))]
    elif kind == "truncate bin":
        bin_ = bin_[:int(rng.integers(0, len(bin_)))]
    elif kind in ("flip idx", "flip bin", "flip header"):
        data = bin_ if kind == "flip bin" else idx
        top = HEADER.size if kind == "flip header" else len(data)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, top))] ^= 1 << int(rng.integers(0, 8))
    elif kind == "junk":
        idx += bytes(rng.integers(0, 256, size=int(rng.integers(1, 30)), dtype=np.uint8))
    else:
        bin_ = bytes(len(bin_))
    return kind, bytes(idx), bytes(bin_)


def test_damaged_real_files(tmp_path, real_pair, tokenizer):
    """400 damaged copies of a real pair: each opens and reads whole (its samples too), or is one clear
    UsageError. Undetectable damage (a flipped token bit) must still give samples or a UsageError
    (a token id beyond the vocab)."""
    _, idx, bin_ = real_pair
    rng = np.random.default_rng(0)
    seen = {"ok": 0, "usage error": 0}
    for case in range(400):
        kind, bad_idx, bad_bin = damaged(rng, idx, bin_)
        prefix = write_pair(str(tmp_path), f"case{case}", bad_idx, bad_bin)
        seen[open_and_read_all(prefix, tokenizer if case % 4 == 0 else None)] += 1
        for suffix in (".idx", ".bin"):
            os.remove(prefix + suffix)
    assert seen["ok"] > 40 and seen["usage error"] > 150, seen  # both outcomes really happen


def test_tokens_beyond_the_vocab(tmp_path, tokenizer):
    """Data tokenized with a bigger vocab (int32 ids up to 99999), read with bert-base-uncased's 30524:
    one UsageError naming --vocab-file when a sample meets such an id; negative ids too; float files
    are refused when the dataset is built."""
    for name, dtype, ids in (("big", np.int32, [2023, 99999, 2003]), ("negative", np.int32, [2023, -5, 2003]),
                             ("float", np.float32, [2023.0, 2003.0, 1012.0])):
        builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=dtype)
        for _ in range(20):
            builder.add_document(np.array(ids * 2, dtype=dtype), [3, 3])
        builder.finalize(str(tmp_path / f"{name}.idx"))
        with pytest.raises(UsageError, match="--vocab-file|not token ids"):
            ds = BertMaskedLMDataset(IndexedDataset(str(tmp_path / name)), tokenizer, seq_length=32,
                                     num_samples=5, seed=1)
            ds[0]


# ---- the preprocessor ----

LINES = st.one_of(
    st.text(max_size=60),                                                    # any Unicode, incl. surrogates
    st.text(alphabet=st.characters(codec="utf-8"), max_size=60),
    st.sampled_from(["Dr. Smith came. He left!", "", "   ", "\ufeffBOM first", "a\rb", "x\x00y", "e.g. this."]),
)
JSON_LINES = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=40)),
    st.builds(lambda t: json.dumps({"body": t}), st.text(max_size=10)),     # the key is missing
    st.builds(json.dumps, st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                       lambda inner: st.lists(inner, max_size=3) |
                                       st.dictionaries(st.sampled_from(["text", "t"]), inner, max_size=2),
                                       max_leaves=6)),
    st.sampled_from(["{", "", "[" * 3000 + "]" * 3000, "1" * 5000, '{"text": "\\ud800 lone surrogate"}',
                     "NaN", '{"text": 1}']),
)


def preprocess_outcome(tmp_path, name, data, tokenizer, **kwargs):
    """Run preprocess on `data`: "ok" (and the output reads back) or "usage error" (and no output)."""
    in_dir, out_dir = tmp_path / f"in-{name}", tmp_path / f"out-{name}"
    in_dir.mkdir(exist_ok=True)
    out_dir.mkdir(exist_ok=True)
    for leftover in os.listdir(out_dir):
        os.remove(out_dir / leftover)
    path = in_dir / name
    path.write_bytes(data)
    start = time.perf_counter()
    try:
        (prefix,) = preprocess(str(path), str(out_dir / "p"), tokenizer, progress=False, **kwargs)
    except UsageError as e:
        assert "\n" not in str(e) and os.listdir(out_dir) == []
        return "usage error"
    finally:
        assert time.perf_counter() - start < SECONDS
    ds = IndexedDataset(prefix)
    lines = data.split(b"\n")
    assert len(ds.document_indices) - 1 == len(lines) - (lines[-1] == b"")  # one document per line
    assert open_and_read_all(prefix) == "ok"
    return "ok"


@FUZZ
@given(st.lists(LINES, max_size=12), st.booleans(), st.booleans(), st.binary(max_size=6))
def test_preprocess_plain_text(tmp_path, tokenizer, lines, split, final_newline, junk):
    text = "\n".join(lines) + ("\n" if final_newline else "")
    data = text.encode("utf-8", "surrogatepass")  # lone surrogates: invalid UTF-8, as some files hold
    if junk:
        data = junk + data
    preprocess_outcome(tmp_path, "in.txt", data, tokenizer, split_sentences=split)


@FUZZ
@given(st.lists(JSON_LINES, min_size=1, max_size=8))
def test_preprocess_jsonl(tmp_path, tokenizer, lines):
    data = "".join(line + "\n" for line in lines).encode("utf-8", "surrogatepass")
    outcome = preprocess_outcome(tmp_path, "in.jsonl", data, tokenizer, split_sentences=True)
    if all(line.startswith('{"text": "') and "\\ud8" not in line for line in lines):
        assert outcome == "ok"


def test_preprocess_two_workers_on_damaged_input(tmp_path, tokenizer, monkeypatch):
    """Bad bytes deep in a many-chunk file with 2 workers: the same single error as with 1 worker, and
    nothing left behind."""
    import minibert.preprocess as preprocess_module
    monkeypatch.setattr(preprocess_module, "CHUNK_BYTES", 512)
    rng = np.random.default_rng(1)
    good = "".join(d + "\n" for d in default_corpus_documents()[:120]).encode()
    path = tmp_path / "in.txt"
    for case in range(3):
        data = bytearray(good)
        data[int(rng.integers(len(data) // 2, len(data)))] = 0xFF  # never valid in UTF-8
        path.write_bytes(bytes(data))
        messages = []
        for workers in (1, 2):
            with pytest.raises(UsageError) as error:
                preprocess(str(path), str(tmp_path / "out"), tokenizer, workers=workers, progress=False)
            messages.append(str(error.value))
        assert messages[0] == messages[1] and "is not valid UTF-8" in messages[0]
        assert os.listdir(tmp_path) == ["in.txt"]


def test_preprocess_empty_corpus_then_samples(tmp_path, tokenizer):
    """A file of blank lines preprocesses (empty documents are legal) and then stops at the samples with
    one UsageError naming the fix; a 0-byte file stops at once."""
    assert preprocess_outcome(tmp_path, "blank.txt", b"\n\n\n", tokenizer, split_sentences=True) == "ok"
    with pytest.raises(UsageError, match="every document in this split is empty"):
        build_train_valid_test_datasets(str(tmp_path / "out-blank.txt" / "p_text_sentence"), tokenizer,
                                        split="1", num_samples=(10, 0, 0), seq_length=32, seed=1,
                                        binary_head=True)
    assert preprocess_outcome(tmp_path, "empty.txt", b"", tokenizer) == "usage error"


def test_idx_header_struct_is_34_bytes():
    assert HEADER.size == 34 == struct.calcsize("<9sQBQQ")
