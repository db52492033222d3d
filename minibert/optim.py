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

The optimizer works on *pieces*: the part of each parameter that lies in this rank's shard of a bucket.
Without ZeRO-1 the shard is the whole bucket, so every parameter is one whole piece and every DP rank
updates everything; with --use-distributed-optimizer rank r updates only shard r and the parameters are
all-gathered afterwards. With fp32 the master pieces are views of the parameters themselves (nothing is
copied); with 16-bit parameters they are views of one fp32 copy of the shard.

fp16 needs its loss scaled so that small gradients do not underflow; the scale comes from
minibert/loss_scale.py (DynamicLossScaler), and the optimizer divides the gradients by it before use.
The LR schedule is minibert/lr_schedule.py.

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

from minibert.loss_scale import DynamicLossScaler
from minibert.parallel.data_parallel import DataParallelGrads, finalize_gradients
from minibert.parallel.state import ParallelState


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and every 1-D parameter (LayerNorm weights) are not decayed."""
    return name.endswith(".bias") or param.ndim == 1


class Piece:
    """The part [start, end) of a flattened parameter that this rank's optimizer updates: `master` is its
    fp32 value (master.grad its fp32 gradient), both views into the bucket's flat buffers."""

    def __init__(self, name, param, start, end, master, in_norm):
        self.name, self.param, self.start, self.end = name, param, start, end
        self.master, self.in_norm = master, in_norm


StepOutcome = namedtuple("StepOutcome", ["update_successful", "grad_norm", "status"])  # "ok" / "overflow" / "nan"


class MixedPrecisionOptimizer:
    """AdamW (decoupled weight decay, as Megatron's 'adam') on fp32 masters, over DP gradient buckets.

    Use per iteration: zero_grad(); for each micro-batch: scale_loss(loss / n).backward(); step().
    step() finishes the gradient reduction, then returns StepOutcome(update_successful, grad_norm,
    status): grad_norm a 0-d tensor taken before clipping (None when the step was skipped)."""

    def __init__(self, grads: list, state: ParallelState, *, lr=0.0, weight_decay=0.01, betas=(0.9, 0.999),
                 eps=1e-8, clip_grad=1.0, loss_scaler: DynamicLossScaler = None, shared_embedding=None):
        self.grads, self.state = grads, state
        self.clip_grad, self.loss_scaler = clip_grad, loss_scaler
        self.shared_embedding = shared_embedding  # pipelining: the tied word table (first stage) or its copy (last)
        self.distributed = grads[0].distributed_optimizer
        self.pieces, self._master_shards = [], []  # (bucket, fp32 shard) for the copy back
        for bucket in (b for g in grads for b in g.buckets):
            lo, hi = bucket.shard
            low_precision = bucket.param_data.dtype != torch.float32
            shard = bucket.param_data[lo:hi].float() if low_precision else bucket.param_data[lo:hi]
            self._master_shards.append((bucket, shard, low_precision))
            grad_shard = bucket.grad_data[lo:hi]
            for name, param, (a, b) in zip(bucket.names, bucket.params, bucket.ranges):
                x, y = max(a, lo), min(b, hi)  # the part of this parameter inside the shard
                if x >= y:
                    continue
                master = shard[x - lo:y - lo]
                master.grad = grad_shard[x - lo:y - lo]
                self.pieces.append(Piece(name, param, x - a, y - a, master, self._in_norm(name, param)))
        order = {id(p): i for i, p in enumerate(p for g in grads for p in g.params)}
        self.pieces.sort(key=lambda pc: order[id(pc.param)])  # the model's order (buckets run backwards)
        self.low_precision = any(lp for _, _, lp in self._master_shards)
        decay = [pc.master for pc in self.pieces if not no_weight_decay(pc.name, pc.param)]
        no_decay = [pc.master for pc in self.pieces if no_weight_decay(pc.name, pc.param)]
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        # fused=True: one kernel for all of AdamW's elementwise work, on CUDA and on the CPU, and the one
        # implementation that takes grad_scale and found_inf (step() says why it needs them)
        self.adam = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)

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
    def param_groups(self):
        return self.adam.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (fp16: times the loss scale). Called before each micro-batch's
        backward, it first folds the previous backward's gradients into the fp32 main grads, so the plain
        loop `scale_loss(loss / n).backward()` accumulates in fp32 even without a schedule."""
        for g in self.grads:
            g.accumulate()
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def zero_grad(self):
        for g in self.grads:
            g.zero()

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: fp32 masters (16-bit runs) and the two Adam moments."""
        elements = sum(pc.master.numel() for pc in self.pieces)
        return elements * 4 * (3 if self.low_precision else 2)

    def step(self, nonfinite_loss=None) -> StepOutcome:
        """nonfinite_loss: 0-d device tensor, > 0 when a micro-batch's loss on this rank was inf/NaN.

        The update is queued before the host learns whether to make it. AdamW (torch's fused kernel, one
        pass over every piece) takes two 0-d device tensors: it divides each gradient by grad_scale before
        using it, and changes nothing (weights, moments, step count) where found_inf is 1. So unscaling
        (fp16), clipping and the decision to skip are computed on the device, and the one host sync of the
        step, reading [||g||^2, bad losses] for the log and the loss scaler, comes after AdamW and the copy
        back are queued: the GPU runs them while the host decides, instead of waiting for its next call."""
        finalize_gradients(self.grads, self.state, self.shared_embedding)
        scale = self.loss_scale                           # fp16: the main grads are still times the scale
        status = self._global_status(nonfinite_loss)      # [||scale g||^2, bad losses]
        sumsq = status[0] / (scale * scale)
        grad_norm = sumsq.sqrt().float()
        # g <- g / scale * min(1, clip / (||g|| + 1e-6)), as one divisor: scale * max(1, (||g|| + 1e-6) / clip)
        divisor = (torch.clamp((grad_norm + 1e-6) / self.clip_grad, min=1.0) if self.clip_grad > 0
                   else torch.ones_like(grad_norm))
        self.adam.grad_scale = divisor * scale if scale != 1.0 else divisor
        self.adam.found_inf = ((status[1] > 0) | ~torch.isfinite(sumsq)).float()  # 1: skip the update
        self.adam.step()
        with torch.no_grad():
            for bucket, shard, low_precision in self._master_shards:
                if low_precision:
                    bucket.param_data[bucket.shard[0]:bucket.shard[1]].copy_(shard)  # fp32 -> 16-bit
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
        return StepOutcome(True, grad_norm, "ok")

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
            for bucket, shard, low_precision in self._master_shards:
                if low_precision:
                    shard.copy_(bucket.param_data[bucket.shard[0]:bucket.shard[1]])

    # ---- checkpoints: by parameter name, any layout ----
    def state_dict(self):
        """{"step", "params": {name: {"range", "exp_avg", "exp_avg_sq"[, "master"]}}, "grad_scaler"}:
        this rank's pieces. Masters are stored for 16-bit runs only (fp32: they are the parameters)."""
        params = {}
        for pc in self.pieces:
            entry = {"range": [pc.start, pc.end]}
            adam_state = self.adam.state.get(pc.master, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in adam_state:
                    entry[key] = adam_state[key].detach().cpu().clone()
            if self.low_precision:
                entry["master"] = pc.master.detach().cpu().clone()
            params[pc.name] = entry
        steps = [float(s["step"]) for s in self.adam.state.values() if "step" in s]
        return {"step": steps[0] if steps else 0.0, "params": params,
                "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, states):
        """`states`: one state_dict or a list of them (ZeRO-1: every DP rank's shard, in any number). Each
        of this rank's pieces is cut out of the saved ranges of its parameter; a missing name raises
        KeyError. The fp32 masters of a 16-bit run come from the saved masters, or else the parameters."""
        states = states if isinstance(states, list) else [states]
        step = states[0]["step"]
        for pc in self.pieces:
            saved = [s["params"][pc.name] for s in states if pc.name in s["params"]]
            if not saved:
                raise KeyError(f"the checkpoint's optimizer has no state for {pc.name}")
            entry = {key: _cut(saved, key, pc.start, pc.end) for key in ("exp_avg", "exp_avg_sq", "master")
                     if all(key in e for e in saved)}
            with torch.no_grad():
                if "master" in entry:
                    pc.master.copy_(entry["master"])
                else:
                    pc.master.copy_(pc.param.detach().reshape(-1)[pc.start:pc.end])
            if "exp_avg" in entry and step > 0:
                self.adam.state[pc.master] = {
                    "step": torch.tensor(step, dtype=torch.float32, device=pc.master.device),
                    "exp_avg": entry["exp_avg"].to(pc.master.device),
                    "exp_avg_sq": entry["exp_avg_sq"].to(pc.master.device)}
        with torch.no_grad():
            for bucket, shard, low_precision in self._master_shards:
                if low_precision:
                    bucket.param_data[bucket.shard[0]:bucket.shard[1]].copy_(shard)
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


def build_optimizer(model_chunks, cfg, state: ParallelState = None, shared_embedding=None) -> MixedPrecisionOptimizer:
    """The gradient buckets of every model chunk (minibert.parallel.data_parallel) and AdamW over them.
    `model_chunks`: a model or a list of them (the interleaved pipeline's chunks); state None: one process."""
    state = state or ParallelState()
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    separate = ("embedding.word_embeddings.weight",) if state.pp > 1 else ()  # ZeRO shards align across stages
    grads = [DataParallelGrads(chunk, state, bucket_size=cfg.ddp_bucket_size,
                               distributed_optimizer=cfg.use_distributed_optimizer,
                               overlap=cfg.overlap_grad_reduce, separate=separate,
                               gradient_accumulation_fusion=cfg.gradient_accumulation_fusion)
             for chunk in chunks]
    scaler = None
    if cfg.fp16:
        scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale,
                                   cfg.loss_scale_window, cfg.hysteresis)
    return MixedPrecisionOptimizer(grads, state, weight_decay=cfg.weight_decay,
                                   betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                   clip_grad=cfg.clip_grad, loss_scaler=scaler, shared_embedding=shared_embedding)
