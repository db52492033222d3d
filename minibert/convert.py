"""HuggingFace <-> minibert weights: `from_hf(hf_dir) -> BertModel`, `to_hf(model, out_dir)`.

Two HF architectures match minibert's two layouts exactly (same math, only names and shapes differ):
  - BertForPreTraining (model_type "bert")                 <-> post_ln=True  (embedding LayerNorm, LN after each add)
  - MegatronBertForPreTraining (model_type "megatron-bert") <-> post_ln=False (Megatron's pre-LN: LN before
    attention and MLP (`attention.ln`, `ln`), a final `encoder.ln`, no embedding LayerNorm; HF's port keeps
    Megatron's placement, so no reordering is needed)
Their *ForMaskedLM variants (no pooler, no SOP head) map to config.bert_no_binary_head.

Weight map ({i}: layer index; HF names start with "bert." except the "cls." heads; [pre] / [post]: only
that layout; LN1 / LN2: attention_layernorm / mlp_layernorm of minibert.model.TransformerLayer):

| minibert | HF BertForPreTraining | HF MegatronBertForPreTraining | note |
|---|---|---|---|
| embedding.word_embeddings | bert.embeddings.word_embeddings | same | [padded_vocab, h] <-> [vocab, h] |
| embedding.position_embeddings | bert.embeddings.position_embeddings | same | |
| embedding.tokentype_embeddings | bert.embeddings.token_type_embeddings | same | |
| embedding.layernorm [post] | bert.embeddings.LayerNorm | - | |
| layers.{i}.attention_layernorm | ...layer.{i}.attention.output.LayerNorm | ...layer.{i}.attention.ln | LN1 |
| layers.{i}.self_attention.query_key_value | ...layer.{i}.attention.self.{query,key,value} | same | [heads,3,d] |
| layers.{i}.self_attention.dense | ...layer.{i}.attention.output.dense | same | |
| layers.{i}.mlp_layernorm | ...layer.{i}.output.LayerNorm | ...layer.{i}.ln | LN2 |
| layers.{i}.mlp.dense_h_to_4h | ...layer.{i}.intermediate.dense | same | |
| layers.{i}.mlp.dense_4h_to_h | ...layer.{i}.output.dense | same | |
| final_layernorm [pre] | - | bert.encoder.ln | |
| lm_head.dense / lm_head.layernorm | cls.predictions.transform.dense / .LayerNorm | same | |
| lm_head.bias | cls.predictions.bias | same | [padded_vocab] <-> [vocab] |
| pooler / binary_head | bert.pooler.dense / cls.seq_relationship | same | absent without the binary head |

QKV: minibert's fused rows are ordered [heads, 3, d] (see SelfAttention), HF's are three [heads * d] blocks:
    W_qkv = stack([W_q.view(heads, d, h), W_k.view(...), W_v.view(...)], dim=1).reshape(3h, h)
Padded vocab rows (Megatron's padding to a multiple of 128) are dropped on export and zero-filled on
import: the model never reads them. HF ties cls.predictions.decoder to the word embeddings, so the decoder
is not stored. LayerNorm eps travels as HF's layer_norm_eps <-> config.layernorm_epsilon (HF BERT: 1e-12).

Weights are read from model.safetensors (a sharded model.safetensors.index.json too) or pytorch_model.bin
(torch.load with weights_only=True). safetensors is not a dependency: the format is small enough to read
and write here (see read_safetensors)."""
import json
import math
import os

import torch

from minibert.atomic import atomic_write_bytes
from minibert.config import Config
from minibert.errors import UsageError
from minibert.model import BertModel

# minibert name prefix -> (BertForPreTraining prefix, MegatronBertForPreTraining prefix); None = not in that layout
TOP_LEVEL = {
    "embedding.word_embeddings": ("bert.embeddings.word_embeddings",) * 2,
    "embedding.position_embeddings": ("bert.embeddings.position_embeddings",) * 2,
    "embedding.tokentype_embeddings": ("bert.embeddings.token_type_embeddings",) * 2,
    "embedding.layernorm": ("bert.embeddings.LayerNorm", None),
    "final_layernorm": (None, "bert.encoder.ln"),
    "lm_head.dense": ("cls.predictions.transform.dense",) * 2,
    "lm_head.layernorm": ("cls.predictions.transform.LayerNorm",) * 2,
    "lm_head.bias": ("cls.predictions.bias",) * 2,
    "pooler": ("bert.pooler.dense",) * 2,
    "binary_head": ("cls.seq_relationship",) * 2,
}
PER_LAYER = {  # under layers.{i} <-> bert.encoder.layer.{i}
    "attention_layernorm": ("attention.output.LayerNorm", "attention.ln"),
    "self_attention.dense": ("attention.output.dense",) * 2,
    "mlp_layernorm": ("output.LayerNorm", "ln"),
    "mlp.dense_h_to_4h": ("intermediate.dense",) * 2,
    "mlp.dense_4h_to_h": ("output.dense",) * 2,
}
QKV = "self_attention.query_key_value"
PADDED_VOCAB = ("embedding.word_embeddings.weight", "lm_head.bias")
TIED_OR_BUFFERS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids")
ARCHITECTURES = {  # post_ln -> (model_type, with binary head, without)
    True: ("bert", "BertForPreTraining", "BertForMaskedLM"),
    False: ("megatron-bert", "MegatronBertForPreTraining", "MegatronBertForMaskedLM"),
}


def hf_name(name: str, post_ln: bool) -> str:
    """minibert parameter name -> HF name (not for the fused QKV, which maps to three)."""
    column = 0 if post_ln else 1
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        prefix, leaf = rest.rsplit(".", 1)
        return f"bert.encoder.layer.{i}.{PER_LAYER[prefix][column]}.{leaf}"
    for prefix, hf_prefixes in TOP_LEVEL.items():
        if name == prefix or name.startswith(prefix + "."):
            return hf_prefixes[column] + name[len(prefix):]
    raise KeyError(name)


def qkv_hf_names(name: str) -> list:
    """layers.{i}.self_attention.query_key_value.{weight,bias} -> the HF query, key, value names."""
    _, i, rest = name.split(".", 2)
    leaf = rest.rsplit(".", 1)[1]
    return [f"bert.encoder.layer.{i}.attention.self.{part}.{leaf}" for part in ("query", "key", "value")]


def fuse_qkv(q, k, v, heads):
    """HF's separate [h, ...] q, k, v -> minibert's fused [3h, ...] with rows ordered [heads, 3, d]."""
    per_head = [t.reshape(heads, -1, *t.shape[1:]) for t in (q, k, v)]  # 3 x [heads, d, (h)]
    return torch.stack(per_head, dim=1).reshape(3 * q.shape[0], *q.shape[1:])  # [heads, 3, d, (h)] -> [3h, (h)]


def split_qkv(qkv, heads):
    """minibert's fused [3h, ...] -> HF's q, k, v, each [h, ...]. Inverse of fuse_qkv."""
    h = qkv.shape[0] // 3
    grouped = qkv.reshape(heads, 3, h // heads, *qkv.shape[1:])  # [3h, (h)] -> [heads, 3, d, (h)]
    return [grouped[:, j].reshape(h, *qkv.shape[1:]) for j in range(3)]  # 3 x [heads, d, (h)] -> [h, (h)]


def to_hf(model: BertModel, out_dir: str) -> None:
    """Write config.json + model.safetensors that transformers' from_pretrained loads
    (BertForPreTraining for post-LN, MegatronBertForPreTraining for pre-LN; *ForMaskedLM without SOP head)."""
    cfg = model.config
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if QKV in name:
            for hf, part in zip(qkv_hf_names(name), split_qkv(t, cfg.num_attention_heads)):
                tensors[hf] = part.contiguous()
            continue
        if name in PADDED_VOCAB:
            t = t[:cfg.vocab_size]  # drop Megatron's padded rows
        tensors[hf_name(name, cfg.post_ln)] = t.contiguous()
    model_type, with_head, without_head = ARCHITECTURES[cfg.post_ln]
    hf_config = {
        "architectures": [with_head if cfg.binary_head else without_head], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_size,
        "hidden_act": "gelu", "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "max_position_embeddings": cfg.max_positions,
        "type_vocab_size": 2, "initializer_range": cfg.init_method_std, "layer_norm_eps": cfg.layernorm_epsilon,
        "pad_token_id": 0, "tie_word_embeddings": True,
    }
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    atomic_write_bytes(os.path.join(out_dir, "config.json"), [(json.dumps(hf_config, indent=2) + "\n").encode()])


def from_hf(hf_dir: str, **overrides) -> BertModel:
    """A BertModel (fp32) holding the weights of a HF BERT / MegatronBERT pretraining checkpoint directory
    (save_pretrained's output). The layout comes from config.json's model_type; the binary head is kept
    when the weights hold it (cls.seq_relationship: Google's bert-base-uncased says "BertForMaskedLM" in
    its config yet ships the NSP head). `overrides` set Config fields, e.g. attention_backend="flash"."""
    hf = _read_json(os.path.join(hf_dir, "config.json"))
    post_ln = {"bert": True, "megatron-bert": False}.get(hf.get("model_type"))
    if post_ln is None:
        raise UsageError(f"{hf_dir}: model_type {hf.get('model_type')!r} is not supported; convert a "
                         "BERT (BertForPreTraining) or MegatronBERT (MegatronBertForPreTraining) checkpoint")
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "vocab_size")
    if any(key not in hf for key in required):
        raise UsageError(f"{hf_dir}/config.json lacks one of {', '.join(required)}: re-save it with save_pretrained")
    for key, wanted in (("hidden_act", "gelu"), ("type_vocab_size", 2), ("position_embedding_type", "absolute")):
        if hf.get(key, wanted) != wanted:
            raise UsageError(f"{hf_dir}/config.json: {key}={hf[key]!r}; minibert implements only {wanted!r}")
    weights = _read_hf_weights(hf_dir)
    config = Config(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                    num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
                    seq_length=hf["max_position_embeddings"], max_position_embeddings=hf["max_position_embeddings"],
                    vocab_size=hf["vocab_size"], layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
                    init_method_std=hf.get("initializer_range", 0.02),
                    hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                    attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                    post_ln=post_ln, bert_no_binary_head="cls.seq_relationship.weight" not in weights)
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise TypeError(f"from_hf: {key!r} is not a Config field")
        setattr(config, key, value)
    model = BertModel(config)
    model.load_state_dict(_from_hf_state(weights, model, hf_dir))
    return model


def _from_hf_state(weights: dict, model: BertModel, hf_dir: str) -> dict:
    cfg = model.config
    # old checkpoints (Google's TF conversions) name LayerNorm parameters gamma / beta
    weights = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): v
               for k, v in weights.items()}
    used, state = set(), {}

    def take(hf_key):
        if hf_key not in weights:
            raise UsageError(f"{hf_dir}: weight {hf_key} is missing; convert a complete BERT pretraining "
                             "checkpoint (with its cls.predictions LM head) written by save_pretrained")
        used.add(hf_key)
        return weights[hf_key]

    for name, ours in model.state_dict().items():
        if QKV in name:
            state[name] = fuse_qkv(*[take(k) for k in qkv_hf_names(name)], cfg.num_attention_heads)
        elif name in PADDED_VOCAB:
            theirs = take(hf_name(name, cfg.post_ln))
            state[name] = torch.cat([theirs, theirs.new_zeros(ours.shape[0] - theirs.shape[0], *theirs.shape[1:])])
        else:
            state[name] = take(hf_name(name, cfg.post_ln))
    decoder = weights.get("cls.predictions.decoder.weight")
    if decoder is not None and not torch.equal(decoder, weights["bert.embeddings.word_embeddings.weight"]):
        raise UsageError(f"{hf_dir}: the LM decoder is not tied to the word embeddings; minibert ties them")
    unused_pooler = () if cfg.binary_head else ("bert.pooler.dense.weight", "bert.pooler.dense.bias")
    unknown = set(weights) - used - set(TIED_OR_BUFFERS) - set(unused_pooler)
    if unknown:
        raise UsageError(f"{hf_dir}: weights minibert has no place for: {', '.join(sorted(unknown)[:5])}")
    return state


def _read_hf_weights(hf_dir: str) -> dict:
    """model.safetensors, its sharded form, or pytorch_model.bin (first found) -> {name: tensor}."""
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        return read_safetensors(single)
    if os.path.exists(index):
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        return {k: v for shard in shards for k, v in read_safetensors(os.path.join(hf_dir, shard)).items()}
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(binary):
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle/zip errors of every kind: the file is not a plain weights file
            raise UsageError(f"{binary} cannot be read as weights ({e}); re-save it with save_pretrained")
    raise UsageError(f"{hf_dir} holds no model.safetensors or pytorch_model.bin: pass a save_pretrained directory")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{path} not found: pass a directory written by save_pretrained (or to_hf)")
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e}): re-save the model")


# ---- safetensors: [8-byte little-endian header length N][N bytes of JSON header][raw tensor bytes] ----
# header: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {...}},
# offsets relative to the first byte after the header; tensors stored row-major, little-endian.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: str) -> dict:
    """A .safetensors file -> {name: CPU tensor}. A malformed file raises UsageError naming it."""
    def corrupt(why):
        return UsageError(f"{path} is not a valid safetensors file ({why}); re-save or re-download it")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}")
    if len(data) < 8:
        raise corrupt("shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise corrupt(f"header length {n} runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise corrupt(f"header is not JSON: {e}")
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise corrupt(f"{name}: unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or not 0 <= begin <= end <= len(body):
            raise corrupt(f"{name}: data_offsets {info['data_offsets']} do not fit shape {shape}")
        raw = bytearray(body[begin:end])  # a copy: writable and aligned for frombuffer
        tensors[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)
    return tensors


def write_safetensors(path: str, tensors: dict) -> None:
    """{name: tensor} -> a .safetensors file, written to a temporary name and renamed (never half-written)."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0  # transformers wants format "pt"
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # row-major bytes of any dtype
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # pad so the tensor data starts 8-byte aligned
    atomic_write_bytes(path, [len(text).to_bytes(8, "little"), text, *blobs])


