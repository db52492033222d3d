"""Tokens per second: minibert's pure-Python WordPiece vs HuggingFace `tokenizers` (Rust), one core.

    python bench/tokenizer_speed.py [--repeats 3]

Both tokenize every document of minibert's default corpus (Python's own docs, ~1.1 MB) with the
bundled bert-base-uncased vocab. Everything is pinned to one CPU core and Rust's thread pool to one
thread, so HF's encode_batch cannot use more cores than we do. Reported, best of --repeats:
  minibert cold   a fresh tokenizer: every distinct chunk is tokenized once, then cached
  minibert warm   the same tokenizer again: all chunks cached (a long preprocessing run's state)
  HF encode       tokenizer.encode(doc) per document
  HF encode_batch tokenizer.encode_batch(all documents)
The ids are checked to be equal before anything is timed.
"""
import os

# Before `tokenizers` is imported: its Rust thread pool reads these once.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tokenizers  # noqa: E402

from minibert.data.corpus import default_corpus_documents  # noqa: E402
from minibert.data.tokenizer import DEFAULT_VOCAB_FILE, BertWordPieceTokenizer  # noqa: E402


def best_seconds(run, repeats):
    """The fastest of `repeats` runs of run() (the others were slowed by something else)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description="minibert vs HF tokenizers speed, one core")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender (best is kept)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core for both contenders

    documents = default_corpus_documents()
    hf = tokenizers.BertWordPieceTokenizer(DEFAULT_VOCAB_FILE, lowercase=True)
    ours = BertWordPieceTokenizer(DEFAULT_VOCAB_FILE, lower_case=True)
    ids = [ours.tokenize(d) for d in documents]
    if ids != [e.ids for e in hf.encode_batch(documents, add_special_tokens=False)]:
        sys.exit("minibert and HF tokenizers disagree on the corpus: run tests/test_tokenizer.py")
    num_tokens = sum(map(len, ids))

    def cold():
        fresh = BertWordPieceTokenizer(DEFAULT_VOCAB_FILE, lower_case=True)
        start = time.perf_counter()
        for d in documents:
            fresh.tokenize(d)
        return time.perf_counter() - start  # vocab loading left out: it is paid once per process

    results = {
        "minibert cold": min(cold() for _ in range(args.repeats)),
        "minibert warm": best_seconds(lambda: [ours.tokenize(d) for d in documents], args.repeats),
        "HF encode": best_seconds(lambda: [hf.encode(d, add_special_tokens=False) for d in documents],
                                  args.repeats),
        "HF encode_batch": best_seconds(lambda: hf.encode_batch(documents, add_special_tokens=False),
                                        args.repeats),
    }
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)) / 1e6:.2f} M chars, "
          f"{num_tokens} tokens; Python {platform.python_version()}, tokenizers {tokenizers.__version__}, "
          f"{platform.processor() or platform.machine()}, 1 core")
    for name, seconds in results.items():
        print(f"{name:16s} {num_tokens / seconds:12,.0f} tokens/s")
    for ours_name in ("minibert cold", "minibert warm"):
        for hf_name in ("HF encode", "HF encode_batch"):
            print(f"{ours_name} / {hf_name}: {results[hf_name] / results[ours_name]:.2f}x")


if __name__ == "__main__":
    main()
