"""What protects a run from silent damage, through the command line: the NaN policy (a non-finite loss or
grad norm never reaches the weights), padding read from the [PAD] id whatever its number, a resume that
refuses another sample stream, fine-tuning from weights, and one atomic writer for every file."""
import glob
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from minibert import atomic
from minibert.config import Config
from minibert.data.masked_lm import build_train_valid_test_datasets
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.preprocess import preprocess
from minibert.tools import reshard
from minibert.train import get_batch
from minibert.train import main as train_main
from minibert.training import checkpoint, save_lock
from tests import launch

ROOT = launch.ROOT


def args(data, *extra):
    base = ["--num-layers", 2, "--hidden-size", 32, "--num-attention-heads", 4, "--seq-length", 32,
            "--micro-batch-size", 4, "--global-batch-size", 8, "--lr", 3e-3, "--lr-warmup-iters", 1,
            "--data-path", data["prefix"], "--vocab-file", data["vocab"], "--split", "90,5,5", "--eval-iters", 0,
            "--log-interval", 1]
    return [str(a) for a in base + list(extra)]


@pytest.fixture(scope="module")
def two_iterations(tiny_data, tmp_path_factory):
    """A bf16 run of 2 iterations with a checkpoint at 2: what the resume tests start from."""
    save = tmp_path_factory.mktemp("two") / "ckpt"
    result = launch.run(1, args(tiny_data, "--train-iters", 2, "--bf16", "--save", save))
    assert result.returncode == 0, result.stderr
    return save


def poisoned_copy(source, destination):
    """The checkpoint with the LM head's dense weight at 3e38 (finite, near bf16's largest): its matmul
    overflows to inf and the loss and every gradient become NaN, while every weight stays finite."""
    import shutil
    shutil.copytree(source, destination)
    path = checkpoint.checkpoint_path(str(destination), 2)
    state = torch.load(path, weights_only=True)
    name = "lm_head.dense.weight"
    state["model"][name] = torch.full_like(state["model"][name], 3e38)
    state["optimizer"]["params"][name]["master"] = torch.full_like(state["optimizer"]["params"][name]["master"], 3e38)
    checkpoint.save_checkpoint(str(destination), 2, state)  # as if training had written it (manifest too)
    return destination


def test_nan_stops_the_run_naming_the_iteration_and_the_last_checkpoint(tiny_data, two_iterations, tmp_path):
    save = poisoned_copy(two_iterations, tmp_path / "poisoned")
    result = launch.run(1, args(tiny_data, "--train-iters", 6, "--bf16", "--save", save, "--load", save))
    assert result.returncode == 2
    errors = launch.error_lines(result.stderr)
    assert len(errors) == 1 and "iteration 3:" in errors[0] and "not finite" in errors[0], result.stderr
    assert f"the last checkpoint is iteration 2 in {save}" in errors[0]
    assert "--no-check-for-nan-in-loss-and-grad" in errors[0]
    assert checkpoint.read_tracker(str(save)) == 2  # nothing was saved after the bad step


def test_without_the_check_nan_steps_are_skipped_counted_and_never_reach_the_weights(tiny_data, two_iterations,
                                                                                     tmp_path):
    load = poisoned_copy(two_iterations, tmp_path / "poisoned")
    save = tmp_path / "after"
    result = launch.run(1, args(tiny_data, "--train-iters", 5, "--bf16", "--load", load, "--save", save,
                                "--no-check-for-nan-in-loss-and-grad"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("iteration ")]
    assert len(lines) == 3 and all("number of nan iterations:   1" in line for line in lines), lines
    assert all("number of skipped iterations:   1" in line and "lm loss" not in line for line in lines)
    before = checkpoint.load_checkpoint(str(load))
    after = checkpoint.load_checkpoint(str(save))
    for name, value in after["model"].items():
        assert torch.isfinite(value.float()).all(), name
        assert torch.equal(value, before["model"][name]), name  # no update happened
    for name, entry in after["optimizer"]["params"].items():
        assert all(torch.isfinite(entry[k]).all() for k in ("master", "exp_avg", "exp_avg_sq")), name


def test_padding_is_read_from_the_pad_id_whatever_its_number(tiny_data, tmp_path):
    """Megatron's samples store the vocab's [PAD] id in padding_mask at padded positions: reading
    `padding_mask == 0` as padding is right only when [PAD] is id 0."""
    tokens = open(tiny_data["vocab"]).read().split("\n")[:-1]
    reordered = tokens[1:4] + ["[PAD]"] + tokens[4:]  # [UNK] [CLS] [SEP] [PAD] [MASK] ...: [PAD] is id 3
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in reordered))
    tokenizer = BertWordPieceTokenizer(str(vocab))
    assert tokenizer.pad == 3
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(d + "\n" for d in tiny_data["docs"][:80]))
    (prefix,) = preprocess(str(corpus), str(tmp_path / "c"), tokenizer, split_sentences=True, progress=False)
    train, _, _ = build_train_valid_test_datasets(prefix, tokenizer, split="1,0,0", num_samples=(16, 0, 0),
                                                  seq_length=64, seed=1, binary_head=True)
    cfg = Config(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=64, vocab_size=tokenizer.vocab_size,
                 micro_batch_size=8)
    loader = iter(torch.utils.data.DataLoader(train, batch_size=8))
    batch = get_batch(loader, torch.device("cpu"), cfg)
    padding_mask = batch["padding_mask"]
    assert (padding_mask == 3).any() and not (padding_mask == 0).any()  # what the old reading missed
    assert torch.equal(batch["is_pad"], padding_mask != 1)
    assert batch["tokens"] == int((padding_mask == 1).sum())


def test_resume_refuses_another_sample_stream_and_warns_on_a_rebuilt_index(tiny_data, two_iterations, tmp_path,
                                                                          capsys):
    import shutil
    save = tmp_path / "ckpt"
    shutil.copytree(two_iterations, save)
    for flag, value in (("--seed", 7), ("--split", "80,10,10"), ("--mask-prob", 0.2)):  # refused in this process
        code, _, err = launch.run_main(train_main, args(tiny_data, "--train-iters", 4, "--bf16", "--load", save,
                                                        flag, value), capsys)
        errors = launch.error_lines(err)
        assert code == 2 and len(errors) == 1 and flag in errors[0], (flag, err)
    longer = launch.run(1, args(tiny_data, "--train-iters", 4, "--bf16", "--load", save, "--micro-batch-size", 2))
    assert longer.returncode == 0, longer.stderr  # a longer run with another micro-batch size continues
    warnings = [line for line in longer.stderr.splitlines() if line.startswith("warning:")]
    assert any("--train-iters" in w and "rebuilt index" in w for w in warnings), warnings
    assert "loaded checkpoint" in longer.stdout and "iteration        3/" in longer.stdout


def test_finetune_and_released_weights_start_at_iteration_0(tiny_data, two_iterations, tmp_path):
    finetune = launch.run(1, args(tiny_data, "--train-iters", 2, "--bf16", "--load", two_iterations, "--finetune"))
    assert finetune.returncode == 0, finetune.stderr
    assert "at iteration 0" in finetune.stdout and "iteration        1/       2" in finetune.stdout
    # weights only ("release", as written by minibert.tools.convert from-hf), shape taken from the checkpoint
    model, cfg = reshard.load_model(str(two_iterations))
    release = tmp_path / "release"
    checkpoint.save_weights(str(release), model, cfg)
    no_shape = [a for a in args(tiny_data, "--train-iters", 2, "--load", release, "--use-checkpoint-args")]
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        i = no_shape.index(flag)
        del no_shape[i:i + 2]
    result = launch.run(1, no_shape)
    assert result.returncode == 0, result.stderr
    assert "at iteration 0" in result.stdout and "iteration        2/       2" in result.stdout
    optim_only = launch.run(1, args(tiny_data, "--train-iters", 3, "--bf16", "--load", two_iterations,
                                    "--no-load-optim", "--no-load-rng"))
    assert optim_only.returncode == 0 and "at iteration 2" in optim_only.stdout, optim_only.stderr


def test_a_save_directory_belongs_to_one_run_and_a_failed_save_leaves_nothing(tiny_data, two_iterations, tmp_path,
                                                                                capsys):
    """--save holds one run's work. A run that does not resume from it refuses to write there (a mistyped
    --load, a second job given the same --save); a live run's lock turns a concurrent launch away, and a
    dead one's is taken over; a save that fails (a full disk, here a file-size limit) leaves no directory
    and no temporary file; a killed save's temporary file goes when the next run starts; --overwrite-save
    starts over."""
    import shutil

    from tests.test_faults import kill_the_whole_job
    save = tmp_path / "ckpt"
    shutil.copytree(two_iterations, save)
    tracker = save / checkpoint.TRACKER_FILENAME
    for extra in ([], ["--load", tmp_path / "ckpt-typo"], ["--load", save, "--finetune"]):
        code, _, err = launch.run_main(train_main, args(tiny_data, "--train-iters", 4, "--bf16", "--save", save,
                                                        *extra), capsys)
        errors = launch.error_lines(err)
        assert code == 2 and len(errors) == 1 and "another run's checkpoints" in errors[0], (extra, err)
        assert "--overwrite-save" in errors[0] and tracker.read_text() == "2"
    resume = args(tiny_data, "--bf16", "--load", save, "--save", save)
    # a full disk: every write past half the size of the checkpoint file fails (EFBIG, as ENOSPC would)
    limit = os.path.getsize(checkpoint.checkpoint_path(str(save), 2)) // 2

    def small_files():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with an error instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    full = subprocess.run([sys.executable, launch.TRAIN_PY, *resume, "--train-iters", "3"], capture_output=True,
                          text=True, env=launch.env(), cwd=ROOT, timeout=launch.TIMEOUT, preexec_fn=small_files)
    errors = launch.error_lines(full.stderr)
    assert full.returncode == 2 and len(errors) == 1, full.stderr[-2000:]
    assert "saving iteration 3" in errors[0] and "File too large" in errors[0], errors
    assert sorted(os.listdir(save)) == ["iter_0000002", checkpoint.TRACKER_FILENAME] and tracker.read_text() == "2"
    # two live runs: the second is turned away by the first's lock; the first is then killed mid-run
    job = launch.Job([sys.executable, launch.TRAIN_PY, *resume, "--train-iters", "100000"])
    job.wait_for(lambda line: "iteration        4/" in line)
    code, _, err = launch.run_main(train_main, resume + ["--train-iters", "4"], capsys)
    assert code == 2 and f"in use by process {job.process.pid} of this host" in err, err
    kill_the_whole_job(job)
    job.finish()
    stale = save / "iter_0000002" / ".model_optim_rng.pt.tmp-host-1-0123abcd"  # what a save killed midway leaves
    stale.write_bytes(b"x" * 10 ** 5)
    after = launch.run(1, resume + ["--train-iters", "3"])
    assert after.returncode == 0, after.stderr[-2000:]
    assert f"process {job.process.pid}, which has ended; taking it over" in after.stderr
    assert "removed 0.1 MB of temporary files" in after.stdout and not stale.exists()
    assert tracker.read_text() == "3" and not (save / save_lock.LOCK_FILENAME).exists()
    again = launch.run(1, args(tiny_data, "--train-iters", 2, "--save-interval", 1, "--save", save,
                               "--overwrite-save"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert "--overwrite-save: deleted iter_0000002, iter_0000003, latest_checkpointed_iteration.txt" in again.stdout
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002", checkpoint.TRACKER_FILENAME]
    assert checkpoint.read_args(str(save))["bf16"] is False  # this run's checkpoints, not the old run's


def test_every_file_is_written_through_the_one_atomic_helper():
    writers = [path for path in glob.glob(os.path.join(ROOT, "minibert", "**", "*.py"), recursive=True)
               + glob.glob(os.path.join(ROOT, "bench", "*.py"))
               if "os.replace(" in open(path).read() and not path.endswith(os.path.join("minibert", "atomic.py"))]
    assert writers == []
    a, b = atomic.temporary_path("/x/y/file.pt"), atomic.temporary_path("/x/y/file.pt")
    assert a != b and socket.gethostname() in a and f"-{os.getpid()}-" in a and os.path.dirname(a) == "/x/y"


def test_a_crash_before_the_rename_leaves_no_file(tmp_path):
    def write(f):
        f.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError):
        atomic.atomic_write(str(tmp_path / "new" / "f.bin"), write, make_dirs=True)
    assert os.listdir(tmp_path / "new") == []
    assert np.array_equal(np.array(os.listdir(tmp_path)), np.array(["new"]))


def test_a_nan_on_one_tensor_parallel_rank_stops_every_rank(tiny_data, tmp_path):
    """Only rank 1's copy of a replicated weight is poisoned: its NaN reaches every rank's grad norm."""
    import shutil
    save = tmp_path / "tp2"
    first = launch.run(2, args(tiny_data, "--train-iters", 2, "--tensor-model-parallel-size", 2, "--save", save))
    assert first.returncode == 0, first.stderr[-2000:]
    assert sorted(os.listdir(save / "iter_0000002")) == ["manifest.json", "mp_rank_00", "mp_rank_01"]  # no _PPP
    path = checkpoint.checkpoint_path(str(save), 2, tp_rank=1)
    state = torch.load(path, weights_only=True)
    state["model"]["lm_head.dense.weight"] = torch.full_like(state["model"]["lm_head.dense.weight"], 3e38)
    entries = {}
    from minibert.training.manifest import write_manifest
    directory = checkpoint.iteration_dir(str(save), 2)
    entries["mp_rank_01/model_optim_rng.pt"] = checkpoint.write_file(path, state)
    import json
    manifest = json.load(open(os.path.join(directory, "manifest.json")))["files"]
    manifest.update(entries)
    write_manifest(directory, manifest)
    result = launch.run(2, args(tiny_data, "--train-iters", 4, "--tensor-model-parallel-size", 2, "--load", save,
                                "--save", save), monitor_interval=launch.EVERY_RANK_SPEAKS)
    errors = launch.error_lines(result.stderr)
    assert result.returncode != 0 and len(errors) == 2 and all("iteration 3:" in e and "not finite" in e
                                                               for e in errors), result.stderr[-3000:]
    shutil.rmtree(save)


@pytest.mark.parametrize("flag,value,named", [("--num-layers", 3, "--num-layers 2 (now 3)"),
                                              ("--post-ln", None, "--post-ln False (now True)"),
                                              ("--hidden-size", 64, "--hidden-size 32 (now 64)")])
def test_a_checkpoint_of_another_model_exits_2_naming_what_differs(tiny_data, two_iterations, flag, value, named,
                                                                   capsys):
    extra = [flag] if value is None else [flag, value]
    code, _, err = launch.run_main(train_main, args(tiny_data, "--train-iters", 4, "--bf16", "--load", two_iterations,
                                                    *extra), capsys)
    errors = launch.error_lines(err)
    assert code == 2 and len(errors) == 1 and named in errors[0], err


def test_all_padding_and_nothing_masked_give_finite_losses(tiny_data):
    from minibert.train import build_model_and_optimizer, forward_step
    cfg = Config(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=16, micro_batch_size=2,
                 global_batch_size=2, train_iters=1, lr=1e-3, vocab_file=tiny_data["vocab"])
    from minibert.validate import validate
    validate(cfg)
    zeros = torch.zeros(2, 16, dtype=torch.int64)
    batch_cpu = {"text": zeros, "types": zeros, "labels": torch.full((2, 16), -1), "padding_mask": zeros,
                 "loss_mask": zeros, "is_random": torch.zeros(2, dtype=torch.int64)}
    model, _, _ = build_model_and_optimizer(cfg, torch.device("cpu"))
    batch = get_batch(iter([batch_cpu]), torch.device("cpu"), cfg)  # every position padding, nothing masked
    loss, metrics = forward_step(batch, model, None, cfg)
    loss.backward()
    assert torch.isfinite(loss) and float(metrics["lm loss"]) == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
