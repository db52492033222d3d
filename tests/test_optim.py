"""minibert.training.optim, lr_schedule and loss_scale against their oracles: megatron-core's LR scheduler and loss
scaler, PyTorch's AdamW and clip_grad_norm_; plus the fp16 skip / bf16 master-weight behaviour on small models."""
import io
import random

import pytest
import torch
import torch.nn as nn

from minibert.config import Config
from minibert.errors import UsageError
from minibert.model.bert import BertModel
from minibert.parallel.data_parallel import DataParallelGrads, finalize_model_grads
from minibert.parallel.state import ParallelState
from minibert.training.build import build_grad_buffers
from minibert.training.loss_scale import DynamicLossScaler
from minibert.training.lr_schedule import OptimizerParamScheduler, build_scheduler
from minibert.training.optim import MixedPrecisionOptimizer, build_optimizer


def finalized_step(opt, nonfinite_loss=None):
    """The trainer's order: finalize_model_grads (in one process: the last fold of the gradients into the
    fp32 buffers), then the update."""
    finalize_model_grads(opt.grads, opt.state)
    return opt.step(nonfinite_loss)


def use_kernel(optimizer, kernel):
    """kernel "torch": the plain optimizer (PyTorch's fused AdamW); "triton": the --adam-fusion lever,
    minibert/fast/adamw.py, run here under the interpreter (conftest sets TRITON_INTERPRET)."""
    if kernel == "triton":
        pytest.importorskip("triton")
        from minibert.fast.adamw import FusedAdamW
        optimizer.__class__ = FusedAdamW
    else:
        optimizer.__class__ = MixedPrecisionOptimizer
    return optimizer


def one_process_optimizer(model, kernel="torch", **kwargs):
    """The optimizer over one process's gradient buckets (what build_optimizer makes from a Config), with
    the update `kernel` (use_kernel)."""
    state = ParallelState()
    return use_kernel(MixedPrecisionOptimizer([DataParallelGrads(model, state)], state, **kwargs), kernel)


def tiny_bert_config(**overrides):
    settings = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=50,
                    micro_batch_size=2, global_batch_size=4, train_iters=10, lr=1e-3)
    cfg = Config(**{**settings, **overrides})
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = cfg.train_iters
    return cfg


class Tiny(nn.Module):
    """A Linear and a LayerNorm: decayed matrix, undecayed bias and LayerNorm weight."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.to(dtype)

    def forward(self, x):
        return self.norm(self.linear(x)).float().pow(2).sum()


# ---------------------------------------------------------------- LR schedule vs megatron-core
@pytest.mark.parametrize("style,warmup_fraction,warmup_iters", [
    ("linear", 0.1, None), ("cosine", 0.1, None), ("constant", None, 3), ("linear", None, 0),
    ("cosine", 0.013, None)])
def test_lr_schedule_matches_megatron(style, warmup_fraction, warmup_iters):
    from megatron.core.optimizer_param_scheduler import (
        OptimizerParamScheduler as MegatronScheduler,
    )
    G, decay_iters, train_iters = 16, 100, 130
    cfg = tiny_bert_config(lr=1e-4, min_lr=1e-5, lr_decay_style=style, lr_decay_iters=decay_iters,
                           lr_warmup_fraction=warmup_fraction, lr_warmup_iters=warmup_iters or 0,
                           global_batch_size=G, train_iters=train_iters)
    ours_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ours = build_scheduler(ours_opt, cfg)
    # Megatron's get_optimizer_param_scheduler, training by iterations: everything in samples.
    decay_steps = decay_iters * G
    warmup_steps = warmup_fraction * decay_steps if warmup_fraction is not None else warmup_iters * G
    ref_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = MegatronScheduler(ref_opt, init_lr=0.0, max_lr=1e-4, min_lr=1e-5, lr_warmup_steps=warmup_steps,
                            lr_decay_steps=decay_steps, lr_decay_style=style, start_wd=0.01, end_wd=0.01,
                            wd_incr_steps=train_iters * G, wd_incr_style="constant")
    for iteration in range(train_iters + 1):
        assert ours_opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"], iteration
        ours.step(G)
        ref.step(G)
    # Key points, written out: the first update runs at lr 0 when there is a warmup, the peak at the
    # end of the warmup, min_lr after the decay.
    fresh_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    fresh = build_scheduler(fresh_opt, cfg)
    assert fresh.get_lr() == (0.0 if warmup_steps > 0 else 1e-4)
    fresh.step(decay_steps + G)
    assert fresh.get_lr() == (1e-4 if style == "constant" else 1e-5)


def test_lr_schedule_state_dict_resumes():
    cfg = tiny_bert_config(lr=1e-3, min_lr=0.0, lr_warmup_iters=2, lr_decay_style="cosine")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, cfg)
    for _ in range(5):
        sched.step(cfg.global_batch_size)
    buffer = io.BytesIO()
    torch.save(sched.state_dict(), buffer)
    buffer.seek(0)
    opt2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, cfg)
    assert sched2.load_state_dict(torch.load(buffer, weights_only=True)) == []
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] != 0.0


def test_warmup_longer_than_decay_is_a_usage_error():
    cfg = tiny_bert_config(lr_warmup_iters=20, lr_decay_iters=10)
    with pytest.raises(UsageError, match="warmup"):
        build_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), cfg)


# ---------------------------------------------------------------- weight decay groups
KERNELS = pytest.mark.parametrize("kernel", ["torch", "triton"])  # PyTorch's fused AdamW; ours (interpreted)


@KERNELS
def test_no_weight_decay_on_biases_and_layernorm(kernel):
    model = BertModel(tiny_bert_config())
    opt = one_process_optimizer(model, lr=0.1, weight_decay=0.5, clip_grad=0.0, kernel=kernel)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # zero gradient: AdamW moves only by its weight decay
    assert finalized_step(opt)[0]
    for name, p in model.named_parameters():
        if name.endswith(".bias") or p.ndim == 1:
            assert torch.equal(p, before[name]), name
        else:  # decoupled decay: p <- p * (1 - lr * wd)
            torch.testing.assert_close(p, before[name] * (1 - 0.1 * 0.5), rtol=0, atol=1e-7)
    assert any(n.endswith("layernorm.weight") for n in before) and any(n.endswith(".bias") for n in before)


# ---------------------------------------------------------------- clipping and AdamW vs PyTorch
@KERNELS
def test_fp32_step_matches_pytorch_clip_and_adamw(kernel):
    model, reference = Tiny(), Tiny()
    ours = one_process_optimizer(model, lr=0.01, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6,
                                 clip_grad=0.5, kernel=kernel)
    decay = [reference.linear.weight]
    no_decay = [reference.linear.bias, reference.norm.weight, reference.norm.bias]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=0.01, betas=(0.8, 0.99), eps=1e-6)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 4) * 10  # large inputs: the gradient norm is well above 0.5
        ours.zero_grad()
        model(x).backward()
        ok, norm, _ = finalized_step(ours)
        ref_opt.zero_grad()
        reference(x).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        assert ok and norm.item() > 0.5
        torch.testing.assert_close(norm, ref_norm)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)


# ---------------------------------------------------------------- fp16 loss scaler
def megatron_scaler(initial, min_scale, window, hysteresis):
    """megatron-core's DynamicGradScaler with CPU tensors (its __init__ puts them on CUDA)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    ref = DynamicGradScaler.__new__(DynamicGradScaler)
    ref._scale = torch.tensor([initial])
    ref.min_scale, ref.growth_factor, ref.backoff_factor = (torch.tensor([min_scale]), torch.tensor([2.0]),
                                                            torch.tensor([0.5]))
    ref.growth_interval, ref.hysteresis = window, hysteresis
    ref._growth_tracker, ref._hysteresis_tracker = 0, hysteresis
    return ref


@pytest.mark.parametrize("hysteresis,window", [(2, 5), (1, 3), (4, 2)])
def test_loss_scaler_matches_megatron(hysteresis, window):
    rng = random.Random(hysteresis * 10 + window)
    ours = DynamicLossScaler(2.0 ** 10, 4.0, window, hysteresis)
    ref = megatron_scaler(2.0 ** 10, 4.0, window, hysteresis)
    for step in range(400):
        found_inf = rng.random() < 0.3
        ours.update(found_inf)
        ref.update(found_inf)
        assert ours.scale == ref._scale.item(), step
        assert (ours.growth_tracker, ours.hysteresis_tracker) == (ref._growth_tracker, ref._hysteresis_tracker)


def test_loss_scaler_hysteresis_window_and_min():
    s = DynamicLossScaler(initial_scale=1024.0, min_scale=256.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 1024.0        # first overflow: tolerated
    s.update(True)
    assert s.scale == 512.0         # second: halved
    s.update(True)
    assert s.scale == 256.0         # hysteresis used up: every overflow halves
    s.update(True)
    assert s.scale == 256.0         # but never below min_scale
    for _ in range(2):
        s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 512.0 and s.hysteresis_tracker == 2  # 3 clean steps: doubled, hysteresis restored
    s.update(True)
    assert s.scale == 512.0         # tolerated again


@KERNELS
def test_fp16_overflow_skips_the_step(kernel):
    model = Tiny(torch.float16)
    scaler = DynamicLossScaler(initial_scale=2.0 ** 32, min_scale=1.0, growth_interval=1000, hysteresis=2)
    opt = one_process_optimizer(model, lr=0.1, loss_scaler=scaler, kernel=kernel)
    sched = OptimizerParamScheduler(opt, max_lr=0.1, min_lr=0.0, warmup_steps=0, decay_steps=100,
                                    decay_style="linear")
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in opt.master_params]
    x = torch.full((2, 4), 3.0, dtype=torch.float16)
    results = []
    for _ in range(2):
        opt.zero_grad()
        opt.scale_loss(model(x)).backward()  # x 2^32 overflows fp16's 65504
        results.append(finalized_step(opt))
    assert [r[:2] for r in results] == [(False, None), (False, None)]
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_params))
    assert scaler.scale == 2.0 ** 31  # one overflow tolerated (hysteresis 2), the second halved
    assert sched.num_steps == 0 and opt.param_groups[0]["lr"] == 0.1
    # AdamW was queued both times and told to skip on the device (found_inf): moments and step count untouched
    assert opt.steps_made == 0 and not any(pc.exp_avg.any() or pc.exp_avg_sq.any() for pc in opt.pieces)
    assert all(pc.step.item() == 0 for pc in opt.pieces)  # PyTorch's step counts (the torch kernel's)
    scaler.scale = 2.0 ** 4           # a scale that fits: the step happens, unscaled
    opt.zero_grad()
    opt.scale_loss(model(x)).backward()
    ok, norm, _ = finalized_step(opt)
    assert ok and torch.isfinite(norm) and not torch.equal(params[0], model.linear.weight)
    assert opt.steps_made == 1 and all(pc.exp_avg.any() for pc in opt.pieces)
    assert all(pc.step.item() == (1 if kernel == "torch" else 0) for pc in opt.pieces)
    # the grad norm is of the unscaled gradient: compare with fp32 autograd on the same weights
    reference = Tiny()
    reference.load_state_dict({k: v.float() for k, v in zip(reference.state_dict(), params)})
    reference(x.float()).backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    torch.testing.assert_close(norm, ref_norm, rtol=2e-2, atol=0)


# ---------------------------------------------------------------- bf16 with fp32 masters
@KERNELS
def test_bf16_masters_stay_fp32_and_accumulate_in_fp32(kernel):
    model = Tiny(torch.bfloat16)
    opt = one_process_optimizer(model, lr=1e-3, clip_grad=0.0, kernel=kernel)
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    xs = [torch.randn(3, 4, dtype=torch.bfloat16) for _ in range(2)]
    single = []
    for x in xs:  # each micro-batch's bf16 grads from a twin without the optimizer's hooks
        twin = Tiny(torch.bfloat16)
        twin(x).backward()
        single.append([p.grad.float() for p in twin.parameters()])
    opt.zero_grad()
    for x in xs:
        opt.scale_loss(model(x)).backward()
        opt.grads[0].accumulate()  # what the schedules do after each backward: folded into fp32
    opt.grads[0].finish()
    for i, p in enumerate(model.parameters()):  # the fp32 main-grad buffer holds the sum of both
        torch.testing.assert_close(p.main_grad, single[0][i] + single[1][i], rtol=0, atol=0)
    assert all(p.grad is None for p in model.parameters())  # folded into main_grad, the 16-bit grads freed
    # Why masters: AdamW moves a weight by ~lr = 1e-3 per step, less than half of bf16's spacing
    # near 1.0 (2^-7). Straight on bf16 weights every update rounds away; the fp32 masters add up.
    plain = Tiny(torch.bfloat16)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(20):
        plain_opt.zero_grad()
        plain(xs[0]).backward()
        plain_opt.step()
        opt.zero_grad()
        model(xs[0]).backward()
        finalized_step(opt)
    assert torch.equal(plain.norm.weight, torch.ones(3, dtype=torch.bfloat16))
    assert (model.norm.weight.float() - 1.0).abs().max() > 2.0 ** -7
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    for p, m in zip(model.parameters(), opt.master_params):
        assert p.dtype == torch.bfloat16
        if kernel == "torch":
            assert torch.equal(p, m.to(torch.bfloat16))
        else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest (tests/gpu: bit for bit)
            assert ((p.float() - m).abs() <= m.abs() * 2.0 ** -7).all()


def test_a_steps_first_fold_copies_and_zeroes_what_got_no_gradient():
    """zero() writes nothing: the step's first accumulate() copies each 16-bit gradient into its fp32
    main_grad (whatever was there before) and zeroes the main_grad of a parameter the micro-batch did not
    reach; the next accumulate() adds. Exactly what zeroing first and adding gives."""
    model = Tiny(torch.bfloat16)
    opt = one_process_optimizer(model, lr=1e-3, clip_grad=0.0)
    grads = opt.grads[0]
    for bucket in grads.buckets:
        bucket.grad_data.fill_(3.0)  # a previous step's gradients
    opt.zero_grad()
    assert grads.fresh and all(bucket.grad_data.eq(3.0).all() for bucket in grads.buckets)  # nothing written
    params = list(model.parameters())
    xs = [torch.randn(3, 4, dtype=torch.bfloat16) for _ in range(2)]
    opt.scale_loss(model(xs[0])).backward()  # the 16-bit gradients: nothing in the buffers yet
    assert grads.fresh and all(bucket.grad_data.eq(3.0).all() for bucket in grads.buckets)
    params[0].grad = None  # as if this micro-batch had not reached the first parameter
    first = [torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float() for p in params]
    grads.accumulate()
    assert not grads.fresh
    for p, expected in zip(params, first):
        torch.testing.assert_close(p.main_grad, expected, rtol=0, atol=0)
    model(xs[1]).backward()
    second = [p.grad.float() for p in params]
    grads.accumulate()
    for p, a, b in zip(params, first, second):
        torch.testing.assert_close(p.main_grad, a + b, rtol=0, atol=0)
    opt.zero_grad()
    grads.finish()  # a step in which no gradient arrived: zeros
    assert not grads.fresh and all(bucket.grad_data.eq(0).all() for bucket in grads.buckets)
    eager = DataParallelGrads(Tiny(torch.bfloat16), ParallelState(dp=2), overlap=True)
    assert not eager.copy_first  # there the overlap hook adds into main_grad before any fold: zeroed at once
    eager.buckets[0].grad_data.fill_(3.0)
    eager.zero()
    assert all(bucket.grad_data.eq(0).all() for bucket in eager.buckets) and not eager.fresh


@pytest.mark.parametrize("save_kernel,load_kernel", [("torch", "torch"), ("triton", "torch"), ("torch", "triton")])
def test_optimizer_state_dict_roundtrip_weights_only(save_kernel, load_kernel):
    """A checkpoint does not depend on the kernel: saved by one, resumed by the other, the same steps."""
    cfg = tiny_bert_config(bf16=True, fp16=False)
    torch.manual_seed(0)
    model = BertModel(cfg).to(torch.bfloat16)
    opt = build_optimizer(build_grad_buffers(model, cfg), cfg)
    use_kernel(opt, save_kernel)
    tokens = torch.randint(0, 50, (2, 8))

    def step(m, o):
        o.zero_grad()
        m(tokens).lm_logits.float().logsumexp(-1).mean().backward()
        return finalized_step(o)

    step(model, opt)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    model2 = BertModel(cfg).to(torch.bfloat16)
    model2.load_state_dict(loaded["model"])
    opt2 = build_optimizer(build_grad_buffers(model2, cfg), cfg)
    use_kernel(opt2, load_kernel)
    opt2.load_state_dict(loaded["optimizer"])
    assert opt2.steps_made == 1
    use_kernel(opt, load_kernel)
    step(model, opt)
    step(model2, opt2)
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
