"""Test setup: everything runs on CPU. Triton kernels run in the interpreter (set before any kernel
module is imported), the repo root is importable, and each process uses one thread (2-core CI)."""
import os
import re
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

# Hypothesis keeps its example database and constants cache in ./.hypothesis by default, which is the
# repository: a notebook test running beside a fuzz test would see files appear that it did not make.
import tempfile  # noqa: E402

from hypothesis.configuration import set_hypothesis_home_dir  # noqa: E402

set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "minibert-hypothesis"))

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
    from minibert.data.corpus import default_corpus_documents
    from minibert.data.tokenizer import BertWordPieceTokenizer
    from minibert.preprocess import preprocess
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
    """The single-process run every parallel layout must reproduce: its stdout, TensorBoard scalars and
    checkpoints (saved at iterations 4 and 8: the ground truth of tests/test_reshard.py)."""
    from tests import launch
    folder = tmp_path_factory.mktemp("reference")
    result = launch.run(1, layout_args(tiny_data, folder / "tb", "--save", folder / "ckpt", "--save-interval", 4))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"stdout": result.stdout, "scalars": launch.tensorboard_scalars(folder / "tb"), "save": folder / "ckpt"}


# Triton has wheels for Linux only: elsewhere the CPU path runs without it (minibert imports it only where a
# kernel runs), and the test files that import the kernels are left out, with one line in the summary.
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
NEEDS_TRITON = re.compile(r"^(from minibert\.kernels|import minibert\.kernels|from minibert import kernels|"
                          r"(from|import) minibert\.fast\.(layer_norm|cross_entropy|adamw|fp8_cast)|from minibert\.fast import [\w, ]*\b(layer_norm|cross_entropy|adamw|fp8_cast)|"
                          r"import triton|from triton)\b", re.M)
LEFT_OUT = []


def pytest_ignore_collect(collection_path, config):
    if HAS_TRITON or not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    if NEEDS_TRITON.search(collection_path.read_text(encoding="utf-8")):
        LEFT_OUT.append(collection_path.name)
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    """Print what tests recorded with record_property("report", text), e.g. each chapter's time (also when
    the tests ran in pytest-xdist workers, which send their properties back with the reports)."""
    if LEFT_OUT:
        terminalreporter.write_line(f"left out {len(LEFT_OUT)} test files of the Triton kernels: Triton is not "
                                    f"installed (it has wheels for Linux only): {', '.join(sorted(set(LEFT_OUT)))}")
    lines = [value for reports in terminalreporter.stats.values() for report in reports
             if getattr(report, "when", None) == "call"
             for key, value in getattr(report, "user_properties", ()) if key == "report"]
    if lines:
        terminalreporter.section("reports")
        for line in lines:
            terminalreporter.write_line(line)


# ---- the order of the suite, and what runs together under pytest-xdist (make test: -n 2, --dist loadgroup)
# A worker takes the next unit of work when it is nearly idle, so the suite ends soonest when the longest
# units come first (a long test started last runs on alone). These files run their tests one by one
# (each an independent launch); every other file is one unit, so its module-scoped fixtures are built once.
SPLIT_FIRST = ["test_chapter_commands.py", "test_faults.py", "test_pipeline_parallel.py", "test_tensor_parallel.py",
               "test_data_parallel.py"]
# then the files that are one unit, the longest first (tests/README.md: keep this list roughly in order)
WHOLE_FIRST = ["test_train_bench.py", "test_reshard.py", "test_train_safety.py", "test_fill_mask.py",
               "test_flash_attention.py", "test_train.py", "test_notebook.py",
               "test_layer_norm_kernel.py", "test_masked_lm.py", "test_flash_varlen.py", "test_recipes.py",
               "test_course_chapter2.py", "test_softmax_kernel.py", "test_cuda_graphs.py", "test_scaling_notebook.py"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(SPLIT_FIRST + WHOLE_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's own order is kept
    for item in items:
        if item.path.name not in SPLIT_FIRST:
            item.add_marker(pytest.mark.xdist_group(item.path.name))
