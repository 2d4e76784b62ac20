// A greedy row's shortlist from a bfloat16 pass over the LM head.
#include "common.h"

#define REL (1.01f / 256)  // bfloat16's rounding of a float32 sum: at most 2^-8 of the value, with room

// One row of bfloat16 scores: the largest score `hi`, then every column scoring at least
// hi - 2 * (base + REL * a), `a` the row's largest magnitude, into idx while fewer than k; returns how many
// (-1: a score is not finite). Blocks of 64 whose largest score is below the line are skipped whole.
__attribute__((target_clones("avx512f", "avx2", "default")))
static long shortlist_row(const uint16_t* z, long cols, float base, long k, int64_t* idx) {
  float hi = -INFINITY, lo = INFINITY;
  int bad = 0;
#pragma omp simd reduction(max : hi) reduction(min : lo) reduction(| : bad)
  for (long i = 0; i < cols; i++) {
    float f = value(z, 1, i);
    hi = f > hi ? f : hi;
    lo = f < lo ? f : lo;
    bad |= (z[i] & 0x7F80) == 0x7F80;  // exponent all ones: an infinity or a NaN
  }
  if (bad) return -1;
  float line = hi - 2.0f * (base + REL * fmaxf(fabsf(hi), fabsf(lo)));
  long n = 0;
  for (long s = 0; s < cols; s += 64) {
    long e = s + 64 < cols ? s + 64 : cols;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (long i = s; i < e; i++) {
      float f = value(z, 1, i);
      m = f > m ? f : m;
    }
    if (m < line) continue;
    for (long i = s; i < e; i++)
      if (value(z, 1, i) >= line) {
        if (n < k) idx[n] = i;
        n++;
      }
  }
  return n;
}

// Every row r of z [rows, cols]: its shortlist in idx[r * k ...], how many in count[r] (see above).
int head_shortlist(const uint16_t* z, int rows, int cols, const float* base, int k, int64_t* idx,
                   int64_t* count, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; r++)
    count[r] = shortlist_row(z + (long)r * cols, cols, base[r], k, idx + (long)r * k);
  return 0;
}

int head_selftest(int isa) {  // 2 + 1/8 leads, 2 is within the line, 1 is not; then a NaN row
  enum { C = 200, K = 4 };
  static uint16_t z[2 * C];
  int64_t idx[2 * K], count[2];
  float base[2] = {0.25f, 0.25f};
  (void)isa;
  for (int i = 0; i < 2 * C; i++) z[i] = 0x3F80;  // 1.0
  z[70] = 0x4002;   // 2.03125
  z[150] = 0x4000;  // 2.0: 2.03125 - 2 * (0.25 + REL * 2.03125) is about 1.5
  z[C + 9] = 0x7FC0;  // a NaN
  head_shortlist(z, 2, C, base, K, idx, count, 1);
  return !(count[0] == 2 && idx[0] == 70 && idx[1] == 150 && count[1] == -1);
}
