"""HuggingFace <-> minibert weights: `from_hf(hf_dir) -> BertModel`, `to_hf(model, out_dir)`, and a CLI:

    python -m minibert.tools.convert to-hf --load CKPT_DIR --output OUT    a minibert checkpoint -> a HF model folder
    python -m minibert.tools.convert from-hf HF_DIR --save DIR            a HF model folder -> minibert released weights

Two HF architectures match minibert's two layouts exactly (same math, only names and shapes differ):
  - BERT (model_type "bert")                  <-> post_ln=True  (embedding LayerNorm, LN after each add)
  - MegatronBERT (model_type "megatron-bert") <-> post_ln=False (Megatron's pre-LN: LN before attention and
    MLP (`attention.ln`, `ln`), a final `encoder.ln`, no embedding LayerNorm; HF's port keeps Megatron's
    placement, so no reordering is needed)
Each comes in three common shapes, all accepted by from_hf:
  - *ForPreTraining: everything (names "bert.*", the "cls.predictions" LM head, the "cls.seq_relationship" SOP head)
  - *ForMaskedLM: no pooler, no SOP head -> config.bert_no_binary_head
  - *Model (what sentence-transformers ship): the encoder and pooler only, named without the "bert." prefix
A head the checkpoint lacks is built fresh with minibert's own init (one warning line names it): the
encoder is pretrained, the head is not, until you train it.

Weight map ({i}: layer index; [pre] / [post]: only that layout; LN1 / LN2: input_layernorm /
pre_mlp_layernorm of minibert.model.bert.TransformerLayer):

| minibert | HF BERT | HF MegatronBERT | note |
|---|---|---|---|
| embedding.word_embeddings | bert.embeddings.word_embeddings | same | [padded_vocab, h] <-> [vocab, h] |
| embedding.position_embeddings | bert.embeddings.position_embeddings | same | |
| embedding.tokentype_embeddings | bert.embeddings.token_type_embeddings | same | |
| embedding.layernorm [post] | bert.embeddings.LayerNorm | - | |
| layers.{i}.input_layernorm | ...layer.{i}.attention.output.LayerNorm | ...layer.{i}.attention.ln | LN1 |
| layers.{i}.self_attention.query_key_value | ...layer.{i}.attention.self.{query,key,value} | same | [heads,3,d] |
| layers.{i}.self_attention.dense | ...layer.{i}.attention.output.dense | same | |
| layers.{i}.pre_mlp_layernorm | ...layer.{i}.output.LayerNorm | ...layer.{i}.ln | LN2 |
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
(torch.load with weights_only=True: a downloaded file never runs code). minibert/tools/safetensors_format.py
reads and writes the safetensors format itself."""
import argparse
import json
import os
import re
import sys

import torch

from minibert.atomic import atomic_write_bytes, require_new_directory
from minibert.config import Config
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error
from minibert.model.bert import BertModel
from minibert.tools.safetensors_format import read_safetensors, write_safetensors  # noqa: F401  (their old home)

# minibert name prefix -> (BERT prefix, MegatronBERT prefix); None = not in that layout
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
    "input_layernorm": ("attention.output.LayerNorm", "attention.ln"),
    "self_attention.dense": ("attention.output.dense",) * 2,
    "pre_mlp_layernorm": ("output.LayerNorm", "ln"),
    "mlp.dense_h_to_4h": ("intermediate.dense",) * 2,
    "mlp.dense_4h_to_h": ("output.dense",) * 2,
}
# The parts a checkpoint may lack: minibert module -> (HF name prefix, what to call it in the warning)
OPTIONAL_PARTS = {"lm_head": ("cls.predictions.", "LM head"), "pooler": ("bert.pooler.", "pooler"),
                  "binary_head": ("cls.seq_relationship.", "sentence-order head")}
BASE_MODEL_PREFIXES = ("embeddings.", "encoder.", "pooler.")  # a plain BertModel's names
QKV = "self_attention.query_key_value"
PADDED_VOCAB = ("embedding.word_embeddings.weight", "lm_head.bias")
TIED_OR_BUFFERS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.embeddings.position_ids")
ARCHITECTURES = {  # post_ln -> (model_type, with binary head, without)
    True: ("bert", "BertForPreTraining", "BertForMaskedLM"),
    False: ("megatron-bert", "MegatronBertForPreTraining", "MegatronBertForMaskedLM"),
}
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]"}


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


# ---- minibert -> HF ----
MAX_SHARD_SIZE = 5 * 10 ** 9  # transformers' own default for save_pretrained ("5GB")


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10^9 bytes, '200MiB' -> 200 * 2^20, '1000' -> 1000 (transformers' notation)."""
    units = {None: 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMG]I?B)?\s*", text, re.IGNORECASE)
    size = int(float(match[1]) * units[match[2] and match[2].upper()]) if match else 0
    if size <= 0:
        raise UsageError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB")
    return size


def write_weights(out_dir: str, tensors: dict, max_shard_size: int = MAX_SHARD_SIZE) -> list:
    """model.safetensors, or, above max_shard_size bytes, shards model-0000k-of-0000n.safetensors (each up to
    the limit, in the model's order; a larger tensor gets a shard of its own) and the index that maps each
    name to its shard, written last (transformers' format for large models). Returns the files written."""
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    if sum(sizes.values()) <= max_shard_size:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
        return ["model.safetensors"]
    shards, current, filled = [], {}, 0
    for name, t in tensors.items():
        if current and filled + sizes[name] > max_shard_size:
            shards.append(current)
            current, filled = {}, 0
        current[name] = t
        filled += sizes[name]
    shards.append(current)
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for file, shard in zip(files, shards):
        write_safetensors(os.path.join(out_dir, file), shard)
    _write_json(os.path.join(out_dir, "model.safetensors.index.json"),
                {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}})
    return files + ["model.safetensors.index.json"]


def to_hf(model: BertModel, out_dir: str, tokenizer=None, max_shard_size: int = MAX_SHARD_SIZE) -> list:
    """Write config.json + the weights that transformers' from_pretrained loads (BertForPreTraining for
    post-LN, MegatronBertForPreTraining for pre-LN; *ForMaskedLM without the SOP head): model.safetensors,
    or shards and their index above max_shard_size bytes. With a tokenizer
    (minibert.data.tokenizer.BertWordPieceTokenizer), also the files AutoTokenizer reads. Returns the files."""
    require_new_directory(out_dir, "--output")
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
    files = ["config.json"] + write_weights(out_dir, tensors, max_shard_size)
    _write_json(os.path.join(out_dir, "config.json"), hf_config)
    if tokenizer is None:
        return files
    # one token per line, in id order, exactly the model's vocab_size rows (HF's BertTokenizer reads ids
    # from line numbers); Megatron's [BOS]/[EOS] stay when the model was trained with them
    tokens = [tokenizer.inv_vocab[i] for i in range(cfg.vocab_size)]
    atomic_write_bytes(os.path.join(out_dir, "vocab.txt"), ["".join(t + "\n" for t in tokens).encode()])
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "BertTokenizer", "do_lower_case": tokenizer.lower_case,
        "model_max_length": cfg.max_positions, **SPECIAL_TOKENS})
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), SPECIAL_TOKENS)
    return files + ["vocab.txt", "tokenizer_config.json", "special_tokens_map.json"]


# ---- HF -> minibert ----
def from_hf(hf_dir: str, **overrides) -> BertModel:
    """A BertModel (fp32) holding the weights of a HF BERT / MegatronBERT directory (save_pretrained's
    output): *ForPreTraining, *ForMaskedLM or a plain *Model. The layout comes from config.json's
    model_type, the heads from the weights present: the binary head is kept when the weights hold the
    pooler or the SOP head (Google's bert-base-uncased says "BertForMaskedLM" in its config yet ships
    both). `overrides` set Config fields, e.g. attention_backend="flash"."""
    return _from_hf(hf_dir, **overrides)[0]


def _from_hf(hf_dir: str, **overrides):
    """-> (the BertModel, the run Config its shape came from)."""
    hf = _read_json(os.path.join(hf_dir, "config.json"))
    post_ln = {"bert": True, "megatron-bert": False}.get(hf.get("model_type"))
    if post_ln is None:
        raise UsageError(f"{hf_dir}: model_type {hf.get('model_type')!r} is not supported; convert a "
                         "BERT or MegatronBERT checkpoint (model_type 'bert' or 'megatron-bert')")
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "vocab_size")
    if any(key not in hf for key in required):
        raise UsageError(f"{hf_dir}/config.json lacks one of {', '.join(required)}: re-save it with save_pretrained")
    for key, wanted in (("hidden_act", "gelu"), ("type_vocab_size", 2), ("position_embedding_type", "absolute")):
        if hf.get(key, wanted) != wanted:
            raise UsageError(f"{hf_dir}/config.json: {key}={hf[key]!r}; minibert implements only {wanted!r}")
    weights = _canonical_names(_read_hf_weights(hf_dir))
    has = {part: any(k.startswith(prefix) for k in weights) for part, (prefix, _) in OPTIONAL_PARTS.items()}
    config = Config(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                    num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
                    seq_length=hf["max_position_embeddings"], max_position_embeddings=hf["max_position_embeddings"],
                    vocab_size=hf["vocab_size"], layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
                    init_method_std=hf.get("initializer_range", 0.02),
                    hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                    attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                    post_ln=post_ln, bert_no_binary_head=not (has["pooler"] or has["binary_head"]))
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise TypeError(f"from_hf: {key!r} is not a Config field")
        setattr(config, key, value)
    with torch.random.fork_rng():  # the fresh heads' init: the same every time, the caller's RNG untouched
        torch.manual_seed(config.seed)
        model = BertModel(config)
    fresh = [part for part in OPTIONAL_PARTS if getattr(model, part) is not None and not has[part]]
    model.load_state_dict(_from_hf_state(weights, model, hf_dir, keep=fresh))
    if fresh:
        what = " and no ".join(f"{OPTIONAL_PARTS[p][1]} ({OPTIONAL_PARTS[p][0].rstrip('.')})" for p in fresh)
        print(f"warning: {hf_dir} has no {what}: {' and '.join(fresh)} start from minibert's random init; "
              "train before trusting what they predict", file=sys.stderr, flush=True)
    return model, config


def _canonical_names(weights: dict) -> dict:
    """Every checkpoint's names as BertForPreTraining's: a plain BertModel (sentence-transformers) has no
    "bert." prefix; Google's TF conversions call LayerNorm parameters gamma / beta."""
    plain = not any(k.startswith("bert.") for k in weights)
    out = {}
    for k, v in weights.items():
        if plain and k.startswith(BASE_MODEL_PREFIXES):
            k = "bert." + k
        out[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    return out


def _from_hf_state(weights: dict, model: BertModel, hf_dir: str, keep=()) -> dict:
    """minibert's state dict from HF weights; the parts in `keep` stay as the model initialised them."""
    cfg = model.config
    used, state = set(), {}

    def take(hf_key, shape):
        if hf_key not in weights:
            raise UsageError(f"{hf_dir}: weight {hf_key} is missing; convert a complete BERT checkpoint "
                             "written by save_pretrained")
        if tuple(weights[hf_key].shape) != tuple(shape):
            raise UsageError(f"{hf_dir}: {hf_key} has shape {list(weights[hf_key].shape)} where config.json's sizes "
                             f"give {list(shape)}: the config does not describe these weights")
        used.add(hf_key)
        return weights[hf_key]

    for name, ours in model.state_dict().items():
        if name.split(".")[0] in keep:
            state[name] = ours
        elif QKV in name:  # three [h, ...] parts of our fused [3h, ...]
            part = (ours.shape[0] // 3, *ours.shape[1:])
            state[name] = fuse_qkv(*[take(k, part) for k in qkv_hf_names(name)], cfg.num_attention_heads)
        elif name in PADDED_VOCAB:
            theirs = take(hf_name(name, cfg.post_ln), (cfg.vocab_size, *ours.shape[1:]))
            state[name] = torch.cat([theirs, theirs.new_zeros(ours.shape[0] - theirs.shape[0], *theirs.shape[1:])])
        else:
            state[name] = take(hf_name(name, cfg.post_ln), ours.shape)
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


def _write_json(path: str, data: dict) -> None:
    atomic_write_bytes(path, [(json.dumps(data, indent=2) + "\n").encode()])


# ---- the command line ----
def hf_to_checkpoint(hf_dir: str, save_dir: str) -> str:
    """from-hf: HF_DIR -> SAVE/release/mp_rank_00/model_optim_rng.pt (+ SAVE/vocab.txt when HF_DIR has one)."""
    from minibert.training.checkpoint import save_weights
    require_new_directory(save_dir, "--save")  # never over a training run's checkpoints and tracker
    model, cfg = _from_hf(hf_dir)
    tokenizer_config = os.path.join(hf_dir, "tokenizer_config.json")
    lower = _read_json(tokenizer_config).get("do_lower_case", True) if os.path.exists(tokenizer_config) else True
    cfg.tokenizer_type = "BertWordPieceLowerCase" if lower else "BertWordPieceCase"
    vocab = os.path.join(hf_dir, "vocab.txt")
    if os.path.exists(vocab):  # fill_mask and to-hf look for SAVE/vocab.txt first
        with open(vocab, "rb") as f:
            atomic_write_bytes(os.path.join(save_dir, "vocab.txt"), [f.read()], make_dirs=True)
    return save_weights(save_dir, model, cfg)


def checkpoint_to_hf(load_dir: str, out_dir: str, max_shard_size: int = MAX_SHARD_SIZE) -> list:
    """to-hf: a minibert checkpoint directory -> OUT with config, weights and tokenizer files."""
    from minibert.tools.fill_mask import load_checkpoint_model, tokenizer_for_checkpoint
    require_new_directory(out_dir, "--output")  # before the checkpoint is read
    model, cfg = load_checkpoint_model(load_dir)
    return to_hf(model, out_dir, tokenizer=tokenizer_for_checkpoint(load_dir, cfg), max_shard_size=max_shard_size)


@exit_on_usage_error
def main(argv=None):
    parser = OneLineArgumentParser(prog="python -m minibert.tools.convert", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    to = commands.add_parser("to-hf", help="a minibert checkpoint -> a HuggingFace model folder")
    to.add_argument("--load", required=True, help="checkpoint directory (train.py --save, or from-hf --save)")
    to.add_argument("--output", required=True, help="folder for config.json, model.safetensors, vocab.txt, ...")
    to.add_argument("--max-shard-size", default="5GB", help="above this, the weights go into shards of up to this "
                    "size with model.safetensors.index.json, as save_pretrained writes them (default 5GB)")
    back = commands.add_parser("from-hf", help="a HuggingFace BERT folder -> minibert released weights")
    back.add_argument("hf_dir", help="a folder written by save_pretrained (config.json + weights)")
    back.add_argument("--save", required=True, help="checkpoint directory to write (release/ + tracker)")
    args = parser.parse_args(argv)
    if args.command == "to-hf":
        files = checkpoint_to_hf(args.load, args.output, parse_size(args.max_shard_size))
        print(f"wrote {args.output}: {', '.join(files)}")
    else:
        path = hf_to_checkpoint(args.hf_dir, args.save)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
