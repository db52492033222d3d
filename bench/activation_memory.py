"""Activation memory of one transformer layer, measured: the bytes autograd keeps for the backward, per rank.

    torchrun --nproc_per_node 2 bench/activation_memory.py                  # gloo on CPU, a few seconds
    torchrun --nproc_per_node 2 bench/activation_memory.py --list           # and every saved tensor, by op
    python bench/activation_memory.py                                       # one process: TP 1 only

The layer is built the way the trainer builds it, by minibert.training.build.build_model (a model with one layer,
meta-built, tensor parallelism applied, this rank's shards allocated) and minibert.fast.levers.apply_levers (the
levers the trainer turns on by default; on the CPU they run the plain ops), in three layouts:

    TP 1          the one-process model (every process can build it: no process group is involved)
    TP p          the layer split over the p processes of this launch
    TP p + SP     the same, with sequence parallelism: the layer's input is this rank's s/p positions

Each runs one forward of the layer alone (training mode, dropout on) under
torch.autograd.graph.saved_tensors_hooks. The pack hook sees every tensor an op saves for its backward;
we add up the bytes of their *storages*, each storage once (q, k and v are views of one QKV output, a
LayerNorm output may be saved by two ops), and leave out the parameters (a weight saved for the input
gradient is memory the model holds anyway). What is left is the activation memory of one layer for one
micro-batch: multiply by the layers and by the micro-batches in flight for a whole model.

The default shape is BERT-large's layer (h 1024, 16 heads, s 512) at micro-batch 1, in fp32 (the CPU's
dtype; --bf16 for the GPU's 16-bit activations). On the CPU PyTorch's dropout keeps its mask in the
activation dtype (a CUDA GPU keeps a 1-byte mask): see chapters/05-tensor-parallel.md for the count."""
import argparse
import os
import sys
from collections import defaultdict

if __package__ in (None, ""):  # run as a script from a checkout: make `minibert` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from minibert.config import Config  # noqa: E402
from minibert.fast.levers import apply_levers  # noqa: E402
from minibert.parallel.state import ParallelState  # noqa: E402
from minibert.training.build import build_model, set_random_seed  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=1024, help="h (BERT-large: 1024)")
    p.add_argument("--num-attention-heads", type=int, default=16, help="a (BERT-large: 16)")
    p.add_argument("--seq-length", type=int, default=512, help="s")
    p.add_argument("--micro-batch-size", type=int, default=1, help="b")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (Megatron's 0.1)")
    p.add_argument("--bf16", action="store_true", help="16-bit activations, as on a GPU (slower on most CPUs)")
    p.add_argument("--list", action="store_true", help="print every saved storage with the ops that saved it")
    return p.parse_args(argv)


def layer_config(args, tp, sequence_parallel):
    return Config(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                  seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.micro_batch_size, train_iters=1, lr=1.0, bf16=args.bf16,
                  hidden_dropout=args.dropout, attention_dropout=args.dropout,
                  vocab_size=128,  # the layer never reads the vocab: keep the (unused) embedding small
                  bert_no_binary_head=True, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)


def saved_by_op(output):
    """storage pointer -> names of the backward nodes (ops) that saved it, found by walking the graph."""
    names, seen, todo = defaultdict(set), set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        op = type(node).__name__.replace("Backward0", "").replace("Backward", "")
        tensors = list(getattr(node, "saved_tensors", ()) or ())  # a custom autograd.Function
        for attr in dir(node):
            if attr.startswith("_saved_"):
                value = getattr(node, attr)
                tensors += [value] if isinstance(value, torch.Tensor) else []
        for t in tensors:
            if t.numel():
                names[t.untyped_storage().data_ptr()].add(op)
        todo += [next_node for next_node, _ in node.next_functions]
    return names


def measure(args, state, sequence_parallel):
    """One forward of the layer; -> (activation bytes, [(bytes, shape, dtype, ops)] per saved storage)."""
    cfg = layer_config(args, state.tp, sequence_parallel)
    set_random_seed(cfg.seed, state)  # the generators the dropout draws from (rng.fork inside the region)
    model = build_model(cfg, state)
    apply_levers(model, None, cfg)  # as minibert/train.py does, once the model is built
    model.train()
    layer = model.layers[0]
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    dtype = next(model.parameters()).dtype
    b, s, h = args.micro_batch_size, args.seq_length, args.hidden_size
    local_s = s // state.tp if sequence_parallel else s  # SP: this rank's slice of the sequence
    x = torch.randn(b, local_s, h, generator=torch.Generator().manual_seed(state.tp_rank)).to(dtype)
    x.requires_grad_()  # as the previous layer's output would
    padding_mask = torch.zeros(b, s, dtype=torch.bool)  # [b, s], True = padding: none here
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in storages and storage.nbytes():
            storages[key] = (storage.nbytes(), tuple(t.shape), t.dtype)
        return t  # keep the tensor itself: we measure, we do not change what is kept

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x, padding_mask, "local")  # [b, local_s, h]
    ops = saved_by_op(y)
    rows = sorted(((n, shape, dt, ",".join(sorted(ops.get(key, {"?"})))) for key, (n, shape, dt) in storages.items()),
                  key=lambda r: -r[0])
    total = sum(r[0] for r in rows)
    y.float().sum().backward()  # the saved tensors are enough for the backward (and nothing stays alive)
    return total, rows


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)  # p processes share the cores
    world = int(os.environ.get("WORLD_SIZE", "1"))
    results = [("TP 1", measure(args, ParallelState(), False))]  # the one-process model, in every process
    state = None
    if world > 1:
        state = ParallelState.from_environment(tp=world, backend="gloo")
        if args.num_attention_heads % world or args.seq_length % world:
            raise SystemExit(f"--num-attention-heads and --seq-length must be divisible by {world} processes")
        results += [(f"TP {world}", measure(args, state, False)), (f"TP {world} + SP", measure(args, state, True))]
    rank = state.tp_rank if state else 0
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, (rank, results))
    else:
        everyone = [(rank, results)]
    if rank == 0:
        b, s, h, a = args.micro_batch_size, args.seq_length, args.hidden_size, args.num_attention_heads
        dtype = "bf16" if args.bf16 else "fp32"
        print(f"one transformer layer, b={b} s={s} h={h} heads={a}, {dtype}, dropout {args.dropout}: "
              f"bytes autograd saves in the forward (parameters excluded), per rank")
        reference = results[0][1][0]
        print(f"{'layout':12s} {'rank':>4s} {'saved bytes':>13s} {'MB':>8s} {'/ TP 1':>7s} {'/ (s*b*h)':>9s}")
        for name_index in range(len(results)):
            for r, rank_results in sorted(everyone):
                name, (total, rows) = rank_results[name_index]
                if name == "TP 1" and r > 0:
                    continue  # the same in every process
                print(f"{name:12s} {r:4d} {total:13,d} {total / 1e6:8.2f} {total / reference:7.3f} "
                      f"{total / (s * b * h):9.2f}")
        if args.list:
            for name, (total, rows) in results:
                print(f"\n{name}, rank 0: {len(rows)} saved storages")
                for n, shape, dt, ops in rows:
                    print(f"  {n:>11,d}  {str(list(shape)):18s} {str(dt).replace('torch.', ''):8s} {ops}")
    if state is not None:
        state.destroy()


if __name__ == "__main__":
    main()
