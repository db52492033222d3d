"""The numbers chapters/06-pipeline-parallel.md quotes that can be recomputed without launching a run:
the parameters of each pipeline stage of the chapter's small model (and the word-embedding copy that
makes their sum larger than the model), the two copies' equal initial values, the share of the model
FLOPs each stage computes, the bubble and the micro-batches in flight of the schedules the chapter
draws and of its exercises, BERT-large's stages (parameters, activation memory per stage with chapter 7's
assumptions, the work per stage of the even and the uneven split), the exchange figure's count of sends
that wait, and how long the exchange plan makes each schedule take when every batch waits for its
matches (section 7 and Appendix A). Stages are built on the meta device (shapes only) except where
values are compared."""
from fractions import Fraction

import torch

from minibert.config import Config
from minibert.model.bert import BertModel
from minibert.parallel import p2p_plan
from minibert.parallel.schedules import layer_ranges, simulate
from minibert.tools import plan_memory, plan_time
from minibert.validate import validate

MiB, GiB = 2 ** 20, 2 ** 30

PP1, STAGE0, STAGE1 = 2_201_346, 2_062_080, 2_097_154  # the "number of parameters" lines of the runs
WORD_TABLE = 30_592 * 64  # padded vocab x hidden


def chapter_config(pp=1, **overrides):
    """The chapter's MODEL flags: 4 layers, hidden 64, 4 heads, sequences of 64, micro 2, global 8."""
    cfg = Config(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                 micro_batch_size=2, global_batch_size=8, train_iters=20, lr=1e-3,
                 pipeline_model_parallel_size=pp, **overrides)
    return validate(cfg, world_size=pp, warn=None)


def stage_parameters(cfg, pp, init=False):
    """[number of parameters of each stage], as build.build_model cuts the model (one chunk per rank)."""
    ranges = layer_ranges(cfg.num_layers, pp, 1, cfg.decoder_first_pipeline_num_layers,
                          cfg.decoder_last_pipeline_num_layers)
    counts = []
    for rank in range(pp):
        with torch.device("meta"):
            stage = BertModel(cfg, layer_numbers=ranges[rank][0], pre_process=rank == 0,
                              post_process=rank == pp - 1, init=False)
        counts.append(sum(p.numel() for p in stage.parameters()))
    return counts


def test_stage_parameters_and_the_word_table_copy():
    assert stage_parameters(chapter_config(), 1) == [PP1]
    assert stage_parameters(chapter_config(2), 2) == [STAGE0, STAGE1]
    assert STAGE0 + STAGE1 - PP1 == WORD_TABLE == 1_957_888  # the last stage's copy of the tied table
    assert stage_parameters(chapter_config(2, decoder_last_pipeline_num_layers=1), 2) == [2_112_064, 2_047_170]
    assert stage_parameters(chapter_config(4), 4) == [2_012_096, 49_984, 49_984, 2_047_170]


def test_the_copy_starts_equal_to_the_first_stage_table():
    cfg = chapter_config(2)
    first = BertModel(cfg, layer_numbers=range(2), pre_process=True, post_process=False)
    last = BertModel(cfg, layer_numbers=range(2, 4), pre_process=False, post_process=True)
    name = "embedding.word_embeddings.weight"
    assert torch.equal(dict(first.named_parameters())[name], dict(last.named_parameters())[name])
    assert sorted(k for k in last.state_dict() if k.startswith("layers.") and k.endswith("input_layernorm.weight")) \
        == ["layers.2.input_layernorm.weight", "layers.3.input_layernorm.weight"]


def test_flops_per_token_by_stage():
    """72 l h^2 + 12 l s h per token in the layers, 6 (h V + h^2) in the LM head (docs/measuring.md)."""
    h, s, vocab = 64, 64, 30_592
    per_layer = 72 * h * h + 12 * s * h
    head = 6 * (h * vocab + h * h)
    total = 4 * per_layer + head
    assert (per_layer, head, total) == (344_064, 11_771_904, 13_148_160)
    assert round(head / total, 3) == 0.895
    assert round((2 * per_layer + head) / total, 3) == 0.948   # stage 1 of PP 2: layers 2, 3 and the head
    assert round((per_layer + head) / total, 3) == 0.921       # with --decoder-last-pipeline-num-layers 1
    assert round(head / per_layer) == 34                       # the head costs as much as 34 such layers
    h, s = 1024, 512                                           # BERT-large: about 2.4 layers
    assert round(6 * (h * vocab + h * h) / (72 * h * h + 12 * s * h), 1) == 2.4


def test_bubbles_and_micro_batches_in_flight_quoted():
    afab, one_f_one_b = simulate("afab", 4, 8), simulate("1f1b", 4, 8)
    interleaved = simulate("interleaved", 4, 8, 2)
    assert afab.bubble == one_f_one_b.bubble == Fraction(3, 8) and interleaved.bubble == Fraction(3, 16)
    assert afab.total_time == one_f_one_b.total_time == 33 and interleaved.total_time == Fraction(57, 2)
    assert afab.peak_in_flight == [8, 8, 8, 8] and one_f_one_b.peak_in_flight == [4, 3, 2, 1]
    assert interleaved.peak_in_flight == [11, 9, 7, 5]  # chunks: 5.5, 4.5, 3.5, 2.5 stages' worth
    m16 = simulate("1f1b", 4, 16)
    assert m16.bubble == Fraction(3, 16) and m16.peak_in_flight == [4, 3, 2, 1]
    assert simulate("1f1b", 2, 4).bubble == Fraction(1, 4)  # the chapter's PP 2 runs: m = 4
    assert [simulate("interleaved", 4, 8, v).peak_in_flight[0] for v in (2, 3, 4)] == [11, 15, 19]


def bert_large(**overrides):
    """BERT-large on 4 stages, micro-batches of 4 sequences of 512, bf16, dropout on (chapter 7's assumptions)."""
    cfg = Config(preset="340m", pipeline_model_parallel_size=4, micro_batch_size=4, global_batch_size=32,
                 train_iters=1, lr=1e-4, bf16=True, **overrides)
    return validate(cfg, world_size=4, warn=None)


def test_bert_large_stages():
    cfg = bert_large()
    assert [round(s.parameters / 1e6, 1) for s in plan_memory.stages(cfg)] == [107.4, 75.6, 75.6, 109.0]
    ranges = layer_ranges(cfg.num_layers, 4)
    with torch.device("meta"):  # the counts the chapter's runnable block prints, from the model itself
        built = [sum(p.numel() for p in BertModel(cfg, layer_numbers=r[0], pre_process=k == 0, post_process=k == 3,
                                                  init=False).parameters()) for k, r in enumerate(ranges)]
    assert built == [s.parameters for s in plan_memory.stages(cfg)]
    assert 4 * 512 * 1024 * 2 == 4 * MiB                        # one [b, s, h] message in bf16
    assert round(cfg.padded_vocab_size * 1024 * 4 / MiB) == 120  # the tied table's fp32 gradient, all-reduced
    assert 20e9 * 18 == 360e9                                    # 18 bytes per parameter (chapter 4)


def test_activation_memory_per_stage_bert_large():
    """Chapter 7's table: one layer, one micro-batch, flash and local attention (plan_memory.layer_activations)."""
    cfg = bert_large()
    flash, local = (plan_memory.layer_activations(cfg, backend).total for backend in ("flash", "local"))
    assert (round(flash / MiB, 1), round(local / MiB, 1)) == (68.2, 180.0)
    assert round((local - flash) / MiB) == 112                   # local attention's s x s tensors
    stage_flash, stage_local = 6 * flash, 6 * local              # 24 layers on 4 stages
    assert (round(stage_flash / MiB), round(stage_local / MiB)) == (409, 1080)
    afab = simulate("afab", 4, 64).peak_in_flight
    one_f_one_b = simulate("1f1b", 4, 64).peak_in_flight
    assert afab == [64] * 4 and one_f_one_b == [4, 3, 2, 1]
    assert (round(64 * stage_flash / GiB, 1), round(64 * stage_local / GiB, 1)) == (25.6, 67.5)
    assert (round(4 * stage_flash / GiB, 1), round(4 * stage_local / GiB, 1)) == (1.6, 4.2)
    assert (round(stage_flash / GiB, 1), round(stage_local / GiB, 1)) == (0.4, 1.1)


def test_work_per_stage_even_and_uneven_bert_large():
    """The uneven-stages figure: TFLOP per micro-batch of each stage (plan_time's layer and head FLOPs)."""
    def work(cfg):
        layer, head = plan_time.layer_flops(cfg), plan_time.head_flops(cfg)
        ranges = layer_ranges(cfg.num_layers, 4, 1, None, cfg.decoder_last_pipeline_num_layers)
        return [len(r[0]) * layer + (head if k == 3 else 0) for k, r in enumerate(ranges)]
    even, uneven = work(bert_large()), work(bert_large(decoder_last_pipeline_num_layers=3))
    assert [round(w / 1e12, 2) for w in even] == [1.01, 1.01, 1.01, 1.4]
    assert round(max(uneven) / 1e12, 2) == 1.17 and round(uneven[3] / 1e12, 2) == 0.9
    assert round(1 - max(uneven) / max(even), 2) == 0.16        # "about 16% shorter"


def test_one_batch_against_micro_batches():
    whole = simulate("afab", 4, 1, forward_time=8, backward_time=16)
    assert (whole.total_time, whole.ideal_compute) == (96, 24)
    assert simulate("afab", 4, 8).total_time == 33
    assert round(float(simulate("1f1b", 4, 32).bubble), 3) == 0.094  # p = 4 needs m = 32 for 9.4%


def sends_that_wait(rule):
    """The exchange figure: sends whose receive is posted later, on the ideal timeline (interleaved 2, 4, 2)."""
    timeline = simulate("interleaved", 2, 4, 2)
    actions = [[a for _, _, a in entries] for entries in timeline.entries]
    plan = (p2p_plan.plan_exchanges(timeline.entries, 2, 2) if rule == "timeline"
            else p2p_plan.plain_exchanges(actions, 2, 2))
    posted = [[0] + [e for _, e, _ in entries] for entries in timeline.entries]
    when = {}
    for rank, batches in enumerate(plan):
        for i, batch in enumerate(batches):
            for x in batch:
                when[(x.op, x.message)] = posted[rank][i]
    sends = [m for op, m in when if op == "send"]
    return sum(when[("recv", m)] > when[("send", m)] for m in sends), len(sends)


def test_exchange_figure_counts():
    assert sends_that_wait("plain") == (10, 24)
    assert sends_that_wait("timeline") == (0, 24)


def executed_total_time(kind, p, m, vp):
    """When the last rank finishes if every batch of the exchange plan waits, before the next action,
    until the peer has posted the matching op of each of its sends and receives (the matching rule of
    p2p_plan.py) and every action takes the drawing's time (forward 1, backward 2 per stage)."""
    timeline = simulate(kind, p, m, vp)
    actions = [[action for _, _, action in entries] for entries in timeline.entries]
    plan = p2p_plan.plan_exchanges(timeline.entries, p, vp)
    duration = {"F": Fraction(1, vp), "B": Fraction(2, vp)}
    partner, counts = {}, {}  # (rank, batch, op index) -> (rank, batch) holding the matching op
    slots = {}
    for rank, batches in enumerate(plan):
        for i, batch in enumerate(batches):
            for j, x in enumerate(batch):
                channel = (rank, x.peer) if x.op == "send" else (x.peer, rank)
                k = counts[(channel, x.op)] = counts.get((channel, x.op), -1) + 1
                slots[(channel, x.op, k)] = (rank, i)
                partner[(rank, i, j)] = (channel, "recv" if x.op == "send" else "send", k)
    posted = [[Fraction(0)] + [None] * len(a) for a in actions]
    done = [[None] * (len(a) + 1) for a in actions]
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            for i, batch in enumerate(plan[rank]):
                if posted[rank][i] is None or done[rank][i] is not None:
                    continue
                peers = [posted[r][b] for r, b in (slots[partner[(rank, i, j)]] for j in range(len(batch)))]
                if None in peers:
                    continue
                done[rank][i] = max([posted[rank][i]] + peers)
                if i < len(actions[rank]):
                    posted[rank][i + 1] = done[rank][i] + duration[actions[rank][i].op]
                progress = True
    return max(rank_done[-1] for rank_done in done)


def test_waiting_for_matches_delays_the_interleaved_schedule_but_not_1f1b():
    assert executed_total_time("1f1b", 4, 8, 1) == simulate("1f1b", 4, 8).total_time == 33
    assert executed_total_time("1f1b", 2, 4, 1) == 15
    assert simulate("interleaved", 2, 4, 2).total_time == Fraction(27, 2)
    assert executed_total_time("interleaved", 2, 4, 2) == Fraction(33, 2)     # later than 1F1B's 15
    assert executed_total_time("interleaved", 2, 8, 2) == Fraction(65, 2)     # 1F1B: 27; drawn: 25.5
    assert executed_total_time("interleaved", 4, 8, 2) == Fraction(59, 2)     # drawn: 28.5; 1F1B: 33
