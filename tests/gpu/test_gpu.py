"""`make test-gpu`: what the CPU suite cannot check, on a CUDA GPU. The Triton interpreter runs the kernels
in float32 only (its bf16 dot is wrong), and the CPU trainer turns fp16 and data-loader workers off: here
the kernels and the whole model run in bf16 and fp16, every fast path against its plain twin, and an fp16
run with workers and flash dropout resumes exactly. Skipped without a GPU."""
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.bfloat16, torch.float16]


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("s", [384, 512], ids=["s384", "s512 (the long forward tile)"])
def test_flash_attention_against_fp32_reference(dtype, s):
    """Right padding, a hole in one row (a padded key before real ones) and a row with left padding: key
    blocks with and without the bias, in the forward's tile for s (flash_tiles.pick_tiles)."""
    from minibert.kernels.flash_attention import attention_reference, flash_attention
    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, d = 4, 8, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    padding = torch.arange(s, device="cuda")[None, :] >= torch.tensor([s, 300, 129, 17], device="cuda")[:, None]
    padding[0, 200:203] = True                                          # a hole
    padding[1, :70] = True                                              # left padding
    out = flash_attention(q, k, v, padding)
    real = ~padding[:, None, :, None]
    grad = torch.randn_like(out) * real  # padded queries' outputs are unspecified: the loss never reads them
    out.backward(grad)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_reference(qf, kf, vf, padding)
    ref.backward(grad.float())
    assert rel(out * real, ref * real) < 1e-2
    for ours, theirs in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert rel(ours * real, theirs * real) < 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_linear_written_out_backward_equals_autograd(dtype):
    """minibert.fast.linear's `linear` on CUDA in 16-bit (bias gradient as a GEMV) against F.linear's
    autograd, at a BERT-large MLP shape."""
    import torch.nn.functional as F

    from minibert.fast.linear import linear, written_out_backward
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, b, dy = (torch.randn(*shape, device="cuda", generator=g, dtype=dtype)
                   for shape in ((8, 512, 1024), (4096, 1024), (4096,), (8, 512, 4096)))
    assert written_out_backward(x, w)
    results = []
    for fn in (linear, F.linear):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fn(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for ours, theirs in zip(*results):
        assert rel(ours, theirs) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_adamw_kernel_equals_pytorch_fused_adamw_and_the_copy_back(dtype):
    """The optimizer's Triton kernel (minibert/fast/adamw.py, the default on CUDA) against its plain twin,
    PyTorch's fused AdamW then the copy back, over four steps of a small BertModel with clipping and (fp16) a
    dynamic loss scale: the masters agree to fp32 rounding, and the 16-bit weights are the masters rounded
    to nearest, bit for bit (the interpreter's bf16 rounding cannot check that on the CPU). Both runs take
    the trainer's levers (apply_levers), the plain one then swapped back to MixedPrecisionOptimizer."""
    from minibert.config import Config
    from minibert.fast.adamw import FusedAdamW
    from minibert.fast.levers import apply_levers
    from minibert.model.bert import BertModel
    from minibert.parallel.data_parallel import finalize_model_grads
    from minibert.parallel.state import ParallelState
    from minibert.training.build import build_grad_buffers
    from minibert.training.optim import MixedPrecisionOptimizer, build_optimizer
    from minibert.validate import validate
    runs = []
    for kernel in ("torch", "triton"):
        cfg = validate(Config(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128,
                              max_position_embeddings=128, micro_batch_size=8, global_batch_size=8,
                              train_iters=4, lr=1e-3, clip_grad=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                              initial_loss_scale=2.0 ** 12,  # fp16: a scale that does not overflow (no skipped step)
                              bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16), device_type="cuda", warn=None)
        torch.manual_seed(0)
        model = BertModel(cfg).to(device="cuda", dtype=dtype)
        optimizer = build_optimizer(build_grad_buffers(model, cfg), cfg)
        assert type(optimizer) is MixedPrecisionOptimizer  # built plain: the trainer applies the levers
        apply_levers(model, optimizer, cfg)
        assert type(optimizer) is FusedAdamW  # --adam-fusion, the default, on CUDA
        if kernel == "torch":
            optimizer.__class__ = MixedPrecisionOptimizer
        g = torch.Generator(device="cuda").manual_seed(3)
        for _ in range(4):
            optimizer.zero_grad()
            text = torch.randint(0, cfg.padded_vocab_size, (8, 128), generator=g, device="cuda")
            out = model(text, torch.zeros_like(text), padding_mask=torch.zeros_like(text, dtype=torch.bool))
            optimizer.scale_loss(out.lm_logits.float().logsumexp(-1).mean() + out.binary_logits.float().sum()).backward()
            finalize_model_grads(optimizer.grads, ParallelState())
            assert optimizer.step().update_successful
        for p, m in zip(model.parameters(), optimizer.master_params):
            assert torch.equal(p, m.to(dtype))
        runs.append(([m.clone() for m in optimizer.master_params], [pc.exp_avg_sq.clone() for pc in optimizer.pieces]))
    # the two runs' 16-bit weights may differ by a rounding after the first step, so their gradients do
    # too: the bounds are loose against that, and tight against a wrong divisor (clipping scales v by its
    # square) or bias correction (each step's size); tests/test_adamw_kernel.py checks the math to 1e-6
    assert len(runs[0][0]) == len(runs[1][0]) > 0
    for (plain_m, plain_v), (ours_m, ours_v) in zip(zip(*runs[0]), zip(*runs[1])):
        assert rel(ours_m, plain_m) < 1e-3 and rel(ours_v, plain_v) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_packed_qkv_flash_equals_plain_flash(dtype):
    from minibert.kernels.flash_attention import flash_attention
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(4, 256, 8, 3, 64, device="cuda", generator=g, dtype=dtype).requires_grad_()
    padding = torch.arange(256, device="cuda")[None, :] >= torch.tensor([256, 200, 64, 3], device="cuda")[:, None]
    out = flash_attention_qkv(qkv, padding, dropout_p=0.1, seed=3)
    grad = torch.randn_like(out)
    out.backward(grad)
    plain = qkv.detach().clone().requires_grad_()
    q, k, v = plain.permute(3, 0, 2, 1, 4).unbind(0)
    reference = flash_attention(q, k, v, padding, dropout_p=0.1, seed=3)
    reference.backward(grad)
    assert torch.equal(out, reference) and torch.equal(qkv.grad, plain.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_short_backward_against_fp32_reference_and_the_two_kernels(dtype, dropout_p):
    """s <= 128: the one-kernel backward on the GPU's tiles, in half precision, against fp32 attention
    (without dropout) and against the dq + dkdv pair (with it), padding with a hole included."""
    from minibert.kernels.dropout import dropout_mask, effective_dropout_p
    from minibert.kernels.flash_attention import (
        attention_forward,
        attention_reference,
        prepare_padding,
    )
    from minibert.kernels.flash_attention_bwd import attention_backward, short_block
    from minibert.kernels.flash_tiles import pick_tiles
    g = torch.Generator(device="cuda").manual_seed(5)
    b, h, s, d = 4, 12, 128, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=g, dtype=dtype) for _ in range(3))
    padding = torch.arange(s, device="cuda")[None, :] >= torch.tensor([128, 100, 65, 1], device="cuda")[:, None]
    padding[0, 7] = True
    real = ~padding[:, None, :, None]
    grad = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=dtype) * real
    tiles = pick_tiles(d, dtype)
    assert short_block(tiles[3], s) == 128  # this shape takes the short backward
    bias, kv_len = prepare_padding(padding)
    out, lse = attention_forward(q, k, v, bias, kv_len, d ** -0.5, dropout_p, 9, tiles[0])
    one = attention_backward(grad, q, k, v, out, lse, bias, kv_len, d ** -0.5, dropout_p, 9, tiles)
    two = attention_backward(grad, q, k, v, out, lse, bias, kv_len, d ** -0.5, dropout_p, 9, tiles[:3] + (None,))
    for a, e in zip(one, two):
        assert rel(a * real, e * real) < 5e-3
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    keep = dropout_mask(b, h, s, 9, dropout_p, device="cuda") if dropout_p else None
    ref = attention_reference(qf, kf, vf, padding, keep_mask=keep, dropout_p=effective_dropout_p(dropout_p))
    ref.backward(grad.float())
    for ours, theirs in zip(one, (qf.grad, kf.grad, vf.grad)):
        assert rel(ours * real, theirs * real) < 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("lengths, max_len", [([512, 301, 77, 1, 128, 450], 512), ([128, 101, 77, 1, 128, 64], 128)],
                         ids=["two-kernel backward", "short backward"])
def test_varlen_flash_equals_padded_flash(dtype, lengths, max_len):
    """Packed rows + cu_seqlens give the padded kernels' outputs and gradients bit for bit, with dropout."""
    from minibert.data.packing import make_packing, to_device
    from minibert.kernels.flash_attention_packed import flash_attention_qkv
    from minibert.kernels.flash_attention_varlen import flash_attention_varlen
    g = torch.Generator(device="cuda").manual_seed(2)
    is_pad = torch.arange(max_len)[None, :] >= torch.tensor(lengths)[:, None]
    packing = to_device(make_packing(is_pad), torch.device("cuda"))
    qkv = torch.randn(6, max_len, 16, 3, 64, device="cuda", generator=g, dtype=dtype)
    qkv = qkv.masked_fill(is_pad.cuda()[:, :, None, None, None], 0.0).requires_grad_()
    rows = qkv.detach().reshape(-1, 16, 3, 64).index_select(0, packing.index).requires_grad_()
    padded = flash_attention_qkv(qkv, is_pad.cuda(), dropout_p=0.1, seed=4)
    grad = torch.randn_like(padded)
    padded.backward(grad)
    packed = flash_attention_varlen(rows, packing.cu_seqlens, max_len, dropout_p=0.1, seed=4)
    packed.backward(grad.transpose(1, 2).reshape(-1, 16, 64).index_select(0, packing.index))
    assert torch.equal(packed, padded.transpose(1, 2).reshape(-1, 16, 64).index_select(0, packing.index))
    assert torch.equal(rows.grad, qkv.grad.reshape(-1, 16, 3, 64).index_select(0, packing.index))


def padded_batch(seed, device="cuda"):
    """4 samples of 256 tokens, real lengths 256/180/90/40, 15% of the real positions masked -> (tokens,
    padding, loss_mask, labels, is_random), vocab 1000."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, 1000, (4, 256), generator=g)
    padding = torch.arange(256)[None, :] >= torch.tensor([256, 180, 90, 40])[:, None]
    loss_mask = ((torch.rand(4, 256, generator=g) < 0.15) & ~padding).long()
    labels = torch.where(loss_mask.bool(), tokens, -1)
    is_random = torch.randint(0, 2, (4,), generator=g)
    return tuple(t.to(device) for t in (tokens, padding, loss_mask, labels, is_random))


def loss_and_grads(model, batch):
    """One forward and backward of the pretraining loss -> (loss, {name: fp32 grad})."""
    from minibert.model.loss import pretraining_loss
    tokens, padding, loss_mask, labels, is_random = batch
    out = model(tokens, padding_mask=padding)
    loss, _, _ = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["fused", "flash"])
def test_whole_model_backends_against_local(dtype, backend):
    """Each attention backend against the local one, in the model the trainer runs (its default levers)."""
    from minibert.config import Config
    from minibert.fast.levers import apply_levers
    from minibert.model.bert import BertModel
    cfg = Config(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1000,
                 hidden_dropout=0.0, attention_dropout=0.0)
    batch = padded_batch(0)
    results = {}
    for name in ("local", backend):
        cfg.attention_backend = name
        model = BertModel(cfg).cuda().to(dtype)
        apply_levers(model, None, cfg)
        results[name] = loss_and_grads(model, batch)
    (loss_a, grads_a), (loss_b, grads_b) = results["local"], results[backend]
    assert abs(float(loss_a - loss_b)) / float(loss_a) < 5e-3
    worst = max(rel(grads_b[n], grads_a[n]) for n in grads_a if grads_a[n].norm() > 0)
    assert worst < 5e-2, worst


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("post_ln", [False, True], ids=["pre-LN", "post-LN"])
def test_fused_layer_norm_and_cross_entropy_equal_their_plain_twins(dtype, post_ln, monkeypatch):
    """The whole model with the levers apply_levers turns on by default (--bias-dropout-fusion,
    --cross-entropy-loss-fusion, (pre-LN) --residual-layernorm-fusion, and the Linear's written-out
    backward) against the plain model, dropout 0: the same loss and gradients up to 16-bit rounding (the
    LayerNorm's, the loss's and the bias gradients' fp32 sums run in other orders)."""
    from minibert.config import Config
    from minibert.fast import residual
    from minibert.fast.levers import apply_levers
    from minibert.model.bert import BertModel
    monkeypatch.setattr(residual, "FUSED_MIN_ELEMENTS", 0)  # this small model fuses too
    batch = padded_batch(2)
    cfg = Config(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1000,
                 hidden_dropout=0.0, attention_dropout=0.0, post_ln=post_ln)
    results = {}
    for fused in (True, False):
        model = BertModel(cfg).cuda().to(dtype)
        if fused:
            apply_levers(model, None, cfg)
            assert isinstance(model.layers[0], residual.FusedTransformerLayer)
            assert isinstance(model, residual.ChainedBertModel) != post_ln  # chaining: pre-LN only
        results[fused] = loss_and_grads(model, batch)
    (loss_a, grads_a), (loss_b, grads_b) = results[False], results[True]
    assert abs(float(loss_a - loss_b)) / float(loss_a) < 5e-3
    worst = max(rel(grads_b[n], grads_a[n]) for n in grads_a if grads_a[n].norm() > 0)
    assert worst < 5e-2, worst


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_the_fused_loss_takes_the_padded_logits_without_a_slice_backward(dtype):
    """With the default levers, in 16-bit on the GPU the decoder runs LinearFunction: the whole model's loss
    graph must reach its [rows, padded vocab] output with no slice backward over the padded width (that node
    fills a zeroed padded gradient and copies the real columns into it)."""
    from minibert.config import Config
    from minibert.fast.levers import apply_levers
    from minibert.model.bert import BertModel
    from minibert.model.loss import pretraining_loss
    from tests.autograd_graph import backward_nodes
    cfg = Config(num_layers=1, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=1000)
    model = BertModel(cfg).cuda().to(dtype)
    apply_levers(model, None, cfg)
    tokens, padding, loss_mask, labels, is_random = padded_batch(3)
    out = model(tokens, padding_mask=padding)
    loss, _, _ = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)
    nodes = backward_nodes(loss.grad_fn)
    names = {type(node).__name__ for node in nodes}
    padded_slices = [node for node in nodes if "Slice" in type(node).__name__
                     and getattr(node, "_saved_self_sym_sizes", (0,))[-1] == cfg.padded_vocab_size]
    assert "LinearFunctionBackward" in names and "_FusedCrossEntropyBackward" in names, sorted(names)
    assert not padded_slices


def test_fused_hidden_dropout_follows_torch_seed(monkeypatch):
    """With hidden dropout on, the fused kernel's dropout seed comes from torch's generator: the same
    torch.manual_seed gives the same loss and gradients, another seed other ones."""
    from minibert.config import Config
    from minibert.fast import residual
    from minibert.fast.levers import apply_levers
    from minibert.model.bert import BertModel
    from minibert.model.loss import pretraining_loss
    monkeypatch.setattr(residual, "FUSED_MIN_ELEMENTS", 0)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, 1000, (8, 128), generator=g).cuda()
    loss_mask = (torch.rand(8, 128, generator=g) < 0.15).cuda().long()
    labels = torch.where(loss_mask.bool(), tokens, -1)
    is_random = torch.randint(0, 2, (8,), generator=g).cuda()
    cfg = Config(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=1000,
                 hidden_dropout=0.3, attention_dropout=0.0)
    model = BertModel(cfg).cuda().to(torch.bfloat16).train()
    apply_levers(model, None, cfg)
    assert isinstance(model.layers[0], residual.FusedTransformerLayer)

    def loss_for(seed):
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = pretraining_loss(model(tokens), labels, loss_mask, is_random, cross_entropy=model.lm_cross_entropy)[0]
        loss.backward()
        return loss.item(), model.layers[0].mlp.dense_h_to_4h.weight.grad.clone()
    (a, grad_a), (b, grad_b), (c, grad_c) = loss_for(5), loss_for(5), loss_for(6)
    assert a == b and torch.equal(grad_a, grad_b)
    assert a != c and not torch.equal(grad_a, grad_c)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_packed_micro_batches_equal_the_padded_twin_on_the_gpu(tmp_path, dtype):
    """Through the trainer's own pieces, its levers applied: the same loss from packed and padded
    micro-batches (flash, 16-bit)."""
    import dataclasses

    from minibert.config import Config
    from minibert.data.batches import build_data_iterator, build_datasets
    from minibert.data.corpus import write_default_corpus
    from minibert.data.tokenizer import build_tokenizer
    from minibert.fast.levers import apply_levers
    from minibert.preprocess import preprocess
    from minibert.train import build_model_and_optimizer, forward_step, get_batch
    from minibert.validate import validate
    write_default_corpus(tmp_path / "c.txt")
    (prefix,) = preprocess(str(tmp_path / "c.txt"), str(tmp_path / "c"), build_tokenizer("BertWordPieceLowerCase"),
                           split_sentences=True, progress=False)
    cfg = Config(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=512, micro_batch_size=8,
                 global_batch_size=8, train_iters=2, lr=1e-4, data_path=[prefix], hidden_dropout=0.0,
                 attention_dropout=0.0, eval_iters=0, num_workers=0, **{dtype: True})
    validate(cfg, device_type="cuda")
    _, (train_ds, _, _) = build_datasets(cfg, log=lambda line: None)
    device = torch.device("cuda")
    losses = {}
    for packed in (True, False):
        run_cfg = dataclasses.replace(cfg, pack_tokens=packed)
        model, optimizer, _ = build_model_and_optimizer(run_cfg, device)
        apply_levers(model, optimizer, run_cfg)
        batch = get_batch(build_data_iterator(train_ds, 0, run_cfg, device), device, run_cfg)
        losses[packed] = forward_step(batch, model, None, run_cfg)[0].item()
    assert abs(losses[True] - losses[False]) / losses[False] < 1e-2, losses


def run_train(args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "minibert", "train.py")] + [str(a) for a in args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize("graphs", [[], ["--cuda-graph-impl", "local"]], ids=["eager", "cuda graphs"])
def test_fp16_resume_mid_window_with_workers_and_flash_dropout_is_exact(tmp_path, graphs):
    """fp16 (the loss scaler inside its growth window), 2 data-loader workers, flash attention with
    in-kernel dropout: a run stopped and resumed logs exactly the unbroken run's lines. With CUDA graphs
    (minibert/fast/cuda_graphs.py) too: each change of the loss scale captures the graphs again, the warm-up
    before a capture draws no random numbers, and the graphs' draws come from the checkpointed CUDA
    generator."""
    from minibert.data.corpus import write_default_corpus
    from minibert.data.tokenizer import build_tokenizer
    from minibert.preprocess import preprocess
    write_default_corpus(tmp_path / "c.txt")
    (prefix,) = preprocess(str(tmp_path / "c.txt"), str(tmp_path / "c"), build_tokenizer("BertWordPieceLowerCase"),
                           split_sentences=True, progress=False)
    common = ["--num-layers", 2, "--hidden-size", 256, "--num-attention-heads", 4, "--seq-length", 128,
              "--micro-batch-size", 8, "--global-batch-size", 16, "--train-iters", 12, "--lr", 1e-4,
              "--lr-warmup-iters", 2, "--data-path", prefix, "--fp16", "--loss-scale-window", 5,
              "--num-workers", 2, "--log-interval", 1, "--eval-interval", 6, "--eval-iters", 2,
              "--attention-backend", "flash", "--split", "90,5,5"] + graphs
    unbroken = run_train(common)
    first = run_train(common + ["--save", tmp_path / "ck", "--exit-interval", 7])
    second = run_train(common + ["--load", tmp_path / "ck"])
    for r in (unbroken, first, second):
        assert r.returncode == 0, r.stderr[-2000:]

    def lines(out):
        timing = re.compile(r"elapsed time per iteration \(ms\): [\d.]+ \| throughput per GPU \(TFLOP/s/GPU\): "
                            r"[\d.]+ \| tokens per second: \d+ \| MFU: [\d.]+% \| ")
        return [timing.sub("", line) for line in out.splitlines() if line.startswith(("iteration ", "validation"))]
    assert lines(first.stdout) + lines(second.stdout) == lines(unbroken.stdout)
    assert any("loss scale: 4294967296.0" not in line for line in lines(unbroken.stdout))  # the scale moved
