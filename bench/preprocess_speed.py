"""Preprocess throughput: minibert's preprocess next to HF tokenizers' encode_batch, same text, this CPU.

    python bench/preprocess_speed.py [--workers 1 2] [--repeats 3] [--corpus FILE]

What is timed, best of --repeats, on the default corpus (minibert.corpus, real English, ~1 MB):
  - minibert: the whole `preprocess()` (read, UTF-8/JSON checks, sentence split, WordPiece, write
    .bin/.idx), with and without --split-sentences, at each --workers (pool start-up included), with a
    fresh tokenizer each time (its word cache starts cold, as in a real run);
  - peer: `tokenizers.BertWordPieceTokenizer.encode_batch(lines, add_special_tokens=False)`, the Rust
    WordPiece of HF, on the same lines already in memory: tokenization only, nothing split or written.
    It runs once on one thread (TOKENIZERS_PARALLELISM=false) and once on all cores (its default).
The ratio compares minibert at N workers with the peer at the same parallelism (1 thread vs 1 worker,
all cores vs as many workers as cores). Python WordPiece against Rust: expect the peer ahead."""
import argparse
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokenizers import BertWordPieceTokenizer as HFBertWordPiece  # noqa: E402

from minibert.preprocess import preprocess  # noqa: E402
from minibert.tokenizer import DEFAULT_VOCAB_FILE, build_tokenizer  # noqa: E402


def default_corpus(path):
    """The corpus `make train-small` preprocesses."""
    from minibert.corpus import write_default_corpus
    write_default_corpus(path)
    return path


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run(workers=(1, 2), repeats=3, corpus=None):
    """Rows of name, value (docs/s), unit, notes: bench/run.py's shape."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus or default_corpus(os.path.join(tmp, "corpus.txt"))
        n_bytes = os.path.getsize(corpus)
        with open(corpus, encoding="utf-8") as f:
            lines = f.read().splitlines()
        n_docs = len(lines)
        print(f"corpus: {corpus}: {n_docs} documents, {n_bytes / 1e6:.2f} MB", flush=True)

        def hf_encode(parallel):
            os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
            HFBertWordPiece(DEFAULT_VOCAB_FILE, lowercase=True).encode_batch(lines, add_special_tokens=False)

        peer = {1: n_docs / best_seconds(lambda: hf_encode(False), repeats)}
        peer["all"] = n_docs / best_seconds(lambda: hf_encode(True), repeats)
        cores = os.cpu_count()
        rows = [dict(name="HF tokenizers encode_batch, 1 thread", value=peer[1], unit="docs/s",
                     notes=f"{peer[1] * n_bytes / n_docs / 1e6:.2f} MB/s")]
        rows.append(dict(name=f"HF tokenizers encode_batch, {cores} threads", value=peer["all"],
                         unit="docs/s", notes=f"{peer['all'] * n_bytes / n_docs / 1e6:.2f} MB/s"))
        with open(os.path.join(tmp, "one.txt"), "w") as f:
            f.write("One short document.\n")
        for n in workers:  # the fixed cost inside each minibert row: tokenizer load, pool start-up
            seconds = best_seconds(lambda: preprocess(
                os.path.join(tmp, "one.txt"), os.path.join(tmp, "one"),
                build_tokenizer("BertWordPieceLowerCase"), workers=n, progress=False), repeats)
            rows.append(dict(name=f"minibert start-up, {n} worker{'s' if n > 1 else ''}",
                             value=seconds, unit="s", notes="a one-line input: the fixed cost in the "
                             "rows below"))
        for split in (False, True):
            for n in workers:
                def ours():
                    preprocess(corpus, os.path.join(tmp, "out"), build_tokenizer("BertWordPieceLowerCase"),
                               split_sentences=split, workers=n, progress=False)
                docs_per_s = n_docs / best_seconds(ours, repeats)
                against = peer[1] if n == 1 else peer["all"] if n == cores else None
                ratio = f", {docs_per_s / against:.2f}x the peer at the same parallelism" if against else ""
                rows.append(dict(name=f"minibert preprocess{' --split-sentences' if split else ''}, "
                                      f"{n} worker{'s' if n > 1 else ''}",
                                 value=docs_per_s, unit="docs/s",
                                 notes=f"{docs_per_s * n_bytes / n_docs / 1e6:.2f} MB/s{ratio}"))
                print(f"  {rows[-1]['name']}: {docs_per_s:,.0f} docs/s ({rows[-1]['notes']})", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to time")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--corpus", default=None, help="a plain-text file, one document a line "
                        "(default: minibert.corpus's default corpus)")
    args = parser.parse_args()
    rows = run(args.workers, args.repeats, args.corpus)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; command: python bench/preprocess_speed.py "
          f"{' '.join(sys.argv[1:])}".rstrip())
    print("| measurement | value | notes |\n|---|---|---|")
    for row in rows:
        value = f"{row['value']:,.0f}" if row["unit"] == "docs/s" else f"{row['value']:.2f}"
        print(f"| {row['name']} | {value} {row['unit']} | {row['notes']} |")


if __name__ == "__main__":
    main()
