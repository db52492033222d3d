"""The model's fused path against its plain twin, on a CPU through the Triton interpreter (conftest).

On a GPU in fp16/bf16 minibert.model.bert sends the loss through kernels/cross_entropy.py and each layer's
dropout + residual add + LayerNorm through kernels/layer_norm.py. Here the choice of path
(minibert.model.bert.fused_kernels_apply) is patched so that CPU fp32 tensors take it too: this checks the
wiring the GPU uses (which output feeds what in pre-LN and post-LN layers, the LayerNorm-less add after
the MLP, the loss through model.lm_cross_entropy) in every `make test`; `make test-gpu` checks the same
in bf16 and fp16. The kernels run for real; the tests count their calls so a bypassed kernel fails."""
import pytest
import torch

import minibert.fast.cross_entropy as cross_entropy_kernels
import minibert.fast.layer_norm as layer_norm_kernels
import minibert.model.bert as model_module
from minibert.config import Config
from minibert.model.bert import BertModel, pretraining_loss

VOCAB, SEQ, HIDDEN, LAYERS = 200, 16, 32, 2


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, VOCAB, (2, SEQ), generator=g)
    padding = torch.arange(SEQ)[None, :] >= torch.tensor([SEQ, 9])[:, None]
    loss_mask = ((torch.rand(2, SEQ, generator=g) < 0.3) & ~padding).long()
    loss_mask[:, 1] = 1  # at least one masked position per sample
    labels = torch.where(loss_mask.bool(), tokens, -1)
    return tokens, padding, loss_mask, labels, torch.tensor([0, 1])


def loss_and_grads(post_ln, fused, **flags):
    cfg = Config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                 hidden_dropout=0.0, attention_dropout=0.0, post_ln=post_ln, bias_dropout_fusion=fused,
                 cross_entropy_loss_fusion=fused, **flags)
    model = BertModel(cfg)
    tokens, padding, loss_mask, labels, is_random = batch()
    out = model(tokens, padding_mask=padding)
    loss = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture
def counted(monkeypatch):
    """CPU tensors take the fused path; every kernel call is counted (the real kernels run)."""
    calls = {"layer_norm": 0, "cross_entropy": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    counting(layer_norm_kernels, "dropout_add_layer_norm", "layer_norm")
    counting(cross_entropy_kernels, "fused_cross_entropy", "cross_entropy")
    monkeypatch.setattr(model_module, "fused_kernels_apply", lambda x: True)
    return calls


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-LN", "post-LN"])
def test_fused_path_equals_the_plain_twin(post_ln, counted, monkeypatch):
    plain_loss, plain_grads = loss_and_grads(post_ln, fused=False)
    assert counted == {"layer_norm": 0, "cross_entropy": 0}  # the flags off: plain ops
    monkeypatch.setattr(model_module, "FUSED_LAYER_NORM_MIN_ELEMENTS", 0)
    fused_loss, fused_grads = loss_and_grads(post_ln, fused=True)
    assert counted == {"layer_norm": 2 * LAYERS, "cross_entropy": 1}  # 2 a layer, 1 loss
    assert torch.allclose(fused_loss, plain_loss, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        assert float((fused_grads[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_small_tensors_keep_the_plain_layer_norm(counted):
    """Below FUSED_LAYER_NORM_MIN_ELEMENTS (this model's 512-element activations) the layers keep the
    plain ops, where the host's cost of the fused one was measured to outweigh it; the loss still fuses."""
    assert 2 * SEQ * HIDDEN < model_module.FUSED_LAYER_NORM_MIN_ELEMENTS
    loss_and_grads(post_ln=False, fused=True)
    assert counted == {"layer_norm": 0, "cross_entropy": 1}


def chained_loss_and_grads(chained, **overrides):
    cfg = Config(num_layers=3, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=VOCAB,
                 hidden_dropout=0.1, attention_dropout=0.0, residual_layernorm_fusion=chained, **overrides)
    torch.manual_seed(0)
    model = BertModel(cfg)
    tokens, padding, loss_mask, labels, is_random = batch()
    torch.manual_seed(1)                                   # the hidden dropout draws the same masks
    out = model(tokens, padding_mask=padding)
    loss = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [{}, {"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": 2},
                                       {"recompute_granularity": "full", "recompute_method": "block",
                                        "recompute_num_layers": 1}], ids=["stored", "uniform-2", "block-1"])
def test_residual_layernorm_fusion_is_the_same_model(recompute, monkeypatch):
    """--residual-layernorm-fusion moves each LN1 (and the final LayerNorm) into the closing add of the layer
    before: on the plain ops the same operations on the same tensors, so the same loss and gradients to
    the bit, with hidden dropout on and through full recompute (groups that pass the LayerNorm on). The
    layers after the first are handed their LN1 (recorded), so the flag is not simply ignored."""
    handed = []
    real = model_module.TransformerLayer.forward_chained
    monkeypatch.setattr(model_module.TransformerLayer, "forward_chained",
                        lambda self, x, normed, *a: handed.append(normed is not None) or real(self, x, normed, *a))
    plain_loss, plain_grads = chained_loss_and_grads(False, **recompute)
    assert not any(handed)
    handed.clear()
    loss, grads = chained_loss_and_grads(True, **recompute)
    assert handed[:3] == [False, True, True]             # the forward (recompute reruns some layers after it)
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def test_residual_layernorm_fusion_runs_the_next_layernorm_in_the_fused_kernel(counted, monkeypatch):
    """On the fused path (pre-LN) every closing add takes a LayerNorm: the next layer's LN1 or the final
    LayerNorm, so no LN1 after the first and no final LayerNorm runs on its own; same loss and gradients
    as the fused model without it (dropout 0)."""
    monkeypatch.setattr(model_module, "FUSED_LAYER_NORM_MIN_ELEMENTS", 0)
    seen = []
    real = layer_norm_kernels.dropout_add_layer_norm
    monkeypatch.setattr(layer_norm_kernels, "dropout_add_layer_norm",
                        lambda r, y, w, *a: seen.append(w is not None) or real(r, y, w, *a))
    plain_loss, plain_grads = loss_and_grads(post_ln=False, fused=True, residual_layernorm_fusion=False)
    assert seen == [True, False] * LAYERS                # LN2 with the mid add, nothing with the closing one
    seen.clear()
    loss, grads = loss_and_grads(post_ln=False, fused=True, residual_layernorm_fusion=True)
    assert seen == [True, True] * LAYERS                 # every add with a LayerNorm
    assert torch.allclose(loss, plain_loss, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        assert float((grads[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name


def test_residual_layernorm_fusion_is_on_by_default_and_no_op_for_post_ln(monkeypatch):
    """On by default (pre-LN); with --post-ln, whose LayerNorms already follow each add, nothing is handed
    on: the same calls, loss and gradients as with it off."""
    assert Config().residual_layernorm_fusion
    handed = []
    real = model_module.TransformerLayer.forward_chained
    monkeypatch.setattr(model_module.TransformerLayer, "forward_chained",
                        lambda self, x, normed, *a: handed.append(normed is not None) or real(self, x, normed, *a))
    plain_loss, plain_grads = chained_loss_and_grads(False, post_ln=True)
    loss, grads = chained_loss_and_grads(True, post_ln=True)
    assert not any(handed)
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
