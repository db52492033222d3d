"""What one GPU holds during a minibert run: parameters, their gradients, the optimizer state, activations.

Every count here follows the shapes minibert's BertModel really has (model.py), split the way
tensor_parallel.py splits them and cut into stages the way schedules.layer_ranges cuts them. The
planner (minibert/tools/plan.py) prints them; tests/test_plan.py checks the parameter counts against models
built on the meta device and the activation formula against the tensors autograd really saves.

Parameters (h hidden, f FFN width, V_p the padded vocab, P positions, t = TP):

    one layer     4h^2 + 2hf + 9h + f         QKV 3h^2+3h, output proj h^2+h, fc1 hf+f, fc2 fh+h, 2 LayerNorms 4h
                  of which split over TP:     QKV (weight and bias), output-proj weight, fc1 (weight and bias),
                                              fc2 weight; the two row-parallel biases and the LayerNorms are whole
    embedding     V_p h / t + P h + 2h        word table (rows split over TP), positions, token types
                                              (+ 2h for post-LN's embedding LayerNorm)
    heads         2h + h^2 + h + 2h + V_p/t   final LayerNorm (pre-LN only), LM head dense + LayerNorm, LM bias
                  + h^2 + h + 2h + 2          pooler and SOP head (unless --bert-no-binary-head)

With pipelining the last stage also holds a copy of the word table for the tied LM head (V_p h / t).

Bytes per parameter (optim.py and parallel/data_parallel.py): the parameter itself (2 in fp16/bf16, 4 in
fp32), its fp32 gradient buffer "main_grad" (4), and the optimizer: an fp32 master copy in 16-bit runs (4)
plus Adam's two moments (8). ZeRO-1 (--use-distributed-optimizer) divides the optimizer part by DP.

Activations: the tensors the forward keeps for the backward, per layer and micro-batch of b samples of
s tokens (bytes; a = heads; e = 2 bytes per activation element in 16-bit runs, 4 in fp32; dropout masks are bool
on a GPU, 1 byte):

    outside the TP region  4ebsh + 2bsh           LN1 input, QKV input, LN2 input, fc1 input; two hidden
                                                  dropout masks                      (/ t with --sequence-parallel)
    inside the TP region   (4ebsh + 2ebsf) / t    q, k, v and the attention output; GeLU input, fc2 input
    attention core, flash  4abs / t               one fp32 softmax statistic per row (no s x s matrix)
    attention core, local  (4 + 1 + e) abs^2 / t  fp32 probabilities, dropout mask, dropped probabilities
    LayerNorm statistics   16bs                   mean and 1/std in fp32 for two LayerNorms

In bf16 with f = 4h that is 34bsh + 4abs (flash) or 34bsh + 7abs^2 (local): Megatron's 34bsh + 5abs^2
(Korthikanti et al. 2022) with the softmax kept in fp32. Selective recompute drops the attention core
(its inputs q, k, v stay); full recompute keeps only each layer's input (ebsh, / t with sequence
parallelism) and rebuilds one layer's activations at a time in the backward. The planner assumes the
recompute another part of the course adds follows these two rules (Megatron's).

FP8 (--fp8-format, minibert/fast/fp8.py): each of the four Linears keeps, for its weight gradient, a
1-byte FP8 copy of its input instead of the 16-bit input. The QKV and fc1 inputs' copies cover the whole
sequence (sequence parallelism gathers before the cast), the attention output projection's and fc2's
their TP shard; the flash kernel still keeps its own output. With f = 4h that is 29bsh (flash) or 27bsh
(local) in place of 34bsh. Beside the activations, each FP8 Linear keeps its weight's FP8 copy and
its transpose for the whole step: 2 bytes per weight of the four Linears (fp8_weight_copies).

Under 1F1B, pipeline stage r holds min(p - r, m) micro-batches' activations at once (the first stage the
most, p); the interleaved schedule counts model chunks (schedules.schedule gives the exact peak).

What production does: Megatron's theoretical_memory_usage.py makes the same estimate with its own formula
(34sbh + 5as^2b per layer, no fp32 softmax, no embedding or loss terms)."""
from dataclasses import dataclass

from minibert.parallel.schedules import layer_ranges, schedule

GiB = 2 ** 30


# ---------------------------------------------------------------- parameters
def layer_parameters(cfg, tp=1) -> int:
    """One transformer layer's parameters on one tensor-parallel rank."""
    h, f = cfg.hidden_size, cfg.ffn_size
    split = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h  # QKV, output proj weight, fc1, fc2 weight
    whole = 4 * h + h + h                                      # LN1 + LN2, output-proj bias, fc2 bias
    return split // tp + whole


def embedding_parameters(cfg, tp=1) -> int:
    h = cfg.hidden_size
    n = cfg.padded_vocab_size * h // tp + cfg.max_positions * h + 2 * h  # word, position, token-type tables
    return n + (2 * h if cfg.post_ln else 0)


def head_parameters(cfg, tp=1) -> int:
    """The last stage's final LayerNorm, LM head and (unless --bert-no-binary-head) pooler + SOP head."""
    h = cfg.hidden_size
    n = (0 if cfg.post_ln else 2 * h) + (h * h + h) + 2 * h + cfg.padded_vocab_size // tp
    return n + ((h * h + h) + (2 * h + 2) if cfg.binary_head else 0)


def total_parameters(cfg) -> int:
    """All of BertModel(cfg): sum(p.numel() for p in BertModel(cfg).parameters())."""
    return embedding_parameters(cfg) + cfg.num_layers * layer_parameters(cfg) + head_parameters(cfg)


@dataclass
class Stage:
    rank: int            # pipeline rank
    layers: int          # transformer layers it holds (all its model chunks)
    first: bool          # holds the embedding
    last: bool           # holds the heads (and, under PP, the copy of the word table)
    parameters: int      # on one tensor-parallel rank of this stage
    in_flight: int = 1   # model chunks whose activations are alive at the peak (schedule below)


def pipeline_kind(cfg) -> str:
    return "interleaved" if cfg.virtual_pipeline_size > 1 else cfg.pipeline_schedule


def stages(cfg) -> list:
    """Every pipeline stage of a validated config, with its parameters and peak chunks in flight."""
    tp, pp, vp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_size
    ranges = layer_ranges(cfg.num_layers, pp, vp, cfg.decoder_first_pipeline_num_layers,
                          cfg.decoder_last_pipeline_num_layers)
    out = []
    for rank, chunks in enumerate(ranges):
        layers = sum(len(chunk) for chunk in chunks)
        first, last = rank == 0, rank == pp - 1
        n = layers * layer_parameters(cfg, tp)
        n += embedding_parameters(cfg, tp) if first else 0
        n += head_parameters(cfg, tp) if last else 0
        n += cfg.padded_vocab_size * cfg.hidden_size // tp if last and not first else 0  # tied-table copy
        in_flight = 1 if pp == 1 else peak_in_flight(pipeline_kind(cfg), pp, rank, cfg.num_micro_batches, vp)
        out.append(Stage(rank, layers, first, last, n, in_flight))
    return out


def peak_in_flight(kind, pp, rank, num_micro_batches, vp=1) -> int:
    """Most forwards whose backward has not run yet along this rank's schedule (1f1b: min(p - rank, m))."""
    alive = peak = 0
    for action in schedule(kind, pp, rank, num_micro_batches, vp):
        alive += 1 if action.op == "F" else -1
        peak = max(peak, alive)
    return peak


# ---------------------------------------------------------------- parameter state
def state_bytes(parameters, cfg, distributed_optimizer=False) -> dict:
    """Bytes of weights, fp32 main grads and optimizer state for `parameters` elements on one GPU."""
    low = cfg.fp16 or cfg.bf16
    optimizer = parameters * (12 if low else 8)  # (fp32 master +) Adam m and v
    if distributed_optimizer:
        optimizer /= cfg.data_parallel_size
    return {"weights": parameters * (2 if low else 4), "grads": parameters * 4, "optimizer": optimizer}


# ---------------------------------------------------------------- activations
@dataclass
class LayerActivations:
    """Bytes one layer keeps for one micro-batch, by part (see the module docstring)."""
    outside: float       # LayerNorm inputs and dropout masks (outside the TP region; / TP with SP)
    inside: float        # q, k, v, attention output, MLP: split over TP
    core: float          # the attention core: softmax statistics (flash) or s x s matrices
    stats: float         # LayerNorm mean and 1/std

    @property
    def total(self):
        return self.outside + self.inside + self.core + self.stats


def activation_bytes(cfg) -> int:
    return 2 if cfg.fp16 or cfg.bf16 else 4


def layer_activations(cfg, backend, recompute=None, mask_bytes=1, stats_bytes=4) -> LayerActivations:
    """One layer, one micro-batch of --micro-batch-size samples. backend: a resolved attention backend
    (flash, local, fused). recompute: None, "selective" or "full". mask_bytes / stats_bytes: a
    dropout mask element and a LayerNorm statistic (GPU: bool and fp32; the CPU keeps both in the
    activation dtype, which the test uses)."""
    b, s, h, f = cfg.micro_batch_size, cfg.seq_length, cfg.hidden_size, cfg.ffn_size
    heads = cfg.num_attention_heads // cfg.tensor_model_parallel_size  # this rank's heads
    t = cfg.tensor_model_parallel_size
    sp = t if cfg.sequence_parallel else 1
    e, tokens = activation_bytes(cfg), b * s
    if recompute == "full":  # only the layer's input is kept, the checkpoint
        return LayerActivations(e * tokens * h / sp, 0, 0, 0)
    masks = 2 if cfg.hidden_dropout > 0 else 0
    outside = tokens * h * (4 * e + masks * mask_bytes) / sp
    inside = tokens * (4 * h + 2 * f) * e / t
    stats = 2 * 2 * tokens * stats_bytes / sp
    if recompute == "selective":
        core = 0
    elif backend == "flash":
        core = 4 * b * heads * s + 4 * tokens + 8 * b  # fp32 log-sum-exp per row; the padding bias; per sample
        #                                                two int32: 1 + its last real key, its first padded key
    else:
        softmax = 4 if backend == "local" else e  # local: fp32 softmax; fused: the scores' dtype
        if cfg.attention_dropout > 0:
            kept = softmax + mask_bytes + e  # probabilities, dropout mask, dropped probabilities (for P V)
        else:
            kept = softmax + (0 if softmax == e else e)  # the probabilities cast to V's dtype for P V
        core = b * heads * s * s * kept
    if cfg.fp8_format is not None:  # each of the 4 Linears keeps an FP8 copy (1 byte) of its input, not the input
        outside += 2 * tokens * h * (1 - e / sp)  # QKV, fc1: the copy covers the whole (gathered) sequence
        inside += tokens * (h + f) * (1 - e) / t  # attention output projection, fc2
        inside += tokens * h * e / t if backend == "flash" else 0  # the flash kernel keeps its output itself
    return LayerActivations(outside, inside, core, stats)


def fp8_weight_copies(cfg, stage) -> float:
    """--fp8-format: bytes of the FP8 copies of a stage's layer weights (one GPU), w8 and its transpose,
    which each FP8 Linear keeps for the micro-batches of a step."""
    if cfg.fp8_format is None:
        return 0
    h, f = cfg.hidden_size, cfg.ffn_size
    return 2 * stage.layers * (4 * h * h + 2 * h * f) / cfg.tensor_model_parallel_size


def embedding_activations(cfg, mask_bytes=1, stats_bytes=4) -> float:
    """First stage, one micro-batch: the embedding dropout's mask (+ post-LN's embedding LayerNorm input)."""
    tokens, h, e = cfg.micro_batch_size * cfg.seq_length, cfg.hidden_size, activation_bytes(cfg)
    n = tokens * h * mask_bytes if cfg.hidden_dropout > 0 else 0
    return n + (tokens * (h * e + 2 * stats_bytes) if cfg.post_ln else 0)


def head_activations(cfg, stats_bytes=4, peak=True) -> float:
    """Last stage, one micro-batch: final LayerNorm, the LM head's saved inputs and the loss's fp32
    probabilities over the vocab. peak=True adds what lives only while the loss is computed: the
    16-bit logits and their fp32 copy (the backward's gradients take the same room)."""
    tokens, h, e = cfg.micro_batch_size * cfg.seq_length, cfg.hidden_size, activation_bytes(cfg)
    t = cfg.tensor_model_parallel_size
    sp = t if cfg.sequence_parallel else 1
    n = 0 if cfg.post_ln else tokens * (h * e + 2 * stats_bytes) / sp  # final LayerNorm
    rows = tokens * cfg.mask_prob if cfg.sparse_mlm else tokens  # positions through the LM head
    vocab = cfg.vocab_size if t == 1 else cfg.padded_vocab_size // t  # columns of this rank's logits
    n += rows * (4 * h * e + 2 * stats_bytes)  # dense input, GeLU input, LayerNorm input (+ stats), decoder input
    if cfg.sparse_mlm and cfg.binary_head:  # the pooler's view hidden[:, 0] keeps all of hidden [b, s, h] alive
        n += tokens * h * e
    n += rows * vocab * 4  # fp32 (log-)probabilities kept by the cross entropy
    return n + (rows * vocab * (e + 4) if peak else 0)


def stage_activations(cfg, stage, backend, recompute=None) -> float:
    """Peak activation bytes of one pipeline stage, one GPU. Full recompute follows --recompute-method:
    uniform (the default) keeps the input of every group of --recompute-num-layers layers (default 1) and
    rebuilds one group at a time in the backward; block recomputes the first --recompute-num-layers layers
    of each chunk and keeps the others' activations whole."""
    whole = layer_activations(cfg, backend, recompute if recompute != "full" else None).total
    chunk_layers = stage.layers // cfg.virtual_pipeline_size
    if recompute == "full":
        kept_input, k = layer_activations(cfg, backend, "full").total, cfg.recompute_num_layers or 1
        if cfg.recompute_method == "block":
            recomputed = min(k, chunk_layers)
            per_chunk = recomputed * kept_input + (chunk_layers - recomputed) * whole
            rebuilt = whole if recomputed else 0  # one layer's activations at a time
        else:
            per_chunk = -(-chunk_layers // k) * kept_input
            rebuilt = min(k, chunk_layers) * whole  # one group's activations at a time
    else:
        per_chunk, rebuilt = chunk_layers * whole, 0
    n = stage.in_flight * per_chunk + rebuilt
    micro_batches = -(-stage.in_flight // cfg.virtual_pipeline_size)  # of the first chunk (the embedding's)
    n += micro_batches * embedding_activations(cfg) if stage.first else 0
    afab = pipeline_kind(cfg) == "afab" and cfg.pipeline_model_parallel_size > 1
    heads = cfg.num_micro_batches if afab else 1  # AFAB keeps every micro-batch's loss until the backwards
    return n + (head_activations(cfg) + (heads - 1) * head_activations(cfg, peak=False) if stage.last else 0)


def memory_table(cfg, stage, backend) -> dict:
    """{(recompute, zero1): total bytes} for one stage: every combination the planner prints."""
    table = {}
    for recompute in (None, "selective", "full"):
        acts = stage_activations(cfg, stage, backend, recompute)
        for zero1 in (False, True):
            table[recompute, zero1] = sum(state_bytes(stage.parameters, cfg, zero1).values()) + acts + \
                fp8_weight_copies(cfg, stage)
    return table
