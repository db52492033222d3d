"""Pipeline schedules (minibert/parallel/schedules.py) and their exchange plan (p2p_plan.py).

Every schedule is checked as data: each (micro-batch, chunk) runs once forward and once backward on every
rank, the forward first; the simulated timeline respects the stage-to-stage dependencies; the bubble it
measures is exactly Megatron's formula; 1F1B keeps at most p - r micro-batches in flight on stage r; and
the ranks' batched sends and receives go through under NCCL's matching rules. The orders and the layer
split are compared with megatron-core's own functions where it is installed."""
import itertools
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest

from minibert.parallel import p2p_plan
from minibert.parallel.p2p_plan import P2P, CommunicationError, Message
from minibert.parallel.schedules import (
    Action,
    bubble_fraction,
    check_communication,
    draw,
    exchanges,
    layer_ranges,
    main,
    num_warmup_micro_batches,
    schedule,
    simulate,
    stage_of,
)


def configs():
    """(kind, p, m, vp): p in 1..4; m below, at and above p; interleaved with vp 2, 3 and m % p == 0."""
    for p in range(1, 5):
        for m in sorted({1, 2, 3, p, p + 1, 2 * p, 8}):
            yield "afab", p, m, 1
            yield "1f1b", p, m, 1
        for vp, groups in itertools.product((2, 3), (1, 2, 3)):
            yield "interleaved", p, groups * p, vp


CONFIGS = list(configs())
ids = [f"{kind}-p{p}-m{m}-vp{vp}" for kind, p, m, vp in CONFIGS]


@pytest.mark.parametrize("kind,p,m,vp", CONFIGS, ids=ids)
def test_every_micro_batch_runs_once_forward_then_backward(kind, p, m, vp):
    for rank in range(p):
        actions = schedule(kind, p, rank, m, vp)
        pairs = {(mb, chunk) for mb in range(m) for chunk in range(vp)}
        forwards = [(a.micro_batch, a.chunk) for a in actions if a.op == "F"]
        backwards = [(a.micro_batch, a.chunk) for a in actions if a.op == "B"]
        assert sorted(forwards) == sorted(pairs) and sorted(backwards) == sorted(pairs)
        position = {(a.op, a.micro_batch, a.chunk): i for i, a in enumerate(actions)}
        assert all(position[("F", mb, c)] < position[("B", mb, c)] for mb, c in pairs)


@pytest.mark.parametrize("kind,p,m,vp", CONFIGS, ids=ids)
def test_timeline_respects_the_dependencies_between_stages(kind, p, m, vp):
    timeline = simulate(kind, p, m, vp)
    start, end = {}, {}
    for rank, entries in enumerate(timeline.entries):
        assert [a for _, _, a in entries] == schedule(kind, p, rank, m, vp)  # each rank in its list order
        for (s, e, a), (s_next, _, _) in zip(entries, entries[1:]):
            assert e <= s_next                                                 # one action at a time
        for s, e, a in entries:
            key = (a.op, a.micro_batch, stage_of(rank, a.chunk, p))
            start[key], end[key] = s, e
            assert e - s == (timeline.forward_time if a.op == "F" else timeline.backward_time) / vp
    last = p * vp - 1
    for mb, stage in itertools.product(range(m), range(p * vp)):
        if stage > 0:
            assert start[("F", mb, stage)] >= end[("F", mb, stage - 1)]
        if stage < last:
            assert start[("B", mb, stage)] >= end[("B", mb, stage + 1)]
        assert start[("B", mb, stage)] >= end[("F", mb, stage)]


@pytest.mark.parametrize("kind,p,m,vp", CONFIGS, ids=ids)
@pytest.mark.parametrize("times", [(1, 2), (1, 1), (1, 3)], ids=["F1B2", "F1B1", "F1B3"])
def test_measured_bubble_is_exactly_the_formula(kind, p, m, vp, times):
    timeline = simulate(kind, p, m, vp, *times)
    formula = Fraction(p - 1, m * vp)  # (p-1)/m, or (p-1)/(v m) interleaved
    assert timeline.bubble == formula
    assert bubble_fraction(kind, p, m, vp) == float(formula)
    assert all(idle == timeline.idle_time[0] for idle in timeline.idle_time)  # every rank idles as long
    t_f, t_b = map(Fraction, times)
    assert timeline.total_time == (m + Fraction(p - 1, vp)) * (t_f + t_b)  # fill + m steps + drain


@pytest.mark.parametrize("kind,p,m,vp", CONFIGS, ids=ids)
def test_micro_batches_in_flight(kind, p, m, vp):
    peaks = simulate(kind, p, m, vp).peak_in_flight
    for rank, peak in enumerate(peaks):
        if kind == "afab":
            assert peak == m                       # all forwards before any backward
        elif kind == "1f1b":
            assert peak == min(p - rank, m) <= p   # Megatron's point: at most p - r on stage r
        else:
            warmup = num_warmup_micro_batches(kind, p, rank, m, vp)
            assert peak == (warmup if warmup == m * vp else warmup + 1)


def test_phases_and_warmup_counts():
    # 1F1B, p=4, m=8: stage 1 warms up with 2 forwards, then alternates, then cools down with 2 backwards
    ops = "".join(a.op for a in schedule("1f1b", 4, 1, 8))
    assert ops == "FF" + "FB" * 6 + "BB"
    assert [num_warmup_micro_batches("1f1b", 4, r, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_micro_batches("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 1, 0]  # capped at m
    # interleaved: (p - r - 1) * 2 + (v - 1) * p, capped at m v (then all forwards come first)
    assert [num_warmup_micro_batches("interleaved", 4, r, 8, 2) for r in range(4)] == [10, 8, 6, 4]
    assert [num_warmup_micro_batches("interleaved", 4, r, 4, 2) for r in range(4)] == [8, 8, 6, 4]
    assert num_warmup_micro_batches("afab", 4, 0, 8) == 8
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))


def test_interleaved_order_takes_micro_batches_in_groups_of_p():
    actions = schedule("interleaved", 2, 0, 4, 2)
    labels = " ".join(f"{a.op}{a.micro_batch}{'ab'[a.chunk]}" for a in actions)
    assert labels == "F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a B2b B3b B2a B3a"
    assert actions[0] == Action("F", 0, 0)


def megatron_order(p, rank, m, vp):
    """The order megatron-core's interleaved / non-interleaved loops run, from its own table functions."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    communicator = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: p, rank=lambda: rank),
                                   virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(m, vp, p, p2p_communicator=communicator)
    table = schedules.get_schedule_table(m, vp, p)  # virtual micro-batch id -> (micro_batch, chunk)
    forward = [Action("F", mb, c) for mb, c in table]
    backward = [Action("B", mb, vp - 1 - c) for mb, c in table]  # get_model_chunk_id(k, forward=False)
    if vp == 1 and p > 1:
        warmup, remaining = min(p - rank - 1, m), m - min(p - rank - 1, m)  # ..._without_interleaving
    order = forward[:warmup]
    for k in range(remaining):
        order += [forward[k + warmup], backward[k]]
    return order + backward[remaining:total]


@pytest.mark.parametrize("p,m,vp", [(2, 2, 1), (4, 8, 1), (4, 3, 1), (2, 4, 2), (4, 8, 2), (4, 4, 2),
                                    (3, 9, 3), (4, 12, 3)])
def test_orders_match_megatron_core(p, m, vp):
    kind = "interleaved" if vp > 1 else "1f1b"
    for rank in range(p):
        assert schedule(kind, p, rank, m, vp) == megatron_order(p, rank, m, vp)


@pytest.mark.parametrize("kind,p,m,vp", CONFIGS, ids=ids)
def test_exchanges_pass_the_nccl_check(kind, p, m, vp):
    check_communication(kind, p, m, vp)  # raises CommunicationError on a deadlock or a mismatch
    plans = [exchanges(kind, p, rank, m, vp) for rank in range(p)]
    assert all(len(plan) == 2 * m * vp + 1 for plan in plans)
    if kind != "interleaved":
        check_communication(kind, p, m, vp, rule="plain")  # Megatron's non-interleaved rule works too


def test_plain_rule_deadlocks_for_interleaved_with_more_micro_batches_than_stages():
    with pytest.raises(CommunicationError, match="deadlock: rank 0 after B0b waits to send gradient"):
        check_communication("interleaved", 2, 4, 2, rule="plain")
    for p, vp in ((2, 3), (3, 2), (4, 2)):
        check_communication("interleaved", p, p, vp, rule="plain")  # m == p: it happens to work
        with pytest.raises(CommunicationError, match="deadlock"):
            check_communication("interleaved", p, 2 * p, vp, rule="plain")


def test_the_checker_catches_out_of_order_and_late_receives():
    timeline = simulate("1f1b", 2, 3)
    actions = [[a for _, _, a in entries] for entries in timeline.entries]
    plan = p2p_plan.plan_exchanges(timeline.entries, 2, 1)
    p2p_plan.verify_exchanges(actions, plan, 2, 1)
    # rank 1 expects micro-batch 1's activation where rank 0 sends micro-batch 0's
    swapped = [list(map(list, rank_plan)) for rank_plan in plan]
    first = next(i for i, batch in enumerate(swapped[1]) if batch)
    swapped[1][first] = [P2P("recv", 0, Message("activation", 1, 1))]
    with pytest.raises(CommunicationError, match="out of order on rank 0 -> rank 1: message 1 sent is "
                                                 r"activation\(micro-batch 0 -> stage 1\)"):
        p2p_plan.verify_exchanges(actions, swapped, 2, 1)
    # rank 1 never receives its first input: rank 0's send waits forever
    dropped = [list(map(list, rank_plan)) for rank_plan in plan]
    dropped[1][first] = []
    with pytest.raises(CommunicationError, match="before receiving its input"):
        p2p_plan.verify_exchanges(actions, dropped, 2, 1)


def test_timeline_rule_receives_no_later_than_the_plain_rule():
    for kind, p, m, vp in CONFIGS:
        timeline = simulate(kind, p, m, vp)
        actions = [[a for _, _, a in entries] for entries in timeline.entries]
        plain = p2p_plan.plain_exchanges(actions, p, vp)
        planned = p2p_plan.plan_exchanges(timeline.entries, p, vp)
        for rank in range(p):
            def where(plan, op):
                return {x.message: i for i, batch in enumerate(plan[rank]) for x in batch if x.op == op}
            assert where(planned, "send") == where(plain, "send")
            early, late = where(planned, "recv"), where(plain, "recv")
            assert early.keys() == late.keys() and all(early[x] <= late[x] for x in early)


def test_layer_ranges_even_split():
    assert layer_ranges(8, 2, 2) == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert layer_ranges(8, 4) == [[range(0, 2)], [range(2, 4)], [range(4, 6)], [range(6, 8)]]
    for num_layers, p, vp in [(24, 4, 1), (24, 4, 3), (24, 3, 2), (7, 1, 1), (12, 1, 4)]:
        ranges = layer_ranges(num_layers, p, vp)
        assert sorted(i for rank in ranges for r in rank for i in r) == list(range(num_layers))
        assert all(len(r) == num_layers // (p * vp) for rank in ranges for r in rank)
        order = [ranges[stage % p][stage // p] for stage in range(p * vp)]  # along the virtual stages
        assert [i for r in order for i in r] == list(range(num_layers))


def test_layer_ranges_uneven_split():
    assert layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=3) == \
        [[range(0, 1)], [range(1, 4)], [range(4, 7)], [range(7, 10)]]
    assert layer_ranges(10, 3, first_stage_layers=2) == [[range(0, 2)], [range(2, 6)], [range(6, 10)]]
    assert layer_ranges(5, 2, first_stage_layers=2, last_stage_layers=3) == [[range(0, 2)], [range(2, 5)]]
    ranges = layer_ranges(16, 4, 2, first_stage_layers=2, last_stage_layers=2)
    assert [len(r) for rank in ranges for r in rank] == [1, 1, 3, 3, 3, 3, 1, 1]
    assert sorted(i for rank in ranges for r in rank for i in r) == list(range(16))


@pytest.mark.parametrize("args,match", [
    ((10, 4), "use a multiple of 4 layers"),
    ((8, 2, 3), "use a multiple of 6 layers"),
    ((10, 4, 1, 2, None), "leave 8 layers for 3 middle stages"),
    ((10, 4, 1, 1, 2), "leave 7 layers for 2 middle stages"),
    ((5, 2, 1, 1, 1), "leave 3 layers for 0 middle stages"),
    ((4, 3, 1, 2, 2), "leave 0 layers for 1 middle stages"),
    ((8, 1, 1, 4, None), "need pipeline parallelism"),
    ((12, 3, 2, 3, 3), "rank 0 would hold 3 layers"),
    ((8, 2, 1, 0, None), "must be >= 1"),
])
def test_layer_ranges_refuse_splits_that_do_not_divide(args, match):
    with pytest.raises(ValueError, match=match):
        layer_ranges(*args)


@pytest.mark.filterwarnings("ignore:full scope is deprecated")  # megatron-core's own config default
@pytest.mark.parametrize("num_layers,p,vp,first,last", [
    (8, 4, 1, None, None), (16, 4, 2, None, None), (10, 4, 1, 1, 3), (10, 3, 1, 2, None),
    (16, 4, 2, 2, 2), (14, 4, 2, None, 2)])
def test_layer_ranges_match_megatron_core(num_layers, p, vp, first, last):
    torch = pytest.importorskip("torch")
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=p, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    ranges = layer_ranges(num_layers, p, vp, first, last)
    for rank, chunk in itertools.product(range(p), range(vp)):
        vp_stage = chunk if vp > 1 else None
        start = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
        assert ranges[rank][chunk] == range(start, start + count), (rank, chunk)


@pytest.mark.parametrize("args,match", [
    (("zb", 2, 4), "unknown pipeline schedule 'zb'"),
    (("1f1b", 2, 4, 2), "need the interleaved schedule"),
    (("interleaved", 2, 4, 1), "needs vp >= 2"),
    (("interleaved", 4, 6, 2), "not a multiple of 4; use 4 or 8"),
    (("interleaved", 4, 3, 2), "not a multiple of 4; use 4 "),
    (("afab", 0, 4), "must both be >= 1"),
])
def test_bad_schedules_raise_value_errors_naming_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        schedule(args[0], args[1], 0, *args[2:])
    with pytest.raises(ValueError, match=match):
        simulate(*args)


def test_draw_scales_forward_to_one_cell_and_backward_to_two():
    text = draw(simulate("1f1b", 4, 8))
    rows = text.splitlines()
    assert len(rows) == 4 and rows[0].startswith("stage 0 | F0 F1 F2 F3 .  .  .  .  .  .  B0    F4 B1")
    assert rows[3].startswith("stage 3 | .  .  .  F0 B0    F1 B1")
    assert len(rows[3]) == len("stage 3 | ") + 3 * 33 - 2  # (m + p - 1) * 3 = 33 cells of 3 characters
    interleaved = draw(simulate("interleaved", 2, 4, 2))
    assert interleaved.startswith("stage 0 | F0a F1a F0b F1b F2a .   B0b     F3a")
    wrapped = draw(simulate("interleaved", 4, 8, 2), width=60)
    assert all(len(line) <= 60 for line in wrapped.splitlines())
    assert wrapped.count("stage 0 | ") > 1


def test_cli_draws_and_prints_the_bubble(capsys):
    main(["--schedule", "1f1b", "--pp", "4", "--micro-batches", "8"])
    out = capsys.readouterr().out
    assert "stage 3 | .  .  .  F0 B0" in out
    assert "bubble: idle / ideal compute = 0.375 (formula (p-1)/m = 3/8 = 0.375)" in out
    assert "share of the total time = 0.2727 (formula (p-1)/(m+p-1) = 0.2727)" in out
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in out
    main(["--schedule", "interleaved", "--pp", "4", "--micro-batches", "8", "--vp", "2"])
    out = capsys.readouterr().out
    assert "bubble: idle / ideal compute = 0.1875 (formula (p-1)/(v*m) = 3/16 = 0.1875)" in out
    assert "F0a" in out and "stage 0: 11" in out


@pytest.mark.parametrize("argv,match", [
    (["--schedule", "interleaved", "--pp", "4", "--micro-batches", "6"], "not a multiple of 4"),
    (["--schedule", "1f1b", "--pp", "4", "--micro-batches", "6", "--vp", "2"], "need the interleaved"),
    (["--schedule", "gpipe", "--pp", "4", "--micro-batches", "6"], "invalid choice"),
    (["--pp", "0", "--micro-batches", "6"], "must both be >= 1"),
    (["--pp", "2"], "required: --micro-batches"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err


def test_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "minibert.parallel.schedules", "--schedule", "afab",
                           "--pp", "2", "--micro-batches", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "bubble: idle / ideal compute = 0.3333 (formula (p-1)/m = 1/3 = 0.3333)" in done.stdout
    done = subprocess.run([sys.executable, "-m", "minibert.parallel.schedules", "--pp", "x",
                           "--micro-batches", "3"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
