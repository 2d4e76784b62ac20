// Between the products: RMSNorm and rotary embeddings, one pass per row.
#include "common.h"

INLINE float to_bf16(float f) {  // f rounded to bfloat16 (to nearest, ties to even), as a float
  uint32_t u;
  memcpy(&u, &f, 4);
  u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
  memcpy(&f, &u, 4);
  return f;
}

// One row: y = w * dtype(x / sqrt(mean(x^2) + eps)), in float32, rounded to x's dtype twice as 01's RMSNorm
// rounds: after the normalization and after the weight. x, w and y float32, or bfloat16 (`bf16`).
__attribute__((target_clones("avx512f", "avx2", "default")))
static void norm_row(int bf16, const void* x, const void* w, float eps, int n, void* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < n; i++) {
    float v = value(x, bf16, i);
    ss += v * v;
  }
  float r = 1.f / sqrtf(ss / (float)n + eps);
  for (int i = 0; i < n; i++) {
    float v = value(x, bf16, i) * r;
    put(y, bf16, i, value(w, bf16, i) * (bf16 ? to_bf16(v) : v));
  }
}

// Every row of x [rows, n] into y [rows, n]; a batch of rows split over the threads.
int rmsnorm(int bf16, const void* x, const void* w, float eps, int rows, int n, void* y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
  for (int r = 0; r < rows; r++) {
    long at = (long)r * n * (bf16 ? 2 : 4);  // bytes to row r
    norm_row(bf16, (const char*)x + at, w, eps, n, (char*)y + at);
  }
  return 0;
}

// Rotary embeddings for T tokens: y [T, H, D] = x * cos + rotate_half(x) * sin (01's `apply_rotary`), each
// product and the sum rounded to x's dtype as PyTorch rounds them (no fused multiply-add), so the same bits.
// x: [T, H, D] with `stride` elements from one token to the next; cos, sin: [T, D].
INLINE float rounded(int bf16, float f) { return bf16 ? to_bf16(f) : f; }

INLINE void rotary_head(int bf16, const void* x, long o, int D, const void* c, const void* s, void* y) {
  int h2 = D / 2;
#pragma omp simd
  for (int i = 0; i < h2; i++)  // the first half turns with -x2
    put(y, bf16, o + i,
        rounded(bf16, value(x, bf16, o + i) * value(c, bf16, i)) +
            rounded(bf16, -value(x, bf16, o + i + h2) * value(s, bf16, i)));
#pragma omp simd
  for (int i = h2; i < D; i++)  // the second with x1
    put(y, bf16, o + i,
        rounded(bf16, value(x, bf16, o + i) * value(c, bf16, i)) +
            rounded(bf16, value(x, bf16, o + i - h2) * value(s, bf16, i)));
}

__attribute__((optimize("fp-contract=off"), target_clones("avx512f", "avx2", "default")))
static void rotary_token(int bf16, const void* x, int H, int D, const void* c, const void* s, void* y) {
  for (int h = 0; h < H; h++)  // the dtype a constant in each loop: both vectorize
    if (bf16)
      rotary_head(1, x, (long)h * D, D, c, s, y);
    else
      rotary_head(0, x, (long)h * D, D, c, s, y);
}

int rotary(int bf16, const void* x, int T, int stride, int H, int D, const void* c, const void* s, void* y,
           int threads) {
  int e = bf16 ? 2 : 4;  // bytes an element
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= 8)
  for (int t = 0; t < T; t++)
    rotary_token(bf16, (const char*)x + (long)t * stride * e, H, D, (const char*)c + (long)t * D * e,
                 (const char*)s + (long)t * D * e, (char*)y + (long)t * H * D * e);
  return 0;
}

int norm_selftest(int isa) {  // rows of 1/8-steps (exact squares and sums), against the same steps in double
  enum { R = 9, N = 40 };
  static float x[R * N], w[N], y[R * N];
  (void)isa;
  for (int i = 0; i < N; i++) w[i] = (i % 5 + 1) / 4.f;
  for (int i = 0; i < R * N; i++) x[i] = ((i * 7) % 17 - 8) / 8.f;
  rmsnorm(0, x, w, 1e-6f, R, N, y, 2);
  float c[4] = {0.5f, 0.25f, 0.5f, 0.25f}, s[4] = {0.75f, 1.f, 0.75f, 1.f}, z[8];
  float q[8] = {1, 2, 3, 4, 5, 6, 7, 8};  // two heads: (1, 2, 3, 4) -> (1/2 - 9/4, 1/2 - 4, 3/2 + 3/4, 1 + 2)
  rotary(0, q, 1, 8, 2, 4, c, s, z, 1);
  if (z[0] != -1.75f || z[1] != -3.5f || z[2] != 2.25f || z[3] != 3.f || z[4] != -2.75f) return 1;
  for (int r = 0; r < R; r++) {
    double ss = 0;
    for (int i = 0; i < N; i++) ss += (double)x[r * N + i] * x[r * N + i];
    double inv = 1 / sqrt(ss / N + 1e-6);
    for (int i = 0; i < N; i++) {
      double want = w[i] * x[r * N + i] * inv;
      if (fabs(y[r * N + i] - want) > 1e-5 * (1 + fabs(want))) return 1;
    }
  }
  return 0;
}
