"""Sample-index build time at corpus scale: minibert's build_sample_index (the numpy walk) next to
megatron-core's C++ build_mapping (helpers.cpp), on the same documents, in the same run.

    python bench/sample_index_speed.py [--sentences 20000000] [--seq-length 128 512] [--repeats 3]
                                       [--data-path PREFIX] [--plain]

The corpus (default): a fixed-seed synthetic one shaped like Wikipedia, the sentence lengths and document
boundaries only (no text is needed to build an index): documents of a geometric number of sentences
(mean 30; 1% empty), sentence lengths log-normal (median 20 tokens, mean ~24, clipped to 1..2000, so a
few documents hold a sentence over 512 tokens and are skipped). --data-path takes a real .bin/.idx prefix
instead. Each build asks for 1 sample (one epoch: all of the corpus's rows), short_seq_prob 0.1, seed
1234, the binary head (2 sentences a row), as Megatron's BERT pretraining does.

Timed, best of --repeats, the two contenders alternating: wall time and this process's CPU time (the
CPU time is steadier when other programs share the machine). Every build's rows are checked equal to
Megatron's.
--plain also times minibert's readable twin (plain_sample_index), once: tens of seconds at 20M.
--stages times each step of minibert's numpy walk (CPU, best of --repeats; the synthetic corpus's layout).
"""
import argparse
import os
import platform
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from minibert.data.sample_index import build_sample_index, plain_sample_index  # noqa: E402


def megatron_build_mapping():
    """megatron-core's compiled helper; its wheel ships it built (else: megatron.core.datasets.utils.
    compile_helpers() builds it with the C++ compiler, as Megatron does at start-up)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Apex / Transformer Engine are missing
        try:
            from megatron.core.datasets import helpers_cpp
        except ImportError:
            from megatron.core.datasets.utils import compile_helpers
            compile_helpers()
            from megatron.core.datasets import helpers_cpp
    return helpers_cpp.build_mapping


def synthetic_corpus(num_sentences, seed=0):
    """(document_indices int64 [D + 1], sentence lengths int32 [S]): see the module docstring."""
    rng = np.random.default_rng(seed)
    counts = rng.geometric(1 / 30, size=num_sentences // 15)
    counts[rng.random(len(counts)) < 0.01] = 0
    total = np.cumsum(counts)
    keep = int(np.searchsorted(total, num_sentences)) + 1
    counts = counts[:keep]
    counts[-1] -= int(total[keep - 1]) - num_sentences  # exactly num_sentences in all
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    sizes = np.clip(rng.lognormal(3.0, 0.6, size=num_sentences), 1, 2000).astype(np.int32)
    return bounds, sizes


def timed(fn, clock):
    start = clock()
    result = fn()
    return clock() - start, result


def stages(bounds, sizes, seq_length, short_seq_prob, seed, min_sentences, repeats):
    """CPU seconds of each step of build_sample_index (best of `repeats`): where the time goes."""
    from minibert.data import sample_walk
    from minibert.data.fisher_yates import shuffled_order, swap_targets
    from minibert.data.sample_index import short_seq_ratio
    max_seq = seq_length - 3
    cum = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=cum[1:], dtype=np.int32)
    first, last = bounds[:-1], bounds[1:]
    usable = (last - first >= min_sentences) & (  # (no long-sentence documents in the synthetic corpus)
        np.add.reduceat(np.concatenate([sizes > 512, [False]]), first) == 0)
    first, last = first[usable], last[usable]
    epochs = sample_walk.Epochs(cum, first, last, max_seq, min_sentences, seed, short_seq_ratio(short_seq_prob))

    def detours():
        epochs.draws = sample_walk.short_draws(seed, short_seq_ratio(short_seq_prob), max_seq)
        epochs.pending, epochs.shift = next(epochs.draws), 0
        return epochs._detours()

    replaced, rows = detours()
    targets = np.full(len(epochs.starts), max_seq, dtype=np.int64)
    columns = sample_walk.assemble((epochs.starts, epochs.ends, targets), replaced, rows)
    draws = swap_targets(len(columns[0]), seed)
    order = shuffled_order(draws)
    steps = [("canonical rows (lockstep)", lambda: sample_walk.canonical_rows(cum, first, last, max_seq,
                                                                            min_sentences)),
             (f"detours (Python, {len(replaced):,} of them)", detours),
             ("assembly", lambda: sample_walk.assemble((epochs.starts, epochs.ends, targets), replaced, rows)),
             ("mt19937_64 draws", lambda: swap_targets(len(columns[0]), seed)),
             ("Fisher-Yates order", lambda: shuffled_order(draws)),
             ("gather the shuffled rows", lambda: [column[order] for column in columns])]
    out = []
    for name, fn in steps:
        out.append((name, min(timed(fn, time.process_time)[0] for _ in range(repeats))))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=20_000_000, help="synthetic corpus size")
    parser.add_argument("--data-path", default=None, help="a .bin/.idx prefix instead of the synthetic corpus")
    parser.add_argument("--seq-length", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many builds each")
    parser.add_argument("--plain", action="store_true", help="also time plain_sample_index (slow)")
    parser.add_argument("--stages", action="store_true", help="also time each step of minibert's build")
    args = parser.parse_args()

    if args.data_path:
        from minibert.data.indexed_dataset import IndexedDataset
        data = IndexedDataset(args.data_path)
        bounds, sizes, what = data.document_indices, data.sequence_lengths, args.data_path
    else:
        bounds, sizes = synthetic_corpus(args.sentences)
        what = "synthetic (geometric documents, mean 30 sentences; log-normal sentences)"
    print(f"corpus: {what}: {len(bounds) - 1:,} documents, {len(sizes):,} sentences, "
          f"{int(sizes.sum(dtype=np.int64)):,} tokens", flush=True)
    build_mapping = megatron_build_mapping()
    seed, min_sentences = 1234, 2
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, numpy {np.__version__}; {time.strftime('%Y-%m-%d')}; command: "
          f"python bench/sample_index_speed.py {' '.join(sys.argv[1:])}".rstrip())
    print("| seq length | rows | Megatron C++ wall / CPU (s) | minibert numpy wall / CPU (s) | ratio wall / CPU |")
    print("|---|---|---|---|---|")
    for seq_length in args.seq_length:
        def ours():
            return build_sample_index(bounds, sizes, num_samples=1, seq_length=seq_length,
                                      short_seq_prob=args.short_seq_prob, seed=seed, min_sentences=min_sentences)

        def theirs():  # (documents, sizes, epochs, num_samples, max_seq, short_seq_prob, seed, verbose, min)
            return build_mapping(bounds, sizes, 2**31 - 2, 1, seq_length - 3, args.short_seq_prob, seed,
                                 False, min_sentences)

        contenders = (("theirs", theirs), ("numpy", ours))
        best = {name: [float("inf")] * 2 for name, _ in contenders}
        for _ in range(args.repeats):
            for name, fn in contenders:
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                rows = fn()
                wall, cpu = time.perf_counter() - wall_start, time.process_time() - cpu_start
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
                if name == "theirs":
                    reference = rows
                elif not np.array_equal(rows, reference):
                    sys.exit(f"seq {seq_length}: minibert's rows ({name}) differ from Megatron's: run "
                             "tests/test_sample_index.py")
        (tw, tc), (nw, nc) = best["theirs"], best["numpy"]
        print(f"| {seq_length} | {len(reference):,} | {tw:.3f} / {tc:.3f} | {nw:.3f} / {nc:.3f} | "
              f"{nw / tw:.1f}x / {nc / tc:.1f}x |", flush=True)
        if args.plain:
            seconds, rows = timed(lambda: plain_sample_index(
                bounds, sizes, num_samples=1, seq_length=seq_length, short_seq_prob=args.short_seq_prob,
                seed=seed, min_sentences=min_sentences), time.perf_counter)
            assert np.array_equal(rows, reference)
            print(f"|   plain_sample_index | | | {seconds:.2f} (wall, once) | {seconds / tw:.0f}x |", flush=True)
        if args.stages:
            for name, seconds in stages(bounds, sizes, seq_length, args.short_seq_prob, seed, min_sentences,
                                        args.repeats):
                print(f"|   {name} (numpy walk) | | | {seconds:.3f} (CPU) | |", flush=True)


if __name__ == "__main__":
    main()
