"""minibert.checkpoint: Megatron's layout, weights_only loading, atomic writes, clear errors."""
import os
import random
import socket

import numpy as np
import pytest
import torch

from minibert import checkpoint, resume
from minibert.config import Config
from minibert.errors import UsageError, exit_on_usage_error
from minibert.model import BertModel
from minibert.lr_schedule import build_scheduler
from minibert.build import build_grad_buffers
from minibert.optim import build_optimizer


def tiny_setup(**overrides):
    settings = dict(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=40,
                    micro_batch_size=2, global_batch_size=2, train_iters=10, lr=1e-3, lr_decay_iters=10,
                    fp16=True)
    cfg = Config(**{**settings, **overrides})
    torch.manual_seed(0)
    model = BertModel(cfg).to(torch.float16 if cfg.fp16 else torch.float32)
    optimizer = build_optimizer(build_grad_buffers(model, cfg), cfg)
    scheduler = build_scheduler(optimizer, cfg)
    return cfg, model, optimizer, scheduler


def test_layout_and_names(tmp_path):
    save = str(tmp_path)
    path = checkpoint.save_checkpoint(save, 100, {"iteration": 100})
    assert path == os.path.join(save, "iter_0000100", "mp_rank_00", "model_optim_rng.pt")
    assert sorted(os.listdir(save)) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    assert os.listdir(os.path.join(save, "iter_0000100", "mp_rank_00")) == ["model_optim_rng.pt"]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "100"
    # pipeline parallel: mp_rank_{tp:02d}_{pp:03d}
    assert checkpoint.checkpoint_path("S", 7, tp_rank=1, pp_rank=3, pp_size=4) == os.path.join(
        "S", "iter_0000007", "mp_rank_01_003", "model_optim_rng.pt")


def test_full_state_loads_with_weights_only_and_restores(tmp_path):
    cfg, model, optimizer, scheduler = tiny_setup()
    optimizer.loss_scaler.update(True)   # some non-default state to carry over
    scheduler.step(6)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    state = checkpoint.training_state(cfg, 3, model, optimizer, scheduler, 6, 4)
    checkpoint.save_checkpoint(str(tmp_path), 3, state)
    expected_draws = (random.random(), np.random.rand(), torch.rand(2))

    raw = torch.load(checkpoint.checkpoint_path(str(tmp_path), 3), weights_only=True)
    assert {"iteration", "checkpoint_version", "model", "optimizer", "opt_param_scheduler", "rng_state",
            "consumed_train_samples", "consumed_valid_samples", "args"} <= set(raw)
    assert raw["args"]["hidden_size"] == 16 and raw["args"]["fp16"] is True
    assert raw["optimizer"]["params"]["embedding.word_embeddings.weight"]["master"].dtype == torch.float32

    loaded = checkpoint.load_checkpoint(str(tmp_path))
    cfg2, model2, optimizer2, scheduler2 = tiny_setup()
    assert resume.restore_training_state(loaded, cfg2, model2, optimizer2, scheduler2) == (3, 6, 4)
    resume.set_rng_state(loaded["rng_state"][0])
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(2), expected_draws[2])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert optimizer2.loss_scaler.state_dict() == optimizer.loss_scaler.state_dict()
    assert scheduler2.num_steps == 6 and optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save = str(tmp_path)
    checkpoint.save_checkpoint(save, 1, {"iteration": 1, "x": torch.ones(3)})
    real_save = torch.save

    def crashing_save(obj, f):
        real_save(obj, f)
        f.write(b"half")
        raise OSError("disk full")  # the writer dies after writing part of the file

    monkeypatch.setattr(checkpoint.torch, "save", crashing_save)
    with pytest.raises(OSError):
        checkpoint.save_checkpoint(save, 2, {"iteration": 2, "x": torch.zeros(3)})
    monkeypatch.undo()
    assert open(checkpoint.tracker_path(save)).read() == "1"
    rank_dir = os.path.dirname(checkpoint.checkpoint_path(save, 2))
    assert os.listdir(rank_dir) == []  # neither the final name nor a temporary file
    assert checkpoint.read_tracker(save) == 1


def test_missing_tracker_warns_and_starts_fresh_unless_the_folder_holds_something_else(tmp_path, capsys):
    """Megatron's first launch (`--save X --load X`): a missing or empty X, or one holding only what a first
    save cut short leaves behind, starts from scratch with one warning. A folder holding anything else is
    not a checkpoint directory (a mistyped --load): one line, exit 2, instead of training from scratch."""
    assert checkpoint.load_checkpoint(str(tmp_path)) is None
    assert "warning: no checkpoint tracker" in capsys.readouterr().err
    assert checkpoint.load_checkpoint(str(tmp_path / "does-not-exist")) is None
    cut_short = tmp_path / "first-save-killed"
    (cut_short / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    (cut_short / "iter_0000001" / "mp_rank_00" / ".model_optim_rng.pt.tmp-host-1-abc").write_bytes(b"half")
    assert checkpoint.load_checkpoint(str(cut_short)) is None
    capsys.readouterr()
    for stray in ("corpus_text_sentence.bin", "config.json"):  # data, or an export folder
        other = tmp_path / stray.split(".")[0]
        other.mkdir()
        (other / stray).write_bytes(b"x")
        with pytest.raises(SystemExit) as exit_info:
            exit_on_usage_error(checkpoint.load_checkpoint)(str(other))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(err) == 1 and "holds files but no checkpoint" in err[0], err
        assert stray in err[0] and str(other) in err[0]


def write_tracker(save, text):
    os.makedirs(save, exist_ok=True)
    with open(checkpoint.tracker_path(save), "w") as f:
        f.write(text)


class NotPlainData:
    def __reduce__(self):  # what a malicious pickle would do: run code when loaded
        return (os.getcwd, ())


@pytest.mark.parametrize("problem", ["garbage", "truncated", "missing", "code", "not-a-dict", "tracker",
                                     "bit-flipped", "zeroed"])
def test_bad_checkpoints_exit_2_naming_the_file(tmp_path, capsys, problem):
    save = str(tmp_path)
    path = checkpoint.checkpoint_path(save, 5)
    if problem == "tracker":
        write_tracker(save, "five\n")
    else:
        checkpoint.save_checkpoint(save, 5, {"iteration": 5, "blob": torch.arange(10000)})
    if problem == "garbage":
        with open(path, "wb") as f:
            f.write(b"this is not a checkpoint")
    elif problem == "truncated":
        data = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(data[:len(data) // 2])
    elif problem == "missing":
        os.remove(path)
    elif problem == "code":
        torch.save({"iteration": 5, "evil": NotPlainData()}, path)
    elif problem == "not-a-dict":
        torch.save([1, 2, 3], path)
    elif problem in ("bit-flipped", "zeroed"):  # torch.load would load these silently: the manifest catches them
        data = bytearray(open(path, "rb").read())
        middle = len(data) // 2
        if problem == "bit-flipped":
            data[middle] ^= 0x10
        else:
            data[middle:middle + 512] = bytes(512)
        open(path, "wb").write(bytes(data))

    with pytest.raises(SystemExit) as exit_info:
        exit_on_usage_error(checkpoint.load_checkpoint)(save)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    named = checkpoint.tracker_path(save) if problem == "tracker" else path
    assert named in err[0]


def test_model_shape_mismatch_is_a_usage_error(tmp_path):
    cfg, model, optimizer, scheduler = tiny_setup()
    checkpoint.save_checkpoint(str(tmp_path), 1, checkpoint.training_state(cfg, 1, model, optimizer,
                                                                          scheduler, 2, 0))
    cfg2, model2, optimizer2, scheduler2 = tiny_setup(hidden_size=32)
    with pytest.raises(UsageError, match="--hidden-size 16"):
        resume.restore_training_state(checkpoint.load_checkpoint(str(tmp_path)), cfg2, model2,
                                          optimizer2, scheduler2)


def test_a_lock_from_another_host_or_unreadable_is_reported_with_the_file_to_delete(tmp_path):
    """This host cannot tell whether another host's process lives: the lock stays, and the one line names the
    file to delete. (The same-host cases, live and dead, run through the trainer in tests/test_train_safety.py.)"""
    lock = tmp_path / checkpoint.LOCK_FILENAME
    for text, named in (("node-17 4242\n", "process 4242 on host node-17"), ("", "an unreadable lock")):
        lock.write_text(text)
        with pytest.raises(UsageError) as info:
            checkpoint.lock_directory(str(tmp_path))
        assert named in str(info.value) and f"delete {lock}" in str(info.value) and lock.read_text() == text
    lock.unlink()
    path = checkpoint.lock_directory(str(tmp_path))
    assert lock.read_text().split() == [socket.gethostname(), str(os.getpid())]
    checkpoint.unlock_directory(path)
    assert not lock.exists()
    with pytest.raises(UsageError, match="--overwrite-save would delete the checkpoints --load"):
        checkpoint.check_save_owner(str(tmp_path), str(tmp_path), overwrite_save=True)
