"""Ask a trained model to fill in the blanks: the masked-LM head, used for what it was trained on.

    python -m minibert.tools.fill_mask --load CKPT "the [MASK] sat on the mat." [--top-k 5] [--vocab-file V]

For each [MASK] in the text it prints the k most likely tokens, most likely first, with their
probabilities (the shape of the output; the tokens depend on the model):

    text:  [CLS] the [MASK] sat on the mat . [SEP]
    [MASK] 1 of 1 (position 2):
        0.xxxxxx  first choice
        0.xxxxxx  second choice
        ...

How it works, in four steps:
  1. Cut the text at each literal "[MASK]" and tokenize the pieces. The tokenizer alone would not do:
     like Google's (and Megatron's), it reads "[MASK]" typed in text as three ordinary words "[ mask ]",
     so that a corpus containing that string never hands the model an unlabelled mask token.
  2. Build [CLS] piece [MASK] piece ... [SEP], as the dataset builds a sample (one segment: types 0).
  3. One forward pass in eval mode (no dropout); softmax over the vocabulary at each [MASK] position.
  4. The top k of each distribution, with the WordPiece "##" kept so you see the piece the model chose.

CKPT is any checkpoint directory: a training run's --save (the latest iteration), released weights
(minibert.training.checkpoint.save_weights), or `python -m minibert.tools.convert from-hf HF_DIR --save CKPT`.
The tokenizer is found the way tokenizer_for_checkpoint says."""
import os

import torch

from minibert.data.tokenizer import build_tokenizer
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error

MASK = "[MASK]"


def tokenizer_for_checkpoint(checkpoint_dir: str, cfg, vocab_file=None):
    """The tokenizer a checkpoint was trained with. The vocab file is, first found: `vocab_file`;
    CKPT/vocab.txt (what from-hf writes); the --vocab-file the run was trained with (its args); the
    bundled bert-base-uncased vocab when it trained with that one. Its size must fit the model: equal to
    the model's vocab, or two more (Megatron's [BOS]/[EOS], which HF checkpoints do not have)."""
    if vocab_file is None and os.path.isfile(os.path.join(checkpoint_dir, "vocab.txt")):
        vocab_file = os.path.join(checkpoint_dir, "vocab.txt")
    if vocab_file is None and cfg.vocab_file:
        if not os.path.isfile(cfg.vocab_file):
            raise UsageError(f"the checkpoint in {checkpoint_dir} was trained with --vocab-file {cfg.vocab_file}, "
                             "which is not here: pass --vocab-file with that vocab")
        vocab_file = cfg.vocab_file
    if vocab_file is not None and not os.path.isfile(vocab_file):
        raise UsageError(f"--vocab-file {vocab_file} does not exist")
    tokenizer = build_tokenizer(cfg.tokenizer_type, vocab_file)
    if cfg.vocab_size not in (tokenizer.vocab_size, tokenizer.vocab_size - 2):
        raise UsageError(f"the vocab {tokenizer.vocab_file} has {tokenizer.vocab_size} tokens but the model in "
                         f"{checkpoint_dir} has {cfg.vocab_size}: pass the --vocab-file it was trained with")
    return tokenizer


def encode_with_masks(text: str, tokenizer, max_length: int):
    """'a [MASK] b' -> ([CLS] a [MASK] b [SEP] ids, positions of the masks)."""
    pieces = text.split(MASK)
    if len(pieces) == 1:
        raise UsageError(f"the text has no {MASK}: write {MASK} where the model should fill in a token, "
                         f"e.g. \"the {MASK} sat on the mat.\"")
    ids, positions = [tokenizer.cls], []
    for i, piece in enumerate(pieces):
        if i > 0:
            positions.append(len(ids))
            ids.append(tokenizer.mask)
        ids.extend(tokenizer.tokenize(piece))
    ids.append(tokenizer.sep)
    if len(ids) > max_length:
        raise UsageError(f"the text is {len(ids)} tokens with [CLS] and [SEP], but the model has "
                         f"{max_length} positions: shorten it")
    return ids, positions


def load_checkpoint_model(checkpoint_dir: str):
    """reshard.load_model, with one clear error (and no "starting from scratch" warning, which is for
    training) when the folder holds no checkpoint."""
    from minibert.tools.reshard import load_model
    from minibert.training.checkpoint import tracker_path
    if not os.path.isfile(tracker_path(checkpoint_dir)):
        raise UsageError(f"{checkpoint_dir} holds no checkpoint (no {os.path.basename(tracker_path(checkpoint_dir))}): "
                         "pass a directory written by train.py --save or by python -m minibert.tools.convert from-hf --save")
    return load_model(checkpoint_dir, attention_backend="local")


@torch.no_grad()
def fill_mask(model, tokenizer, text: str, top_k: int = 5):
    """-> (ids, [(position, [(token, probability), ...top_k]) for each [MASK]])."""
    ids, positions = encode_with_masks(text, tokenizer, model.config.max_positions)
    model.eval()
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)  # [1, s]
    logits = model(tokens, torch.zeros_like(tokens)).lm_logits[0, positions].float()  # [masks, vocab]
    probabilities = logits.softmax(dim=-1)
    top = probabilities.topk(min(top_k, probabilities.shape[-1]), dim=-1)
    results = []
    for position, values, indices in zip(positions, top.values.tolist(), top.indices.tolist()):
        results.append((position, list(zip(tokenizer.convert_ids_to_tokens(indices), values))))
    return ids, results


@exit_on_usage_error
def main(argv=None):
    parser = OneLineArgumentParser(prog="python -m minibert.tools.fill_mask",
                                   description="Print the most likely tokens for each [MASK] in a text.")
    parser.add_argument("text", help='text with one or more [MASK], e.g. "the [MASK] sat on the mat."')
    parser.add_argument("--load", required=True, help="checkpoint directory (a training --save, or released weights)")
    parser.add_argument("--top-k", type=int, default=5, help="tokens to print per [MASK] (default 5)")
    parser.add_argument("--vocab-file", default=None, help="the vocab the model was trained with (default: found "
                        "from the checkpoint)")
    args = parser.parse_args(argv)
    if args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: ask for at least 1 token")
    model, cfg = load_checkpoint_model(args.load)
    tokenizer = tokenizer_for_checkpoint(args.load, cfg, args.vocab_file)
    ids, results = fill_mask(model, tokenizer, args.text, args.top_k)
    print("text: ", " ".join(tokenizer.convert_ids_to_tokens(ids)))
    for n, (position, candidates) in enumerate(results, 1):
        print(f"{MASK} {n} of {len(results)} (position {position}):")
        for token, probability in candidates:
            print(f"    {probability:.6f}  {token}")


if __name__ == "__main__":
    main()
