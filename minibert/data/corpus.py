"""Two corpora that need no download: real English from Python's own documentation, and the course's
synthetic lines.

The default corpus is the prose that every Python installation already holds:

    pydoc_data.topics          the language reference sections that help("assert") shows
    stdlib docstrings          the triple-quoted string that opens a module, class or function
    stdlib comment blocks      runs of "# ..." lines
                                 of the modules in SOURCE_MODULES, read as text, never imported

Each text is cut into paragraphs at blank lines. A paragraph is prose when its lines line up (no
code nested under it), no line looks like code, a table, an option list or a heading underline,
at least 85% of it is letters and spaces, and it ends like a sentence. Consecutive prose paragraphs
of one text make one document, kept when it has at least 2 sentences (BERT's sentence-order task
needs two). Whitespace is collapsed, so a document is one line; repeated documents are dropped.

    "Assert statements are a convenient way to insert debugging assertions into a program:"
    "   assert_stmt ::= ..."                  <- code: ends the run
    "The simple form, ... is equivalent to"   <- ends without . ! ? : -> not prose
    "These equivalences assume ... In the current implementation, ..."  -> a document

CPython 3.11.7 gives 3468 documents, 1.11 MB (Debian's 3.11.2: 3417, 1.11 MB). The order is
fixed (topics by name, then the modules in SOURCE_MODULES order, files sorted, texts in source
order), so a given Python always gives the same corpus; another Python version ships other docs,
so it gives another corpus.

The long-document corpus (--long-documents) is the same prose grouped by where it comes from: one
document per pydoc topic and one per module of SOURCE_MODULES (all its files' prose, in order), the
sources under LONG_MIN_CHARS characters left out. CPython 3.11.7 gives 80 documents, 0.99 MB, of 929
to 20,222 tokens (median 1,927): like Wikipedia articles, long enough that most of Megatron's seq-512
samples are full, where the default corpus's paragraphs fill a tenth of one (tests/test_corpus.py
measures both; `python -m minibert.data.masked_lm --lengths` prints the histogram).

The synthetic corpus is chapter 2's generator, exactly: random.seed(42), 2000 lines of the same 8
words repeated; its lines have no sentence punctuation, so each is a one-sentence document.

    python -m minibert.data.corpus --output data/corpus.txt [--synthetic | --long-documents]
"""
import ast
import inspect
import os
import random
import re
import sys
import sysconfig
import warnings

if __package__ in (None, ""):  # `python minibert/data/corpus.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from minibert.atomic import atomic_write  # noqa: E402
from minibert.errors import OneLineArgumentParser, UsageError, exit_on_usage_error  # noqa: E402

# Modules (or packages: all their .py files) of the core standard library, present in every CPython
# 3.11+ install we know (Debian's split packages included) and not scheduled for removal. Sorted.
SOURCE_MODULES = tuple("""
    _collections_abc _pydecimal _pyio argparse ast asyncio base64 bdb bisect calendar cmd code codecs
    collections concurrent configparser contextlib copy csv ctypes dataclasses datetime difflib doctest
    email enum fileinput fnmatch fractions ftplib functools gettext glob graphlib gzip heapq hmac html
    http imaplib importlib inspect ipaddress json locale logging lzma mimetypes multiprocessing operator
    optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib pprint pstats pydoc
    queue random re sched selectors shelve shlex shutil site smtplib socket socketserver sqlite3 ssl
    statistics string subprocess tarfile tempfile textwrap threading timeit tokenize traceback typing
    unittest urllib uuid warnings weakref wsgiref xml xmlrpc zipfile zipimport""".split())
MIN_CORPUS_BYTES = 1_000_000  # a corpus big enough that a small BERT does not just memorize it
MIN_SENTENCES = 2             # the sentence-order (SOP) task splits a document between sentences
MIN_LETTER_FRACTION = 0.85    # prose is words; code and tables are mostly symbols
LONG_MIN_CHARS = 4000         # ~1000 tokens: two seq-512 samples at least, so few end half empty
LONG_MIN_CORPUS_BYTES = 900_000  # the long sources hold ~90% of the prose (CPython 3.11: 0.99 MB)

SYNTHETIC_WORDS = ["the", "model", "train", "data", "gpu", "batch", "layer", "attention"]
SYNTHETIC_SEED, SYNTHETIC_LINES = 42, 2000  # chapter 2's random.seed(42) and range(2000)

# A docstring, the cheap way: a triple-quoted string at the start of the file or right after a line
# ending in ':' (a def/class header). ast.parse would find them exactly, but parsing these modules
# took many times longer than this regex (bench/notes/preprocess.md).
_DOCSTRING = re.compile(r"""(?:\A(?:[ \t]*(?:\#[^\n]*)?\n)*|:[ \t]*(?:\#[^\n]*)?\n)\s*"""
                        r"""([rRuU]?)(\"\"\"|''')(.*?)\2""", re.S)
_SENTENCE_END = re.compile(r"""[a-z0-9)\]"'*][.!?]["')\]]*(?=\s+["'(*]?[A-Z]|$)""")
_PROSE_END = re.compile(r"""[.!?:]["')\]]*$""")
_CODE_STARTS = (">>>", "...", "|", "+-", "+=", "$ ", "%")
# Two or more spaces that do not follow a sentence's end: the columns of a table or an option list.
_COLUMN_GAP = re.compile(r"""[^.:?!"')\]\s]\s{2,}\S|[^.:?!]["')\]]\s{2,}\S""")
_LETTERS = re.compile(r"[A-Za-z ]")


def is_prose(lines):
    """Does this paragraph (a list of lines) read as prose? See the module docstring for the rules."""
    first_indent = len(lines[0]) - len(lines[0].lstrip())
    other_indents = {len(line) - len(line.lstrip()) for line in lines[1:]}
    if len(other_indents) > 1 or any(indent > first_indent + 4 for indent in other_indents):
        return False  # ragged: code or a nested block under a header line
    for line in lines:
        stripped = line.strip()
        if (stripped.startswith(_CODE_STARTS) or "::=" in stripped or _COLUMN_GAP.search(stripped)
                or not any(c.isalnum() for c in stripped)):
            return False  # code, a grammar rule, a table or option list, an underline
    text = " ".join(lines)
    return (len(_LETTERS.findall(text)) >= MIN_LETTER_FRACTION * len(text)
            and _PROSE_END.search(text.rstrip()) is not None)


def prose_documents(text):
    """Cut `text` at blank lines; yield each run of consecutive prose paragraphs with >= 2 sentences,
    as one line with single spaces."""
    run = []
    for paragraph in re.split(r"\n[ \t]*\n", text) + [""]:
        lines = [line.rstrip() for line in paragraph.split("\n") if line.strip()]
        if lines and is_prose(lines):
            run.append(" ".join(" ".join(lines).split()))
            continue
        document = " ".join(run)
        run = []
        if len(_SENTENCE_END.findall(document)) >= MIN_SENTENCES:
            yield document


def docstrings(source):
    """The docstrings of a module's source text, in source order (see _DOCSTRING)."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. 3.12's SyntaxWarning for an odd escape in a false match
        for match in _DOCSTRING.finditer(source):
            prefix, quotes, body = match.groups()
            try:
                value = ast.literal_eval(prefix + quotes + body + quotes)  # resolves escapes exactly
            except (SyntaxError, ValueError):
                continue  # not a plain string literal after all
            found.append(inspect.cleandoc(value))
    return found


def comment_blocks(source):
    """Runs of whole-line '#' comments, the '#' removed; a bare '#' line becomes a blank line."""
    blocks, block = [], []
    for line in source.split("\n") + [""]:
        stripped = line.lstrip()
        if stripped.startswith("#") and not stripped.startswith(("#!", "# -*-")):
            text = stripped[1:]
            block.append(text[1:] if text.startswith(" ") else text)
        elif block:
            blocks.append("\n".join(block))
            block = []
    return blocks


def module_files(stdlib_dir, name):
    """The .py files of a module or package, sorted; [] when this install lacks its source."""
    path = os.path.join(stdlib_dir, *name.split("."))
    if os.path.isfile(path + ".py"):
        return [path + ".py"]
    files = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "test", "tests"))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


def source_texts():
    """(source, its texts) in the corpus's fixed order: each pydoc topic by name, then each module of
    SOURCE_MODULES with the docstrings and comment blocks of its files (sorted), in source order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        topics = {}
    sources = [(f"topic {name}", [topics[name]]) for name in sorted(topics)]
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    for name in SOURCE_MODULES:
        texts = []
        for path in module_files(stdlib_dir, name):
            with open(path, encoding="utf-8") as f:
                source = f.read()
            texts += docstrings(source)
            texts += comment_blocks(source)
        sources.append((name, texts))
    return sources


def _check_size(documents, minimum, what):
    size = sum(len(d.encode("utf-8")) + 1 for d in documents)
    if size < minimum:
        raise UsageError(f"this Python ({sys.executable}) ships only {size / 1e6:.2f} MB of documentation "
                         f"prose (pydoc_data, stdlib sources), less than the {minimum / 1e6:.1f} MB "
                         f"{what} needs: use a full CPython install, --synthetic, or your own corpus")
    return documents


def default_corpus_documents():
    """Real English from this Python's docs: one string per document (no newlines), fixed order."""
    texts = [text for _, source in source_texts() for text in source]
    documents = list(dict.fromkeys(d for text in texts for d in prose_documents(text)))  # dedupe, keep order
    return _check_size(documents, MIN_CORPUS_BYTES, "the default corpus")


def long_corpus_documents():
    """The same prose, one document per source (a whole pydoc topic; all of one module's docstrings and
    comments), in the same order; sources under LONG_MIN_CHARS characters are left out. Wikipedia-like
    lengths: most of a source's BERT samples fill --seq-length 512."""
    seen, documents = set(), []
    for _, texts in source_texts():
        runs = [run for text in texts for run in prose_documents(text) if not (run in seen or seen.add(run))]
        document = " ".join(runs)  # each run is one line already: the source's prose, one line
        if len(document) >= LONG_MIN_CHARS:
            documents.append(document)
    return _check_size(documents, LONG_MIN_CORPUS_BYTES, "the long-document corpus")


def synthetic_corpus_lines():
    """Chapter 2's sample.txt lines, exactly: the same draws as its global random.seed(42) code."""
    rng = random.Random(SYNTHETIC_SEED)  # our own generator: the global one stays untouched
    lines = []
    for _ in range(SYNTHETIC_LINES):
        words = SYNTHETIC_WORDS * rng.randint(3, 8)
        lines.append(" ".join(words[:rng.randint(10, 30)]))
    return lines


def write_text_atomically(path, text):
    """Write to a temporary name in the same directory, then rename: no half-written file, ever."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"cannot write {path}: directory {directory} does not exist (create it first)")
    if os.path.isdir(path):
        raise UsageError(f"cannot write {path}: it is a directory (name a file)")
    atomic_write(path, lambda f: f.write(text), text=True)


def write_default_corpus(path, long_documents=False):
    """One document per line, newline-terminated. Returns the number of documents."""
    documents = long_corpus_documents() if long_documents else default_corpus_documents()
    write_text_atomically(path, "".join(d + "\n" for d in documents))
    return len(documents)


def write_synthetic_corpus(path):
    """Chapter 2's file byte for byte: lines joined by '\\n', no final newline. Returns the line count."""
    lines = synthetic_corpus_lines()
    write_text_atomically(path, "\n".join(lines))
    return len(lines)


@exit_on_usage_error
def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="file to write, one document per line")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--synthetic", action="store_true", help="chapter 2's synthetic lines instead")
    kind.add_argument("--long-documents", action="store_true", help="one long document per pydoc topic "
                      "or stdlib module (seq-512 samples mostly full) instead of one per paragraph run")
    args = parser.parse_args(argv)
    if args.synthetic:
        count, what = write_synthetic_corpus(args.output), "synthetic lines"
    else:
        count = write_default_corpus(args.output, long_documents=args.long_documents)
        what = "long documents" if args.long_documents else "documents"
    print(f"wrote {count} {what} ({os.path.getsize(args.output) / 1e6:.2f} MB) to {args.output}")


if __name__ == "__main__":
    main()
