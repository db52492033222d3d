"""minibert/fast/adamw.py (interpreted) against PyTorch's fused AdamW, the optimizer's plain twin.

The kernel works on flat buffers: three parameters with padding between them, one decayed, two not,
updated over five steps with a different divisor each step (the loss scale times clipping's factor) and
one skipped step (found_inf). tests/test_optim.py runs the whole optimizer with either kernel."""
import pytest
import torch

from minibert.fast import adamw as kernel

LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.95), 1e-6
RANGES, DECAYED, SIZE = [(0, 150), (192, 200), (256, 300)], [True, False, False], 320  # gaps: padding


def test_program_table_cuts_each_parameter_into_chunks_of_its_own():
    starts, ends, decays = kernel.program_table(RANGES, DECAYED, 64, "cpu")
    assert starts.tolist() == [0, 64, 128, 192, 256]
    assert ends.tolist() == [150, 150, 150, 200, 300]
    assert decays.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("copy_dtype", [None, torch.float16], ids=["fp32 run", "fp16 copy"])
def test_kernel_matches_pytorch_fused_adamw_and_skips_on_found_inf(copy_dtype):
    g = torch.Generator().manual_seed(0)
    master = torch.full((SIZE,), 7.0)                  # padding keeps 7.0: the kernel must not touch it
    exp_avg, exp_avg_sq = torch.full((SIZE,), 7.0), torch.full((SIZE,), 7.0)
    for a, b in RANGES:
        master[a:b] = torch.randn(b - a, generator=g)
        exp_avg[a:b], exp_avg_sq[a:b] = 0.0, 0.0
    model_copy = master.to(copy_dtype) if copy_dtype else None
    table = kernel.program_table(RANGES, DECAYED, 64, "cpu")
    reference = [master[a:b].clone() for a, b in RANGES]
    adam = torch.optim.AdamW([{"params": [reference[0]], "weight_decay": WD},
                              {"params": reference[1:], "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS, fused=True)
    steps_made = 0
    for step, (divisor, skip) in enumerate([(1.0, 0), (2.5, 0), (1e4, 1), (0.5, 0), (3.0, 0)]):
        grad = torch.randn(SIZE, generator=g) * (step + 1)
        divisor_t, found_inf = torch.tensor(divisor), torch.tensor(float(skip))
        kernel.adamw_(master, grad, exp_avg, exp_avg_sq, table, divisor=divisor_t, found_inf=found_inf, lr=LR,
                      weight_decay=WD, betas=BETAS, eps=EPS, step=steps_made + 1, model_copy=model_copy, block=64)
        for p, (a, b) in zip(reference, RANGES):
            p.grad = grad[a:b].clone()
        adam.grad_scale, adam.found_inf = divisor_t, found_inf
        adam.step()
        steps_made += 1 - skip
        for p, (a, b) in zip(reference, RANGES):
            torch.testing.assert_close(master[a:b], p, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(exp_avg[a:b], adam.state[p]["exp_avg"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(exp_avg_sq[a:b], adam.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-9)
        if copy_dtype:
            assert torch.equal(model_copy, master.to(copy_dtype)), step  # numpy's fp32 -> fp16 rounds to nearest
    assert float(adam.state[reference[0]]["step"]) == steps_made == 4
    outside = torch.ones(SIZE, dtype=torch.bool)
    for a, b in RANGES:
        outside[a:b] = False
    for buffer in (master, exp_avg, exp_avg_sq):
        assert buffer[outside].eq(7.0).all()


def test_a_skipped_step_changes_nothing():
    master, grad = torch.randn(SIZE), torch.randn(SIZE)
    exp_avg, exp_avg_sq, model_copy = torch.randn(SIZE), torch.rand(SIZE), torch.zeros(SIZE, dtype=torch.float16)
    before = [t.clone() for t in (master, exp_avg, exp_avg_sq, model_copy)]
    kernel.adamw_(master, grad, exp_avg, exp_avg_sq, kernel.program_table(RANGES, DECAYED, 64, "cpu"),
                  divisor=torch.tensor(1.0), found_inf=torch.tensor(1.0), lr=LR, weight_decay=WD, betas=BETAS,
                  eps=EPS, step=3, model_copy=model_copy, block=64)
    assert all(torch.equal(a, b) for a, b in zip(before, (master, exp_avg, exp_avg_sq, model_copy)))
