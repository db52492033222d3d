"""--cuda-graph-impl local, the parts a CPU can check (the captures themselves run in
tests/gpu/test_gpu_cuda_graphs.py): the kernels' seed read from memory draws what the same seed passed
by value draws (TRITON_INTERPRET=1), draw_seed outside a capture, and what the flag refuses or turns off."""
import pytest
import torch

from minibert.config import Config, validate
from minibert.errors import UsageError
from minibert.kernels.dropout import draw_seed, seed_in_memory


def test_every_dropout_kernel_reads_a_seed_from_memory_as_it_takes_one_by_value():
    """SEED_IN_MEMORY (the seed a CUDA graph draws on the device): the same outputs and gradients, bit for
    bit, as the int seed, in the padded, packed-QKV and varlen flash kernels and the fused LayerNorm."""
    from minibert.kernels.flash_attention import flash_attention
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    from minibert.kernels.flash_attention_varlen import flash_attention_varlen
    from minibert.kernels.layer_norm import dropout_add_layer_norm
    torch.manual_seed(0)
    qkv = torch.randn(2, 40, 2, 3, 16, requires_grad=True)  # [b, s, heads, 3, d]
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[1, 25:] = True
    packed = torch.randn(65, 2, 3, 16, requires_grad=True)  # [n, heads, 3, d]: samples of 40 and 25 rows
    cu = torch.tensor([0, 40, 65], dtype=torch.int32)
    res, y = torch.randn(12, 64, requires_grad=True), torch.randn(12, 64, requires_grad=True)
    w, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    calls = {
        "flash": (lambda s: flash_attention(*[t.transpose(1, 2) for t in qkv.unbind(3)], pad, dropout_p=0.3,
                                            seed=s), [qkv]),
        "flash qkv": (lambda s: flash_attention_qkv(qkv, pad, dropout_p=0.3, seed=s), [qkv]),
        "varlen": (lambda s: flash_attention_varlen(packed, cu, 40, dropout_p=0.3, seed=s), [packed]),
        "layer norm": (lambda s: torch.cat([t.reshape(-1) for t in dropout_add_layer_norm(res, y, w, b, 1e-5, 0.3,
                                                                                           seed=s)]),
                       [res, y, w, b]),
    }
    for name, (call, inputs) in calls.items():
        results = []
        for seed in (4321, torch.tensor([4321], dtype=torch.int64), 4322):
            out = call(seed)
            results.append([out, *torch.autograd.grad(out.square().sum(), inputs)])
        assert all(torch.equal(a, b) for a, b in zip(results[0], results[1])), name
        assert not torch.equal(results[0][0], results[2][0]), name  # another seed, another mask


def test_draw_seed_outside_a_capture_is_a_python_int_from_torchs_generator():
    cpu = torch.device("cpu")
    assert draw_seed(0.0, cpu) == 0
    torch.manual_seed(7)
    first = draw_seed(0.1, cpu)
    torch.manual_seed(7)
    assert draw_seed(0.1, cpu) == first and isinstance(first, int) and 0 <= first < 2**31 - 1
    assert not seed_in_memory(first) and seed_in_memory(torch.tensor([first]))


def graph_config(**overrides):
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  train_iters=2, lr=1e-4, cuda_graph_impl="local")
    return Config(**{**values, **overrides})


def test_the_flag_turns_packing_and_overlap_off_with_one_line_each():
    warnings = []
    cfg = validate(graph_config(overlap_grad_reduce=True), world_size=2, device_type="cuda", warn=warnings.append)
    assert not cfg.pack_tokens and not cfg.overlap_grad_reduce and len(warnings) == 2
    assert "fixed [micro batch, sequence] shapes" in warnings[0] and "--overlap-grad-reduce" in warnings[1]
    warnings.clear()
    validate(graph_config(pack_tokens=False), device_type="cuda", warn=warnings.append)
    assert warnings == []  # --no-pack-tokens silences it


@pytest.mark.parametrize("overrides,world,named", [
    ({}, 1, "needs a CUDA GPU"),
    ({"tensor_model_parallel_size": 2}, 2, "--tensor-model-parallel-size 1"),
    ({"pipeline_model_parallel_size": 2}, 2, "--pipeline-model-parallel-size 1"),
    ({"recompute_activations": True}, 1, "drop --recompute-*"),
    ({"sparse_mlm": True}, 1, "--sparse-mlm"),
    ({"cuda_graph_impl": "transformer_engine"}, 1, "pass --cuda-graph-impl local"),
])
def test_what_the_flag_refuses_names_the_fix(overrides, world, named):
    device = "cpu" if not overrides else "cuda"
    with pytest.raises(UsageError) as info:
        validate(graph_config(**overrides), world_size=world, device_type=device, warn=None)
    assert named in str(info.value)
