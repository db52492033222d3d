"""Chapter 1's figures: the data pipeline drawn from minibert's own tokenizer, builder, sample index and
dataset, run on the default corpus (written, preprocessed and indexed in a scratch folder, once per
process, in a few seconds of CPU)."""
import atexit
import functools
import shutil
import tempfile

import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from style import COLORS, figure, save

from minibert.data.blended_dataset import blending_indices
from minibert.data.corpus import write_default_corpus
from minibert.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from minibert.data.masked_lm import build_train_valid_test_datasets, sample_lengths
from minibert.data.sample_index import split_document_ranges
from minibert.data.sample_walk import canonical_rows
from minibert.data.sentence_split import split_sentences
from minibert.data.tokenizer import BertWordPieceTokenizer
from minibert.preprocess import preprocess

SEQ, SEED = 64, 1234   # the chapter's settings: --seq-length 64 --seed 1234, --split 969,30,1
LIGHT = {"A": "#DCE6F2", "B": "#FBE3D3", "pad": "#F2F2F2", "special": "#D9D9D9"}


@functools.cache
def _scratch():
    folder = tempfile.mkdtemp(prefix="ch01_figures_")
    atexit.register(shutil.rmtree, folder, True)
    return folder


@functools.cache
def _tokenizer():
    return BertWordPieceTokenizer()


@functools.cache
def _corpus(long_documents=False):
    """The default (or long-document) corpus, preprocessed with --split-sentences: the prefix."""
    name = "long" if long_documents else "corpus"
    text = f"{_scratch()}/{name}.txt"
    write_default_corpus(text, long_documents=long_documents)
    return preprocess(text, f"{_scratch()}/{name}", _tokenizer(), split_sentences=True, progress=False)[0]


@functools.cache
def _train():
    """The train split of the default corpus at the chapter's settings (python -m minibert.data.masked_lm
    --seq-length 64 --seed 1234 --num-samples 10)."""
    train, _, _ = build_train_valid_test_datasets(_corpus(), _tokenizer(), split="969,30,1",
                                                  num_samples=(10, 0, 0), seq_length=SEQ, seed=SEED,
                                                  binary_head=True)
    return train


def _kinds(sample):
    """Per position: 'special', 'pad', 'plain', or for a predicted position 'mask', 'random', 'kept'."""
    tok = _tokenizer()
    kinds = []
    for text, label, loss, pad in zip(sample["text"], sample["labels"], sample["loss_mask"],
                                      sample["padding_mask"]):
        if not pad:
            kinds.append("pad")
        elif loss:
            kinds.append("mask" if text == tok.mask else "kept" if text == label else "random")
        elif text in (tok.cls, tok.sep):
            kinds.append("special")
        else:
            kinds.append("plain")
    return kinds


@functools.cache
def _pair_sample():
    """The first short sample (<= 28 real tokens) whose predictions include all three kinds: its number."""
    train = _train()
    for i in range(len(train)):
        sample = train[i]
        kinds = _kinds(sample)
        if kinds.count("pad") >= SEQ - 28 and {"mask", "random", "kept"} <= set(kinds):
            return i
    raise RuntimeError("no short sample with all three kinds of prediction")


def _box(ax, x, y, w, h, text, face, edge="#555555", size=8, weight="normal", color="black"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, color=color)


def _blank(ax, width, height):
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")


def draw_wordpiece(path):
    """The sentence pair of the sample figure: its text as the corpus has it, cut into WordPiece pieces and
    their ids, and the greedy longest match that cuts one word."""
    tok, train = _tokenizer(), _train()
    first, end, _ = (int(v) for v in train.sample_index[_pair_sample()])
    sentences = IndexedDataset(_corpus())
    document = int(np.searchsorted(sentences.document_indices, first, side="right")) - 1
    with open(f"{_scratch()}/corpus.txt", encoding="utf-8") as f:
        text = f.read().split("\n")[document]
    texts = split_sentences(text)[first - int(sentences.document_indices[document]):]
    fig, ax = figure(3.6)
    _blank(ax, 100, 40)
    y = 32.5
    for label, s, raw in zip("AB", range(first, end), texts):
        ids = sentences[s].tolist()
        pieces = tok.convert_ids_to_tokens(ids)
        ax.text(0, y + 4.6, f"sentence {s} (document {document}):  \"{raw}\"", fontsize=9, va="center")
        widths = [max(4.2, 0.95 * len(piece) + 1.8) for piece in pieces]
        x = 0.0
        for k, (piece, i, w) in enumerate(zip(pieces, ids, widths)):
            continued = piece.startswith("##")
            punct = len(piece) == 1 and not piece.isalnum()
            face = COLORS["highlight"] if continued else LIGHT["special"] if punct else LIGHT[label]
            _box(ax, x, y - 2, w - 0.4, 4.2, piece, face, size=8.5)
            ax.text(x + (w - 0.4) / 2, y - 3.9, str(i), ha="center", va="center", fontsize=7, color="#444444")
            if continued:  # bracket the word this piece continues
                left = x - widths[k - 1]
                ax.plot([left, left, x + w - 0.4, x + w - 0.4], [y + 2.5, y + 3.0, y + 3.0, y + 2.5],
                        color=COLORS["highlight"], lw=1.2)
            x += w
        y -= 13
    # greedy longest match for the first word cut in two
    pieces = tok.convert_ids_to_tokens(np.concatenate([sentences[k] for k in range(first, end)]))
    k = next(k for k, piece in enumerate(pieces) if piece.startswith("##"))
    begin = max(j for j in range(k) if not pieces[j].startswith("##"))
    stop = next((j for j in range(k, len(pieces)) if not pieces[j].startswith("##")), len(pieces))
    word = "".join(piece.removeprefix("##") for piece in pieces[begin:stop])
    tries, start = [], 0
    while start < len(word):
        prefix = "##" if start else ""
        for stop in range(min(len(word), start + tok.max_piece_chars), start, -1):
            piece = prefix + word[start:stop]
            tries.append((piece, piece in tok.vocab))
            if piece in tok.vocab:
                start = stop
                break
    ax.text(0, 6.2, f"WordPiece on \"{word}\": the longest vocab entry first, then \"##\" + the longest "
            "entry for the rest", fontsize=9, va="center")
    x = 0.0
    for piece, found in tries:
        w = 0.95 * len(piece) + 4.0
        _box(ax, x, 0, w, 3.8, f"{piece} {'✓' if found else '✗'}", COLORS["communication"] if found else "white",
             size=8.5, color="white" if found else "#777777", edge="#555555" if found else "#BBBBBB")
        x += w + 0.8
    legend = [(LIGHT["A"], "a whole word (sentence A)"), (LIGHT["B"], "a whole word (sentence B)"),
              (COLORS["highlight"], "\"##\": continues the piece before"),
              (LIGHT["special"], "punctuation: a word of its own")]
    for i, (face, label) in enumerate(legend):
        lx, ly = 56 + 23 * (i // 2), 3.0 - 3.0 * (i % 2)
        _box(ax, lx, ly, 2.0, 1.8, "", face)
        ax.text(lx + 2.8, ly + 0.9, label, fontsize=7.5, va="center")
    save(fig, path)


def draw_bin_idx(path):
    """The worked example of docs/formats.md, written by minibert's builder and read back from the bytes."""
    folder = _scratch()
    builder = IndexedDatasetBuilder(f"{folder}/ex.bin", dtype=np.uint16)
    builder.add_document([101, 7592, 2088], [2, 1])
    builder.add_document([1037, 1038, 1039], [3])
    builder.finalize(f"{folder}/ex.idx")
    ds = IndexedDataset(f"{folder}/ex")
    with open(f"{folder}/ex.bin", "rb") as f:
        raw = f.read()
    lengths, pointers, docs = (a.tolist() for a in (ds.sequence_lengths, ds.sequence_pointers,
                                                      ds.document_indices))
    seq_colors = [LIGHT["A"], "#C9DAF0", LIGHT["B"]]

    fig, ax = figure(3.5)
    _blank(ax, 100, 40)
    # .idx: fields, widths proportional to their bytes
    fields = [("magic\nMMIDIDX", 9, "white"), ("version\n1", 8, "white"), ("", 1, "white"),
              ("S\n3", 8, "white"), ("D+1\n3", 8, "white")]
    fields += [(f"len\n{n}", 4, seq_colors[s]) for s, n in enumerate(lengths)]
    fields += [(f"ptr\n{p}", 8, seq_colors[s]) for s, p in enumerate(pointers)]
    fields += [(f"doc\n{d}", 8, "#EFE6DC") for d in docs]
    scale, yidx, x = 100 / 96.5, 26.0, 0.0
    where = []
    for text, size, face in fields:
        w = size * scale
        _box(ax, x, yidx, w, 5.5, text, face, size=6.5 if size < 8 else 7)
        where.append((x, w))
        x += w
    ax.text(0, yidx + 11.5, ".idx", fontsize=11, weight="bold", va="center")
    ax.text(7.5, yidx + 11.5, f"{x / scale:.0f} bytes: a 34-byte header, then lengths (int32), byte pointers "
            "(int64), document indices (int64)", fontsize=7.5, va="center", color="#444444")
    for i, span, label in ((0, 5, "header (dtype 8 = uint16, 1 byte)"), (5, 3, "lengths"), (8, 3, "pointers"),
                           (11, 3, "document indices")):
        a, b = where[i][0], where[i + span - 1][0] + where[i + span - 1][1]
        ax.plot([a + 0.3, a + 0.3, b - 0.3, b - 0.3], [yidx + 6.2, yidx + 6.8, yidx + 6.8, yidx + 6.2],
                color="#555555", lw=0.9)
        ax.text((a + b) / 2, yidx + 8.2, label, fontsize=7.5, ha="center", va="center")
    # .bin: one cell per token, 2 bytes each
    cell, x0, ybin = 9.0, 18.0, 10.0
    ax.text(0, ybin + 3.2, ".bin", fontsize=11, weight="bold", va="center")
    ax.text(0, ybin + 0.6, f"{len(raw)} bytes, no header", fontsize=7.5, va="center", color="#444444")
    token = 0
    for s, n in enumerate(lengths):
        for _ in range(n):
            x = x0 + cell * token
            value = int(np.frombuffer(raw[2 * token:2 * token + 2], "<u2")[0])
            _box(ax, x, ybin, cell, 5, f"{value}\n{raw[2 * token:2 * token + 2].hex(' ')}", seq_colors[s], size=8)
            ax.text(x, ybin - 1.3, str(2 * token), fontsize=7, ha="center", color="#444444")
            token += 1
        ax.text(x0 + cell * (token - n / 2), ybin - 3.3, f"sequence {s}", fontsize=7.5, ha="center")
    ax.text(x0 + cell * token, ybin - 1.3, f"{2 * token}  (byte offsets)", fontsize=7, color="#444444")
    for d in range(len(docs) - 1):  # documents, from the document indices
        a, b = x0 + cell * sum(lengths[:docs[d]]), x0 + cell * sum(lengths[:docs[d + 1]])
        ax.plot([a + 0.3, a + 0.3, b - 0.3, b - 0.3], [ybin - 4.6, ybin - 5.4, ybin - 5.4, ybin - 4.6],
                color=COLORS["data"], lw=1.2)
        ax.text((a + b) / 2, ybin - 7.0, f"document {d} = sequences [{docs[d]}, {docs[d + 1]})",
                fontsize=7.5, ha="center", color=COLORS["data"])
    for s, p in enumerate(pointers):  # each pointer -> the byte its sequence starts at
        x, w = where[8 + s]
        ax.add_patch(FancyArrowPatch((x + w / 2, yidx), (x0 + cell * p / 2 + 0.6, ybin + 5.1),
                                     arrowstyle="-|>", mutation_scale=9, color=COLORS["forward"], lw=1.0))
    ax.text(78, 19.5, "pointer = byte offset\nwhere its sequence starts", fontsize=7.5, color=COLORS["forward"],
            va="center")
    save(fig, path)


def draw_sample(path):
    """One real sample of the default corpus, position by position: [CLS] A [SEP] B [SEP] [PAD]..., what
    is predicted and how it is shown, the token types and the sentence-order label."""
    tok, train = _tokenizer(), _train()
    i = _pair_sample()
    s = train[i]
    kinds = _kinds(s)
    shown = tok.convert_ids_to_tokens(s["text"])
    original = tok.convert_ids_to_tokens(np.where(s["loss_mask"] == 1, s["labels"], s["text"]))
    n = int(np.flatnonzero(s["padding_mask"])[-1]) + 1
    sep_a = shown.index("[SEP]")
    rows = [("type 0:  [CLS] A [SEP]", range(sep_a + 1)), ("type 1:  B [SEP]", range(sep_a + 1, n)),
            ("padding", range(n, n + 4))]
    face = {"plain": "white", "special": LIGHT["special"], "pad": LIGHT["pad"], "mask": COLORS["forward"],
            "random": COLORS["backward"], "kept": COLORS["communication"]}
    fig, ax = figure(4.4)
    _blank(ax, 100, 50)
    ax.set_ylim(-0.8, 50)
    first, end, target = (int(v) for v in train.sample_index[i])
    ax.text(0, 48.8, f"sample {i} of the train split: row ({first}, {end}, {target}) of the sample index, "
            f"--seq-length {SEQ}", fontsize=9, va="center", weight="bold")
    ax.text(0, 46.0, f"is_random = {int(s['is_random'])}: A and B are in their order (the SOP label; half the "
            f"samples swap them)      truncated = {int(s['truncated'])}", fontsize=8.5, va="center")
    y = 35.5
    for title, positions in rows:
        ax.text(0, y + 7.0, title, fontsize=8.5, weight="bold", va="center")
        x = 0.0
        for p in positions:
            text = shown[p]
            dark = kinds[p] in ("mask", "random", "kept")
            w = max(4.2, (1.1 if dark else 0.95) * max(len(text), len(original[p])) + 1.8)
            _box(ax, x, y, w, 4.2, text, face[kinds[p]], size=8, color="white" if dark else "black",
                 weight="bold" if dark else "normal")
            ax.text(x + w / 2, y + 4.9, str(p), fontsize=6.5, ha="center", color="#555555")
            if dark:
                ax.text(x + w / 2, y - 1.5, f"label: {original[p]}", fontsize=7.5, ha="center",
                        color=face[kinds[p]], weight="bold")
            x += w + 0.3
        if title == "padding":
            ax.text(x + 1, y + 2.1, f"... [PAD] up to position {SEQ - 1}: padding_mask 0, label -1, "
                    "loss_mask 0, type 0", fontsize=8, va="center")
        y -= 13.5
    counts = {k: kinds.count(k) for k in ("mask", "random", "kept")}
    ax.text(0, 3.6, f"{sum(counts.values())} positions predicted, n_mask = min(0.15 x {target}, "
            f"max(1, round(0.15 x {n}))) = {min(0.15 * target, max(1, round(0.15 * n))):g}; each one: "
            "80% [MASK], 10% a random token, 10% kept", fontsize=8, va="center")
    legend = [("mask", "[MASK]"), ("random", "random token"), ("kept", "kept"),
              ("plain", "not predicted (label -1)"), ("special", "[CLS], [SEP]: never predicted")]
    x = 0.0
    for kind, text in legend:
        _box(ax, x, -0.4, 2.2, 1.9, "", face[kind])
        ax.text(x + 3.0, 0.55, text, fontsize=7.5, va="center")
        x += 6.0 + 0.85 * len(text)
    save(fig, path)


@functools.cache
def _detour_document():
    """The first train document of 6-8 sentences where one short target, drawn for a row after the first,
    makes one row more than the canonical (every target full) rows: (first, last, real rows, canonical)."""
    train = _train()
    sentences = IndexedDataset(_corpus())
    bounds, sizes = sentences.document_indices, sentences.sequence_lengths
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    rows = train.sample_index[np.argsort(train.sample_index[:, 0], kind="stable")].astype(np.int64)
    document_of = np.searchsorted(bounds, rows[:, 0], side="right") - 1
    for d in np.unique(document_of):
        first, last = int(bounds[d]), int(bounds[d + 1])
        real = rows[document_of == d]
        if not 6 <= last - first <= 8 or real[0, 2] != SEQ - 3 or (real[:, 2] == SEQ - 3).all():
            continue
        _, starts, ends = canonical_rows(cum, np.array([first]), np.array([last]), SEQ - 3, 2)
        if len(real) == len(starts) + 1:
            return first, last, real.tolist(), list(zip(starts.tolist(), ends.tolist()))
    raise RuntimeError("no document with a detour of the kind drawn")


def draw_sample_index(path):
    """One document's sentences cut into rows: every target full (canonical rows), then the real draws,
    with a short target; and where each row lands in the shuffled index."""
    train = _train()
    sentences = IndexedDataset(_corpus())
    first, last, real, canonical = _detour_document()
    sizes = sentences.sequence_lengths[first:last].astype(np.int64)
    offset = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offset[-1])
    position = {tuple(r): int(np.flatnonzero((train.sample_index == np.array(r, dtype=np.uint32)).all(1))[0])
                for r in real}
    fig, ax = figure(3.5)
    ax.set_xlim(-32, total + 4)
    ax.set_ylim(-0.6, 9.8)
    ax.axis("off")
    shades = ["#DCE6F2", "#B9CDE6"]
    for k, size in enumerate(sizes):
        _box(ax, offset[k], 8.2, size, 1.4, f"{first + k}\n{size}",
             shades[k % 2], size=7)
    ax.text(-32, 8.9, "sentences\n(number, tokens)", fontsize=8, va="center")

    def rows_at(y, rows, title, targets):
        ax.text(-32, y + 0.5, title, fontsize=8, va="center")
        for (a, b), target in zip(rows, targets):
            x0, x1 = offset[a - first], offset[b - first]
            short = target != SEQ - 3
            color = COLORS["backward"] if short else COLORS["forward"]
            ax.add_patch(Rectangle((x0 + 0.6, y), x1 - x0 - 1.2, 1.1, facecolor=color, edgecolor="none",
                                   zorder=2))
            label = f"({a}, {b}, {target})"
            ax.text((x0 + x1) / 2, y + 0.55, label, fontsize=7.5, ha="center", va="center", color="white",
                    weight="bold", zorder=3)
            reach = x0 + target
            if reach < x1:  # where the running count reached the target
                ax.plot([reach, reach], [y - 0.35, y + 1.45], color="black", lw=1.0, ls=":", zorder=0)
        return y

    rows_at(5.6, canonical, "every target 61:\ncanonical rows", [SEQ - 3] * len(canonical))
    rows_at(2.9, [(a, b) for a, b, _ in real], "the real draws", [t for _, _, t in real])
    ax.text(-32, 1.9, "its place in the\nshuffled index", fontsize=8, va="center")
    for a, b, t in real:
        x0, x1 = offset[a - first], offset[b - first]
        ax.text((x0 + x1) / 2, 1.9, f"row {position[(a, b, t)]}", fontsize=8, ha="center", va="center",
                color="#444444")
    ax.text(-32, 0.1, f"Row = (first sentence, end sentence, target). A row ends once its tokens reach the "
            f"target (dotted line) and\nat least two sentences remain, or at the document's end; a short "
            f"target (orange) cuts earlier. seq-length {SEQ}: full target {SEQ - 3}.",
            fontsize=7.5, va="center")
    save(fig, path)


def draw_splits_blend(path):
    """--split 969,30,1 over the default corpus's documents, and a 0.3/0.7 blend's first 20 samples."""
    documents = len(IndexedDataset(_corpus()).document_indices) - 1
    ranges = split_document_ranges("969,30,1", documents)
    fig, (top, bottom) = figure(3.3, nrows=2, gridspec_kw={"height_ratios": [1, 1.15]})
    colors = [COLORS["forward"], COLORS["backward"], COLORS["idle"]]
    for (a, b), name, color in zip(ranges, ("train", "valid", "test"), colors):
        top.barh(0, b - a, left=a, height=0.6, color=color)
    (a, b), (c, d), (e, f) = ranges
    top.text((a + b) / 2, 0, f"train: documents [{a}, {b})", color="white", ha="center", va="center",
             fontsize=9, weight="bold")
    top.annotate(f"valid [{c}, {d})", xy=((c + d) / 2, 0.3), xytext=(c - 700, 0.75), fontsize=8.5,
                 arrowprops={"arrowstyle": "-", "color": colors[1]}, color=colors[1])
    top.annotate(f"test [{e}, {f}): {f - e} documents", xy=(f, 0.3), xytext=(d - 500, -0.95), fontsize=8.5,
                 arrowprops={"arrowstyle": "-", "color": colors[2]}, color=colors[2])
    top.set_xlim(0, documents)
    top.set_ylim(-1.2, 1.2)
    top.set_yticks([])
    top.spines["left"].set_visible(False)
    top.set_xlabel(f"--split 969,30,1 cuts the {documents} documents of the default corpus, in file order",
                   fontsize=8.5)
    weights, size = [0.3, 0.7], 20
    corpus, number = blending_indices(weights, size)
    for t, (c, k) in enumerate(zip(corpus.tolist(), number.tolist())):
        bottom.add_patch(Rectangle((t + 0.05, 0), 0.9, 1, color=[COLORS["data"], COLORS["communication"]][c]))
        bottom.text(t + 0.5, 0.5, f"{'AB'[c]}{k}", color="white", ha="center", va="center", fontsize=8,
                    weight="bold")
        bottom.text(t + 0.5, -0.35, str(t), ha="center", va="center", fontsize=7, color="#555555")
    bottom.set_xlim(0, size)
    bottom.set_ylim(-0.7, 1.5)
    bottom.axis("off")
    bottom.text(0, 1.25, "--data-path 0.3 A 0.7 B: sample t of the blend is the next one of the corpus furthest "
                "below its share (A3: A's sample 3)", fontsize=8.5, va="center")
    save(fig, path)


def draw_lengths(path):
    """Real tokens per sample at --seq-length 512: the default corpus against the long-document one."""
    fig, ax = figure(3.2)
    bins = np.arange(0, 513, 32)
    for long_documents, color, name in ((False, COLORS["forward"], "default corpus"),
                                        (True, COLORS["backward"], "--long-documents")):
        prefix = _corpus(long_documents)
        documents = len(IndexedDataset(prefix).document_indices) - 1
        train, _, _ = build_train_valid_test_datasets(prefix, _tokenizer(), split="1", num_samples=(1, 0, 0),
                                                      seq_length=512, seed=SEED, binary_head=True)
        lengths = sample_lengths(train)
        share = np.histogram(lengths, bins=bins)[0] / len(lengths)
        ax.bar(bins[:-1] + (0 if not long_documents else 14), share * 100, width=14, align="edge",
               color=color, label=f"{name} ({documents} documents): {len(lengths)} samples, {lengths.mean() / 512:.0%} of the "
               f"positions hold text")
    ax.set_xlabel("real tokens in a sample ([CLS] ... [SEP]); the rest of its 512 positions is padding")
    ax.set_ylabel("% of the samples")
    ax.set_xlim(0, 512)
    ax.legend(fontsize=8, frameon=False, loc="upper center")
    save(fig, path)


FIGURES = {"ch01_wordpiece": draw_wordpiece, "ch01_bin_idx": draw_bin_idx, "ch01_sample": draw_sample,
           "ch01_sample_index": draw_sample_index, "ch01_splits_blend": draw_splits_blend,
           "ch01_lengths": draw_lengths}
