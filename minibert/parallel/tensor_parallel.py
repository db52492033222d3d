"""Tensor parallelism applied to a BertModel, from outside: one table names the modules that are split.

    module                                      becomes                      split along
    embedding.word_embeddings                   VocabParallelEmbedding       vocab rows
    layers.*.self_attention.query_key_value     ColumnParallelLinear         output = heads (rows [heads, 3, d])
    layers.*.self_attention.dense               RowParallelLinear            input = heads
    layers.*.mlp.dense_h_to_4h                  ColumnParallelLinear         FFN width
    layers.*.mlp.dense_4h_to_h                  RowParallelLinear            FFN width
    lm_head.decoder (+ lm_head.bias)            VocabParallelDecoder         vocab rows (tied to the table)
    everything else (LayerNorms, position and token-type tables, the LM head's dense, pooler, SOP head)
                                                replicated: every rank holds it whole

Every rank of a tensor-parallel group runs the model on the same micro-batch. Attention needs no
communication (each rank has whole heads); per layer the forward makes two all-reduces (after attention's
output projection, after the MLP) and the backward two (at the layers' inputs); the embedding and the LM
head one each; the cross entropy two small ones over [tokens] numbers (a MAX, then one SUM of two stacked).

The model is built on the meta device (shapes, no memory), this function swaps the modules, and only then
are this rank's shards allocated and initialised (init_parameters draws each full tensor from its name's
seed and keeps the block): no rank ever holds the whole model. At TP = 1 no module is swapped.

Sequence parallelism: `to_layers` / `from_layers` scatter and gather the sequence, every LayerNorm inside
works on s/p positions (its gradients are then summed over the group: finalize_model_grads), and the
column-parallel layers gather, the row-parallel ones reduce-scatter."""
import fnmatch
import functools

import torch.nn as nn

from minibert.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelDecoder,
    VocabParallelEmbedding,
    mark_sharded,
    vocab_parallel_cross_entropy,
)
from minibert.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

PLAN = {
    "embedding.word_embeddings": "vocab",
    "layers.*.self_attention.query_key_value": "column",
    "layers.*.self_attention.dense": "row",
    "layers.*.mlp.dense_h_to_4h": "column",
    "layers.*.mlp.dense_4h_to_h": "row",
    "lm_head.decoder": "decoder",
}


class SequenceScatter(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return scatter_to_sequence_parallel_region(x, self.group)


class SequenceGather(nn.Module):
    """Before the heads, which every rank computes whole: the backward keeps this rank's slice."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return gather_from_sequence_parallel_region(x, self.group, grad_is_partial=False)


def parallel_module(kind, old, group, sequence_parallel):
    if kind == "decoder":
        return VocabParallelDecoder(group)
    w = old.weight
    like = dict(device=w.device, dtype=w.dtype)
    if kind == "vocab":
        return VocabParallelEmbedding(w.shape[0], w.shape[1], group, **like)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    return cls(old.in_features, old.out_features, group, bias=old.bias is not None,
               sequence_parallel=sequence_parallel, **like)


def apply_tensor_parallel(model, state, rng, sequence_parallel=False):
    """Swap model's modules per PLAN for this rank's shards (TP > 1), and route the dropout inside the
    tensor-parallel region through `rng` (always: one code path). Returns the model."""
    group = state.group("tensor")
    for layer in model.layers.values():
        layer.self_attention.rng_context = rng.fork  # attention dropout: this rank's heads
        if sequence_parallel:
            layer.rng_context = rng.fork  # hidden dropout on this rank's positions
    if group is None:
        return model
    for name, module in list(model.named_modules()):
        kind = next((k for pattern, k in PLAN.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if kind is not None:
            model.set_submodule(name, parallel_module(kind, module, group, sequence_parallel))
    if getattr(model, "lm_head", None) is not None:
        old = model.lm_head.bias
        model.lm_head.bias = nn.Parameter(old.new_empty(old.shape[0] // state.tp))
        mark_sharded(model.lm_head.bias, 0, group, old.shape)
        table = model.embedding.word_embeddings
        model.lm_cross_entropy = functools.partial(vocab_parallel_cross_entropy, group=group,
                                                   vocab_start=table.vocab_start, vocab_size=model.config.vocab_size)
    if sequence_parallel:
        model.to_layers, model.from_layers = SequenceScatter(group), SequenceGather(group)
        for name, param in model.named_parameters():
            if name.startswith("layers.") and "layernorm" in name or name.startswith("final_layernorm"):
                param.sequence_parallel = True  # computed on s/p positions: grads summed over TP
    return model
