"""The two Mersenne Twisters of C++'s <random>, bit for bit, so Python can replay Megatron's sample index.

Megatron builds its BERT sample index in C++ (megatron/core/datasets/helpers.cpp) with two generators:

    std::mt19937    rand32(seed)      32-bit words: which rows get a short target length
    std::mt19937_64 rand64(seed + 1)  64-bit words: the Fisher-Yates shuffle of the rows

To get the same rows we need the same streams. Both are the Mersenne Twister (Matsumoto & Nishimura, 1998):
a state of n words, a "twist" that regenerates all n words at once, and a "tempering" that scrambles each
word on its way out:

    state  x[0] ... x[n-1]                      (seeded by x[i] = f * (x[i-1] ^ (x[i-1] >> (w-2))) + i)
    twist  y    = upper bits of x[i] | lower r bits of x[i+1]
           x[i] = x[i+m] ^ (y >> 1) ^ (a if y is odd else 0)       (indices mod n)
    temper z = x[i]; z ^= (z >> u) & d; z ^= (z << s) & b; z ^= (z << t) & c; z ^= z >> l

- 32-bit: numpy already ships it. `np.random.MT19937()._legacy_seeding(s)` seeds it exactly as
  std::mt19937(s) does (numpy's RandomState(s) uses the same routine), and `random_raw()` returns its words.
- 64-bit: numpy has none, so `MT19937_64` below implements it. Its twist is vectorised in three numpy
  slices (the recurrence only looks m = n/2 words ahead), so a million words cost milliseconds.

Checked against the C++ standard: the 10000th word of a default-constructed engine (seed 5489) is
4123659995 for mt19937 and 9981545732273789042 for mt19937_64 ([rand.predef] in the standard).
"""
import numpy as np

DEFAULT_SEED = 5489  # std::mersenne_twister_engine::default_seed


def mt19937_words(seed, count):
    """The first `count` words of std::mt19937(seed), as np.uint64 values < 2**32.

    `seed` is taken mod 2**32, as C++ does when an int seed becomes the engine's unsigned result_type."""
    bits = np.random.MT19937()
    bits._legacy_seeding(int(seed) % 2**32)  # init_genrand(seed): the std::mt19937(seed) constructor
    return bits.random_raw(count)


class MT19937_64:
    """std::mt19937_64: 312 words of 64 bits, twisted in bulk with numpy.

    >>> MT19937_64().random_raw(10000)[-1]   # default seed 5489
    np.uint64(9981545732273789042)
    """
    N, M = 312, 156                      # state size, and how far ahead the twist looks
    MATRIX_A = np.uint64(0xB5026F5AA96619E9)
    UPPER = np.uint64(0xFFFFFFFF80000000)  # the top 33 bits (w - r, with r = 31)
    LOWER = np.uint64(0x7FFFFFFF)          # the low 31 bits
    SEED_MULTIPLIER = 6364136223846793005  # f in the seeding recurrence

    def __init__(self, seed=DEFAULT_SEED):
        mask = 2**64 - 1
        state = [int(seed) & mask]  # a negative C int wraps to 2**64 + seed, as in C++
        for i in range(1, self.N):
            prev = state[-1]
            state.append((self.SEED_MULTIPLIER * (prev ^ (prev >> 62)) + i) & mask)
        self._state = np.array(state, dtype=np.uint64)
        self._next = self.N  # index of the next word to hand out; N means "twist first"

    def _twist(self):
        x, n, m = self._state, self.N, self.M

        def mixed(here, after, ahead):  # new x[i] from old x[i], x[i + 1] and x[(i + m) % n]
            y = (here & self.UPPER) | (after & self.LOWER)
            return ahead ^ (y >> np.uint64(1)) ^ ((y & np.uint64(1)) * self.MATRIX_A)

        # In C++ this is one loop i = 0..n-1 that overwrites x in place. Each slice below only reads words
        # that the loop would already have rewritten (x[i + m - n] for i >= n - m) or not yet touched.
        x[:n - m] = mixed(x[:n - m], x[1:n - m + 1], x[m:])       # reads x[m..n-1]: all still old
        x[n - m:n - 1] = mixed(x[n - m:n - 1], x[n - m + 1:], x[:m - 1])  # x[0..m-2]: new, from above
        x[n - 1:] = mixed(x[n - 1:], x[:1], x[m - 1:m])            # the last word wraps to x[0], new
        self._next = 0

    @staticmethod
    def _temper(z):
        z = z ^ ((z >> np.uint64(29)) & np.uint64(0x5555555555555555))
        z = z ^ ((z << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000))
        z = z ^ ((z << np.uint64(37)) & np.uint64(0xFFF7EEE000000000))
        return z ^ (z >> np.uint64(43))

    def random_raw(self, count):
        """The next `count` words of the stream, np.uint64 [count]."""
        out = np.empty(count, dtype=np.uint64)
        filled = 0
        while filled < count:
            if self._next == self.N:
                self._twist()
            take = min(count - filled, self.N - self._next)
            out[filled:filled + take] = self._state[self._next:self._next + take]
            self._next += take
            filled += take
        return self._temper(out)  # tempering is word by word, so it can wait and run once on everything
