"""Megatron's init, drawn per parameter name, so every parallel layout builds the one-process model.

Each parameter is drawn at its full shape from its own generator, seeded by (--seed, the parameter's full
name), and this process keeps its block: the numbers do not depend on which parameters a process builds
(a pipeline stage holding layers 6..11) or how a tensor is split (a tensor-parallel rank holding half of
every matrix), nor on the order they are built in."""
import hashlib

import torch

OUTPUT_PROJECTIONS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")  # add into the residual


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (--seed, parameter name), the same in every process and on every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def full_shape(param) -> tuple:
    """The shape of the whole tensor this parameter is a block of (its own shape when not sharded)."""
    return tuple(getattr(param, "full_shape", param.shape))


def shard(full, param):
    """This process's block of a full tensor: tensor parallelism marks a sharded parameter with
    partition_dim / partition_index / partition_count (Megatron: tensor_model_parallel, partition_dim)."""
    if not hasattr(param, "partition_dim"):
        return full
    return full.chunk(param.partition_count, param.partition_dim)[param.partition_index]


@torch.no_grad()
def init_parameters(model, seed):
    """Megatron's init, drawn per parameter name: weights N(0, std); the two output projections of each
    layer (the ones adding into the residual stream) N(0, std / sqrt(2L)) so the stream's variance does not
    grow with depth; biases 0; LayerNorm weight 1. Each weight is drawn at its full shape from
    torch.Generator().manual_seed(name_seed(seed, name)), then this process keeps its block (shard). The
    word table is drawn for the real vocab and its padding rows are 0: the real rows do not depend on
    how much padding the tensor-parallel size asks for."""
    cfg = model.config
    std = cfg.init_method_std
    output_std = std / (2.0 * cfg.num_layers) ** 0.5
    for name, param in model.named_parameters():
        if "layernorm" in name:
            param.fill_(1.0 if name.endswith(".weight") else 0.0)
            continue
        if name.endswith("bias"):
            param.zero_()
            continue
        shape = full_shape(param)
        rows = cfg.vocab_size if name == "embedding.word_embeddings.weight" else shape[0]
        generator = torch.Generator().manual_seed(name_seed(seed, name))
        full = torch.zeros(shape)
        full[:rows].normal_(0.0, output_std if name.endswith(OUTPUT_PROJECTIONS) else std, generator=generator)
        param.copy_(shard(full, param))
