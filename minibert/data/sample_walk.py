"""Megatron's sample-index walk at corpus scale: the rows of sample_index.plain_sample_index, vectorised.

The plain walk (sample_index.py) spends about a microsecond of Python on every row: seconds for a
corpus of 20M sentences, where Megatron's C++ takes a fraction of one. Almost all of that work does
not depend on the random stream, and this file separates the part that does.

1. **Canonical rows.** If every target were max_seq, a document's rows would be fixed by its sentence
   lengths alone. All documents walk at once, "in lockstep": step k finds the k-th row of every
   document that still has sentences left, with one np.searchsorted over the running token counts.

2. **Slots and the shift.** The walk draws one target per row and one more after each document's
   last row. Number those draws by *slot* over an epoch of canonical rows:

       slots   | d0 row0 | d0 row1 | d0 end | d1 row0 | d1 end | d2 row0 | d2 row1 | d2 end | ...
       draws      t0        t1        t2       t3        t4       t5        t6        t7

   With no short targets, draw number = slot number + shift, the shift fixed (0 in the first epoch).
   Only a draw r with r % ratio == 0 (short_seq_prob of them) can change anything, and only if it
   lands on a row slot (on an end slot it is drawn and dropped anyway).

3. **Detours.** Such a draw replaces its row by a shorter one; from where that row ends, the walk goes
   on in Python, row by row with full targets (and any further short draw), until it reaches the start
   of a canonical row again: from there on the rows are canonical once more. It always gets back, at
   the latest at the document's end. Say the detour replaced canonical rows [r, r') with rows that
   used q draws; every later draw lands q - (r' - r) slots further on: the shift grows by that, which
   is 0 or 1 (a greedy cut that starts earlier ends no later, so the detour interleaves the canonical
   cuts and rejoins them one row behind or level). Python runs once per short draw, not once per row.

       canonical   | 0 ......... 40 | 41 ....... 77 | 78 ...... 120 |    (sentence numbers)
       short row   | 0 .. 12 |
       detour                | 13 ...... 58 | 59 ....... 98 | 99 ..... 120 | -> rejoins at the end:
                                                                  4 rows for 3: the shift grows by 1

4. **Assembly.** An epoch's rows are its canonical rows with each detour's rows in place of the rows it
   replaced, put together with a few array operations. Epochs repeat until there are num_samples rows.

A sentence index here is "local": counted from the first sentence of the split (`base`).
"""
import itertools
from bisect import bisect_left

import numpy as np

GROUP = 1 << 14              # documents walked together: small enough for the CPU cache
LOCKSTEP_MIN_DOCUMENTS = 16  # fewer documents still walking: finish them in Python (one giant document)


def canonical_rows(cum, first, last, max_seq, min_sentences):
    """Every document's rows when every target is max_seq, in document order.

    cum: tokens before each local sentence, int32 or int64 [S + 1]; first, last: each usable document's
    sentences [first, last) (local, in file order). Returns (rows per document [U], row starts [R], row
    ends [R], exclusive). The documents go GROUP at a time, so that a group's arrays and its stretch of
    `cum` stay in the CPU's cache while its lockstep runs."""
    counts, ends = [], []
    for g in range(0, len(first), GROUP):
        lo, hi = int(first[g]), int(last[min(g + GROUP, len(first)) - 1])  # the group's sentences
        group_counts, group_ends = _lockstep(cum[lo:hi + 1], first[g:g + GROUP] - lo,
                                             last[g:g + GROUP] - lo, max_seq, min_sentences)
        counts.append(group_counts)
        ends.append(group_ends + lo)
    counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=cum.dtype)
    starts = np.empty_like(ends)
    starts[1:] = ends[:-1]                      # each row starts where the one before ended ...
    starts[np.cumsum(counts) - counts] = first  # ... except a document's first
    return counts, starts, ends


def _lockstep(cum, first, last, max_seq, min_sentences):
    """canonical_rows for one group: (rows per document, row ends in document order)."""
    documents, pos, stop = np.arange(len(first)), first, last
    steps = []  # step k: (documents still walking, the end of their k-th row)
    finished = np.zeros(len(first), dtype=np.int64)  # after how many steps each document was done
    while len(documents) >= LOCKSTEP_MIN_DOCUMENTS:
        # the first sentence j with tokens(pos .. j) >= max_seq: cum[j + 1] - cum[pos] >= max_seq
        end = np.searchsorted(cum, cum[pos] + max_seq)      # = j + 1
        np.maximum(end, pos + min_sentences, out=end)       # the row needs min_sentences sentences
        end = np.where(end > stop - 2, stop, end)           # ... and must leave >= 2, else take all
        steps.append((documents, end))
        going = end < stop
        finished[documents[~going]] = len(steps)
        documents, pos, stop = documents[going], end[going], stop[going]
    tail = []  # the few long documents left: one row at a time, in Python
    for start, finish in zip(pos.tolist(), stop.tolist()):
        tail.append([])
        while start < finish:
            end = max(bisect_left(cum, cum[start] + max_seq, start + 1, finish + 1), start + min_sentences)
            start = finish if end > finish - 2 else end
            tail[-1].append(start)
    finished[documents] = len(steps) + np.array([len(ends) for ends in tail], dtype=np.int64)

    row_of_document = np.concatenate([[0], np.cumsum(finished)])  # first row of each document [U + 1]
    ends = np.empty(row_of_document[-1], dtype=cum.dtype)
    for k, (walking, end) in enumerate(steps):
        ends[row_of_document[walking] + k] = end
    for d, rows in zip(documents.tolist(), tail):
        at = row_of_document[d] + len(steps)
        ends[at:at + len(rows)] = rows
    return finished, ends


def short_draws(seed, ratio, max_seq):
    """An iterator of (draw number, target) for every draw of std::mt19937(seed) whose target is not
    max_seq, forever. The words are drawn in blocks; itertools.chain hands the pairs out from C."""
    def blocks():
        bits = np.random.MT19937()
        bits._legacy_seeding(seed)  # == std::mt19937(seed)
        done, block = 0, 1 << 12
        while True:
            r = bits.random_raw(block)
            target = np.where(r % ratio == 0, 2 + r % (max_seq - 1), max_seq)
            where = np.flatnonzero(target != max_seq)
            yield zip((where + done).tolist(), target[where].tolist())
            done += block
            block = min(2 * block, 1 << 20)  # small first: a tiny split needs few draws
    return itertools.chain.from_iterable(blocks())


class Epochs:
    """The walk over one split's usable documents, epoch after epoch, draws included."""

    def __init__(self, cum, first, last, max_seq, min_sentences, seed, ratio):
        self.cum, self.max_seq, self.min_sentences = cum, max_seq, min_sentences
        counts, self.starts, self.ends = canonical_rows(cum, first, last, max_seq, min_sentences)
        self.slots = len(self.starts) + len(first)      # every row and one end per document
        # slot -> canonical row, or -1 for a document's end slot; row -> its document's end sentence
        self.row_of_slot = np.full(self.slots, -1, dtype=np.int64)
        is_row = np.ones(self.slots, dtype=bool)
        is_row[np.cumsum(counts + 1) - 1] = False       # each document's last slot is its end
        self.row_of_slot[is_row] = np.arange(len(self.starts))
        self.stop_of_row = np.repeat(last, counts)
        self.shift = 0  # draw number of slot 0 of the coming epoch
        self.draws = short_draws(seed, ratio, max_seq) if ratio else None
        self.pending = next(self.draws) if ratio else None  # the next short draw not yet used

    def next_epoch(self):
        """The rows of the next epoch in walk order, as columns: local starts, ends, targets."""
        targets = np.full(len(self.starts), self.max_seq, dtype=np.int64)
        if self.draws is None:
            return self.starts, self.ends, targets
        replaced, detour_rows = self._detours()
        self.shift += self.slots
        return assemble((self.starts, self.ends, targets), replaced, detour_rows)

    def _detours(self):
        """Walk the short draws of this epoch. Returns (first row, end row, rows made) per detour, int64
        [detours, 3], and the detours' rows, int64 [n, 3], in order."""
        cum, max_seq, m = memoryview(self.cum), self.max_seq, self.min_sentences
        starts, ends = memoryview(self.starts), memoryview(self.ends)
        row_of_slot, stop_of_row = memoryview(self.row_of_slot), memoryview(self.stop_of_row)
        draws, slots, shift = self.draws, self.slots, self.shift
        draw, target = self.pending
        replaced, rows = [], []
        while True:
            slot = draw - shift
            if slot >= slots:
                break
            row = row_of_slot[slot]
            if row < 0:                         # a document's end slot: this draw is dropped anyway
                draw, target = next(draws)
                continue
            first_row, first_draw, start, stop = row, draw, starts[row], stop_of_row[row]
            used = draw                         # the draw the coming row's target comes from
            draw, next_target = next(draws)
            while True:                         # the detour, one row per draw
                end = bisect_left(cum, cum[start] + target, start + 1, stop + 1)
                if end < start + m:             # the row needs m sentences
                    end = start + m
                if end > stop - 2:              # a cut must leave 2 sentences, else take them all
                    end = stop
                rows += (start, end, target)
                used += 1
                start = end
                while ends[row] < start:        # the canonical row that `start` falls in
                    row += 1
                if ends[row] == start:          # back at a canonical row's start (or the end slot:
                    row += 1                    # the last row ends at `stop`)
                    break
                if used == draw:                # another short draw, inside the detour
                    target = next_target
                    draw, next_target = next(draws)
                else:
                    target = max_seq
            shift = used - (slot + row - first_row)  # the slot we are back at comes with draw `used`
            replaced += (first_row, row, used - first_draw)  # one row per draw
            target = next_target
        self.pending, self.shift = (draw, target), shift
        return (np.array(replaced, dtype=np.int64).reshape(-1, 3),
                np.array(rows, dtype=np.int64).reshape(-1, 3))


def assemble(canonical, replaced, detour_rows):
    """The canonical rows (columns, [R] each) with rows [first, end) of each detour replaced by its
    `made` rows; returns the same three columns for the epoch."""
    first, end, made = replaced.T
    covered = np.zeros(len(canonical[0]) + 1, dtype=np.int64)  # +1 inside each replaced range
    covered[first] += 1
    covered[end] -= 1                                           # ranges never overlap: no repeated index
    kept = np.flatnonzero(np.cumsum(covered[:-1]) == 0)
    count = np.zeros(len(canonical[0]), dtype=np.int64)         # output rows of each canonical row
    count[kept] = 1
    count[first] = made
    position = np.concatenate([[0], np.cumsum(count)])          # where each canonical row's output goes
    detour_at = np.repeat(position[first] - np.concatenate([[0], np.cumsum(made)[:-1]]), made)
    detour_at += np.arange(len(detour_rows))
    columns = []
    for column, detour_column in zip(canonical, detour_rows.T):
        out = np.empty(position[-1], dtype=np.int64)
        out[position[kept]] = column[kept]
        out[detour_at] = detour_column
        columns.append(out)
    return tuple(columns)


def walk(cum, first, last, *, num_samples, max_seq, min_sentences, seed, ratio):
    """All epochs' rows (local sentence numbers), unshuffled, as columns: starts, ends, targets
    [rows] each (integers), rows >= num_samples."""
    if num_samples <= 0:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
    epochs = Epochs(cum, first, last, max_seq, min_sentences, seed, ratio if max_seq > 2 else 0)
    out, total = [], 0
    while total < num_samples:  # whole epochs, checked when one starts (Megatron's rule)
        out.append(epochs.next_epoch())
        total += len(out[-1][0])
    return tuple(np.concatenate(column) for column in zip(*out))
