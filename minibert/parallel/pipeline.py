"""Schedules: how a step's micro-batches run forward and backward, on one stage or through a pipeline.

A schedule runs every micro-batch's forward and backward on this rank and returns the per-micro-batch
(loss, metrics) of the stage that has the losses. Gradients add up in the data-parallel buffers; only the
last micro-batch's backward reduces them (minibert.parallel.data_parallel), so the schedule tells the
buffers which backward is last.

No pipelining (one stage), Megatron's forward_backward_no_pipelining:

    for k in range(m):  forward(k); backward(k)        one micro-batch's activations alive at a time

With PP stages, each rank holds a slice of the layers (one model chunk, or several with the interleaved
schedule) and a micro-batch travels through the stages: activations forward, their gradients backward,
by point-to-point sends between neighbouring ranks. The order of forwards (F) and backwards (B) on each
rank is the schedule (minibert.parallel.schedules: all-forward-all-backward, 1F1B, interleaved 1F1B);
which tensors are exchanged after each action, batched so NCCL can never deadlock, is the exchange plan
(minibert.parallel.p2p_plan). This executor just follows both:

    plan = exchanges(...)                           # batch 0 before the first action, i + 1 after action i
    for i, action in enumerate(actions):
        post batch i (batch_isend_irecv), wait      # sends of finished outputs, receives of coming inputs
        F(mb, chunk): input = the received activation (stage 0: the embedding reads the tokens)
                      output = chunk(input); last stage: the loss; else keep it to send, and for B
        B(mb, chunk): last stage: loss.backward(); else output.backward(received gradient)
                      keep input.grad to send to the previous stage
    post the last batch

Only the last stage computes losses; every stage reads each micro-batch (the attention needs its padding
mask). p2p tensors have the fixed shape [micro batch, seq (/ TP with sequence parallelism), hidden]: no
shapes travel."""
import torch
import torch.distributed as dist

from minibert.errors import write_line
from minibert.parallel.p2p_plan import input_message, output_message
from minibert.parallel.schedules import exchanges, schedule


def forward_backward_no_pipelining(forward_step, batches, model_chunks, *, grads=(),
                                   scale_loss=lambda loss: loss, forward_only=False):
    """forward_step(batch, model, None) -> (loss, metrics). Each loss is divided by the number of
    micro-batches (the step's gradient is the mean of theirs) and scaled (fp16) before its backward.
    Returns the list of each micro-batch's (loss, metrics), losses detached."""
    (model,) = model_chunks
    results = []
    for k, batch in enumerate(batches):
        if forward_only:
            with torch.no_grad():
                loss, metrics = forward_step(batch, model, None)
        else:
            loss, metrics = forward_step(batch, model, None)
            for g in grads:
                g.set_last_micro_batch(k == len(batches) - 1)
            scale_loss(loss / len(batches)).backward()
            for g in grads:
                g.accumulate()
        results.append((loss.detach(), metrics))
    return results


class Pipeline:
    """This rank's place in the pipeline and its exchange plans (computed once per schedule)."""

    def __init__(self, state, kind, num_micro_batches, vp, shape, dtype, trace=False):
        self.state, self.kind, self.m, self.vp = state, kind, num_micro_batches, vp
        self.shape, self.dtype, self.trace = shape, dtype, trace
        self.actions = schedule(kind, state.pp, state.pp_rank, num_micro_batches, vp)
        self.plan = exchanges(kind, state.pp, state.pp_rank, num_micro_batches, vp)
        self.group = state.group("pipeline")
        if self.group is not None:
            dist.barrier(group=self.group)  # NCCL: the first p2p call must be one all ranks of the group join

    def stage(self, chunk) -> int:
        return chunk * self.state.pp + self.state.pp_rank

    def post(self, batch, outgoing, received):
        """One batch_isend_irecv of the plan's ops, waited on; received tensors land in `received`."""
        ops, landing = [], []
        for op in batch:
            peer = self.state.stage_rank(op.peer)
            if op.op == "send":
                ops.append(dist.P2POp(dist.isend, outgoing.pop(op.message), peer, self.group))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.state.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer, self.group))
                landing.append((op.message, buffer))
            if self.trace:
                kind, mb, stage = op.message
                # one write per line (write_line): the ranks share stdout
                write_line(f"[pipeline rank {self.state.pp_rank}] {op.op} {kind} of micro-batch {mb} for stage "
                           f"{stage} {'to' if op.op == 'send' else 'from'} pipeline rank {op.peer}")
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for message, buffer in landing:
            received[message] = buffer


def forward_backward_pipelining(forward_step, batches, model_chunks, pipeline, *, grads=(),
                                scale_loss=lambda loss: loss):
    """Run one step's schedule on this rank. forward_step(batch, model, hidden_states) -> (output,
    metrics): on the last stage the loss and its metrics, elsewhere the hidden states and None.
    Returns the last stage's [(loss, metrics)] per micro-batch (empty elsewhere)."""
    state, m = pipeline.state, pipeline.m
    received, outgoing, saved, results = {}, {}, {}, []
    last_backward = {}  # chunk -> index of its last backward action: the one that reduces gradients
    for i, action in enumerate(pipeline.actions):
        if action.op == "B":
            last_backward[action.chunk] = i
    for i, action in enumerate(pipeline.actions):
        pipeline.post(pipeline.plan[i], outgoing, received)
        needed = input_message(action, state.pp_rank, state.pp, pipeline.vp)
        produced = output_message(action, state.pp_rank, state.pp, pipeline.vp)
        chunk = model_chunks[action.chunk]
        if action.op == "F":
            x = None
            if needed is not None:
                x = _take_local(received, outgoing, needed, state).requires_grad_()
            output, metrics = forward_step(batches[action.micro_batch], chunk, x)
            saved[(action.micro_batch, action.chunk)] = (x, output)
            if metrics is not None:  # the last stage: output is the loss
                results.append((output.detach(), metrics))
            else:
                outgoing[produced[1]] = output.detach()
        else:
            x, output = saved.pop((action.micro_batch, action.chunk))
            if action.chunk < len(grads):
                grads[action.chunk].set_last_micro_batch(i == last_backward[action.chunk])
            if needed is None:  # the last stage: the loss starts the backward
                scale_loss(output / m).backward()
            else:
                torch.autograd.backward(output, grad_tensors=_take_local(received, outgoing, needed, state))
            if action.chunk < len(grads):
                grads[action.chunk].accumulate()
            if produced is not None:
                outgoing[produced[1]] = x.grad
    pipeline.post(pipeline.plan[len(pipeline.actions)], outgoing, received)
    return results


def _take_local(received, outgoing, needed, state):
    """The input of an action: received from a peer, or (interleaved on one rank) made here."""
    peer, message = needed
    return (outgoing if peer == state.pp_rank else received).pop(message)


def forward_pipelining(forward_step, batches, model_chunks, pipeline):
    """Evaluation: every micro-batch through the virtual stages in order, no backward. Each transfer is
    between the stage that just ran and the next one, posted by both in the same global order."""
    state, vp = pipeline.state, pipeline.vp
    results = []
    for mb, batch in enumerate(batches):
        x = None
        for stage in range(state.pp * vp):
            rank, chunk = stage % state.pp, stage // state.pp
            if stage > 0 and rank != (stage - 1) % state.pp:  # the input comes from another rank
                if rank == state.pp_rank:
                    x = torch.empty(pipeline.shape, dtype=pipeline.dtype, device=state.device)
                    dist.recv(x, src=state.stage_rank((stage - 1) % state.pp), group=pipeline.group)
                elif (stage - 1) % state.pp == state.pp_rank:
                    dist.send(x, dst=state.stage_rank(rank), group=pipeline.group)
            if rank == state.pp_rank:
                with torch.no_grad():
                    x, metrics = forward_step(batch, model_chunks[chunk], x)
                if metrics is not None:
                    results.append((x, metrics))
    return results


if __name__ == "__main__":  # python -m minibert.parallel.pipeline --schedule 1f1b --pp 4 --micro-batches 8
    from minibert.parallel.schedules import main
    main(prog="python -m minibert.parallel.pipeline")
