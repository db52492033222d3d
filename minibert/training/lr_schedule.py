"""The learning-rate schedule: linear warmup, then linear or cosine decay to --min-lr, counted in samples.

Megatron counts the schedule in samples, not iterations, even when training by iterations: each
successful update adds the global batch size, so a run whose batch size changes keeps its schedule.
A skipped update (an fp16 overflow) does not advance it."""
import math

from minibert.errors import UsageError


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
