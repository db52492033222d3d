"""The optimizer: AdamW on fp32 master weights, fp16 loss scaling, gradient clipping, the LR schedule.

Mixed precision the Megatron way. With --bf16 or --fp16 the model's parameters are 16-bit, so the
forward and backward run at 16-bit speed; the optimizer keeps an fp32 *master* copy of every parameter
and does all of its arithmetic there, because a 16-bit weight cannot absorb an update that is ~1e-4 of
its size (bf16 keeps 8 bits of mantissa: 1 + 2^-9 rounds back to 1).

    model params (bf16/fp16) --forward/backward--> param.grad (16-bit)
         ^                                              | hook after each micro-batch: main_grad += grad
         |                                              v                 (fp32, sums the micro-batches)
    copy back <-- AdamW <-- clip <-- grad norm <-- fp16 only: unscale, look for inf/NaN (skip the step)
                     (fp32 master params, fp32 main grads, fp32 Adam moments)

With fp32 the master params are the model's own parameters and nothing is copied.

fp16 has a small range (max 65504, smallest normal 6e-5), so small gradients underflow to 0. The loss is
multiplied by a large scale S before backward (every gradient is then S times larger) and the gradients
are divided by S before the update. If S is too large, a gradient overflows to inf: the step is skipped
and S shrinks; after many clean steps S grows again (DynamicLossScaler). bf16 has fp32's range: no scaling.

What production does: Megatron's distributed optimizer shards the master weights and Adam moments over
data-parallel ranks (ZeRO-1) and keeps the grads in one flat buffer per bucket for the all-reduce. The
arithmetic is the same; minibert keeps a tensor per parameter so each step can be read."""
import math

import torch

from minibert.errors import UsageError


class DynamicLossScaler:
    """fp16 loss scale with Megatron's DynamicGradScaler rules:

    - an overflow (inf/NaN in a gradient) resets the clean-step count and uses up one unit of
      hysteresis; once hysteresis is used up, every further overflow halves the scale (never below
      min_scale). The first `hysteresis - 1` overflows of a run of bad steps leave the scale alone.
    - `growth_interval` clean steps in a row double the scale and restore the hysteresis.

    Example with hysteresis 2: overflow (keep S), overflow (S/2), overflow (S/4), 1000 clean (2x)."""

    def __init__(self, initial_scale=2.0 ** 32, min_scale=1.0, growth_interval=1000, hysteresis=2,
                 growth_factor=2.0, backoff_factor=0.5):
        assert 0 < min_scale <= initial_scale and growth_factor > 1 and 0 < backoff_factor < 1
        assert growth_interval > 0 and hysteresis > 0
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval   # clean steps before the scale doubles
        self.hysteresis = hysteresis             # overflows tolerated before the scale halves
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_tracker = 0                  # clean steps in a row
        self.hysteresis_tracker = hysteresis     # overflows left before backing off

    def update(self, found_inf: bool):
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and every 1-D parameter (LayerNorm weights) are not decayed."""
    return name.endswith(".bias") or param.ndim == 1


def global_grad_norm(grads) -> torch.Tensor:
    """||g|| = sqrt(sum_i ||g_i||^2) over all parameters, in fp32, on the device (no host sync)."""
    if not grads:
        return torch.zeros(())
    per_tensor = torch._foreach_norm(grads)        # [||g_1||, ||g_2||, ...], 0-d tensors
    return torch.linalg.vector_norm(torch.stack(per_tensor))


class MixedPrecisionOptimizer:
    """AdamW (decoupled weight decay, as Megatron's 'adam') with fp32 master weights.

    Use per iteration: zero_grad(); for each micro-batch: scale_loss(loss / n).backward(); step().
    step() returns (update_successful, grad_norm): grad_norm is a 0-d device tensor, taken before
    clipping, or None when an fp16 overflow skipped the step."""

    def __init__(self, model: torch.nn.Module, *, lr=0.0, weight_decay=0.01, betas=(0.9, 0.999),
                 eps=1e-8, clip_grad=1.0, loss_scaler: DynamicLossScaler = None):
        self.clip_grad = clip_grad
        self.loss_scaler = loss_scaler
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # Two groups: decayed matrices, and biases + LayerNorm weights with no decay. The masters
        # are listed in the same order, so model_params[i] <-> master_params[i].
        decay = [p for n, p in named if not no_weight_decay(n, p)]
        no_decay = [p for n, p in named if no_weight_decay(n, p)]
        self.model_params = decay + no_decay
        self.low_precision = any(p.dtype != torch.float32 for p in self.model_params)
        if self.low_precision:
            self.master_params = [p.detach().clone().float() for p in self.model_params]
            for master in self.master_params:
                master.grad = torch.zeros_like(master)  # Megatron's "main_grad": fp32 accumulator
            self._hooks = [p.register_post_accumulate_grad_hook(self._make_main_grad_hook(m))
                           for p, m in zip(self.model_params, self.master_params)]
        else:
            self.master_params = self.model_params      # fp32: the masters are the params
        groups = [{"params": self.master_params[:len(decay)], "weight_decay": weight_decay},
                  {"params": self.master_params[len(decay):], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        # fused=True is one kernel for all of AdamW's elementwise work (CUDA only); CPU uses foreach.
        on_cuda = all(p.is_cuda for p in self.master_params)
        self.adam = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                                      **({"fused": True} if on_cuda else {}))

    @staticmethod
    def _make_main_grad_hook(master):
        def hook(param):
            master.grad.add_(param.grad)   # fp32 += 16-bit, once per micro-batch
            param.grad = None              # the 16-bit grad is no longer needed
        return hook

    @property
    def param_groups(self):
        return self.adam.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def zero_grad(self):
        if self.low_precision:
            torch._foreach_zero_([m.grad for m in self.master_params])
        else:
            for p in self.model_params:
                p.grad = None

    def master_grads(self):
        return [m.grad for m in self.master_params if m.grad is not None]

    def step(self):
        grads = self.master_grads()
        if self.loss_scaler is not None:
            # Unscale in place and look for inf/NaN in one pass. .item() is a host sync: the decision
            # to skip must reach the host (Megatron syncs here too). bf16/fp32 never sync in step().
            found_inf = torch.zeros(1, device=grads[0].device)
            inv_scale = torch.full((1,), 1.0 / self.loss_scaler.scale, device=grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            overflow = bool(found_inf.item())
            self.loss_scaler.update(overflow)
            if overflow:
                return False, None
        grad_norm = global_grad_norm(grads)
        if self.clip_grad > 0:
            # g <- g * min(1, clip / (||g|| + 1e-6)), computed on the device: no sync for the "if".
            clip_coef = torch.clamp(self.clip_grad / (grad_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, clip_coef)
        self.adam.step()
        if self.low_precision:
            with torch.no_grad():
                torch._foreach_copy_(self.model_params, self.master_params)  # fp32 -> 16-bit
        return True, grad_norm

    def state_dict(self):
        """Adam moments + master weights + the loss scaler: plain tensors, numbers, dicts, lists."""
        return {"adam": self.adam.state_dict(),
                "master_params": [m.detach() for m in self.master_params] if self.low_precision else None,
                "grad_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, state):
        self.adam.load_state_dict(state["adam"])
        # The fp32 masters are the truth: a 16-bit checkpoint resumed in fp32 takes them as the
        # params; a fp32 checkpoint resumed in 16-bit starts its masters from the loaded params.
        masters = state["master_params"] or [p.detach() for p in self.model_params]
        with torch.no_grad():
            for mine, saved in zip(self.master_params, masters, strict=True):
                mine.copy_(saved)
            if self.low_precision:
                torch._foreach_copy_(self.model_params, self.master_params)
        if self.loss_scaler is not None and state.get("grad_scaler") is not None:
            self.loss_scaler.load_state_dict(state["grad_scaler"])


class OptimizerParamScheduler:
    """The LR schedule of Megatron's OptimizerParamScheduler, counted in samples (as Megatron does
    when training by iterations: one step() per successful update adds the global batch size).

        lr
        max |      /‾‾‾‾‾‾‾‾\\                 warmup: init_lr + (max - init) * n / warmup
            |     /          \\                linear: min + (max - min) * (1 - r)
            |    /            \\               cosine: min + (max - min) * (1 + cos(pi r)) / 2
        min |   /               ‾‾‾‾‾‾‾‾‾     r = (n - warmup) / (decay - warmup); n > decay: min
            +---+------+----------+------> n (samples)
            0  warmup            decay

    The first update runs at n = 0, i.e. at init_lr (0 by default) when there is a warmup."""

    def __init__(self, optimizer, *, max_lr, min_lr, warmup_steps, decay_steps, decay_style,
                 init_lr=0.0):
        if not 0.0 <= min_lr <= max_lr:
            raise UsageError(f"--min-lr {min_lr} must be between 0 and --lr {max_lr}")
        if decay_steps <= 0 or warmup_steps >= decay_steps:
            raise UsageError("the LR warmup must be shorter than --lr-decay-iters: lower "
                             "--lr-warmup-iters / --lr-warmup-fraction or raise --lr-decay-iters")
        self.optimizer = optimizer
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.decay_style = decay_style
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * float(n) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        ratio = float(n - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:
            raise UsageError(f"--lr-decay-style {self.decay_style!r}: use linear, cosine or constant")
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int):
        """Advance by `increment` samples and set the LR of every parameter group."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self):
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "num_steps": self.num_steps}

    def load_state_dict(self, state):
        """Resume the step count; the schedule's shape comes from the current flags (as Megatron's
        --override-opt_param-scheduler), so a run can be extended. Returns the settings that differ."""
        differ = [k for k, v in self.state_dict().items() if k != "num_steps" and state.get(k) != v]
        self.num_steps = 0
        self.step(int(state["num_steps"]))
        return differ


def build_optimizer(model: torch.nn.Module, cfg) -> MixedPrecisionOptimizer:
    scaler = None
    if cfg.fp16:
        scaler = DynamicLossScaler(cfg.initial_loss_scale, cfg.min_loss_scale,
                                   cfg.loss_scale_window, cfg.hysteresis)
    return MixedPrecisionOptimizer(model, weight_decay=cfg.weight_decay,
                                   betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                   clip_grad=cfg.clip_grad, loss_scaler=scaler)


def build_scheduler(optimizer, cfg) -> OptimizerParamScheduler:
    """Megatron's iteration flags turned into sample counts (x global batch size)."""
    decay_steps = cfg.lr_decay_iters * cfg.global_batch_size
    if cfg.lr_warmup_fraction is not None:
        warmup_steps = cfg.lr_warmup_fraction * decay_steps
    else:
        warmup_steps = cfg.lr_warmup_iters * cfg.global_batch_size
    return OptimizerParamScheduler(optimizer, max_lr=cfg.lr, min_lr=cfg.min_lr,
                                   warmup_steps=warmup_steps, decay_steps=decay_steps,
                                   decay_style=cfg.lr_decay_style)
