"""minibert.training.checkpoint: Megatron's layout, weights_only loading, atomic writes, clear errors, and checkpoints
written under older parameter names (tests/data/pre_rename_checkpoint) loading under today's; and the --save
directory's lock (minibert.training.save_lock)."""
import os
import random
import socket

import numpy as np
import pytest
import torch

from minibert.config import Config
from minibert.errors import UsageError, exit_on_usage_error
from minibert.model.bert import BertModel
from minibert.tools import reshard
from minibert.training import checkpoint, resume, save_lock
from minibert.training.build import build_grad_buffers, build_model_and_optimizer
from minibert.training.lr_schedule import build_scheduler
from minibert.training.optim import build_optimizer


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
    lock = tmp_path / save_lock.LOCK_FILENAME
    for text, named in (("node-17 4242\n", "process 4242 on host node-17"), ("", "an unreadable lock")):
        lock.write_text(text)
        with pytest.raises(UsageError) as info:
            save_lock.lock_directory(str(tmp_path))
        assert named in str(info.value) and f"delete {lock}" in str(info.value) and lock.read_text() == text
    lock.unlink()
    path = save_lock.lock_directory(str(tmp_path))
    assert lock.read_text().split() == [socket.gethostname(), str(os.getpid())]
    save_lock.unlock_directory(path)
    assert not lock.exists()
    with pytest.raises(UsageError, match="--overwrite-save would delete the checkpoints --load"):
        save_lock.check_save_owner(str(tmp_path), str(tmp_path), overwrite_save=True)


# Written by commit 9d2e13f (README.txt there says how), before TransformerLayer's LayerNorms took megatron-core's
# names: its files hold layers.{i}.attention_layernorm / mlp_layernorm, now input_layernorm / pre_mlp_layernorm.
PRE_RENAME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pre_rename_checkpoint")
OLD_TO_NEW = {"attention_layernorm": "input_layernorm", "mlp_layernorm": "pre_mlp_layernorm"}


def todays_name(old: str) -> str:
    """The fixture's name of a parameter -> today's, spelled out here rather than through the key map."""
    parts = old.split(".")
    if parts[0] == "layers":
        parts[2] = OLD_TO_NEW.get(parts[2], parts[2])
    return ".".join(parts)


def test_a_checkpoint_written_before_the_layernorm_rename_loads_and_restores_under_todays_names():
    raw = torch.load(checkpoint.checkpoint_path(PRE_RENAME, 2), weights_only=True)
    assert "layers.1.attention_layernorm.weight" in raw["model"]  # the fixture does hold the old names
    assert "layers.1.mlp_layernorm.bias" in raw["optimizer"]["params"]
    expected = {todays_name(k): v for k, v in raw["model"].items()}

    model, cfg = reshard.load_model(PRE_RENAME)  # what fill_mask and convert to-hf read
    assert "layers.1.pre_mlp_layernorm.bias" in model.state_dict()
    assert sorted(model.state_dict()) == sorted(expected)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name].float()), name

    cfg = reshard.config_from_args(raw["args"])  # the trainer's resume: the run's own model and optimizer
    model, optimizer, scheduler = build_model_and_optimizer(cfg, torch.device("cpu"))
    loaded = checkpoint.load_checkpoint(PRE_RENAME)
    assert resume.restore_training_state(loaded, cfg, model, optimizer, scheduler) == (2, 8, 0)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    saved = optimizer.state_dict()
    assert saved["step"] == 2.0 and scheduler.num_steps == raw["opt_param_scheduler"]["num_steps"]
    assert sorted(saved["params"]) == sorted(todays_name(k) for k in raw["optimizer"]["params"])
    for old, entry in raw["optimizer"]["params"].items():
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(saved["params"][todays_name(old)][key], entry[key]), (old, key)


def test_the_key_map_renames_only_old_names_in_every_table_of_a_file():
    old, new = "layers.3.mlp_layernorm.weight", "layers.3.pre_mlp_layernorm.weight"
    assert checkpoint.new_key(old) == new and checkpoint.new_key(new) == new
    for kept in ("final_layernorm.weight", "lm_head.layernorm.bias", "layers.0.self_attention.dense.weight",
                 "layers.0.input_layernorm.bias"):
        assert checkpoint.new_key(kept) == kept
    shard = {"step": 1.0, "params": {old: {"range": [0, 4]}}, "grad_scaler": None}
    state = {"model": {old: 1, "lm_head.bias": 2}, "sharding": {old: [0, 2]},
             "optimizer": {"distributed": True, "step": 1.0, "shards": [shard, dict(shard)]}}
    checkpoint.rename_old_keys(state)
    assert list(state["model"]) == [new, "lm_head.bias"] and list(state["sharding"]) == [new]
    assert [list(s["params"]) for s in state["optimizer"]["shards"]] == [[new], [new]]
    today = {"model": {new: 1}, "optimizer": {"params": {new: {}}}}
    tables = today["model"], today["optimizer"]["params"]
    checkpoint.rename_old_keys(today)  # nothing old: the very same dicts
    assert (today["model"], today["optimizer"]["params"]) == tables
    assert today["model"] is tables[0] and today["optimizer"]["params"] is tables[1]
