"""What BertModel needs to know, and nothing else: its shape, dropout, where the LayerNorms go, the heads,
the attention backend, what it recomputes, and the seed its weights are drawn from.

The run's Config (minibert/config.py) holds ~90 flags: the optimizer's, the data's, the checkpoints'.
The model reads only these; `ModelConfig.of(run_config)` picks them out, so a model built by the trainer
and one built by hand in the notebook are built from the same few numbers:

    ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, max_positions=128)"""
import math
from dataclasses import dataclass


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 30522            # the tokenizer's vocab (bert-base-uncased)
    padded_vocab_size: int = None      # rows of the word table; default: vocab_size rounded up to 128
    max_positions: int = 512           # rows of the position table
    ffn_size: int = None               # MLP width; default: 4 x hidden_size
    layernorm_epsilon: float = 1e-5    # Megatron's (HF BERT: 1e-12)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    post_ln: bool = False              # False: Megatron's pre-LN; True: original BERT / HF post-LN
    binary_head: bool = True           # the pooler and the sentence-order (SOP) head
    attention_backend: str = "auto"    # auto, local, fused or flash (minibert/model/attention.py)
    sparse_mlm: bool = False           # only the masked positions go through the LM head
    recompute: str = None              # None, "selective" (the attention core) or "full" (whole layers)
    recompute_method: str = None       # full: "uniform" or "block"
    recompute_num_layers: int = None   # full: layers per group (uniform) or recomputed (block)
    init_method_std: float = 0.02
    seed: int = 1234                   # every weight is drawn from (seed, its name): init_weights.py

    def __post_init__(self):
        if self.padded_vocab_size is None:
            self.padded_vocab_size = int(math.ceil(self.vocab_size / 128) * 128)
        if self.ffn_size is None:
            self.ffn_size = 4 * self.hidden_size

    @classmethod
    def of(cls, config) -> "ModelConfig":
        """`config` if it is a ModelConfig; from the run's Config (minibert.config.Config), its model fields."""
        if isinstance(config, cls):
            return config
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   num_attention_heads=config.num_attention_heads, vocab_size=config.vocab_size,
                   padded_vocab_size=config.padded_vocab_size, max_positions=config.max_positions,
                   ffn_size=config.ffn_size, layernorm_epsilon=config.layernorm_epsilon,
                   hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
                   post_ln=config.post_ln, binary_head=config.binary_head,
                   attention_backend=config.attention_backend, sparse_mlm=config.sparse_mlm,
                   recompute=config.recompute, recompute_method=config.recompute_method,
                   recompute_num_layers=config.recompute_num_layers, init_method_std=config.init_method_std,
                   seed=config.seed)
