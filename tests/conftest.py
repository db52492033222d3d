"""Test setup: everything runs on CPU. Triton kernels run in the interpreter (set before any kernel
module is imported), the repo root is importable, and each process uses one thread (2-core CI)."""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

torch.set_num_threads(1)

import subprocess  # noqa: E402


def run_without_interpreter(code):
    """Run `code` in a fresh Python without TRITON_INTERPRET (triton.jit reads it when a kernel module is
    imported, so this process's kernels are interpreted for good), one thread, the repo importable ->
    the CompletedProcess. For the errors kernels raise when they cannot run on a CPU tensor."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", "import torch; torch.set_num_threads(1)\n" + code], env=env,
                          capture_output=True, text=True, timeout=300)

import collections  # noqa: E402

import pytest  # noqa: E402

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """Built once per session: 400 documents of the default corpus; a 1.5k-token vocab made of their most
    frequent WordPieces (a cheap LM head for a 2-core machine); the corpus preprocessed with it (sentences),
    and a few documents with the full BERT vocab."""
    from minibert.corpus import default_corpus_documents
    from minibert.preprocess import preprocess
    from minibert.tokenizer import BertWordPieceTokenizer
    d = tmp_path_factory.mktemp("tiny_data")
    docs = default_corpus_documents()[:400]
    corpus = d / "corpus.txt"
    corpus.write_text("".join(doc + "\n" for doc in docs))
    full = BertWordPieceTokenizer()
    counts = collections.Counter(i for doc in docs for i in full.tokenize(doc))
    frequent = [full.inv_vocab[i] for i, _ in counts.most_common() if full.inv_vocab[i] not in SPECIAL]
    vocab = d / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in SPECIAL + frequent[:1500]))
    prefix = preprocess(str(corpus), str(d / "corpus"), BertWordPieceTokenizer(str(vocab)),
                        split_sentences=True, progress=False)[0]
    few = d / "few.txt"
    few.write_text("".join(doc + "\n" for doc in docs[:60]))
    full_prefix = preprocess(str(few), str(d / "full"), full, split_sentences=True, progress=False)[0]
    return {"dir": d, "prefix": prefix, "vocab": str(vocab), "full_prefix": full_prefix, "docs": docs}


# The layout tests (data, tensor, pipeline parallel) all compare against one single-process run of this
# configuration: 4 layers (so 4 pipeline stages fit), fp32, dropout off, 8 iterations with gradient
# accumulation (global batch 16 = micro 2 x 8 micro-batches in one process).
def layout_args(data, tensorboard_dir, *extra):
    args = ["--num-layers", 4, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
            "--micro-batch-size", 2, "--global-batch-size", 16, "--train-iters", 8, "--lr", 3e-3,
            "--lr-warmup-iters", 2, "--data-path", data["prefix"], "--vocab-file", data["vocab"], "--split", "90,5,5",
            "--log-interval", 1, "--eval-interval", 4, "--eval-iters", 1, "--hidden-dropout", 0,
            "--attention-dropout", 0, "--distributed-timeout-minutes", 1, "--tensorboard-dir", tensorboard_dir]
    return [str(a) for a in args + list(extra)]


@pytest.fixture(scope="session")
def layout_reference(tiny_data, tmp_path_factory):
    """The single-process run every parallel layout must reproduce: its stdout and TensorBoard scalars."""
    from tests import launch
    tb = tmp_path_factory.mktemp("reference") / "tb"
    result = launch.run(1, layout_args(tiny_data, tb))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"stdout": result.stdout, "scalars": launch.tensorboard_scalars(tb)}
