"""The planner (minibert/tools/plan.py, plan_memory.py, plan_time.py) against the things it models.

- parameters: the counts equal the models minibert really builds: BertModel(cfg) on the meta device for
  the total, and build.build_model (tensor parallelism applied, per pipeline stage) for each rank;
- activations: the per-layer formula equals the bytes autograd really saves for the backward (counted
  with saved_tensors_hooks on the CPU, local and flash attention, fp32 and bf16, dropout on and off, FP8);
- micro-batches in flight, FLOPs and the bubble agree with schedules.py and training_log.py; FP8 shortens
  the step by what its FLOP share and rate say;
- the checks: the planner refuses exactly the layouts minibert.validate.validate refuses, and lists every
  layout problem where validate stops at the first; the guide's 340M script is refused with its reasons."""
import dataclasses
import itertools
import types

import pytest
import torch

from minibert.config import Config
from minibert.errors import UsageError
from minibert.fast import fp8
from minibert.model.bert import BertModel, TransformerLayer
from minibert.model.loss import pretraining_loss
from minibert.parallel import layers as tp_layers
from minibert.parallel.schedules import simulate
from minibert.tools import plan, plan_time
from minibert.tools import plan_memory as pm
from minibert.training.training_log import model_flops
from minibert.validate import validate

GUIDE_340M = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512 "
              "--max-position-embeddings 512 --attention-backend auto --micro-batch-size 4 --global-batch-size 32 "
              "--train-iters 1000000 --weight-decay 1e-2 --clip-grad 1.0 --fp16 --lr 0.0001 --lr-decay-iters 990000 "
              "--lr-decay-style linear --min-lr 1.0e-5 --lr-warmup-fraction .01 --tensor-model-parallel-size 8 "
              "--pipeline-model-parallel-size 16 --data-path data/my-bert_text_document --split 949,50,1 "
              "--log-interval 100 --save-interval 10000 --eval-interval 1000 --eval-iters 10").split()


def small(**overrides):
    values = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=2,
                  train_iters=10, lr=1e-4, vocab_size=1000)
    return Config(**{**values, **overrides})


# ---------------------------------------------------------------- parameters
@pytest.mark.parametrize("overrides", [{}, dict(post_ln=True), dict(bert_no_binary_head=True),
                                       dict(ffn_hidden_size=96, max_position_embeddings=48),
                                       dict(tensor_model_parallel_size=4, post_ln=True, bert_no_binary_head=True)])
def test_total_parameters_equal_the_model(overrides):
    cfg = small(**overrides)
    with torch.device("meta"):
        model = BertModel(cfg, init=False)
    assert pm.total_parameters(cfg) == sum(p.numel() for p in model.parameters())


class FakeGroup:
    """A tensor-parallel group of `size` ranks for building rank 0's shards in one process."""

    def __init__(self, size):
        self.size = size


def fake_state(tp, pp, pp_rank):
    group = FakeGroup(tp) if tp > 1 else None
    return types.SimpleNamespace(tp=tp, pp=pp, pp_rank=pp_rank, is_first_stage=pp_rank == 0,
                                 is_last_stage=pp_rank == pp - 1, device=torch.device("cpu"),
                                 rng=types.SimpleNamespace(fork=None),
                                 group=lambda kind: group if kind == "tensor" else None)


@pytest.mark.parametrize("layout", [dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                                    dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1),
                                    dict(pipeline_model_parallel_size=3, num_layers=6, post_ln=True),
                                    dict(pipeline_model_parallel_size=2, num_layers=8,
                                         num_layers_per_virtual_pipeline_stage=2, global_batch_size=4),
                                    dict(pipeline_model_parallel_size=3, num_layers=7,
                                         decoder_first_pipeline_num_layers=1, tensor_model_parallel_size=2,
                                         bert_no_binary_head=True, sequence_parallel=True)])
def test_parameters_per_stage_equal_what_build_model_builds(layout, monkeypatch):
    from minibert.training.build import build_model
    monkeypatch.setattr(tp_layers, "_size", lambda group: 1 if group is None else group.size)
    monkeypatch.setattr(tp_layers, "_rank", lambda group: 0)
    tp, pp = layout.get("tensor_model_parallel_size", 1), layout["pipeline_model_parallel_size"]
    cfg = validate(small(**layout), world_size=tp * pp, device_type="cuda", warn=None)
    for stage in pm.stages(cfg):
        chunks = build_model(cfg, fake_state(tp, pp, stage.rank))
        chunks = chunks if isinstance(chunks, list) else [chunks]
        assert stage.parameters == sum(p.numel() for c in chunks for p in c.parameters()), stage
        assert stage.layers == sum(len(c.layers) for c in chunks)


# ---------------------------------------------------------------- activations
def saved_bytes(run, excluded):
    """Bytes of the distinct storages autograd saves for the backward while `run()` runs."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    skip = {t.untyped_storage().data_ptr() for t in excluded}
    return sum(n for ptr, n in saved.items() if ptr not in skip)


@pytest.mark.parametrize("backend, dtype, dropout, fp8_format", [
    ("local", torch.bfloat16, 0.1, None), ("local", torch.bfloat16, 0.0, None), ("local", torch.float32, 0.1, None),
    ("flash", torch.bfloat16, 0.1, None), ("flash", torch.float32, 0.0, None),
    ("local", torch.bfloat16, 0.1, "hybrid"), ("flash", torch.bfloat16, 0.0, "e4m3")])
def test_layer_activations_equal_what_autograd_saves(backend, dtype, dropout, fp8_format):
    cfg = small(bf16=dtype == torch.bfloat16, hidden_dropout=dropout, attention_dropout=dropout, fp8_format=fp8_format)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg).to(dtype)
    if fp8_format:  # the four Linears -> their FP8 twins, as apply_levers does it to a model chunk
        fp8.apply(types.SimpleNamespace(layers={"0": layer}), cfg)
    x = torch.randn(cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size, dtype=dtype, requires_grad=True)
    padding = torch.zeros(cfg.micro_batch_size, cfg.seq_length, dtype=torch.bool)
    padding[0, -5:] = True
    got = saved_bytes(lambda: layer(x, padding, backend), list(layer.parameters()) + [padding])
    x_bytes = 4 if dtype == torch.float32 else 2  # the CPU keeps dropout masks and LayerNorm stats in this dtype
    expected = pm.layer_activations(cfg, backend, mask_bytes=x_bytes, stats_bytes=x_bytes).total
    if fp8_format:  # the backward also holds each Linear's FP8 weight copy and two fp32 inverse scales; the Linear
        # keeps the copy for the whole step, so the planner counts it once per GPU (fp8_weight_copies)
        expected += 4 * cfg.hidden_size ** 2 + 2 * cfg.hidden_size * cfg.ffn_size + 4 * 2 * 4
    assert got == expected


def test_the_formula_is_megatrons_with_an_fp32_softmax():
    """bf16, FFN 4h, TP 1: 34 b s h + 7 a b s^2 (local) and 34 b s h + 4 a b s (+ padding bias) for flash."""
    cfg = small(bf16=True, micro_batch_size=3, seq_length=64, hidden_size=128, num_attention_heads=8)
    b, s, h, a = 3, 64, 128, 8
    local = pm.layer_activations(cfg, "local")
    assert local.outside + local.inside == 34 * b * s * h and local.core == 7 * a * b * s * s
    flash = pm.layer_activations(cfg, "flash")
    assert flash.core == 4 * a * b * s + 4 * b * s + 8 * b   # lse, the bias, two lengths per sample
    assert pm.layer_activations(cfg, "flash", "selective").total == 34 * b * s * h + 16 * b * s
    assert pm.layer_activations(cfg, "local", "full").total == 2 * b * s * h
    tp = small(bf16=True, hidden_size=128, num_attention_heads=8, tensor_model_parallel_size=4)
    split = pm.layer_activations(tp, "local")
    assert split.outside + split.inside == (10 + 24 / 4) * 2 * 32 * 128
    sp = pm.layer_activations(dataclasses.replace(tp, sequence_parallel=True), "local")
    assert sp.outside + sp.inside == 34 * 2 * 32 * 128 / 4


@pytest.mark.parametrize("sparse, post_ln", [(False, False), (True, False), (False, True), (True, True)])
def test_head_activations_are_what_autograd_saves(sparse, post_ln):
    cfg = small(bf16=True, sparse_mlm=sparse, post_ln=post_ln, vocab_size=500)
    torch.manual_seed(0)
    model = BertModel(cfg).to(torch.bfloat16)
    b, s = cfg.micro_batch_size, cfg.seq_length
    hidden = torch.randn(b, s, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    loss_mask = (torch.rand(b, s) < 0.15).long()
    labels = torch.randint(0, 500, (b, s)).masked_fill(loss_mask == 0, -1)
    is_random = torch.randint(0, 2, (b,))

    def run():
        x = model.final_layernorm(hidden) if model.final_layernorm is not None else hidden
        out = model.head(x, lm_mask=loss_mask.bool() if sparse else None)
        pretraining_loss(out, labels, loss_mask, is_random, sparse=sparse)
    got = saved_bytes(run, list(model.parameters()) + [labels, loss_mask, is_random])
    cfg.mask_prob = float(loss_mask.float().mean())  # the expected share of positions, as drawn here
    expected = pm.head_activations(cfg, stats_bytes=2, peak=False)
    assert expected <= got <= expected + 8 * b * s + 64  # the loss's few numbers per position are left out


@pytest.mark.parametrize("kind, p, m, v", [("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("afab", 3, 5, 1),
                                           ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 3)])
def test_in_flight_matches_the_simulated_schedule(kind, p, m, v):
    peaks = simulate(kind, p, m, v).peak_in_flight
    assert [pm.peak_in_flight(kind, p, r, m, v) for r in range(p)] == peaks
    if kind == "1f1b":
        assert peaks == [min(p - r, m) for r in range(p)]


# ---------------------------------------------------------------- FLOPs and time
def test_flops_are_the_trainers():
    cfg = validate(small(global_batch_size=4), device_type="cuda", warn=None)
    lengths = torch.full((cfg.micro_batch_size,), float(cfg.seq_length), dtype=torch.float64)
    per_micro_batch = cfg.num_layers * plan_time.layer_flops(cfg) + plan_time.head_flops(cfg)
    assert per_micro_batch == pytest.approx(model_flops(cfg, lengths, cfg.micro_batch_size * cfg.seq_length))
    assert plan_time.layer_flops(cfg, "full") == pytest.approx(plan_time.layer_flops(cfg) * 4 / 3)  # a forward more


def test_the_bubble_stretches_the_step():
    hw = {name: default for name, (default, _) in plan_time.HARDWARE.items()}
    cfg = validate(small(pipeline_model_parallel_size=4, global_batch_size=16), world_size=4, device_type="cuda",
                   warn=None)
    est = plan_time.estimate(cfg, hw, pm.stages(cfg), gpus_per_node=8)
    m = cfg.num_micro_batches
    assert est["bubble"] == pytest.approx(3 / m)  # (p-1)/m
    assert est["pipeline"] == pytest.approx((est["compute"] + est["tp_time"] + est["pp_time"]) * (1 + 3 / m))
    assert est["step"] > est["pipeline"]  # + the optimizer, the tied-embedding all-reduce


@pytest.mark.parametrize("recipe, cast_bytes", [("delayed", 4), ("tensorwise", 6)])
def test_fp8_shortens_the_step_by_its_flop_share_and_rate(recipe, cast_bytes):
    """The 4B on one GPU: the layers' Linears (6 b s (4h^2 + 2hf) per layer) at the FP8 rate, the rest at
    bf16's, plus the casts' HBM bytes: 4 per element cast (6 with tensorwise's amax pass); per micro-batch
    the Linears' inputs and output gradients, per step their weights."""
    hw = {name: default for name, (default, _) in plan_time.HARDWARE.items()}
    bf16 = validate(Config(preset="4b", micro_batch_size=4, global_batch_size=32, train_iters=1, lr=1e-4, bf16=True),
                    device_type="cuda", warn=None)
    with_fp8 = dataclasses.replace(bf16, fp8_format="hybrid", fp8_recipe=recipe)
    a, b = (plan_time.estimate(c, hw, pm.stages(c), gpus_per_node=8) for c in (bf16, with_fp8))
    layers, m, tokens, h, f = bf16.num_layers, bf16.num_micro_batches, 4 * 512, 2560, 10240
    linears = layers * 6 * tokens * (4 * h * h + 2 * h * f)
    share = linears / (layers * plan_time.layer_flops(bf16) + plan_time.head_flops(bf16))
    assert 0.9 < share < 1
    assert b["compute"] / a["compute"] == pytest.approx(1 - share + share * hw["peak_tflops"] / hw["fp8_peak_tflops"])
    per_micro_batch = tokens * (3 * h + f) + tokens * (5 * h + f)  # the Linears' inputs, their outputs' gradients
    elements = m * per_micro_batch + 4 * h * h + 2 * h * f  # + the weights, once
    assert b["fp8_casts"] == pytest.approx(layers * cast_bytes * elements / (hw["hbm_tb_s"] * 1e12))
    assert b["step"] == pytest.approx(a["step"] - a["compute"] + b["compute"] + b["fp8_casts"])  # nothing else moves
    assert b["step"] < a["step"]


# ---------------------------------------------------------------- the checks and the CLI
def run_plan(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        plan.main([str(a) for a in argv])
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_the_guides_340m_script_is_refused_with_its_reasons(capsys):
    code, out, err = run_plan(capsys, *GUIDE_340M, "--nnodes", 1, "--nproc-per-node", 8)
    lines = err.strip().split("\n")
    assert code == 2 and out == "" and len(lines) == 2, err
    assert "TP 8 x PP 16 needs 128 GPUs" in lines[0] and "has 8" in lines[0]
    assert "--num-layers 24 cannot be split evenly over --pipeline-model-parallel-size 16" in lines[1]
    code, _, err = run_plan(capsys, *GUIDE_340M, "--nnodes", 16, "--nproc-per-node", 8)  # 128 GPUs: the layers only
    assert code == 2 and len(err.strip().split("\n")) == 1 and "--num-layers 24" in err


def test_every_problem_is_listed_one_line_each(capsys):
    code, out, err = run_plan(capsys, "--num-layers", 6, "--hidden-size", 100, "--num-attention-heads", 12,
                              "--seq-length", 1024, "--max-position-embeddings", 512, "--micro-batch-size", 3,
                              "--global-batch-size", 32, "--tensor-model-parallel-size", 8,
                              "--pipeline-model-parallel-size", 4, "--ffn-hidden-size", 300, "--lr", 1e-4,
                              "--nnodes", 6, "--nproc-per-node", 8)
    lines = err.strip().split("\n")
    assert code == 2 and out == ""
    assert all(line.startswith("error: ") for line in lines)
    for expected in ("TP 8 x PP 4 needs 32 GPUs for one copy of the model, but the run has 48",
                     "--hidden-size 100 must be divisible by --num-attention-heads 12",
                     "--num-attention-heads 12 must be divisible by --tensor-model-parallel-size 8",
                     "--hidden-size 100 must be divisible by --tensor-model-parallel-size 8",
                     "--ffn-hidden-size 300 must be divisible", "--seq-length 1024 is larger",
                     "--num-layers 6 cannot be split evenly over --pipeline-model-parallel-size 4"):
        assert sum(expected in line for line in lines) == 1, (expected, err)
    assert len(lines) == 7


def test_a_plan_for_a_layout_that_runs(capsys):
    code, out, err = run_plan(capsys, "--preset", "340m", "--micro-batch-size", 4, "--global-batch-size", 32,
                              "--train-iters", 100, "--lr", 1e-4, "--bf16", "--tensor-model-parallel-size", 2,
                              "--pipeline-model-parallel-size", 2, "--nproc-per-node", 8, "--use-distributed-optimizer")
    assert code == 0, err
    cfg = validate(Config(preset="340m", micro_batch_size=4, train_iters=100, lr=1e-4, tensor_model_parallel_size=2),
                   world_size=2, device_type="cuda", warn=None)
    assert f"total parameters: {pm.total_parameters(cfg)} " in out
    assert "layout: 8 GPUs = 1 node x 8 GPUs = TP 2 x PP 2 x DP 2" in out
    assert "<- this run" in out and "pipeline bubble: (p-1)/m = 1/4" in out and "= step" in out


def test_a_plan_needs_no_training_flags_and_gives_the_days_when_told_the_iterations(capsys):
    """The model, the batch and the layout make a plan; --train-iters adds the days-to-train line."""
    shape = ["--num-layers", 24, "--hidden-size", 1024, "--num-attention-heads", 16, "--seq-length", 512,
             "--micro-batch-size", 4, "--global-batch-size", 32, "--nproc-per-node", 8]
    code, out, err = run_plan(capsys, *shape)
    assert code == 0 and "total parameters: " in out and "= step" in out and "days at that rate" not in out, err
    code, out, err = run_plan(capsys, *shape, "--train-iters", 1000)
    assert code == 0 and "--train-iters 1000: " in out and "days at that rate" in out, err
    code, out, err = run_plan(capsys, *shape, "--train-iters", 0)
    assert code == 2 and "--train-iters 0 must be positive" in err


@pytest.mark.parametrize("argv, message", [(["--mfu", "1.5"], "--mfu must be at most 1"),
                                           (["--ib-gb-s", "0"], "--ib-gb-s 0 must be positive"),
                                           (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
                                           (["--fp8-peak-tflops", "0"], "--fp8-peak-tflops 0 must be positive"),
                                           (["--fp8-format", "hybrid"], "inside a bf16 model: add --bf16"),
                                           ])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_plan(capsys, "--preset", "340m", "--micro-batch-size", 4, "--train-iters", 10, "--lr", 1e-4,
                              *argv)
    assert code == 2 and out == "" and len(err.strip().split("\n")) == 1 and message in err, err


def validate_accepts(cfg, world) -> bool:
    """Whether the trainer's validate accepts cfg on `world` GPUs."""
    try:
        validate(cfg, world_size=world, device_type="cuda", warn=None)
        return True
    except UsageError:
        return False


def test_the_planner_refuses_exactly_what_validate_refuses(tmp_path):
    """Over a grid of layouts: no planner problem <=> validate accepts it."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]))
    grid = itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 4, 6, 8], [4, 6], [None, 2], [None, 12], [False, True])
    for tp, pp, world, layers, lps, global_batch, sp in grid:
        cfg = small(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, num_layers=layers,
                    num_layers_per_virtual_pipeline_stage=lps, global_batch_size=global_batch, sequence_parallel=sp,
                    hidden_size=48, num_attention_heads=6, seq_length=30, vocab_file=str(vocab))
        problems = plan.layout_problems(cfg, world) + plan.other_problem(cfg)
        assert validate_accepts(cfg, world) == (not problems), (tp, pp, world, layers, lps, global_batch, sp, problems)


def test_the_fp8_rules_are_listed_and_are_validates(capsys):
    """--fp8-format without --bf16 and with sizes the FP8 product cannot take: every rule one line, in
    validate's words; and over TP x bf16 x sizes the planner refuses exactly what validate refuses."""
    code, out, err = run_plan(capsys, "--preset", "340m", "--micro-batch-size", 4, "--fp8-format", "hybrid",
                              "--hidden-size", 1040, "--ffn-hidden-size", 4100, "--num-attention-heads", 8,
                              "--tensor-model-parallel-size", 2, "--nproc-per-node", 2)
    lines = err.strip().split("\n")
    assert code == 2 and out == "" and len(lines) == 3, err
    assert "--fp8-format hybrid runs the layers' matrix products in FP8 inside a bf16 model: add --bf16" in lines[0]
    assert "--fp8-format: --hidden-size 1040 must be a multiple of 16 x --tensor-model-parallel-size 2 = 32" in lines[1]
    assert "--fp8-format: --ffn-hidden-size 4100 must be a multiple of 16 x --tensor-model-parallel-size 2" in lines[2]
    for tp, bf16, hidden in itertools.product([1, 2, 4], [False, True], [64, 96]):
        cfg = small(tensor_model_parallel_size=tp, bf16=bf16, hidden_size=hidden, fp8_format="e4m3")
        problems = plan.layout_problems(cfg, tp) + plan.other_problem(cfg)
        assert validate_accepts(cfg, tp) == (not problems), (tp, bf16, hidden, problems)


def test_full_recompute_follows_the_recompute_method():
    """uniform: one kept input per group of k layers, one group rebuilt at a time; block: k layers
    recomputed, the others kept whole."""
    cfg = validate(small(num_layers=4, global_batch_size=2), device_type="cuda", warn=None)
    stage = pm.stages(cfg)[0]
    whole, kept = pm.layer_activations(cfg, "flash").total, pm.layer_activations(cfg, "flash", "full").total
    ends = pm.stage_activations(cfg, stage, "flash") - 4 * whole  # the embedding and the heads
    assert pm.stage_activations(cfg, stage, "flash", "full") == pytest.approx(4 * kept + whole + ends)
    cfg.recompute_num_layers = 2
    assert pm.stage_activations(cfg, stage, "flash", "full") == pytest.approx(2 * kept + 2 * whole + ends)
    cfg.recompute_method, cfg.recompute_num_layers = "block", 1
    assert pm.stage_activations(cfg, stage, "flash", "full") == pytest.approx(kept + 3 * whole + whole + ends)
