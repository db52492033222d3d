"""The trainer: Megatron's BERT pretraining loop, in plain sight.

    for iteration in range(start, train_iters):
        zero the gradients
        for each of G / (m x DP) micro-batches:            gradient accumulation (G global, m micro batch)
            loss = (lm + sop) / number of micro-batches     (fp16: x loss scale)
            loss.backward()                                 grads sum up over the micro-batches
        optimizer.step()        fp16: unscale, skip on inf/NaN; grad norm, clip, AdamW on fp32 masters
        scheduler.step(G)       only when the update happened (a skipped step keeps its LR)
        log every --log-interval, evaluate every --eval-interval, save every --save-interval

`python minibert/train.py --help` lists the flags (Megatron's names and defaults, minibert/config.py).
The notebook imports the pieces: build_model_and_optimizer, get_batch, train_step, evaluate, train.
What gets printed and written to TensorBoard (and the FLOP count behind MFU) is in training_log.py.

Performance: the loop never waits for the GPU except at a log line (losses and the grad norm stay on
the device until then) and, with --fp16, once per step to learn whether the gradients overflowed.
Batches come from pinned memory and are copied without blocking."""
import os
import random
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from minibert import checkpoint
from minibert.config import parse_args, validate
from minibert.errors import UsageError, exit_on_usage_error
from minibert.masked_lm import build_train_valid_test_datasets, open_data_prefix, split_num_samples
from minibert.model import BertModel, pretraining_loss
from minibert.optim import build_optimizer, build_scheduler
from minibert.tokenizer import build_tokenizer
from minibert.training_log import IntervalStats, TrainingLogger, batch_flops

BATCH_KEYS = ("text", "types", "labels", "padding_mask", "loss_mask", "is_random")


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- setup
def setup(cfg, device=None) -> torch.device:
    """Validate the flags for this machine and pick the device (a GPU if there is one)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world_size > 1:
        raise UsageError(f"data parallelism is not supported yet: run one process (torchrun started "
                         f"{world_size}; use --nproc_per_node 1)")
    validate(cfg, world_size)
    if cfg.data_path is None:
        raise UsageError("--data-path is required: the prefix written by minibert/preprocess.py, "
                         "e.g. corpus_text_sentence")
    if device is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (10-bit mantissa)
        torch.backends.cudnn.allow_tf32 = True
    else:
        if cfg.fp16:
            warn("--fp16 needs a GPU; running in fp32 on the CPU")
            cfg.fp16 = False
        if cfg.distributed_backend == "nccl":
            warn("--distributed-backend nccl needs GPUs; using gloo on the CPU")
            cfg.distributed_backend = "gloo"
        if cfg.num_workers:
            # measured on 2 cores: 1.3 s per train-small iteration with samples built in this process,
            # 4-10 s with 2 worker processes competing with training for the cores
            warn(f"--num-workers {cfg.num_workers} -> 0 on the CPU: worker processes would compete with "
                 "training for the cores")
            cfg.num_workers = 0
    return device


def set_random_seed(seed: int):
    """One seed for python, numpy and torch (CPU and CUDA): init and dropout follow from it."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- data
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


def build_datasets(cfg):
    """-> tokenizer, (train, valid, test) datasets (None for a split of weight 0); sets cfg.vocab_size."""
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)
    cfg.vocab_size = tokenizer.vocab_size
    print("building train/valid/test datasets ...", flush=True)
    check_token_ids(cfg.data_path[0], tokenizer, cfg.vocab_file)
    num_samples = split_num_samples(cfg.train_iters, cfg.eval_interval, cfg.eval_iters, cfg.global_batch_size)
    datasets = build_train_valid_test_datasets(
        cfg.data_path[0], tokenizer, split=cfg.split, num_samples=num_samples, seq_length=cfg.seq_length,
        seed=cfg.seed, binary_head=cfg.binary_head, masked_lm_prob=cfg.mask_prob,
        short_seq_prob=cfg.short_seq_prob)
    for name, wanted, ds in zip(("train", "validation", "test"), num_samples, datasets):
        print(f"    {name + ':':12s} {len(ds) if ds is not None else 0:10d} samples "
              f"(asked for {wanted if ds is not None else 0})", flush=True)
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


def build_data_iterator(dataset, consumed_samples, cfg, device):
    """An iterator of micro-batches (dicts of CPU tensors), or None without that split."""
    if dataset is None:
        return None
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=MicroBatchSampler(len(dataset), consumed_samples, cfg.micro_batch_size),
        num_workers=cfg.num_workers, pin_memory=device.type == "cuda")
    return iter(loader)


def get_batch(data_iterator, device):
    """The next micro-batch: (dict of device tensors, the same on the CPU for cheap counting)."""
    try:
        cpu_batch = next(data_iterator)
    except StopIteration:
        raise UsageError("a data split ran out of samples: keep --train-iters/--eval-iters/--eval-interval "
                         "as in the run being resumed, or start without --load") from None
    return {k: cpu_batch[k].to(device, non_blocking=True) for k in BATCH_KEYS}, cpu_batch


# ---------------------------------------------------------------- model and one step
def build_model_and_optimizer(cfg, device):
    """The model (built on the CPU so the init is the same on every device, then moved and cast to
    --fp16/--bf16), AdamW with fp32 masters, and the LR scheduler."""
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32
    model = BertModel(cfg).to(device=device, dtype=dtype)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    return model, optimizer, scheduler


def forward_step(model, batch, cfg):
    """One micro-batch -> (loss, lm loss, sop loss or None), fp32 scalars on the device."""
    lm_mask = batch["loss_mask"].bool() if cfg.sparse_mlm else None
    output = model(batch["text"], batch["types"], padding_mask=batch["padding_mask"] == 0, lm_mask=lm_mask)
    return pretraining_loss(output, batch["labels"], batch["loss_mask"], batch["is_random"],
                            sparse=cfg.sparse_mlm)


@dataclass
class StepResult:
    losses: dict            # name -> 0-d device tensor, mean over the micro-batches
    grad_norm: object       # 0-d device tensor (before clipping), None when skipped
    skipped: bool           # fp16 overflow: no update
    flops: float = 0.0      # model FLOPs of the step (PERF.md), real tokens only
    tokens: int = 0         # real (non-padding) tokens of the step


def train_step(model, optimizer, scheduler, data_iterator, cfg, device) -> StepResult:
    """One optimizer step over a global batch: accumulate micro-batch gradients, then update."""
    num_micro_batches = cfg.global_batch_size // cfg.micro_batch_size  # x DP when DP arrives
    optimizer.zero_grad()
    losses, flops, tokens = {}, 0.0, 0
    for _ in range(num_micro_batches):
        batch, cpu_batch = get_batch(data_iterator, device)
        loss, lm_loss, sop_loss = forward_step(model, batch, cfg)
        optimizer.scale_loss(loss / num_micro_batches).backward()
        for name, value in (("lm loss", lm_loss), ("sop loss", sop_loss)):
            if value is not None:  # summed on the device: no sync
                losses[name] = losses.get(name, 0.0) + value.detach() / num_micro_batches
        step_flops, step_tokens = batch_flops(cpu_batch, cfg)
        flops, tokens = flops + step_flops, tokens + step_tokens
    update_successful, grad_norm = optimizer.step()
    if update_successful:
        scheduler.step(increment=cfg.global_batch_size)
    return StepResult(losses, grad_norm, not update_successful, flops, tokens)


@torch.no_grad()
def evaluate(model, data_iterator, cfg, device, eval_iters) -> dict:
    """Mean losses over eval_iters global batches (dropout off). The iterator is not rewound."""
    model.eval()
    num_micro_batches = cfg.global_batch_size // cfg.micro_batch_size
    totals = {}
    for _ in range(eval_iters * num_micro_batches):
        batch, _ = get_batch(data_iterator, device)
        _, lm_loss, sop_loss = forward_step(model, batch, cfg)
        for name, value in (("lm loss", lm_loss), ("sop loss", sop_loss)):
            if value is not None:
                totals[name] = totals.get(name, 0.0) + value
    model.train()
    return {name: float(total) / (eval_iters * num_micro_batches) for name, total in totals.items()}


# ---------------------------------------------------------------- the loop
@dataclass
class TrainResult:
    model: torch.nn.Module
    optimizer: object
    scheduler: object
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    history: list = field(default_factory=list)  # every log record (dicts), as passed to on_log


def train(cfg, on_log=None, device=None) -> TrainResult:
    """Pretrain BERT as configured by `cfg` (a minibert.config.Config). on_log(record) is called with
    every log record: kind "train" (one per --log-interval), "validation" or "test"."""
    device = setup(cfg, device)
    set_random_seed(cfg.seed)
    _, (train_ds, valid_ds, test_ds) = build_datasets(cfg)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, device)

    iteration = consumed_train = consumed_valid = 0
    saved = cfg.load and checkpoint.load_checkpoint(cfg.load)
    if saved:
        iteration, consumed_train, consumed_valid = checkpoint.restore_training_state(
            saved, cfg, model, optimizer, scheduler)
        print(f"loaded checkpoint {cfg.load} at iteration {iteration}", flush=True)
    train_iterator = build_data_iterator(train_ds, consumed_train, cfg, device)
    valid_iterator = build_data_iterator(valid_ds, consumed_valid, cfg, device)
    if saved:  # last: building the iterators above draws from torch's generator
        checkpoint.set_rng_state(saved["rng_state"][0])
    do_valid = valid_iterator is not None and cfg.eval_iters > 0

    logger = TrainingLogger(cfg, device, on_log)

    def save():
        state = checkpoint.training_state(cfg, iteration, model, optimizer, scheduler,
                                          consumed_train, consumed_valid)
        path = checkpoint.save_checkpoint(cfg.save, iteration, state)
        print(f"saved checkpoint {path}", flush=True)

    def run_evaluation(iterator, split_name):
        losses = evaluate(model, iterator, cfg, device, cfg.eval_iters)
        logger.log_evaluation(iteration, split_name, losses)

    print("starting training", flush=True)
    model.train()
    stats = IntervalStats(device)
    same_dir = bool(saved and cfg.save) and os.path.abspath(cfg.save) == os.path.abspath(cfg.load)
    last_saved = iteration if same_dir else None  # a checkpoint resumed in place is already on disk
    stopped_early = False
    while iteration < cfg.train_iters:
        step = train_step(model, optimizer, scheduler, train_iterator, cfg, device)
        iteration += 1
        consumed_train += cfg.global_batch_size
        stats.add(step)
        if iteration % cfg.log_interval == 0:
            logger.log_train(iteration, consumed_train, optimizer, stats)
        if do_valid and iteration % cfg.eval_interval == 0:
            with stats.paused():  # evaluation time does not count as training time
                run_evaluation(valid_iterator, None)
            consumed_valid += cfg.eval_iters * cfg.global_batch_size
        if cfg.save and cfg.save_interval and iteration % cfg.save_interval == 0:
            with stats.paused():
                save()
            last_saved = iteration
        if cfg.exit_interval and iteration % cfg.exit_interval == 0:
            if cfg.save and last_saved != iteration:
                save()
            print(f"exiting at iteration {iteration} (--exit-interval {cfg.exit_interval})", flush=True)
            stopped_early = True
            break

    if not stopped_early:  # as Megatron: save, then evaluate on the validation and test splits
        if cfg.save and last_saved != iteration and iteration > 0:
            save()
        if do_valid:
            run_evaluation(valid_iterator, "validation set")
            consumed_valid += cfg.eval_iters * cfg.global_batch_size
        if test_ds is not None and cfg.eval_iters > 0:
            run_evaluation(build_data_iterator(test_ds, 0, cfg, device), "test set")
    logger.close()
    return TrainResult(model, optimizer, scheduler, iteration, consumed_train, consumed_valid, logger.history)


@exit_on_usage_error
def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
