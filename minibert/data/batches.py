"""The trainer's data: datasets from the flags, Megatron's sampler, micro-batches on the device.

    .bin/.idx --(masked_lm: Megatron's samples)--> dataset rows --(MicroBatchSampler)--> this rank's rows
              --(DataLoader: workers make samples)--> CPU batch --(next_micro_batch)--> device tensors

Every process builds the same datasets (a sample is a pure function of its row: masked_lm.py), and the
sampler hands data-parallel rank r its own rows of each global batch, so DP = N consumes exactly the rows
DP = 1 does. The sample index is cached on disk: on each node the local rank 0 builds it while the other
ranks wait at a barrier, then they read the cached file.

What shapes the stream of samples (the data, seed, sequence length, split, masking, vocab, binary head)
is stored in every checkpoint: a resume with other values would silently point consumed_samples into
another index, so it stops instead (resume.check_data_stream).

This is the data side: it knows nothing of the model or the loop. What the model decides about a batch
(whether its attention reads packed rows) comes in as an argument; what the log makes of it (model FLOPs)
is computed by the trainer from the counts the batch carries (train.get_batch)."""
import hashlib
import os

import numpy as np
import torch

from minibert.data.blended_dataset import parse_data_path
from minibert.data.masked_lm import (
    build_blended_train_valid_test_datasets,
    open_data_prefix,
)
from minibert.data.packing import (
    fill_rows,
    make_packing,
    packing_threshold,
    to_device,
    trimmed_length,
    worth_packing,
)
from minibert.data.sample_index import split_num_samples
from minibert.data.tokenizer import DEFAULT_VOCAB_FILE, build_tokenizer
from minibert.errors import UsageError

BATCH_KEYS = ("text", "types", "labels", "padding_mask", "loss_mask", "is_random")


def check_token_ids(prefix, tokenizer, vocab_file):
    """Tokens must be ids of this vocab (a corpus made with another vocab fails here, once, clearly)."""
    data = open_data_prefix(prefix)  # a missing prefix: the error suggests _text_sentence if it exists
    tokens = np.memmap(data.bin_path, dtype=data.dtype, mode="r") if os.path.getsize(data.bin_path) else []
    chunk = 1 << 26  # scan 64M tokens at a time: bounded memory on a large corpus
    largest = max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
    if largest >= tokenizer.vocab_size:
        raise UsageError(f"{data.bin_path} holds token id {largest} but the vocab has {tokenizer.vocab_size} "
                         f"tokens ({vocab_file or 'the bundled bert-base-uncased'}): pass the --vocab-file "
                         "the data was preprocessed with")


def cache_dir_for(cfg, state):
    """--data-cache-path, or (several processes) a cache/ directory beside the first data prefix."""
    if cfg.data_cache_path:
        return cfg.data_cache_path
    if state.world_size > 1:
        return os.path.join(os.path.dirname(os.path.abspath(parse_data_path(cfg.data_path)[0][0])), "cache")
    return None  # one process: building the index costs what reading it would


def build_datasets(cfg, state=None, log=print):
    """-> tokenizer, (train, valid, test) datasets (None for a split of weight 0). state None: one process."""
    from minibert.parallel.state import ParallelState
    state = state or ParallelState()
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)
    if tokenizer.pad == 1:
        raise UsageError(f"[PAD] is id 1 in {cfg.vocab_file}: Megatron's samples mark padding with the pad id "
                         "and real tokens with 1, so padding could not be told apart; use a vocab whose [PAD] "
                         "is another id (BERT's is 0)")
    log("building train/valid/test datasets ...")
    prefixes, _ = parse_data_path(cfg.data_path)
    for prefix in prefixes:
        check_token_ids(prefix, tokenizer, cfg.vocab_file)
    num_samples = split_num_samples(cfg.train_iters, cfg.eval_interval, cfg.eval_iters, cfg.global_batch_size)
    cache_dir = cache_dir_for(cfg, state)

    def build():
        return build_blended_train_valid_test_datasets(
            cfg.data_path, tokenizer, split=cfg.split, num_samples=num_samples, seq_length=cfg.seq_length,
            seed=cfg.seed, binary_head=cfg.binary_head, masked_lm_prob=cfg.mask_prob,
            short_seq_prob=cfg.short_seq_prob, cache_dir=cache_dir)

    if cache_dir is not None and state.local_rank == 0:
        datasets = build()  # writes the cached indexes (atomically)
        state.barrier()
    elif cache_dir is not None:
        state.barrier()  # wait for this node's local rank 0, then read its files
        datasets = build()
    else:
        datasets = build()
    for name, wanted, ds in zip(("train", "validation", "test"), num_samples, datasets):
        log(f"    {name + ':':12s} {len(ds) if ds is not None else 0:10d} samples "
            f"(asked for {wanted if ds is not None else 0})")
    return tokenizer, datasets


class MicroBatchSampler:
    """Megatron's pretraining sampler: rows in order from `consumed` on (the shuffle is in the sample
    index), in chunks of m x DP; data-parallel rank r takes rows [r*m, (r+1)*m) of each chunk.

        chunk:  | rank 0: m rows | rank 1: m rows | ... | rank DP-1: m rows |   then the next chunk"""

    def __init__(self, total_samples, consumed_samples, micro_batch_size, dp_rank=0, dp_size=1):
        self.total, self.consumed = total_samples, consumed_samples
        self.m, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self):
        return max(0, (self.total - self.consumed) // (self.m * self.dp_size))

    def __iter__(self):
        chunk = self.m * self.dp_size
        for start in range(self.consumed, self.total - chunk + 1, chunk):  # only whole chunks
            first = start + self.dp_rank * self.m
            yield list(range(first, first + self.m))


def build_data_iterator(dataset, consumed_samples, cfg, device, state=None):
    """An iterator of this rank's micro-batches (dicts of CPU tensors), or None without that split."""
    if dataset is None:
        return None
    dp_rank, dp_size = (state.dp_rank, state.dp) if state is not None else (0, 1)
    sampler = MicroBatchSampler(len(dataset), consumed_samples, cfg.micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.num_workers or 0,
                                         collate_fn=stack_samples)
    pin = device.type == "cuda"  # page-locked host memory: the copies to the GPU can then run asynchronously
    return ({key: torch.from_numpy(rows).pin_memory() if pin else torch.from_numpy(rows)
             for key, rows in arrays.items()} for arrays in loader)


class PrefetchingBatches:
    """The training iterator one step ahead. train_step takes a step's device micro-batches (take), queues
    that step's forward and backward, then calls prefetch, which builds the next step's (get_batch's CPU
    work and the copies to the GPU) while the GPU still runs this one. Without it that host work would
    sit between the optimizer's host sync and the next step's first kernel, the GPU idle all along
    (bench/step_timeline.py times it: bench/results/step_timeline_h200_2026-12-03.md, bench/notes/training.md). The batches
    and their order are the same; running out of samples is reported by the step that needed them, not by
    the prefetch."""

    def __init__(self, iterator):
        self.iterator, self.ready = iterator, None

    def __next__(self):  # one CPU micro-batch, as the plain iterator gives it
        return next(self.iterator)

    def prefetch(self, fetch):
        """fetch() -> the next step's batches (from this iterator); kept, or its UsageError, for take."""
        try:
            self.ready = fetch()
        except UsageError as e:  # out of samples: the next step, if there is one, reports it
            self.ready = e

    def take(self, fetch):
        """The prefetched batches, or fetch() when none are ready."""
        ready, self.ready = self.ready, None
        if isinstance(ready, UsageError):
            raise ready
        return ready if ready is not None else fetch()


def stack_samples(samples):
    """A micro-batch as numpy arrays, {key: [b, ...]}, made in a DataLoader worker. Numpy arrays travel to
    the main process pickled through the worker's pipe; torch tensors (the DataLoader's default) would each
    travel through a shared-memory file, and at train-small's size that costs more than making the samples
    (chapter 8, section 6)."""
    return {key: np.stack([sample[key] for sample in samples]) for key in samples[0]}


def next_micro_batch(data_iterator, device, cfg, varlen):
    """The next micro-batch as device tensors, plus `is_pad` (bool [b, s], True = padding), what the log
    counts, on the host: `lengths` (CPU int64 [b], real tokens per sample), `tokens` (their sum) and `masked`
    (the masked positions; Python ints), and the indices the model and loss need, computed here on the CPU:
    `packing` (cfg.pack_tokens: the real tokens' positions, minibert.data.packing; the batch is then trimmed to
    its longest sample and packed when worth it, packing_threshold(varlen), varlen = the model's attention
    reads packed rows; with --cuda-graph-impl local it is not trimmed, every micro-batch is packed and its
    rows are rounded up to a multiple of s with filler rows, so that a few graphs serve every batch),
    `lm_rows` (--sparse-mlm: the rows of the model's flattened hidden states the LM head computes; with
    graphs followed by fillers up to a multiple of s, packing.fill_rows) and `loss_positions` (the flat
    positions b * s + j the LM logits' rows belong to; None: all of [b, s]). Megatron's padding_mask is 1
    at real tokens and the vocab's [PAD] id at padding (0 with BERT's vocab), so padding is where it is
    not 1 (build_datasets refuses a vocab whose [PAD] is 1)."""
    try:
        cpu_batch = next(data_iterator)
    except StopIteration:
        raise UsageError("a data split ran out of samples: keep --train-iters/--eval-iters/--eval-interval "
                         "as in the run being resumed, or start without --load") from None
    is_pad = cpu_batch["padding_mask"] != 1
    is_pad[:, 0] = False  # the [CLS] position is always attended and pooled: a sample is never all padding
    lengths = (~is_pad).sum(dim=1)  # [b] real tokens per sample
    masked = int(cpu_batch["loss_mask"].sum())
    packing = lm_rows = loss_positions = None
    graphed = cfg.cuda_graph_impl == "local"  # a CUDA graph per shape: keep s, round the rows up
    if cfg.pack_tokens:
        s = is_pad.shape[1] if graphed else trimmed_length(is_pad)
        cpu_batch = {k: v[:, :s] if v.dim() == 2 else v for k, v in cpu_batch.items()}
        is_pad = is_pad[:, :s]
        if graphed or worth_packing(is_pad, packing_threshold(varlen)):
            packing = make_packing(is_pad, bucket=s if graphed else None)
            loss_positions = packing.index  # one LM row per packed row
    if cfg.sparse_mlm:
        loss_mask = cpu_batch["loss_mask"].reshape(-1)
        loss_positions = loss_mask.nonzero().squeeze(1)  # the masked positions
        if graphed:  # a fixed number of LM rows per graph: fillers that the loss ignores, as the packing's
            rows = packing.index if packing is not None else torch.arange(loss_mask.numel())
            loss_positions = fill_rows(loss_positions, rows[loss_mask[rows] == 0], is_pad.shape[1], len(rows))
        lm_rows = loss_positions
        if packing is not None:  # flat position -> packed row
            row_of = torch.full((is_pad.numel(),), -1, dtype=torch.int64)
            row_of[packing.index] = torch.arange(len(packing.index))
            lm_rows = row_of[loss_positions]
    batch = {k: cpu_batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}
    batch["is_pad"] = is_pad.to(device, non_blocking=True)
    batch["packing"] = to_device(packing, device) if packing is not None else None
    batch["lm_rows"] = lm_rows.to(device, non_blocking=True) if lm_rows is not None else None
    if packing is not None and loss_positions is packing.index:
        loss_positions = batch["packing"].index  # the same rows: copied once
    elif loss_positions is not None:
        loss_positions = loss_positions.to(device, non_blocking=True)
    batch["loss_positions"] = loss_positions
    batch["lengths"], batch["tokens"], batch["masked"] = lengths, int(lengths.sum()), masked
    return batch


# ---- what shapes the sample stream (stored in checkpoints, compared on resume) ----
STREAM_FLAGS = ("data_path", "seed", "seq_length", "split", "mask_prob", "short_seq_prob", "vocab_file",
                "tokenizer_type", "bert_no_binary_head")
NUM_SAMPLES_FLAGS = ("train_iters", "eval_interval", "eval_iters", "global_batch_size")


def file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def data_stream(cfg) -> dict:
    """What the rows consumed_samples counts depend on: each flag's value, and for the data and the vocab
    their content (a fingerprint: the .idx's digest and the .bin's size; the vocab file's digest), so a
    moved file is fine and a rewritten one is not."""
    values = {name: getattr(cfg, name) for name in STREAM_FLAGS}
    prefixes, weights = parse_data_path(cfg.data_path)
    values["data_path"] = [f"{w}:{file_digest(p + '.idx')}:{os.path.getsize(p + '.bin')}"
                           for w, p in zip(weights or [None], prefixes)]
    values["vocab_file"] = file_digest(cfg.vocab_file or DEFAULT_VOCAB_FILE)
    values["num_samples"] = {name: getattr(cfg, name) for name in NUM_SAMPLES_FLAGS}
    return values
