"""The speed levers (minibert/fast/) against their plain twins, and kept apart from the core.

On a GPU in fp16/bf16 apply_levers sends the loss through fast/cross_entropy.py and each layer's
dropout + residual add + LayerNorm through fast/layer_norm.py. Here the choice of path
(minibert.fast.residual.fused_kernels_apply) is patched so that CPU fp32 tensors take it too: this checks
the wiring the GPU uses (which output feeds what in pre-LN and post-LN layers, the LayerNorm-less add after
the MLP, the loss through model.lm_cross_entropy) in every `make test`, through the Triton interpreter
(conftest); `make test-gpu` checks the same in bf16 and fp16. The kernels run for real; the tests count
their calls so a bypassed kernel fails."""
import ast
import pathlib

import pytest
import torch

import minibert.fast.cross_entropy as cross_entropy_kernels
import minibert.fast.layer_norm as layer_norm_kernels
from minibert.config import Config
from minibert.fast import levers, residual
from minibert.fast.levers import apply_levers
from minibert.model.bert import BertModel
from minibert.model.loss import pretraining_loss

VOCAB, SEQ, HIDDEN, LAYERS = 200, 16, 32, 2
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minibert"


def test_no_core_module_imports_the_levers():
    """Only the levers themselves and the trainer, where a run is assembled, may import minibert.fast:
    at the top of a module or inside a function."""
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "minibert.fast" or n.startswith("minibert.fast.") for n in names):
                importers.add(path.relative_to(PACKAGE).as_posix())
    assert {p for p in importers if not p.startswith("fast/")} == {"train.py"}


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, VOCAB, (2, SEQ), generator=g)
    padding = torch.arange(SEQ)[None, :] >= torch.tensor([SEQ, 9])[:, None]
    loss_mask = ((torch.rand(2, SEQ, generator=g) < 0.3) & ~padding).long()
    loss_mask[:, 1] = 1  # at least one masked position per sample
    labels = torch.where(loss_mask.bool(), tokens, -1)
    return tokens, padding, loss_mask, labels, torch.tensor([0, 1])


def loss_and_grads(levers_on, num_layers=LAYERS, hidden_dropout=0.0, **flags):
    """The plain model's (levers_on False) or the one apply_levers made of it (with cfg's flags)."""
    cfg = Config(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ,
                 vocab_size=VOCAB, hidden_dropout=hidden_dropout, attention_dropout=0.0, **flags)
    torch.manual_seed(0)
    model = BertModel(cfg)
    if levers_on:
        apply_levers(model, None, cfg)
    tokens, padding, loss_mask, labels, is_random = batch()
    torch.manual_seed(1)  # the hidden dropout draws the same masks
    out = model(tokens, padding_mask=padding)
    loss = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


def assert_close_grads(grads, plain_grads):
    for name, grad in plain_grads.items():
        scale = float(grad.abs().max())
        assert float((grads[name] - grad).abs().max()) <= 1e-4 * scale + 1e-7, name


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-LN", "post-LN"])
def test_on_a_cpu_the_levers_run_the_plain_twins_bit_for_bit(post_ln):
    """apply_levers with the default flags swaps modules (the checkpoint's names stay), and where the kernels
    do not apply (CPU, fp32) each twin runs the plain ops: the same loss and gradients, to the bit, with
    hidden dropout on (the same random draws in the same order)."""
    plain_loss, plain_grads, plain = loss_and_grads(False, num_layers=3, hidden_dropout=0.1, post_ln=post_ln)
    loss, grads, model = loss_and_grads(True, num_layers=3, hidden_dropout=0.1, post_ln=post_ln)
    assert isinstance(model.layers[0], residual.FusedTransformerLayer)
    assert isinstance(model, residual.ChainedBertModel) != post_ln  # chaining: pre-LN only
    assert model.lm_cross_entropy is levers.fused_lm_cross_entropy
    assert list(model.state_dict()) == list(plain.state_dict())
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.fixture
def counted(monkeypatch):
    """CPU tensors take the fused path at any size; every kernel call is counted (the real kernels run)."""
    calls = {"layer_norm": 0, "cross_entropy": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)
    counting(layer_norm_kernels, "dropout_add_layer_norm", "layer_norm")
    counting(cross_entropy_kernels, "fused_cross_entropy", "cross_entropy")
    monkeypatch.setattr(residual, "fused_kernels_apply", lambda x: True)
    monkeypatch.setattr(levers, "fused_kernels_apply", lambda x: True)
    monkeypatch.setattr(residual, "FUSED_MIN_ELEMENTS", 0)
    return calls


@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-LN", "post-LN"])
def test_fused_kernels_equal_the_plain_twin(post_ln, counted):
    plain_loss, plain_grads, _ = loss_and_grads(False, post_ln=post_ln)
    assert counted == {"layer_norm": 0, "cross_entropy": 0}
    fused_loss, fused_grads, _ = loss_and_grads(True, post_ln=post_ln)
    assert counted == {"layer_norm": 2 * LAYERS, "cross_entropy": 1}  # 2 a layer, 1 loss
    assert torch.allclose(fused_loss, plain_loss, rtol=1e-5, atol=0)
    assert_close_grads(fused_grads, plain_grads)
    counted.update(layer_norm=0, cross_entropy=0)
    loss_and_grads(True, post_ln=post_ln, bias_dropout_fusion=False, cross_entropy_loss_fusion=False)
    assert counted == {"layer_norm": 0, "cross_entropy": 0}  # the flags off: plain ops


def test_small_tensors_keep_the_plain_layer_norm(counted, monkeypatch):
    """Below FUSED_MIN_ELEMENTS (this model's 512-element activations) the layers keep the plain ops,
    where the host's cost of the fused one was measured to outweigh it; the loss still fuses."""
    monkeypatch.setattr(residual, "FUSED_MIN_ELEMENTS", 1 << 22)
    assert 2 * SEQ * HIDDEN < residual.FUSED_MIN_ELEMENTS
    loss_and_grads(True)
    assert counted == {"layer_norm": 0, "cross_entropy": 1}


def record_handed(monkeypatch):
    """Each FusedTransformerLayer call: was it handed its LN1 (normed) by the layer before?"""
    handed, real = [], residual.FusedTransformerLayer.forward

    def forward(self, x, *args, normed=None, **kwargs):
        handed.append(normed is not None)
        return real(self, x, *args, normed=normed, **kwargs)
    monkeypatch.setattr(residual.FusedTransformerLayer, "forward", forward)
    return handed


@pytest.mark.parametrize("recompute", [{}, {"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": 2},
                                       {"recompute_granularity": "full", "recompute_method": "block",
                                        "recompute_num_layers": 1}], ids=["stored", "uniform-2", "block-1"])
def test_residual_layernorm_fusion_is_the_same_model(recompute, monkeypatch):
    """--residual-layernorm-fusion moves each LN1 (and the final LayerNorm) into the closing add of the layer
    before: on the plain ops the same operations on the same tensors, so the plain model's loss and
    gradients to the bit, with hidden dropout on and through full recompute (groups that pass the LayerNorm
    on). The layers after the first are handed their LN1 (recorded), so the flag is not simply ignored."""
    handed = record_handed(monkeypatch)
    plain_loss, plain_grads, _ = loss_and_grads(False, num_layers=3, hidden_dropout=0.1, **recompute)
    loss, grads, _ = loss_and_grads(True, num_layers=3, hidden_dropout=0.1, bias_dropout_fusion=False, **recompute)
    assert handed[:3] == [False, True, True]  # the forward (recompute reruns some layers after it)
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def test_residual_layernorm_fusion_runs_the_next_layernorm_in_the_fused_kernel(counted, monkeypatch):
    """On the fused path (pre-LN) every closing add takes a LayerNorm: the next layer's LN1 or the final
    LayerNorm, so no LN1 after the first and no final LayerNorm runs on its own; same loss and gradients
    as the fused model without it (dropout 0)."""
    seen = []
    real = layer_norm_kernels.dropout_add_layer_norm
    monkeypatch.setattr(layer_norm_kernels, "dropout_add_layer_norm",
                        lambda r, y, w, *a: seen.append(w is not None) or real(r, y, w, *a))
    plain_loss, plain_grads, _ = loss_and_grads(True, residual_layernorm_fusion=False)
    assert seen == [True, False] * LAYERS  # LN2 with the mid add, nothing with the closing one
    seen.clear()
    loss, grads, _ = loss_and_grads(True, residual_layernorm_fusion=True)
    assert seen == [True, True] * LAYERS  # every add with a LayerNorm
    assert torch.allclose(loss, plain_loss, rtol=1e-5, atol=0)
    assert_close_grads(grads, plain_grads)


def test_residual_layernorm_fusion_is_on_by_default_and_no_op_for_post_ln(monkeypatch):
    """On by default (pre-LN); with --post-ln, whose LayerNorms already follow each add, the model is not
    chained and no layer is handed a LayerNorm."""
    assert Config().residual_layernorm_fusion
    handed = record_handed(monkeypatch)
    _, _, model = loss_and_grads(True, post_ln=True, bias_dropout_fusion=False)
    assert type(model) is BertModel and not any(handed)
