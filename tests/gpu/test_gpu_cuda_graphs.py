"""--cuda-graph-impl local on a GPU (minibert/fast/cuda_graphs.py): the kernels' device-drawn seeds, captured
training against eager training, fresh dropout at every replay. (fp16 recapture and exact resume with
graphs: test_gpu.py's resume test, parametrized.)"""
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_seed_in_device_memory_gives_the_int_seeds_numbers():
    """SEED_IN_MEMORY: every dropout kernel loads a tensor seed and draws what the same int seed draws."""
    from minibert.fast.layer_norm import dropout_add_layer_norm
    from minibert.kernels.flash_attention import flash_attention
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    from minibert.kernels.flash_attention_varlen import flash_attention_varlen
    torch.manual_seed(0)
    dev = torch.device("cuda")
    as_tensor = torch.tensor([987654], dtype=torch.int64, device=dev)
    qkv = torch.randn(2, 200, 4, 3, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    pad = torch.zeros(2, 200, dtype=torch.bool, device=dev)
    pad[1, 150:] = True
    packed = torch.randn(330, 4, 3, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 200, 330], dtype=torch.int32, device=dev)
    res = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w, b = (torch.ones(1024, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    calls = {
        "flash": (lambda s: flash_attention(*[t.transpose(1, 2) for t in qkv.unbind(3)], pad, dropout_p=0.2,
                                            seed=s), [qkv]),
        "flash qkv": (lambda s: flash_attention_qkv(qkv, pad, dropout_p=0.2, seed=s), [qkv]),
        "varlen": (lambda s: flash_attention_varlen(packed, cu, 200, dropout_p=0.2, seed=s), [packed]),
        "layer norm": (lambda s: torch.cat([t.reshape(-1) for t in dropout_add_layer_norm(res, y, w, b, 1e-5,
                                                                                           0.2, seed=s)]),
                       [res, y, w, b]),
    }
    for name, (call, inputs) in calls.items():
        results = []
        for seed in (987654, as_tensor):
            out = call(seed)
            grads = torch.autograd.grad(out.float().square().sum(), inputs)
            results.append([out, *grads])
        assert all(torch.equal(a, b) for a, b in zip(*results)), name


def test_captured_dropout_draws_new_numbers_at_every_replay():
    """A graph of the flash kernel and the fused LayerNorm with dropout: two replays on the same inputs
    drop different entries (the seeds are drawn inside the graph); without dropout they agree."""
    from minibert.fast.layer_norm import dropout_add_layer_norm
    from minibert.kernels.dropout import seeds_on_device
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    dev = torch.device("cuda")
    qkv = torch.randn(2, 128, 4, 3, 64, device=dev, dtype=torch.bfloat16)
    res, y = (torch.randn(256, 512, device=dev, dtype=torch.bfloat16) for _ in range(2))
    for p in (0.1, 0.0):
        for run in (lambda: flash_attention_qkv(qkv, None, dropout_p=p),
                    lambda: dropout_add_layer_norm(res, y, None, None, 1e-5, p)[0]):
            with seeds_on_device():  # compile (the seed-in-memory variants too) outside the capture
                run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            graph.replay()
            first = out.clone()
            graph.replay()
            assert torch.equal(first, out) == (p == 0.0)


def trainer_pieces(tmp_path, **overrides):
    from minibert.config import Config
    from minibert.data.batches import build_datasets
    from minibert.data.corpus import write_default_corpus
    from minibert.data.tokenizer import build_tokenizer
    from minibert.preprocess import preprocess
    from minibert.validate import validate
    write_default_corpus(tmp_path / "c.txt")
    (prefix,) = preprocess(str(tmp_path / "c.txt"), str(tmp_path / "c"), build_tokenizer("BertWordPieceLowerCase"),
                           split_sentences=True, progress=False)
    values = dict(num_layers=4, hidden_size=128, num_attention_heads=8, seq_length=128, micro_batch_size=4,
                  global_batch_size=16, train_iters=8, lr=1e-3, data_path=[prefix], eval_iters=0, num_workers=0)
    cfg = validate(Config(**{**values, **overrides}), device_type="cuda", warn=None)
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    return cfg, train_ds


def build(cfg, dev):
    """The trainer's model, optimizer and scheduler: built plain, then cfg's levers applied (as _train)."""
    from minibert.fast.levers import apply_levers
    from minibert.train import build_model_and_optimizer
    model, optimizer, scheduler = build_model_and_optimizer(cfg, dev)
    apply_levers(model, optimizer, cfg)
    return model, optimizer, scheduler


def losses_of(cfg, train_ds, steps, counts=None):
    """-> (each step's lm loss, the graphs captured); each step's accuracy counts appended to `counts`."""
    from minibert.data.batches import build_data_iterator
    from minibert.fast.cuda_graphs import captured_graphs
    from minibert.train import train_step
    dev = torch.device("cuda")
    torch.manual_seed(1)
    model, optimizer, scheduler = build(cfg, dev)
    model.train()
    iterator = build_data_iterator(train_ds, 0, cfg, dev)
    losses = []
    for _ in range(steps):
        step = train_step(model, optimizer, scheduler, iterator, cfg, dev)
        losses.append(float(step.losses["lm loss"]))
        if counts is not None:
            counts.append({name: int(value) for name, value in step.counts.items()})
    return losses, captured_graphs(model)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_captured_steps_equal_eager_steps_without_dropout(tmp_path, precision, packed):
    """make train-small's model, 4 micro-batches per step: without dropout the captured run's losses are
    the eager run's, step after step of AdamW updates. Padded: the same kernels on the same numbers, two
    graphs (a step's first micro-batch copies into the main grads, the others add). Packed: the graph's
    rows are rounded up with fillers (the eager run trims instead), two graphs per row count met, at most
    4 row counts (micro batch x s / s)."""
    cfg, train_ds = trainer_pieces(tmp_path, hidden_dropout=0.0, attention_dropout=0.0, bf16=precision == "bf16",
                                   pack_tokens=packed)
    eager_counts, captured_counts = [], []
    eager, graphs = losses_of(cfg, train_ds, 6, eager_counts)
    assert graphs == 0
    captured, graphs = losses_of(dataclasses.replace(cfg, cuda_graph_impl="local"), train_ds, 6, captured_counts)
    assert graphs == 2 if not packed else 2 <= graphs <= 8
    tolerance = {("fp32", False): 1e-5, ("fp32", True): 1e-4, ("bf16", False): 2e-3, ("bf16", True): 1e-2}[
        precision, packed]  # packed: other shapes, so other summation orders (as the packed-vs-padded test)
    assert all(abs(a - b) <= tolerance * abs(b) for a, b in zip(captured, eager)), (captured, eager)
    assert eager[-1] < eager[0]
    # the accuracy counts come out of the replays too: the same masked positions and samples (the fillers
    # count for nothing), the same right predictions up to a rounding-flipped near-tie or two
    for a, b in zip(captured_counts, eager_counts):
        assert set(a) == {"lm correct", "lm masked", "sop correct", "sop samples"} and a["lm masked"] > 0
        assert (a["lm masked"], a["sop samples"]) == (b["lm masked"], b["sop samples"]), (a, b)
        assert abs(a["lm correct"] - b["lm correct"]) <= 2 and abs(a["sop correct"] - b["sop correct"]) <= 1, (a, b)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_captured_sparse_mlm_steps_equal_eager_steps(tmp_path, packed):
    """--sparse-mlm under graphs: the masked rows are followed by fillers up to a multiple of s
    (packing.fill_rows), so the LM head has one of a few shapes; without dropout the captured run's
    losses are the eager sparse run's (which has no fillers), and the dense run's up to rounding."""
    cfg, train_ds = trainer_pieces(tmp_path, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                                   pack_tokens=packed, sparse_mlm=True)
    eager, _ = losses_of(cfg, train_ds, 6)
    captured, graphs = losses_of(dataclasses.replace(cfg, cuda_graph_impl="local"), train_ds, 6)
    dense, _ = losses_of(dataclasses.replace(cfg, sparse_mlm=False), train_ds, 6)
    assert graphs >= 2
    for other in (eager, dense):
        assert all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(captured, other)), (captured, other)
    assert eager[-1] < eager[0]


def test_captured_steps_with_dropout_train_like_eager(tmp_path):
    """With dropout (flash attention and the fused LayerNorm draw in-kernel, the embedding through torch):
    the captured run learns as the eager run does, and its losses differ from the dropout-free run's."""
    cfg, train_ds = trainer_pieces(tmp_path, bf16=True, train_iters=30, attention_backend="flash")
    eager, _ = losses_of(cfg, train_ds, 30)
    captured, _ = losses_of(dataclasses.replace(cfg, cuda_graph_impl="local"), train_ds, 30)
    no_dropout, _ = losses_of(dataclasses.replace(cfg, cuda_graph_impl="local", hidden_dropout=0.0,
                                                  attention_dropout=0.0), train_ds, 30)
    assert captured != no_dropout
    late = lambda losses: sum(losses[-10:]) / 10  # noqa: E731
    assert late(captured) < captured[0] - 1.0
    assert abs(late(captured) - late(eager)) < 0.05 * late(eager), (late(captured), late(eager))


def test_the_warm_up_leaves_no_trace(tmp_path):
    """The warm-up itself, on its side stream, with dropout on (it draws seeds): the main grads are
    bit-identical afterwards, no 16-bit gradient is kept, and the CPU and CUDA generators are put back."""
    import functools

    from minibert.data.batches import build_data_iterator
    from minibert.fast.cuda_graphs import forward_backward, warm_up
    from minibert.train import forward_step, get_batch
    cfg, train_ds = trainer_pieces(tmp_path, bf16=True, cuda_graph_impl="local")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, optimizer, _ = build(cfg, dev)
    model.train()
    batch = get_batch(build_data_iterator(train_ds, 0, cfg, dev), dev, cfg)
    step = functools.partial(forward_step, cfg=cfg)
    optimizer.zero_grad()
    forward_backward(step, model, optimizer, 4, batch)  # some gradient already accumulated
    before = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    states = torch.get_rng_state(), torch.cuda.get_rng_state()
    run = lambda accumulate: forward_backward(step, model, optimizer, 4, batch, accumulate)  # noqa: E731
    warm_up(run, torch.cuda.Stream())
    torch.cuda.synchronize()
    assert all(torch.equal(p.main_grad, before[n]) and p.grad is None for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), states[0]) and torch.equal(torch.cuda.get_rng_state(), states[1])


def graph_pool_bytes() -> int:
    """The bytes of CUDA memory in private pools (CUDA graphs' pools), from the allocator's snapshot."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) != (0, 0))


def test_graphs_of_several_shapes_cost_the_memory_of_the_largest(tmp_path):
    """A model's graphs share one pool and one capture stream: after the largest shape's graph, three
    smaller shapes' graphs fit in the blocks it freed, and the pool grows by at most a quarter (with a
    stream per capture each graph kept blocks of its own, and the pool grew by each one's temporaries)."""
    import functools

    from minibert.data.batches import build_data_iterator
    from minibert.fast.cuda_graphs import (
        captured_graphs,
        forward_backward_captured,
        shape_key,
    )
    from minibert.train import forward_step, get_batch
    cfg, train_ds = trainer_pieces(tmp_path, bf16=True, hidden_size=512, micro_batch_size=32,
                                   global_batch_size=32, cuda_graph_impl="local")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model, optimizer, _ = build(cfg, dev)
    model.train()
    iterator = build_data_iterator(train_ds, 0, cfg, dev)
    by_shape = {}
    for _ in range(40):
        batch = get_batch(iterator, dev, cfg)
        by_shape.setdefault(shape_key(batch, 1), batch)
    batches = sorted(by_shape.values(), key=lambda b: b["packing"].index.numel(), reverse=True)[:4]
    assert len(batches) == 4 and batches[0]["packing"].index.numel() > batches[-1]["packing"].index.numel()
    step = functools.partial(forward_step, cfg=cfg)
    pools = []
    for batch in batches:
        optimizer.zero_grad()
        forward_backward_captured(step, [batch], model, optimizer)
        torch.cuda.synchronize()
        pools.append(graph_pool_bytes())
    assert captured_graphs(model) == 4
    assert pools[0] > 0 and pools[-1] <= 1.25 * pools[0], pools
