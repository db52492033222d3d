"""minibert/fast/fp8.py: FP8 training of the layers' four Linears, on the CPU (torch._scaled_mm runs there).

The FP8 linear is checked against a float64 product of the *same* FP8 operands, dequantized: what is left
is the GEMM's fp32 accumulation and the output's rounding, so the tolerance is tight, and any wrong scale,
format, transposition or padding shows. Then the scales: the delayed recipe's follow its amax history (max
or most recent, with a margin), change once per optimizer step and not per micro-batch, and are maxed over
the tensor- and data-parallel groups; tensorwise takes the tensor's own amax. A negative control shows what
the scales are for. Then the run: validate's refusals, a tiny BERT trained through minibert.train.train
in bf16 and in FP8, an exact resume of an FP8 run, and checkpoints with and without FP8 state."""
import pytest
import torch
import torch.nn as nn

from minibert.config import Config
from minibert.fast import fp8
from minibert.fast import linear as fast_linear
from minibert.fast.fp8 import (
    E4M3,
    E5M2,
    FP8_MAX,
    GRAD,
    INPUT,
    WEIGHT,
    Recipe,
    quantize,
    scale_from_amax,
)
from minibert.fast.levers import apply_levers
from minibert.model.bert import BertModel
from minibert.parallel.layers import ColumnParallelLinear, RowParallelLinear
from minibert.tools import reshard
from minibert.train import train
from minibert.training import checkpoint, resume
from minibert.training.build import build_model_and_optimizer
from minibert.validate import validate
from tests import launch

SHAPE = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
         "--micro-batch-size", 2, "--train-iters", 10, "--lr", 1e-3]


def fp8_linear(recipe, k=32, n=48, dtype=torch.float32, seed=0):
    """An FP8Linear made as fp8.apply makes them: a built nn.Linear whose class is swapped."""
    torch.manual_seed(seed)
    module = nn.Linear(k, n).to(dtype)
    module.__class__ = fp8.FP8Linear
    module.fp8_setup(recipe)
    return module


def current_scale(t, dtype, margin=0):
    return scale_from_amax(t.detach().abs().amax(), dtype, margin)


def dequantized(t, dtype, scale):
    """The FP8 operand the product sees, back in float64: quantize(t) / scale."""
    return quantize(t.detach(), dtype, scale).double() / scale.double()


def run(module, x, dy):
    """-> y, dx, dW, db of one forward and backward."""
    x = x.clone().requires_grad_()
    module.zero_grad()
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, module.weight.grad, module.bias.grad


def reference(x, weight, bias, dy, scales, grad_dtype):
    """The same four in float64 from the FP8 operands dequantized (scales: input, weight, grad); the bias
    gradient from the 16-bit gradient itself."""
    xq = dequantized(x.reshape(-1, x.shape[-1]), E4M3, scales[INPUT])
    wq = dequantized(weight, E4M3, scales[WEIGHT])
    gq = dequantized(dy.reshape(-1, dy.shape[-1]), grad_dtype, scales[GRAD])
    y = xq @ wq.t() + bias.detach().double()
    return (y.view(*x.shape[:-1], -1), (gq @ wq).view(x.shape), gq.t() @ xq,
            dy.double().reshape(-1, dy.shape[-1]).sum(0))


def assert_close(actual, expected, rel, name=""):
    """Largest error within rel of the largest magnitude (what fp32 accumulation / a 16-bit output allow)."""
    error = float((actual.double() - expected).abs().max())
    assert error <= rel * float(expected.abs().max()), (name, error, float(expected.abs().max()))


def test_the_two_formats_by_hand():
    """e4m3 keeps 8 steps per power of 2 and tops out at 448, e5m2 4 steps and 57344; the cast rounds to the
    nearest step and clamps past the top; a scale moves the tensor into the range before the cast."""
    values = torch.tensor([1.1, 300.0, 1000.0, -1e6])
    assert quantize(values, E4M3, torch.tensor(1.0)).float().tolist() == [1.125, 288.0, 448.0, -448.0]
    assert quantize(values, E5M2, torch.tensor(1.0)).float().tolist() == [1.0, 320.0, 1024.0, -57344.0]
    scale = scale_from_amax(torch.tensor(1e-3), E4M3)  # 448 / 1e-3: 1e-3 lands on 448
    small = torch.tensor([1e-3, 4e-4])
    assert dequantized(small, E4M3, scale).tolist() == pytest.approx(small.tolist(), rel=1 / 16)
    # unscaled, they fall below e4m3's smallest step, 2^-9: the first nearly doubles, the second is gone
    assert quantize(small, E4M3, torch.tensor(1.0)).float().tolist() == [2.0 ** -9, 0.0]


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 16, 32), (37, 32)], ids=["batch", "packed-37-rows"])
def test_forward_and_gradients_are_the_float64_product_of_the_fp8_operands(fmt, dtype, shape):
    """y, dx, dW, db against float64 from the same FP8 operands (tensorwise: each tensor's own scale). 37
    packed rows: the weight gradient's inner dimension is padded to 48 with zero rows, which add nothing."""
    module = fp8_linear(Recipe(fmt, "tensorwise"), dtype=dtype)
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    dy = (1e-4 * torch.randn(*shape[:-1], 48, generator=g)).to(dtype)  # gradients are small: the scale's job
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    scales = [current_scale(x, E4M3), current_scale(module.weight, E4M3), current_scale(dy, grad_dtype)]
    ours = run(module, x, dy)
    expected = reference(x, module.weight, module.bias, dy, scales, grad_dtype)
    rel = 1e-5 if dtype == torch.float32 else 2.0 ** -7  # fp32 accumulation; a bf16 rounding or two
    for name, a, e in zip(("y", "dx", "dW", "db"), ours, expected):
        assert a.dtype == dtype and a.shape == e.shape, name
        assert_close(a, e, rel, name)
    plain = x.double() @ module.weight.detach().double().t() + module.bias.detach().double()
    assert float((ours[0].double() - plain).abs().max()) > 0.01 * float(plain.abs().max())  # FP8 rounds


def test_the_three_products_keep_the_gpus_operand_rules(monkeypatch):
    """What reaches torch._scaled_mm: the first operand row-major, the second column-major, inner
    dimensions in 16s (37 rows padded to 48 for the weight gradient), e5m2 only for the gradient."""
    calls = []
    original = torch._scaled_mm

    def recording(a, b, **kwargs):
        calls.append((tuple(a.shape), a.stride(), a.dtype, tuple(b.shape), b.stride(), b.dtype))
        return original(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    run(fp8_linear(Recipe("hybrid", "tensorwise")), torch.randn(37, 32), torch.randn(37, 48))
    assert calls == [((37, 32), (32, 1), E4M3, (32, 48), (1, 32), E4M3),    # y = x W^T
                     ((37, 48), (48, 1), E5M2, (48, 32), (1, 48), E4M3),    # dx = g W
                     ((48, 48), (48, 1), E5M2, (48, 32), (1, 48), E4M3)]   # dW = g^T x, 48 = 37 padded


def test_scaled_mm_refuses_what_the_gpu_refuses():
    a, b = torch.randn(32, 64).to(E4M3), torch.randn(48, 64).to(E4M3)  # b: a row-major [n, k] weight
    one = torch.tensor(1.0)
    assert fp8.scaled_mm(a, b.t(), one, one, torch.float32).shape == (32, 48)
    with pytest.raises(ValueError, match="column-major second"):
        fp8.scaled_mm(a, b.t().contiguous(), one, one, torch.float32)
    with pytest.raises(ValueError, match="row-major first"):
        fp8.scaled_mm(a.t().contiguous().t(), b.t(), one, one, torch.float32)
    with pytest.raises(ValueError, match="two e5m2"):
        fp8.scaled_mm(a.float().to(E5M2), b.t().float().to(E5M2), one, one, torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.scaled_mm(a[:, :40].contiguous(), b[:, :40].contiguous().t(), one, one, torch.float32)


@pytest.mark.parametrize("algo, margin", [("max", 0), ("most_recent", 2)])
def test_delayed_scales_follow_the_history_and_change_once_per_step(algo, margin):
    """Four steps of two micro-batches each: during a step the products use the scales of the steps before
    (the first step, with no history, each tensor's own), the micro-batches only record their amaxes; at
    the step boundary the history rolls and the scale becomes fp8_max / amax / 2^margin, the amax being the
    history's max or its newest entry. A forward without gradients (evaluation) records nothing."""
    recipe = Recipe("hybrid", "delayed", history_len=3, algo=algo, margin=margin)
    module = fp8_linear(recipe)
    g = torch.Generator().manual_seed(2)
    sizes = [(1.0, 2.0), (0.5, 0.25), (3.0, 1.0), (0.1, 0.2)]  # each micro-batch's input magnitude
    history = []  # the input's step amaxes, newest first
    first_addresses = None  # of the weight's FP8 copies
    for step, pair in enumerate(sizes):
        scale_before = module.fp8_scale.clone()
        amaxes = []
        for size in pair:
            x, dy = size * torch.randn(32, 32, generator=g), size * 1e-5 * torch.randn(32, 48, generator=g)
            scales = (module.fp8_scale if step else
                      [current_scale(x, E4M3, margin), current_scale(module.weight, E4M3, margin),
                       current_scale(dy, E5M2, margin)])
            expected = reference(x, module.weight, module.bias, dy, scales, E5M2)
            for name, a, e in zip(("y", "dx", "dW", "db"), run(module, x, dy), expected):
                assert_close(a, e, 1e-5, (step, name))
            amaxes.append(torch.stack([x.abs().amax(), module.weight.detach().abs().amax(), dy.abs().amax()]))
            assert torch.equal(module.fp8_scale, scale_before)  # never within a step
        with torch.no_grad():
            module(100 * torch.randn(32, 32))  # evaluation: not recorded
        # the weight's copies: cast once a step, into the same tensors (what CUDA graphs read), at this step's scale
        addresses = [t.data_ptr() for t in module.fp8_weight_copy]
        assert first_addresses in (None, addresses), (addresses, first_addresses)
        first_addresses = addresses
        w8 = quantize(module.weight.detach(), E4M3, scales[WEIGHT])
        assert torch.equal(module.fp8_weight_copy[0].view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(module.fp8_weight_copy[1], w8.t().contiguous())
        step_amax = torch.stack(amaxes).amax(0)
        assert torch.equal(module.fp8_amax, step_amax)  # the running max over the micro-batches
        fp8.fp8_step(module)
        history = [step_amax] + history[:2]
        assert torch.equal(module.fp8_amax_history[:len(history)], torch.stack(history))
        chosen = torch.stack(history).amax(0) if algo == "max" else history[0]
        expected_scale = torch.tensor([FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[E5M2]]) / chosen / 2.0 ** margin
        torch.testing.assert_close(module.fp8_scale, expected_scale, rtol=1e-6, atol=0)
        assert not module.fp8_amax.any()  # the next step records afresh


def test_tensorwise_scales_each_tensor_by_its_own_amax_now():
    """No state: every product scales by the amax of the tensor in hand, so a tensor 1000 times larger or
    smaller than the last one loses nothing; the checkpoint holds the weights only."""
    module = fp8_linear(Recipe("e4m3", "tensorwise"))
    assert list(module.state_dict()) == ["weight", "bias"]
    g = torch.Generator().manual_seed(3)
    for size in (1.0, 1000.0, 0.001):
        x, dy = size * torch.randn(16, 32, generator=g), size * torch.randn(16, 48, generator=g)
        scales = [current_scale(x, E4M3), current_scale(module.weight, E4M3), current_scale(dy, E4M3)]
        expected = reference(x, module.weight, module.bias, dy, scales, E4M3)
        for name, a, e in zip(("y", "dx", "dW", "db"), run(module, x, dy), expected):
            assert_close(a, e, 1e-5, (size, name))


def test_negative_control_without_scaling_large_values_saturate_and_small_gradients_vanish():
    """The same products with every scale forced to 1 (what FP8 without scales would do): inputs of
    magnitude 1e4 clamp at 448, gradients of 1e-7 flush to zero in e5m2 (smallest subnormal 2^-16), and the
    results are far from the exact product, while the scaled ones are within FP8's rounding."""
    g = torch.Generator().manual_seed(4)
    x, dy = 1e4 * torch.randn(32, 32, generator=g), 1e-7 * torch.randn(32, 48, generator=g)
    scaled, unscaled = fp8_linear(Recipe("hybrid", "delayed")), fp8_linear(Recipe("hybrid", "delayed"))
    unscaled.fp8_scale.fill_(1.0)
    w, b = scaled.weight.detach().double(), scaled.bias.detach().double()
    exact_y, exact_dw = x.double() @ w.t() + b, dy.double().t() @ x.double()

    def relative_error(module):
        y, _, dw, _ = run(module, x, dy)
        return [float((a.double() - e).abs().max() / e.abs().max()) for a, e in ((y, exact_y), (dw, exact_dw))]

    y_error, dw_error = relative_error(scaled)
    assert y_error < 0.1 and dw_error < 0.2  # e4m3 steps of 1/8, e5m2 of 1/4
    y_error, dw_error = relative_error(unscaled)
    assert y_error > 0.9 and dw_error > 0.9  # saturated outputs; a weight gradient of zeros
    with pytest.raises(AssertionError):  # the float64 check of the first test sees it at once
        scales = [current_scale(x, E4M3), current_scale(unscaled.weight, E4M3), current_scale(dy, E5M2)]
        assert_close(run(unscaled, x, dy)[0], reference(x, unscaled.weight, unscaled.bias, dy, scales, E5M2)[0],
                     2.0 ** -7)


def test_the_step_maxes_amaxes_over_tensor_and_data_parallel_ranks_in_place(monkeypatch):
    """fp8_step reduces every FP8 linear's amaxes in one MAX all-reduce per group (tensor, then data), so
    each rank computes the one-process run's scales; it updates the buffers in place (a CUDA graph reads
    them by address)."""
    import torch.distributed as dist
    modules = [fp8_linear(Recipe("hybrid", "delayed", history_len=2), seed=s) for s in (0, 1)]
    for module in modules:
        run(module, torch.randn(16, 32), torch.randn(16, 48))
    local = torch.stack([m.fp8_amax.clone() for m in modules])
    calls = []

    def other_ranks(tensor, group, op):  # the other ranks of each group saw twice (data: three times) as much
        calls.append((group, op))
        tensor.copy_(torch.maximum(tensor, local * (2 if group == "tp" else 3)))

    monkeypatch.setattr(fp8, "all_reduce", other_ranks)
    state = type("State", (), {"group": staticmethod(lambda kind: {"tensor": "tp", "data": "dp"}[kind])})()
    addresses = [(m.fp8_amax_history.data_ptr(), m.fp8_scale.data_ptr(), m.fp8_amax.data_ptr()) for m in modules]
    model = nn.Sequential(*modules)
    fp8.fp8_step(model, state)
    assert calls == [("tp", dist.ReduceOp.MAX), ("dp", dist.ReduceOp.MAX)]
    for m, row in zip(modules, local):
        torch.testing.assert_close(m.fp8_amax_history[0], 3 * row, rtol=0, atol=0)
    assert addresses == [(m.fp8_amax_history.data_ptr(), m.fp8_scale.data_ptr(), m.fp8_amax.data_ptr())
                         for m in modules]


def test_apply_swaps_the_four_layer_linears_and_nothing_else():
    """Each layer's QKV, output projection and MLP matrices become FP8 twins (names and parameters kept;
    fp32 buffers named fp8_* added, which resume.py knows as FP8 state); the LM head, pooler and SOP head
    stay 16-bit. The tensor-parallel twins compute what FP8Linear computes (at TP 1 here: no collective)."""
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100, bf16=True,
                 fp8_format="hybrid")
    plain = BertModel(cfg).bfloat16()
    model = apply_levers(BertModel(cfg).bfloat16(), None, cfg)[0]
    swapped = {name for name, m in model.named_modules() if isinstance(m, fp8.FP8Scaling)}
    assert swapped == {f"layers.{i}.{name}" for i in range(2) for name in fp8.LAYER_LINEARS}
    assert all(type(m) is fast_linear.Linear for m in (model.lm_head.dense, model.pooler, model.binary_head))
    extra = [k for k in model.state_dict() if k not in plain.state_dict()]
    assert len(extra) == 2 * 4 * 2 and all(resume.is_fp8_state(k) for k in extra)
    assert not any(resume.is_fp8_state(k) for k in plain.state_dict())
    assert all(b.dtype == torch.float32 for name, b in model.named_buffers() if "fp8_" in name)
    tokens = torch.randint(0, 100, (2, 16))
    out = model(tokens, padding_mask=torch.zeros(2, 16, dtype=torch.bool))
    (out.lm_logits.float().pow(2).mean() + out.binary_logits.float().sum()).backward()
    assert torch.isfinite(out.lm_logits).all() and model.layers[0].mlp.dense_4h_to_h.weight.grad is not None

    recipe = Recipe("hybrid", "tensorwise")
    x, dy = torch.randn(2, 16, 32), torch.randn(2, 16, 48)
    for parallel in (ColumnParallelLinear(32, 48, group=None), RowParallelLinear(32, 48, group=None)):
        single = fp8_linear(recipe)
        parallel.load_state_dict(single.state_dict())
        parallel.__class__ = fp8.TWINS[type(parallel)]
        parallel.fp8_setup(recipe)
        ours, expected = run(parallel, x, dy), run(single, x, dy)
        for name, a, e in zip(("y", "dx", "dW"), ours, expected):  # the same FP8 operands and products
            assert torch.equal(a, e), (type(parallel).__name__, name)
        torch.testing.assert_close(ours[3], expected[3], rtol=1e-6, atol=1e-6)  # row: autograd's sum of y + b


def test_validate_refuses_what_fp8_cannot_run(monkeypatch):
    assert "add --bf16" in launch.usage_error(SHAPE + ["--fp8-format", "hybrid"], world_size=1)
    message = launch.usage_error(SHAPE + ["--bf16", "--fp8-format", "e4m3", "--hidden-size", 40], world_size=1)
    assert "--hidden-size 40 must be a multiple of 16" in message
    message = launch.usage_error(SHAPE + ["--bf16", "--fp8-format", "e4m3", "--ffn-hidden-size", 72], world_size=1)
    assert "--ffn-hidden-size 72 must be a multiple of 16" in message
    message = launch.usage_error(SHAPE + ["--bf16", "--fp8-format", "hybrid", "--hidden-size", 48,
                                          "--tensor-model-parallel-size", 2], world_size=2)
    assert "--hidden-size 48 must be a multiple of 16 x --tensor-model-parallel-size 2 = 32" in message
    assert "invalid choice" in launch.usage_error(SHAPE + ["--bf16", "--fp8-recipe", "mxfp8"], world_size=1)
    flags = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                 train_iters=10, lr=1e-3, bf16=True, fp8_format="hybrid")
    validate(Config(**flags), device_type="cpu", warn=None)  # the CPU runs it (torch._scaled_mm)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(Exception, match="compute capability 8.9 or newer.*has 8.0"):
        validate(Config(**flags), device_type="cuda", warn=None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    validate(Config(**flags), device_type="cuda", warn=None)


# ---------------------------------------------------------------- a tiny BERT through the trainer
def tiny_config(data, **flags):
    return Config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                  global_batch_size=8, train_iters=6, lr=3e-3, lr_decay_style="constant", data_path=[data["prefix"]],
                  vocab_file=data["vocab"], split="90,5,5", num_workers=0, eval_iters=1, log_interval=1,
                  bf16=True, **flags)


def train_losses(cfg):
    records = []
    result = train(cfg, on_log=records.append)
    return [r["lm loss"] for r in records if r["kind"] == "train"], result


def test_a_tiny_bert_trains_in_fp8_and_resumes_exactly(tiny_data, tmp_path, capsys):
    """Through minibert.train.train (its train_step calls fp8_step): the FP8 run's losses are finite and
    fall, its first is the bf16 run's within FP8's rounding; stopped at 3 and resumed from its checkpoint
    (with dropout on), it logs the unbroken run's losses and ends with its weights and FP8 state, bit for bit."""
    bf16, _ = train_losses(tiny_config(tiny_data))
    whole, unbroken = train_losses(tiny_config(tiny_data, fp8_format="hybrid", save=str(tmp_path / "whole")))
    assert all(torch.isfinite(torch.tensor(whole))) and len(whole) == 6
    assert abs(whole[0] - bf16[0]) < 0.02 and sum(whole[3:]) < sum(whole[:3]), (whole, bf16)
    assert whole != bf16  # the products did run in FP8
    scale = unbroken.model.layers[0].mlp.dense_h_to_4h.fp8_scale
    assert (scale > 0).all() and scale[GRAD] > scale[INPUT]  # gradients are small: scaled up most

    split = str(tmp_path / "split")
    first, _ = train_losses(tiny_config(tiny_data, fp8_format="hybrid", save=split, exit_interval=3))
    second, _ = train_losses(tiny_config(tiny_data, fp8_format="hybrid", save=split, load=split))
    assert first + second == whole
    a, b = checkpoint.load_checkpoint(str(tmp_path / "whole")), checkpoint.load_checkpoint(split)
    assert a["model"].keys() == b["model"].keys() and any(resume.is_fp8_state(k) for k in a["model"])
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key

    # the weights-only readers leave the FP8 state out: load_model builds the plain model; convert warns
    model, _ = reshard.load_model(str(tmp_path / "whole"))
    assert not any(resume.is_fp8_state(k) for k in model.state_dict())
    warnings = []
    reshard.convert(str(tmp_path / "whole"), str(tmp_path / "converted"), 1, 1, warn=warnings.append)
    assert any("FP8 scaling state" in w for w in warnings)
    converted = checkpoint.load_checkpoint(str(tmp_path / "converted"))
    assert not any(resume.is_fp8_state(k) for k in converted["model"])
    capsys.readouterr()


def test_checkpoints_with_and_without_fp8_state_load_into_either_run(tiny_data):
    """A bf16 checkpoint into an FP8 run: the weights load, the FP8 state starts fresh (no scale yet), one
    warning. An FP8 checkpoint into a bf16 run: its FP8 state is ignored, one warning. A missing weight is
    still an error."""
    def built(**flags):
        cfg = tiny_config(tiny_data, **flags)
        validate(cfg, warn=None)
        model, optimizer, scheduler = build_model_and_optimizer(cfg, "cpu")
        apply_levers(model, optimizer, cfg)
        return cfg, model, optimizer, scheduler

    def saved(cfg, model, optimizer, scheduler):
        state = checkpoint.training_state(cfg, 3, model, optimizer, scheduler, 24, 0)
        state["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in state["model"].items()}
        return state

    bf16_run, fp8_run = built(), built(fp8_format="hybrid")
    for target in (bf16_run, fp8_run):
        target[0].no_load_optim = True  # the weights stay as loaded (no fp32 masters from the file)
    scale = fp8_run[1].layers[0].mlp.dense_h_to_4h.fp8_scale
    scale.fill_(5.0)
    from_fp8, from_bf16 = saved(*fp8_run), saved(*bf16_run)  # every number + 1: the FP8 scales 6
    for state, target, message, expected_scale in (
            (from_bf16, fp8_run, "holds no FP8 scaling state", 0.0),  # fresh: no scale yet
            (from_fp8, bf16_run, "FP8 scaling state (amax histories and scales) is not used", 0.0),
            (from_fp8, fp8_run, None, 6.0)):
        scale.fill_(0.0)
        warnings = []
        resume.restore_training_state(state, *target, warn=warnings.append)
        assert warnings == [] if message is None else len(warnings) == 1 and message in warnings[0], warnings
        weights = dict(target[1].named_parameters())
        assert all(torch.equal(weights[k], state["model"][k].to(weights[k].dtype)) for k in weights)
        assert (scale == expected_scale).all()
    del from_fp8["model"]["layers.0.mlp.dense_h_to_4h.weight"]
    with pytest.raises(Exception, match="does not fit"):
        resume.restore_training_state(from_fp8, *fp8_run, warn=None)


def test_tensor_and_data_parallel_fp8_runs_scale_every_shard_as_one_process_does(tiny_data, tmp_path_factory):
    """The layout configuration in FP8 (hybrid, delayed) on one process, TP 2 and DP 2, checkpointed after
    8 steps. The amaxes are maxed over the ranks before the scales are made, so both TP ranks hold the same
    scales and histories for each layer's Linears (their shards of one tensor), and those are the
    one-process run's up to the runs' drift (their bf16 sums in another order) and DP's factor 2 on the
    output gradients (below); the logged losses follow the one-process FP8 run's."""
    runs, states = {}, {}
    for name, nproc, extra in (("one", 1, ()), ("tp2", 2, ("--tensor-model-parallel-size", "2")), ("dp2", 2, ())):
        save = tmp_path_factory.mktemp(f"fp8-{name}-ckpt")
        flags = ("--bf16", "--fp8-format", "hybrid", "--save", str(save), "--save-interval", "8")
        runs[name] = launch.layout_run(tiny_data, tmp_path_factory, f"fp8-{name}", nproc, *flags, *extra)[1]
        states[name] = [checkpoint.load_checkpoint(str(save), tp_rank=r)["model"]
                        for r in range(2 if name == "tp2" else 1)]
    fp8_keys = [k for k in states["one"][0] if k.endswith(("fp8_scale", "fp8_amax_history"))]
    assert len(fp8_keys) == 2 * 4 * 4  # 4 layers x 4 Linears x (scales, history)
    for key in fp8_keys:
        one, (tp_a, tp_b), (dp,) = states["one"][0][key], states["tp2"], states["dp2"]
        assert torch.equal(tp_a[key], tp_b[key]), key  # one scale for both shards of a tensor
        # each DP rank scales its loss by 1 / its own micro-batch count (the reduction averages over DP), so
        # its output gradients are DP times the one process's: amax x 2, scale / 2, the same FP8 values
        dp = dp[key].clone()
        dp[..., GRAD] *= 2 if key.endswith("fp8_scale") else 0.5
        for other in (tp_a[key], dp):
            torch.testing.assert_close(other, one, rtol=0.1, atol=0, msg=key)  # one element's max: drifts most
    for name in ("tp2", "dp2"):  # (the same layouts in plain bf16 differ from one process by up to 4e-5)
        launch.assert_close_runs(runs["one"], runs[name], ("lm loss", "sop loss"), rel=2e-4)
