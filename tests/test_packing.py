"""Packed micro-batches (the real tokens as [n, h] rows, trimmed to the longest sample) against the padded
twin (--no-pack-tokens): the same losses and gradients, with and without --sparse-mlm, pre-LN and
post-LN, on real samples of the default corpus; and the index bookkeeping of minibert.data.packing."""
import dataclasses

import pytest
import torch

from minibert.config import Config
from minibert.data.batches import build_data_iterator, build_datasets
from minibert.data.packing import (
    gather_rows,
    make_packing,
    scatter_rows,
    trimmed_length,
)
from minibert.train import build_model_and_optimizer, forward_step, get_batch
from minibert.validate import validate


def test_packing_indices_round_trip():
    is_pad = torch.tensor([[False, False, False, False, True, True],
                           [False, False, False, True, True, True]])
    packing = make_packing(is_pad)
    assert packing.index.tolist() == [0, 1, 2, 3, 6, 7, 8] and packing.cls_rows.tolist() == [0, 4]
    x = torch.arange(12.0).view(2, 6, 1)
    rows = gather_rows(x, packing)
    assert rows.squeeze(1).tolist() == [0, 1, 2, 3, 6, 7, 8]
    back = scatter_rows(rows, packing)
    assert torch.equal(back, x.masked_fill(is_pad[..., None], 0.0))
    assert trimmed_length(is_pad, multiple=4) == 4 and trimmed_length(is_pad, multiple=64) == 6


def first_micro_batch_grads(run_cfg, train_ds, device):
    """One forward and backward of the first micro-batch as the trainer runs it, the .grad folded into
    the fp32 main_grad the optimizer reads -> (loss, {name: main_grad}, batch)."""
    model, optimizer, _ = build_model_and_optimizer(run_cfg, device)
    optimizer.zero_grad()
    batch = get_batch(build_data_iterator(train_ds, 0, run_cfg, device), device, run_cfg)
    loss, _ = forward_step(batch, model, None, run_cfg)
    loss.backward()
    for grads in optimizer.grads:
        grads.accumulate()
    main_grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    assert all(g.norm() > 0 for g in main_grads.values()), "no gradient arrived"
    return loss.detach(), main_grads, batch


def packed_and_padded_runs(cfg):
    """The first micro-batch, packed and padded (the twin) ->
    {pack_tokens: (loss, {name: main_grad}, packing, trimmed seq length)}."""
    validate(cfg)
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    results = {}
    for packed in (True, False):
        loss, main_grads, batch = first_micro_batch_grads(dataclasses.replace(cfg, pack_tokens=packed), train_ds,
                                                          torch.device("cpu"))
        results[packed] = (loss, main_grads, batch["packing"], batch["text"].shape[1])
    return results


@pytest.mark.parametrize("post_ln", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
def test_packed_equals_padded(tiny_data, post_ln, sparse):
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=256, micro_batch_size=4,
                 global_batch_size=4, train_iters=2, lr=1e-3, data_path=[tiny_data["prefix"]],
                 vocab_file=tiny_data["vocab"], split="90,5,5", hidden_dropout=0.0, attention_dropout=0.0,
                 post_ln=post_ln, sparse_mlm=sparse, eval_iters=0)
    results = packed_and_padded_runs(cfg)
    assert results[True][2].index.numel() < 4 * results[True][3]  # fewer rows than [b, s]
    (loss_p, grads_p, _, _), (loss_u, grads_u, _, _) = results[True], results[False]
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-6, atol=0)
    for name, grad in grads_u.items():
        error = (grads_p[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-5, (name, float(error))
