"""The numbers chapters/04-data-parallel.md quotes that can be recomputed without launching a run: the
parameter count of BERT-large and its bytes per rank with and without ZeRO-1, the optimizer state each
rank of the chapter's small model holds at DP 1, 2 and 4, the gradient buckets of both models, and the
rows each data-parallel rank reads. Models are built on the meta device (shapes only, no memory, no arithmetic)
and the data-parallel ranks are simulated by ParallelState(dp=..., rank=...) without process groups."""
import pytest
import torch

from minibert.config import Config
from minibert.data.batches import MicroBatchSampler
from minibert.model.bert import BertModel
from minibert.parallel.data_parallel import DataParallelGrads
from minibert.parallel.state import ParallelState
from minibert.training.build import build_grad_buffers
from minibert.training.optim import build_optimizer
from minibert.validate import validate

BERT_LARGE_PARAMETERS = 336_297_858


def chapter_model_config(dp=1, **overrides):
    """The chapter's MODEL flags: 2 layers, hidden 64, 4 heads, sequences of 64, micro 2, global 8."""
    cfg = Config(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                 micro_batch_size=2, global_batch_size=8, train_iters=20, lr=1e-3, **overrides)
    return validate(cfg, world_size=dp, warn=None)


def meta_model(cfg):
    """The model as train.py builds it (cast to --bf16 / --fp16), on the meta device."""
    dtype = torch.float16 if cfg.fp16 else torch.bfloat16 if cfg.bf16 else torch.float32
    with torch.device("meta"):
        return BertModel(cfg).to(dtype)


def test_bert_large_parameters_and_bytes_per_rank():
    cfg = validate(Config(preset="340m", micro_batch_size=2, train_iters=1, lr=1e-4), warn=None)
    n = sum(p.numel() for p in meta_model(cfg).parameters())
    h, layers, vocab = 1024, 24, 30592
    per_layer = 12 * h * h + 13 * h  # QKV, output projection, MLP (h -> 4h -> h), two LayerNorms
    embeddings = vocab * h + 512 * h + 2 * h
    heads = 2 * h + (h * h + h) + 2 * h + vocab + (h * h + h) + (2 * h + 2)  # final LN, LM head, pooler, SOP
    assert n == layers * per_layer + embeddings + heads == BERT_LARGE_PARAMETERS
    # 16-bit params 2 + fp32 grads 4 + fp32 masters 4 + Adam m 4 + Adam v 4 = 18 bytes; ZeRO-1: 6 + 12 / DP
    gigabytes = {dp: round(n * (6 + 12 / dp) / 1e9, 2) for dp in (1, 2, 4, 8, 64)}
    assert n * 18 == 6_053_361_444
    assert gigabytes == {1: 6.05, 2: 4.04, 4: 3.03, 8: 2.52, 64: 2.08}
    assert round(n * 6 / 1e9, 2) == 2.02
    # ring collectives at DP 8, per GPU per step: all-reduce of fp32 grads vs reduce-scatter (fp32 grads)
    # + all-gather (bf16 params)
    assert round(2 * 7 / 8 * 4 * n / 1e9, 2) == 2.35
    assert round(7 / 8 * (4 + 2) * n / 1e9, 2) == 1.77


@pytest.mark.parametrize("dtype, bytes_per_parameter", [("fp32", 8), ("bf16", 12)])
def test_optimizer_state_per_rank_of_the_chapter_model(dtype, bytes_per_parameter):
    """What train.py prints as ' > optimizer state per rank ...' (the last rank's value)."""
    per_rank = {}
    for dp in (1, 2, 4):
        cfg = chapter_model_config(dp, use_distributed_optimizer=dp > 1, ddp_bucket_size=100_000,
                                   bf16=dtype == "bf16")
        per_rank[dp] = [build_optimizer(build_grad_buffers(meta_model(cfg), cfg, ParallelState(dp=dp, rank=r)), cfg,
                                        ParallelState(dp=dp, rank=r)).state_bytes() for r in range(dp)]
    n = sum(p.numel() for p in meta_model(chapter_model_config()).parameters())
    assert n == 2_101_378
    assert per_rank[1] == [n * bytes_per_parameter]
    # every parameter starts at a multiple of 64 elements of its bucket, and each bucket is padded to a
    # multiple of 64 x DP: the shards cut the padded buffers, so a rank holds a little more or less than n / DP
    for dp in (2, 4):
        assert sum(per_rank[dp]) == n * bytes_per_parameter
        assert all(abs(b / bytes_per_parameter - n / dp) < 64 * 4 for b in per_rank[dp])
    if dtype == "fp32":
        assert per_rank == {1: [16_811_024], 2: [8_405_520, 8_405_504],
                            4: [4_203_024, 4_203_520, 4_203_520, 4_200_960]}


def test_buckets_of_the_chapter_model():
    cfg = chapter_model_config()
    counts = {size: [b.grad_data.numel() for b in DataParallelGrads(meta_model(cfg), ParallelState(),
                                                                       bucket_size=size).buckets]
              for size in (None, 100_000, 20_000)}
    assert counts == {None: [2_101_440], 100_000: [105_792, 1_995_648],
                      20_000: [39_232, 33_216, 33_344, 20_928, 1_974_720]}


def test_bert_large_default_buckets():
    """Section 6 and its timeline figure: Megatron's default bucket size (40M elements at DP 1) cuts
    BERT-large's 302 parameters into 8 buckets in backward order, the last ending with the word embedding;
    the chapter's model has 38 parameters, one default bucket, whose fp32 gradients are 8.4 MB."""
    cfg = validate(Config(preset="340m", micro_batch_size=2, train_iters=1, lr=1e-4), warn=None)
    buckets = DataParallelGrads(meta_model(cfg), ParallelState()).buckets
    assert len(buckets) == 8 and sum(len(b.params) for b in buckets) == 302
    assert buckets[0].names[0] == "binary_head.bias" and buckets[-1].names[-1] == "embedding.word_embeddings.weight"
    (small,) = DataParallelGrads(meta_model(chapter_model_config()), ParallelState()).buckets
    assert len(small.params) == 38 and round(4 * small.grad_data.numel() / 1e6, 1) == 8.4


def test_every_parameter_starts_on_an_aligned_address():
    """Section 6: each parameter's view starts at a multiple of ALIGN elements of its bucket, so a bf16
    weight sits on a 128-byte boundary whatever the odd-sized parameters before it (the binary head's
    2-element bias), and its fp32 main_grad on a 256-byte one, counted from the buffers' starts (which
    the allocators align: 64 bytes on the CPU, 512 on a GPU)."""
    from minibert.parallel.data_parallel import ALIGN
    model = BertModel(chapter_model_config()).to(torch.bfloat16)
    assert any(p.numel() % 8 for p in model.parameters())  # packed back to back, the next would be off
    grads = DataParallelGrads(model, ParallelState(), bucket_size=20_000)
    for bucket in grads.buckets:
        for p, (start, end) in zip(bucket.params, bucket.ranges):
            assert start % ALIGN == 0 and end - start == p.numel()
            assert p.data_ptr() == bucket.param_data.data_ptr() + 2 * start
            assert p.main_grad.data_ptr() == bucket.grad_data.data_ptr() + 4 * start
            assert p.data_ptr() % 16 == 0 and p.main_grad.data_ptr() % 16 == 0  # what cuBLAS's fast kernels need
            assert torch.equal(bucket.param_data[start:end], p.detach().reshape(-1))


def test_every_data_parallel_size_reads_the_same_micro_batches():
    """Global batch 8, micro-batch 2: DP=1's micro-batch k is rank k % DP's micro-batch k // DP."""
    def step_rows(dp, rank, consumed=0):
        sampler = iter(MicroBatchSampler(100, consumed, 2, rank, dp))
        return [next(sampler) for _ in range(8 // (2 * dp))]
    one = step_rows(1, 0)
    assert one == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for dp in (2, 4):
        for rank in range(dp):
            assert step_rows(dp, rank) == one[rank::dp]
    assert step_rows(2, 1, consumed=80) == [[82, 83], [86, 87]]  # a resume at iteration 10
