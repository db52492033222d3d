"""--cuda-graph-impl local, the parts a CPU can check (the captures themselves run in
tests/gpu/test_gpu_cuda_graphs.py): the kernels' seed read from memory draws what the same seed passed
by value draws (TRITON_INTERPRET=1), draw_seed outside a capture, and what the flag refuses or turns off."""
import pytest
import torch

from minibert.config import Config
from minibert.errors import UsageError
from minibert.kernels.dropout import draw_seed, seed_in_memory
from minibert.validate import validate


def test_every_dropout_kernel_reads_a_seed_from_memory_as_it_takes_one_by_value():
    """SEED_IN_MEMORY (the seed a CUDA graph draws on the device): the same outputs and gradients, bit for
    bit, as the int seed, in the padded, packed-QKV and varlen flash kernels and the fused LayerNorm."""
    from minibert.fast.layer_norm import dropout_add_layer_norm
    from minibert.kernels.flash_attention import flash_attention
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    from minibert.kernels.flash_attention_varlen import flash_attention_varlen
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


def tiny_trainer_config(tiny_data, **overrides):
    """The 2-layer trainer the CPU tests below run on the session's tiny corpus, dropout off."""
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=64, micro_batch_size=4,
                  global_batch_size=8, train_iters=2, lr=1e-3, data_path=[tiny_data["prefix"]],
                  vocab_file=tiny_data["vocab"], split="90,5,5", hidden_dropout=0.0, attention_dropout=0.0,
                  eval_iters=0)
    return validate(Config(**{**values, **overrides}))


def graph_config(**overrides):
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2,
                  train_iters=2, lr=1e-4, cuda_graph_impl="local")
    return Config(**{**values, **overrides})


def test_the_flag_turns_overlap_off_with_one_line_and_keeps_packing():
    warnings = []
    cfg = validate(graph_config(overlap_grad_reduce=True), world_size=2, device_type="cuda", warn=warnings.append)
    assert cfg.pack_tokens and not cfg.overlap_grad_reduce
    assert len(warnings) == 1 and "--overlap-grad-reduce" in warnings[0]
    warnings.clear()
    validate(graph_config(), device_type="cuda", warn=warnings.append)
    assert warnings == []


def test_bucketed_packing_rounds_the_rows_up_with_fillers_at_padding():
    """make_packing(bucket): n real rows, then the first padding positions up to a multiple of bucket
    (at most b * s), as one more sample in cu_seqlens; a full batch gets no fillers."""
    from minibert.data.packing import make_packing
    is_pad = torch.ones(3, 8, dtype=torch.bool)
    for sample, length in enumerate((5, 2, 8)):
        is_pad[sample, :length] = False
    plain, bucketed = make_packing(is_pad), make_packing(is_pad, bucket=8)
    assert plain.index.tolist() == [0, 1, 2, 3, 4, 8, 9, 16, 17, 18, 19, 20, 21, 22, 23]
    assert bucketed.index.tolist() == plain.index.tolist() + [5]           # 15 real rows -> 16
    assert bucketed.cu_seqlens.tolist() == [0, 5, 7, 15, 16] and bucketed.cls_rows.tolist() == [0, 5, 7]
    assert not is_pad.reshape(-1)[plain.index].any() and is_pad.reshape(-1)[bucketed.index[15:]].all()
    full = make_packing(torch.zeros(2, 8, dtype=torch.bool), bucket=8)
    assert full.index.tolist() == list(range(16)) and full.cu_seqlens.tolist() == [0, 8, 16]
    for bucket in (1, 3, 5, 8):
        rows = len(make_packing(is_pad, bucket=bucket).index)
        assert rows % bucket == 0 or rows == 24, (bucket, rows)
        assert rows - 15 < bucket


@pytest.mark.parametrize("backend", ["local", "flash"])
def test_the_layout_a_graph_replays_equals_the_padded_twin(tiny_data, backend):
    """What get_batch makes for --cuda-graph-impl local (untrimmed, every micro-batch packed, rows rounded
    up to a multiple of s with fillers), run eagerly on the CPU: the padded twin's loss and gradients, with
    the fillers scattered to padding (local) or attending among themselves (flash, varlen, interpreted)."""
    import dataclasses

    from test_packing import first_micro_batch_grads

    from minibert.data.batches import build_datasets
    cfg = tiny_trainer_config(tiny_data, global_batch_size=4, attention_backend=backend)
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    runs = {name: first_micro_batch_grads(run_cfg, train_ds, torch.device("cpu"))
            for name, run_cfg in {"graph layout": dataclasses.replace(cfg, cuda_graph_impl="local"),  # validated above
                                  "padded": dataclasses.replace(cfg, pack_tokens=False)}.items()}
    packing = runs["graph layout"][2]["packing"]
    real = int((~runs["padded"][2]["is_pad"]).sum())
    assert len(packing.index) % 64 == 0 and real < len(packing.index) < real + 64  # fillers, this batch
    assert runs["graph layout"][2]["text"].shape == (4, 64)                         # not trimmed
    torch.testing.assert_close(runs["graph layout"][0], runs["padded"][0], rtol=1e-5, atol=0)
    for name, grad in runs["padded"][1].items():
        error = (runs["graph layout"][1][name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-4, (name, float(error))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_sparse_mlm_rows_a_graph_replays_give_the_dense_loss_and_gradients(tiny_data, packed):
    """--sparse-mlm in the graph layout, run eagerly on the CPU: the masked positions are followed by
    fillers up to a multiple of s (packing.fill_rows), which the loss gives no weight, so the loss and
    every gradient are the dense padded twin's."""
    import dataclasses

    from test_packing import first_micro_batch_grads

    from minibert.data.batches import build_datasets
    cfg = tiny_trainer_config(tiny_data, global_batch_size=4)
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    runs = {name: first_micro_batch_grads(run_cfg, train_ds, torch.device("cpu"))
            for name, run_cfg in {"graph layout": dataclasses.replace(cfg, cuda_graph_impl="local", sparse_mlm=True,
                                                                      pack_tokens=packed),
                                  "dense": dataclasses.replace(cfg, pack_tokens=False)}.items()}
    batch = runs["graph layout"][2]
    masked = int(batch["loss_mask"].sum())
    rows = len(batch["lm_rows"])
    assert rows % 64 == 0 and masked <= rows < masked + 64 and len(batch["loss_positions"]) == rows
    fillers = batch["loss_positions"][masked:]
    assert (batch["loss_mask"].reshape(-1)[fillers] == 0).all() and (batch["lm_rows"][masked:] >= 0).all()
    torch.testing.assert_close(runs["graph layout"][0], runs["dense"][0], rtol=1e-5, atol=0)
    for name, grad in runs["dense"][1].items():
        error = (runs["graph layout"][1][name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < 1e-4, (name, float(error))


def test_fill_rows_pads_to_the_bucket_with_the_first_free_position():
    from minibert.data.packing import fill_rows
    positions, free = torch.tensor([3, 7, 9]), torch.tensor([0, 1, 2])
    assert fill_rows(positions, free, 4, 12).tolist() == [3, 7, 9, 0]
    assert fill_rows(positions, free, 8, 6).tolist() == [3, 7, 9, 0, 0, 0]      # at most the rows there are
    assert fill_rows(positions, free[:0], 3, 12).tolist() == [3, 7, 9]           # a full bucket: no filler
    assert fill_rows(positions[:0], free, 4, 12).tolist() == [0, 0, 0, 0]       # no masked position at all


@pytest.mark.parametrize("overrides,world,named", [
    ({}, 1, "needs a CUDA GPU"),
    ({"tensor_model_parallel_size": 2}, 2, "--tensor-model-parallel-size 1"),
    ({"pipeline_model_parallel_size": 2}, 2, "--pipeline-model-parallel-size 1"),
    ({"recompute_activations": True}, 1, "drop --recompute-*"),
    ({"cuda_graph_impl": "transformer_engine"}, 1, "pass --cuda-graph-impl local"),
])
def test_what_the_flag_refuses_names_the_fix(overrides, world, named):
    device = "cpu" if not overrides else "cuda"
    with pytest.raises(UsageError) as info:
        validate(graph_config(**overrides), world_size=world, device_type=device, warn=None)
    assert named in str(info.value)


def test_what_a_graph_records_is_the_eager_schedules_micro_batch(tiny_data):
    """cuda_graphs.forward_backward, the function a graph records, run eagerly on the CPU: over two
    micro-batches its main grads are the eager schedule's, bit for bit, and what a replay hands back
    (replayed_metrics of its two packed outputs) is the eager forward_step's loss and metrics: the losses
    and the accuracy counts; the warm-up's form (accumulate=False) leaves them untouched and no 16-bit
    grad behind. shape_key tells the bucketed micro-batches' shapes apart."""
    import dataclasses
    import functools

    from minibert.data.batches import build_data_iterator, build_datasets
    from minibert.fast.cuda_graphs import forward_backward, replayed_metrics, shape_key
    from minibert.parallel.pipeline import forward_backward_no_pipelining
    from minibert.train import forward_step, get_batch
    from minibert.training.build import build_model_and_optimizer
    cfg = tiny_trainer_config(tiny_data)
    cfg = dataclasses.replace(cfg, cuda_graph_impl="local")  # the graph's batch layout, run on the CPU
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    device = torch.device("cpu")
    iterator = build_data_iterator(train_ds, 0, cfg, device)
    batches = [get_batch(iterator, device, cfg) for _ in range(2)]
    step = functools.partial(forward_step, cfg=cfg)
    grads = {}
    for how in ("eager", "recorded"):
        torch.manual_seed(0)
        model, optimizer, _ = build_model_and_optimizer(cfg, device)
        optimizer.zero_grad()
        if how == "eager":
            results = forward_backward_no_pipelining(step, batches, [model], grads=optimizer.grads,
                                                     scale_loss=optimizer.scale_loss)
        else:
            before = {n: p.main_grad.clone() for n, p in model.named_parameters()}
            forward_backward(step, model, optimizer, 2, batches[0], accumulate=False)  # the warm-up
            assert all(torch.equal(p.main_grad, before[n]) and p.grad is None for n, p in model.named_parameters())
            recorded = [forward_backward(step, model, optimizer, 2, batch) for batch in batches]
            assert all(has_sop and counts.dtype == torch.int64 and counts.shape == (4,)
                       for _, counts, has_sop in recorded)
            results = [replayed_metrics(*outputs, batch) for outputs, batch in zip(recorded, batches)]
        metrics = [{k: float(v) for k, v in m.items()} for _, m in results]
        grads[how] = ([float(loss) for loss, _ in results], metrics,
                      {n: p.main_grad.clone() for n, p in model.named_parameters()})
    assert grads["eager"][0] == grads["recorded"][0]
    assert grads["eager"][1] == grads["recorded"][1]  # lm loss, sop loss, the accuracy counts, flops, tokens
    assert {"lm loss", "sop loss", "lm correct", "lm masked", "sop correct", "sop samples"} <= set(grads["eager"][1][0])
    for name, grad in grads["eager"][2].items():
        assert torch.equal(grads["recorded"][2][name], grad), name
    keys = [shape_key(batch, 2) for batch in batches]
    rows = [len(batch["packing"].index) for batch in batches]
    assert (keys[0] == keys[1]) == (rows[0] == rows[1]) and all(r % 64 == 0 for r in rows)
