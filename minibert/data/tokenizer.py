"""BERT's WordPiece tokenizer: text -> token ids, as Google's BERT (and so Megatron-LM) computes them.

Two stages. The *basic* stage cuts text into words; the *WordPiece* stage cuts each word into
vocabulary pieces, greedily taking the longest piece that is in the vocab:

    "Héllo,\u00a0WORLD!  unaffable 你好"
      clean        drop NUL, U+FFFD and control/format chars (Cc, Cf); any whitespace -> " "
      CJK          put spaces around each CJK ideograph      -> "... unaffable  你  好 "
      lower case   lower() then NFD and drop accents (Mn)     -> "hello, world!  unaffable  你  好 "
      split        on whitespace, then every punctuation char is a word of its own
                   -> hello  ,  world  !  unaffable  你  好
      WordPiece    unaffable -> una ##ffa ##ble  ("##" = continues the previous piece)
                   a word with no split into vocab pieces, or longer than 200 chars -> [UNK]

Cased tokenizers (BertWordPieceCase) skip the lower-casing and accent stripping.
No [CLS]/[SEP] is added here: the dataset adds them when it builds samples.

Where Google's tokenization.py and HuggingFace `tokenizers` disagree we follow Google's, because
Megatron-LM tokenizes with a copy of it (megatron/training/tokenizer/bert_tokenization.py):
"[MASK]" typed in raw text is three words "[", "mask", "]" (HF matches it as the special token);
only Cc/Cf characters are dropped (HF also drops private-use ones); words of 101-200 characters are
WordPiece'd (HF: [UNK]); Python's lower() turns a word-final capital sigma into "ς" (HF: "σ");
Unicode categories come from Python's unicodedata (HF's tables are older). tests/test_tokenizer.py
shows each case. Megatron also appends [BOS] and [EOS] to the vocab (ids 30522, 30523 for
bert-base-uncased): we do too, because the masking draws random replacement tokens from all ids.

Speed, in pure Python: whole-text passes run in C (a regex for odd characters, lower(), split());
each whitespace-separated chunk ("world!") is looked up in a cache of chunk -> ids, so the
per-character work runs once per distinct chunk. The cache is a plain dict emptied when it reaches
CACHE_SIZE entries: by Zipf's law the frequent chunks are back in it at once, and a bound keeps a
long preprocessing run from growing without limit (an LRU would cost more per lookup than it saves).
"""
import itertools
import os
import re
import unicodedata

from minibert.errors import UsageError

DEFAULT_VOCAB_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vocab",
                                  "bert-base-uncased-vocab.txt")  # minibert/vocab/
MAX_WORD_CHARS = 200     # longer words become [UNK]: Google's/Megatron's limit (HF tokenizers: 100)
CACHE_SIZE = 1 << 18     # chunks remembered (~60 MB at most); covers a Zipfian corpus's head
MEGATRON_EXTRA_TOKENS = ("[BOS]", "[EOS]")  # Megatron's _BertWordPieceTokenizer appends these
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # Megatron's detokenize

# Anything but printable ASCII, tab, newline and carriage return needs a look (controls, Unicode).
_ODD_CHARS = re.compile(r"[^\t\n\r -~]+")
# In clean ASCII every char that is not a letter or digit (or space) is punctuation.
_ASCII_WORDS = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9]")


def is_cjk(cp):
    """Google's "Chinese character": the CJK Unified Ideographs blocks and compatibility ideographs
    (not Hangul, Hiragana or Katakana, which are written with spaces between words)."""
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def clean_char(char):
    """What the basic stage turns one character into, before lower-casing: "" (dropped), " "
    (whitespace), " c " (a CJK ideograph stands alone) or the character itself."""
    if char in "\t\n\r":
        return " "
    category = unicodedata.category(char)
    if char == "\0" or char == "\ufffd" or category in ("Cc", "Cf"):
        return ""
    if category == "Zs":
        return " "
    if is_cjk(ord(char)):
        return f" {char} "
    return char


def is_punctuation(char):
    """ASCII non-alphanumerics ($, ^, ` included though Unicode calls them symbols) and Unicode P*."""
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def strip_accents(word):
    """NFD splits "é" into "e" + U+0301 (a non-spacing mark, category Mn); dropping the Mn leaves "e"."""
    return "".join(c for c in unicodedata.normalize("NFD", word) if unicodedata.category(c) != "Mn")


def split_on_punctuation(word):
    """'world!)' -> ['world', '!', ')']: each punctuation character becomes a word of its own."""
    if word.isascii():
        return _ASCII_WORDS.findall(word)
    words, current = [], []
    for char in word:
        if is_punctuation(char):
            if current:
                words.append("".join(current))
                current = []
            words.append(char)
        else:
            current.append(char)
    if current:
        words.append("".join(current))
    return words


class _Memo(dict):
    """A dict that fills itself: a missing key is computed by `compute(key)` and remembered; when
    `max_size` keys are held it starts over empty."""

    def __init__(self, compute, max_size):
        super().__init__()
        self.compute, self.max_size = compute, max_size

    def __missing__(self, key):
        value = self.compute(key)
        if len(self) >= self.max_size:
            self.clear()
        self[key] = value
        return value


def load_vocab(vocab_file):
    """vocab.txt (one token per line, id = line number) -> dict token -> id, checked."""
    if not vocab_file or not os.path.isfile(vocab_file):
        raise UsageError(f"vocab file {vocab_file!r} not found: pass --vocab-file with a BERT vocab.txt "
                         f"(one token per line), e.g. {DEFAULT_VOCAB_FILE}")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            tokens = [line.strip() for line in f]  # as Google's load_vocab: strip each line
    except UnicodeDecodeError as e:
        raise UsageError(f"vocab file {vocab_file} is not UTF-8 text ({e}): pass a BERT vocab.txt") from None
    if not tokens:
        raise UsageError(f"vocab file {vocab_file} is empty: pass a BERT vocab.txt (one token per line)")
    vocab = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise UsageError(f"vocab file {vocab_file} lists {token!r} twice (lines {vocab[token] + 1} and "
                             f"{i + 1}): each line must hold a different token")
        vocab[token] = i
    missing = [t for t in ("[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in vocab]
    if missing:
        raise UsageError(f"vocab file {vocab_file} has no {', '.join(missing)}: pass a BERT WordPiece "
                         "vocab.txt")
    return vocab


class BertWordPieceTokenizer:
    """BERT WordPiece with Megatron's interface: tokenize(text) -> ids, detokenize(ids) -> text,
    vocab_size, cls/sep/mask/pad (and bos/eos) ids, vocab (token -> id), inv_vocab (id -> token)."""

    def __init__(self, vocab_file=None, lower_case=True):
        self.vocab_file = DEFAULT_VOCAB_FILE if vocab_file is None else vocab_file
        self.lower_case = lower_case
        self.vocab = load_vocab(self.vocab_file)
        self.max_piece_chars = max(map(len, self.vocab))  # no longer piece can be in the vocab
        for token in MEGATRON_EXTRA_TOKENS:  # after max_piece_chars: they never match text
            self.vocab.setdefault(token, len(self.vocab))
        self.inv_vocab = {i: token for token, i in self.vocab.items()}
        self.unk = self.vocab["[UNK]"]
        self.cls, self.sep = self.vocab["[CLS]"], self.vocab["[SEP]"]
        self.mask, self.pad = self.vocab["[MASK]"], self.vocab["[PAD]"]
        self.bos, self.eos = self.vocab["[BOS]"], self.vocab["[EOS]"]
        self._clean_chars = _Memo(clean_char, CACHE_SIZE)  # char -> what cleaning makes of it
        self._chunk_ids = _Memo(self._encode_chunk, CACHE_SIZE)  # "world!" -> ids
        self._word_ids = _Memo(self.wordpiece, CACHE_SIZE)  # "world" -> ids ("world," shares it)

    def __reduce__(self):  # pickled for worker processes: send the recipe, not the caches
        return BertWordPieceTokenizer, (self.vocab_file, self.lower_case)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def tokenize(self, text):
        """text -> list of token ids (no [CLS]/[SEP])."""
        if _ODD_CHARS.search(text):  # rare in English: controls, non-ASCII
            text = _ODD_CHARS.sub(self._clean_run, text)
        if self.lower_case:
            text = text.lower()  # the whole text at once: whitespace never changes a word's lower()
        return list(itertools.chain.from_iterable(map(self._chunk_ids.__getitem__, text.split())))

    def _clean_run(self, match):
        return "".join(map(self._clean_chars.__getitem__, match.group()))

    def _encode_chunk(self, chunk):
        """One cleaned, lower-cased whitespace-free chunk ("world!") -> tuple of ids."""
        if self.lower_case and not chunk.isascii():
            chunk = strip_accents(chunk)
        return tuple(itertools.chain.from_iterable(map(self._word_ids.__getitem__,
                                                        split_on_punctuation(chunk))))

    def wordpiece(self, word):
        """Greedy longest-match-first: 'unaffable' -> 'una' (the longest vocab entry it starts with),
        then '##ffa', '##ble' from the rest. A word that some position has no piece for, or that is
        longer than MAX_WORD_CHARS, is [UNK] as a whole."""
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        whole_word = self.vocab.get(word)
        if whole_word is not None:  # most words are: skip the search
            return [whole_word]
        ids, start = [], 0
        while start < len(word):
            prefix = "##" if start > 0 else ""
            for end in range(min(len(word), start + self.max_piece_chars), start, -1):
                piece_id = self.vocab.get(prefix + word[start:end])
                if piece_id is not None:
                    ids.append(piece_id)
                    start = end
                    break
            else:
                return [self.unk]
        return ids

    def convert_ids_to_tokens(self, ids):
        return [self.inv_vocab[int(i)] for i in ids]

    def detokenize(self, ids):
        """Megatron's decode: join pieces, glue '##' continuations, tidy spaces before , . ! ? 's."""
        text = " ".join(self.convert_ids_to_tokens(ids)).replace(" ##", "").strip()
        for before, after in _CLEANUP:
            text = text.replace(before, after)
        return text


def build_tokenizer(tokenizer_type, vocab_file=None):
    """Megatron's --tokenizer-type names: BertWordPieceLowerCase (uncased) or BertWordPieceCase."""
    lower_case = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}.get(tokenizer_type)
    if lower_case is None:
        raise UsageError(f"--tokenizer-type {tokenizer_type!r} is not supported: use BertWordPieceLowerCase "
                         "or BertWordPieceCase")
    return BertWordPieceTokenizer(vocab_file, lower_case=lower_case)
