"""FP8 training of the transformer layers' matrix products (--fp8-format), as Megatron runs it through
NVIDIA Transformer Engine (TE): the four Linears of every layer multiply FP8 operands on the GPU's FP8
matrix units, everything else stays in bf16.

Two FP8 formats. A float is sign x 2^exponent x 1.mantissa; with 8 bits there are two sensible splits:

    e4m3  s eeee mmm   largest 448      8 steps per power of 2 (relative step 1/8)     smallest normal 2^-6
    e5m2  s eeeee mm   largest 57344    4 steps per power of 2 (relative step 1/4)     smallest normal 2^-14

e4m3 is the more precise, e5m2 reaches further (the "fn" of torch.float8_e4m3fn: no infinities, which
buys it the top values up to 448). --fp8-format e4m3 uses e4m3 for everything; hybrid (the usual choice)
keeps e4m3 for activations and weights and gives the gradients of the outputs, whose values spread over
more powers of 2, e5m2.

Why a scale per tensor. Either format covers only a few powers of 2 around 1, while a layer's tensors sit
wherever their magnitudes put them (weights near 0.02, gradients near 1e-6). So each tensor is multiplied
by a scale before the cast, chosen so that its largest magnitude, its amax, lands at the format's top:

    scale = fp8_max / amax / 2^margin            x8 = cast(x * scale)          x ~ x8 / scale

    |x|:   0 ........................ amax            values of the tensor
             \\                          \\  x scale
    fp8:   0 ... 2^-9 ... 1 ... 2^8 .. 448           what e4m3 can hold

The product of two scaled operands is unscaled in the GEMM's fp32 epilogue: torch._scaled_mm takes the
inverse scales (scale_a, scale_b) and writes a bf16 (the input's dtype) result. The scale is one fp32 number
per tensor ("tensorwise"); finer recipes (per block: mxfp8, blockwise) are left out.

Where the scale comes from, the two recipes of --fp8-recipe:

    tensorwise (current scaling)   amax of this tensor, now: one extra pass over it before the cast
    delayed                        amax of the same tensor in earlier steps: the cast needs no pass of
                                   its own to find the amax, which is recorded while casting
                                   (minibert/fast/fp8_cast.py: one pass over the tensor)

    step:                 t-2      t-1       t        (delayed)
    amax history:        [a_t-2]  [a_t-1]            <- each step's largest amax, reduced over the ranks
    scale used at t:     fp8_max / (max or most recent of the history) / 2^margin

Delayed scaling bets that a tensor's range changes slowly; a tensor that grows past its history's amax
saturates at fp8_max for a step (the cast clamps) until the history catches up. Per FP8 linear it keeps
three histories (input, weight, gradient of the output), --fp8-amax-history-len steps each, chosen by
--fp8-amax-compute-algo (max of the history or its most recent entry). During a step every micro-batch
only records its amaxes (a running max); fp8_step, called by the trainer once per optimizer step after the
gradients are reduced, takes the max over the tensor- and data-parallel ranks (so every layout computes the
one-process run's scales), rolls the histories and computes the next step's scales. A tensor with no
history yet (a fresh run's first step, or a run resumed from a checkpoint without FP8 state) is scaled by
its own current amax; TE starts from scale 1 instead, which would flush small gradients to zero for a step.

The state (amax histories, scales) is fp32 buffers of each FP8 linear, named fp8_*: it lives on the device,
is updated in place, and is saved in the model's state dict, so a checkpoint resumes exactly
(minibert/training/resume.py: a checkpoint without it loads with a warning and fresh state; the
weights-only loaders leave it out). With --cuda-graph-impl local a captured micro-batch reads the scales
and records its amaxes at their fixed addresses, and fp8_step runs between replays, outside the graphs
(the graphs' warm-up run records the amaxes of the micro-batch replayed next: the same maximum).

Layouts. Delayed scales are the one-process run's (amaxes maxed over the ranks), except in the first step,
where each rank scales by what it holds. Tensorwise scaling has no collective: under tensor parallelism
each rank scales its own shard (of a weight, of a row-parallel layer's input) by the shard's amax, so its
numbers differ from the one-process run's by FP8 rounding.

What stays in bf16, as in Megatron with TE: the embeddings and the LM head (the vocab-sized matrices, where
the loss is most sensitive to rounding), the pooler and SOP head (tiny), the attention core (softmax(QK^T)V
is a product of activations, not of weights; TE has an FP8 attention of its own, off by default), and the
LayerNorms. The weights themselves, their fp32 main gradients, and the optimizer are untouched: the FP8
copies live only inside a product.

The GPU's FP8 GEMM (cuBLASLt) has rules the CPU's torch._scaled_mm does not check, so `scaled_mm` checks
them here and the CPU tests run the GPU's layouts: the first operand row-major, the second column-major;
the inner dimension and the second operand's other one multiples of 16; never e5m2 x e5m2. For y = x W^T:

    forward   y  [m, n] = x8 [m, k]      @ W8^T [k, n]       W8 [n, k] row-major: its .t() is column-major
    dgrad     dx [m, k] = g8 [m, n]      @ W8   [n, k]       the column-major W8 is a transposed copy
    wgrad     dW [n, k] = g8^T [n, m']   @ x8   [m', k]      m rounded up to m' (16s) with zero rows

The forward product accumulates in the matrix units' fast mode, the backward's two in fp32 all along: TE's
and torchao's defaults (the gradients, whose errors the optimizer sums up over the steps, get the exact
sums). bench/fp8_steps.py's numerics check trains with this choice.

k and n are hidden and FFN sizes (over TP), which validate.py requires in 16s; the token count m is
whatever a packed micro-batch holds, so the weight gradient's inner dimension is padded. The bias
gradient is the row sum of the bf16 gradient (fast/linear.py's GEMV), not of its FP8 copy.

The casts. On a GPU each cast is one pass (minibert/fast/fp8_cast.py: read the 16-bit tensor once; write
its FP8 copy, the transposed copy that the backward's product needs, and the amax); the same casts written
as PyTorch ops are its plain twin (fp8_plain_casts), and the CPU path. The weight's copies are made once per
optimizer step and reused by the step's later micro-batches (with CUDA graphs too: cast_weights makes them
before a step's replays, which only read them). Only the transposed copies of the input and
the weight are kept for the backward.

The plain twin of the whole is the bf16 Linear that runs without --fp8-format. What is not here: the cast
fused into the kernel that produces the activation (the LayerNorm before QKV and fc1, the GeLU before fc2),
as Transformer Engine does, and sequence parallelism's gather in FP8 (here the bf16 input is gathered and
its FP8 copy of the whole sequence is kept for the weight gradient)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minibert.fast import linear as fast_linear
from minibert.parallel.layers import ColumnParallelLinear, RowParallelLinear
from minibert.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from minibert.parallel.state import all_reduce
from minibert.training.build import as_chunks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448, 57344
INPUT, WEIGHT, GRAD = 0, 1, 2  # the three tensors of an FP8 linear: one amax history and scale each
MULTIPLE = 16  # what the FP8 GEMM's dimensions must be multiples of


@dataclass(frozen=True)
class Recipe:
    """How an FP8 linear picks its formats and scales (the --fp8-* flags)."""
    format: str = "hybrid"       # e4m3 | hybrid                  (--fp8-format)
    scaling: str = "delayed"     # delayed | tensorwise           (--fp8-recipe)
    history_len: int = 1
    algo: str = "most_recent"    # max | most_recent
    margin: int = 0

    @classmethod
    def of(cls, cfg):
        return cls(cfg.fp8_format, cfg.fp8_recipe, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo,
                   cfg.fp8_margin)

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    def dtype(self, which):
        """The FP8 format of tensor `which` (INPUT, WEIGHT, GRAD)."""
        return E5M2 if which == GRAD and self.format == "hybrid" else E4M3


def scale_from_amax(amax, dtype, margin=0, otherwise=1.0):
    """fp8_max / amax / 2^margin (fp32), or `otherwise` (a number or a tensor) where that is no scale at all:
    amax 0 (an all-zero tensor), or not finite."""
    scale = FP8_MAX[dtype] / amax.float() * 2.0 ** -margin
    usable = torch.isfinite(scale) & (scale > 0)
    return torch.where(usable, scale, otherwise)


def largest_magnitude(t):
    """max |t| in fp32, in one pass over t (no |t| written out first: the infinity norm)."""
    return torch.linalg.vector_norm(t.detach(), float("inf")).float()


def quantize(t, dtype, scale):
    """t * scale, saturated to the format's range, cast to FP8 (a value past the top clamps, as TE's cast)."""
    limit = FP8_MAX[dtype]
    return (t.float() * scale).clamp_(-limit, limit).to(dtype)


def scaled_mm(a, b, a_inverse, b_inverse, out_dtype, bias=None, fast_accumulation=False):
    """a [m, k] @ b [k, n] of FP8 operands, each times its inverse scale, accumulated in fp32 -> [m, n] in
    out_dtype (+ bias, in the epilogue where the GPU allows it: a bias of the output's 16-bit dtype).
    fast_accumulation: let the matrix units keep their running sums over the whole k (on Hopper, fewer
    bits than fp32) instead of adding them into fp32 every few steps of k: faster, less exact.
    Checks the GPU's rules (module docstring) so that the CPU, where torch._scaled_mm takes anything, runs
    the layouts the GPU needs."""
    if a.dtype == E5M2 and b.dtype == E5M2:
        raise ValueError("an FP8 GEMM takes no two e5m2 operands")
    if a.stride() != (a.shape[1], 1) or b.stride() != (1, b.shape[0]):
        raise ValueError(f"an FP8 GEMM takes a row-major first operand and a column-major second one, got "
                         f"strides {a.stride()} and {b.stride()}")
    if a.shape[1] % MULTIPLE or b.shape[1] % MULTIPLE:
        raise ValueError(f"an FP8 GEMM takes dimensions in multiples of {MULTIPLE}, got [{a.shape[0]}, "
                         f"{a.shape[1]}] @ [{b.shape[0]}, {b.shape[1]}]")
    epilogue = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(a, b, scale_a=a_inverse, scale_b=b_inverse, bias=bias if epilogue else None,
                         out_dtype=out_dtype, use_fast_accum=fast_accumulation)
    return y if bias is None or epilogue else y + bias


class FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with both products of the backward in FP8 too (module docstring). `module` is the FP8
    linear whose recipe and state give the scales; record: note this forward's amaxes (training)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, record):
        rows = x.reshape(-1, x.shape[-1])  # [m, k]
        m, padded = rows.shape[0], rows.shape[0] + (-rows.shape[0] % MULTIPLE)  # m': the wgrad's 16s
        wgrad = record and weight.requires_grad  # (grad mode is off inside forward: record says it was on)
        x8, x8_t, x_inverse = module.fp8_quantize(rows, INPUT, record, padded, transpose=wgrad)  # [m', k], [k, m']
        w8, w8_t, w_inverse = module.fp8_weight(weight, record)  # [n, k], [k, n]
        y = scaled_mm(x8[:m], w8.t(), x_inverse, w_inverse, x.dtype, bias, fast_accumulation=True)  # [m, n]
        ctx.save_for_backward(x8_t, w8_t, x_inverse, w_inverse)  # FP8 copies: 1 byte an element
        ctx.module, ctx.has_bias, ctx.x_shape, ctx.weight_dtype = module, bias is not None, x.shape, weight.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x8_t, w8_t, x_inverse, w_inverse = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # [m, n]
        m = grad_rows.shape[0]
        g8, g8_t, g_inverse = ctx.module.fp8_quantize(grad_rows, GRAD, True, m + (-m % MULTIPLE), transpose=True)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # dx = g W: W [n, k] column-major is the row-major [k, n] transposed
            grad_x = scaled_mm(g8[:m], w8_t.t(), g_inverse, w_inverse, grad.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # dW = g^T x, over the m' (padded) rows: x [m', k] column-major is x^T
            grad_w = scaled_mm(g8_t, x8_t.t(), g_inverse, x_inverse, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = fast_linear.bias_grad(grad_rows)
        return grad_x, grad_w, grad_b, None, None


class FP8Scaling:
    """What the FP8 twins add to their plain class: the recipe and, for the delayed one, its state."""
    fp8_plain_casts = False  # True: cast with PyTorch ops even on a GPU (the casts' plain twin; benches)

    def fp8_setup(self, recipe: Recipe):
        self.fp8_recipe = recipe
        self.fp8_steps = 0  # optimizer steps seen (fp8_step): the weight's FP8 copy is made once per step
        self.fp8_weight_copy = None  # w8, w8^T, inverse scale: made by the first cast, then cast into
        self.fp8_weight_key = None  # (weight version, step) the copy was cast at
        self.fp8_fresh = True  # no fp8_step yet: the stored scales may be missing (0)
        if recipe.delayed:
            device = self.weight.device
            # rows: steps, newest first; columns: INPUT, WEIGHT, GRAD
            self.register_buffer("fp8_amax_history", torch.zeros(recipe.history_len, 3, device=device))
            self.register_buffer("fp8_scale", torch.zeros(3, device=device))  # 0: no history yet
            self.register_buffer("fp8_amax", torch.zeros(3, device=device), persistent=False)  # this step's
            # 1 / fp8_scale, made by fp8_step with the scales: a cast needs no kernel to invert its scale.
            # A row of 64 each, column 0 used: cuBLASLt refuses a scale that sits a few bytes into a
            # tensor (CUBLAS_STATUS_NOT_SUPPORTED), so each starts 256 bytes on, as a tensor of its own would
            self.register_buffer("fp8_scale_inverse", torch.zeros(3, 64, device=device), persistent=False)

    def fp8_quantize(self, t, which, record, rows=None, transpose=False, out=None):
        """t [m, k] -> (t in FP8 [rows, k] (zero rows added past m), its transpose [k, rows] or None, the
        inverse of its scale): the recipe's scale for tensor `which`. Delayed: the stored scale, and with
        `record` this amax goes into the step's running max, in the cast's own pass; before the first
        fp8_step, a stored scale may be missing, so the tensor's current amax stands in (one more pass).
        out: an earlier result to write this one into (same shapes). Every update is in place, on the
        device: nothing waits for the host."""
        dtype, recipe = self.fp8_recipe.dtype(which), self.fp8_recipe
        slot = slice(which, which + 1)
        if recipe.delayed and not self.fp8_fresh:
            scale, amax = self.fp8_scale[slot], self.fp8_amax[slot] if record else None
            inverse = self.fp8_scale_inverse[which, :1]
        else:
            current = largest_magnitude(t).reshape(1)
            scale, amax = scale_from_amax(current, dtype, recipe.margin), None
            if recipe.delayed:
                if record:
                    torch.maximum(self.fp8_amax[slot], current, out=self.fp8_amax[slot])
                scale = torch.where(self.fp8_scale[slot] > 0, self.fp8_scale[slot], scale)
            inverse = scale.reciprocal()
        rows = t.shape[0] if rows is None else rows
        if t.is_cuda and not self.fp8_plain_casts:  # one pass (minibert/fast/fp8_cast.py)
            from minibert.fast import fp8_cast  # Triton is imported where it runs
            t8, t8_t = fp8_cast.cast(t.detach(), dtype, scale, FP8_MAX[dtype], amax, rows, transpose,
                                     *(out[:2] if out else ()))
        else:  # the plain twin: a PyTorch op per step
            if amax is not None:
                torch.maximum(amax, largest_magnitude(t), out=amax)
            t8 = quantize(F.pad(t.detach(), (0, 0, 0, rows - t.shape[0])), dtype, scale)
            t8_t = t8.t().contiguous() if transpose else None
            if out:
                t8, t8_t = out[0].copy_(t8), out[1].copy_(t8_t) if transpose else None
        return t8, t8_t, out[2].copy_(inverse) if out else inverse

    def fp8_weight(self, weight, record):
        """The weight's FP8 copy, its transpose (dgrad's operand) and its inverse scale. In training
        (record) cast once per optimizer step, into the same tensors all run long: a step's later
        micro-batches reuse the first one's (the weight and its scale change only between steps), and CUDA
        graphs read them where they stay (minibert/fast/cuda_graphs.py casts them before a step's replays:
        cast_weights). An evaluation between two steps casts a copy of its own and records nothing."""
        key = (weight._version, self.fp8_steps)
        if self.fp8_weight_key == key:
            return self.fp8_weight_copy
        if not record:
            return self.fp8_quantize(weight, WEIGHT, False)
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an FP8 weight cast inside a CUDA graph: call fp8.cast_weights(model) first")
        copy = self.fp8_quantize(weight, WEIGHT, True, transpose=True, out=self.fp8_weight_copy)
        if self.fp8_weight_copy is None:  # the first cast: its inverse scale may be a view of fp8_scale_inverse
            copy = (copy[0], copy[1], copy[2].clone())
        self.fp8_weight_copy, self.fp8_weight_key = copy, key
        return copy

    def fp8_linear(self, x, bias):
        return FP8LinearFunction.apply(x, self.weight, bias, self, torch.is_grad_enabled())


class FP8Linear(FP8Scaling, nn.Linear):
    def forward(self, x):
        return self.fp8_linear(x, self.bias)


class FP8ColumnLinear(FP8Scaling, ColumnParallelLinear):
    """The column-parallel twin: f (or, with sequence parallelism, the gather whose backward reduce-scatters),
    the FP8 product with this rank's output features, the optional gather."""

    def forward(self, x):
        if self.sequence_parallel and self.group is not None:
            x = gather_from_sequence_parallel_region(x, self.group)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
        y = self.fp8_linear(x, self.bias)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y


class FP8RowLinear(FP8Scaling, RowParallelLinear):
    """The row-parallel twin: the FP8 product of this rank's input features, summed over the ranks (or
    reduce-scattered), and the bias added once, after the sum."""

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        partial = self.fp8_linear(x, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


LAYER_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
TWINS = {nn.Linear: FP8Linear, fast_linear.Linear: FP8Linear, ColumnParallelLinear: FP8ColumnLinear,
         fast_linear.ColumnLinear: FP8ColumnLinear, RowParallelLinear: FP8RowLinear}


def apply(chunk, cfg):
    """The four Linears of every transformer layer of a built model chunk -> their FP8 twins, with the
    recipe of cfg's --fp8-* flags (parameters and names kept; the delayed recipe adds its buffers)."""
    recipe = Recipe.of(cfg)
    for layer in chunk.layers.values():
        for name in LAYER_LINEARS:
            module = layer.get_submodule(name)
            module.__class__ = TWINS[type(module)]
            module.fp8_setup(recipe)
    return chunk


def cast_weights(model):
    """Every FP8 linear's weight copies for the coming micro-batches, cast now (CUDA graphs' replays read
    them: a graph records no weight cast of its own). `model`: a chunk or a list."""
    for chunk in as_chunks(model):
        for m in chunk.modules():
            if isinstance(m, FP8Scaling):
                m.fp8_weight(m.weight, True)


def any_fresh(model) -> bool:
    """Whether an FP8 linear of `model` (a chunk or a list) has not seen an fp8_step yet."""
    return any(getattr(m, "fp8_fresh", False) for chunk in as_chunks(model) for m in chunk.modules())


def fp8_step(model, state=None):
    """The delayed recipe's update, once per optimizer step, after the step's last backward: each FP8
    linear's amaxes of the step (a running max over its micro-batches), maxed over the tensor- and
    data-parallel ranks, become the newest row of its histories; the oldest row drops out; the next step's
    scales come from the histories. `model`: a chunk or a list; state: the ParallelState (None: one process).
    All the model's FP8 linears at once, in a few kernels, in place."""
    every = [m for chunk in as_chunks(model) for m in chunk.modules() if isinstance(m, FP8Scaling)]
    for m in every:
        m.fp8_steps += 1  # the weights change next: their FP8 copies are made again
        m.fp8_fresh = False
    modules = [m for m in every if m.fp8_recipe.delayed]
    if not modules:
        return
    recipe = modules[0].fp8_recipe
    amax = torch.stack([m.fp8_amax for m in modules])  # [linears, 3]: one collective per group for all
    if state is not None:
        for kind in ("tensor", "data"):
            all_reduce(amax, state.group(kind), op=dist.ReduceOp.MAX)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))  # an inf or NaN step: no entry
    history = torch.stack([m.fp8_amax_history for m in modules])  # [linears, steps, 3]
    history = torch.cat([amax[:, None], history[:, :-1]], dim=1)  # newest first
    chosen = history.amax(dim=1) if recipe.algo == "max" else history[:, 0]  # [linears, 3]
    old = torch.stack([m.fp8_scale for m in modules])
    old = torch.where(old > 0, old, torch.ones_like(old))  # a tensor with no amax yet: scale 1, as TE starts
    scale = torch.stack([scale_from_amax(chosen[:, i], recipe.dtype(i), recipe.margin, otherwise=old[:, i])
                         for i in (INPUT, WEIGHT, GRAD)], dim=1)  # no usable amax: the scale stays
    torch._foreach_copy_([m.fp8_amax_history for m in modules], list(history.unbind(0)))
    torch._foreach_copy_([m.fp8_scale for m in modules], list(scale.unbind(0)))
    torch._foreach_copy_([m.fp8_scale_inverse[:, 0] for m in modules], list(scale.reciprocal().unbind(0)))
    torch._foreach_zero_([m.fp8_amax for m in modules])
