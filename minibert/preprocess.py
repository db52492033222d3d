"""Preprocess: raw text -> token ids in Megatron's `.bin`/`.idx` files, ready for pretraining.

    python minibert/preprocess.py --input corpus.txt --output-prefix data/corpus \\
        --vocab-file minibert/vocab/bert-base-uncased-vocab.txt --tokenizer-type BertWordPieceLowerCase \\
        --split-sentences --workers 2
    -> data/corpus_text_sentence.bin / .idx

The pipeline, per document (one line of the input):

    line bytes --utf-8--> text --(json key)--> text --split_sentences--> ["Dr. X came.", "He left."]
               --WordPiece--> [[2852, 1012, 1060, 2234, 1012], [2002, 2187, 1012]]  (empty ones dropped)
               --builder.add_document(tokens, lengths)--> .bin gets the tokens, .idx the boundaries

Inputs, by extension:
  .json / .jsonl  one JSON object per line; each --json-keys key (default "text") holds the document.
                  Every line must parse and hold every key (else exit 2 naming the line).
  anything else   plain text, one document per line. A blank line is an empty document (kept: it
                  repeats a document index, as in Megatron); the file's final newline adds none.

Outputs `{prefix}_{key}_sentence` with --split-sentences (one sequence per sentence: what BERT's
sentence-order task needs), else `{prefix}_{key}_document` (one sequence per document; an empty
document has none). No special tokens are added: the dataset adds [CLS] and [SEP] when it builds
samples. The bytes are exactly those Megatron's tools/preprocess_data.py writes for the same tokens.

Parallelism: `--workers N` runs N processes. The main process reads the input in chunks of about
CHUNK_BYTES, cut at line ends, and hands each to a worker with its first line number; the worker
decodes, splits and tokenizes every line of it and sends back, per key, three packed arrays:

    tokens   [n]     every token of the chunk's documents, back to back (the file dtype)
    lengths  [s]     each sequence's length
    per_doc  [d]     how many sequences each document has (0: an empty document)

so the main process only appends them to the .bin/.idx (IndexedDatasetBuilder.add_documents): a few
array operations per chunk, whatever is in it, which keeps N workers busy (Megatron's tool sends
every document to the main process and writes it there, one at a time, and that loop is what stops
it from scaling). Chunks are submitted and collected in order, at most a few per worker in flight,
so the output is byte-identical for any N and memory stays bounded on any file size. With
--workers 1 the same chunks are encoded in the main process.

Departures from Megatron's tool, on purpose: plain-text input (Megatron reads JSONL only); our own
rule-based sentence splitter instead of NLTK Punkt (no downloads; see sentence_split.py);
--append-eod is refused (BERT samples need no end-of-document token: Megatron's BERT tokenizer
would append the [EOS] id it adds after vocab.txt's tokens, which BERT never trains on); no
--partitions / --keep-newlines / --lang. Run it as a script or with -m: where worker processes must be
spawned (see _start_method) they re-import the main module, which a script piped on stdin does not have.

Stopping: SIGTERM (what `kill`, `timeout` and SLURM send) and SIGINT (Ctrl-C) end a run the same way:
one line on stderr, no worker and no temporary file left, and exit code 128 + the signal's number, the
shells' convention (143 for SIGTERM, 130 for SIGINT). main installs a handler that turns either signal
into a `Stopped` exception in the main process, wherever it is waiting, so the clean-up an error gets
runs: the builders delete their temporary files, and the pool is shut down with cancel_futures, its
workers finishing the chunk or two they hold (a fraction of a second) before they exit. The workers
themselves ignore both signals, though Ctrl-C, `timeout` and SLURM send them to every process: a worker
killed while it sends a result back leaves half a message in the pipe, and the pool's thread waits for
the rest for good (seen with `timeout`, which signals the whole group). Two steps of a few ms would
leave a file behind if cut in the middle (creating the temporary files, renaming the pairs into place):
there the signals wait until the step is over (_signals_held). Only SIGKILL, which no process can
catch, leaves files and workers behind."""
import collections
import contextlib
import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor

if __package__ in (None, ""):  # `python minibert/preprocess.py` from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each worker would import numpy, whose OpenBLAS starts one busy-waiting thread per core at import: on a
# many-core host one import burnt several times its wall clock in CPU, and 8 workers starting at once took
# those cores from the work (bench/notes/preprocess.md). Neither the tool nor its workers multiply
# matrices, so they run with one thread each.
WORKER_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
if __name__ == "__main__":  # run as the tool: one BLAS thread here too, so its workers can be forked
    for _name, _value in WORKER_THREADS.items():
        os.environ.setdefault(_name, _value)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from minibert.data.indexed_dataset import IndexedDatasetBuilder, best_dtype  # noqa: E402
from minibert.data.sentence_split import split_sentences as split_into_sentences  # noqa: E402
from minibert.data.tokenizer import build_tokenizer  # noqa: E402
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error  # noqa: E402

CHUNK_BYTES = 1 << 18  # input per task: a fraction of a second of work (bench/notes/preprocess.md), so 8
                       # workers share even a few MB evenly
IN_FLIGHT_PER_WORKER = 4  # chunks queued per worker: keeps workers busy, bounds memory
JSON_EXTENSIONS = (".json", ".jsonl")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """SIGINT or SIGTERM arrived: raised in the main process by the handler that main installs."""

    def __init__(self, signum):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def _raise_stopped(signum, frame):
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
    raise Stopped(signum)


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait (blocked, not lost) until the block is over, then arrive: for a step that a
    signal must not cut in half. Blocking is per thread; it holds them for the whole process here because
    the tool runs one thread when it creates and renames its files, and the threads and workers that the
    pool starts inside a hold begin with both blocked too. (Windows has no signal masks: nothing is held.)"""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DocumentEncoder:
    """Turns a chunk of input lines into packed token arrays, per key (see __call__)."""

    def __init__(self, tokenizer, json_keys, jsonl, split_sentences, dtype, input_path):
        self.tokenizer, self.json_keys, self.jsonl = tokenizer, json_keys, jsonl
        self.split_sentences, self.dtype, self.input_path = split_sentences, dtype, input_path

    def texts(self, line_number, offset, raw):
        """The line's document text for each key; a UsageError naming the line if it is malformed."""
        where = f"{self.input_path}: line {line_number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"{where} is not valid UTF-8 (byte {offset + e.start} of the file): "
                             "re-save the input as UTF-8") from None
        if line_number == 1:
            line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
        if not self.jsonl:
            return [line.rstrip("\r\n")]
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where} is not JSON ({e.msg}, column {e.colno}): a .json/.jsonl input "
                             "needs one JSON object per line (use a .txt name for plain text)") from None
        except (ValueError, RecursionError) as e:  # a 5000-digit number; arrays nested 1000 deep
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
            raise UsageError(f"{where} is JSON that Python cannot read ({why}): give each line a JSON "
                             "object with the text as a string") from None
        texts = []
        for key in self.json_keys:
            if not isinstance(record, dict) or key not in record:
                has = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
                raise UsageError(f"{where} has no key {key!r} (it has: {has or 'nothing'}): give every "
                                 "line that key or pass --json-keys with the right one")
            if not isinstance(record[key], str):
                raise UsageError(f"{where}: key {key!r} holds a {type(record[key]).__name__}, not a "
                                 "string: each document must be one string")
            texts.append(record[key])
        return texts

    def sentences(self, text):
        """The document's sequences as lists of token ids; empty ones dropped."""
        pieces = split_into_sentences(text) if self.split_sentences else [text]
        return [ids for ids in map(self.tokenizer.tokenize, pieces) if ids]

    def __call__(self, chunk):
        """(first line number, byte offset, bytes of whole lines) -> per key (tokens [n] in the file
        dtype, sequence lengths int32 [s], sequences per document int32 [d]), and d."""
        line_number, offset, data = chunk
        lines = data.split(b"\n")
        last_has_newline = not lines[-1]
        if last_has_newline:
            lines.pop()  # the chunk's final newline ends its last line; it starts none
        packed = [([], [], []) for _ in self.json_keys]
        for i, raw in enumerate(lines):
            raw_line = raw + b"\n" if i < len(lines) - 1 or last_has_newline else raw
            for (tokens, lengths, per_doc), text in zip(packed, self.texts(line_number + i, offset, raw_line)):
                ids = self.sentences(text)
                for sentence in ids:
                    tokens.extend(sentence)
                lengths.extend(map(len, ids))
                per_doc.append(len(ids))
            offset += len(raw_line)
        return [(np.array(tokens, dtype=self.dtype), np.array(lengths, dtype=np.int32),
                 np.array(per_doc, dtype=np.int32)) for tokens, lengths, per_doc in packed], len(lines)


_worker_encoder = None  # set once in each worker process by the pool initializer


def _init_worker(encoder):
    """Runs first in each worker, which starts with SIGINT and SIGTERM held (see _encoded_chunks), then
    ignores both from here on: only the main process answers them, and it stops the workers."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(chunk):
    return _worker_encoder(chunk)


def _chunks(path):
    """(first line number, byte offset, bytes) of about CHUNK_BYTES of whole lines each, in order."""
    line_number, offset, pieces = 1, 0, []
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK_BYTES)
            cut = block.rfind(b"\n") + 1  # whole lines only; 0: no line ends in this block
            if block and not cut:
                pieces.append(block)      # a line longer than a chunk: read on
                continue
            data = b"".join(pieces + [block[:cut] if block else b""])
            if data:                       # at the end: the last line, if it has no newline
                yield line_number, offset, data
            if not block:
                return
            line_number += data.count(b"\n")
            offset += len(data)
            pieces = [block[cut:]]


def _start_method():
    """How the pool starts its workers: "fork" where the OS has it and this process runs one thread,
    else "spawn". A forked worker is a copy of this process, modules and encoder included, so it is
    ready in milliseconds; a spawned one starts a fresh Python that imports numpy and minibert again, a
    large share of a run's time at 8 workers (bench/notes/preprocess.md). fork copies only the thread
    that calls it: a lock that another thread held at that moment (BLAS, torch, tqdm's monitor) would
    stay locked in the child for good, so any second thread means spawn. The pool starts its workers on
    the first submit, after this is asked: nothing here starts a thread in between."""
    try:
        threads = len(os.listdir("/proc/self/task"))  # every thread of this process, not only Python's
    except OSError:
        return "spawn"  # no /proc (macOS, Windows): no cheap count, and spawn is safe everywhere
    return "fork" if threads == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"


def _encoded_chunks(encoder, path, workers):
    """Every chunk's encoding (see DocumentEncoder.__call__) with its size in bytes, in input order,
    computed in `workers` processes."""
    if workers == 1:
        for chunk in _chunks(path):
            yield encoder(chunk), len(chunk[2])
        return
    # A process pool, not multiprocessing.Pool: a worker that dies (killed for memory) raises, never
    # hangs. A spawned worker inherits os.environ as it is when it starts (on one of the first
    # submits), so WORKER_THREADS is set for the pool's life and the caller's values are put back after.
    saved = {name: os.environ.get(name) for name in WORKER_THREADS}
    os.environ.update(WORKER_THREADS)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(_start_method()),
                               initializer=_init_worker, initargs=(encoder,))
    try:
        pending = collections.deque()
        for chunk in _chunks(path):
            with _signals_held():  # submit starts the workers: each begins with the signals held
                future = pool.submit(_encode_in_worker, chunk)
            pending.append((future, len(chunk[2])))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                future, size = pending.popleft()  # the oldest first: output keeps input order
                yield future.result(), size
        while pending:
            future, size = pending.popleft()
            yield future.result(), size
    finally:  # also on an error or a signal (Stopped): drop what is queued, wait for the workers to exit
        pool.shutdown(cancel_futures=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Bar(tqdm):
    """tqdm's bar without its monitor thread (which only tunes redraws of a stalled bar): a second
    thread would make the pool spawn its workers instead of forking them (see _start_method)."""
    monitor_interval = 0


def _check_inputs(input_path, json_keys, workers):
    if not os.path.isfile(input_path):
        raise UsageError(f"input file {input_path} does not exist: check --input")
    if os.path.getsize(input_path) == 0:
        raise UsageError(f"input file {input_path} is empty (0 bytes): give a file with at least "
                         "one document")
    jsonl = input_path.lower().endswith(JSON_EXTENSIONS)
    if not jsonl and tuple(json_keys) != ("text",):
        raise UsageError(f"--json-keys only applies to .json/.jsonl input; {input_path} is read as "
                         "plain text (one document per line, written under the key 'text')")
    if len(set(json_keys)) != len(json_keys) or not json_keys:
        raise UsageError(f"--json-keys {' '.join(json_keys)}: give one or more distinct keys")
    if workers < 1:
        raise UsageError(f"--workers {workers}: use 1 or more worker processes")
    return jsonl


def _show_progress(bar, docs, done_bytes, start):
    """The bar counts bytes (so it shows MB/s and a true ETA); docs and docs/s go beside it."""
    bar.set_postfix_str(f"{docs} docs, {docs / max(time.perf_counter() - start, 1e-9):,.0f} docs/s",
                        refresh=False)
    bar.update(done_bytes - bar.n)


def preprocess(input_path, output_prefix, tokenizer, json_keys=("text",), split_sentences=False,
               workers=1, progress=True):
    """Tokenize `input_path` into one .bin/.idx pair per key; returns the prefixes written.
    Nothing is left under the output names if anything fails."""
    jsonl = _check_inputs(input_path, json_keys, workers)
    dtype = best_dtype(tokenizer.vocab_size)
    encoder = DocumentEncoder(tokenizer, tuple(json_keys), jsonl, split_sentences, dtype, input_path)
    level = "sentence" if split_sentences else "document"
    prefixes = [f"{output_prefix}_{key}_{level}" for key in json_keys]
    builders = []
    total_bytes = os.path.getsize(input_path)
    # The bar redraws itself in place, which only a terminal shows as one line: in a pipe or a log
    # file it would be a heap of fragments (and bury an error line), so there only the summary prints.
    on_terminal = getattr(sys.stderr, "isatty", lambda: False)()
    bar = _Bar(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess",
               file=sys.stderr, disable=not (progress and on_terminal), smoothing=0.1)
    docs = sequences = tokens = done_bytes = 0
    start = time.perf_counter()
    chunks = _encoded_chunks(encoder, input_path, workers)
    try:
        with _signals_held():  # a temporary file exists once its builder does: none is created unknown
            builders = [IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) for prefix in prefixes]
        for (per_key, num_docs), n_bytes in chunks:
            for builder, (chunk_tokens, lengths, per_doc) in zip(builders, per_key):
                builder.add_documents(chunk_tokens, lengths, per_doc)
                sequences += len(lengths)
                tokens += len(chunk_tokens)
            docs += num_docs
            done_bytes += n_bytes
            _show_progress(bar, docs, done_bytes, start)
        with _signals_held():  # every pair renamed into place, .bin then .idx; a signal waits for them
            for builder, prefix in zip(builders, prefixes):
                builder.finalize(prefix + ".idx")
    except BaseException:
        for builder in builders:
            builder.abort()
        bar.leave = False  # clear the bar, so an error is the only line left
        raise
    finally:
        chunks.close()  # stops the worker pool now, also when we stopped early on an error
        _show_progress(bar, docs, done_bytes, start)
        bar.close()
    seconds = time.perf_counter() - start
    if progress:
        kind = "sentences" if split_sentences else "sequences"
        outputs = ", ".join(f"{p}.{{bin,idx}}" for p in prefixes)
        print(f"wrote {outputs}: {docs} documents, {sequences} {kind}, {tokens} tokens in "
              f"{seconds:.2f} s ({docs / seconds:,.0f} docs/s, {total_bytes / 1e6 / seconds:.2f} MB/s)",
              flush=True)
    return prefixes


def build_parser():
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input", required=True, help=".json/.jsonl (one JSON object a line) or "
                        "plain text (one document a line)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_{sentence|document}"
                        ".{bin,idx}")
    parser.add_argument("--vocab-file", default=None, help="WordPiece vocab.txt (default: the shipped "
                        "bert-base-uncased vocab)")
    parser.add_argument("--tokenizer-type", default="BertWordPieceLowerCase",
                        choices=["BertWordPieceLowerCase", "BertWordPieceCase"],
                        help="lower-case (uncased vocab) or keep case (cased vocab)")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL keys to extract, "
                        "one output pair each")
    parser.add_argument("--split-sentences", action="store_true", help="one sequence per sentence "
                        "(BERT's sentence-order task needs it)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (about one per "
                        "CPU core)")
    parser.add_argument("--append-eod", action="store_true", help="GPT-style end-of-document token: "
                        "not for BERT, refused")
    return parser


@exit_on_usage_error
def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.append_eod:
        raise UsageError("--append-eod is for GPT-style data: BERT has no end-of-document token (the "
                         "dataset adds [CLS]/[SEP] itself); drop the flag")
    previous = {number: signal.signal(number, _raise_stopped) for number in STOP_SIGNALS}
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file)
        preprocess(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                   split_sentences=args.split_sentences, workers=args.workers)
    except Stopped as e:  # preprocess has stopped its workers and removed its temporary files
        print(f"preprocess: {e}; no partial output, temporary file or worker is left", file=sys.stderr)
        sys.exit(128 + e.signum)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


if __name__ == "__main__":
    main()
