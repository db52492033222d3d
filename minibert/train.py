"""The trainer: Megatron's BERT pretraining loop, in plain sight.

    for iteration in range(start, train_iters):
        zero the gradient buffers
        schedule: for each of G / (m x DP) micro-batches      gradient accumulation (G global, m micro batch)
            loss = (lm + sop) / number of micro-batches         (fp16: x loss scale)
            loss.backward()                                     grads add up in fp32 buffers
        finalize_model_grads    the buffers averaged over DP (overlapped with the last backward with
                                --overlap-grad-reduce), the sequence- and pipeline-parallel copies summed
        fp8_step                --fp8-format, delayed recipe: this step's amaxes -> the next step's scales
        optimizer.step()        global grad norm; skip on inf/NaN; clip; AdamW on fp32 masters
        scheduler.step(G)       only when the update happened (a skipped step keeps its LR)
        log every --log-interval, evaluate every --eval-interval, save every --save-interval

One process or many: `python minibert/train.py ...` is a run of world size 1, and `torchrun
--nproc_per_node N minibert/train.py ...` runs the same code on N processes (minibert.parallel.state:
the rank grid; data_parallel: the gradient averaging). `python minibert/train.py --help` lists the flags
(Megatron's names and defaults, minibert/config.py). The notebook imports the pieces:
build_model_and_optimizer, get_batch, forward_step, train_step, evaluate, train. What gets printed and
written to TensorBoard (and the FLOP count behind MFU) is in training_log.py; the data in batches.py; this
rank's model, optimizer and generators in build.py.

Performance: the loop waits for the GPU once per step (the skip decision on a non-finite grad norm must
reach the host) and at the log lines. Batches come from pinned memory and are copied without blocking,
and the next step's are built before that wait, while the GPU still computes (PrefetchingBatches).
With --cuda-graph-impl local each micro-batch's forward and backward is one CUDA graph replay
(minibert/fast/cuda_graphs.py): for small models, whose steps are the host's launch time."""
import functools
import gc
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from minibert.config import parse_args
from minibert.data.batches import (  # noqa: F401
    BATCH_KEYS,
    MicroBatchSampler,
    PrefetchingBatches,
    build_data_iterator,
    build_datasets,
    data_stream,
    next_micro_batch,
)
from minibert.errors import UsageError, exit_on_usage_error, write_line
from minibert.fast.cuda_graphs import forward_backward_captured
from minibert.fast.fp8 import fp8_step
from minibert.fast.levers import apply_levers
from minibert.model.attention import reads_packed_rows
from minibert.model.loss import pretraining_loss
from minibert.parallel import faults
from minibert.parallel.data_parallel import finalize_model_grads
from minibert.parallel.pipeline import (
    forward_backward_no_pipelining,
    forward_backward_pipelining,
    forward_pipelining,
)
from minibert.parallel.state import Launch, ParallelState
from minibert.training import checkpoint, resume, save_lock
from minibert.training.build import (
    as_chunks,
    as_state,
    backend_for,
    build_model_and_optimizer,
    build_pipeline,
    set_random_seed,
    tied_embedding,
)
from minibert.training.profiling import Profiler
from minibert.training.training_log import (
    COUNTS,
    IntervalStats,
    TrainingLogger,
    accuracies,
    batch_flops,
    reduce_over_data_parallel,
)
from minibert.validate import validate


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- setup
def setup(cfg, device=None) -> ParallelState:
    """Read torchrun's variables (once), validate the flags for this machine and world (every rank, before
    any collective: a bad layout exits on every rank instead of hanging), then build the rank grid of the
    validated sizes and pick the device."""
    launch = Launch.from_environment()  # no torchrun: a world of one
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if cfg.use_checkpoint_args and cfg.load:
        use_checkpoint_args(cfg)
    validate(cfg, launch.world_size, device_type, warn=warn if launch.rank == 0 else None)
    if cfg.data_path is None:
        raise UsageError("--data-path is required: the prefix written by minibert/preprocess.py, "
                         "e.g. corpus_text_sentence")
    if device_type == "cpu" and launch.world_size > 1:
        torch.set_num_threads(1)  # 2 cores, N processes: oversubscribed OpenMP threads spin
    state = ParallelState.create(launch, tp=cfg.tensor_model_parallel_size, dp=cfg.data_parallel_size,
                                 pp=cfg.pipeline_model_parallel_size, backend=cfg.distributed_backend,
                                 timeout_minutes=cfg.distributed_timeout_minutes, device=device)
    if state.device.type == "cuda":
        torch.cuda.set_device(state.device)
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32: 10-bit mantissa)
        torch.backends.cudnn.allow_tf32 = True
    return state


def use_checkpoint_args(cfg):
    """--use-checkpoint-args: the model's shape comes from the --load checkpoint (Megatron's flag)."""
    saved = checkpoint.read_args(cfg.load)
    if saved is None:
        raise UsageError(f"--use-checkpoint-args: {cfg.load} holds no checkpoint to take the model flags from")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                 "post_ln", "bert_no_binary_head", "layernorm_epsilon", "tokenizer_type"):
        setattr(cfg, name, saved.get(name, getattr(cfg, name)))
    if cfg.seq_length is None:
        cfg.seq_length = saved.get("seq_length")


# ---------------------------------------------------------------- one step
def forward_step(batch, model, hidden_states, cfg):
    """One micro-batch through this model chunk -> (loss, metrics) on the stage with the heads: fp32
    device scalars lm loss / sop loss, int64 device scalars counting the right predictions (lm correct,
    lm masked, sop correct, sop samples: pretraining_loss), and the micro-batch's model FLOPs and real
    tokens (host numbers, for the log line). Earlier pipeline stages return (hidden states, None)."""
    output = model(batch["text"], batch["types"], padding_mask=batch["is_pad"], hidden_states=hidden_states,
                   packing=batch["packing"], lm_rows=batch["lm_rows"])
    if not model.post_process:
        return output, None
    loss, lm_loss, sop_loss, counts = pretraining_loss(output, batch["labels"], batch["loss_mask"],
                                                       batch["is_random"], cross_entropy=model.lm_cross_entropy,
                                                       positions=batch["loss_positions"], counts=True)
    metrics = {"lm loss": lm_loss.detach(), **counts, "flops": batch["flops"], "tokens": batch["tokens"]}
    if sop_loss is not None:
        metrics["sop loss"] = sop_loss.detach()
    return loss, metrics


@dataclass
class StepResult:
    losses: dict            # name -> 0-d device tensor, mean over this rank's micro-batches
    grad_norm: object       # 0-d device tensor (before clipping), None when skipped
    skipped: bool           # no update: an fp16 overflow, or a non-finite loss / grad norm
    status: str = "ok"      # "ok", "overflow" (fp16) or "nan"
    flops: float = 0.0      # model FLOPs of this rank's micro-batches, real tokens only
    tokens: int = 0         # real (non-padding) tokens of this rank's micro-batches
    counts: dict = field(default_factory=dict)  # accuracy counts (training_log.COUNTS) -> 0-d int64 device
                                                # tensor, summed over this rank's micro-batches


def get_batch(data_iterator, device, cfg):
    """The next micro-batch on the device (batches.next_micro_batch: trimmed, packed when worth it for the
    model's attention, which reads packed rows or not), with its model FLOPs (training_log.batch_flops)."""
    batch = next_micro_batch(data_iterator, device, cfg, varlen=reads_packed_rows(backend_for(cfg, device)))
    batch["flops"] = batch_flops(cfg, batch["lengths"], batch["masked"])
    return batch


def fetch_batches(data_iterator, cfg, state):
    """The next num_micro_batches micro-batches of this rank, on the device (every pipeline stage reads them)."""
    return [get_batch(data_iterator, state.device, cfg) for _ in range(cfg.num_micro_batches)]


def next_batches(data_iterator, cfg, state):
    """This step's micro-batches: from a PrefetchingBatches (the training iterator) the ones it built while
    the GPU ran the previous step; from any other iterator, fetched now."""
    fetch = functools.partial(fetch_batches, data_iterator, cfg, state)
    return data_iterator.take(fetch) if isinstance(data_iterator, PrefetchingBatches) else fetch()


def train_step(model, optimizer, scheduler, data_iterator, cfg, state, pipeline=None) -> StepResult:
    """One optimizer step over a global batch: the schedule runs the micro-batches (forward, backward, the
    gradients folded into each chunk's fp32 buffers), finalize_model_grads reduces the gradients over the
    data-parallel group (and the sequence- and pipeline-parallel copies), then the optimizer updates."""
    state = as_state(state)
    chunks = as_chunks(model)
    grads = [chunk.grad_buffers for chunk in chunks]  # minibert.training.build.build_grad_buffers
    optimizer.zero_grad()
    step = functools.partial(forward_step, cfg=cfg)
    batches = next_batches(data_iterator, cfg, state)
    if cfg.cuda_graph_impl == "local":  # the same micro-batches, each replayed from a CUDA graph
        results = forward_backward_captured(step, batches, chunks[0], optimizer)
    elif pipeline is None:
        results = forward_backward_no_pipelining(step, batches, chunks, grads=grads, scale_loss=optimizer.scale_loss)
    else:
        results = forward_backward_pipelining(step, batches, chunks, pipeline, grads=grads,
                                              scale_loss=optimizer.scale_loss)
    losses = {name: sum(m[name] for _, m in results) / len(results)
              for name in ("lm loss", "sop loss") if results and name in results[0][1]}
    counts = {name: sum(m[name] for _, m in results) for name in COUNTS if results and name in results[0][1]}
    nonfinite = sum((~torch.isfinite(loss)).float() for loss, _ in results) if results else None
    if isinstance(data_iterator, PrefetchingBatches):  # the next step's batches, while the GPU runs this one
        data_iterator.prefetch(functools.partial(fetch_batches, data_iterator, cfg, state))
    finalize_model_grads(grads, state, tied_embedding(chunks, state))
    if cfg.fp8_format is not None:
        fp8_step(chunks, state)  # once per step, outside any CUDA graph (minibert/fast/fp8.py)
    outcome = optimizer.step(nonfinite)
    if outcome.update_successful:
        scheduler.step(increment=cfg.global_batch_size)
    flops, tokens = sum(b["flops"] for b in batches), sum(b["tokens"] for b in batches)
    return StepResult(losses, outcome.grad_norm if outcome.update_successful else None,
                      not outcome.update_successful, outcome.status, flops, tokens, counts)


@torch.no_grad()
def evaluate(model, data_iterator, cfg, state, eval_iters, pipeline=None) -> dict:
    """Mean losses over eval_iters global batches (dropout off), averaged over data-parallel ranks, and the
    accuracies (lm acc, sop acc: right predictions / predictions, counted over all of those batches and
    ranks), on the last pipeline stage; {} elsewhere. The iterator is not rewound."""
    state = as_state(state)
    chunks = as_chunks(model)
    for chunk in chunks:
        chunk.eval()
    step = functools.partial(forward_step, cfg=cfg)
    results = []
    for _ in range(eval_iters):
        batches = next_batches(data_iterator, cfg, state)
        if pipeline is None:
            results += forward_backward_no_pipelining(step, batches, chunks, forward_only=True)
        else:
            results += forward_pipelining(step, batches, chunks, pipeline)
    for chunk in chunks:
        chunk.train()
    sums = {name: sum(m[name] for _, m in results) / len(results)
            for name in ("lm loss", "sop loss") if results and name in results[0][1]}
    counts = {name: sum(m[name] for _, m in results) for name in COUNTS if results and name in results[0][1]}
    totals = reduce_over_data_parallel({**sums, **counts}, state, average=sums.keys())  # one all-reduce
    return {**{name: totals[name] for name in sums}, **accuracies(totals)}


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
    state = setup(cfg, device)
    faults.register(state)
    lock = None
    try:
        lock = save_lock.claim(cfg, state)  # --save: this run's alone (a lock) before anything is written
        result = _train(cfg, state, on_log)
    except UsageError as e:  # a mistake every rank meets prints on every rank; one rank's is recorded too
        faults.record(state, e)
        raise
    except Exception as e:
        if state.world_size == 1:
            raise
        faults.handle(state, e, cfg.distributed_timeout_minutes)  # one line per rank, exit 1: never a hang
    finally:
        save_lock.unlock_directory(lock)
    state.destroy()
    return result


def _train(cfg, state, on_log) -> TrainResult:
    set_random_seed(cfg.seed, state)
    logger = TrainingLogger(cfg, state.device, on_log, state)
    _, (train_ds, valid_ds, test_ds) = build_datasets(cfg, state, log=logger.print)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, state)
    apply_levers(model, optimizer, cfg)  # chapter 8's fused kernels, where the flags turn them on
    chunks, pipeline = as_chunks(model), build_pipeline(cfg, state)
    stream = data_stream(cfg)
    if state.dp_rank == 0:
        write_line(f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, "
                   f"{state.pp_rank}): {sum(p.numel() for c in chunks for p in c.parameters())}")  # ranks share stdout
    logger.print(f" > optimizer state per rank (fp32 masters and Adam moments): {optimizer.state_bytes()} bytes")

    iteration = consumed_train = consumed_valid = 0
    saved = cfg.load and checkpoint.load_checkpoint(cfg.load, tp_rank=state.tp_rank, pp_rank=state.pp_rank,
                                                    pp_size=state.pp)
    if saved:
        iteration, consumed_train, consumed_valid = resume.restore_training_state(
            saved, cfg, model, optimizer, scheduler, data_stream=stream,
            warn=warn if state.rank == 0 else (lambda m: None))
        logger.print(f"loaded checkpoint {cfg.load} at iteration {iteration}")
    train_iterator = build_data_iterator(train_ds, consumed_train, cfg, state.device, state)
    train_iterator = PrefetchingBatches(train_iterator) if train_iterator is not None else None
    valid_iterator = build_data_iterator(valid_ds, consumed_valid, cfg, state.device, state)
    if saved and iteration > 0 and not cfg.no_load_rng:  # last: building the iterators draws from torch's generator
        resume.set_rng_state(saved["rng_state"][0])
        state.rng.load_state_dict(saved["rng_state"][0]["tensor_parallel"])
    do_valid = valid_iterator is not None and cfg.eval_iters > 0

    def save():
        rng_state = {**resume.get_rng_state(), "tensor_parallel": state.rng.state_dict()}
        rank_state = checkpoint.training_state(cfg, iteration, model, optimizer, scheduler, consumed_train,
                                               consumed_valid, data_stream=stream, rng_state=rng_state)
        path = checkpoint.save(cfg.save, iteration, state, rank_state, cfg.use_distributed_optimizer)
        logger.print(f"saved checkpoint {path}")

    def run_evaluation(iterator, split_name):
        losses = evaluate(model, iterator, cfg, state, cfg.eval_iters, pipeline)
        logger.log_evaluation(iteration, split_name, losses)

    logger.print("starting training")
    for chunk in chunks:
        chunk.train()
    stats = IntervalStats(state.device)
    same_dir = bool(saved and cfg.save) and os.path.abspath(cfg.save) == os.path.abspath(cfg.load)
    last_saved = iteration if same_dir and iteration > 0 else None  # a checkpoint resumed in place is on disk
    stopped_early = False
    profiler = Profiler(cfg, state)
    signals = faults.SignalFlag(state, cfg.distributed_timeout_minutes) if cfg.exit_signal_handler else None
    while iteration < cfg.train_iters:
        profiler.at(iteration)
        step = train_step(model, optimizer, scheduler, train_iterator, cfg, state, pipeline)
        if step.status == "nan" and cfg.check_for_nan_in_loss_and_grad:
            raise UsageError(nan_stop_message(cfg, iteration + 1, last_saved))
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
            logger.print(f"exiting at iteration {iteration} (--exit-interval {cfg.exit_interval})")
            stopped_early = True
            break
        if signals is not None and signals.agreed():  # SIGTERM / SIGINT on any rank: save and stop, together
            if cfg.save and last_saved != iteration:
                save()
            logger.print(f"exiting at iteration {iteration}: {signals.received or 'a signal on another rank'} "
                         "(--exit-signal-handler)")
            stopped_early = True
            break

    profiler.at(iteration, end=True)
    if not stopped_early:  # as Megatron: save, then evaluate on the validation and test splits
        if cfg.save and last_saved != iteration and iteration > 0:
            save()
        if do_valid:
            run_evaluation(valid_iterator, "validation set")
            consumed_valid += cfg.eval_iters * cfg.global_batch_size
        if test_ds is not None and cfg.eval_iters > 0:
            run_evaluation(build_data_iterator(test_ds, 0, cfg, state.device, state), "test set")
    logger.close()
    return TrainResult(model, optimizer, scheduler, iteration, consumed_train, consumed_valid, logger.history)


def nan_stop_message(cfg, iteration, last_saved) -> str:
    where = (f"the last checkpoint is iteration {last_saved} in {cfg.save} (resume with --load {cfg.save})"
             if last_saved else "no checkpoint was saved")
    return (f"iteration {iteration}: the loss or the gradient norm is not finite, so the update was not applied "
            f"and the run stops; {where}. Lower --lr or check the data, or pass "
            "--no-check-for-nan-in-loss-and-grad to skip such steps and count them")


@exit_on_usage_error
def main(argv=None):
    train(parse_args(argv))
    gc.collect()  # free every object holding a process group while Python is fully alive


if __name__ == "__main__":
    main()
