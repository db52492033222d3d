"""BERT, as Megatron-LM trains it (pre-LN, the default) or as the original paper / HuggingFace (post-LN).

    tokens, types [b, s]
        |  word + position + token-type embeddings  (post-LN: then a LayerNorm), dropout
        v
    x [b, s, h] --> L x TransformerLayer --> (pre-LN: final LayerNorm) --> hidden [b, s, h]
                                                           |                      |
                        LM head: dense, GeLU, LayerNorm,   |         pooler: tanh(dense(hidden[:, 0]))
                        @ word_embeddings^T + bias         |         binary head: dense h -> 2 (SOP)
                                 v                                                v
                       lm_logits [b, s, vocab]                          binary_logits [b, 2]

One transformer layer, the two placements of LayerNorm (drop = dropout(hidden_dropout)):

    pre-LN  (Megatron):  x = x + drop(attn(LN1(x)));   x = x + drop(mlp(LN2(x)))
    post-LN (BERT / HF): x = LN1(x + drop(attn(x)));   x = LN2(x + drop(mlp(x)))

Pre-LN keeps an un-normalised residual stream, which trains stably at depth; it therefore needs a final
LayerNorm and no LayerNorm on the embeddings. Post-LN normalises after every residual add, the
embeddings included.

This file has no parallel code: tensor and pipeline parallelism are applied from outside (minibert.parallel)
by swapping the Linear/Embedding modules named here. Tensors are [b, s, h] (Megatron uses [s, b, h])."""
import math
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from minibert.attention import attention, resolve_backend

BertOutput = namedtuple("BertOutput", ["lm_logits", "binary_logits", "hidden"])
NUM_TOKEN_TYPES = 2  # sentence A / sentence B


class Embedding(nn.Module):
    """tokens, types [b, s] -> [b, s, h] = word[tokens] + position[0..s) + tokentype[types].

    The word table has config.padded_vocab_size rows (Megatron pads the vocab so it splits evenly over
    tensor-parallel ranks); rows past vocab_size are never looked up, and the LM head drops their logits."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_positions, h)
        self.tokentype_embeddings = nn.Embedding(NUM_TOKEN_TYPES, h)
        # post-LN (HF) normalises the embeddings; Megatron's pre-LN leaves that to the first layer's LN1
        self.layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon) if config.post_ln else None
        self.dropout = config.hidden_dropout

    def forward(self, tokens, types=None):
        b, s = tokens.shape
        if s > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {s} > max_positions {self.position_embeddings.num_embeddings}")
        if types is None:
            types = torch.zeros_like(tokens)  # everything is sentence A
        positions = torch.arange(s, device=tokens.device)  # [s], broadcast over the batch
        x = self.word_embeddings(tokens) + self.position_embeddings(positions) + self.tokentype_embeddings(types)
        if self.layernorm is not None:
            x = self.layernorm(x)
        return F.dropout(x, self.dropout, self.training)  # [b, s, h]


class SelfAttention(nn.Module):
    """[b, s, h] -> [b, s, h]: one fused QKV projection, attention per head, an output projection.

    The fused weight is laid out as Megatron does, with the output dim ordered [heads, 3, head_dim]:

        query_key_value.weight rows:  | q0 k0 v0 | q1 k1 v1 | ... | q(n-1) k(n-1) v(n-1) |   (each d rows)

    so any contiguous block of rows holds whole heads with their q, k and v together. Tensor parallelism
    can then split this Linear by plain column blocks (rank r gets heads [r*n/p, (r+1)*n/p)) and every rank
    runs attention on its own heads without communicating. (HF keeps separate query/key/value matrices;
    minibert.convert interleaves them.)"""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_attention_heads
        self.head_dim = h // self.heads
        self.query_key_value = nn.Linear(h, 3 * h)  # column-parallel under TP
        self.dense = nn.Linear(h, h)  # row-parallel under TP; an "output projection" for the init
        self.dropout = config.attention_dropout

    def forward(self, x, padding_mask, backend):
        b, s, h = x.shape
        qkv = self.query_key_value(x)  # [b, s, 3h]
        qkv = qkv.view(b, s, self.heads, 3, self.head_dim)  # [b, s, heads, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x [b, heads, s, d]
        dropout_p = self.dropout if self.training else 0.0
        out = attention(q, k, v, padding_mask, backend=backend, dropout_p=dropout_p)  # [b, heads, s, d]
        out = out.transpose(1, 2).reshape(b, s, h)  # [b, s, heads, d] -> [b, s, h]
        return self.dense(out)


class MLP(nn.Module):
    """[b, s, h] -> [b, s, h]: dense h -> ffn, GeLU (the exact erf form), dense ffn -> h."""

    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_size)  # column-parallel under TP
        self.dense_4h_to_h = nn.Linear(config.ffn_size, config.hidden_size)  # row-parallel; output projection

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    """One layer; `attention_layernorm` / `mlp_layernorm` are LN1 / LN2 of the module docstring (Megatron:
    input_layernorm / post_attention_layernorm; HF post-LN: attention.output.LayerNorm / output.LayerNorm)."""

    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.post_ln = config.post_ln
        self.attention_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = SelfAttention(config)
        self.mlp_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(config)
        self.dropout = config.hidden_dropout

    def forward(self, x, padding_mask, backend):  # x [b, s, h] -> [b, s, h]
        def drop(y):
            return F.dropout(y, self.dropout, self.training)
        if self.post_ln:
            x = self.attention_layernorm(x + drop(self.self_attention(x, padding_mask, backend)))
            return self.mlp_layernorm(x + drop(self.mlp(x)))
        x = x + drop(self.self_attention(self.attention_layernorm(x), padding_mask, backend))
        return x + drop(self.mlp(self.mlp_layernorm(x)))


class LMHead(nn.Module):
    """hidden [..., h] -> logits [..., vocab_size]: dense, GeLU, LayerNorm, then the *tied* decoder
    x @ word_embeddings^T + bias (no weight of its own: input and output share one table).

    The table has padded_vocab_size rows (Megatron pads the vocab so it splits evenly over tensor-parallel
    ranks) but the decoder multiplies only its first vocab_size rows, so the softmax/CE only ever covers
    the real vocab: the padding can never change the loss, whatever its rows hold, and every TP layout
    gives the same model. Slicing the *weight* [vocab, h], not the *logits* [tokens, vocab], keeps the
    logits contiguous; slicing them would copy the model's largest activation and, in the backward,
    zero-fill a tensor of its padded size."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.vocab_size = config.vocab_size
        self.dense = nn.Linear(h, h)
        self.layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))

    def forward(self, hidden, word_embeddings):
        x = self.layernorm(F.gelu(self.dense(hidden)))  # [..., h]
        v = self.vocab_size  # the real vocab: rows past it are padding
        return F.linear(x, word_embeddings[:v], self.bias[:v])  # [..., h] @ [h, vocab] -> [..., vocab_size]


class BertModel(nn.Module):
    """BERT for pretraining: masked-LM head (tied) and, unless config.binary_head is False, the pooler and
    the sentence-order (SOP) binary head. See the module docstring for the picture."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(TransformerLayer(config) for _ in range(config.num_layers))
        self.final_layernorm = None if config.post_ln else nn.LayerNorm(h, eps=eps)
        self.lm_head = LMHead(config)
        self.pooler = nn.Linear(h, h) if config.binary_head else None
        self.binary_head = nn.Linear(h, 2) if config.binary_head else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """Megatron's init: weights N(0, std), the two output projections of each layer (the ones adding
        into the residual stream) N(0, std / sqrt(2L)) so the stream's variance does not grow with depth;
        biases 0; LayerNorm weight 1, bias 0. Deterministic under torch.manual_seed (fixed module order)."""
        std = self.config.init_method_std
        output_std = std / math.sqrt(2.0 * self.config.num_layers)
        outputs = {id(m) for layer in self.layers for m in (layer.self_attention.dense, layer.mlp.dense_4h_to_h)}
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, output_std if id(module) in outputs else std)
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                module.bias.zero_()
        self.lm_head.bias.zero_()

    def attention_backend(self, device) -> str:
        """config.attention_backend resolved for this device and compute dtype (autocast's if it is on)."""
        dtype = self.embedding.word_embeddings.weight.dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return resolve_backend(self.config.attention_backend, device, dtype,
                               self.config.hidden_size // self.config.num_attention_heads)

    def forward(self, tokens, types=None, padding_mask=None, lm_mask=None):
        """tokens, types int64 [b, s]; padding_mask bool [b, s] (True = padding); lm_mask bool [b, s]: with
        config.sparse_mlm, only these positions go through the LM head (lm_logits [n, vocab], row-major)."""
        backend = self.attention_backend(tokens.device)  # once per forward, shared by every layer
        x = self.embedding(tokens, types)  # [b, s, h]
        for layer in self.layers:
            x = layer(x, padding_mask, backend)  # [b, s, h]
        hidden = x if self.final_layernorm is None else self.final_layernorm(x)

        binary_logits = None
        if self.binary_head is not None:
            pooled = torch.tanh(self.pooler(hidden[:, 0]))  # [b, h]: the [CLS] position
            binary_logits = self.binary_head(pooled)  # [b, 2]
        if self.config.sparse_mlm and lm_mask is not None:
            lm_input = hidden[lm_mask]  # [b, s, h] -> [n, h], only the masked positions
        else:
            lm_input = hidden  # [b, s, h]
        lm_logits = self.lm_head(lm_input, self.embedding.word_embeddings.weight)
        return BertOutput(lm_logits, binary_logits, hidden)


def pretraining_loss(output, labels, loss_mask, is_random, sparse=False):
    """-> (loss, lm_loss, sop_loss or None), all fp32 scalars whatever dtype the model ran in.

    lm_loss  = sum_i ce_i * loss_mask_i / max(sum_i loss_mask_i, 1)   (0, not NaN, when nothing is masked)
    sop_loss = mean_b CE(binary_logits_b, is_random_b)
    labels [b, s] (-1 where not selected), loss_mask [b, s], is_random [b]. With sparse=True the model was
    called with lm_mask = (loss_mask != 0), so lm_logits holds those positions' rows in row-major order."""
    logits = output.lm_logits.float()  # fp32 log-softmax: bf16/fp16 logits lose too much precision here
    loss_mask = loss_mask.float()
    if sparse:
        selected = loss_mask != 0  # [b, s]
        labels, loss_mask = labels[selected], loss_mask[selected]  # [n]
        if logits.shape[0] != labels.shape[0]:
            raise ValueError(f"sparse loss: {logits.shape[0]} LM rows for {labels.shape[0]} masked positions;"
                             " call the model with lm_mask=(loss_mask != 0)")
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),  # [b*s, vocab] -> [b*s]
                         ignore_index=-1, reduction="none")
    lm_loss = (ce * loss_mask.reshape(-1)).sum() / loss_mask.sum().clamp(min=1.0)
    if output.binary_logits is None:
        return lm_loss, lm_loss, None
    sop_loss = F.cross_entropy(output.binary_logits.float(), is_random.reshape(-1).long())
    return lm_loss + sop_loss, lm_loss, sop_loss
