"""Megatron's row shuffle, Fisher-Yates with std::mt19937_64, computed without a loop over the rows.

helpers.cpp shuffles the sample index in place:

    for i = n-1 down to 1:   j = rand64() % (i + 1);   swap(row[i], row[j])

`shuffled_order_plain` is that loop, one Python step per row (seconds at corpus scale:
bench/notes/sample-index.md). `shuffled_order` gets the same permutation from whole-array numpy
operations. Two facts make that possible:

1. After step i, position i is final: later steps only touch positions below i. So the row that ends
   at position i is the one sitting at position j_i just before step i.
2. A position p < i only ever changes when a step writes into it, i.e. a step i' with j_i' = p. Call
   V(i) the row at position i just before step i. Then, just before step i, position p holds
   V(i') for the most recent such write (the smallest i' > i with j_i' = p), or row p if none came.

So, with the steps grouped by their j (one sort of (j, i) pairs):

    out[i] = V(next step after i in i's group)  or  j_i if there is none     (the row left at i)
    V(i)   = V(first step above i in group i)   or  i   if there is none     (chains upwards in i)

V is a chain of links i -> i' with i' > i: following them by pointer doubling (V <- V[V]) takes about
log2(chain length) rounds of one gather each; chains are short (about ln n), so it is a handful.

    rows 0 1 2 3, draws j_3 = 1, j_2 = 2, j_1 = 0:
    step 3: swap 3,1 -> 0 3 2 1;  step 2: swap 2,2 -> 0 3 2 1;  step 1: swap 1,0 -> 3 0 2 1
    groups: j=0: [1]  j=1: [3]  j=2: [2]   V(3) = 3, V(2) = 2, V(1) = V(3) = 3 (step 3 wrote into 1)
    out[3] = j_3 = 1, out[2] = j_2 = 2, out[1] = j_1 = 0, out[0] = V(1) = 3   ->  3 0 2 1
"""
import numpy as np

from minibert.data.mersenne import MT19937_64


def swap_targets(n, seed):
    """j_i = rand64() % (i + 1) for i = n-1 .. 1, from std::mt19937_64(seed + 1) as Megatron seeds it:
    seed + 1 in a C int (2**31 - 1 + 1 wraps to -2**31, which the engine takes mod 2**64)."""
    wrapped = (seed + 1 + 2**31) % 2**32 - 2**31
    i = np.arange(n - 1, 0, -1, dtype=np.uint64)
    return MT19937_64(wrapped).random_raw(n - 1) % (i + np.uint64(1))  # uint64 [n - 1]


def shuffled_order_plain(targets):
    """The loop itself: order[p] = the unshuffled row that ends at position p. targets = j for
    i = n-1 .. 1 (swap_targets)."""
    n = len(targets) + 1
    order = list(range(n))
    for i, j in zip(range(n - 1, 0, -1), np.asarray(targets).tolist()):
        order[i], order[j] = order[j], order[i]
    return np.array(order, dtype=np.int64)


def shuffled_order(targets):
    """The same permutation as shuffled_order_plain(targets), vectorised (see the module docstring)."""
    n = len(targets) + 1
    if n < 2:
        return np.arange(n, dtype=np.int64)
    if n >= 2**31:
        return shuffled_order_plain(targets)  # (j, i) would not fit the uint64 key below; never for BERT
    index = np.int32  # n < 2**31: half the memory traffic of int64
    keys = np.sort((np.asarray(targets, dtype=np.uint64) << np.uint64(32))
                   | np.arange(n - 1, 0, -1, dtype=np.uint64))  # the steps by j, then by i
    group = (keys >> np.uint64(32)).astype(index)           # j of each sorted step   [n - 1]
    step = keys.astype(np.uint32).astype(index)             # i of each sorted step   [n - 1]
    same = group[1:] == group[:-1]                          # sorted neighbours in one group

    after = np.full(n, -1, dtype=index)  # after[i] = the next step above i in i's group, or -1
    after[step[:-1][same]] = step[1:][same]
    # first[p] = the first step above p that writes into position p: its group's smallest step, or
    # the next one when the smallest is p's own step swapping p with itself (j_p = p).
    first = np.full(n, -1, dtype=index)
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    first[group[starts]] = step[starts]
    own = np.flatnonzero(first == np.arange(n, dtype=index))
    first[own] = after[own]

    value = np.where(first >= 0, first, np.arange(n, dtype=index))  # V(i) = V(first[i]), doubling
    moving = np.flatnonzero(first >= 0)
    while len(moving):
        value[moving] = value[value[moving]]
        moving = moving[value[value[moving]] != value[moving]]

    order = np.empty(n, dtype=np.int64)
    later = after[1:]                                       # indexed by step i = 1 .. n-1
    j = np.asarray(targets)[::-1].astype(index)             # j of step i = 1 .. n-1
    order[1:] = np.where(later >= 0, value[np.maximum(later, 0)], j)
    order[0] = value[first[0]] if first[0] >= 0 else 0      # position 0: whatever was last written there
    return order


def megatron_order(n, seed, plain=False):
    """The permutation helpers.cpp's shuffle applies to n rows with this seed: row p of the shuffled
    index is row order[p] of the unshuffled one. plain=True takes the loop (the readable twin)."""
    if n < 2:
        return np.arange(n, dtype=np.int64)
    targets = swap_targets(n, seed)
    return shuffled_order_plain(targets) if plain else shuffled_order(targets)
