"""The optimizer: AdamW on fp32 master weights, fp16 loss scaling, the global grad norm and clipping.

Mixed precision the Megatron way. With --bf16 or --fp16 the model's parameters are 16-bit, so the
forward and backward run at 16-bit speed; the optimizer keeps an fp32 *master* copy of every parameter
and does all of its arithmetic there, because a 16-bit weight cannot absorb an update that is ~1e-4 of
its size (bf16 keeps 8 bits of mantissa: 1 + 2^-9 rounds back to 1).

    model params (bf16/fp16) --forward/backward--> param.grad (16-bit)
         ^                                              | hook after each micro-batch: main_grad += grad
         |                                              v     (fp32 buckets, minibert.parallel.data_parallel)
    copy back <-- AdamW <-- grad norm <-- all-reduce over DP
                     | AdamW divides each gradient by (fp16: the loss scale) x (clipping's factor)
                     | and skips a bad step itself: both decided on the device (see step())
                     (fp32 master params, fp32 main grads, fp32 Adam moments)

The update is PyTorch's fused AdamW followed by a copy back into the 16-bit weights. (On a GPU,
--adam-fusion, a lever of chapter 8, replaces it with one Triton pass that writes the 16-bit weights on
its way out: minibert/fast/adamw.py. Both keep Adam's moments in the same flat buffers, so checkpoints
do not depend on which ran.)

The optimizer works on *pieces*: the part of each parameter that lies in this rank's shard of a bucket.
Without ZeRO-1 the shard is the whole bucket, so every parameter is one whole piece and every DP rank
updates everything; with --use-distributed-optimizer rank r updates only shard r and the parameters are
all-gathered afterwards. With fp32 the master pieces are views of the parameters themselves (nothing is
copied); with 16-bit parameters they are views of one fp32 copy of the shard.

fp16 needs its loss scaled so that small gradients do not underflow; the scale comes from
minibert/training/loss_scale.py (DynamicLossScaler), and the optimizer divides the gradients by it before use.
The LR schedule is minibert/training/lr_schedule.py.

Non-finite numbers: a step whose grad norm (or, under fp16, whose loss) is not finite never reaches the
weights. Under fp16 an infinite gradient with a finite loss is an *overflow*: the step is skipped and
the loss scale lowered (that is how the scale is found). Anything else is a *nan* step, which the
trainer stops on (--check-for-nan-in-loss-and-grad, the default) or skips and counts.

Checkpoints store the optimizer by parameter name (each piece with its range in the flattened
parameter), so a checkpoint written at one data-parallel size, with or without ZeRO-1, loads at any other.

What production does: Megatron's distributed optimizer is the same idea with more machinery (parameter
all-gathers overlapped with the next forward, precision-aware moments)."""
import math
from collections import namedtuple

import torch
import torch.distributed as dist
from torch.optim.adamw import (
    adamw as pytorch_adamw,  # the functional form (update() says why)
)

from minibert.parallel.state import ParallelState
from minibert.training.loss_scale import DynamicLossScaler


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and every 1-D parameter (LayerNorm weights) are not decayed."""
    return name.endswith(".bias") or param.ndim == 1


class Shard:
    """The part [lo, hi) of a gradient bucket that this rank's optimizer updates, as flat fp32 buffers:
    `master` (a copy of the 16-bit values, or in fp32 runs the bucket's own values), `grad` (the bucket's
    fp32 gradients), and Adam's two moments. `pieces`: its parameters' parts, in the bucket's order."""

    def __init__(self, bucket):
        self.lo, self.hi = bucket.shard
        self.low_precision = bucket.param_data.dtype != torch.float32
        values = bucket.param_data[self.lo:self.hi]
        self.model_values = values if self.low_precision else None  # where the 16-bit weights are copied back
        self.master = values.float() if self.low_precision else values
        self.grad = bucket.grad_data[self.lo:self.hi]
        self.exp_avg, self.exp_avg_sq = torch.zeros_like(self.master), torch.zeros_like(self.master)
        self.pieces = []

    def copy_back(self):
        """The updated fp32 masters into the model's 16-bit weights (nothing to do in fp32 runs)."""
        if self.low_precision:
            with torch.no_grad():
                self.model_values.copy_(self.master)


class Piece:
    """The part [start, end) of a flattened parameter that this rank's optimizer updates, at [lo, hi) of its
    shard's buffers: `master` is its fp32 value (master.grad its fp32 gradient), `exp_avg` and `exp_avg_sq`
    its Adam moments, all views of the shard's flat buffers."""

    def __init__(self, name, param, start, end, in_norm, shard, lo, hi):
        self.name, self.param, self.start, self.end, self.in_norm = name, param, start, end, in_norm
        self.lo, self.hi = lo, hi
        self.master = shard.master[lo:hi]
        self.master.grad = shard.grad[lo:hi]
        self.exp_avg, self.exp_avg_sq = shard.exp_avg[lo:hi], shard.exp_avg_sq[lo:hi]
        self.step = torch.zeros((), dtype=torch.float32, device=self.master.device)  # AdamW's t (PyTorch's kernel)


StepOutcome = namedtuple("StepOutcome", ["update_successful", "grad_norm", "status"])  # "ok" / "overflow" / "nan"


class MixedPrecisionOptimizer:
    """AdamW (decoupled weight decay, as Megatron's 'adam') on fp32 masters, over DP gradient buckets.

    Use per iteration: zero_grad(); for each micro-batch: scale_loss(loss / n).backward() and fold the
    gradients into the fp32 buffers (DataParallelGrads.accumulate: the schedules do it);
    finalize_model_grads (the data-parallel reduction); step(), which returns StepOutcome(update_successful,
    grad_norm, status): grad_norm a 0-d tensor taken before clipping (None when the step was skipped).
    `grads`: the DataParallelGrads of each model chunk (minibert.training.build.build_grad_buffers), whose buckets
    the optimizer updates."""

    def __init__(self, grads: list, state: ParallelState, *, lr=0.0, weight_decay=0.01, betas=(0.9, 0.999),
                 eps=1e-8, clip_grad=1.0, loss_scaler: DynamicLossScaler = None, shared_embedding=None):
        self.grads, self.state = grads, state
        self.clip_grad, self.loss_scaler = clip_grad, loss_scaler
        self.shared_embedding = shared_embedding  # pipelining: the tied word table (first stage) or its copy (last)
        self.distributed = grads[0].distributed_optimizer
        self.pieces, self.shards = [], []
        for bucket in (b for g in grads for b in g.buckets):
            shard = Shard(bucket)
            for name, param, (a, b) in zip(bucket.names, bucket.params, bucket.ranges):
                x, y = max(a, shard.lo), min(b, shard.hi)  # the part of this parameter inside the shard
                if x >= y:
                    continue
                piece = Piece(name, param, x - a, y - a, self._in_norm(name, param), shard, x - shard.lo, y - shard.lo)
                shard.pieces.append(piece)
                self.pieces.append(piece)
            self.shards.append(shard)
        order = {id(p): i for i, p in enumerate(p for g in grads for p in g.params)}
        self.pieces.sort(key=lambda pc: order[id(pc.param)])  # the model's order (buckets run backwards)
        self.low_precision = any(sh.low_precision for sh in self.shards)
        self.steps_made = 0  # updates applied so far (skipped steps do not count): AdamW's t - 1
        decay = [pc for pc in self.pieces if not no_weight_decay(pc.name, pc.param)]
        no_decay = [pc for pc in self.pieces if no_weight_decay(pc.name, pc.param)]
        # the LR schedule sets each group's "lr"; the moments are views of the shards' flat buffers
        self.param_groups = [{"pieces": pieces, "lr": lr, "weight_decay": decay_rate, "betas": betas, "eps": eps}
                             for pieces, decay_rate in ((decay, weight_decay), (no_decay, 0.0)) if pieces]

    def _in_norm(self, name, param) -> bool:
        """Count each parameter once in the global grad norm: a tensor-parallel *replicated* one (a
        LayerNorm, a row-parallel bias) only on tensor-parallel rank 0, the tied table's pipeline copy never."""
        if param is self.shared_embedding and not self.state.is_first_stage:
            return False
        return hasattr(param, "partition_dim") or self.state.tp_rank == 0

    @property
    def master_params(self):
        """The fp32 masters, one per piece in the model's parameter order (a whole piece has its
        parameter's shape)."""
        return [pc.master.view_as(pc.param) if pc.end - pc.start == pc.param.numel() else pc.master
                for pc in self.pieces]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (fp16: times the loss scale)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def zero_grad(self):
        for g in self.grads:
            g.zero()

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters (16-bit runs) and the two Adam moments."""
        elements = sum(pc.master.numel() for pc in self.pieces)
        return elements * 4 * (3 if self.low_precision else 2)

    @torch.profiler.record_function("MixedPrecisionOptimizer.step")  # a named range in --profile's trace
    def step(self, nonfinite_loss=None) -> StepOutcome:
        """The update, from gradients that finalize_model_grads has made final. nonfinite_loss: 0-d device
        tensor, > 0 when a micro-batch's loss on this rank was inf/NaN.

        The update is queued before the host learns whether to make it. AdamW (see update)
        takes two 0-d device tensors: it divides each gradient by a divisor before using it, and changes
        nothing (weights, moments, step count) where found_inf is 1. So unscaling
        (fp16), clipping and the decision to skip are computed on the device, and the one host sync of the
        step, reading [||g||^2, bad losses] for the log and the loss scaler, comes after AdamW and the copy
        back are queued: the GPU runs them while the host decides, instead of waiting for its next call."""
        scale = self.loss_scale                           # fp16: the main grads are still times the scale
        status = self._global_status(nonfinite_loss)      # [||scale g||^2, bad losses]
        sumsq = status[0] / (scale * scale)
        grad_norm = sumsq.sqrt().float()
        # g <- g / scale * min(1, clip / (||g|| + 1e-6)), as one divisor: scale * max(1, (||g|| + 1e-6) / clip)
        divisor = (torch.clamp((grad_norm + 1e-6) / self.clip_grad, min=1.0) if self.clip_grad > 0
                   else torch.ones_like(grad_norm))
        found_inf = ((status[1] > 0) | ~torch.isfinite(sumsq)).float()  # 1: skip the update
        self.update(divisor * scale if scale != 1.0 else divisor, found_inf)
        for g in self.grads:
            g.gather_params()  # ZeRO-1: the updated shards to every rank
        scaled_sumsq, bad_losses = status.tolist()  # one host sync per step: the log and the loss scaler need it
        if bad_losses > 0:
            return StepOutcome(False, grad_norm, "nan")
        if not math.isfinite(scaled_sumsq):
            if self.loss_scaler is None:
                return StepOutcome(False, grad_norm, "nan")
            self.loss_scaler.update(True)  # fp16 overflow: skipped, lower the scale
            return StepOutcome(False, None, "overflow")
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        self.steps_made += 1
        return StepOutcome(True, grad_norm, "ok")

    def update(self, divisor, found_inf):
        """AdamW on every piece, each gradient divided by `divisor`, then the 16-bit weights from the
        masters; nothing changes where `found_inf` is 1 (both 0-d fp32 device tensors)."""
        # PyTorch's fused AdamW (fused=True: one kernel for all of AdamW's elementwise work, on CUDA and on
        # the CPU, and the one implementation that takes grad_scale and found_inf: step() says why it needs
        # them), called as a function: the torch.optim class would hold nothing we use, and its first
        # call imports torch's compiler, seconds of start-up for every run
        for group in self.param_groups:
            pieces = group["pieces"]
            pytorch_adamw(
                [pc.master for pc in pieces], [pc.master.grad for pc in pieces], [pc.exp_avg for pc in pieces],
                [pc.exp_avg_sq for pc in pieces], [], [pc.step for pc in pieces], fused=True, grad_scale=divisor,
                found_inf=found_inf, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        for shard in self.shards:
            shard.copy_back()

    def _global_status(self, nonfinite_loss):
        """[||g||^2 over the whole model, count of bad losses], the same on every rank: one all-reduce
        over every rank. Without ZeRO-1 each DP replica holds the whole (already averaged) gradient, so
        each contributes 1/DP of its sum of squares; TP/PP ranks contribute their own parameters."""
        device = self.pieces[0].master.device
        counted = [pc.master.grad for pc in self.pieces if pc.in_norm]
        # in float64: a float32 sum of a million squares loses ~1e-4 of it on a CPU (sequential adds)
        sumsq = (torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float64)).square().sum() if counted
                 else torch.zeros((), device=device, dtype=torch.float64))
        replicas = 1 if self.distributed else self.state.dp
        bad = nonfinite_loss.to(device=device, dtype=torch.float64) if nonfinite_loss is not None \
            else torch.zeros((), device=device, dtype=torch.float64)
        status = torch.stack([sumsq / replicas, bad])
        if self.state.world_size > 1:
            dist.all_reduce(status)
        return status

    def reload_masters(self):
        """After new weights were loaded into the model (--finetune, --no-load-optim): the fp32 masters
        of a 16-bit run start from them (fp32 runs' masters are the parameters already)."""
        with torch.no_grad():
            for shard in self.shards:
                if shard.low_precision:
                    shard.master.copy_(shard.model_values)

    # ---- checkpoints: by parameter name, any layout ----
    def state_dict(self):
        """{"step", "params": {name: {"range", "exp_avg", "exp_avg_sq"[, "master"]}}, "grad_scaler"}:
        this rank's pieces. Masters are stored for 16-bit runs only (fp32: they are the parameters)."""
        params = {}
        for pc in self.pieces:
            entry = {"range": [pc.start, pc.end]}
            if self.steps_made > 0:
                entry["exp_avg"] = pc.exp_avg.detach().cpu().clone()
                entry["exp_avg_sq"] = pc.exp_avg_sq.detach().cpu().clone()
            if self.low_precision:
                entry["master"] = pc.master.detach().cpu().clone()
            params[pc.name] = entry
        return {"step": float(self.steps_made), "params": params,
                "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, states):
        """`states`: one state_dict or a list of them (ZeRO-1: every DP rank's shard, in any number). Each
        of this rank's pieces is cut out of the saved ranges of its parameter; a missing name raises
        KeyError. The fp32 masters of a 16-bit run come from the saved masters, or else the parameters."""
        states = states if isinstance(states, list) else [states]
        step = states[0]["step"]
        self.steps_made = int(step)
        for pc in self.pieces:
            saved = [s["params"][pc.name] for s in states if pc.name in s["params"]]
            if not saved:
                raise KeyError(f"the checkpoint's optimizer has no state for {pc.name}")
            entry = {key: _cut(saved, key, pc.start, pc.end) for key in ("exp_avg", "exp_avg_sq", "master")
                     if all(key in e for e in saved)}
            if "exp_avg" not in entry:  # saved before any step was made
                self.steps_made = 0
            with torch.no_grad():
                if "master" in entry:
                    pc.master.copy_(entry["master"])
                else:
                    pc.master.copy_(pc.param.detach().reshape(-1)[pc.start:pc.end])
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in entry:
                        getattr(pc, key).copy_(entry[key])
                    else:
                        getattr(pc, key).zero_()
        for pc in self.pieces:
            pc.step.fill_(self.steps_made)
        for shard in self.shards:
            shard.copy_back()
        for g in self.grads:
            g.gather_params()
        if self.loss_scaler is not None and states[0].get("grad_scaler") is not None:
            self.loss_scaler.load_state_dict(states[0]["grad_scaler"])


def _cut(saved_entries, key, start, end):
    """Elements [start, end) of a flattened parameter, from saved pieces that each cover a range of it."""
    parts = []
    for entry in sorted(saved_entries, key=lambda e: e["range"][0]):
        a, b = entry["range"]
        x, y = max(a, start), min(b, end)
        if x < y:
            parts.append(entry[key].reshape(-1)[x - a:y - a])
    cut = torch.cat(parts) if parts else torch.empty(0)
    if cut.numel() != end - start:
        raise KeyError(f"the checkpoint's optimizer covers {cut.numel()} of elements [{start}, {end}) of a "
                       f"parameter ({key}): a shard file is missing")
    return cut


def build_optimizer(grads, cfg, state: ParallelState = None, shared_embedding=None) -> MixedPrecisionOptimizer:
    """AdamW over the gradient buckets `grads` (minibert.training.build.build_grad_buffers) as the flags say.
    state None: one process."""
    scaler = None
    if cfg.fp16:
        scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale,
                                   cfg.loss_scale_window, cfg.hysteresis)
    return MixedPrecisionOptimizer(grads, state or ParallelState(), weight_decay=cfg.weight_decay,
                                   betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                   clip_grad=cfg.clip_grad, loss_scaler=scaler, shared_embedding=shared_embedding)
