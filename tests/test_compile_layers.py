"""--compile-layers: each transformer layer through torch.compile, checked on the CPU (Inductor writes C++
there, Triton on a GPU: tests/gpu/test_gpu.py runs the same comparison in bf16).

Inside the compiled graphs the layer runs its plain ops (minibert.model.fused_kernels_apply and
linear.written_out_backward say no while compiling), and SelfAttention.attend stays outside them
(torch.compiler.disable). So the compiled model must give the eager model's loss and gradients, the
attention must be the graph break, and the layers must share their graphs rather than compile one each."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from minibert.build import build_model_and_optimizer
from minibert.config import Config
from minibert.errors import UsageError
from minibert.model import pretraining_loss
from minibert.validate import validate

LAYERS, SEQ = 4, 16


def config(**flags):
    cfg = Config(num_layers=LAYERS, hidden_size=32, num_attention_heads=4, seq_length=SEQ,
                 max_position_embeddings=SEQ, micro_batch_size=2, global_batch_size=2, train_iters=4, lr=1e-4,
                 seed=7, split="100,0,0", num_workers=0, eval_iters=0, hidden_dropout=0.0, attention_dropout=0.0,
                 **flags)
    return validate(cfg, 1, "cpu", warn=None)


def loss_and_grads(cfg, calls=2):
    """-> (loss, {name: gradient}, the state dict's names) after `calls` forward + backward passes."""
    model = build_model_and_optimizer(cfg, torch.device("cpu"))[0].train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, cfg.vocab_size, (2, SEQ), generator=g)
    padding = torch.arange(SEQ)[None, :] >= torch.tensor([SEQ, 11])[:, None]
    loss_mask = (~padding).long()
    labels = torch.where(loss_mask.bool(), tokens, -1)
    for _ in range(calls):  # the second call runs the compiled graphs without compiling
        model.zero_grad(set_to_none=True)
        out = model(tokens, padding_mask=padding)
        loss = pretraining_loss(out, labels, loss_mask, torch.tensor([0, 1]),
                                cross_entropy=model.lm_cross_entropy)[0]
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(model.state_dict())


def test_compiled_layers_give_the_eager_loss_and_gradients_and_share_their_graphs():
    eager_loss, eager_grads, eager_keys = loss_and_grads(config())
    torch._dynamo.reset()
    counters.clear()
    loss, grads, keys = loss_and_grads(config(compile_layers=True))
    assert keys == eager_keys  # layer.compile() keeps the names: checkpoints load either way
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # the layers ran compiled: graphs were made, and the graph break is the attention core
    breaks = " ".join(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0
    assert "SelfAttention.attend" in breaks, breaks
    # one pair of graphs (before / after the attention) for the first layer, which runs its own LN1, and
    # one for the others, which take theirs from the previous layer's closing add: not a pair per layer
    assert counters["stats"]["unique_graphs"] <= 4 < 2 * LAYERS


def test_compiled_layers_under_full_recompute_give_the_eager_loss_and_gradients():
    """Full recompute reruns each layer's forward in the backward (checkpoint): the compiled graphs run
    again there, and the gradients must not change."""
    flags = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    eager_loss, eager_grads, _ = loss_and_grads(config(**flags), calls=1)
    torch._dynamo.reset()
    counters.clear()
    loss, grads, _ = loss_and_grads(config(compile_layers=True, **flags), calls=1)
    assert counters["stats"]["unique_graphs"] > 0  # the layers did run compiled
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_tensor_parallel_layers_are_refused_with_the_fix():
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, max_position_embeddings=SEQ,
                 micro_batch_size=2, global_batch_size=2, train_iters=4, lr=1e-4, tensor_model_parallel_size=2,
                 compile_layers=True)
    with pytest.raises(UsageError, match="--compile-layers .* --tensor-model-parallel-size 1"):
        validate(cfg, 2, "cpu", warn=None)
