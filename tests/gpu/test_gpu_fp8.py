"""FP8 on the GPU (minibert/fast/fp8.py): cuBLASLt's FP8 GEMM, which checks the operand rules the CPU's
torch._scaled_mm lets pass, computes what the CPU suite's float64 reference of the same FP8 operands says.
Skipped without a GPU with FP8 matrix units (compute capability 8.9 or newer)."""
import pytest
import torch

from minibert.fast import fp8
from minibert.fast.fp8 import E4M3, E5M2, GRAD, INPUT, WEIGHT, Recipe
from tests.test_fp8 import assert_close, current_scale, fp8_linear, reference, run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 matrix units")


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("rows", [4096, 4099], ids=["4096 rows", "4099 packed rows"])
def test_the_gpus_fp8_linear_is_the_float64_product_of_its_fp8_operands(fmt, rows):
    """bf16 in and out, tensorwise scales: y, dx, dW, db against float64 from the same FP8 operands; 4099
    rows (a packed micro-batch) pad the weight gradient's inner dimension to 4112."""
    module = fp8_linear(Recipe(fmt, "tensorwise"), k=1024, n=4096, dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (3 * torch.randn(rows, 1024, device="cuda", generator=g)).bfloat16()
    dy = (1e-4 * torch.randn(rows, 4096, device="cuda", generator=g)).bfloat16()
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    scales = [current_scale(x, E4M3), current_scale(module.weight, E4M3), current_scale(dy, grad_dtype)]
    ours = run(module, x, dy)
    expected = reference(x, module.weight, module.bias, dy, scales, grad_dtype)
    for name, a, e in zip(("y", "dx", "dW", "db"), ours, expected):
        assert a.dtype == torch.bfloat16 and a.shape == e.shape, name
        assert_close(a, e, 2.0 ** -7, name)


def test_delayed_scales_on_the_gpu_follow_the_recorded_amaxes():
    """Two micro-batches record their amaxes (a running max); fp8_step turns the step's max into the scales
    that the next step's casts use, in place on the device."""
    module = fp8_linear(Recipe("hybrid", "delayed"), k=256, n=512, dtype=torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(2)
    xs = [(s * torch.randn(64, 256, device="cuda", generator=g)).bfloat16() for s in (1.0, 5.0)]
    dys = [(1e-5 * torch.randn(64, 512, device="cuda", generator=g)).bfloat16() for _ in xs]
    for x, dy in zip(xs, dys):
        run(module, x, dy)
    fp8.fp8_step([module])
    amax = torch.stack([max(float(x.abs().max()) for x in xs) * torch.ones(()),
                        module.weight.detach().abs().max().float().cpu(),
                        max(float(dy.abs().max()) for dy in dys) * torch.ones(())])
    expected = [fp8.FP8_MAX[d] / amax[i] for i, d in ((INPUT, E4M3), (WEIGHT, E4M3), (GRAD, E5M2))]
    assert module.fp8_scale.cpu().tolist() == pytest.approx([float(e) for e in expected], rel=1e-6)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_the_one_pass_cast_is_the_plain_ops_bit_for_bit(dtype):
    """fp8_cast.cast against fp8.quantize (+ padding, + .t().contiguous(), + amax): the same bytes, the
    same amax, rounding included (Triton's interpreter gets rounding across a power of 2 wrong, so the CPU
    suite checks the kernel on exactly representable values; here every value rounds)."""
    from minibert.fast import fp8_cast
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (2 * torch.randn(4099, 1000, device="cuda", generator=g)).bfloat16()
    x[7, 11] = 1e5  # saturates
    scale = torch.tensor([fp8.FP8_MAX[dtype] / 8.0], device="cuda")
    amax = torch.tensor([3.0], device="cuda")
    out, out_t = fp8_cast.cast(x, dtype, scale, fp8.FP8_MAX[dtype], amax, rows=4112, transpose=True)
    plain = fp8.quantize(torch.nn.functional.pad(x, (0, 0, 0, 13)), dtype, scale)
    assert torch.equal(out.view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), plain.t().contiguous().view(torch.uint8))
    assert float(amax) == float(x.abs().max().float())  # 1e5 in bf16


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_the_fp8_linear_with_one_pass_casts_equals_its_plain_twin(scaling):
    """The same FP8 linear with the casts as PyTorch ops (fp8_plain_casts) and in one pass: y, dx, dW and
    the recorded state equal bit for bit, before the first fp8_step and after it, over two micro-batches
    (the second reuses the weight's FP8 copy)."""
    twins = [fp8_linear(Recipe("hybrid", scaling), k=1024, n=3072, dtype=torch.bfloat16).cuda() for _ in range(2)]
    twins[0].fp8_plain_casts = True
    g = torch.Generator(device="cuda").manual_seed(4)
    batches = [((s * torch.randn(2050, 1024, device="cuda", generator=g)).bfloat16(),
                (1e-5 * torch.randn(2050, 3072, device="cuda", generator=g)).bfloat16()) for s in (1.0, 3.0, 2.0)]
    for step in range(2):
        for x, dy in batches[step:step + 2]:
            plain, fused = (run(m, x, dy) for m in twins)
            for name, a, b in zip(("y", "dx", "dW", "db"), plain, fused):
                assert torch.equal(a, b), (step, name)
        fp8.fp8_step(twins)
        if scaling == "delayed":
            assert torch.equal(twins[0].fp8_amax_history, twins[1].fp8_amax_history)
            assert torch.equal(twins[0].fp8_scale, twins[1].fp8_scale)


def test_fp8_training_eager_captured_and_plain_casts_agree(tmp_path):
    """make train-small's model in FP8 (hybrid, delayed) through train_step, 6 steps without dropout: the
    eager run with one-pass casts logs the plain casts' losses; CUDA graphs (captured again after the first
    step, when the stored scales take over) log the eager losses; bf16's first loss is FP8's within 1%."""
    import dataclasses

    from tests.gpu.test_gpu_cuda_graphs import losses_of, trainer_pieces
    cfg, train_ds = trainer_pieces(tmp_path, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                                   pack_tokens=False, fp8_format="hybrid")
    eager, _ = losses_of(cfg, train_ds, 6)
    fp8.FP8Scaling.fp8_plain_casts = True
    try:
        plain, _ = losses_of(cfg, train_ds, 6)
    finally:
        fp8.FP8Scaling.fp8_plain_casts = False
    captured, graphs = losses_of(dataclasses.replace(cfg, cuda_graph_impl="local"), train_ds, 6)
    bf16, _ = losses_of(dataclasses.replace(cfg, fp8_format=None), train_ds, 6)
    assert plain == eager, (plain, eager)
    assert graphs == 2 and all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(captured, eager)), (captured, eager)
    assert abs(eager[0] - bf16[0]) <= 1e-2 * bf16[0] and eager != bf16 and eager[-1] < eager[0], (eager, bf16)
