"""minibert/fast/fp8_cast.py, the one-pass FP8 cast, through Triton's interpreter on the CPU: the FP8 copy,
its transpose, the zero rows that pad it and the running amax, against the plain twin (fp8.quantize).

The interpreter rounds wrongly where a value rounds up across a power of 2 (it drops the carry), so the
values here are exactly representable after scaling: the layout, the scale, the saturation and the amax
are checked here, the rounding on a GPU (tests/gpu/test_gpu_fp8.py, bit for bit on random values)."""
import pytest
import torch
import torch.nn.functional as F

from minibert.fast import fp8, fp8_cast


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("m, rows", [(37, 48), (64, 64), (100, 112)])
def test_the_cast_writes_the_copy_its_transpose_the_padding_and_the_amax(dtype, m, rows):
    g = torch.Generator().manual_seed(m)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()  # every FP8 value
    grid = grid[torch.isfinite(grid) & (grid.abs() <= fp8.FP8_MAX[dtype])]
    scale = torch.tensor([2.0 ** 5])  # a power of 2: value / scale * scale is the value again
    x = (grid[torch.randint(len(grid), (m, 80), generator=g)] / scale).bfloat16()
    x[3, 5] = 1e6  # past the top: saturates
    amax = torch.tensor([0.5])
    out, out_t = fp8_cast.cast(x, dtype, scale, fp8.FP8_MAX[dtype], amax, rows=rows, transpose=True)
    plain = fp8.quantize(F.pad(x, (0, 0, 0, rows - m)), dtype, scale)
    assert out.dtype == out_t.dtype == dtype and out.shape == (rows, 80) and out_t.shape == (80, rows)
    assert torch.equal(out.view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), plain.t().contiguous().view(torch.uint8))
    assert (out[m:].float() == 0).all() and out[3, 5].float() == fp8.FP8_MAX[dtype]
    assert float(amax) == float(x.abs().max())  # the running max took this tensor's
    out2, none = fp8_cast.cast(x, dtype, scale, fp8.FP8_MAX[dtype])  # no amax, no transpose, no padding
    assert none is None and torch.equal(out2.view(torch.uint8), out[:m].view(torch.uint8))
    into = torch.empty_like(out), torch.empty_like(out_t)  # the weights' copies: cast into the same tensors
    written = fp8_cast.cast(x, dtype, scale, fp8.FP8_MAX[dtype], None, rows, True, *into)
    assert all(w is t for w, t in zip(written, into))
    assert torch.equal(into[0].view(torch.uint8), out.view(torch.uint8)) and torch.equal(into[1], out_t)
