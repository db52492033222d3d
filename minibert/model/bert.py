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
by swapping the Linear/Embedding modules named here, and every reshape uses this rank's local sizes (-1), so
a layer whose QKV holds only some of the heads runs unchanged. A pipeline stage is a BertModel that owns a
slice of the layers (`layer_numbers`), the embedding only on the first stage (`pre_process`) and the heads
only on the last (`post_process`); forward = embed -> encode -> head, so each stage runs its part.
Tensors are [b, s, h] (Megatron uses [s, b, h]). The init (init_weights.py) draws each parameter from
(config.seed, its name), so every layout builds the numbers of the one-process model."""
import contextlib
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minibert.data.packing import gather_rows, scatter_rows
from minibert.model.attention import attention_qkv, reads_packed_rows, resolve_backend
from minibert.model.config import ModelConfig
from minibert.model.init_weights import init_parameters  # noqa: F401 (BertModel's init; re-exported)
from minibert.model.loss import lm_cross_entropy

BertOutput = namedtuple("BertOutput", ["lm_logits", "binary_logits", "hidden"])
NUM_TOKEN_TYPES = 2  # sentence A / sentence B


class Table(nn.Embedding):
    """nn.Embedding without an init of its own: init_parameters draws every weight, so nn.Embedding's draw
    would be thrown away, and on the meta device (where build.py shapes the model) its first call imports
    torch's compiler: seconds of start-up for every process."""

    def reset_parameters(self):
        pass


class Embedding(nn.Module):
    """tokens, types [b, s] -> [b, s, h] = word[tokens] + position[0..s) + tokentype[types].

    The word table has config.padded_vocab_size rows (Megatron pads the vocab so it splits evenly over
    tensor-parallel ranks); rows past vocab_size are never looked up, and the LM head drops their logits.
    Tensor parallelism swaps word_embeddings for a VocabParallelEmbedding (each rank a block of rows)."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = Table(config.padded_vocab_size, h)
        self.position_embeddings = Table(config.max_positions, h)
        self.tokentype_embeddings = Table(NUM_TOKEN_TYPES, h)
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
    runs attention on its own heads without communicating: the reshapes below take the head count from
    the tensor (-1), never from the config. (HF keeps separate query/key/value matrices; minibert.tools.convert
    interleaves them.)

    `rng_context` wraps the attention (its dropout draws random numbers): a no-op here; tensor parallelism
    sets it to a generator of this rank's own, since each rank drops entries of different heads."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.head_dim = h // config.num_attention_heads
        self.query_key_value = nn.Linear(h, 3 * h)  # column-parallel under TP
        self.dense = nn.Linear(h, h)  # row-parallel under TP; an "output projection" for the init
        self.dropout = config.attention_dropout
        self.rng_context = contextlib.nullcontext
        self.recompute_core = config.recompute == "selective"  # keep q, k, v; redo softmax(qk^T)v in backward

    def forward(self, x, padding_mask, backend, packing=None):
        qkv = self.query_key_value(x)  # [b, s, 3 * local heads * d] (sequence parallel: x had s / TP); packed: [n, ...]
        return self.dense(self.attend(qkv, padding_mask, backend, packing))

    def attend(self, qkv, padding_mask, backend, packing=None):
        """core() under this layer's random generator, recomputed in the backward where selective
        recompute is on."""
        dropout_p = self.dropout if self.training else 0.0
        with self.rng_context():
            if self.recompute_core and torch.is_grad_enabled():
                # checkpoint() stores the RNG state, so the recomputed dropout drops the same entries
                return checkpoint(self.core, qkv, padding_mask, backend, dropout_p, packing, use_reentrant=False)
            return self.core(qkv, padding_mask, backend, dropout_p, packing)

    def core(self, qkv, padding_mask, backend, dropout_p, packing=None):
        """softmax(q k^T / sqrt(d)) v for every head: qkv [b, s, 3hd] -> [b, s, hd], or packed [n, 3hd] -> [n, hd].
        Packed rows go straight to the varlen flash kernel; the other backends want the padded layout, so
        the rows are scattered into it and gathered back (minibert.data.packing)."""
        if packing is not None and reads_packed_rows(backend):
            from minibert.kernels.flash_attention_varlen import flash_attention_varlen
            n = qkv.shape[0]
            qkv = qkv.view(n, -1, 3, self.head_dim)  # [n, heads, 3, d]
            out = flash_attention_varlen(qkv, packing.cu_seqlens, packing.seq, dropout_p=dropout_p)
            return out.view(n, -1)  # [n, heads, d] -> [n, heads * d], no copy
        if packing is not None:
            qkv = scatter_rows(qkv, packing)  # packed [n, 3hd] -> [b, s, 3hd], zeros at padding
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # [b, s, heads, 3, d]: q, k, v of each head side by side
        out = attention_qkv(qkv, padding_mask, backend=backend, dropout_p=dropout_p)  # [b, heads, s, d]
        out = out.transpose(1, 2).reshape(b, s, -1)  # [b, s, heads, d] -> [b, s, heads * d]
        if packing is not None:
            out = gather_rows(out, packing)  # [b, s, hd] -> [n, hd]: the real tokens again
        return out


class MLP(nn.Module):
    """[b, s, h] -> [b, s, h]: dense h -> ffn, GeLU (the exact erf form), dense ffn -> h."""

    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_size)  # column-parallel under TP
        self.dense_4h_to_h = nn.Linear(config.ffn_size, config.hidden_size)  # row-parallel; output projection

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class TransformerLayer(nn.Module):
    """One layer; `input_layernorm` / `pre_mlp_layernorm` are LN1 / LN2 of the module docstring, named as in
    megatron-core's TransformerLayer (Megatron's legacy model: input_layernorm / post_attention_layernorm; HF
    post-LN: attention.output.LayerNorm / output.LayerNorm). Post-LN keeps the names, though there each one
    normalises after its residual add. They were attention_layernorm / mlp_layernorm up to commit 9d2e13f:
    checkpoints of those days load through minibert.training.checkpoint.rename_old_keys."""

    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.post_ln = config.post_ln
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps)
        self.mlp = MLP(config)
        self.dropout = config.hidden_dropout
        self.rng_context = contextlib.nullcontext  # sequence parallelism: each rank's own generator

    def residual(self, x, y):
        """x + dropout(y): the residual add, its dropout drawn under this layer's generator."""
        with self.rng_context():
            return x + F.dropout(y, self.dropout, self.training)

    def forward(self, x, padding_mask, backend, packing=None):
        """x [b, s, h] (packed: [n, h]) -> the same shape."""
        attend = lambda y: self.self_attention(y, padding_mask, backend, packing)  # noqa: E731
        if self.post_ln:
            x = self.input_layernorm(self.residual(x, attend(x)))
            return self.pre_mlp_layernorm(self.residual(x, self.mlp(x)))
        x = self.residual(x, attend(self.input_layernorm(x)))
        return self.residual(x, self.mlp(self.pre_mlp_layernorm(x)))


class TiedDecoder(nn.Module):
    """x [..., h] @ W^T + b -> logits [..., vocab_size], where W is the word-embedding table the caller
    passes in: the decoder has no weight of its own (input and output share one table, "tied").

    The table has padded_vocab_size rows (Megatron pads the vocab to a multiple of 128 so it splits evenly
    over tensor-parallel ranks). The matmul runs over the whole padded table (a multiple of 128 columns is
    what the GPU's matmul kernels are fastest at), on 2-D rows, so the padded logits are its own output
    (the fused loss of chapter 8 hands its gradient to them directly); the padded columns are then cut off
    as a view, so the loss only ever covers the real vocab, whatever the padded rows hold. Tensor
    parallelism swaps this module for a vocab-parallel one (the cross entropy masks the padding)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, x, weight, bias):
        logits = F.linear(x.reshape(-1, x.shape[-1]), weight, bias)  # [rows, h] @ [h, padded vocab]
        return logits.view(*x.shape[:-1], -1)[..., :self.vocab_size]  # the real vocab, a view: then padding


class LMHead(nn.Module):
    """hidden [..., h] -> logits: dense, GeLU, LayerNorm, then the tied decoder (see TiedDecoder)."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.dense = nn.Linear(h, h)
        self.layernorm = nn.LayerNorm(h, eps=config.layernorm_epsilon)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.decoder = TiedDecoder(config.vocab_size)

    def forward(self, hidden, word_embeddings):
        x = self.layernorm(F.gelu(self.dense(hidden)))  # [..., h]
        return self.decoder(x, word_embeddings, self.bias)


class WordEmbeddingCopy(nn.Module):
    """The last pipeline stage's copy of the word table, for the tied LM head when the embedding lives on
    the first stage. Same name as the original (embedding.word_embeddings), same init; the pipeline sums
    the two copies' gradients every step, so they stay equal."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = Table(config.padded_vocab_size, config.hidden_size)


class Layers(nn.ModuleDict):
    """The transformer layers a model holds, keyed by their global index (a pipeline stage holds a slice,
    e.g. layers 6..11), so parameter names are the full model's: layers.7.mlp.dense_h_to_4h.weight.
    model.layers[7] is layer 7; a negative index counts from this model's last layer."""

    def __getitem__(self, index):
        if isinstance(index, int) and index < 0:
            return list(self.values())[index]
        return super().__getitem__(str(index))


def run_layers(layers, x, padding_mask, backend, packing=None):
    for layer in layers:
        x = layer(x, padding_mask, backend, packing)  # [b, s, h] or packed [n, h]
    return x


def recompute_groups(layers, config) -> list:
    """[(the layers of a group, recomputed?)] in order. Full recompute (config.recompute "full") keeps only
    each group's input and reruns its forward in the backward: uniform = groups of recompute_num_layers
    layers, all recomputed; block = the first recompute_num_layers layers one by one, the rest stored."""
    if config.recompute != "full":
        return [(layers, False)]
    k = config.recompute_num_layers or 1
    if config.recompute_method == "uniform":
        return [(layers[i:i + k], True) for i in range(0, len(layers), k)]
    return [([layer], True) for layer in layers[:k]] + ([(layers[k:], False)] if layers[k:] else [])


class BertModel(nn.Module):
    """BERT for pretraining: masked-LM head (tied) and, unless config.binary_head is False, the pooler and
    the sentence-order (SOP) binary head. See the module docstring for the picture.

    BertModel(config) is the whole model (config: a ModelConfig, or the run's Config, whose model fields it
    reads: ModelConfig.of). A pipeline stage passes the layers it owns (global indices:
    parameters keep their full-model names, e.g. layers.7.mlp...), pre_process (it has the embedding) and
    post_process (it has the final LayerNorm and the heads). init=False leaves the parameters
    uninitialised (e.g. built on the meta device, to be sharded before init_parameters)."""

    def __init__(self, config, layer_numbers=None, pre_process=True, post_process=True, init=True):
        super().__init__()
        self.config = config = ModelConfig.of(config)
        self.pre_process, self.post_process = pre_process, post_process
        h, eps = config.hidden_size, config.layernorm_epsilon
        layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        if pre_process:
            self.embedding = Embedding(config)
        elif post_process:
            self.embedding = WordEmbeddingCopy(config)
        self.layers = Layers({str(i): TransformerLayer(config) for i in layer_numbers})
        if post_process:
            self.final_layernorm = None if config.post_ln else nn.LayerNorm(h, eps=eps)
            self.lm_head = LMHead(config)
            self.pooler = nn.Linear(h, h) if config.binary_head else None
            self.binary_head = nn.Linear(h, 2) if config.binary_head else None
        self.lm_cross_entropy = lm_cross_entropy  # swappable (vocab-parallel under TP)
        # Where the layers' region starts and ends: identities here; sequence parallelism scatters the
        # sequence over the tensor-parallel ranks on the way in and gathers it on the way out.
        self.to_layers, self.from_layers = nn.Identity(), nn.Identity()
        if init:
            init_parameters(self, config.seed)

    def attention_backend(self, device) -> str:
        """config.attention_backend resolved for this device and compute dtype (autocast's if it is on)."""
        dtype = next(self.parameters()).dtype
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        return resolve_backend(self.config.attention_backend, device, dtype,
                               self.config.hidden_size // self.config.num_attention_heads)

    def embed(self, tokens, types=None, packing=None):
        """First stage: tokens, types [b, s] -> x [b, s, h] (sequence parallel: [b, s / TP, h]; packed:
        the real tokens' rows [n, h], minibert.data.packing)."""
        x = self.embedding(tokens, types)
        return self.to_layers(x if packing is None else gather_rows(x, packing))

    def encode(self, x, padding_mask=None, packing=None):
        """This model's layers (and, on the last stage of pre-LN, the final LayerNorm): [b, s, h] -> [b, s, h],
        each group of layers recomputed in the backward where full recompute says so (recompute_groups)."""
        backend = self.attention_backend(x.device)  # once per forward, shared by every layer
        for layers, recomputed in recompute_groups(list(self.layers.values()), self.config):
            if recomputed and torch.is_grad_enabled():
                x = checkpoint(run_layers, layers, x, padding_mask, backend, packing, use_reentrant=False)
            else:
                x = run_layers(layers, x, padding_mask, backend, packing)
        if self.post_process:
            if self.final_layernorm is not None:
                x = self.final_layernorm(x)
            x = self.from_layers(x)
        return x

    def head(self, hidden, lm_mask=None, packing=None, lm_rows=None) -> BertOutput:
        """Last stage: hidden [b, s, h] (packed: [n, h]) -> BertOutput (lm logits, SOP logits, hidden).
        lm_rows: the rows of the flattened hidden states the LM head computes (the masked positions with
        --sparse-mlm, as indices computed on the CPU); lm_mask: the same as a bool [b, s] mask."""
        binary_logits = None
        if self.binary_head is not None:
            cls = hidden[:, 0] if packing is None else hidden.index_select(0, packing.cls_rows)
            binary_logits = self.binary_head(torch.tanh(self.pooler(cls)))  # [b, h] -> [b, 2]
        if lm_rows is not None:
            lm_input = hidden.reshape(-1, hidden.shape[-1]).index_select(0, lm_rows)  # [rows, h]
        elif self.config.sparse_mlm and lm_mask is not None:
            lm_input = hidden[lm_mask]  # [b, s, h] -> [n, h], only the masked positions
        else:
            lm_input = hidden  # [b, s, h] or packed [n, h]
        lm_logits = self.lm_head(lm_input, self.embedding.word_embeddings.weight)
        return BertOutput(lm_logits, binary_logits, hidden)

    def forward(self, tokens, types=None, padding_mask=None, lm_mask=None, hidden_states=None, packing=None,
                lm_rows=None):
        """tokens, types int64 [b, s]; padding_mask bool [b, s] (True = padding); lm_mask bool [b, s]: with
        config.sparse_mlm, only these positions go through the LM head (lm_logits [n, vocab], row-major).
        packing (minibert.data.packing): run the real tokens packed; lm_logits then has one row per real token
        (or per lm_rows entry), hidden is [n, h]. A stage without the embedding takes the previous stage's
        output as hidden_states; a stage without the heads returns its hidden states instead of a BertOutput."""
        x = self.embed(tokens, types, packing) if self.pre_process else hidden_states
        x = self.encode(x, padding_mask, packing)
        return self.head(x, lm_mask, packing, lm_rows) if self.post_process else x
