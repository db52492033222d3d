"""Schedules: how a step's micro-batches run forward and backward.

A schedule takes (forward_step, data_iterator, model chunks, number of micro-batches) and runs every
micro-batch's forward and backward on this rank, returning the per-micro-batch metrics of the stage that
has the losses. Gradients add up in the data-parallel buffers; only the last micro-batch's backward
reduces them (minibert.parallel.data_parallel), so the schedule tells the buffers which backward is last.

No pipelining (one stage), Megatron's forward_backward_no_pipelining:

    for k in range(m):  forward(k); backward(k)        one micro-batch's activations alive at a time
"""


def forward_backward_no_pipelining(forward_step, data_iterator, model_chunks, num_micro_batches, *,
                                   grads=(), scale_loss=lambda loss: loss, forward_only=False):
    """forward_step(batch_iterator, model) -> (loss, metrics). Each loss is divided by the number of
    micro-batches (the step's gradient is the mean of theirs) and scaled (fp16) before its backward.
    Returns the list of each micro-batch's (loss, metrics), losses detached."""
    (model,) = model_chunks
    results = []
    for k in range(num_micro_batches):
        loss, metrics = forward_step(data_iterator, model)
        if not forward_only:
            for g in grads:
                g.set_last_micro_batch(k == num_micro_batches - 1)
            scale_loss(loss / num_micro_batches).backward()
        results.append((loss.detach(), metrics))
    return results
