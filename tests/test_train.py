"""The trainer end to end on CPU: tiny BERTs trained on a little real English (minibert.data.corpus) through
the command line, as a user runs it. A small vocab (the corpus's most frequent WordPieces) keeps the
LM head cheap enough for a 2-core machine."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from minibert.config import Config
from minibert.train import (
    MicroBatchSampler,
    build_data_iterator,
    build_datasets,
    build_model_and_optimizer,
    main,
    train,
    train_step,
)
from minibert.training import checkpoint
from minibert.training.training_log import IntervalStats, TrainingLogger, batch_flops
from minibert.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_PY = os.path.join(ROOT, "minibert", "train.py")
NUM = r"[-+]?\d\.\d{6}E[-+]\d{2}"
ACC = r"[01]\.\d{4}"  # an accuracy: a share in [0, 1], 4 decimals
LOG_LINE = re.compile(
    r"^iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| elapsed time per iteration \(ms\): \d+\.\d \| "
    rf"learning rate: ({NUM}) \| global batch size: +(\d+) \| lm loss: ({NUM}) \| sop loss: ({NUM}) \| "
    rf"lm acc: ({ACC}) \| sop acc: ({ACC}) \| "
    r"loss scale: (\d+\.\d) \| grad norm: (\d+\.\d{3}) \| number of skipped iterations: +(\d+) \| "
    r"number of nan iterations: +(\d+) \|$")
VALID_LINE = re.compile(rf"^validation loss at iteration (\d+)( on validation set| on test set)? \| "
                        rf"lm loss value: ({NUM}) \| lm loss PPL: ({NUM}) \| sop loss value: ({NUM}) \| "
                        rf"sop loss PPL: ({NUM}) \| lm acc value: ({ACC}) \| sop acc value: ({ACC}) \|$")


@pytest.fixture(scope="module")
def data(tiny_data):
    return tiny_data


def tiny_args(data, *extra):
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2",
            "--data-path", data["prefix"], "--vocab-file", data["vocab"], "--split", "90,5,5",
            "--num-workers", "0", "--eval-iters", "2", "--distributed-backend", "gloo"]
    return args + [str(e) for e in extra]


def one_layer_config(data, device_type="cpu", **overrides):
    """A validated 1-layer Config on the tiny corpus, for tests that call the trainer's pieces directly."""
    cfg = Config(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                 global_batch_size=8, train_iters=4, lr=1e-3, data_path=[data["prefix"]],
                 vocab_file=data["vocab"], split="90,5,5", num_workers=0, eval_iters=1, **overrides)
    validate(cfg, device_type=device_type)
    return cfg


def run_cli(args, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env_extra or {})}
    env.pop("WORLD_SIZE", None)
    # torch.set_num_threads(1) in the child: OMP_NUM_THREADS=1 does it for torch's CPU ops
    return subprocess.run([sys.executable, TRAIN_PY] + args, capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=600)


def train_lines(stdout):
    return [LOG_LINE.match(line) for line in stdout.splitlines() if line.startswith("iteration ")]


def test_log_format_loss_decrease_tensorboard_and_checkpoints(data):
    save, tb = data["dir"] / "run1", data["dir"] / "tb1"
    result = run_cli(tiny_args(data, "--train-iters", 40, "--log-interval", 5, "--eval-interval", 20,
                               "--save", save, "--save-interval", 20, "--tensorboard-dir", tb))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "building train/valid/test datasets ..." in out and "starting training" in out
    assert out.index("building train/valid/test datasets ...") < out.index("starting training")
    lines = train_lines(out)
    assert len(lines) == 8 and all(lines), [line for line in out.splitlines() if line.startswith("iteration ")]
    assert [int(m[1]) for m in lines] == list(range(5, 41, 5))
    assert [int(m[3]) for m in lines] == [8 * i for i in range(5, 41, 5)]
    assert all(m[2] == "40" and m[5] == "8" and m[10] == "1.0" for m in lines)
    lm = [float(m[6]) for m in lines]
    assert lm[0] > 7.0, lm  # about ln(1505) = 7.3 at init: uniform over the vocab
    assert lm[-1] < lm[0] - 0.5 and sum(lm[4:]) < sum(lm[:4]) - 2.0, lm  # measured: 7.29 -> 6.31
    lm_acc, sop_acc = [float(m[8]) for m in lines], [float(m[9]) for m in lines]
    assert all(0.0 <= a <= 1.0 for a in lm_acc + sop_acc)
    # it learns the frequent tokens: measured 0.0065 in the first interval, 0.123 -> 0.231 summed over halves
    assert lm_acc[0] < 0.01 and sum(lm_acc[4:]) > sum(lm_acc[:4]) + 0.05, lm_acc
    assert float(lines[-1][4]) == 0.0  # linear decay to --min-lr 0 at --lr-decay-iters = train-iters
    valid = [VALID_LINE.match(line) for line in out.splitlines() if line.startswith("validation loss")]
    assert all(valid) and [(m[1], m[2]) for m in valid] == [
        ("20", None), ("40", None), ("40", " on validation set"), ("40", " on test set")]
    assert all(0.0 <= float(m[7]) <= 1.0 and 0.0 <= float(m[8]) <= 1.0 for m in valid)
    # checkpoints: Megatron's layout at the save interval, tracker at the last
    assert open(save / "latest_checkpointed_iteration.txt").read() == "40"
    for it in (20, 40):
        assert os.path.isfile(checkpoint.checkpoint_path(str(save), it))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "sop loss", "learning-rate", "loss-scale", "grad-norm", "throughput",
            "lm loss validation", "lm loss validation ppl", "lm acc", "sop acc", "lm acc validation",
            "sop acc validation", "lm acc test", "sop acc test"} <= tags
    assert not {"lm acc validation ppl", "lm acc test ppl"} & tags  # a share has no perplexity
    assert [e.step for e in events.Scalars("lm loss")] == list(range(5, 41, 5))
    assert [e.value for e in events.Scalars("lm loss")] == pytest.approx(lm, rel=1e-5)
    assert [e.value for e in events.Scalars("lm acc")] == pytest.approx(lm_acc, abs=5e-5)  # printed: 4 decimals
    assert [e.value for e in events.Scalars("lm acc test")] == pytest.approx([float(valid[-1][7])], abs=5e-5)


def test_exact_resume(data):
    """Stopped at 6 (--exit-interval) and resumed from its checkpoint, a run logs what an unbroken
    run logs, with dropout on: weights, Adam, LR, RNG and both data positions come back. In bf16: the
    fp32 masters come back from the checkpoint, not from the rounded 16-bit weights."""
    common = ("--train-iters", 12, "--log-interval", 1, "--eval-interval", 4, "--split", "80,20,0", "--bf16")
    unbroken = run_cli(tiny_args(data, *common, "--save", data["dir"] / "unbroken"))
    stopped = run_cli(tiny_args(data, *common, "--save", data["dir"] / "resumed", "--exit-interval", 6))
    resumed = run_cli(tiny_args(data, *common, "--save", data["dir"] / "resumed",
                                "--load", data["dir"] / "resumed"))
    for result in (unbroken, stopped, resumed):
        assert result.returncode == 0, result.stderr

    def comparable(stdout):  # every field but the time
        lines = [re.sub(r"elapsed time per iteration \(ms\): [\d.]+", "", line) for line in stdout.splitlines()
                 if line.startswith(("iteration ", "validation loss"))]
        return lines

    first, second, whole = comparable(stopped.stdout), comparable(resumed.stdout), comparable(unbroken.stdout)
    assert "loaded checkpoint" in resumed.stdout and any("iteration 4 |" in line for line in first)
    assert len(train_lines(stopped.stdout)) == 6 and len(train_lines(resumed.stdout)) == 6
    assert first + second == whole
    # and bit for bit: the final weights and Adam moments
    a = checkpoint.load_checkpoint(str(data["dir"] / "unbroken"))
    b = checkpoint.load_checkpoint(str(data["dir"] / "resumed"))
    assert a["iteration"] == b["iteration"] == 12
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for name, state in a["optimizer"]["params"].items():
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[kind], b["optimizer"]["params"][name][kind]), (name, kind)
    # saved at 12 after the evaluations at 4, 8 and 12 (the final one comes after the save)
    assert (a["consumed_train_samples"], a["consumed_valid_samples"]) == (12 * 8, 3 * 2 * 8)


def run_main(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return info.value.code, err


@pytest.mark.parametrize("case", ["prefix", "vocab", "positions", "batch", "warmup", "world", "checkpoint", "graph"])
def test_bad_inputs_exit_2_with_one_line(data, capsys, monkeypatch, case):
    args = tiny_args(data, "--train-iters", 3)
    expect = {"prefix": "_text_sentence", "vocab": "--vocab-file", "positions": "--max-position-embeddings",
              "batch": "--global-batch-size", "warmup": "--lr-decay-iters", "world": "data-parallel size = 4 x 2",
              "checkpoint": "iter_0000003", "graph": "--cuda-graph-impl local needs a CUDA GPU"}
    if case == "prefix":
        args[args.index("--data-path") + 1] = data["prefix"][:-len("_text_sentence")]
    elif case == "vocab":  # data tokenized with the full 30522-token vocab, trained with the small one
        args[args.index("--data-path") + 1] = data["full_prefix"]
    elif case == "positions":
        args += ["--max-position-embeddings", "16"]
    elif case == "batch":
        args[args.index("--global-batch-size") + 1] = "6"
    elif case == "warmup":
        args += ["--lr-warmup-iters", "3"]
    elif case == "world":  # two processes (as torchrun would say): 8 samples per micro-batch round
        monkeypatch.setenv("WORLD_SIZE", "2")
        args[args.index("--global-batch-size") + 1] = "4"
    elif case == "checkpoint":
        load = data["dir"] / "corrupt"
        path = checkpoint.checkpoint_path(str(load), 3)
        os.makedirs(os.path.dirname(path))
        open(path, "wb").write(b"\x00garbage")
        (load / "latest_checkpointed_iteration.txt").write_text("3")
        args += ["--load", load]
    elif case == "graph":  # CUDA graphs on this CPU
        args += ["--cuda-graph-impl", "local"]
    code, err = run_main([str(a) for a in args], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error:") and expect[case] in err[0], err


def test_unknown_flag_exits_2_from_the_command_line(data):
    result = run_cli(tiny_args(data, "--train-iters", 2, "--no-such-flag", 3))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--no-such-flag" in lines[0]


def test_fp16_on_cpu_warns_once_and_runs_fp32(data, tmp_path):
    """The CPU path on a laptop: --fp16 falls back to fp32 with one warning, and the first run has Triton made
    unimportable (no wheel outside Linux): the trainer imports it only where a kernel runs."""
    args = tiny_args(data, "--train-iters", 3, "--log-interval", 1, "--eval-iters", 0, "--fp16",
                     "--save", data["dir"] / "fp16")
    args.remove("--distributed-backend"), args.remove("gloo"), args.remove("--num-workers"), args.remove("0")
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('raise ImportError("no Triton here (the test hides it)")\n')
    result = run_cli(args, env_extra={"PYTHONPATH": str(tmp_path)})  # defaults not passed are not warned about
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "--fp16" in warnings[0], warnings
    asked = run_cli(args + ["--distributed-backend", "nccl", "--num-workers", "2", "--save", data["dir"] / "fp16b"])
    assert asked.returncode == 0, asked.stderr
    warnings = [line for line in asked.stderr.splitlines() if line.startswith("warning:")]
    assert len([w for w in warnings if "nccl" in w]) == 1 and len([w for w in warnings if "--num-workers 2" in w]) == 1
    assert all(m and m[10] == "1.0" for m in train_lines(result.stdout))
    saved = checkpoint.load_checkpoint(str(data["dir"] / "fp16"))
    assert saved["args"]["fp16"] is False
    assert all(v.dtype == torch.float32 for v in saved["model"].values() if v.is_floating_point())


def test_bf16_on_cpu_through_the_python_api(data, tmp_path, capsys):
    """The notebook's entry point: train(cfg, on_log=...) in-process, bf16 with fp32 masters; with
    --profile over iterations [1, 3): a Chrome trace per rank and the top-operations table."""
    records = []
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32, micro_batch_size=4,
                 global_batch_size=8, train_iters=4, lr=3e-3, lr_warmup_iters=1, data_path=[data["prefix"]],
                 vocab_file=data["vocab"], split="90,5,5", num_workers=0, eval_iters=1, eval_interval=2,
                 log_interval=2, bf16=True, distributed_backend="gloo", profile=True, profile_step_start=1,
                 profile_step_end=3, tensorboard_dir=str(tmp_path))
    result = train(cfg, on_log=records.append)
    trace_path = tmp_path / "profile_rank0_iter1.json"
    assert f"profile of iterations [1, 3) written to {trace_path}" in capsys.readouterr().out
    with open(trace_path) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert "MixedPrecisionOptimizer.step" in names and {"aten::mm", "aten::addmm"} & names, sorted(names)[:20]
    assert [r["kind"] for r in records] == ["train", "validation", "train", "validation", "validation", "test"]
    assert all(torch.isfinite(torch.tensor(r["lm loss"])) for r in records)
    assert all(0.0 <= r["lm acc"] <= 1.0 and 0.0 <= r["sop acc"] <= 1.0 for r in records)  # bf16 logits too
    assert result.iteration == 4 and result.consumed_train_samples == 32
    assert all(p.dtype == torch.bfloat16 for p in result.model.parameters())
    assert all(m.dtype == torch.float32 for m in result.optimizer.master_params)


def test_micro_batch_order_follows_formats_md():
    """Iteration t, rank r, micro-batch k holds rows t*G + k*m*DP + r*m + [0, m) (docs/formats.md)."""
    m, dp, G, consumed = 2, 3, 12, 24
    per_rank = [list(MicroBatchSampler(100, consumed, m, dp_rank=r, dp_size=dp)) for r in range(dp)]
    for r in range(dp):
        for t in range(2):
            for k in range(G // (m * dp)):
                start = consumed + t * G + k * m * dp + r * m
                assert per_rank[r][t * (G // (m * dp)) + k] == list(range(start, start + m))
    assert all(len(batches) == (100 - consumed) // (m * dp) for batches in per_rank)


def test_batch_flops_is_perf_md_formula():
    cfg = Config(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000)
    l, h, s, V = 3, 64, 16, cfg.padded_vocab_size
    flops = batch_flops(cfg, torch.tensor([s, s]), masked=3)
    per_token = 72 * l * h * h + 12 * l * s * h + 6 * (h * V + h * h)  # docs/measuring.md, no padding, r = 1
    assert flops == pytest.approx(2 * s * per_token, rel=1e-12)
    flops = batch_flops(cfg, torch.tensor([s, 10]), masked=3)  # sample 1 has 10 real tokens
    expected = (72 * l * h * h + 6 * (h * V + h * h)) * (s + 10) + 12 * l * h * (s * s + 10 * 10)
    assert flops == pytest.approx(expected, rel=1e-12)
    sparse = Config(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000,
                    sparse_mlm=True)  # only the 3 masked positions reach the LM head
    expected = 72 * l * h * h * (s + 10) + 12 * l * h * (s * s + 10 * 10) + 6 * (h * V + h * h) * 3
    assert batch_flops(sparse, torch.tensor([s, 10]), masked=3) == pytest.approx(expected, rel=1e-12)


def test_the_data_loader_gives_the_same_batches_with_workers(data):
    """The worker processes hand their micro-batches over as numpy arrays (batches.stack_samples: cheaper
    than a shared-memory file per tensor); the main process sees the same int64 tensors, in the same
    order, as with no workers."""
    cfg = one_layer_config(data)
    _, (train_ds, _, _) = build_datasets(cfg)
    device = torch.device("cpu")
    alone = build_data_iterator(train_ds, 8, cfg, device)
    workers = build_data_iterator(train_ds, 8, Config(**{**vars(cfg), "num_workers": 2}), device)
    for _ in range(6):
        a, b = next(alone), next(workers)
        assert list(a) == list(b) and "padding_mask" in a and a["text"].shape == (4, 32)
        for key in a:
            assert isinstance(b[key], torch.Tensor) and b[key].dtype == torch.int64 and torch.equal(a[key], b[key])


def test_prefetching_gives_the_steps_of_the_plain_iterator_and_reports_running_out_at_the_step(data):
    """train_step with PrefetchingBatches (the trainer's iterator: the next step's batches built before
    the optimizer's host sync) takes the same batches in the same order as with the plain iterator, so
    the losses are equal; the prefetch past the last sample raises nothing, the step that needs it does."""
    from minibert.data.batches import PrefetchingBatches
    from minibert.errors import UsageError
    cfg = one_layer_config(data)
    _, (train_ds, _, _) = build_datasets(cfg)
    device = torch.device("cpu")
    total = len(train_ds) // 8 * 8
    runs = []
    for wrap in (lambda it: it, PrefetchingBatches):
        torch.manual_seed(0)
        model, optimizer, scheduler = build_model_and_optimizer(cfg, device)
        iterator = wrap(build_data_iterator(train_ds, total - 24, cfg, device))  # 3 steps' samples left
        runs.append([float(train_step(model, optimizer, scheduler, iterator, cfg, device).losses["lm loss"])
                     for _ in range(3)])
        if isinstance(iterator, PrefetchingBatches):
            assert isinstance(iterator.ready, UsageError)  # the 4th step's prefetch found no samples
        with pytest.raises(UsageError, match="ran out of samples"):
            train_step(model, optimizer, scheduler, iterator, cfg, device)
    assert runs[0] == runs[1]


def test_fp16_overflow_skips_the_update_and_the_lr_step(data, capsys):
    """Megatron's semantics at the trainer level: an overflowing fp16 step changes no weight, does not
    advance the LR schedule, is counted as skipped, and its loss is left out of the interval's mean.
    (fp16 runs on the CPU here by calling the pieces directly; the CLI switches a CPU run to fp32.)"""
    cfg = one_layer_config(data, "cuda", fp16=True)  # validated as for a GPU, so fp16 stays on
    device = torch.device("cpu")
    _, (train_ds, _, _) = build_datasets(cfg)
    model, optimizer, scheduler = build_model_and_optimizer(cfg, device)
    assert model.embedding.word_embeddings.weight.dtype == torch.float16
    iterator = build_data_iterator(train_ds, 0, cfg, device)
    before = [p.detach().clone() for p in model.parameters()]
    stats, logger = IntervalStats(device), TrainingLogger(cfg, device)
    step = train_step(model, optimizer, scheduler, iterator, cfg, device)  # loss x 2^32: overflows
    assert step.skipped and step.grad_norm is None
    stats.add(step)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scheduler.num_steps == 0
    # an interval of only skipped steps has no loss mean and no grad norm: Megatron leaves them out
    only_skipped = IntervalStats(device)
    only_skipped.add(step)
    capsys.readouterr()
    logger.log_train(1, 8, optimizer, only_skipped)
    line = capsys.readouterr().out.strip()
    assert "number of skipped iterations:   1" in line
    assert "lm loss" not in line and "lm acc" not in line and "grad norm" not in line and "nan" not in \
        line.lower().replace("number of nan iterations", "")
    optimizer.loss_scaler.scale = 128.0  # small enough for these gradients
    step = train_step(model, optimizer, scheduler, iterator, cfg, device)
    assert not step.skipped and scheduler.num_steps == cfg.global_batch_size
    stats.add(step)
    capsys.readouterr()
    logger.log_train(2, 16, optimizer, stats)
    line = capsys.readouterr().out.strip()
    assert LOG_LINE.match(line), line
    assert "number of skipped iterations:   1" in line and "loss scale: 128.0" in line
    assert f"lm loss: {float(step.losses['lm loss']):.6E}" in line  # the mean leaves the skipped step out
    right, masked = int(step.counts["lm correct"]), int(step.counts["lm masked"])  # and so do the counts
    assert masked > 0 and f"lm acc: {right / masked:.4f}" in line


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--exit-interval", "--fp16", "--tensorboard-dir", "--load"))
