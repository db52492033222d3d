"""Which tensors each pipeline rank sends and receives after each action, so that NCCL never deadlocks.

The messages. A forward on virtual stage v sends its output activation to stage v+1 (on rank (v+1) mod p)
unless v is the last stage; a backward on stage v sends the gradient of its input to stage v-1 unless
v = 0. A Message is named by the stage that consumes it: Message("activation", 3, 5) is the input of
F(micro-batch 3) on stage 5; Message("gradient", 3, 4) is the output gradient B(micro-batch 3) on stage
4 needs. With p = 1 (interleaved on one rank) every message stays on its rank: no p2p op, the output is
simply the next chunk's input.

The executor exchanges them with torch.distributed.batch_isend_irecv, one batch (group) at a time. NCCL's
rules, which `verify_exchanges` simulates:
  - a batch completes only when every send and receive in it is matched by an op the peer has posted
    (in its current batch, or an earlier one); until then the rank waits, and posts nothing else;
  - messages from rank a to rank b are matched in order (no tags): the k-th send of a to b is the k-th
    receive b posts from a, so b must expect exactly that micro-batch and stage there.

The plain rule: "before the first action, receive its input; after each action, one batch that sends its
output and receives the next action's input". It is Megatron's non-interleaved rule (recv_forward,
send_forward_recv_backward, send_backward_recv_forward) and works for afab and 1f1b. For interleaved with
m > p it deadlocks. p=2, v=2, m=4 (`check_communication("interleaved", 2, 4, 2, rule="plain")`):
    rank 0 | F0a F1a F0b F1b F2a B0b F3a B1b ...      rank 1 | F0a F1a F0b B0b F1b B1b F2a B0a ...
    rank 0, after B0b: sends gradient(micro-batch 0 -> stage 1) to rank 1, receives nothing (F3a is on
            stage 0: no input);
    rank 1, after B1b: sends gradient(micro-batch 1 -> stage 2) to rank 0, receives F2a's activation.
Rank 1 receives rank 0's gradient only in its next batch (after F2a, for B0a), and rank 0 receives rank
1's only in its next batch (after F3a, for B1b): each batch waits for a batch of the other rank that
comes after it. The cause: a rank receives a message when it needs it, but its peer sends it when it
is made, in a batch that must complete before the peer goes on.

The rule that works ("receive when it is sent"): take the ideal timeline, `simulate(kind, p, m, v)` with
its default times (forward 1, backward 2 per stage). Rank r posts batch 0 at time e_0 = 0 and batch i+1 at
e_{i+1} = the end of its action i. Every message has a send time T = the end of the action producing it.

    batch i of rank r = [send the output of action i-1 (none for batch 0)]
                      + [receive every message addressed to r with e_i <= T < e_{i+1}]   (last batch: e_i <= T)
    receives from one peer in order of T; empty batches are skipped; inputs are kept, keyed by Message,
    until their action runs.

Why it cannot deadlock. Give batch i the number c_i = max(e_i, the T of its receives); c_i < e_{i+1}.
If some batch never completed, take one with the smallest c. It was posted: the rank's batch before it
has c < e_i <= c_i, so that one completed. Each of its receives is matched: the sender has posted the
batch holding the send (posted at T; the sender's batch before has c < T <= c_i, so it completed). Its
send is matched: the receiver has posted the batch holding the receive (posted at some e <= e_i, after
a batch with c < e). So all its ops match and it completes: a contradiction. FIFO order holds: sends
from a to b leave in order of T, and b posts their receives in order of T. Inputs arrive in time: the
action consuming a message starts at >= T, so not before the batch receiving it. Only the order of the
times is used, so the plan is right however long the actions really take.

For afab and 1f1b the plain rule passes too (`check_communication(..., rule="plain")`); the timeline
rule differs from it only by receiving some messages one batch earlier (a message sent exactly when the
batch is posted, or while the receiver is still busy). The executor uses the timeline rule for all three
schedules: one code path.

Megatron's interleaved loop rests on the same idea: one exchange per (forward, backward) pair in which a rank
receives what its peer sends in that same iteration (recv_tensor_from_previous_stage, with its
p - 1 offset for the first and last stage), into per-chunk queues, rather than the input it needs next.

The executor (pipeline.py), per rank, with actions = schedule(kind, p, rank, m, v):
    plan = exchanges(kind, p, rank, m, v)    # len(actions) + 1 batches of P2P(op, peer, message)
    received, to_send = {}, {}               # Message -> tensor
    for i in range(len(actions) + 1):
        ops = [isend(to_send.pop(x.message), x.peer) if x.op == "send" else irecv(new buffer, x.peer)
               for x in plan[i]]             # in the plan's order; skip the call when plan[i] is empty
        wait for all of batch_isend_irecv(ops); put each received buffer in received[x.message]
        if i < len(actions): run actions[i] on received.pop(input_message(...)) (if it has one) and
                             put its output in to_send[output_message(...)] (if it has one)
(NCCL's first p2p call must be one every rank of the pipeline group joins, as torch's batch_isend_irecv
documentation requires: run a collective, e.g. a barrier, on the pipeline group first.)
"""
from bisect import bisect_right
from collections import defaultdict, namedtuple

Message = namedtuple("Message", ["kind", "micro_batch", "stage"])  # "activation"/"gradient" into `stage`
P2P = namedtuple("P2P", ["op", "peer", "message"])                  # op "send" or "recv"; peer: a pp rank


class CommunicationError(RuntimeError):
    """A deadlock, or a message received where another was expected: a bug in the exchange plan."""


def input_message(action, pp_rank, pp_size, vp):
    """(peer rank, Message) an action needs from another stage, or None (stage 0's F, the last one's B)."""
    stage, last = action.chunk * pp_size + pp_rank, pp_size * vp - 1  # stage_of(pp_rank, chunk)
    if action.op == "F":
        return None if stage == 0 else ((stage - 1) % pp_size, Message("activation", action.micro_batch, stage))
    return None if stage == last else ((stage + 1) % pp_size, Message("gradient", action.micro_batch, stage))


def output_message(action, pp_rank, pp_size, vp):
    """(peer rank, Message) an action's output goes to, or None (the last stage's F, stage 0's B)."""
    stage, last = action.chunk * pp_size + pp_rank, pp_size * vp - 1
    if action.op == "F":
        return None if stage == last else ((stage + 1) % pp_size, Message("activation", action.micro_batch,
                                                                           stage + 1))
    return None if stage == 0 else ((stage - 1) % pp_size, Message("gradient", action.micro_batch, stage - 1))


def plain_exchanges(actions, pp_size, vp):
    """[rank][i] -> batch i under the plain rule: send action i-1's output, receive action i's input."""
    plan = []
    for rank, rank_actions in enumerate(actions):
        batches = [[] for _ in range(len(rank_actions) + 1)]
        for i, action in enumerate(rank_actions):
            needed, produced = input_message(action, rank, pp_size, vp), output_message(action, rank, pp_size, vp)
            if needed and needed[0] != rank:
                batches[i].append(P2P("recv", *needed))
            if produced and produced[0] != rank:
                batches[i + 1].insert(0, P2P("send", *produced))
        plan.append(batches)
    return plan


def plan_exchanges(entries, pp_size, vp):
    """[rank][i] -> batch i under the timeline rule, from a Timeline's entries [rank] -> (start, end, action)."""
    plan = [[[] for _ in range(len(rank_entries) + 1)] for rank_entries in entries]
    incoming = [[] for _ in range(pp_size)]  # [receiver] -> (send time, sender, message)
    for rank, rank_entries in enumerate(entries):
        for i, (_, end, action) in enumerate(rank_entries):
            produced = output_message(action, rank, pp_size, vp)
            if produced and produced[0] != rank:
                plan[rank][i + 1].append(P2P("send", *produced))
                incoming[produced[0]].append((end, rank, produced[1]))
    for rank, rank_entries in enumerate(entries):
        posted_at = [0] + [end for _, end, _ in rank_entries]  # when each batch is posted
        for sent_at, sender, message in sorted(incoming[rank]):
            plan[rank][bisect_right(posted_at, sent_at) - 1].append(P2P("recv", sender, message))
    return plan


def _describe(message):
    return f"{message.kind}(micro-batch {message.micro_batch} -> stage {message.stage})"


def action_label(action, vp):
    """F3, B0; with chunks F3a, B0b (a = chunk 0), as schedules.draw writes them."""
    return f"{action.op}{action.micro_batch}" + (chr(ord("a") + action.chunk) if vp > 1 else "")


def _where(rank_actions, i, vp):
    """Where batch i of a rank is: 'before its first action', 'after F2b'."""
    return "before its first action" if i == 0 else f"after {action_label(rank_actions[i - 1], vp)}"


def verify_exchanges(actions, plan, pp_size, vp):
    """Run every rank's [batch 0, action 0, batch 1, ...] with NCCL's matching rules; raise on any problem."""
    sent, expected = defaultdict(list), defaultdict(list)  # (src, dst) -> messages posted, in order
    inbox = [set() for _ in range(pp_size)]   # received (or kept on the rank) and not yet used
    outbox = [set() for _ in range(pp_size)]  # produced and not yet sent
    step = [0] * pp_size                      # 2i: batch i, 2i + 1: action i
    current = [None] * pp_size                # the posted, incomplete batch: (op, channel, index, message)

    def post(rank, i):
        ops = []
        for op in plan[rank][i]:
            channel = (rank, op.peer) if op.op == "send" else (op.peer, rank)
            if op.op == "send":
                if op.message not in outbox[rank]:
                    raise CommunicationError(f"rank {rank} sends {_describe(op.message)} "
                                             f"{_where(actions[rank], i, vp)}, which it has not produced")
                outbox[rank].remove(op.message)
            mine, theirs = (sent, expected) if op.op == "send" else (expected, sent)
            ops.append((op.op, channel, len(mine[channel]), op.message))
            mine[channel].append(op.message)
            k = len(mine[channel]) - 1
            if k < len(theirs[channel]) and sent[channel][k] != expected[channel][k]:
                raise CommunicationError(
                    f"out of order on rank {channel[0]} -> rank {channel[1]}: message {k + 1} sent is "
                    f"{_describe(sent[channel][k])}, but rank {channel[1]} receives it as "
                    f"{_describe(expected[channel][k])}")
        return ops

    def waiting(ops):
        return [(op, channel, k, message) for op, channel, k, message in ops
                if len((expected if op == "send" else sent)[channel]) <= k]

    while not all(step[rank] == 2 * len(actions[rank]) + 1 for rank in range(pp_size)):
        progress = False
        for rank in range(pp_size):
            while step[rank] < 2 * len(actions[rank]) + 1:
                i, is_action = divmod(step[rank], 2)
                if is_action:
                    action = actions[rank][i]
                    needed = input_message(action, rank, pp_size, vp)
                    if needed and needed[1] not in inbox[rank]:
                        raise CommunicationError(f"rank {rank} reaches {action_label(action, vp)} "
                                                 f"before receiving its input {_describe(needed[1])}")
                    if needed:
                        inbox[rank].remove(needed[1])
                    produced = output_message(action, rank, pp_size, vp)
                    if produced:
                        (inbox if produced[0] == rank else outbox)[rank].add(produced[1])
                else:
                    if current[rank] is None:
                        current[rank] = post(rank, i)
                    if waiting(current[rank]):
                        break
                    inbox[rank].update(message for op, _, _, message in current[rank] if op == "recv")
                    current[rank] = None
                step[rank] += 1
                progress = True
        if not progress:
            raise CommunicationError("deadlock: " + "; ".join(
                f"rank {rank} {_where(actions[rank], step[rank] // 2, vp)} waits to " + ", ".join(
                    f"{op} {_describe(message)} {'to' if op == 'send' else 'from'} rank "
                    f"{channel[1] if op == 'send' else channel[0]} (message {k + 1} on rank {channel[0]} -> rank "
                    f"{channel[1]}, where rank {channel[1] if op == 'send' else channel[0]} has posted only "
                    f"{len((expected if op == 'send' else sent)[channel])})"
                    for op, channel, k, message in waiting(ops))
                for rank, ops in enumerate(current) if ops is not None))
    for rank in range(pp_size):
        if outbox[rank] or inbox[rank]:
            raise CommunicationError(f"rank {rank} ends with outputs never sent {sorted(outbox[rank])} or "
                                     f"inputs never used {sorted(inbox[rank])}")
