"""Two levers on the residual stream: dropout + add + LayerNorm in one kernel, and each layer's closing add
handing the next layer its LayerNorm.

The plain layer (minibert/model/bert.py) runs, per sublayer, three separate passes over [b, s, h]:

    plain:   y' = dropout(y)      x = x + y'      normed = LayerNorm(x)       (next sublayer's input)
    fused:   x, normed = dropout_add_layer_norm(x, y, LN)                    one kernel, one pass

--bias-dropout-fusion (Megatron's flag name; the bias stays in the matmul) swaps each TransformerLayer
for FusedTransformerLayer, whose residual add calls the kernel of minibert/fast/layer_norm.py on a GPU in
fp16/bf16, for tensors of at least FUSED_MIN_ELEMENTS elements (launched from Python, the kernel's
backward costs the host more than eager's ops on small tensors, where the GPU waits for the host anyway:
chapter 8, section 9). Everywhere else it runs the plain ops: the CPU gives the plain model's numbers.

--residual-layernorm-fusion (pre-LN only). A pre-LN layer ends with an add and no LayerNorm, and the next
layer starts with its LN1 of that sum. The lever moves that LayerNorm into the add, so the fused kernel
computes both:

    plain:    ... x = x + drop(mlp(LN2 x))  |  next layer: LN1(x) ...
    chained:  ... x, normed = add_norm(x, drop(mlp(...)), next.LN1)  |  next layer takes `normed`

ChainedBertModel runs the layers so, the last one's add computing the final LayerNorm (on a pipeline
stage without the heads, the next stage's first layer runs its own LN1). Full recompute keeps working:
a recomputed group takes and returns the pair (x, normed).

apply(chunk, cfg) turns both on as the flags say, from outside, by swapping the classes of modules that
are already built and initialised (their parameters and names stay: checkpoints do not change). The
plain twins are the core's TransformerLayer and BertModel; tests/test_levers.py checks that the
levers give the plain model's losses and gradients."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from minibert.model.bert import BertModel, TransformerLayer, recompute_groups

FUSED_MIN_ELEMENTS = 1 << 22  # between the sizes where the kernel lost (small, host-bound) and won


def fused_kernels_apply(x) -> bool:
    """Where the Triton kernels of this package replace their plain twins: CUDA tensors in fp16/bf16."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


class FusedTransformerLayer(TransformerLayer):
    """TransformerLayer whose residual adds may run as one kernel with the LayerNorm after them, and whose
    closing add may compute the next layer's LN1 (forward with next_layernorm / normed)."""

    fused = True  # False: the plain ops, chained (--no-bias-dropout-fusion --residual-layernorm-fusion)

    def add_norm(self, x, y, layernorm=None):
        """-> (x + drop(y), layernorm(x + drop(y)) or None)."""
        p = self.dropout if self.training else 0.0
        with self.rng_context():
            if self.fused and fused_kernels_apply(x) and x.numel() >= FUSED_MIN_ELEMENTS:
                from minibert.fast.layer_norm import dropout_add_layer_norm
                weight, bias = (None, None) if layernorm is None else (layernorm.weight, layernorm.bias)
                eps = 0.0 if layernorm is None else layernorm.eps
                return dropout_add_layer_norm(x, y, weight, bias, eps, p, None)
            x = x + F.dropout(y, p, self.training)
        return x, None if layernorm is None else layernorm(x)

    def forward(self, x, padding_mask, backend, packing=None, normed=None, next_layernorm=None, chained=False):
        """As TransformerLayer.forward; chained=True: -> (x, next_layernorm(x) or None), taking `normed`
        (this layer's LN1 of x, from the previous layer's add) when it is given."""
        attend = lambda y: self.self_attention(y, padding_mask, backend, packing)  # noqa: E731
        if self.post_ln:
            _, x = self.add_norm(x, attend(x), self.input_layernorm)
            x = self.add_norm(x, self.mlp(x), self.pre_mlp_layernorm)[1]
            return (x, None) if chained else x
        if normed is None:
            normed = self.input_layernorm(x)
        x, normed = self.add_norm(x, attend(normed), self.pre_mlp_layernorm)
        x, normed = self.add_norm(x, self.mlp(normed), next_layernorm)
        return (x, normed) if chained else x


def run_chained(steps, x, normed, padding_mask, backend, packing=None):
    """steps: (layer, the LayerNorm its closing add computes, or None), in order -> (x, normed)."""
    for layer, next_layernorm in steps:
        x, normed = layer(x, padding_mask, backend, packing, normed=normed, next_layernorm=next_layernorm,
                          chained=True)
    return x, normed


class ChainedBertModel(BertModel):
    """BertModel whose layers hand each other their LN1 (and the last one the final LayerNorm)."""

    def encode(self, x, padding_mask=None, packing=None):
        backend = self.attention_backend(x.device)
        layers = list(self.layers.values())
        after = [layer.input_layernorm for layer in layers[1:]] + [self.final_layernorm if self.post_process else None]
        normed = None
        for steps, recomputed in recompute_groups(list(zip(layers, after)), self.config):
            if recomputed and torch.is_grad_enabled():
                x, normed = checkpoint(run_chained, steps, x, normed, padding_mask, backend, packing,
                                       use_reentrant=False)
            else:
                x, normed = run_chained(steps, x, normed, padding_mask, backend, packing)
        if self.post_process:
            x = self.from_layers(normed if normed is not None else self.final_layernorm(x))
        return x


def apply(chunk, cfg):
    """Turn on --bias-dropout-fusion and --residual-layernorm-fusion (pre-LN) in a built model chunk."""
    chain = cfg.residual_layernorm_fusion and not cfg.post_ln
    if not (cfg.bias_dropout_fusion or chain):
        return chunk
    for layer in chunk.layers.values():
        layer.__class__ = FusedTransformerLayer
        layer.fused = cfg.bias_dropout_fusion
    if chain:
        chunk.__class__ = ChainedBertModel
    return chunk
