"""This rank's share of the run, built for its place in the layout: the model chunks and their
data-parallel gradient buffers, the optimizer over those buckets, the LR schedule, the pipeline plan,
and the random generators.

    --seed --> python / numpy / torch generators (+ 100 x pipeline stage)  -> dropout
           --> one generator per tensor-parallel rank (minibert.parallel.rng) -> dropout inside TP
    every parameter: drawn from (--seed, its name) at its full shape, this rank's block kept
                     (minibert.model.init_weights), so the weights do not depend on the layout

The trainer (minibert.train), the notebooks and the tests build through these functions; a one-process
run is the layout of world size 1."""
import random

import numpy as np
import torch

from minibert.config import compute_dtype
from minibert.model.attention import resolve_backend
from minibert.model.bert import BertModel, init_parameters
from minibert.parallel.data_parallel import DataParallelGrads
from minibert.parallel.pipeline import Pipeline
from minibert.parallel.rng import TENSOR_PARALLEL_SEED_OFFSET, TensorParallelRNG
from minibert.parallel.schedules import layer_ranges
from minibert.parallel.state import ParallelState
from minibert.parallel.tensor_parallel import apply_tensor_parallel
from minibert.training.lr_schedule import build_scheduler
from minibert.training.optim import build_optimizer


def set_random_seed(seed: int, state: ParallelState):
    """Seeds python, numpy and torch (CPU and CUDA): dropout follows from them (the init does not: it is
    drawn per parameter name). As Megatron, each pipeline stage gets seed + 100 x stage, and each
    tensor-parallel rank a generator of its own for the dropout inside the tensor-parallel region
    (minibert.parallel.rng)."""
    seed = seed + 100 * state.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    state.rng = TensorParallelRNG(seed + TENSOR_PARALLEL_SEED_OFFSET + state.tp_rank, state.device)


def as_state(state_or_device) -> ParallelState:
    """The notebook and tests may pass a device: that is a one-process grid on it."""
    if isinstance(state_or_device, ParallelState):
        return state_or_device
    return ParallelState(device=torch.device(state_or_device))


def build_model(cfg, state):
    """This rank's part of the model: its pipeline stage's layers (one model chunk, or several with the
    interleaved schedule: then a list), each built on the meta device (shapes only), tensor parallelism
    applied (this rank's shards), then allocated on the device and initialised (each parameter drawn from
    --seed and its name, so the weights are the one-process model's whatever the layout), cast to 16-bit."""
    vp = cfg.virtual_pipeline_size
    ranges = layer_ranges(cfg.num_layers, state.pp, vp, cfg.decoder_first_pipeline_num_layers,
                          cfg.decoder_last_pipeline_num_layers)[state.pp_rank]
    chunks = []
    for c, layers in enumerate(ranges):
        with torch.device("meta"):
            chunk = BertModel(cfg, layer_numbers=layers, pre_process=state.is_first_stage and c == 0,
                              post_process=state.is_last_stage and c == vp - 1, init=False)
        apply_tensor_parallel(chunk, state, state.rng, cfg.sequence_parallel)
        marks = {name: dict(vars(p)) for name, p in chunk.named_parameters()}  # which block each shard is
        chunk.to_empty(device=state.device)  # makes new Parameter objects (without the marks) ...
        for name, p in chunk.named_parameters():
            vars(p).update(marks[name])  # ... so they are put back
        init_parameters(chunk, cfg.seed)
        chunks.append(chunk.to(compute_dtype(cfg)))
    return chunks[0] if len(chunks) == 1 else chunks


def backend_for(cfg, device) -> str:
    """cfg.attention_backend resolved for the model that cfg builds on `device` (in its compute dtype)."""
    return resolve_backend(cfg.attention_backend, device, compute_dtype(cfg),
                           cfg.hidden_size // cfg.num_attention_heads)


def as_chunks(model) -> list:
    return model if isinstance(model, (list, tuple)) else [model]


def tied_embedding(chunks, state):
    """With pipelining, the word table of the first stage and its copy on the last (for the tied LM head)."""
    if state.pp == 1:
        return None
    for chunk in (chunks[0], chunks[-1]):
        if chunk.pre_process or chunk.post_process:
            return chunk.embedding.word_embeddings.weight
    return None


def build_pipeline(cfg, state):
    """The pipeline's schedule and exchange plan for this rank (None without pipelining)."""
    if state.pp == 1:
        return None
    kind = "interleaved" if cfg.virtual_pipeline_size > 1 else cfg.pipeline_schedule
    seq = cfg.seq_length // (state.tp if cfg.sequence_parallel else 1)
    return Pipeline(state, kind, cfg.num_micro_batches, cfg.virtual_pipeline_size,
                    (cfg.micro_batch_size, seq, cfg.hidden_size), compute_dtype(cfg), cfg.pipeline_trace)


def build_grad_buffers(model, cfg, state=None) -> list:
    """Each model chunk's data-parallel gradient buffers (minibert.parallel.data_parallel): every parameter's
    fp32 `main_grad` is a view of a bucket, which finalize_model_grads reduces over the data-parallel group.
    Kept on the chunk as `chunk.grad_buffers` (Megatron's DDP wrapper holds them the same way); returns them.
    `model`: a model or a list of chunks; state None: one process."""
    state = state or ParallelState()
    chunks = as_chunks(model)
    separate = ("embedding.word_embeddings.weight",) if state.pp > 1 else ()  # ZeRO shards align across stages
    for chunk in chunks:
        chunk.grad_buffers = DataParallelGrads(chunk, state, bucket_size=cfg.ddp_bucket_size,
                                               distributed_optimizer=cfg.use_distributed_optimizer,
                                               overlap=cfg.overlap_grad_reduce, separate=separate)
    return [chunk.grad_buffers for chunk in chunks]


def build_model_and_optimizer(cfg, state):
    """The model (build_model) with its gradient buffers (build_grad_buffers), AdamW with fp32 masters
    over those buckets, and the LR scheduler. `state`: a ParallelState or a device."""
    state = as_state(state)
    if state.rng is None:
        set_random_seed(cfg.seed, state)
    model = build_model(cfg, state)
    grads = build_grad_buffers(model, cfg, state)
    optimizer = build_optimizer(grads, cfg, state, tied_embedding(as_chunks(model), state))
    scheduler = build_scheduler(optimizer, cfg)
    return model, optimizer, scheduler
