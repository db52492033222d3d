"""fp16's dynamic loss scale: how a run finds the largest scale its gradients survive.

fp16 has a small range (largest 65504, smallest normal 6e-5), so many gradients underflow to 0. The
loss is multiplied by a scale S before the backward (every gradient is then S times larger) and the
optimizer divides the gradients by S before using them. Too large an S and some gradient overflows to
inf: that step is skipped and S shrinks; after many clean steps S grows again. The scale therefore
hovers just under the largest value the gradients tolerate. bf16 has fp32's range and needs none of this.

What production does: Megatron's DynamicGradScaler is this rule (its names: hysteresis, growth
interval, backoff factor); PyTorch's torch.amp.GradScaler is the same idea without hysteresis."""


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
