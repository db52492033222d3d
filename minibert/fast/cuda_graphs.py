"""CUDA graphs: a micro-batch's forward and backward, captured once and replayed (--cuda-graph-impl local).

Why. A small model's step is the host's time, not the GPU's. Each kernel costs the host microseconds to
launch (Python, autograd, the driver), and a micro-batch of make train-small's 4-layer model launches
hundreds of kernels that the GPU finishes faster than that: the GPU waits for the host (chapter 8,
sections 4.12 and 4.13, measure it). A CUDA graph records those launches once, with their arguments; a
replay submits all of them in one call.

    eager:   host  |launch|launch|launch|launch|launch| ...          GPU idles between tiny kernels
    graph:   host  |copy inputs|replay|                               GPU runs the recorded kernels back to back

What a graph freezes is everything the host decided while it was recorded: which kernels run, their grid
sizes, the *addresses* of every tensor they read and write, and every Python number passed to them. So a
replay needs:
- a shape it was recorded for. Packed micro-batches (minibert/data/packing.py) change their row count with
  every batch, so with graphs get_batch rounds the rows up to a multiple of the sequence length s with
  filler rows (make_packing's `bucket`) and does not trim: a [b, s] micro-batch then has one of b row
  counts, and each gets its graph the first time it is seen (--no-pack-tokens: one padded shape);
- its inputs copied into the tensors the graph reads (`static`), and its outputs read from the tensors
  the graph wrote, copied before the next replay overwrites them;
- new random numbers at every replay: torch's CUDA generator is graph-aware (each replay advances its
  offset, so F.dropout drops other entries), and our Triton kernels, whose seed is otherwise a Python
  number, take a seed drawn on the device while a graph is captured (kernels/dropout.py: draw_seed);
- every Python number to stay what it was: the fp16 loss scale is one, so when it changes the graphs
  are captured again (and so are FP8's, once, after the first step: minibert/fast/fp8.py).

What is captured, per micro-batch: embedding, layers, heads, loss, its backward, and the gradient
accumulation into the fp32 main grads (fixed buffers outside the graph, so replays add up in them as
eager micro-batches do; a step's first micro-batch copies into them instead, so it has a graph of its
own). What is not: getting the batch, the data-parallel reduction after the last
micro-batch, and the optimizer step (its skip decision reads the grad norm on the host).

Capture, once per shape: a warm-up forward + backward on a side stream first (kernels compile, with the
seed read from memory as in the capture, and cuBLAS picks its algorithms and workspaces: a graph cannot
record a first-time setup), which leaves no trace: its gradients are dropped and the random generators
are put back. Then the capture itself, which runs nothing: the kernels it
records run at the first replay. A model's graphs share one memory pool and one
capture stream: each replay's temporaries are dead once it ends (its outputs are copied at once, its
gradients are in the main grads), so the next graph may reuse their memory, and b graphs cost about the
memory of the largest (the allocator reuses a freed block only on the stream that allocated it, hence
the one stream).

--sparse-mlm's LM head takes a different number of masked rows in every micro-batch; with graphs
get_batch rounds that count up to a multiple of s too, with filler rows the loss gives no weight
(packing.fill_rows), so the head's shape is one of a few as well.

Limits (config.py refuses the rest with one line): a CUDA device; tensor and pipeline parallel size 1
(their collectives and sends would be recorded too); no activation recompute (torch.utils.checkpoint
sets generator states, which capture forbids).

What production does: Megatron's --cuda-graph-impl local (CudaGraphManager) captures each transformer
layer's forward and backward separately, which keeps the pipeline schedule and the collectives between
the graphs; --cuda-graph-scope full_iteration captures a whole step. minibert captures whole micro-batches:
fewer host calls than per-layer graphs, and one idea to read."""
import gc
import weakref

import torch

from minibert.fast import fp8
from minibert.training.training_log import COUNTS

BATCH_INPUTS = ("text", "types", "labels", "loss_mask", "is_random", "is_pad")  # [b, s] and [b] tensors


def graph_inputs(batch) -> dict:
    """Every device tensor of a micro-batch that its forward reads, by name: what a replay copies in."""
    inputs = {k: batch[k] for k in BATCH_INPUTS}
    packing = batch["packing"]
    if packing is not None:
        inputs.update(index=packing.index, cls_rows=packing.cls_rows, cu_seqlens=packing.cu_seqlens)
    for name in ("loss_positions", "lm_rows"):  # lm_rows: --sparse-mlm's rows, a fixed count (get_batch)
        if batch[name] is not None:
            inputs[name] = batch[name]
    return inputs


def shape_key(batch, num_micro_batches, inputs=None):
    """What a graph is recorded for: every input's name, shape and dtype, and the 1 / n its loss is
    scaled by. inputs: graph_inputs(batch), if the caller has it already."""
    inputs = graph_inputs(batch) if inputs is None else inputs
    return tuple((k, tuple(t.shape), t.dtype) for k, t in inputs.items()) + (num_micro_batches,)


class CapturedMicroBatch:
    """One shape's graph: forward_step + backward + gradient accumulation of one micro-batch. It keeps
    the graph and its input and output tensors, not the model (so a model's graphs go with the model)."""

    def __init__(self, forward_step, model, optimizer, num_micro_batches, batch, pool, stream):
        self.host_numbers = host_numbers(model, optimizer)
        self.static = {k: t.clone() for k, t in graph_inputs(batch).items()}
        packing = batch["packing"]
        if packing is not None:
            packing = packing._replace(index=self.static["index"], cls_rows=self.static["cls_rows"],
                                       cu_seqlens=self.static["cu_seqlens"])
        static_batch = {**batch, **{k: self.static[k] for k in BATCH_INPUTS}, "packing": packing,
                        "loss_positions": self.static.get("loss_positions"), "lm_rows": self.static.get("lm_rows")}
        run = lambda accumulate: forward_backward(forward_step, model, optimizer, num_micro_batches,  # noqa: E731
                                                  static_batch, accumulate)
        warm_up(run, stream)  # warm-up and capture on the model's side stream (ModelGraphs)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread is barred from unsafe CUDA calls while recording (the DataLoader's
        # pin-memory thread keeps pinning batches meanwhile); no garbage collection while recording: what it
        # frees (an old graph, CUDA memory of other objects) is not this recording's business
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self.losses, self.counts, self.has_sop = run(True)  # [3] losses, [2 or 4] accuracy counts
        finally:
            if collecting:
                gc.enable()

    def replay(self, batch, inputs=None):
        """-> (loss, metrics) of this micro-batch, as forward_step's (losses are fresh device tensors).
        inputs: graph_inputs(batch), if the caller has it already."""
        for name, tensor in (graph_inputs(batch) if inputs is None else inputs).items():
            self.static[name].copy_(tensor, non_blocking=True)
        self.graph.replay()
        # the next replay overwrites the outputs (and may reuse their memory): copy them now
        return replayed_metrics(self.losses.clone(), self.counts.clone(), self.has_sop, batch)


def host_numbers(model, optimizer):
    """What the host decided that a graph records and that can change during a run: the fp16 loss scale,
    and whether FP8 casts still take their scale from the tensor (before the first step: minibert/fast/fp8.py)."""
    return optimizer.loss_scale, fp8.any_fresh(model)


def replayed_metrics(losses, counts, has_sop, batch):
    """forward_step's (loss, metrics) from what forward_backward packed: the inverse of its packing."""
    metrics = {"lm loss": losses[1], **dict(zip(COUNTS, counts)), "flops": batch["flops"], "tokens": batch["tokens"]}
    if has_sop:
        metrics["sop loss"] = losses[2]
    return losses[0], metrics


def forward_backward(forward_step, model, optimizer, num_micro_batches, batch, accumulate=True):
    """The micro-batch as the eager schedule runs it (pipeline.forward_backward_no_pipelining) ->
    (float32 [3]: loss, lm loss, sop loss (lm loss again without the binary head), int64 [4]: the accuracy
    counts in COUNTS order (lm correct, lm masked, sop correct, sop samples; the first 2 without the
    binary head), has the sop loss). Two packed tensors, so a replay copies its outputs in two copies."""
    loss, metrics = forward_step(batch, model, None)
    grads = model.grad_buffers  # minibert.training.build.build_grad_buffers
    grads.set_last_micro_batch(False)  # nothing is reduced inside a graph: finalize_model_grads does it after
    optimizer.scale_loss(loss / num_micro_batches).backward()
    if accumulate:
        grads.accumulate()  # main_grad += grad, then the 16-bit grads are freed
    else:
        for p in grads.params:
            p.grad = None
    sop = metrics.get("sop loss", metrics["lm loss"])
    counts = torch.stack([metrics[name] for name in COUNTS if name in metrics])
    return torch.stack([loss.detach(), metrics["lm loss"], sop]), counts, "sop loss" in metrics


def warm_up(run, stream):
    """run(accumulate=False) once on `stream`, leaving no trace: no gradient is kept and the CPU and CUDA
    generators are as they were. Its dropout seeds are drawn on the device, as in the capture, so the
    kernels the graph records (their SEED_IN_MEMORY variants) are compiled and loaded here."""
    from minibert.kernels.dropout import (
        seeds_on_device,  # Triton is imported only where its kernels run
    )
    states = torch.get_rng_state(), torch.cuda.get_rng_state()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), seeds_on_device():
        run(False)
    torch.cuda.current_stream().wait_stream(stream)
    torch.set_rng_state(states[0])
    torch.cuda.set_rng_state(states[1])


class ModelGraphs:
    """A model's graphs, one per shape, the memory pool they share and the one side stream they are all
    captured on. One stream, because the caching allocator hands a freed block only to a request on the
    stream it was first allocated on: graphs captured on a stream each would each keep their own blocks
    in the shared pool, and b graphs would cost b graphs' memory (BERT-large at micro-batch 205 ran out of
    memory so: chapter 8, section 6; bench/notes/training.md)."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.by_shape = {}


_graphs = weakref.WeakKeyDictionary()  # model -> its ModelGraphs, made by its first train_step


def forward_backward_captured(forward_step, batches, model, optimizer):
    """The schedule of forward_backward_no_pipelining with each micro-batch replayed from its shape's graph
    (captured at its first use) -> the list of each micro-batch's (loss, metrics)."""
    graphs = _graphs.get(model)
    if graphs is None:
        graphs = _graphs[model] = ModelGraphs()
    numbers = host_numbers(model, optimizer)
    if any(g.host_numbers != numbers for g in graphs.by_shape.values()):
        _graphs[model] = graphs = ModelGraphs()  # every graph holds the old numbers: capture again
    fp8.cast_weights(model)  # --fp8-format: this step's FP8 weights, which every replay reads
    results = []
    for batch in batches:
        inputs = graph_inputs(batch)  # once per micro-batch: the key and the copies both read it
        # a step's first micro-batch records a copy into the main grads, the others an add (see
        # minibert/parallel/data_parallel.py): a graph of each kind where a step has several
        key = shape_key(batch, len(batches), inputs) + (model.grad_buffers.fresh,)
        if key not in graphs.by_shape:
            graphs.by_shape[key] = CapturedMicroBatch(forward_step, model, optimizer, len(batches), batch,
                                                      graphs.pool, graphs.stream)
        results.append(graphs.by_shape[key].replay(batch, inputs))
        model.grad_buffers.fresh = False  # the replay ran the recorded fold: the next micro-batch adds
    return results


def captured_graphs(model) -> int:
    """How many micro-batch graphs `model` holds (for tests and benches)."""
    graphs = _graphs.get(model)
    return len(graphs.by_shape) if graphs is not None else 0
