"""Pipeline schedules as data: the order of forwards (F) and backwards (B) each pipeline rank runs.

The layers are cut into p stages, one per pipeline rank; a batch is cut into m micro-batches. Stage r can
run micro-batch i's forward only after stage r-1 has, and its backward only after stage r+1's backward.
A schedule is the order each rank takes its 2m actions in; everything else (sends, receives, the model)
follows from it. Three schedules (a cell is a forward; a backward takes two; . is idle time):

  afab (GPipe: all forwards, then all backwards, in micro-batch order 0..m-1), p=4, m=4:
    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  .  .  .  B0    B1    B2    B3
    stage 1 | .  F0 F1 F2 F3 .  .  .  .  .  .  B0    B1    B2    B3    .  .
    stage 2 | .  .  F0 F1 F2 F3 .  .  .  B0    B1    B2    B3    .  .  .  .
    stage 3 | .  .  .  F0 F1 F2 F3 B0    B1    B2    B3    .  .  .  .  .  .
  1f1b (Megatron's non-interleaved schedule), p=4, m=4:
    stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0    .  B1    .  B2    .  B3
    stage 1 | .  F0 F1 F2 .  .  .  .  B0    F3 B1    .  B2    .  B3    .  .
    stage 2 | .  .  F0 F1 .  .  B0    F2 B1    F3 B2    .  B3    .  .  .  .
    stage 3 | .  .  .  F0 B0    F1 B1    F2 B2    F3 B3    .  .  .  .  .  .

1F1B runs in three phases, named as in Megatron's forward_backward_pipelining_without_interleaving:
  "Run warmup forward passes":  num_warmup = min(p - r - 1, m) forwards (stage 0 fills the pipe),
  "Run 1F1B in steady state":   m - num_warmup pairs (one forward, then one backward),
  "Run cooldown backward passes": the num_warmup backwards left.
Both schedules idle for the same time, but 1F1B keeps at most p - r micro-batches' activations alive on
stage r (a forward whose backward has not run yet), where AFAB keeps all m.

The bubble (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters"):
with t_f, t_b the time of one micro-batch's forward and backward through one stage, the pipeline fills
and drains in (p-1)(t_f + t_b) of idle time per rank, against an ideal compute time of m(t_f + t_b):

    bubble = idle / ideal compute = (p-1) / m          share of the total time = (p-1) / (m + p - 1)

Interleaved 1F1B ("interleaved" below): each rank holds v model chunks, so the model is cut into p*v
virtual stages; chunk c of rank r is virtual stage c*p + r (Megatron's layout, `stage_of`):

    rank 0: [stage 0] [stage 4]        a micro-batch's forward goes 0 1 2 3 4 5 6 7:
    rank 1: [stage 1] [stage 5]        around the ranks twice (p=4, v=2), each chunk 1/v of a stage's
    rank 2: [stage 2] [stage 6]        layers, so each action takes 1/v of the time and the fill and
    rank 3: [stage 3] [stage 7]        drain shrink v times: bubble = (p-1) / (v m).

Micro-batches go in groups of p: the k-th forward of a rank runs chunk (k mod pv) // p on micro-batch
(k // pv) * p + k mod p (chunk 0 on micro-batches 0..p-1, chunk 1 on the same ones, ..., then the next
group), so m must be a multiple of p; the k-th backward runs chunk v-1 minus that. The warm-up is
num_warmup = (p - r - 1) * 2 + (v - 1) * p forwards, capped at m*v (then all forwards run first). p=2,
v=2, m=4 (a cell is a chunk's forward; letters name the chunk):
    stage 0 | F0a F1a F0b F1b F2a .   B0b     F3a B1b     F2b B0a     F3b B1a     .   B2b     .   B3b ...
    stage 1 | .   F0a F1a F0b B0b     F1b B1b     F2a B0a     F3a B1a     F2b B2b     F3b B3b     B2a ...
Stage 0 warms up with 4 forwards (both chunks of micro-batches 0 and 1), stage 1 with 2; the total is
27 cells instead of 24: the bubble is 3 chunk-cells = 1.5 stage forwards = (p-1)(t_f + t_b)/v.

What production does: Megatron makes the group size tunable (--microbatch-group-size-per-virtual-
pipeline-stage, default p, as here), overlaps the sends with compute, and has forward-only schedules for
evaluation. Older Megatron ran all forwards first whenever m == p; megatron-core 0.16.1 only caps the
warm-up at m*v, and so do we. Zero-bubble schedules (which split B into input and weight gradients) are
left out.

Sending and receiving (p2p_plan.py has the proof): the executor posts one torch.distributed.
batch_isend_irecv batch before its first action and one after each action, exactly as `exchanges` lists
them. Batch i (after action i-1) sends action i-1's output, and receives every message addressed to this
rank that the ideal timeline (`simulate` with forward 1, backward 2) sends at a time T with
e_i <= T < e_{i+1}, where e_i is when this rank posts batch i on that timeline (0 for batch 0). The plain
rule "send the output, receive the next action's input" deadlocks on NCCL for interleaved with m > p;
`check_communication` runs either rule with NCCL's matching semantics.
"""
from collections import namedtuple
from dataclasses import dataclass
from fractions import Fraction

from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error
from minibert.parallel import p2p_plan

Action = namedtuple("Action", ["op", "micro_batch", "chunk"])  # op "F" or "B"; chunk: 0..vp-1 on this rank
KINDS = ("afab", "1f1b", "interleaved")


def check_schedule_args(kind, pp_size, num_micro_batches, vp=1):
    """ValueError, naming the fix, for a schedule that cannot be built (the trainer makes it a user error)."""
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline schedule {kind!r}: use one of {', '.join(KINDS)}")
    if pp_size < 1 or num_micro_batches < 1:
        raise ValueError(f"pp_size={pp_size} and num_micro_batches={num_micro_batches} must both be >= 1")
    if kind != "interleaved" and vp != 1:
        raise ValueError(f"vp={vp} model chunks per rank need the interleaved schedule: use it, or vp=1")
    if kind == "interleaved":
        if vp < 2:
            raise ValueError(f"the interleaved schedule needs vp >= 2 model chunks per rank (got {vp}); "
                             "with one chunk use the 1f1b schedule")
        if num_micro_batches % pp_size:
            lower, upper = num_micro_batches // pp_size * pp_size, (num_micro_batches // pp_size + 1) * pp_size
            choices = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(f"the interleaved schedule takes micro-batches in groups of the pipeline size "
                             f"{pp_size}: {num_micro_batches} micro-batches is not a multiple of {pp_size}; use "
                             f"{choices} (global batch = micro-batches x micro batch size x data-parallel size)")


def stage_of(pp_rank, chunk, pp_size):
    """Virtual stage of model chunk `chunk` on rank `pp_rank`: chunk c of rank r is stage c*p + r."""
    return chunk * pp_size + pp_rank


def num_warmup_micro_batches(kind, pp_size, pp_rank, num_micro_batches, vp=1):
    """How many forwards rank `pp_rank` runs before its first backward (Megatron's num_warmup_microbatches)."""
    check_schedule_args(kind, pp_size, num_micro_batches, vp)
    if kind == "afab":
        return num_micro_batches
    if kind == "1f1b":
        return min(pp_size - pp_rank - 1, num_micro_batches)
    warmup = (pp_size - pp_rank - 1) * 2 + (vp - 1) * pp_size
    return min(warmup, num_micro_batches * vp)  # capped: then every forward runs before any backward


def _kth(k, op, kind, pp_size, vp):
    """The k-th forward (op "F") or backward ("B") of a rank, as an Action."""
    if kind != "interleaved":
        return Action(op, k, 0)
    group, within = divmod(k, pp_size * vp)  # groups of p micro-batches, each walked through every chunk
    chunk = within // pp_size                # Megatron's get_model_chunk_id
    return Action(op, group * pp_size + within % pp_size, chunk if op == "F" else vp - 1 - chunk)


def schedule(kind, pp_size, pp_rank, num_micro_batches, vp=1):
    """The list of Actions rank `pp_rank` runs, in order, for one batch of `num_micro_batches`."""
    check_schedule_args(kind, pp_size, num_micro_batches, vp)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is not a rank of a pipeline of {pp_size}")
    total = num_micro_batches * vp  # actions of each kind: every (micro-batch, chunk) once
    forwards = [_kth(k, "F", kind, pp_size, vp) for k in range(total)]
    backwards = [_kth(k, "B", kind, pp_size, vp) for k in range(total)]
    warmup = num_warmup_micro_batches(kind, pp_size, pp_rank, num_micro_batches, vp)
    actions = forwards[:warmup]                  # Run warmup forward passes
    for i in range(total - warmup):              # Run 1F1B in steady state
        actions += [forwards[warmup + i], backwards[i]]
    actions += backwards[total - warmup:]        # Run cooldown backward passes
    return actions


def layer_ranges(num_layers, pp_size, vp=1, first_stage_layers=None, last_stage_layers=None):
    """[pp_rank][chunk] -> the range of global layer indices that model chunk holds.

    Even split: every virtual stage gets num_layers / (p v) layers. Uneven split (Megatron's
    --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers): the first and/or last rank
    get the given counts, the ranks between share the rest evenly; with v chunks each rank's count is split
    evenly over its chunks. Layers are numbered along the virtual stages 0, 1, ..., p v - 1:
        8 layers, p=2, v=2:   rank 0: [0, 1] [4, 5]    rank 1: [2, 3] [6, 7]"""
    if pp_size < 1 or vp < 1 or num_layers < 1:
        raise ValueError(f"num_layers={num_layers}, pp_size={pp_size} and vp={vp} must all be >= 1")
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % (pp_size * vp):
            raise ValueError(f"{num_layers} layers cannot be split evenly over {pp_size} pipeline stages x {vp} "
                             f"chunks: use a multiple of {pp_size * vp} layers, or give the first/last stage "
                             "its own count (--decoder-first/last-pipeline-num-layers)")
        per_rank = [num_layers // pp_size] * pp_size
    else:
        per_rank = _uneven_layers_per_rank(num_layers, pp_size, first_stage_layers, last_stage_layers)
    for rank, count in enumerate(per_rank):
        if count % vp:
            raise ValueError(f"pipeline rank {rank} would hold {count} layers, which do not split over its "
                             f"{vp} model chunks: choose counts that are multiples of {vp}")
    ranges = [[None] * vp for _ in range(pp_size)]
    start = 0
    for stage in range(pp_size * vp):  # walk the model in order, one virtual stage after the other
        rank, chunk = stage % pp_size, stage // pp_size
        ranges[rank][chunk] = range(start, start + per_rank[rank] // vp)
        start += per_rank[rank] // vp
    assert start == num_layers, "every layer must be on exactly one virtual stage"  # the ranges tile [0, L)
    return ranges


def _uneven_layers_per_rank(num_layers, pp_size, first, last):
    """Layers per pipeline rank with a given first and/or last count; the middle ranks split the rest."""
    if pp_size < 2:
        raise ValueError("first/last stage layer counts (--decoder-first/last-pipeline-num-layers) need "
                         "pipeline parallelism: use pp_size >= 2, or drop them")
    given = {rank: n for rank, n in ((0, first), (pp_size - 1, last)) if n is not None}
    if any(n < 1 for n in given.values()):
        raise ValueError(f"first/last stage layer counts must be >= 1 (got {first}, {last})")
    middle_ranks = pp_size - len(given)
    middle_layers = num_layers - sum(given.values())
    if middle_layers < 0 or (middle_ranks == 0) != (middle_layers == 0) or \
            (middle_ranks and middle_layers % middle_ranks):
        raise ValueError(f"{num_layers} layers with first={first}, last={last} leave {middle_layers} layers for "
                         f"{middle_ranks} middle stages: choose counts so that the rest divides evenly "
                         "(at least one layer per stage)")
    return [given.get(rank, middle_layers // max(middle_ranks, 1)) for rank in range(pp_size)]


@dataclass
class Timeline:
    """Every rank's actions placed in time, in exact fractions (so the bubble compares exactly).

    entries[rank] = [(start, end, Action), ...] in the rank's order; total_time = when the last action
    ends; idle_time[rank] = total_time minus the rank's compute; forward_time and backward_time are a
    whole stage's (an interleaved chunk takes 1/vp of them); peak_in_flight[rank] = the most (micro-batch,
    chunk) forwards whose backward had not run yet: the activations the rank must hold (each a chunk's,
    1/vp of a stage's)."""
    kind: str
    pp_size: int
    num_micro_batches: int
    vp: int
    forward_time: Fraction
    backward_time: Fraction
    entries: list
    total_time: Fraction
    idle_time: list
    peak_in_flight: list

    @property
    def ideal_compute(self):
        """One rank's compute with no bubble: m (t_f + t_b)."""
        return self.num_micro_batches * (self.forward_time + self.backward_time)

    @property
    def bubble(self):
        """Measured idle / ideal compute (mean over ranks), as a Fraction."""
        return sum(self.idle_time) / len(self.idle_time) / self.ideal_compute


def _dependencies(action, pp_rank, pp_size, vp):
    """(op, micro_batch, virtual stage) of the actions that must finish before `action` can start."""
    stage, last = stage_of(pp_rank, action.chunk, pp_size), pp_size * vp - 1
    if action.op == "F":
        return [("F", action.micro_batch, stage - 1)] if stage > 0 else []
    needs = [("F", action.micro_batch, stage)]  # its own forward's activations
    return needs + ([("B", action.micro_batch, stage + 1)] if stage < last else [])


def simulate(kind, pp_size, num_micro_batches, vp=1, forward_time=1.0, backward_time=2.0):
    """Run every rank's action list, one action at a time in list order, as early as its inputs allow."""
    check_schedule_args(kind, pp_size, num_micro_batches, vp)
    if forward_time <= 0 or backward_time <= 0:
        raise ValueError(f"forward_time={forward_time} and backward_time={backward_time} must be > 0")
    actions = [schedule(kind, pp_size, rank, num_micro_batches, vp) for rank in range(pp_size)]
    t_f, t_b = Fraction(forward_time), Fraction(backward_time)
    duration = {"F": t_f / vp, "B": t_b / vp}  # a chunk is 1/vp of a stage's layers
    finished = {}                               # (op, micro_batch, stage) -> end time
    entries = [[] for _ in range(pp_size)]
    while any(len(entries[rank]) < len(actions[rank]) for rank in range(pp_size)):
        progress = False
        for rank in range(pp_size):
            while len(entries[rank]) < len(actions[rank]):
                action = actions[rank][len(entries[rank])]
                needs = _dependencies(action, rank, pp_size, vp)
                if any(need not in finished for need in needs):
                    break  # wait for another rank
                free = entries[rank][-1][1] if entries[rank] else Fraction(0)
                start = max([free] + [finished[need] for need in needs])
                end = start + duration[action.op]
                entries[rank].append((start, end, action))
                finished[(action.op, action.micro_batch, stage_of(rank, action.chunk, pp_size))] = end
                progress = True
        if not progress:  # a schedule bug: some rank waits for an action that can never run
            stuck = {rank: actions[rank][len(entries[rank])] for rank in range(pp_size)
                     if len(entries[rank]) < len(actions[rank])}
            raise RuntimeError(f"schedule {kind} cannot run: each rank's next action waits forever: {stuck}")
    total = max(rank_entries[-1][1] for rank_entries in entries)
    idle = [total - sum(end - start for start, end, _ in rank_entries) for rank_entries in entries]
    return Timeline(kind, pp_size, num_micro_batches, vp, t_f, t_b, entries, total, idle,
                    [_peak_in_flight(rank_actions) for rank_actions in actions])


def _peak_in_flight(actions):
    """Most forwards done whose backward is not yet done, along one rank's list."""
    in_flight = peak = 0
    for action in actions:
        in_flight += 1 if action.op == "F" else -1
        peak = max(peak, in_flight)
    return peak


def _bubble_formula(kind, pp_size, num_micro_batches, vp=1):
    """(exact value, the formula as text) of Megatron's bubble fraction."""
    check_schedule_args(kind, pp_size, num_micro_batches, vp)
    if kind == "interleaved":
        return Fraction(pp_size - 1, vp * num_micro_batches), "(p-1)/(v*m)"
    return Fraction(pp_size - 1, num_micro_batches), "(p-1)/m"


def bubble_fraction(kind, pp_size, num_micro_batches, vp=1):
    """Idle time over ideal compute time: (p-1)/m for afab and 1f1b, (p-1)/(v m) interleaved."""
    return float(_bubble_formula(kind, pp_size, num_micro_batches, vp)[0])


def draw(timeline, width=None):
    """The timeline as text, one row per stage (pipeline rank).

    One cell is one forward of a model chunk (a whole stage's forward when vp == 1); a backward is drawn
    as two cells (exact with the default times 1 and 2; other times are rounded to cells); '.' is an idle
    cell. With `width`, rows longer than that many characters wrap into blocks."""
    vp = timeline.vp
    cell_time = timeline.forward_time / vp
    labels = [p2p_plan.action_label(action, vp) for entries in timeline.entries for _, _, action in entries]
    cell = max(len(label) for label in labels) + 1
    rows = []
    for rank_entries in timeline.entries:
        cells = [".".ljust(cell)] * round(timeline.total_time / cell_time)
        for start, end, action in rank_entries:
            first, last = round(start / cell_time), max(round(end / cell_time), round(start / cell_time) + 1)
            cells[first] = p2p_plan.action_label(action, vp).ljust(cell)
            for i in range(first + 1, last):
                cells[i] = " " * cell  # the rest of a long action
        rows.append(cells)
    prefix = [f"stage {rank} | " for rank in range(timeline.pp_size)]
    per_line = len(rows[0]) if width is None else max(1, (width - len(prefix[0])) // cell)
    blocks = []
    for at in range(0, len(rows[0]), per_line):
        blocks.append("\n".join((prefix[rank] + "".join(rows[rank][at:at + per_line])).rstrip()
                                for rank in range(timeline.pp_size)))
    return "\n\n".join(blocks)


def exchanges(kind, pp_size, pp_rank, num_micro_batches, vp=1):
    """The batched sends/receives rank `pp_rank` posts: [0] before its first action, [i + 1] after action i.

    Each batch is a list of P2P(op, peer, message); post it with one batch_isend_irecv, in that order,
    and skip empty ones. The rule (derived and proven in p2p_plan.py) the pipeline executor follows. It
    depends only on the arguments: compute it once per run (it takes about a second for p=16, m=256, v=4)."""
    timeline = simulate(kind, pp_size, num_micro_batches, vp)
    return p2p_plan.plan_exchanges(timeline.entries, pp_size, vp)[pp_rank]


def check_communication(kind, pp_size, num_micro_batches, vp=1, rule="timeline"):
    """Run the executor's exchanges with NCCL's matching rules; raise CommunicationError on a deadlock or
    a message received out of order. rule="plain" checks the simpler just-in-time rule instead (it
    deadlocks for interleaved schedules with m > p: see p2p_plan.py)."""
    timeline = simulate(kind, pp_size, num_micro_batches, vp)
    actions = [[action for _, _, action in rank_entries] for rank_entries in timeline.entries]
    if rule == "timeline":
        plan = p2p_plan.plan_exchanges(timeline.entries, pp_size, vp)
    elif rule == "plain":
        plan = p2p_plan.plain_exchanges(actions, pp_size, vp)
    else:
        raise ValueError(f"unknown communication rule {rule!r}: use 'timeline' or 'plain'")
    p2p_plan.verify_exchanges(actions, plan, pp_size, vp)


@exit_on_usage_error
def main(argv=None, prog="python -m minibert.parallel.schedules"):
    parser = OneLineArgumentParser(prog=prog, description="Draw a pipeline schedule and measure its bubble.")
    parser.add_argument("--schedule", choices=KINDS, default="1f1b", help="the schedule (default 1f1b)")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--micro-batches", type=int, required=True, help="micro-batches per batch m")
    parser.add_argument("--vp", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    parser.add_argument("--width", type=int, default=None, help="wrap the drawing at this many characters")
    args = parser.parse_args(argv)
    vp = args.vp if args.vp is not None else (2 if args.schedule == "interleaved" else 1)
    p, m = args.pp, args.micro_batches
    try:
        timeline = simulate(args.schedule, p, m, vp)
        check_communication(args.schedule, p, m, vp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    formula, text = _bubble_formula(args.schedule, p, m, vp)
    unit = "a model chunk's forward (1/vp of a stage's)" if vp > 1 else "one forward"
    print(f"{args.schedule} schedule, pp {p}, {m} micro-batches" + (f", vp {vp}" if vp > 1 else "") +
          f": one cell = {unit}, a backward = 2 cells, '.' = idle")
    print(draw(timeline, args.width))
    print()
    share = sum(timeline.idle_time) / len(timeline.idle_time) / timeline.total_time
    share_text = "(p-1)/(v*m+p-1)" if vp > 1 else "(p-1)/(m+p-1)"
    share_formula = Fraction(p - 1, vp * m + p - 1)
    print(f"bubble: idle / ideal compute = {float(timeline.bubble):.4g} (formula {text} = "
          f"{p - 1}/{vp * m if vp > 1 else m} = {float(formula):.4g}); share of the total time = "
          f"{float(share):.4g} (formula {share_text} = {float(share_formula):.4g})")
    peaks = ", ".join(f"stage {rank}: {peak}" for rank, peak in enumerate(timeline.peak_in_flight))
    what = "(micro-batch, chunk) pairs in flight, each 1/vp of a stage's activations" if vp > 1 else \
        "micro-batches in flight (activations held)"
    print(f"peak {what}: {peaks}")
    print("p2p check: every rank's batched sends/receives match under NCCL's rules (no deadlock)")


if __name__ == "__main__":
    main()
