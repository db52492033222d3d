"""The one place the speed levers are turned on: apply_levers(model, optimizer, cfg), called by the trainer
(minibert/train.py) once the model and its optimizer are built, the way tensor parallelism is applied to a
plain BertModel by the builder. Each lever swaps a built module (or the optimizer) for a twin that does the
same math faster on a GPU, and runs the plain twin's code everywhere else, the CPU included:

    lever (flag, default)                  swaps                              plain twin (the core)
    --bias-dropout-fusion (on)             TransformerLayer -> Fused...       TransformerLayer.residual
    --residual-layernorm-fusion (on)       BertModel -> ChainedBertModel      BertModel.encode
    --cross-entropy-loss-fusion (on)       model.lm_cross_entropy             model.bert.lm_cross_entropy
    the bias gradient as a GEMV (always)   nn.Linear and the decoders         F.linear's autograd
    --adam-fusion (on)                     MixedPrecisionOptimizer -> Fused   PyTorch's fused AdamW + copy
    --cuda-graph-impl local (off)          the schedule (minibert/train.py)   forward_backward_no_pipelining
    --fp8-format e4m3|hybrid (off)         each layer's 4 Linears -> FP8...   the bf16 Linear

Parameters, their names and the optimizer's state are untouched, so checkpoints do not depend on the
levers, but for one addition: FP8's delayed recipe keeps its scaling state in buffers of the model (saved
with it; minibert/training/resume.py says how checkpoints with and without it load). Unlike the others,
FP8 changes the numbers (it rounds the products' operands to 8 bits) and runs on the CPU too
(torch._scaled_mm): tests/test_fp8.py checks it against a float64 product of the same FP8 operands.
Chapter 8 measures the other levers, and their tests check each against its plain twin."""
from minibert.fast import fp8, linear, residual
from minibert.fast.residual import fused_kernels_apply
from minibert.model.loss import lm_cross_entropy
from minibert.training.build import as_chunks


def fused_lm_cross_entropy(logits, labels, with_correct=False):
    """lm_cross_entropy, as one Triton kernel on a GPU with 16-bit logits (minibert/fast/cross_entropy.py:
    it reads the logits once and never makes their fp32 copy); the same numbers up to the order of fp32 sums."""
    if fused_kernels_apply(logits):
        from minibert.fast.cross_entropy import (
            fused_cross_entropy,  # Triton is imported only where it runs
        )
        return fused_cross_entropy(logits, labels, with_correct=with_correct)
    return lm_cross_entropy(logits, labels, with_correct=with_correct)


def apply_levers(model, optimizer, cfg):
    """Turn on, in a built model (a chunk or a list of chunks) and its optimizer, the levers cfg asks for."""
    for chunk in as_chunks(model):
        residual.apply(chunk, cfg)
        linear.apply(chunk)
        if cfg.fp8_format is not None:
            fp8.apply(chunk, cfg)
        if cfg.cross_entropy_loss_fusion and chunk.lm_cross_entropy is lm_cross_entropy:  # TP has its own
            chunk.lm_cross_entropy = fused_lm_cross_entropy
    if optimizer is not None and cfg.adam_fusion and optimizer.pieces and optimizer.pieces[0].master.is_cuda:
        from minibert.fast import adamw  # Triton is imported only where it runs
        adamw.apply(optimizer)
    return model, optimizer
