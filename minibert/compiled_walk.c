/* Megatron's BERT sample index as one loop in C: the walk over the documents, then the shuffle.

   The same rows as minibert/sample_index.py's plain_sample_index (read that first: the rule is
   written out there); minibert/compiled_walk.py compiles this file with the system's C compiler on
   first use and calls it through ctypes. Megatron does the same with its helpers.cpp. The loop
   visits each sentence once, adding its length to the row being built, so it runs at the speed of
   reading the lengths from memory: a few nanoseconds a sentence.

   Two random generators, both from the C++ standard library's definitions (minibert/mersenne.py
   explains them): std::mt19937 (32-bit words) draws the target lengths, std::mt19937_64 (64-bit
   words) the Fisher-Yates swaps. */
#include <stdint.h>
#include <stdlib.h>

/* ---- std::mt19937: n = 624, m = 397 ---- */
typedef struct { uint32_t x[624]; int i; } mt32;

static void mt32_seed(mt32 *g, uint32_t seed) {
    g->x[0] = seed;
    for (int k = 1; k < 624; k++)
        g->x[k] = 1812433253u * (g->x[k - 1] ^ (g->x[k - 1] >> 30)) + (uint32_t)k;
    g->i = 624;
}

static uint32_t mt32_next(mt32 *g) {
    if (g->i == 624) {  /* make the next 624 words of state at once */
        for (int k = 0; k < 624; k++) {
            uint32_t y = (g->x[k] & 0x80000000u) | (g->x[(k + 1) % 624] & 0x7fffffffu);
            g->x[k] = g->x[(k + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        g->i = 0;
    }
    uint32_t y = g->x[g->i++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    return y ^ (y >> 18);
}

/* ---- std::mt19937_64: n = 312, m = 156 ---- */
typedef struct { uint64_t x[312]; int i; } mt64;

static void mt64_seed(mt64 *g, uint64_t seed) {
    g->x[0] = seed;
    for (int k = 1; k < 312; k++)
        g->x[k] = 6364136223846793005ull * (g->x[k - 1] ^ (g->x[k - 1] >> 62)) + (uint64_t)k;
    g->i = 312;
}

static uint64_t mt64_next(mt64 *g) {
    if (g->i == 312) {
        for (int k = 0; k < 312; k++) {
            uint64_t y = (g->x[k] & 0xffffffff80000000ull) | (g->x[(k + 1) % 312] & 0x7fffffffull);
            g->x[k] = g->x[(k + 156) % 312] ^ (y >> 1) ^ ((y & 1u) ? 0xb5026f5aa96619e9ull : 0ull);
        }
        g->i = 0;
    }
    uint64_t y = g->x[g->i++];
    y ^= (y >> 29) & 0x5555555555555555ull;
    y ^= (y << 17) & 0x71d67fffeda60000ull;
    y ^= (y << 37) & 0xfff7eee000000000ull;
    return y ^ (y >> 43);
}

/* helpers.cpp's get_target_sample_len: usually max_seq, short when the word is a multiple of ratio. */
static int64_t next_target(mt32 *g, uint32_t ratio, int64_t max_seq) {
    if (ratio == 0)
        return max_seq;  /* short_seq_prob 0: no draw at all */
    uint32_t r = mt32_next(g);
    return r % ratio == 0 ? 2 + (int64_t)(r % (uint32_t)(max_seq - 1)) : max_seq;
}

/* Rows (first sentence, end sentence, target) of the documents [first[d], last[d]) (global sentence
   numbers; only the usable ones: the caller drops those Megatron skips), epoch after epoch until
   there are at least num_samples, then shuffled. Returns the number of rows and sets *out to them
   (uint32 [rows, 3], malloc'd: release with compiled_walk_free); returns -1 if memory runs out. */
int64_t compiled_walk(const int32_t *sizes, const int64_t *first, const int64_t *last, int64_t documents,
                      int64_t num_samples, int64_t max_seq, int64_t min_sentences, uint32_t seed,
                      uint32_t ratio, uint64_t shuffle_seed, uint32_t **out) {
    int64_t rows = 0, capacity = 1024;
    uint32_t *row = malloc(3 * sizeof(uint32_t) * capacity);
    mt32 draws;
    mt32_seed(&draws, seed);
    while (row != NULL && rows < num_samples) {          /* one epoch per pass, never stopped inside */
        for (int64_t d = 0; d < documents; d++) {
            int64_t start = first[d], tokens = 0;
            int64_t target = next_target(&draws, ratio, max_seq);
            for (int64_t s = first[d]; s < last[d]; s++) {
                tokens += sizes[s];
                int64_t left = last[d] - 1 - s;           /* sentences after s */
                if ((tokens >= target && left > 1 && s + 1 - start >= min_sentences) || left == 0) {
                    if (rows == capacity) {
                        uint32_t *grown = realloc(row, 6 * sizeof(uint32_t) * capacity);
                        if (grown == NULL) {
                            free(row);
                            return -1;
                        }
                        row = grown;
                        capacity *= 2;
                    }
                    row[3 * rows] = (uint32_t)start;
                    row[3 * rows + 1] = (uint32_t)(s + 1);
                    row[3 * rows + 2] = (uint32_t)target;
                    rows++;
                    start = s + 1;
                    tokens = 0;
                    target = next_target(&draws, ratio, max_seq);  /* after every row, the last too */
                }
            }
        }
    }
    if (row == NULL)
        return -1;
    mt64 swaps;                                            /* Fisher-Yates, as helpers.cpp shuffles */
    mt64_seed(&swaps, shuffle_seed);
    for (int64_t i = rows - 1; i > 0; i--) {
        int64_t j = (int64_t)(mt64_next(&swaps) % (uint64_t)(i + 1));
        for (int c = 0; c < 3; c++) {
            uint32_t t = row[3 * i + c];
            row[3 * i + c] = row[3 * j + c];
            row[3 * j + c] = t;
        }
    }
    *out = row;
    return rows;
}

void compiled_walk_free(uint32_t *rows) { free(rows); }
