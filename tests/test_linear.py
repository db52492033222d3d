"""minibert/model/linear.py: the written-out backward (bias gradient as a GEMV) against autograd's F.linear.

On the CPU `linear` is F.linear itself, so these tests call LinearFunction directly, in float64 (a
matmul against a sum differs only by rounding there); tests/gpu/test_gpu.py checks it in bf16 on CUDA
through the model."""
import pytest
import torch
import torch.nn.functional as F

from minibert.model.linear import (
    Linear,
    LinearFunction,
    bias_grad,
    linear,
    written_out_backward,
)


def grads(fn, x, w, b, dy):
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(*leaves, *([] if b is not None else [None]))
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape,bias", [((3, 5, 7), True), ((11, 7), True), ((2, 3, 7), False)])
def test_linear_function_matches_autograd(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    w = torch.randn(4, 7, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(*shape[:-1], 4, generator=g, dtype=torch.float64)
    ours = grads(LinearFunction.apply, x, w, b, dy)
    theirs = grads(F.linear, x, w, b, dy)
    assert len(ours) == len(theirs) == (4 if bias else 3)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_bias_grad_is_the_row_sum():
    dy = torch.randn(300, 9, dtype=torch.float64)
    torch.testing.assert_close(bias_grad(dy), dy.sum(0), rtol=1e-12, atol=1e-12)


def test_only_input_gradient_when_parameters_are_frozen():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    LinearFunction.apply(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(5, 7))


def test_plain_on_the_cpu_and_the_module_keeps_nn_linear_names():
    x = torch.randn(2, 7)
    layer = Linear(7, 4)
    assert not written_out_backward(x, layer.weight)              # CPU: F.linear itself
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))


def test_weight_grad_fusion_adds_into_main_grad_and_reports_it():
    """A weight marked as the data-parallel buffers mark it (--gradient-accumulation-fusion): its gradient
    is added into main_grad, no .grad is made, the callback hears of it once per backward; the bias and
    the input get theirs as usual; with fuse_weight_grad=False (the tied decoder), .grad again."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 4, generator=g, dtype=torch.float64)
    w = torch.nn.Parameter(torch.randn(4, 7, generator=g, dtype=torch.float64))
    b = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
    earlier = torch.randn(4, 7, generator=g, dtype=torch.float64)  # an earlier micro-batch's gradient
    w.main_grad = earlier.clone()
    heard = []
    w.main_grad_added = heard.append
    linear(x, w, b).backward(dy)
    torch.testing.assert_close(w.main_grad, earlier + dy.t() @ x.detach(), rtol=1e-12, atol=1e-12)
    assert w.grad is None and heard == [w]
    torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, dy @ w.detach(), rtol=1e-12, atol=1e-12)
    w.main_grad = earlier.clone()
    linear(x, w, b, fuse_weight_grad=False).backward(dy)
    assert torch.equal(w.main_grad, earlier) and heard == [w]
    torch.testing.assert_close(w.grad, dy.t() @ x.detach(), rtol=1e-12, atol=1e-12)


def test_fused_model_gradients_equal_the_plain_ones():
    """A small BertModel with the trainer's buffers, --gradient-accumulation-fusion on and off: after two
    micro-batches the fp32 main grads agree; with the fusion every Linear weight skipped its .grad."""
    from minibert.config import Config
    from minibert.model.bert import BertModel
    from minibert.training.build import build_grad_buffers
    from minibert.training.optim import build_optimizer
    from minibert.validate import validate

    main_grads, grads_made = [], []
    for fusion in (False, True):
        cfg = validate(Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                              max_position_embeddings=16, micro_batch_size=2, global_batch_size=4,
                              train_iters=1, lr=1e-3, hidden_dropout=0.0, attention_dropout=0.0,
                              gradient_accumulation_fusion=fusion), warn=None)
        torch.manual_seed(0)
        model = BertModel(cfg)
        optimizer = build_optimizer(build_grad_buffers(model, cfg), cfg)
        optimizer.zero_grad()
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            text = torch.randint(0, cfg.padded_vocab_size, (2, 16), generator=g)
            out = model(text, torch.zeros_like(text), padding_mask=torch.zeros(2, 16, dtype=torch.bool))
            (out.lm_logits.float().pow(2).mean() + out.binary_logits.float().sum()).backward()
            grads_made.append({n for n, p in model.named_parameters() if p.grad is not None})
            for buffers in optimizer.grads:
                buffers.accumulate()
        main_grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    linear_weights = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear)}
    assert linear_weights and all(not (linear_weights & made) for made in grads_made[2:])  # fused
    assert linear_weights <= grads_made[0]                                                # plain
    assert "embedding.word_embeddings.weight" in grads_made[2]                           # tied: not fused
    for name, plain in main_grads[0].items():
        torch.testing.assert_close(main_grads[1][name], plain, rtol=1e-5, atol=1e-7, msg=name)
