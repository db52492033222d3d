"""A small rule-based English sentence splitter (no downloads, no trained model).

Why BERT needs sentences: the sentence-order task (SOP) cuts each training sample between two
sentences of one document, so `preprocess --split-sentences` stores every sentence as its own
sequence. Megatron-LM splits with NLTK's Punkt, a model trained on a corpus and downloaded at run
time; minibert uses a handful of readable rules instead, good enough for well-edited English prose.

The rules, applied left to right:

  1. A blank line (two newlines, maybe with spaces between) always ends a sentence: headings and
     paragraphs without final punctuation stay apart.
  2. A candidate end is a run of terminators  .  !  ?  …  (so "?!" and the ellipsis "..." are one end)
     followed by any closing quotes or brackets  " ' ” ’ ) ]  (they stay with the sentence), then
     whitespace.
  3. The candidate is a sentence end only if the next sentence visibly starts: its first character is
     an uppercase letter, a digit, or an opening quote or bracket  " ' “ ‘ ( [ .
     So "e.g. the", "... and then", "3.14" (no space) and "Hello!" he said (lowercase) never split.
  4. A single "." does not end a sentence after
       - a title or Latin abbreviation that is always followed by more of the sentence:
         Mr. Mrs. Ms. Dr. Prof. St. Jr. Sr. vs. etc. cf. et al. ... (TITLES below);
       - a dotted abbreviation: U.S. e.g. i.e. a.m. (single letters joined by dots);
       - an initial: one uppercase letter, as in "J. R. R. Tolkien";
       - an abbreviation that announces a number, when a digit follows: No. 5, Fig. 2, Jan. 3, pp. 10.
     "!" "?" and "…" always end a sentence under rule 3.

Picture ("|" marks the splits):

    Dr. Smith met J. R. R. Tolkien in the U.S. in 1950.| "Really?" she asked.| Yes! See Fig. 3.|

Known misses (the price of rules over a model): "He moved to the U.S. Then..." stays one
sentence (a dotted abbreviation may end a sentence), and so does a sentence ending in "etc." or in
a single capital ("plan B."), and "I said no. 5 left." is not split ("no" before a digit reads
as "No. 5"). For BERT pretraining a missed or extra split only moves an SOP cut."""
import re

# Always followed by more of the sentence (compared lowercased, without the final ".").
TITLES = frozenset("""
    mr mrs ms mx dr prof rev fr st sr jr gen col capt lt sgt cmdr adm gov sen rep hon pres supt
    messrs mme mlle vs etc cf al approx viz
""".split())
# Abbreviations that announce a number: no split when a digit comes next.
BEFORE_NUMBER = frozenset("""
    no nos fig figs vol vols p pp eq eqs sec ch art ref ed op chap
    jan feb mar apr jun jul aug sep sept oct nov dec
""".split())

OPENERS = "\"'“‘(["
# rule 2: terminators, closing quotes/brackets, whitespace; the next character is looked at, not eaten
CANDIDATE = re.compile(r"(?P<end>[.!?…]+)(?P<close>[\"'”’)\]]*)\s+(?=(?P<next>\S))")
BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n\s*")
DOTTED = re.compile(r"(?:[^\W\d_]\.)+[^\W\d_]")  # U.S  e.g  i.e  a.m  (the final "." is the end)


def _word_before(text, pos):
    """The whitespace-delimited word ending at text[pos], without opening quotes/brackets."""
    start = pos
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:pos].lstrip(OPENERS)


def _is_sentence_end(text, match):
    """Rules 3 and 4 for one candidate."""
    nxt = match.group("next")
    if not (nxt.isupper() or nxt.isdigit() or nxt in OPENERS):
        return False  # rule 3: the next sentence must visibly start
    if match.group("end") != ".":
        return True  # ! ? … ?! ... always end
    word = _word_before(text, match.start())
    lower = word.lower()
    if lower in TITLES or DOTTED.fullmatch(word) or (len(word) == 1 and word.isupper()):
        return False
    if lower in BEFORE_NUMBER and nxt.isdigit():
        return False
    return True


def _split_paragraph(text):
    sentences, start = [], 0
    for match in CANDIDATE.finditer(text):
        if _is_sentence_end(text, match):
            sentences.append(text[start:match.end("close")])
            start = match.end()
    sentences.append(text[start:])
    return sentences


def split_sentences(text):
    """Split `text` into sentences: stripped substrings of `text`, in order, none empty."""
    sentences = []
    for paragraph in BLANK_LINE.split(text):  # rule 1
        sentences.extend(s.strip() for s in _split_paragraph(paragraph))
    return [s for s in sentences if s]
