// Decode attention over the paged K/V pools, one pass with an online softmax.
#include "common.h"

enum { MAX_D = 256, MAX_G = 16 };

// One sequence b and one K/V head h: its G query heads against every slot of its blocks that holds context,
// in one pass (online softmax: a running maximum m, the sum l of exp(s - m), and the weighted values acc).
INLINE void one_head(int bf16, const void* q, const void* kp, const void* vp, const int64_t* ids,
                     const uint8_t* valid, int p0, int p1, int b, int h, int Hq, int Hkv, int D, int bs,
                     void* out) {
  int G = Hq / Hkv;
  float qv[MAX_G][MAX_D], acc[MAX_G][MAX_D], m[MAX_G], l[MAX_G], kv[MAX_D];
  float scale = 1.f / sqrtf((float)D);
  for (int g = 0; g < G; g++) {
    for (int d = 0; d < D; d++) {
      qv[g][d] = value(q, bf16, ((long)b * Hq + h * G + g) * D + d) * scale;
      acc[g][d] = 0.f;
    }
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  for (int p = p0; p < p1; p++)
    for (int t = 0; t < bs; t++) {
      if (!valid[(long)p * bs + t]) continue;
      long at = ((ids[p] * bs + t) * Hkv + h) * (long)D;  // this slot's row of head h
      for (int d = 0; d < D; d++) kv[d] = value(kp, bf16, at + d);
      float s[MAX_G];
      for (int g = 0; g < G; g++) {  // 16 partial sums: independent chains the compiler vectorizes
        float part[16] = {0};
        int d0 = 0;
        for (; d0 + 16 <= D; d0 += 16)
          for (int j = 0; j < 16; j++) part[j] += qv[g][d0 + j] * kv[d0 + j];
        for (int d = d0; d < D; d++) part[d - d0] += qv[g][d] * kv[d];
        float dot = 0.f;
        for (int j = 0; j < 16; j++) dot += part[j];
        s[g] = dot;
      }
      for (int d = 0; d < D; d++) kv[d] = value(vp, bf16, at + d);
      for (int g = 0; g < G; g++) {
        if (s[g] > m[g]) {  // a new maximum: what was summed so far shrinks by exp(old - new)
          float c = expf(m[g] - s[g]);
          l[g] *= c;
          for (int d = 0; d < D; d++) acc[g][d] *= c;
          m[g] = s[g];
        }
        float e = expf(s[g] - m[g]);
        l[g] += e;
        for (int d = 0; d < D; d++) acc[g][d] += e * kv[d];
      }
    }
  for (int g = 0; g < G; g++)
    for (int d = 0; d < D; d++)
      put(out, bf16, ((long)b * Hq + h * G + g) * D + d, l[g] > 0 ? acc[g][d] / l[g] : 0.f);
}

// one_head for each dtype, compiled for AVX-512, AVX2 and plain x86-64; the loader picks what this CPU runs
#define CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#define HEADS(name, bf16)                                                                          \
  CLONES static void name(const void* q, const void* kp, const void* vp, const int64_t* ids,      \
                          const uint8_t* valid, int p0, int p1, int b, int h, int Hq, int Hkv,     \
                          int D, int bs, void* out) {                                              \
    one_head(bf16, q, kp, vp, ids, valid, p0, p1, b, h, Hq, Hkv, D, bs, out);                     \
  }
HEADS(heads_f32, 0)
HEADS(heads_bf16, 1)

// out [B, Hq, D] = attention of q [B, Hq, D] (one query per decoding sequence) over the K/V pools
// [blocks, bs, Hkv, D] through the blocks each sequence reads: ids [P] sequence after sequence, row [P] the
// sequence of each, valid [P, bs] which of its slots hold context. float32 or bfloat16 throughout (`bf16`).
// Returns 0, -1 where memory ran out, -2 for a shape past MAX_D / MAX_G.
int attn_decode(int bf16, const void* q, const void* kp, const void* vp, const int64_t* ids,
                const int64_t* row,
                const uint8_t* valid, int P, int B, int Hq, int Hkv, int D, int bs, void* out, int threads) {
  if (D > MAX_D || Hq / Hkv > MAX_G || Hq % Hkv) return -2;
  int* start = calloc((size_t)B + 1, sizeof(int));  // sequence b reads blocks start[b] .. start[b + 1] - 1
  if (!start) return -1;
  for (int p = 0; p < P; p++) start[row[p] + 1] = p + 1;
  for (int b = 0; b < B; b++)
    if (start[b + 1] < start[b]) start[b + 1] = start[b];  // a sequence without blocks
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1) collapse(2)
  for (int b = 0; b < B; b++)
    for (int h = 0; h < Hkv; h++)
      (bf16 ? heads_bf16 : heads_f32)(q, kp, vp, ids, valid, start[b], start[b + 1], b, h, Hq, Hkv, D, bs,
                                      out);
  free(start);
  return 0;
}

// 0 where the kernel agrees with a two-pass softmax in double on a small batch: 3 sequences of 9, 4 and 1
// tokens in blocks of 4 scattered over a pool of 8, 4 query heads on 2 K/V heads of 16 dimensions.
int attn_selftest(int isa) {
  enum { NB = 8, BS = 4, HQ = 4, HKV = 2, D = 16, B = 3, P = 5 };
  static float kp[NB * BS * HKV * D], vp[NB * BS * HKV * D], q[B * HQ * D], out[B * HQ * D];
  static const int64_t ids[P] = {6, 1, 3, 0, 5}, row[P] = {0, 0, 0, 1, 2};
  static const int lens[B] = {9, 4, 1};
  static uint8_t valid[P * BS];
  (void)isa;
  for (int i = 0; i < NB * BS * HKV * D; i++) {
    kp[i] = ((i * 7) % 19 - 9) / 8.f;
    vp[i] = ((i * 5) % 23 - 11) / 4.f;
  }
  for (int i = 0; i < B * HQ * D; i++) q[i] = ((i * 3) % 13 - 6) / 4.f;
  for (int p = 0, b = 0, seen = 0; p < P; p++) {
    if (p && row[p] != row[p - 1]) b++, seen = 0;
    for (int t = 0; t < BS; t++) valid[p * BS + t] = seen + t < lens[b];
    seen += BS;
  }
  if (attn_decode(0, q, kp, vp, ids, row, valid, P, B, HQ, HKV, D, BS, out, 2)) return 2;
  for (int b = 0, p0 = 0; b < B; p0 += (lens[b] + BS - 1) / BS, b++)
    for (int hq = 0; hq < HQ; hq++) {
      int h = hq / (HQ / HKV), n = lens[b];
      double s[16], m = -1e300, l = 0;
      for (int t = 0; t < n; t++) {
        long at = ((ids[p0 + t / BS] * BS + t % BS) * HKV + h) * D;
        s[t] = 0;
        for (int d = 0; d < D; d++)  // scaled by 1/sqrt(16)
          s[t] += (double)q[(b * HQ + hq) * D + d] * kp[at + d] / 4.0;
        m = s[t] > m ? s[t] : m;
      }
      for (int t = 0; t < n; t++) l += exp(s[t] - m);
      for (int d = 0; d < D; d++) {
        double want = 0;
        for (int t = 0; t < n; t++) {
          long at = ((ids[p0 + t / BS] * BS + t % BS) * HKV + h) * D;
          want += exp(s[t] - m) / l * vp[at + d];
        }
        if (fabs(out[(b * HQ + hq) * D + d] - want) > 1e-4) return 1;
      }
    }
  return 0;
}
