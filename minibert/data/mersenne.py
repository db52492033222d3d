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
- 64-bit: numpy has none, so `MT19937_64` below implements it, vectorised. Written as one long
  sequence instead of a state overwritten in place, the twist is a recurrence (n = 312, m = 156):

      x[k + n] = x[k + m] ^ F[k]        F[k] = twist(x[k], x[k + 1])     x[0 .. n-1] = the seeded state

  Its nearest term is n - m = 156 words back, so numpy could make 156 words per step. Put the
  recurrence into itself once (x[k + m] = x[k] ^ F[k - m]) and the nearest term is x[k + 1], 311 back:

      x[k + n] = x[k] ^ F[k - m] ^ F[k]

  so each step makes 311 words from words already made, in 9 array operations.

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

    def _long_sequence(self, count):
        """The state followed by the next `count` untempered words (see the module docstring)."""
        n, m = self.N, self.M
        block = n - 1                                   # 311 new words per step
        size = n + m + -(-max(count - m, 0) // block) * block
        x = np.empty(size, dtype=np.uint64)
        f = np.empty(size, dtype=np.uint64)             # f[k] = twist(x[k], x[k + 1])
        x[:n] = self._state
        self._twist(x, f, 0, m)
        np.bitwise_xor(x[m:n], f[:m], out=x[n:n + m])   # the first m words: x[k + n] = x[k + m] ^ f[k]
        for j in range(n + m, size, block):             # new words x[j .. j + block - 1]
            self._twist(x, f, j - n, block)
            np.bitwise_xor(x[j - n:j - 1], f[j - n - m:j - 1 - m], out=x[j:j + block])
            np.bitwise_xor(x[j:j + block], f[j - n:j - 1], out=x[j:j + block])
        return x[:n + count]

    def _twist(self, x, f, k, count):
        """f[k .. k + count - 1] = twist(x[i], x[i + 1]): upper 33 bits of x[i], lower 31 of x[i + 1],
        shifted right once, xor MATRIX_A if odd."""
        y, odd = f[k:k + count], np.empty(count, dtype=np.uint64)
        np.bitwise_and(x[k:k + count], self.UPPER, out=y)
        np.bitwise_and(x[k + 1:k + count + 1], self.LOWER, out=odd)
        np.bitwise_or(y, odd, out=y)
        np.bitwise_and(y, np.uint64(1), out=odd)
        np.multiply(odd, self.MATRIX_A, out=odd)
        np.right_shift(y, np.uint64(1), out=y)
        np.bitwise_xor(y, odd, out=y)

    @staticmethod
    def _temper(z):
        """z ^= (z >> 29) & d; z ^= (z << 17) & b; z ^= (z << 37) & c; z ^= z >> 43, in place."""
        t = np.empty_like(z)
        for shift, mask in ((-29, 0x5555555555555555), (17, 0x71D67FFFEDA60000),
                            (37, 0xFFF7EEE000000000), (-43, 0xFFFFFFFFFFFFFFFF)):
            shifter = np.left_shift if shift > 0 else np.right_shift
            shifter(z, np.uint64(abs(shift)), out=t)
            np.bitwise_and(t, np.uint64(mask), out=t)
            np.bitwise_xor(z, t, out=z)
        return z

    def random_raw(self, count):
        """The next `count` words of the stream, np.uint64 [count]."""
        n = self.N
        left = n - self._next                 # words of the current state not yet handed out
        if count <= left:
            out = self._state[self._next:self._next + count].copy()
            self._next += count
            return self._temper(out)
        twists = -(-(count - left) // n)      # whole new states needed
        x = self._long_sequence(twists * n)
        out = x[self._next:self._next + count]  # the rest of this state, then the new words
        self._state = x[-n:].copy()           # the last state made; part of it may still be unused
        self._next = n - (twists * n - (count - left))
        return self._temper(out.copy())       # tempering is word by word: once, on everything
