"""Preprocess throughput and its scaling with --workers: minibert's preprocess next to HF tokenizers'
encode_batch at the same parallelism, on the same text, on this machine.

    python bench/preprocess_speed.py [--workers 1 2] [--repeats 3] [--copies 20] [--corpus FILE]
    python bench/preprocess_speed.py --workers 1 2 4 8 --copies 100     # a 16-core machine
    python bench/preprocess_speed.py --workers 1 2 4 8 --sequential     # the work alone, any machine
    python bench/preprocess_speed.py --workers 1 2 4 8 --side-by-side   # what the machine costs
    python bench/preprocess_speed.py --workers 1 8 --copies 100 --no-peer   # minibert alone, faster

What is timed, best of --repeats, on the default corpus (minibert.data.corpus, real English, 1.1 MB)
written --copies times over (20: 22 MB), or on --corpus FILE:
  - minibert: the whole `preprocess()` (read, UTF-8/JSON checks, sentence split, WordPiece, write
    .bin/.idx), with and without --split-sentences, at each --workers (pool start-up included), with a
    fresh tokenizer each time (its word cache starts cold, as in a real run);
  - peer: `tokenizers.BertWordPieceTokenizer.encode_batch(lines, add_special_tokens=False)`, the Rust
    WordPiece of HF, on the same lines already in memory: tokenization only, nothing split or written.
    It runs in a fresh process per thread count N with RAYON_NUM_THREADS=N (its thread pool reads that
    once, at start), so "N threads" is exactly N.
Printed per N: docs/s, MB/s and the speed-up over N = 1 for both, and minibert's speed-up once its
fixed start-up (tokenizer load, worker processes: timed on a one-line input) is taken out; and, from one
more run, the CPU seconds of the main process and of the workers: the main process's share is what
would limit the speed-up on more cores (it must stay small), and it can be read on a busy machine, where
wall times cannot. With a copied
corpus every worker meets the same words, so each warms its own word cache: a cost a real corpus pays
too (its frequent words), counted here.

--sequential separates that extra work from slower work: the corpus's chunks are dealt round-robin to N
fresh encoders (each with its own tokenizer caches, as N workers have) that run one after another in
this one process, and the CPU seconds of all N together are printed. Against the workers' CPU seconds of
a parallel run at the same N, the difference is what running side by side costs (shared cores, caches,
clock), not what the caches cost.

--side-by-side measures that cost directly: N processes start together and each encodes the same first
--side-mb of the corpus with a fresh encoder (identical work, caches included), so any growth of a
process's CPU seconds with N is the machine's (shared cores, caches, memory, all-core clock), none of it
the program's. N / (that growth) is the speed-up the machine allows at N workers."""
import argparse
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# What the preprocess tool does when it runs: one BLAS thread (set before numpy loads), so this process
# runs one thread and its pools fork their workers (see minibert/preprocess.py, _start_method).
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

from minibert import preprocess as preprocessing  # noqa: E402
from minibert.data.indexed_dataset import best_dtype  # noqa: E402
from minibert.data.tokenizer import DEFAULT_VOCAB_FILE, build_tokenizer  # noqa: E402
from minibert.preprocess import preprocess  # noqa: E402

HF_PEER = """
import json, sys, time
from tokenizers import BertWordPieceTokenizer
lines = open(sys.argv[1], encoding="utf-8").read().splitlines()
times = []
for _ in range(int(sys.argv[3])):
    tokenizer = BertWordPieceTokenizer(sys.argv[2], lowercase=True)
    start = time.perf_counter()
    tokenizer.encode_batch(lines, add_special_tokens=False)
    times.append(time.perf_counter() - start)
print(json.dumps(min(times)))
"""


def write_corpus(path, copies):
    """The corpus `make train-small` preprocesses, `copies` times over."""
    from minibert.data.corpus import default_corpus_documents
    text = "".join(d + "\n" for d in default_corpus_documents())
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.write(text)
    return path


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_seconds(fn):
    """(CPU seconds of this process, of its finished child processes) during fn(): where the work went."""
    before = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    fn()
    after = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)]


def hf_seconds(corpus, threads, repeats):
    """HF encode_batch on `threads` threads, in its own process (best of `repeats`)."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="true" if threads > 1 else "false")
    result = subprocess.run([sys.executable, "-c", HF_PEER, corpus, DEFAULT_VOCAB_FILE, str(repeats)],
                            env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def run(workers=(1, 2), repeats=3, corpus=None, copies=20, with_peer=True):
    """Rows of name, value, unit, notes: bench/run.py's shape."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus or write_corpus(os.path.join(tmp, "corpus.txt"), copies)
        n_bytes = os.path.getsize(corpus)
        with open(corpus, encoding="utf-8") as f:
            n_docs = sum(1 for _ in f)
        print(f"corpus: {corpus}: {n_docs} documents, {n_bytes / 1e6:.2f} MB", flush=True)
        with open(os.path.join(tmp, "one.txt"), "w") as f:
            f.write("One short document.\n")

        rows, peer = [], {}
        for n in workers if with_peer else ():
            peer[n] = hf_seconds(corpus, n, repeats)
            rows.append(dict(name=f"HF tokenizers encode_batch, {n} thread{'s' if n > 1 else ''}",
                             value=n_docs / peer[n], unit="docs/s",
                             notes=f"{n_bytes / 1e6 / peer[n]:.2f} MB/s, {peer[workers[0]] / peer[n]:.2f}x "
                                   f"its {workers[0]}-thread speed"))
            print(f"  {rows[-1]['name']}: {rows[-1]['value']:,.0f} docs/s ({rows[-1]['notes']})", flush=True)
        startup = {}
        for n in workers:  # the fixed cost inside each minibert row: tokenizer load, pool start-up
            startup[n] = best_seconds(lambda: preprocess(
                os.path.join(tmp, "one.txt"), os.path.join(tmp, "one"),
                build_tokenizer("BertWordPieceLowerCase"), workers=n, progress=False), repeats)
            how = f"workers {preprocessing._start_method()}ed" if n > 1 else "no workers"
            rows.append(dict(name=f"minibert start-up, {n} worker{'s' if n > 1 else ''}",
                             value=startup[n], unit="s", notes=f"a one-line input: the fixed cost in the "
                             f"rows below; {how}"))
        for split in (False, True):
            seconds = {}
            for n in workers:
                def ours():
                    preprocess(corpus, os.path.join(tmp, "out"), build_tokenizer("BertWordPieceLowerCase"),
                               split_sentences=split, workers=n, progress=False)
                seconds[n] = best_seconds(ours, repeats)
                main_cpu, workers_cpu = cpu_seconds(ours)
                base = workers[0]
                speedup = seconds[base] / seconds[n]
                steady = (seconds[base] - startup[base]) / max(seconds[n] - startup[n], 1e-9)
                rows.append(dict(
                    name=f"minibert preprocess{' --split-sentences' if split else ''}, "
                         f"{n} worker{'s' if n > 1 else ''}",
                    value=n_docs / seconds[n], unit="docs/s",
                    notes=f"{n_bytes / 1e6 / seconds[n]:.2f} MB/s; {speedup:.2f}x its {base}-worker speed "
                          f"({steady:.2f}x without start-up); "
                          + (f"{peer[n] / seconds[n]:.2f}x the peer at {n} thread{'s' if n > 1 else ''}; "
                             if with_peer else "")
                          + f"CPU s: main {main_cpu:.2f}, workers {workers_cpu:.2f}"))
                print(f"  {rows[-1]['name']}: {rows[-1]['value']:,.0f} docs/s ({rows[-1]['notes']})", flush=True)
    return rows


def sequential_rows(workers, corpus=None, copies=20, split_sentences=False):
    """CPU seconds to encode the corpus with its chunks dealt to N fresh encoders, run one after another."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus or write_corpus(os.path.join(tmp, "corpus.txt"), copies)
        chunks = list(preprocessing._chunks(corpus))
        rows = []
        for n in workers:
            encoders = []
            for _ in range(n):
                tokenizer = build_tokenizer("BertWordPieceLowerCase")  # fresh caches, as a worker's
                encoders.append(preprocessing.DocumentEncoder(tokenizer, ("text",), False, split_sentences,
                                                              best_dtype(tokenizer.vocab_size), corpus))
            cpu = [0.0] * n
            for i, chunk in enumerate(chunks):
                start = time.process_time()
                encoders[i % n](chunk)
                cpu[i % n] += time.process_time() - start
            rows.append(dict(name=f"the work of {n} encoder{'s' if n > 1 else ''}, one after another"
                                  f"{', --split-sentences' if split_sentences else ''}",
                             value=sum(cpu), unit="CPU s",
                             notes=f"{len(chunks)} chunks round-robin; per encoder {min(cpu):.2f}-{max(cpu):.2f} s"))
            print(f"  {rows[-1]['name']}: {sum(cpu):.2f} CPU s ({rows[-1]['notes']})", flush=True)
    return rows


def _encode_alone(chunks, split_sentences, corpus, ready, go, results):
    """One side-by-side process: wait for the start signal, encode `chunks`, report its CPU seconds."""
    tokenizer = build_tokenizer("BertWordPieceLowerCase")
    encoder = preprocessing.DocumentEncoder(tokenizer, ("text",), False, split_sentences,
                                            best_dtype(tokenizer.vocab_size), corpus)
    ready.release()
    go.wait()
    start_cpu, start = time.process_time(), time.perf_counter()
    for chunk in chunks:
        encoder(chunk)
    results.put((time.process_time() - start_cpu, time.perf_counter() - start))


def side_by_side_rows(workers, corpus=None, copies=20, split_sentences=False, megabytes=8.0):
    """CPU seconds per process when N processes do the same encoding at once, against one alone."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus or write_corpus(os.path.join(tmp, "corpus.txt"), copies)
        chunks, size = [], 0
        for chunk in preprocessing._chunks(corpus):
            if size >= megabytes * 1e6:
                break
            chunks.append(chunk)
            size += len(chunk[2])
        rows, alone = [], None
        for n in workers:
            ready, go, results = context.Semaphore(0), context.Event(), context.Queue()
            procs = [context.Process(target=_encode_alone, args=(chunks, split_sentences, corpus, ready, go,
                                                                  results)) for _ in range(n)]
            for proc in procs:
                proc.start()
            for _ in procs:
                ready.acquire()  # every process loaded and waiting: the timed work starts together
            go.set()
            measured = [results.get(timeout=600) for _ in procs]
            for proc in procs:
                proc.join()
            cpu = sum(c for c, _ in measured) / n
            wall = max(w for _, w in measured)
            alone = alone or cpu
            rows.append(dict(name=f"{n} process{'es' if n > 1 else ''} side by side, each encoding the same "
                                  f"{size / 1e6:.1f} MB{', --split-sentences' if split_sentences else ''}",
                             value=cpu, unit="CPU s",
                             notes=f"per process, mean; {cpu / alone:.2f}x one alone; wall {wall:.2f} s; "
                                   f"the machine allows {n * alone / cpu:.2f}x at {n}"))
            print(f"  {rows[-1]['name']}: {cpu:.2f} CPU s ({rows[-1]['notes']})", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time "
                        "(the first is the base of the speed-ups)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--copies", type=int, default=20, help="the default corpus, this many times over")
    parser.add_argument("--corpus", default=None, help="a plain-text file, one document a line "
                        "(instead of the copied default corpus)")
    parser.add_argument("--sequential", action="store_true", help="instead: the CPU seconds of N fresh "
                        "encoders run one after another (what the word caches cost, without contention)")
    parser.add_argument("--no-peer", action="store_true", help="leave HF tokenizers out (it takes the longest "
                        "at 1 thread): minibert's own scaling only")
    parser.add_argument("--side-by-side", action="store_true", help="instead: N processes doing the same "
                        "encoding at once, against one alone (what running side by side costs on this machine)")
    parser.add_argument("--side-mb", type=float, default=8.0, help="with --side-by-side: megabytes each "
                        "process encodes")
    parser.add_argument("--spawn", action="store_true", help="spawn the workers even where they would be "
                        "forked (each imports numpy and minibert again): the other arm of that comparison")
    args = parser.parse_args()
    if args.spawn:
        preprocessing._start_method = lambda: "spawn"
    if args.side_by_side:
        rows = [r for split in (False, True)
                for r in side_by_side_rows(args.workers, args.corpus, args.copies, split, args.side_mb)]
    elif args.sequential:
        rows = [r for split in (False, True) for r in sequential_rows(args.workers, args.corpus, args.copies, split)]
    else:
        rows = run(args.workers, args.repeats, args.corpus, args.copies, with_peer=not args.no_peer)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}; command: python bench/preprocess_speed.py "
          f"{' '.join(sys.argv[1:])}".rstrip())
    print("| measurement | value | notes |\n|---|---|---|")
    for row in rows:
        value = f"{row['value']:,.0f}" if row["unit"] == "docs/s" else f"{row['value']:.2f}"  # s, CPU s
        print(f"| {row['name']} | {value} {row['unit']} | {row['notes']} |")


if __name__ == "__main__":
    main()
