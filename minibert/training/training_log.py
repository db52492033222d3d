"""What the trainer reports: Megatron's console lines, TensorBoard scalars, and model FLOPs / MFU.

A log line every --log-interval iterations (losses are means over the interval's non-skipped
iterations; the grad norm is the last update's, before clipping):

    iteration       10/     200 | consumed samples:          160 | elapsed time per iteration (ms): 812.3 |
    learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 1.023456E+01 |
    sop loss: 6.931472E-01 | lm acc: 0.0312 | sop acc: 0.5000 | loss scale: 4294967296.0 |
    grad norm: 3.456 | number of skipped iterations:   0 | number of nan iterations:   0 |
                                                                                   (one line, wrapped here)

The accuracies are not Megatron's (it has no such field; MLPerf's BERT benchmark uses `lm acc` as its
quality target, 0.720): lm acc = the masked positions whose label is the argmax of the logits / all masked
positions, both counted over every micro-batch, data-parallel rank and non-skipped iteration of the
interval (a ratio of sums, not a mean of per-step ratios as the losses are); sop acc the same over the
samples' sentence-order predictions. The counts are int64 device scalars that ride the one all-reduce and
the one host sync the loss sums already take at the log line; evaluation lines carry them too
(`lm acc value: ...`).

On a GPU, after the elapsed time: `throughput per GPU (TFLOP/s/GPU): x | tokens per second: n | MFU: p% |`.
As in Megatron, the learning rate shown is the one set after the step (the next update's).
Differences from Megatron: no timestamp prefix; the loss scale is shown in every precision (1.0
without fp16). As in Megatron, an interval of only skipped steps (fp16 lowering its loss scale at the
start) has no loss mean and no grad norm: those fields are left out of its line.

Model FLOPs per step (docs/measuring.md), forward + backward (x3) at 2 FLOPs per multiply-add, no recompute:

    F = sum_i [ 6 l (4h^2 + 2 h f) L_i  +  12 l h L_i^2 ]  +  6 (h V + h^2) N_head
          ^ QKV, out proj, MLP per token   ^ QK^T and PV       ^ LM head (dense + decoder)

with L_i the real (non-padding) tokens of sample i, f the FFN width (4h: 72 l h^2 per token), V the
padded vocab (the decoder matmul runs over it) and N_head the positions sent through the LM head: every
real token, or only the masked ones with --sparse-mlm. MFU = FLOP/s per GPU / PEAK_FLOPS, the rate of a
large bf16 matmul as measured in docs/measuring.md, section 2 (not a datasheet's peak).

With several GPUs every figure is per GPU: the model FLOPs of the whole global batch (summed over the
data-parallel replicas) divided by the world size; recomputed activations are not model FLOPs. The losses
are means over the data-parallel replicas (each replica saw different samples), and one rank, the last
(it is on the last pipeline stage, which has the losses), prints the lines and writes TensorBoard."""
import math
import time

import torch
import torch.distributed as dist

from minibert.errors import write_line

PEAK_FLOPS = 790e12  # a large bf16 matmul's FLOP/s on one GPU, as measured in docs/measuring.md, section 2


def model_flops(cfg, lengths, head_positions) -> float:
    """The formula above for samples of `lengths` real tokens (a float64 tensor) and `head_positions`
    positions through the LM head."""
    l, h, f, vocab = cfg.num_layers, cfg.hidden_size, cfg.ffn_size, cfg.padded_vocab_size
    return (6 * l * (4 * h * h + 2 * h * f) * float(lengths.sum()) + 12 * l * h * float((lengths ** 2).sum())
            + 6 * (h * vocab + h * h) * head_positions)


def batch_flops(cfg, lengths, masked) -> float:
    """Model FLOPs of one micro-batch from what get_batch counted on the host: `lengths` (an int tensor [b],
    real tokens per sample) and `masked` (its masked positions, which alone reach the LM head with
    --sparse-mlm; otherwise every real token does)."""
    lengths = lengths.to(torch.float64)
    return model_flops(cfg, lengths, float(masked) if cfg.sparse_mlm else float(lengths.sum()))


# accuracy -> (right predictions, predictions): the counts pretraining_loss(counts=True) returns
ACCURACIES = {"lm acc": ("lm correct", "lm masked"), "sop acc": ("sop correct", "sop samples")}
COUNTS = tuple(name for pair in ACCURACIES.values() for name in pair)


def accuracies(counts: dict) -> dict:
    """{"lm acc": lm correct / lm masked, "sop acc": ...} from summed counts (numbers); an accuracy whose
    counts are absent is left out, one of nothing is 0.0 (as an lm loss of nothing is 0)."""
    return {name: counts[right] / max(counts[total], 1) for name, (right, total) in ACCURACIES.items()
            if total in counts}


def reduce_over_data_parallel(values: dict, state, average=()) -> dict:
    """{name: number or 0-d tensor} summed over this rank's data-parallel group (one all-reduce); the names
    in `average` are divided by DP. Called by every rank of the group, with the same names."""
    names = sorted(values)
    if not names:
        return {}
    device = state.device if state.device.type == "cuda" else torch.device("cpu")
    packed = torch.stack([torch.as_tensor(values[n], dtype=torch.float64, device=device).reshape(())
                          for n in names])
    if state.group("data") is not None:
        dist.all_reduce(packed, group=state.group("data"))
    summed = dict(zip(names, packed.tolist()))
    return {n: v / state.dp if n in average else v for n, v in summed.items()}


class IntervalStats:
    """Sums over the iterations since the last log line; device tensors until the line is printed. The
    losses and the accuracy counts are summed over the non-skipped iterations only."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self):
        self.loss_sums, self.count_sums, self.advanced, self.skipped, self.nan = {}, {}, 0, 0, 0
        self.grad_norm = None
        self.flops, self.tokens = 0.0, 0
        self.excluded = 0.0  # seconds spent in evaluation / checkpoints inside this interval
        self.start = time.perf_counter()

    def add(self, step):
        if step.skipped:
            self.skipped += 1
            self.nan += int(step.status == "nan")  # a non-finite loss or grad norm (Megatron's count)
        else:
            self.advanced += 1
            for name, value in step.losses.items():
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
            for name, value in step.counts.items():
                self.count_sums[name] = self.count_sums.get(name, 0) + value
            self.grad_norm = step.grad_norm
        self.flops += step.flops
        self.tokens += step.tokens

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def paused(self):
        """with stats.paused(): evaluate() -- that time does not count as training time."""
        stats = self

        class _Pause:
            def __enter__(self):
                stats._sync()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                stats._sync()
                stats.excluded += time.perf_counter() - self.t
        return _Pause()

    def elapsed(self):
        self._sync()
        return time.perf_counter() - self.start - self.excluded


class TrainingLogger:
    """Prints the lines, writes TensorBoard scalars, keeps every record, calls on_log(record)."""

    def __init__(self, cfg, device, on_log=None, state=None):
        from minibert.parallel.state import ParallelState
        self.cfg, self.device, self.on_log = cfg, device, on_log
        self.state = state or ParallelState(device=device)
        self.printing = self.state.is_logging_rank
        self.history = []
        self.memory_reported = False
        self.writer = None
        if cfg.tensorboard_dir and self.printing:
            from torch.utils.tensorboard import (
                SummaryWriter,  # needs the tensorboard package
            )
            self.writer = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=1000)

    def print(self, line):
        if self.printing:
            write_line(line)  # one write: other ranks print to the same stdout

    def _emit(self, record, line, scalars):
        if not self.printing:
            return
        write_line(line)
        if self.writer is not None:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, record["iteration"])
        self.history.append(record)
        if self.on_log is not None:
            self.on_log(record)

    def log_train(self, iteration, consumed_samples, optimizer, stats):
        """Every rank calls this at the same iterations (the last stage's ranks reduce over DP)."""
        cfg, state = self.cfg, self.state
        iterations = stats.advanced + stats.skipped
        seconds = stats.elapsed() / max(iterations, 1)
        if not state.is_last_stage:
            stats.reset()
            return
        # one all-reduce and one host sync for everything the line reports
        totals = reduce_over_data_parallel({**stats.loss_sums, **stats.count_sums, "flops": stats.flops,
                                            "tokens": stats.tokens}, state, average=stats.loss_sums.keys())
        flops, tokens = totals.pop("flops"), totals.pop("tokens")
        tflops = flops / iterations / seconds / 1e12 / state.world_size if iterations else 0.0  # per GPU
        # means over the interval's non-skipped iterations; when every step was skipped (fp16 finding its
        # loss scale) there is no mean, and the loss fields are left out of the line, as Megatron does;
        # so are the accuracies, which are ratios of the summed counts
        accuracy = accuracies({name: totals.pop(name) for name in stats.count_sums})
        losses = {name: total / stats.advanced for name, total in totals.items()}
        record = {"kind": "train", "iteration": iteration, "train_iters": cfg.train_iters,
                  "consumed_samples": consumed_samples, "elapsed_ms": seconds * 1000.0,
                  "tflops_per_gpu": tflops, "tokens_per_second": tokens / max(seconds * iterations, 1e-9),
                  "mfu": tflops * 1e12 / PEAK_FLOPS, "learning_rate": optimizer.param_groups[0]["lr"],
                  "global_batch_size": cfg.global_batch_size, "loss_scale": optimizer.loss_scale,
                  "grad_norm": float(stats.grad_norm) if stats.grad_norm is not None else float("nan"),
                  "skipped_iterations": stats.skipped, "nan_iterations": stats.nan,
                  # records always carry the loss and accuracy keys (nan when the interval has no mean)
                  "lm loss": float("nan"), **({"sop loss": float("nan")} if cfg.binary_head else {}), **losses,
                  "lm acc": float("nan"), **({"sop acc": float("nan")} if cfg.binary_head else {}), **accuracy}
        parts = [f"iteration {iteration:8d}/{cfg.train_iters:8d}",
                 f"consumed samples: {consumed_samples:12d}",
                 f"elapsed time per iteration (ms): {record['elapsed_ms']:.1f}"]
        if self.device.type == "cuda":
            parts += [f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f}",
                      f"tokens per second: {record['tokens_per_second']:.0f}",
                      f"MFU: {100 * record['mfu']:.1f}%"]
        parts += [f"learning rate: {record['learning_rate']:.6E}",
                  f"global batch size: {cfg.global_batch_size:5d}"]
        parts += [f"{name}: {value:.6E}" for name, value in losses.items()]
        parts += [f"{name}: {value:.4f}" for name, value in accuracy.items()]
        parts += [f"loss scale: {record['loss_scale']:.1f}"]
        if stats.grad_norm is not None:
            parts += [f"grad norm: {record['grad_norm']:.3f}"]
        parts += [f"number of skipped iterations: {stats.skipped:3d}",
                  f"number of nan iterations: {stats.nan:3d}"]
        scalars = {**losses, **accuracy, "learning-rate": record["learning_rate"],
                   "loss-scale": record["loss_scale"], "throughput": tflops}
        if stats.grad_norm is not None:
            scalars["grad-norm"] = record["grad_norm"]
        self._emit(record, " | ".join(parts) + " |", scalars)
        if self.device.type == "cuda" and not self.memory_reported and self.printing:
            self.report_memory(iteration)
            self.memory_reported = True
        stats.reset()

    def report_memory(self, iteration):
        """Megatron's memory line after the first log interval: what the GPU holds once training runs."""
        mb = 1024 * 1024
        write_line(f"[Rank {self.state.rank}] (after {iteration} iterations) memory (MB) | "
                   f"allocated: {torch.cuda.memory_allocated(self.device) / mb:.1f} | "
                   f"max allocated: {torch.cuda.max_memory_allocated(self.device) / mb:.1f} | "
                   f"reserved: {torch.cuda.memory_reserved(self.device) / mb:.1f} | "
                   f"max reserved: {torch.cuda.max_memory_reserved(self.device) / mb:.1f}")

    def log_evaluation(self, iteration, split_name, losses):
        """`validation loss at iteration 50 | lm loss value: x | lm loss PPL: y | ... | lm acc value: z |`;
        losses: evaluate()'s means and accuracies. split_name None for the evaluations during training,
        "validation set" / "test set" for those at the end. TensorBoard: `lm loss validation`, `lm loss
        validation ppl`, `lm acc validation` (and `test` for the test set)."""
        prefix = f"iteration {iteration}" + (f" on {split_name}" if split_name else "")
        kind = "test" if split_name == "test set" else "validation"
        parts = [f"validation loss at {prefix}"]
        record = {"kind": kind, "iteration": iteration}
        scalars = {}
        for name, value in losses.items():
            record[name], scalars[f"{name} {kind}"] = value, value
            if name in ACCURACIES:  # a share, not a loss: no perplexity
                parts += [f"{name} value: {value:.4f}"]
                continue
            ppl = math.exp(min(20.0, value))  # Megatron caps the exponent so the PPL stays printable
            parts += [f"{name} value: {value:.6E}", f"{name} PPL: {ppl:.6E}"]
            record[f"{name} PPL"], scalars[f"{name} {kind} ppl"] = ppl, ppl
        line = " | ".join(parts) + " |"
        dashes = "-" * (len(line) + 1)
        self._emit(record, f"{dashes}\n{line}\n{dashes}", scalars)

    def close(self):
        if self.writer is not None:
            self.writer.close()
