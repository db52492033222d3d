"""The rule-based splitter on hand-written tricky cases (expected splits written by a person, one
case per rule of the module docstring), plus the invariant that splitting loses no text."""
import re

import pytest

from minibert.data.sentence_split import split_sentences

CASES = [
    # plain ends: . ! ? and runs of them
    ("The cat sat. The dog ran! Did it? Yes?! Fine.",
     ["The cat sat.", "The dog ran!", "Did it?", "Yes?!", "Fine."]),
    # titles and Latin abbreviations
    ("Mr. Smith and Dr. Jones met Prof. Lee at St. Paul's. They talked.",
     ["Mr. Smith and Dr. Jones met Prof. Lee at St. Paul's.", "They talked."]),
    ("Bring fruit, bread, etc. Then we eat.", ["Bring fruit, bread, etc. Then we eat."]),  # known miss
    ("Smith et al. Found it first. Really.", ["Smith et al. Found it first.", "Really."]),
    # dotted abbreviations and initials
    ("Use a list, e.g. Python's list. Or a tuple, i.e. An immutable one.",
     ["Use a list, e.g. Python's list.", "Or a tuple, i.e. An immutable one."]),
    ("She moved to the U.S. in 1990. It rained.", ["She moved to the U.S. in 1990.", "It rained."]),
    ("J. R. R. Tolkien wrote it. John F. Kennedy read it.",
     ["J. R. R. Tolkien wrote it.", "John F. Kennedy read it."]),
    ("We met at 9 a.m. Everyone came.", ["We met at 9 a.m. Everyone came."]),  # known miss
    # abbreviations before numbers; a number may start a sentence otherwise
    ("See Fig. 2 and No. 7 on Jan. 5. 12 people came.",
     ["See Fig. 2 and No. 7 on Jan. 5.", "12 people came."]),
    ("Turn to p. 4 now. Fig. It was a fig.", ["Turn to p. 4 now.", "Fig.", "It was a fig."]),
    # decimals, versions, file names: no whitespace after the dot
    ("Pi is 3.14159 roughly. Python 3.12 is out. Edit os.path now.",
     ["Pi is 3.14159 roughly.", "Python 3.12 is out.", "Edit os.path now."]),
    ("The total was 4.5. Then it fell.", ["The total was 4.5.", "Then it fell."]),
    # ellipses: one end; split only when a capital follows
    ("Well... maybe. Wait... What now? Hmm… Fine.",
     ["Well... maybe.", "Wait...", "What now?", "Hmm…", "Fine."]),
    ("It went on . . . and on.", ["It went on . . . and on."]),
    # closing quotes and brackets stay with their sentence
    ('He said "Stop." Then he left. (It was late.) "Why?" she asked.',
     ['He said "Stop."', "Then he left.", "(It was late.)", '"Why?" she asked.']),
    ("“Go home.” ‘Now.’ [Sic.] Done.", ["“Go home.”", "‘Now.’", "[Sic.]", "Done."]),
    # lowercase after the terminator: no split
    ('"Hello!" he said. "Goodbye?" she asked, and left.',
     ['"Hello!" he said.', '"Goodbye?" she asked, and left.']),
    ("it ends. but not here. Here yes.", ["it ends. but not here.", "Here yes."]),
    # non-ASCII capitals start sentences too
    ("Il pleut. Élise sort.", ["Il pleut.", "Élise sort."]),
    # whitespace: newlines, tabs, runs; blank lines always split
    ("One.\nTwo.\t  Three.", ["One.", "Two.", "Three."]),
    ("A heading\n\nFirst paragraph. Second\n \n  third", ["A heading", "First paragraph.", "Second",
                                                          "third"]),
    # nothing to split
    ("no terminal punctuation", ["no terminal punctuation"]),
    ("  Trailing space.  ", ["Trailing space."]),
    ("", []),
    ("   \n\n  ", []),
    ("...", ["..."]),
]


@pytest.mark.parametrize("text, expected", CASES, ids=[c[0][:30] for c in CASES])
def test_tricky_cases(text, expected):
    assert split_sentences(text) == expected


@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_no_text_is_lost_and_pieces_are_stripped(text):
    sentences = split_sentences(text)
    assert re.sub(r"\s", "", "".join(sentences)) == re.sub(r"\s", "", text)
    assert all(s and s == s.strip() and s in text for s in sentences)
