"""BertModel and pretraining_loss on CPU: shapes, the padded vocab, pre-/post-LN structure, Megatron's init,
the loss guards, sparse MLM, padding isolation, determinism. (Numerical parity with HuggingFace's BERT and
MegatronBERT is in test_convert.py; the attention backends against each other in test_attention_backends.py.)"""
import math

import pytest
import torch
import torch.nn.functional as F

from minibert.config import Config
from minibert.fast import residual
from minibert.model.bert import BertModel
from minibert.model.loss import pretraining_loss

VOCAB = 100  # padded to 128 by Megatron's rule


def tiny_config(**overrides):
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=VOCAB,
                  hidden_dropout=0.0, attention_dropout=0.0, attention_backend="local")
    fields.update(overrides)
    return Config(**fields)


def tiny_model(seed=0, **overrides):
    return BertModel(tiny_config(seed=seed, **overrides))  # the init is drawn from --seed, per name


def make_batch(b=3, s=16, lengths=(16, 9, 5), seed=0):
    """Random tokens; row i has lengths[i] real tokens, then padding; ~30% of real positions masked."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s), generator=g)
    types = (torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None] // 2).long()  # sentence B: 2nd half
    padding_mask = torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]  # [b, s], True = padding
    loss_mask = (torch.rand(b, s, generator=g) < 0.3) & ~padding_mask
    loss_mask[:, 1] = True  # every row has at least one masked token
    labels = torch.where(loss_mask, torch.randint(0, VOCAB, (b, s), generator=g), -1)
    is_random = torch.randint(0, 2, (b,), generator=g)
    return dict(tokens=tokens, types=types, padding_mask=padding_mask, loss_mask=loss_mask.long(),
                labels=labels, is_random=is_random)


def run(model, batch, sparse=False):
    out = model(batch["tokens"], batch["types"], batch["padding_mask"],
                lm_mask=batch["loss_mask"].bool() if sparse else None)
    return out, pretraining_loss(out, batch["labels"], batch["loss_mask"], batch["is_random"], sparse=sparse)


@pytest.mark.parametrize("post_ln", [False, True])
def test_shapes(post_ln):
    model = tiny_model(post_ln=post_ln)
    out, (loss, lm, sop) = run(model, make_batch())
    assert out.lm_logits.shape == (3, 16, VOCAB)
    assert out.binary_logits.shape == (3, 2)
    assert out.hidden.shape == (3, 16, 32)
    assert loss.shape == lm.shape == sop.shape == ()
    assert torch.allclose(loss, lm + sop)


def test_loss_is_masked_mean_cross_entropy_plus_sop():
    model, batch = tiny_model(), make_batch()
    out, (loss, lm, sop) = run(model, batch)
    selected = batch["loss_mask"].bool()
    expected_lm = F.cross_entropy(out.lm_logits[selected], batch["labels"][selected])  # mean over masked tokens
    expected_sop = F.cross_entropy(out.binary_logits, batch["is_random"])
    torch.testing.assert_close(lm, expected_lm)
    torch.testing.assert_close(sop, expected_sop)


def test_padded_vocab_columns_are_never_returned_and_cannot_change_the_loss():
    model, batch = tiny_model(), make_batch()
    assert model.config.padded_vocab_size == 128
    assert model.embedding.word_embeddings.weight.shape[0] == 128 and model.lm_head.bias.shape[0] == 128
    out, (loss, _, _) = run(model, batch)
    with torch.no_grad():  # make the padded rows as loud as possible: they would dominate any softmax
        model.embedding.word_embeddings.weight[VOCAB:] = 1e4
        model.lm_head.bias[VOCAB:] = 1e4
    out2, (loss2, _, _) = run(model, batch)
    assert out2.lm_logits.shape[-1] == VOCAB
    torch.testing.assert_close(out2.lm_logits, out.lm_logits, rtol=0, atol=0)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)


def _record(module, store, key):
    return module.register_forward_hook(lambda m, args, out: store.update({key + ".in": args[0], key + ".out": out}))


@pytest.mark.parametrize("chained", [False, True], ids=["own-LN1", "chained"])
def test_pre_ln_structure(chained):
    """Megatron: no embedding LayerNorm, LN1 sees the raw residual stream, a final LayerNorm makes `hidden`.
    Chained (--residual-layernorm-fusion, a lever of minibert.fast), the last layer's call returns its output with the
    final LayerNorm of it, and forward hooks still see every layer."""
    model, seen = tiny_model(post_ln=False), {}
    if chained:
        residual.apply(model, tiny_config(residual_layernorm_fusion=True))
    assert model.embedding.layernorm is None and model.final_layernorm is not None
    layer = model.layers[0]
    for key, module in [("emb", model.embedding), ("ln1", layer.input_layernorm),
                        ("attn", layer.self_attention), ("last", model.layers[-1])]:
        _record(module, seen, key)
    out = model(make_batch()["tokens"])
    assert torch.equal(seen["ln1.in"], seen["emb.out"])  # LN before attention, on the stream itself
    assert torch.equal(seen["attn.in"], seen["ln1.out"])
    last = seen["last.out"]
    if chained:
        last, normed = last
        assert torch.equal(out.hidden, normed)
    expected = F.layer_norm(last, (32,), model.final_layernorm.weight, model.final_layernorm.bias,
                            model.config.layernorm_epsilon)
    torch.testing.assert_close(out.hidden, expected)


def test_post_ln_structure():
    """HF/original BERT: embedding LayerNorm, attention reads the stream, LN1 after the residual add,
    no final LayerNorm (`hidden` is the last layer's output)."""
    model, seen = tiny_model(post_ln=True), {}
    assert model.embedding.layernorm is not None and model.final_layernorm is None
    layer = model.layers[0]
    for key, module in [("emb", model.embedding), ("attn", layer.self_attention),
                        ("ln1", layer.input_layernorm), ("last", model.layers[-1])]:
        _record(module, seen, key)
    out = model(make_batch()["tokens"])
    emb = seen["emb.out"]
    torch.testing.assert_close(emb.mean(-1), torch.zeros_like(emb[..., 0]), atol=1e-5, rtol=0)  # normalised
    assert torch.equal(seen["attn.in"], emb)
    torch.testing.assert_close(seen["ln1.in"], emb + seen["attn.out"])  # residual add, then LN1
    assert torch.equal(out.hidden, seen["last.out"])


def test_megatron_init_statistics():
    torch.manual_seed(0)
    config = tiny_config(num_layers=4, hidden_size=128, num_attention_heads=4)
    model = BertModel(config)
    std, output_std = 0.02, 0.02 / math.sqrt(2 * 4)
    for name, p in model.named_parameters():
        if name == "embedding.word_embeddings.weight":  # the real vocab's rows; the padding rows are 0
            p, padding = p[:VOCAB], p[VOCAB:]
            assert torch.all(padding == 0)
        tolerance = 5 / math.sqrt(2 * p.numel())  # 5 sigma of a sample std's relative error
        if name.endswith(("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")):
            assert abs(p.std().item() / output_std - 1) < tolerance, name
        elif "layernorm" in name and name.endswith("weight"):
            assert torch.all(p == 1), name
        elif name.endswith("weight"):  # every other Linear and Embedding
            assert abs(p.std().item() / std - 1) < tolerance, name
            assert abs(p.mean().item()) < 5 * std / math.sqrt(p.numel()), name
        else:  # biases (Linear, LayerNorm, the LM head's)
            assert torch.all(p == 0), name


def test_loss_is_finite_when_nothing_is_masked():
    model, batch = tiny_model(), make_batch()
    batch["loss_mask"].zero_()
    batch["labels"].fill_(-1)
    _, (loss, lm, sop) = run(model, batch)
    assert lm.item() == 0.0 and torch.isfinite(loss)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_loss_math_is_fp32_for_a_bf16_model():
    model = tiny_model().to(torch.bfloat16)
    out, (loss, lm, sop) = run(model, make_batch())
    assert out.lm_logits.dtype == torch.bfloat16
    assert loss.dtype == lm.dtype == sop.dtype == torch.float32
    assert torch.isfinite(loss)


def test_accuracy_counts_the_masked_positions_whose_label_is_the_argmax():
    """pretraining_loss(counts=True) against accuracies counted by hand: a tie for the maximum counts as
    right, unmasked positions never count, and the padded vocab columns (here 2, holding the largest
    logits) never win: the plain loss sees only the real vocab, the vocab-parallel one masks them."""
    from functools import partial

    from minibert.model.bert import BertOutput
    from minibert.model.loss import lm_cross_entropy
    from minibert.parallel.layers import vocab_parallel_cross_entropy
    padded = torch.tensor([[[0.0, 3.0, 1.0, 9.0, 9.0], [2.0, 2.0, 0.0, 9.0, 9.0], [1.0, 0.0, 0.0, 9.0, 9.0]],
                           [[0.0, 1.0, 5.0, 9.0, 9.0], [4.0, 0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 0.0, 9.0, 9.0]]])
    labels = torch.tensor([[1, 1, 2], [0, 0, -1]])     # right, right (a tie), wrong | wrong, right, not masked
    loss_mask = (labels != -1).long()
    binary_logits = torch.tensor([[0.5, 0.5], [1.0, -1.0], [0.0, 2.0]])
    is_random = torch.tensor([1, 1, 1])                 # right (a tie), wrong, right
    losses = {"plain": lm_cross_entropy,
              "vocab-parallel": partial(vocab_parallel_cross_entropy, group=None, vocab_start=0, vocab_size=3)}
    for name, cross_entropy in losses.items():
        logits = padded if name == "vocab-parallel" else padded[..., :3]   # the plain path gets the real vocab
        out = BertOutput(logits, binary_logits, None)
        loss, lm, sop, counts = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=cross_entropy,
                                                 counts=True)
        assert {k: int(v) for k, v in counts.items()} == {"lm correct": 3, "lm masked": 5, "sop correct": 2,
                                                           "sop samples": 3}, name
        assert all(v.dtype == torch.int64 and v.shape == () for v in counts.values())
        plain = pretraining_loss(out, labels, loss_mask, is_random, cross_entropy=cross_entropy)
        assert all(torch.equal(a, b) for a, b in zip(plain, (loss, lm, sop)))  # counting changes no loss
    # in a model: the same counts dense and sparse, and none without the binary head for SOP
    batch = make_batch()
    dense, sparse = tiny_model(), tiny_model(sparse_mlm=True)
    counted = []
    for model, is_sparse in ((dense, False), (sparse, True)):
        out = model(batch["tokens"], batch["types"], batch["padding_mask"],
                    lm_mask=batch["loss_mask"].bool() if is_sparse else None)
        counts = pretraining_loss(out, batch["labels"], batch["loss_mask"], batch["is_random"], sparse=is_sparse,
                                  counts=True)[3]
        selected = batch["loss_mask"].bool()
        logits = out.lm_logits if is_sparse else out.lm_logits[selected]
        assert int(counts["lm correct"]) == int((logits.argmax(-1) == batch["labels"][selected]).sum())
        assert int(counts["lm masked"]) == int(selected.sum())
        counted.append({k: int(v) for k, v in counts.items()})
    assert counted[0] == counted[1]
    model = tiny_model(bert_no_binary_head=True)
    out = model(batch["tokens"], batch["types"], batch["padding_mask"])
    counts = pretraining_loss(out, batch["labels"], batch["loss_mask"], batch["is_random"], counts=True)[3]
    assert set(counts) == {"lm correct", "lm masked"}


def test_sparse_mlm_gives_the_dense_loss_and_gradients():
    batch = make_batch()
    dense, sparse = tiny_model(), tiny_model(sparse_mlm=True)
    out_d, (loss_d, _, _) = run(dense, batch)
    out_s, (loss_s, _, _) = run(sparse, batch, sparse=True)
    n = int(batch["loss_mask"].sum())
    assert out_s.lm_logits.shape == (n, VOCAB)
    torch.testing.assert_close(out_s.lm_logits, out_d.lm_logits[batch["loss_mask"].bool()])
    torch.testing.assert_close(loss_s, loss_d)
    loss_d.backward()
    loss_s.backward()
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


@pytest.mark.parametrize("post_ln", [False, True])
def test_padded_tokens_do_not_change_real_positions(post_ln):
    model, batch = tiny_model(post_ln=post_ln), make_batch()
    out, _ = run(model, batch)
    other = dict(batch, tokens=torch.where(batch["padding_mask"], (batch["tokens"] + 7) % VOCAB, batch["tokens"]))
    assert not torch.equal(other["tokens"], batch["tokens"])
    out2, _ = run(model, other)
    real = ~batch["padding_mask"]
    torch.testing.assert_close(out2.hidden[real], out.hidden[real], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out2.lm_logits[real], out.lm_logits[real], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out2.binary_logits, out.binary_logits, rtol=1e-6, atol=1e-6)
    # and the mask matters: without it the padded tokens do reach the real positions
    leaky = model(other["tokens"], other["types"]).hidden
    assert not torch.allclose(leaky[real], out.hidden[real], atol=1e-4)


def test_binary_head_off():
    model, batch = tiny_model(bert_no_binary_head=True), make_batch()
    assert model.pooler is None and model.binary_head is None
    assert not any(n.startswith(("pooler", "binary_head")) for n, _ in model.named_parameters())
    out, (loss, lm, sop) = run(model, batch)
    assert out.binary_logits is None and sop is None
    assert torch.equal(loss, lm)


def test_a_pipeline_stage_draws_the_weights_of_the_whole_model():
    """Per-name seeded init: a stage holding only layer 1 (no embedding, the heads) has, under the same
    names, exactly the full model's numbers, and its word-table copy equals the first stage's table."""
    full = tiny_model(seed=3, num_layers=3)
    first = BertModel(tiny_config(seed=3, num_layers=3), layer_numbers=[0], post_process=False)
    last = BertModel(tiny_config(seed=3, num_layers=3), layer_numbers=[1, 2], pre_process=False)
    whole = full.state_dict()
    for stage in (first, last):
        for name, value in stage.state_dict().items():
            assert torch.equal(value, whole[name]), name
    assert set(first.state_dict()) | set(last.state_dict()) == set(whole)
    assert torch.equal(last.embedding.word_embeddings.weight, first.embedding.word_embeddings.weight)
    assert "layers.1.mlp.dense_h_to_4h.weight" in last.state_dict() and last.layers[2] is last.layers[-1]


def test_stages_chained_give_the_whole_models_output():
    full = tiny_model(seed=3, num_layers=3)
    first = BertModel(tiny_config(seed=3, num_layers=3), layer_numbers=[0, 1], post_process=False)
    last = BertModel(tiny_config(seed=3, num_layers=3), layer_numbers=[2], pre_process=False)
    batch = make_batch()
    hidden = first(batch["tokens"], batch["types"], batch["padding_mask"])
    out = last(None, padding_mask=batch["padding_mask"], hidden_states=hidden)
    expected = full(batch["tokens"], batch["types"], batch["padding_mask"])
    assert torch.equal(out.lm_logits, expected.lm_logits) and torch.equal(out.binary_logits, expected.binary_logits)


def test_deterministic_for_a_seed():
    a, b, c = tiny_model(seed=5), tiny_model(seed=5), tiny_model(seed=6)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers[0].self_attention.query_key_value.weight,
                           c.layers[0].self_attention.query_key_value.weight)


def test_dropout_only_in_training_and_reproducible_under_a_seed():
    model, batch = tiny_model(hidden_dropout=0.1, attention_dropout=0.1), make_batch()
    model.eval()
    _, (eval_1, _, _) = run(model, batch)
    _, (eval_2, _, _) = run(model, batch)
    assert torch.equal(eval_1, eval_2)
    model.train()
    losses = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        losses.append(run(model, batch)[1][0])
    assert torch.equal(losses[0], losses[1]) and not torch.equal(losses[0], losses[2])
    assert not torch.equal(losses[0], eval_1)
