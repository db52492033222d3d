"""The Megatron course's chapter 2 ("training a BERT model on one GPU"; chapters/00-setup.md), replayed on CPU.

The learner's path, through the command line as the course types it: write the course's synthetic
sample.txt, preprocess it with --split-sentences, then launch the course's training command with
minibert/train.py in place of its script. The command keeps the course's flags verbatim (--fp16 and
--distributed-backend nccl included: on a CPU each falls back with one warning); the test changes only
the paths and makes the run short (COURSE_OVERRIDES). What a learner then meets, in order:

    1. --data-path /tmp/bert_data/bert_sample     exit 2: preprocess wrote bert_sample_text_sentence
    2. --data-path ..._text_sentence              exit 2: one-sentence documents + the binary (SOP) head
                                                  (Megatron's index builder loops forever here)
    3. + --bert-no-binary-head --save DIR         trains: the course's pass criteria (log lines, the loss
                                                  starts at ~ln(vocab) and falls, iter_XXXXXXX/ checkpoints)

chapters/02-single-gpu.md walks through the same steps with the 200-iteration GPU runs."""
import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from minibert.data.indexed_dataset import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = os.path.join(ROOT, "minibert", "vocab", "bert-base-uncased-vocab.txt")

# The course's command, flag for flag as printed (only `python pretrain_bert_single_gpu.py` is replaced).
COURSE_COMMAND = """
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 4 --hidden-size 128
    --num-attention-heads 8 --seq-length 128 --max-position-embeddings 512 --micro-batch-size 4
    --global-batch-size 16 --train-iters 200 --lr 1e-4 --lr-decay-iters 100 --lr-warmup-fraction 0.1
    --min-lr 1e-5 --optimizer adam --data-path /tmp/bert_data/bert_sample
    --tokenizer-type BertWordPieceLowerCase --vocab-file /path/to/bert-base-uncased-vocab.txt
    --split 980,10,10 --distributed-backend nccl --init-method-std 0.02 --attention-dropout 0.1
    --hidden-dropout 0.1 --weight-decay 0.01 --clip-grad 1.0 --log-interval 10 --save-interval 100
    --eval-interval 50 --eval-iters 10 --fp16"""
# A 2-core CPU does ~2 s per iteration of this model (the tied LM head over 30,592 padded vocab columns
# at all 16 x 128 positions dominates): 20 iterations, not 200. The ratios of the course's schedule stay
# (decay over half the run, warmup 10% of the decay); --log-interval 1 so the first logged loss is the
# untrained model's.
COURSE_OVERRIDES = {"--vocab-file": VOCAB, "--train-iters": "20", "--lr-decay-iters": "10",
                    "--log-interval": "1", "--save-interval": "10", "--eval-interval": "10",
                    "--eval-iters": "2"}
FP16_WARNING = "warning: --fp16 needs a GPU; running in fp32 on the CPU"
NCCL_WARNING = "warning: --distributed-backend nccl needs GPUs; using gloo on the CPU"
LM_LOSS = re.compile(r"^iteration +(\d+)/ +\d+ \|.* lm loss: ([-+]?\d\.\d{6}E[-+]\d{2}) \|")


def course_args(data_path, *extra):
    """The course's flags with COURSE_OVERRIDES and --data-path replaced, then `extra` appended."""
    args = shlex.split(COURSE_COMMAND)
    for flag, value in {**COURSE_OVERRIDES, "--data-path": data_path}.items():
        args[args.index(flag) + 1] = value  # each flag appears once in the course's command
    return args + list(extra)


def run(args, cwd):
    """A command as the learner runs it: a fresh process, CPU only, one thread (2-core CI)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("WORLD_SIZE", None)  # not under torchrun
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)


def train(data_path, cwd, *extra):
    return run([os.path.join(ROOT, "minibert", "train.py"), *course_args(data_path, *extra)], cwd)


def stderr_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def error_lines(result):
    """Checks that each CPU fallback warned exactly once and nothing crashed (no traceback, no argparse
    usage block); returns the `error: ...` lines."""
    lines = stderr_lines(result)
    assert lines.count(FP16_WARNING) == 1 and lines.count(NCCL_WARNING) == 1, result.stderr
    assert "Traceback" not in result.stderr and not any(line.startswith("usage:") for line in lines), \
        result.stderr
    return [line for line in lines if line.startswith("error")]


@pytest.fixture(scope="module")
def course_data(tmp_path_factory):
    """Steps 1 and 2 of the course: /tmp/bert_data/sample.txt and its .bin/.idx, in a temporary dir."""
    d = tmp_path_factory.mktemp("bert_data")
    made = run(["-m", "minibert.data.corpus", "--synthetic", "--output", str(d / "sample.txt")], ROOT)
    assert made.returncode == 0, made.stderr
    preprocessed = run([os.path.join(ROOT, "minibert", "preprocess.py"), "--input", str(d / "sample.txt"),
                        "--output-prefix", str(d / "bert_sample"), "--vocab-file", VOCAB,
                        "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences", "--workers", "4"],
                       str(d))
    assert preprocessed.returncode == 0, preprocessed.stderr
    return d


def test_preprocess_writes_text_sentence_with_one_sentence_per_document(course_data):
    """The root of both errors below: the file is named _text_sentence, and the course's lines have no
    sentence punctuation, so every line is a document of exactly one sentence."""
    assert sorted(os.listdir(course_data)) == ["bert_sample_text_sentence.bin", "bert_sample_text_sentence.idx",
                                                "sample.txt"]
    lines = (course_data / "sample.txt").read_text().split("\n")
    sentences = IndexedDataset(str(course_data / "bert_sample_text_sentence"))
    assert len(sentences.document_indices) - 1 == len(lines) == 2000
    assert len(sentences) == len(lines)  # one sentence per document


def test_the_printed_data_path_exits_2_naming_the_written_prefix(course_data):
    result = train(str(course_data / "bert_sample"), str(course_data))
    assert result.returncode == 2, result.stdout + result.stderr
    errors = error_lines(result)
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert f"--data-path {course_data / 'bert_sample_text_sentence'}" in errors[0]
    assert "starting training" not in result.stdout


def test_one_sentence_documents_with_the_binary_head_exit_2_naming_the_flag(course_data):
    """Megatron's sample index would loop over up to 2^31 empty epochs here; minibert stops at once."""
    result = train(str(course_data / "bert_sample_text_sentence"), str(course_data))
    assert result.returncode == 2, result.stdout + result.stderr
    errors = error_lines(result)
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    assert "--bert-no-binary-head" in errors[0] and "bert_sample_text_sentence" in errors[0]
    assert "starting training" not in result.stdout


def test_without_the_binary_head_it_trains_and_saves(course_data, tmp_path):
    """The course's pass criteria: the two log lines, no error, an lm loss that starts near ln(vocab)
    and falls, iter_XXXXXXX/ directories holding the weights."""
    save = tmp_path / "checkpoints"
    result = train(str(course_data / "bert_sample_text_sentence"), str(tmp_path),
                   "--bert-no-binary-head", "--save", str(save))
    assert result.returncode == 0, result.stdout + result.stderr
    assert error_lines(result) == [], result.stderr
    out = result.stdout.splitlines()
    assert "building train/valid/test datasets ..." in out and "starting training" in out
    assert out.index("building train/valid/test datasets ...") < out.index("starting training")

    losses = [(int(m[1]), float(m[2])) for m in map(LM_LOSS.match, out) if m]
    train_iters = int(COURSE_OVERRIDES["--train-iters"])
    assert [it for it, _ in losses] == list(range(1, train_iters + 1)), result.stdout
    assert "sop loss" not in result.stdout  # no binary head, no SOP loss
    # Before the first update the model knows nothing: cross entropy ~ ln(vocab). The vocab is the
    # file's 30522 lines + Megatron's [BOS]/[EOS] (the padded columns up to 30592 are masked out).
    with open(VOCAB, encoding="utf-8") as f:
        vocab_size = sum(1 for _ in f) + 2
    first, last = losses[0][1], losses[-1][1]
    assert abs(first - math.log(vocab_size)) < 0.5, (first, math.log(vocab_size))
    assert last < first - 0.3, losses  # 20 updates at lr <= 1e-4: ~1 nat lower on this data
    assert re.search(rf"^validation loss at iteration {train_iters} on test set \| lm loss value: ", result.stdout,
                     re.M)

    for iteration in (10, 20):  # --save-interval 10
        assert f"saved checkpoint {save}/iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt" in out
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(train_iters)
    state = torch.load(save / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu",
                       weights_only=True)
    assert state["iteration"] == 10 and state["consumed_train_samples"] == 10 * 16
    assert state["args"]["bert_no_binary_head"] is True and state["args"]["fp16"] is False  # fp32 on CPU
    embeddings = state["model"]["embedding.word_embeddings.weight"]
    assert embeddings.dtype == torch.float32 and embeddings.shape == (30592, 128)  # ceil(30524/128)*128
    assert not any(key.startswith(("pooler.", "binary_head.")) for key in state["model"])
