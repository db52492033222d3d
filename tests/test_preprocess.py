"""minibert/preprocess.py: tokens against HF tokenizers, bytes against megatron-core's builder used the
way Megatron's tools/preprocess_data.py uses it, 1 vs 2 workers, the line rules, and every bad input
through the real command line (exit 2, one stderr line, nothing left behind)."""
import json
import os
import pydoc_data.topics
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
from tokenizers import BertWordPieceTokenizer as HFBertWordPiece

import minibert.preprocess as preprocess_module
from minibert.data.corpus import default_corpus_documents
from minibert.data.indexed_dataset import IndexedDataset
from minibert.data.sentence_split import split_sentences
from minibert.data.tokenizer import DEFAULT_VOCAB_FILE, build_tokenizer
from minibert.preprocess import preprocess

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import indexed_dataset as megatron

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRICKY = [
    "Dr. Smith met J. R. R. Tolkien in the U.S. in 1950. \"Really?\" she asked. Yes! See Fig. 3.",
    "",  # an empty document
    "   ",  # whitespace only: no tokens, no sequence
    "\x01 \x02",  # only characters BERT deletes: a sentence that tokenizes to nothing is dropped
    "Café naïve résumé. Ünïcödé façade! 東京 is a city. Emoji 🙂 here.",
    "One sentence without an end",
    "",
    "Pi is 3.14. Wait... What? e.g. this. (Parenthetical.) End.",
]


def corpus_lines(n=400):
    """Real English paragraphs (the Python docs), one a line, with the tricky ones mixed in."""
    lines = []
    for text in pydoc_data.topics.topics.values():
        lines += [" ".join(p.split()) for p in text.split("\n\n")]
    lines = lines[:n]
    for i, tricky in enumerate(TRICKY):
        lines.insert(i * 37 % len(lines), tricky)
    return lines


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer("BertWordPieceLowerCase", DEFAULT_VOCAB_FILE)


def write_lines(path, lines, final_newline=True):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + ("\n" if final_newline else ""))
    return str(path)


def files_in(directory):
    return sorted(os.listdir(directory))


def read(path):
    with open(path, "rb") as f:
        return f.read()


def megatron_reference(prefix, documents, tokenizer, split):
    """What Megatron's tools/preprocess_data.py writes: per document, tokenize each sentence, keep the
    non-empty ones, add_document(all tokens, sentence lengths); the dtype from DType.optimal_dtype."""
    builder = megatron.IndexedDatasetBuilder(
        prefix + ".bin", dtype=megatron.DType.optimal_dtype(tokenizer.vocab_size))
    for text in documents:
        ids = [tokenizer.tokenize(s) for s in (split_sentences(text) if split else [text])]
        ids = [s for s in ids if len(s) > 0]
        builder.add_document([t for s in ids for t in s], [len(s) for s in ids])
    builder.finalize(prefix + ".idx")


def test_document_tokens_equal_hf_tokenizers(tmp_path, tokenizer):
    lines = corpus_lines(200)
    (prefix,) = preprocess(write_lines(tmp_path / "c.txt", lines), str(tmp_path / "c"), tokenizer,
                           progress=False)
    assert prefix == str(tmp_path / "c_text_document")
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert len(ds.document_indices) == len(lines) + 1
    hf = HFBertWordPiece(DEFAULT_VOCAB_FILE, lowercase=True)
    for d, line in enumerate(lines):
        sequences = range(ds.document_indices[d], ds.document_indices[d + 1])
        expected = hf.encode(line, add_special_tokens=False).ids
        assert len(sequences) == (1 if expected else 0)  # an empty document has no sequence
        assert [t for i in sequences for t in ds[i].tolist()] == expected


@pytest.mark.parametrize("split", [True, False], ids=["sentence", "document"])
def test_bytes_equal_megatron_preprocess(tmp_path, tokenizer, split):
    lines = corpus_lines(300)
    (prefix,) = preprocess(write_lines(tmp_path / "c.txt", lines), str(tmp_path / "c"), tokenizer,
                           split_sentences=split, progress=False)
    megatron_reference(str(tmp_path / "m"), lines, tokenizer, split)
    assert read(prefix + ".bin") == read(str(tmp_path / "m.bin"))
    assert read(prefix + ".idx") == read(str(tmp_path / "m.idx"))
    ds = IndexedDataset(prefix)
    lengths = np.diff(ds.document_indices)
    assert (lengths == 0).sum() >= 4  # the empty, blank and deleted-character documents
    if split:
        assert (lengths > 1).sum() > 50  # really split: many documents have several sentences


def test_jsonl_with_two_keys_matches_megatron(tmp_path, tokenizer):
    lines = corpus_lines(60)
    records = [{"text": line, "title": line[:30], "id": i} for i, line in enumerate(lines)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    prefixes = preprocess(str(path), str(tmp_path / "j"), tokenizer, json_keys=("text", "title"),
                          split_sentences=True, progress=False)
    assert prefixes == [str(tmp_path / "j_text_sentence"), str(tmp_path / "j_title_sentence")]
    for key, prefix in zip(["text", "title"], prefixes):
        megatron_reference(str(tmp_path / f"m_{key}"), [r[key] for r in records], tokenizer, split=True)
        assert read(prefix + ".bin") == read(str(tmp_path / f"m_{key}.bin"))
        assert read(prefix + ".idx") == read(str(tmp_path / f"m_{key}.idx"))


@pytest.mark.parametrize("chunk_bytes", [7, 300, 1 << 18], ids=["lines-longer-than-chunks", "small", "default"])
def test_any_worker_count_writes_the_same_bytes(tmp_path, tokenizer, monkeypatch, chunk_bytes):
    """1, 2 and 3 workers, chunks from a few bytes (every line longer than a chunk) to the default: the
    same .bin/.idx, equal to Megatron's."""
    monkeypatch.setattr(preprocess_module, "CHUNK_BYTES", chunk_bytes)
    lines = corpus_lines(400 if chunk_bytes > 7 else 60)
    path = write_lines(tmp_path / "c.txt", lines, final_newline=chunk_bytes != 300)
    written = [preprocess(path, str(tmp_path / f"w{n}"), tokenizer, split_sentences=True, workers=n,
                          progress=False)[0] for n in (1, 2, 3)]
    megatron_reference(str(tmp_path / "m"), lines, tokenizer, split=True)
    for prefix in written:
        assert read(prefix + ".bin") == read(str(tmp_path / "m.bin"))
        assert read(prefix + ".idx") == read(str(tmp_path / "m.idx"))
    assert files_in(tmp_path) == ["c.txt", "m.bin", "m.idx"] + [f"w{n}_text_sentence.{e}" for n in (1, 2, 3)
                                                               for e in ("bin", "idx")]


class _WorkerThreads:
    """Stands in for the encoder: reports the thread settings of the worker process it runs in."""

    def __call__(self, chunk):
        return {name: os.environ.get(name) for name in preprocess_module.WORKER_THREADS}


def test_workers_start_with_one_blas_thread_and_the_caller_keeps_its_settings(tmp_path, monkeypatch):
    """numpy's OpenBLAS busy-waits one thread per core at import: each worker starts with one, and the
    caller's own values (one set, the others unset) are as they were afterwards."""
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "in.txt"
    path.write_bytes(b"one line\n" * 3)
    seen = [result for result, _ in preprocess_module._encoded_chunks(_WorkerThreads(), str(path), 2)]
    assert seen == [dict.fromkeys(preprocess_module.WORKER_THREADS, "1")]
    assert os.environ["OPENBLAS_NUM_THREADS"] == "7"
    assert "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ


HOW_IT_CAME = textwrap.dedent("""
    import sys, threading
    import minibert.preprocess as preprocess_module

    class HowItCame:
        \"\"\"Stands in for the encoder: True in a worker it reached pickled (spawned: a fresh Python
        unpickles it), False in one that inherited it with this process's memory (forked).\"\"\"
        pickled = False

        def __getstate__(self):
            return {"pickled": True}

        def __call__(self, chunk):
            return self.pickled

    if __name__ == "__main__":
        stop = threading.Event()
        if sys.argv[2] == "second-thread":
            threading.Thread(target=stop.wait).start()
        method = preprocess_module._start_method()
        seen = sorted({r for r, _ in preprocess_module._encoded_chunks(HowItCame(), sys.argv[1], 2)})
        stop.set()
        print(method, seen)
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_workers_are_forked_from_a_one_thread_process_and_spawned_beside_a_second_thread(tmp_path):
    """In a process of one thread, as the tool runs, the workers are forked: the encoder reaches them
    without being pickled. With a second thread alive (its locks would be copied held) they are
    spawned. DeprecationWarnings are errors: Python 3.12 warns when a process with threads forks."""
    script = tmp_path / "how.py"
    script.write_text(HOW_IT_CAME)
    data = tmp_path / "in.txt"
    data.write_bytes(b"one line\n" * 3)
    env = dict(os.environ, PYTHONPATH=ROOT, **preprocess_module.WORKER_THREADS)
    for second, expected in [("alone", "fork [False]"), ("second-thread", "spawn [True]")]:
        result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", str(script), str(data),
                                 second], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


def test_spawned_workers_write_the_same_bytes(tmp_path, tokenizer):
    """A second thread alive here makes the pool spawn its workers (the forked ones are the other
    tests'): the same .bin/.idx as one worker."""
    lines = corpus_lines(400)
    path = write_lines(tmp_path / "c.txt", lines)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert preprocess_module._start_method() == "spawn"
        spawned = preprocess(path, str(tmp_path / "w2"), tokenizer, split_sentences=True, workers=2,
                             progress=False)[0]
    finally:
        stop.set()
        thread.join()
    alone = preprocess(path, str(tmp_path / "w1"), tokenizer, split_sentences=True, progress=False)[0]
    for ext in (".bin", ".idx"):
        assert read(spawned + ext) == read(alone + ext)


def test_chunks_cut_at_line_ends(tmp_path, monkeypatch):
    """The chunks cover the file exactly, each ends at a newline (the last may not), and their line
    numbers and byte offsets are the file's."""
    monkeypatch.setattr(preprocess_module, "CHUNK_BYTES", 5)
    content = b"ab\n\nlonger line here\nx\n\n\nlast without newline"
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    chunks = list(preprocess_module._chunks(str(path)))
    assert b"".join(data for _, _, data in chunks) == content
    for (line, offset, data), nxt in zip(chunks, chunks[1:] + [None]):
        assert content[offset:offset + len(data)] == data
        assert line == content[:offset].count(b"\n") + 1
        assert data.endswith(b"\n") or nxt is None


@pytest.mark.parametrize("workers", [1, 2])
def test_error_deep_in_a_file_names_its_line_and_byte(tmp_path, tokenizer, monkeypatch, workers):
    """With chunks of a few hundred bytes, the bad line sits in a late chunk: the message still counts
    lines and bytes from the start of the file, and nothing is left under the output names."""
    monkeypatch.setattr(preprocess_module, "CHUNK_BYTES", 200)
    good = "".join(f"Line {i} is fine. It has two sentences.\n" for i in range(300)).encode()
    path = tmp_path / "in.txt"
    path.write_bytes(good + b"bad \xff here\n" + good)
    with pytest.raises(preprocess_module.UsageError, match=f"line 301 is not valid UTF-8 \\(byte {len(good) + 4} "):
        preprocess(str(path), str(tmp_path / "out"), tokenizer, workers=workers, progress=False)
    assert files_in(tmp_path) == ["in.txt"]


@pytest.mark.parametrize("content, n_docs", [
    (b"a b\n\nc d\n", 3), (b"a b\n\nc d", 3), (b"\n", 1), (b"\n\n", 2), (b"x\r\ny\r\n", 2),
    (b"\xef\xbb\xbfhello\n", 1), (b"a\n\n\n", 3)])
def test_one_document_per_line(tmp_path, tokenizer, content, n_docs):
    path = tmp_path / "in.txt"
    path.write_bytes(content)
    ds = IndexedDataset(preprocess(str(path), str(tmp_path / "o"), tokenizer, progress=False)[0])
    assert len(ds.document_indices) == n_docs + 1
    words = content.decode("utf-8-sig").split()
    assert [tokenizer.inv_vocab[t] for i in range(len(ds)) for t in ds[i].tolist()] == words


# ---- the command line ----

def run_cli(args, cwd=ROOT, module=False):
    command = [sys.executable, "-m", "minibert.preprocess"] if module else [
        sys.executable, os.path.join(ROOT, "minibert", "preprocess.py")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_cli_script_and_module(tmp_path):
    path = write_lines(tmp_path / "c.txt", corpus_lines(40))
    common = ["--input", path, "--vocab-file", DEFAULT_VOCAB_FILE, "--tokenizer-type",
              "BertWordPieceLowerCase", "--split-sentences"]
    script = run_cli(common + ["--output-prefix", str(tmp_path / "s")], cwd=str(tmp_path))  # outside the repo
    module = run_cli(common + ["--output-prefix", str(tmp_path / "m"), "--workers", "2"], module=True)
    for result, name in [(script, "s"), (module, "m")]:
        assert result.returncode == 0, result.stderr
        summary = result.stdout.strip().splitlines()[-1]
        assert f"{name}_text_sentence" in summary and f"{len(corpus_lines(40))} documents" in summary
        assert "docs/s" in summary and "MB/s" in summary
    assert read(str(tmp_path / "s_text_sentence.bin")) == read(str(tmp_path / "m_text_sentence.bin"))
    assert read(str(tmp_path / "s_text_sentence.idx")) == read(str(tmp_path / "m_text_sentence.idx"))


def test_progress_bar_on_a_terminal(tmp_path):
    """On a terminal stderr shows tqdm's bar with MB/s and docs/s (in a pipe, only the summary)."""
    import fcntl
    import pty
    import struct
    import termios
    path = write_lines(tmp_path / "c.txt", corpus_lines(100))
    command = [sys.executable, os.path.join(ROOT, "minibert", "preprocess.py"), "--input", path,
               "--output-prefix", str(tmp_path / "o")]
    terminal, child_side = pty.openpty()
    fcntl.ioctl(child_side, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # 160 columns
    proc = subprocess.Popen(command, stderr=child_side, stdout=subprocess.PIPE, text=True)
    os.close(child_side)
    seen = b""
    while True:
        try:
            data = os.read(terminal, 4096)
        except OSError:  # the child closed its side
            break
        if not data:
            break
        seen += data
    os.close(terminal)
    assert proc.wait(timeout=120) == 0
    assert proc.stdout.read().startswith("wrote ")
    final = [redraw for redraw in seen.decode().split("\r") if redraw.strip()][-1]  # the last redraw
    assert "100%" in final and "B/s" in final and f"{len(corpus_lines(100))} docs" in final
    assert "docs/s" in final


BAD_INPUTS = {
    # name: (file name, file bytes, extra flags, words the error line must contain)
    "missing input": (None, None, [], "does not exist"),
    "empty input": ("in.txt", b"", [], "is empty"),
    "missing vocab": ("in.txt", b"hello\n", ["--vocab-file", "/nonexistent/vocab.txt"], "vocab"),
    "not json": ("in.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', [], "line 3 is not JSON"),
    "blank json line": ("in.json", b'{"text": "a"}\n\n', [], "line 2 is not JSON"),
    "missing key": ("in.jsonl", b'{"text": "a"}\n{"body": "b"}\n', [], "line 2 has no key 'text'"),
    "json not object": ("in.jsonl", b'["text"]\n', [], "line 1 has no key 'text'"),
    "value not string": ("in.jsonl", b'{"text": ["a", "b"]}\n', [], "line 1: key 'text' holds a list"),
    "invalid utf-8": ("in.txt", b"fine\nbad \xff byte\n", [], "line 2 is not valid UTF-8 (byte 9"),
    "keys on text": ("in.txt", b"hello\n", ["--json-keys", "body"], "--json-keys only applies"),
    "append eod": ("in.txt", b"hello\n", ["--append-eod"], "--append-eod"),
    "zero workers": ("in.txt", b"hello\n", ["--workers", "0"], "--workers 0"),
    "unknown flag": ("in.txt", b"hello\n", ["--keep-newlines"], "unrecognized arguments"),
    "bad tokenizer": ("in.txt", b"hello\n", ["--tokenizer-type", "GPT2BPETokenizer"], "invalid choice"),
    "missing out dir": ("in.txt", b"hello\n", ["--output-prefix", "/nonexistent/dir/x"], "does not exist"),
    "late json error, 2 workers": ("in.jsonl", b'{"text": "Hello there. Bye."}\n' * 700 + b"{\n",
                                   ["--workers", "2", "--split-sentences"], "line 701 is not JSON"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, name):
    file_name, content, extra, words = BAD_INPUTS[name]
    in_dir, out_dir = tmp_path / "in", tmp_path / "out"
    in_dir.mkdir()
    out_dir.mkdir()
    path = in_dir / (file_name or "missing.txt")
    if content is not None:
        path.write_bytes(content)
    flags = ["--input", str(path), "--output-prefix", str(out_dir / "p"), "--vocab-file",
             DEFAULT_VOCAB_FILE, "--tokenizer-type", "BertWordPieceLowerCase"]
    result = run_cli(flags + extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr
    assert files_in(out_dir) == [] and result.stdout == ""


def children(pid):
    """The processes whose parent is `pid`, from /proc/*/stat (field 4; the name before it, in
    parentheses, may hold spaces)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):
            continue  # it ended meanwhile
        if parent == pid:
            found.append(int(entry))
    return found


def running(pid):
    """Alive and not a zombie (one that ended and waits for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the workers in /proc (Linux)")
def test_sigterm_and_ctrl_c_stop_the_workers_and_leave_nothing(tmp_path):
    """The tool on 11 MB of the default corpus with two workers, stopped once its workers have sent
    tokens back (its hidden .bin has grown): SIGTERM to the tool alone (`kill`), then SIGINT to its whole
    process group (Ctrl-C, which reaches the workers too). Each time: one stderr line, exit code 128 +
    the signal, no worker left running, nothing in the output directory, not even a hidden file."""
    path = tmp_path / "corpus.txt"
    path.write_text("".join(doc + "\n" for doc in default_corpus_documents()) * 10, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    for number, send in [(signal.SIGTERM, os.kill), (signal.SIGINT, os.killpg)]:
        out_dir, err_path = tmp_path / number.name, tmp_path / f"{number.name}.err"
        out_dir.mkdir()
        command = [sys.executable, os.path.join(ROOT, "minibert", "preprocess.py"), "--input", str(path),
                   "--output-prefix", str(out_dir / "o"), "--split-sentences", "--workers", "2"]
        # stderr to a file, not a pipe: workers left running would hold a pipe open, and reading it hang
        with open(err_path, "w") as err:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)  # its own process group, as a terminal gives it
        workers = []
        try:
            deadline = time.monotonic() + 120
            while not (len(workers := children(proc.pid)) == 2 and any(
                    os.path.getsize(out_dir / name) for name in os.listdir(out_dir))):
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, "the workers sent nothing back in 120 s"
                time.sleep(0.01)
            send(proc.pid, number)
            proc.wait(timeout=120)
        finally:  # a failed check leaves no process behind
            proc.kill()  # nothing if it has ended
            left = [pid for pid in workers if running(pid)]
            for pid in left:
                os.kill(pid, signal.SIGKILL)  # orphaned, a worker would wait for work for good
        assert proc.returncode == 128 + number, f"exit {proc.returncode}: {err_path.read_text()}"
        line = f"preprocess: stopped by {number.name}; no partial output, temporary file or worker is left"
        assert err_path.read_text().splitlines() == [line]
        assert left == []
        assert files_in(out_dir) == []
