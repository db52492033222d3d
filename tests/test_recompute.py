"""Activation recompute: selective (--recompute-activations: the attention core) and full (--recompute-granularity
full with --recompute-method uniform / block) give exactly the losses and gradients of a run that stores
everything, dropout included (checkpointing replays the random state), and store fewer bytes for the
backward (measured with autograd's saved-tensor hooks)."""
import dataclasses

import pytest
import torch

from minibert.config import Config
from minibert.model.bert import BertModel
from minibert.model.loss import pretraining_loss
from tests import launch
from tests.conftest import layout_args

MODES = {
    "none": {},
    "selective": {"recompute_activations": True},
    "full-uniform-2": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full-block-1": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
}


def base_config(**overrides):
    return Config(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=64, vocab_size=200,
                  attention_backend="local", seed=3, **overrides)


def batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 200, (4, 64), generator=g)
    padding = torch.arange(64)[None, :] >= torch.tensor([64, 50, 40, 30])[:, None]
    loss_mask = (torch.rand(4, 64, generator=g) < 0.2) & ~padding
    labels = torch.where(loss_mask, tokens, -1)
    return tokens, padding, loss_mask.long(), labels, torch.randint(0, 2, (4,), generator=g)


def step(cfg):
    """Loss, every gradient, and the bytes autograd stored for the backward (each storage once)."""
    model = BertModel(cfg).train()
    tokens, padding, loss_mask, labels, is_random = batch()
    stored = {}

    def pack(t):
        stored[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    torch.manual_seed(7)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens, padding_mask=padding)
        loss, _, _ = pretraining_loss(out, labels, loss_mask, is_random)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(stored.values())


@pytest.fixture(scope="module")
def stored_everything():
    return step(base_config())


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recompute_gives_the_same_numbers_and_stores_less(stored_everything, mode):
    loss, grads, stored = stored_everything
    loss_r, grads_r, stored_r = step(base_config(**MODES[mode]))
    assert torch.equal(loss, loss_r)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_r[name]), name
    print(f"{mode}: {stored_r} bytes stored for the backward vs {stored} without recompute")
    # selective drops the s x s scores and probabilities; full keeps one input per group of layers (all 4
    # layers recomputed in groups of 2, or only the first of 4 recomputed for block-1)
    assert stored_r < stored * {"selective": 0.8, "full-uniform-2": 0.5, "full-block-1": 0.9}[mode]


def test_recompute_through_the_trainer_gives_the_one_process_losses(tiny_data, tmp_path, layout_reference):
    result = launch.run(1, layout_args(tiny_data, tmp_path / "tb", "--recompute-granularity", "full",
                                       "--recompute-method", "uniform", "--recompute-num-layers", 2))
    assert result.returncode == 0, result.stderr[-2000:]
    launch.assert_close_runs(layout_reference["scalars"], launch.tensorboard_scalars(tmp_path / "tb"), rel=0)


def test_full_recompute_needs_a_method(tiny_data, tmp_path):
    result = launch.run(1, layout_args(tiny_data, tmp_path / "tb", "--recompute-granularity", "full"), timeout=60)
    assert result.returncode == 2 and "--recompute-method uniform or block" in result.stderr


def test_modes_are_config_fields():
    names = {f.name for f in dataclasses.fields(Config)}
    assert {"recompute_activations", "recompute_granularity", "recompute_method", "recompute_num_layers"} <= names
