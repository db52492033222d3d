"""Run by tests/test_tensor_parallel.py under torchrun (2 or 4 processes, gloo, fp32): every tensor-parallel
layer against its plain twin on the full tensors (outputs and all gradients, norm-wise relative error
<= 1e-6), the vocab-parallel accuracy flags (the one-process ones, with no collective of their own), the
layout-invariant init (gathered shards = the one-process model), and the collectives one transformer layer
makes, counted. Prints one line per check; a failed check raises."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minibert.config import Config  # noqa: E402
from minibert.model.bert import BertModel  # noqa: E402
from minibert.model.loss import label_is_max
from minibert.parallel import data_parallel, mappings  # noqa: E402
from minibert.parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from minibert.parallel.state import ParallelState  # noqa: E402
from minibert.training.build import build_model, set_random_seed  # noqa: E402

torch.set_num_threads(1)
tp = int(os.environ["WORLD_SIZE"])
state = ParallelState.from_environment(tp=tp, backend="gloo", timeout_minutes=0.5)
group, rank = state.group("tensor"), state.tp_rank
WORST = [0.0]


def close(ours, reference, what):
    error = (ours - reference).norm() / reference.norm().clamp(min=1e-30)
    WORST[0] = max(WORST[0], float(error))
    assert error <= 1e-6, f"{what}: norm-wise relative error {error:.2e}"


def block(full, dim):
    return full.chunk(tp, dim)[rank]


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- ColumnParallelLinear and RowParallelLinear, with and without sequence parallelism
b, s, h_in, h_out = 3, 8, 7, 12  # odd input width; the split widths divide by 2 and 4
x_full = randn(b, s, h_in, seed=1)
w1, b1 = randn(h_out, h_in, seed=2), randn(h_out, seed=3)
w2, b2 = randn(5, h_out, seed=4), randn(5, seed=5)
for sequence_parallel in (False, True):
    x_ref = x_full.clone().requires_grad_()
    ref_w1, ref_b1, ref_w2, ref_b2 = (t.clone().requires_grad_() for t in (w1, b1, w2, b2))
    y_ref = F.linear(F.gelu(F.linear(x_ref, ref_w1, ref_b1)), ref_w2, ref_b2)  # the MLP shape: column, row
    y_ref.pow(2).sum().backward()

    column = ColumnParallelLinear(h_in, h_out, group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(h_out, 5, group, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        column.weight.copy_(block(w1, 0)), column.bias.copy_(block(b1, 0))
        row.weight.copy_(block(w2, 1)), row.bias.copy_(b2)
    x = (block(x_full, 1) if sequence_parallel else x_full).clone().requires_grad_()  # SP: my positions
    y = row(F.gelu(column(x)))
    expected = block(y_ref, 1) if sequence_parallel else y_ref
    close(y, expected.detach(), f"column+row output (sp={sequence_parallel})")
    # the loss: sum of squares over the whole output (SP: each rank has its positions; sum them all)
    (y.pow(2).sum()).backward()
    if sequence_parallel:
        torch.distributed.all_reduce(row.bias.grad, group=group)  # a replicated bias on sliced positions
    close(x.grad, (block(x_ref.grad, 1) if sequence_parallel else x_ref.grad), f"dX (sp={sequence_parallel})")
    close(column.weight.grad, block(ref_w1.grad, 0), f"column dW (sp={sequence_parallel})")
    close(column.bias.grad, block(ref_b1.grad, 0), f"column db (sp={sequence_parallel})")
    close(row.weight.grad, block(ref_w2.grad, 1), f"row dW (sp={sequence_parallel})")
    close(row.bias.grad, ref_b2.grad, f"row db (sp={sequence_parallel})")
print(f"rank {rank}: column/row-parallel linear ok", flush=True)

# gather_output / input_is_parallel=False (the other two forms)
gathered = ColumnParallelLinear(h_in, h_out, group, gather_output=True)
scattered = RowParallelLinear(h_out, 5, group, input_is_parallel=False)
with torch.no_grad():
    gathered.weight.copy_(block(w1, 0)), gathered.bias.copy_(block(b1, 0))
    scattered.weight.copy_(block(w2, 1)), scattered.bias.copy_(b2)
close(gathered(x_full), F.linear(x_full, w1, b1), "gather_output")
close(scattered(F.linear(x_full, w1, b1)), F.linear(F.linear(x_full, w1, b1), w2, b2), "input_is_parallel=False")
print(f"rank {rank}: gather_output and input_is_parallel=False ok", flush=True)

# ---- VocabParallelEmbedding and the vocab-parallel cross entropy; vocab 300, padded to 512 (128 x 4)
vocab, padded, h = 300, 512, 6
table = randn(padded, h, seed=6)
tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(7))
ref_table = table.clone().requires_grad_()
F.embedding(tokens, ref_table).pow(2).sum().backward()
emb = VocabParallelEmbedding(padded, h, group)
with torch.no_grad():
    emb.weight.copy_(block(table, 0))
out = emb(tokens)
close(out, F.embedding(tokens, table), "vocab-parallel embedding")
out.pow(2).sum().backward()
close(emb.weight.grad, block(ref_table.grad, 0), "vocab-parallel embedding dW")

n = 40
logits_full = randn(n, padded, seed=8) * 3
labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(9))
labels[::7] = -1  # positions that are not masked tokens
ref_logits = logits_full.clone().requires_grad_()
ref_loss = F.cross_entropy(ref_logits[:, :vocab], labels, ignore_index=-1, reduction="none")
weights = randn(n, seed=10)  # a loss_mask-like weighting of the per-position losses
(ref_loss * weights).sum().backward()
local = block(logits_full, 1).clone().requires_grad_()
loss = vocab_parallel_cross_entropy(local, labels, group, vocab_start=rank * (padded // tp), vocab_size=vocab)
close(loss, ref_loss.detach(), "vocab-parallel cross entropy")
(loss * weights).sum().backward()
close(local.grad, block(ref_logits.grad, 1), "vocab-parallel cross entropy d(logits)")
assert torch.all(local.grad[:, max(0, vocab - rank * (padded // tp)):] == 0), "padded columns got gradients"
print(f"rank {rank}: vocab-parallel embedding and cross entropy ok", flush=True)

# ---- the accuracy flags (lm acc): the one-process label_is_max on the real vocab, from the loss's own
# all-reduces (t = z_label - max is exactly 0 when the label is the argmax): no collective of its own
tied = logits_full.clone()
right = labels.clone()
tied[0, 0] = tied[0, vocab - 1] = tied[0, :vocab].max()   # a tie between rank 0's block and the last real one
right[0] = 0
tied[1, vocab:] = 1e4                                       # padded columns far above: never the prediction
right[1] = int(tied[1, :vocab].argmax())
right[2] = int(tied[2, :vocab].argmax())
expected = label_is_max(tied[:, :vocab], right)
assert expected[:3].all() and not expected[right == -1].any()
real_all_reduce, calls = dist.all_reduce, []
dist.all_reduce = lambda *args, **kwargs: (calls.append(1), real_all_reduce(*args, **kwargs))[1]
loss_alone = vocab_parallel_cross_entropy(block(tied, 1), right, group, vocab_start=rank * (padded // tp),
                                          vocab_size=vocab)
alone = len(calls)
loss_counted, correct = vocab_parallel_cross_entropy(block(tied, 1), right, group, vocab_start=rank * (padded // tp),
                                                     vocab_size=vocab, with_correct=True)
dist.all_reduce = real_all_reduce
assert torch.equal(correct, expected), (correct, expected)
assert torch.equal(loss_counted, loss_alone) and len(calls) == 2 * alone == 4, calls
print(f"rank {rank}: vocab-parallel accuracy ok", flush=True)

# ---- layout-invariant init: the gathered shards are the one-process model (real vocab rows)
cfg = Config(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=300,
             tensor_model_parallel_size=tp, seed=11, micro_batch_size=1, global_batch_size=1, train_iters=1, lr=1.0)
set_random_seed(cfg.seed, state)
model = build_model(cfg, state)
single = BertModel(Config(**{**vars(cfg), "tensor_model_parallel_size": 1})).state_dict()
for name, param in model.named_parameters():
    full = param.detach()
    if hasattr(param, "partition_dim"):
        parts = [torch.empty_like(full) for _ in range(tp)]
        dist.all_gather(parts, full.contiguous(), group=group)
        full = torch.cat(parts, dim=param.partition_dim)
    reference = single[name]
    rows = min(full.shape[0], reference.shape[0]) if name in ("embedding.word_embeddings.weight", "lm_head.bias") \
        else full.shape[0]
    if name in ("embedding.word_embeddings.weight", "lm_head.bias"):  # 384 rows at TP 1, 512 at TP 4
        assert torch.equal(full[:cfg.vocab_size], reference[:cfg.vocab_size]), name
    else:
        assert torch.equal(full, reference), name
print(f"rank {rank}: layout-invariant init ok (padded vocab {cfg.padded_vocab_size})", flush=True)

# ---- the collectives of one transformer layer, counted (forward, backward), without and with SP
counts = {}
for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):
    real = getattr(dist, name) if name == "all_reduce" else getattr(data_parallel, name)

    def counting(*args, _real=real, _name=name, **kwargs):
        counts[_name] = counts.get(_name, 0) + 1
        return _real(*args, **kwargs)
    if name == "all_reduce":
        dist.all_reduce = counting
    else:
        setattr(mappings, name, counting)
for sequence_parallel in (False, True):
    lcfg = Config(**{**vars(cfg), "num_layers": 1, "sequence_parallel": sequence_parallel, "hidden_dropout": 0.0,
                     "attention_dropout": 0.0})
    layer_model = build_model(lcfg, state)  # embedding, one layer, heads: we run the layer alone
    layer = layer_model.layers[0]
    x = randn(2, 8 // (tp if sequence_parallel else 1), 16, seed=12).requires_grad_()
    counts.clear()
    y = layer(x, None, "local")
    forward = dict(counts)
    counts.clear()
    y.sum().backward()
    backward = dict(counts)
    print(f"rank {rank}: collectives sp={sequence_parallel} forward {sorted(forward.items())} "
          f"backward {sorted(backward.items())}", flush=True)
print(f"rank {rank}: worst relative error {WORST[0]:.2e}", flush=True)
state.destroy()
