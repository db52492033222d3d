"""Resharding checkpoints (minibert/tools/reshard.py, `python -m minibert.tools.reshard convert`) on CPU.

All runs are the layout configuration of tests/conftest.py (fp32, dropout off). The one-process run of 8
iterations saves at 4 and 8: its iteration 4 is the ground truth every converted source is compared with,
tensor by tensor (weights and Adam moments), and its iterations 5-8 are the losses a resumed run must log.
Sources, each trained 4 iterations and saved: TP 2 x PP 2 (with sequence parallelism), ZeRO-1 DP 2, and
interleaved PP 2 with 2 chunks per stage. TP 2 x PP 2 is converted to one process and resumed, converted
back (bit for bit the source's files) and resumed on 4 processes; the one-process state is cut into the
interleaved and an uneven pipeline layout; the vocab is re-padded (TP 8: an 8-head bf16 model saved in
this process, with fp32 masters; TP 4); load_model and to-hf read sharded directories; bad inputs exit 2
with one line and write nothing."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from minibert.config import Config
from minibert.model.bert import BertModel
from minibert.parallel.data_parallel import finalize_model_grads
from minibert.parallel.state import ParallelState
from minibert.tools import convert, reshard
from minibert.training import checkpoint
from minibert.training.build import build_grad_buffers
from minibert.training.lr_schedule import build_scheduler
from minibert.training.optim import build_optimizer
from tests import launch

WORD = "embedding.word_embeddings.weight"
VOCAB = 1505  # tests/conftest.py's tiny vocab: 5 special tokens and 1500 WordPieces
SOURCES = {  # name -> processes, flags; every source stops at iteration 4 with a checkpoint
    "tp2-pp2": (4, ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2, "--sequence-parallel"]),
    "zero-dp2": (2, ["--use-distributed-optimizer"]),
    "interleaved": (2, ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1]),
}
CHECKPOINTS = {}  # name -> checkpoint directory, each launch once per session


def saved_run(data, factory, name):
    """The checkpoint directory of source `name`."""
    if name not in CHECKPOINTS:
        ckpt = factory.mktemp(name + "-ckpt") / "ckpt"
        nproc, flags = SOURCES[name]
        launch.layout_run(data, factory, "reshard-" + name, nproc, *flags, "--exit-interval", 4, "--save", ckpt)
        CHECKPOINTS[name] = ckpt
    return CHECKPOINTS[name]


@pytest.fixture(scope="module")
def truth(layout_reference, tmp_path_factory):
    """The one-process run's iteration 4 (tests/conftest.py's layout_reference saves at 4 and 8) as a
    checkpoint directory of its own (tracker "4")."""
    reference = layout_reference["save"]
    directory = tmp_path_factory.mktemp("truth")
    shutil.copytree(reference / "iter_0000004", directory / "iter_0000004")
    (directory / checkpoint.TRACKER_FILENAME).write_text("4")
    return directory


def read(directory, tp=0, pp=0, pp_size=1, iteration=4):
    return torch.load(checkpoint.checkpoint_path(str(directory), iteration, tp, pp, pp_size), weights_only=True)


def relative(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


TOLERANCE = 1e-4  # norm-wise, per tensor; the losses of the layouts agree to 1e-5. The worst tensor is the
# key part of each QKV bias: its true gradient is 0 (softmax ignores a constant added to every score of a
# query), so it learns from rounding noise, which Adam scales up to the size of the LR: ~5e-5 apart.


def compare_to_truth(directory, truth_dir) -> float:
    """Worst norm-wise relative difference of a one-process checkpoint from the truth (weights, moments)."""
    got, want = read(directory), read(truth_dir)
    assert set(got["model"]) == set(want["model"])
    worst = max(relative(got["model"][n], want["model"][n]) for n in want["model"])
    for name, entry in want["optimizer"]["params"].items():
        assert got["optimizer"]["params"][name]["range"] == entry["range"]
        for kind in ("exp_avg", "exp_avg_sq"):
            worst = max(worst, relative(got["optimizer"]["params"][name][kind], entry[kind]))
    for key in ("iteration", "opt_param_scheduler", "consumed_train_samples", "consumed_valid_samples",
                "data_stream"):
        assert got[key] == want[key], key
    assert got["optimizer"]["step"] == want["optimizer"]["step"] == 4
    return worst


def later_than(scalars, iteration, tags=("lm loss", "sop loss", "lm acc", "sop acc", "grad-norm")):
    return {tag: [(s, v) for s, v in scalars[tag] if s > iteration] for tag in tags}


def resume(data, factory, name, nproc, directory, *flags):
    """Iterations 5-8 from `directory`: (the launch, its scalars)."""
    result, scalars = launch.layout_run(data, factory, name, nproc, *flags, "--load", directory)
    assert f"loaded checkpoint {directory} at iteration 4" in result.stdout
    return result, scalars


def test_tp2_pp2_to_one_process_and_back_resumes_the_unbroken_run(tiny_data, tmp_path_factory, truth,
                                                                   layout_reference):
    source = saved_run(tiny_data, tmp_path_factory, "tp2-pp2")
    one = tmp_path_factory.mktemp("one") / "ckpt"
    command = [sys.executable, "-m", "minibert.tools.reshard", "convert", "--load", source, "--save", one,
               "--target-tensor-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=launch.env(),
                            cwd=launch.ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote 2 files under {one}, the tracker last: TP 1 x PP 1")
    assert "tensor-parallel dropout generators cannot be carried from TP 2 to TP 1" in result.stderr
    assert sorted(os.listdir(one)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(one / "iter_0000004")) == ["manifest.json", "mp_rank_00"]
    state = read(one)
    assert state["args"]["tensor_model_parallel_size"] == 1 and state["args"]["pipeline_model_parallel_size"] == 1
    assert state["sharding"] == {} and not state["args"]["sequence_parallel"]
    worst = compare_to_truth(one, truth)
    print(f"TP 2 x PP 2 -> TP 1: worst relative difference of weights and moments from the one-process run {worst:.2e}")
    assert worst <= TOLERANCE

    reference = layout_reference["scalars"]
    _, scalars = resume(tiny_data, tmp_path_factory, "reshard-resume-one", 1, one)
    worst = launch.assert_close_runs(later_than(reference, 4), later_than(scalars, 4))
    print(f"resumed at TP 1: iterations 5-8 within {worst:.2e} of the unbroken run")

    back = tmp_path_factory.mktemp("back") / "ckpt"
    reshard.convert(str(one), str(back), 2, 2, warn=lambda m: None)
    for t in range(2):
        for p in range(2):  # a round trip through TP 1 gives back the source's tensors, bit for bit
            a, b = read(source, t, p, 2), read(back, t, p, 2)
            assert a["model"].keys() == b["model"].keys() and a["sharding"] == b["sharding"]
            assert all(torch.equal(a["model"][n], b["model"][n]) for n in a["model"])
            for name, entry in a["optimizer"]["params"].items():
                assert all(torch.equal(entry[k], b["optimizer"]["params"][name][k]) for k in ("exp_avg", "exp_avg_sq"))
    flags = SOURCES["tp2-pp2"][1]
    _, scalars = resume(tiny_data, tmp_path_factory, "reshard-resume-back", 4, back, *flags)
    worst = launch.assert_close_runs(later_than(reference, 4), later_than(scalars, 4))
    print(f"converted back and resumed at TP 2 x PP 2: iterations 5-8 within {worst:.2e} of the unbroken run")


@pytest.mark.parametrize("name", ["zero-dp2", "interleaved"])
def test_zero1_and_interleaved_sources_gather_to_the_one_process_state(tiny_data, tmp_path_factory, truth, name):
    source = saved_run(tiny_data, tmp_path_factory, name)
    files = sorted(os.listdir(source / "iter_0000004" / ("mp_rank_00" if name == "zero-dp2" else "mp_rank_00_000")))
    if name == "zero-dp2":  # the optimizer state is in two shards, each parameter's pieces cut by range
        assert files == ["distrib_optim_dp000.pt", "distrib_optim_dp001.pt", "model_optim_rng.pt"]
    one = tmp_path_factory.mktemp(name + "-one") / "ckpt"
    reshard.convert(str(source), str(one), 1, 1)
    worst = compare_to_truth(one, truth)
    print(f"{name} -> TP 1: worst relative difference from the one-process run {worst:.2e}")
    assert worst <= TOLERANCE
    if name == "interleaved":  # the other way: the truth cut into the interleaved layout holds the trainer's names
        cut = tmp_path_factory.mktemp("cut") / "ckpt"
        reshard.convert(str(truth), str(cut), 1, 2, target_num_layers_per_virtual_pipeline_stage=1)
        for p, layers in ((0, {"0", "2"}), (1, {"1", "3"})):
            mine, trainer = read(cut, 0, p, 2), read(source, 0, p, 2)
            assert mine["model"].keys() == trainer["model"].keys()
            assert {n.split(".")[1] for n in mine["model"] if n.startswith("layers.")} == layers
            assert mine["optimizer"]["params"].keys() == trainer["optimizer"]["params"].keys()
            assert mine["args"]["num_layers_per_virtual_pipeline_stage"] == 1
        assert torch.equal(read(cut, 0, 0, 2)["model"][WORD], read(cut, 0, 1, 2)["model"][WORD])  # the tied copy
        uneven = tmp_path_factory.mktemp("uneven") / "ckpt"
        reshard.convert(str(truth), str(uneven), 1, 2, target_decoder_first_pipeline_num_layers=1)
        for p, layers in ((0, {"0"}), (1, {"1", "2", "3"})):
            assert {n.split(".")[1] for n in read(uneven, 0, p, 2)["model"] if n.startswith("layers.")} == layers


def eight_head_checkpoint(directory):
    """One optimizer step of a 2-layer, 8-head bf16 model (so with fp32 masters) on the test vocab, saved at
    TP 1 in this process: a model TP 8 can split (the layout configuration has 4 heads)."""
    cfg = Config(num_layers=2, hidden_size=32, num_attention_heads=8, seq_length=8, vocab_size=VOCAB,
                 micro_batch_size=2, global_batch_size=2, train_iters=10, lr=1e-2, lr_decay_iters=10,
                 attention_backend="local", bf16=True)
    model = BertModel(cfg).to(torch.bfloat16)
    optimizer = build_optimizer(build_grad_buffers(model, cfg), cfg)
    scheduler = build_scheduler(optimizer, cfg)
    optimizer.zero_grad()
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens).lm_logits.logsumexp(-1).mean().backward()
    finalize_model_grads(optimizer.grads, ParallelState())
    assert optimizer.step().update_successful
    rng = {**checkpoint.get_rng_state(), "tensor_parallel": {"cpu": torch.get_rng_state(), "cuda": None}}
    state = checkpoint.training_state(cfg, 1, model, optimizer, scheduler, 2, 0, rng_state=rng)
    checkpoint.save_checkpoint(str(directory), 1, state)
    return state


def vocab_rows(state, kind):
    """The full vocab-sized tensors of one file's dict: weight or moment, as [rows, ...]."""
    shape = {n: state["model"][n].shape for n in (WORD, "lm_head.bias")}
    if kind == "model":
        return {n: state["model"][n] for n in shape}
    return {n: state["optimizer"]["params"][n][kind].view(shape[n]) for n in shape}


def test_vocab_is_repadded_for_the_target(tiny_data, tmp_path_factory, truth, tmp_path):
    # Megatron's rule: a multiple of 128 x TP. 1505 tokens fit 3 x 512 = 1536 rows at TP 4 too; TP 8 needs 2048
    assert [Config(vocab_size=VOCAB, tensor_model_parallel_size=t).padded_vocab_size for t in (1, 2, 4, 8)] == \
        [1536, 1536, 1536, 2048]
    original = eight_head_checkpoint(tmp_path / "tp1")
    reshard.convert(str(tmp_path / "tp1"), str(tmp_path / "tp8"), 8, 1, warn=lambda m: None)
    shards = [read(tmp_path / "tp8", t, iteration=1) for t in range(8)]
    assert all(s["sharding"][WORD] == s["sharding"]["lm_head.bias"] == [0, 8] for s in shards)
    for kind in ("model", "exp_avg", "exp_avg_sq", "master"):
        want = vocab_rows(original, kind)
        for name, rows in want.items():
            assert rows.shape[0] == 1536 and rows[VOCAB:].abs().sum() == 0 and rows[:VOCAB].abs().sum() > 0
            got = torch.cat([vocab_rows(s, kind)[name] for s in shards])  # 8 blocks of 256 rows
            assert got.shape[0] == 2048 and torch.equal(got[:VOCAB], rows[:VOCAB]) and not got[VOCAB:].any()
    reshard.convert(str(tmp_path / "tp8"), str(tmp_path / "back"), 1, 1, warn=lambda m: None)
    back = read(tmp_path / "back", iteration=1)  # and back to 1536 rows: the original, bit for bit
    assert all(torch.equal(back["model"][n], original["model"][n]) for n in original["model"])
    for name, entry in original["optimizer"]["params"].items():
        assert set(entry) == {"range", "exp_avg", "exp_avg_sq", "master"}
        assert all(torch.equal(back["optimizer"]["params"][name][k], entry[k]) for k in entry if k != "range")
    model, cfg = reshard.load_model(str(tmp_path / "tp8"))  # load_model gathers the 8 shards
    assert cfg.tensor_model_parallel_size == 1 and model.embedding.word_embeddings.weight.shape[0] == 1536
    assert all(torch.equal(model.state_dict()[n], original["model"][n].float()) for n in original["model"])

    tp4 = tmp_path_factory.mktemp("tp4") / "ckpt"  # the layout run's checkpoint at TP 4: 4 x 384 rows
    reshard.convert(str(truth), str(tp4), 4, 1, warn=lambda m: None)
    shards = [read(tp4, t) for t in range(4)]
    assert shards[0]["model"][WORD].shape == (384, 32) and shards[3]["model"]["lm_head.bias"].shape == (384,)
    assert shards[1]["sharding"]["layers.0.self_attention.dense.weight"] == [1, 4]  # row-parallel: columns
    assert shards[1]["sharding"]["layers.0.mlp.dense_h_to_4h.bias"] == [0, 4]       # column-parallel
    assert "layers.0.self_attention.dense.bias" not in shards[1]["sharding"]        # replicated
    model, _ = reshard.load_model(str(tp4))
    unsharded, _ = reshard.load_model(str(truth))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), unsharded.state_dict().values()))


def test_load_model_and_to_hf_read_a_sharded_directory(tiny_data, tmp_path_factory, truth, tmp_path):
    source = saved_run(tiny_data, tmp_path_factory, "tp2-pp2")
    model, cfg = reshard.load_model(str(source))
    unsharded, _ = reshard.load_model(str(truth))
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (1, 1)
    state, want = model.state_dict(), unsharded.state_dict()
    assert state.keys() == want.keys()
    worst = max(relative(state[n], want[n]) for n in want)
    print(f"load_model of TP 2 x PP 2 vs the one-process model: worst relative difference {worst:.2e}")
    assert worst <= TOLERANCE
    convert.main(["to-hf", "--load", str(source), "--output", str(tmp_path / "hf")])
    back = convert.from_hf(str(tmp_path / "hf"))
    assert all(torch.equal(back.state_dict()[n], state[n]) for n in state)


DAMAGE = {  # case -> (the checkpoint it damages, the file or folder it removes or overwrites)
    "corrupt": ("truth", "mp_rank_00/model_optim_rng.pt"),
    "missing-rank": ("tp2-pp2", "mp_rank_01_001"),
    "missing-shard": ("zero-dp2", "mp_rank_00/distrib_optim_dp001.pt"),
}


def damaged(directory, tmp_path, what):
    copy = tmp_path / "damaged"
    shutil.copytree(directory, copy)
    target = copy / "iter_0000004" / DAMAGE[what][1]
    if what == "corrupt":
        target.write_bytes(b"not a checkpoint")
    elif target.is_dir():
        shutil.rmtree(target)
    else:
        os.remove(target)
    return copy


@pytest.mark.parametrize("case,target,message", [
    ("no-checkpoint", (1, 1), "holds no checkpoint"),
    ("corrupt", (1, 1), "is corrupt or not a minibert checkpoint"),
    ("missing-rank", (1, 1), "was saved at TP 2 x PP 2 (4 files) but 1 are missing"),
    ("missing-shard", (1, 1), "has 1 distrib_optim_dp*.pt files but the run had data-parallel size 2"),
    ("heads", (3, 1), "--num-attention-heads 4 must be divisible by --target-tensor-parallel-size 3"),
    ("layers", (1, 3), "4 layers cannot be split evenly over 3 pipeline stages"),
    ("not-empty", (1, 1), "exists and is not empty"),
])
def test_bad_inputs_exit_2_with_one_line(tiny_data, tmp_path_factory, truth, tmp_path, capsys, case, target, message):
    load = truth
    if case == "no-checkpoint":
        load = tmp_path
    elif case in DAMAGE:
        source = DAMAGE[case][0]
        load = damaged(truth if source == "truth" else saved_run(tiny_data, tmp_path_factory, source), tmp_path, case)
    save = truth if case == "not-empty" else tmp_path / "new"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        reshard.main(["convert", "--load", str(load), "--save", str(save), "--target-tensor-parallel-size",
                      str(target[0]), "--target-pipeline-model-parallel-size", str(target[1])])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: "), errors
    assert message in errors[0], errors[0]
    assert not os.path.exists(tmp_path / "new")  # nothing written
